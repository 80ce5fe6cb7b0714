"""`tison up`: NATS, a scheduler, prefill and decode workers and a gateway on one machine."""

import argparse
import json
import logging
import secrets
import signal
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from services.cli.generate import (
    add_device_options,
    add_model_options,
    cpulist_arg,
    resolve_model,
)
from services.nats_client import TLS_ENV
from services.scheduler import routing
from services.up.identities import NatsIdentities, write_batch_password
from services.up.placement import MODES
from services.up.plan import UpConfig, placement, plan
from services.up.supervisor import StartupFailure, Supervisor, child_env
from shared.errors import ModelFolderError, TisonError, UnsupportedArchitectureError
from shared.models.registry import supported_architectures
from shared.nats_server import NatsServer, ServerTls
from shared.proc import process_age_s
from shared.startup_log import PhaseLogHandler, StartupPhases, summary
from shared.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("tison.up")


def register(subparsers) -> None:
    p = subparsers.add_parser("up", help="run the whole service on this machine")
    add_model_options(p)
    add_device_options(p)
    p.add_argument(
        "--gpus", type=int, default=0,
        help="GPUs the workers may use: with a GPU for every rank each worker gets its own, "
        "else they share the visible ones (default 0: share)",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument(
        "--mode",
        choices=MODES,
        default="auto",
        help="disaggregated prefill and decode workers, or colocated (one engine does both); "
        "auto: colocated only when the cores are too few for both",
    )
    p.add_argument(
        "--colocated", dest="mode", action="store_const", const="colocated", help="--mode colocated"
    )
    p.add_argument("--cores-prefill", type=cpulist_arg, default=(), help="CPUs of prefill workers")
    p.add_argument("--cores-decode", type=cpulist_arg, default=(), help="CPUs of decode workers")
    p.add_argument("--nats-url", default="", help="use this NATS instead of starting one")
    p.add_argument(
        "--nats-tls-cert", type=Path, default=None,
        help="the NATS server it starts speaks TLS only, with this certificate (PEM; valid for "
        "127.0.0.1 and the addresses other hosts use)",
    )  # fmt: skip
    p.add_argument("--nats-tls-key", type=Path, default=None, help="its private key (PEM)")
    p.add_argument(
        "--nats-tls-ca", type=Path, default=None,
        help="the CA that signed it, which the services trust (default: the certificate itself)",
    )  # fmt: skip
    p.add_argument(
        "--state-dir", type=Path, default=None, help="NATS JetStream store (default: a temp dir)"
    )
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads per worker, unpinned (no core plan)"
    )
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size of every worker")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages of every worker")
    p.add_argument(
        "--dp",
        type=int,
        default=None,
        help="data-parallel attention ranks of every worker (with --tp 1 --pp 1): each its own "
        "requests and KV pool, MoE experts spread whole over them",
    )
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-tp", type=int, default=None, help=f"{role} workers' --tp")
        p.add_argument(f"--{role}-pp", type=int, default=None, help=f"{role} workers' --pp")
        p.add_argument(f"--{role}-dp", type=int, default=None, help=f"{role} workers' --dp")
    p.add_argument(
        "--ep", action="store_true", help="every worker: MoE experts spread whole over its --tp"
    )
    p.add_argument(
        "--no-prefix-caching", dest="prefix_caching", action="store_false",
        help="every worker recomputes every prompt (full pages are cached by default)",
    )  # fmt: skip
    p.add_argument(
        "--allow-oversubscribe", action="store_true", help="workers may use more ranks than cores"
    )
    p.add_argument(
        "--routing",
        choices=routing.MODES,
        default=routing.KV,
        help="the scheduler's routing: kv (prefix-cache aware), load, round-robin",
    )
    p.add_argument(
        "--batch-max-share", type=float, default=None,
        help="the scheduler's --batch-max-share: of a decode pool, what batch requests may "
        "fill, in (0, 1] (default: the scheduler's)",
    )  # fmt: skip
    p.add_argument(
        "--batch-runners", type=int, default=None,
        help="the gateway's --batch-runners: batch lines it runs at once (default: its own)",
    )  # fmt: skip
    p.add_argument(
        "--tool-call-parser", default="auto",
        help="the gateway's tool-call format (see `tison gateway --help`; default: detected)",
    )  # fmt: skip
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    launched = time.time() - (process_age_s() or 0.0)  # the ready time counts our imports too
    phases = StartupPhases()
    log.addHandler(PhaseLogHandler(phases, launched))
    try:
        cfg = UpConfig(
            model_dir=Path(resolve_model(args.model)),
            dtype=args.dtype,
            device=args.device,
            gpus=args.gpus,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enforce_eager=args.enforce_eager,
            resident_codec=args.resident_codec,
            host=args.host,
            port=args.port,
            prefill_workers=args.prefill_workers,
            decode_workers=args.decode_workers,
            mode=args.mode,
            nats_url=args.nats_url,
            kv_cache_bytes=args.kv_cache_bytes,
            threads=args.threads,
            **_shapes(args),
            allow_oversubscribe=args.allow_oversubscribe,
            ep=args.ep,
            prefix_caching=args.prefix_caching,
            cores_prefill=args.cores_prefill,
            cores_decode=args.cores_decode,
            routing=args.routing,
            batch_max_share=args.batch_max_share,
            batch_runners=args.batch_runners,
            tool_call_parser=args.tool_call_parser,
        )
        check_model_folder(cfg.model_dir)
        tls = _server_tls(args)
        where = placement(cfg)
        _check_port_free(cfg.host, cfg.port)
    except (TisonError, ValueError, OSError) as e:
        print(f"tison up: {e}", file=sys.stderr)
        return 2
    for line in where.describe():
        log.info("placement: %s", line)
    stop = _stop_on_signals()
    with tempfile.TemporaryDirectory(prefix="tison-") as tmp:
        specs, nats, identities = plan(cfg, where), None, None
        if not cfg.nats_url:  # ours: a user per service, its password only in its env
            identities = NatsIdentities(specs)
            state = args.state_dir or Path(tmp) / "nats"
            nats = NatsServer(state, cores=where.services, users=identities.users(), tls=tls)
            started = time.perf_counter()
            identities.server = nats.start()
            log.info("nats-server started in %.2f s", time.perf_counter() - started)
            secret = write_batch_password(identities, state)
            log.info(
                "batch clients: tison batch submit FILE.jsonl --nats-url %s --nats-user batch "
                "--nats-password-file %s",
                nats.url,
                secret,
            )
        env = child_env(secrets.token_hex(16))
        if tls is not None:  # the services trust the server's certificate
            env[TLS_ENV["ca"]] = str(args.nats_tls_ca or tls.cert)

        def on_line(child: str, line: str) -> None:
            phases.record(f"[{child}] {line}", launched, time.time() - launched)

        url = cfg.nats_url or nats.url
        supervisor = Supervisor(specs, url, env, identities=identities, on_line=on_line)
        try:
            supervisor.start_all()
            return _serve(cfg, supervisor, nats, stop, args.ready_timeout, (phases, launched))
        except StartupFailure as e:
            print(f"tison up: {e}", file=sys.stderr)
            return 2
        finally:
            supervisor.stop_all()
            if nats is not None:
                nats.stop()
            log.info("stopped")


