"""`tison prefill`, `tison decode`, `tison colocated`: model-running workers."""

import argparse
import functools
import os
from pathlib import Path

from services import nats_client
from services.cli.generate import (
    add_device_options,
    add_model_options,
    add_parallel_options,
    cpulist_arg,
    resolve_model,
)
from services.runtime import run_service
from services.worker.config import WEIGHTS_FROM, WorkerConfig
from services.worker.worker import run_worker
from shared.transfer.handoff import TRANSPORTS

D = WorkerConfig
HELP = {
    "prefill": "run a prefill worker (prompts -> KV pages of a decode worker)",
    "decode": "run a decode worker (reserved KV pages -> tokens)",
    "colocated": "run prefill and decode in one engine (the non-disaggregated baseline)",
}


def register(subparsers) -> None:
    for role, text in HELP.items():
        p = subparsers.add_parser(role, help=text)
        add_model_options(p)
        p.add_argument("--nats-url", default=os.environ.get("TISON_NATS_URL", D.nats_url))
        nats_client.add_flags(p)
        p.add_argument("--worker-id", default="")
        p.add_argument("--served-model-name", default="")
        p.add_argument("--kv-cache-bytes", type=int, default=D.kv_cache_bytes)
        p.add_argument(
            "--memory-bytes", type=int, default=None,
            help="each rank's memory: the KV pool takes what its weights and a 1 GiB reserve "
            "leave (as `tison plan --gpu cpu --memory` predicts); overrides --kv-cache-bytes",
        )  # fmt: skip
        p.add_argument("--num-pages", type=int, default=None, help="exact KV pool size (pages)")
        p.add_argument(
            "--no-prefix-caching", dest="prefix_caching", action="store_false",
            help="recompute every prompt (computed full pages are cached by default)",
        )  # fmt: skip
        p.add_argument("--page-size", type=int, default=D.page_size)
        p.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=0,
            help="token budget of a step (default: prefill 512, decode 2048, colocated 128: the "
            "most a prompt chunk makes running streams wait)",
        )
        p.add_argument("--max-num-seqs", type=int, default=D.max_num_seqs)
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--heartbeat", type=float, default=D.heartbeat_s, help="seconds")
        p.add_argument(
            "--reservation-lease", type=float, default=D.reservation_lease_s,
            help="seconds a decode reservation waits for its KV before its pages are freed",
        )  # fmt: skip
        p.add_argument(
            "--kv-transport", choices=TRANSPORTS, default=D.kv_transport,
            help="prefill: how KV reaches decode workers (auto: shm on one host, else tcp; "
            "dist: torch.distributed, chosen by name)",
        )  # fmt: skip
        p.add_argument("--kv-host", default=D.kv_host, help="address of the KV servers")
        p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
        p.add_argument(
            "--cpus",
            type=cpulist_arg,
            default=(),
            help="run on these cores (0-3,8), one thread per core; ranks split them",
        )
        p.add_argument(
            "--weights-from", choices=WEIGHTS_FROM, default=D.weights_from,
            help="disk: the --model folder's weights; peer: a running worker's of the same "
            "model (by served name) over TCP, authenticated with TISON_KV_SECRET; auto: disk "
            "if the folder exists, else a peer",
        )  # fmt: skip
        p.add_argument(
            "--weights-wait", type=float, default=D.weights_wait_s,
            help="seconds to wait for a peer to announce the model (--weights-from peer)",
        )  # fmt: skip
        p.add_argument(
            "--weights-timeout", type=float, default=D.weights_timeout_s,
            help="seconds a peer may send nothing in the middle of the weights before the "
            "load is given up (a stopped peer, a host cut off)",
        )  # fmt: skip
        p.add_argument(
            "--cache-dir", type=Path, default=D.cache_dir,
            help="the small files (config, tokenizer) of a model from a peer go under it",
        )  # fmt: skip
        add_parallel_options(p)
        add_device_options(p)
        p.add_argument("--log-level", default="INFO")
        p.set_defaults(func=functools.partial(main, role))


def main(role: str, args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    config = WorkerConfig(
        role=role,
        model_dir=Path(resolve_model(args.model)),
        dtype=args.dtype,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        resident_codec=args.resident_codec,
        nats_url=args.nats_url,
        nats=nats_client.NatsClientOptions.from_args(args),
        worker_id=args.worker_id,
        served_model_name=args.served_model_name,
        kv_cache_bytes=args.kv_cache_bytes,
        memory_bytes=args.memory_bytes,
        enable_prefix_caching=args.prefix_caching,
        num_pages=args.num_pages,
        page_size=args.page_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        heartbeat_s=args.heartbeat,
        reservation_lease_s=args.reservation_lease,
        kv_secret=os.environ.get("TISON_KV_SECRET", ""),
        kv_transport=args.kv_transport,
        kv_host=args.kv_host,
        tp=args.tp,
        pp=args.pp,
        pp_layers=args.pp_layers,
        ep=args.ep,
        dp=args.dp,
        allow_oversubscribe=args.allow_oversubscribe,
        cpus=args.cpus,
        weights_from=args.weights_from,
        weights_wait_s=args.weights_wait,
        weights_timeout_s=args.weights_timeout,
        cache_dir=args.cache_dir,
    )
    return run_service(functools.partial(run_worker, config), args.log_level)