def _server_tls(args: argparse.Namespace) -> ServerTls | None:
    """TLS for the nats-server that `tison up` starts (the services then trust its CA)."""
    if args.nats_tls_cert is None and args.nats_tls_key is None:
        return None
    if args.nats_url:
        raise ValueError(
            "--nats-tls-cert: only for the NATS server tison up starts, not --nats-url"
        )
    if args.nats_tls_cert is None or args.nats_tls_key is None:
        raise ValueError("--nats-tls-cert and --nats-tls-key: give both")
    for flag, path in (
        ("--nats-tls-cert", args.nats_tls_cert),
        ("--nats-tls-key", args.nats_tls_key),
        ("--nats-tls-ca", args.nats_tls_ca),
    ):
        if path is not None and not path.is_file():
            raise ValueError(f"{flag}: no such file: {path}")
    return ServerTls(args.nats_tls_cert.resolve(), args.nats_tls_key.resolve())


def check_model_folder(model_dir: Path) -> None:
    """What every child reads first, read once here: a folder that cannot serve stops `tison
    up` with one error line, instead of children restarting on it. Torch-free: config.json's
    architecture against the registry, and the tokenizer."""
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
        arch = (raw.get("architectures") or [None])[0]
    except (OSError, ValueError, AttributeError) as e:
        raise ModelFolderError(str(path), f"unreadable ({e})") from None
    if arch not in supported_architectures():
        raise UnsupportedArchitectureError(str(arch), supported_architectures())
    Tokenizer.from_dir(model_dir)


def _shapes(args: argparse.Namespace) -> dict:
    """--prefill-tp etc., each defaulting to --tp/--pp/--dp, then 1."""
    shapes = {}
    for role in ("prefill", "decode"):
        for dim in ("tp", "pp", "dp"):
            value = getattr(args, f"{role}_{dim}")
            shapes[f"{role}_{dim}"] = value or getattr(args, dim) or 1
    return shapes


def _serve(
    cfg: UpConfig,
    supervisor: Supervisor,
    nats: NatsServer | None,
    stop: list,
    ready_timeout: float,
    startup: tuple[StartupPhases, float],  # (the phases seen, time.time() at launch)
) -> int:
    """Until stopped: restarts dead children and the nats-server it started (same port)."""
    url = f"http://{cfg.host}:{cfg.port}"
    deadline, ready = time.monotonic() + ready_timeout, False
    while not stop:
        if nats is not None and not nats.alive():
            log.warning("nats-server exited; restarting it on port %d", nats.port)
            try:
                nats.restart()
            except TisonError as e:  # the port was taken meanwhile: try again next round
                log.error("nats-server did not restart: %s", e)
        supervisor.poll()
        if not ready and _healthy(url):
            ready = True
            print(f"Tison is serving {cfg.model_dir.name} at {url}/v1 (Ctrl-C to stop)", flush=True)
            for line in summary(startup[0], time.time() - startup[1]):
                log.info("%s", line)
        elif not ready and time.monotonic() > deadline:
            log.error("not healthy after %.0f s", ready_timeout)
            return 1
        time.sleep(0.2)
    return 0


def _stop_on_signals() -> list:
    stop: list = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    return stop


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(f"{host}:{port} is in use ({e.strerror}); pick another --port") from None
