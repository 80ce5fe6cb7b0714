"""Processes a scenario starts: a NATS server and `tison` subcommands, each optionally pinned to
CPUs with `taskset -c`, logging to `<workdir>/<name>.log`, all stopped on exit.

    with Cluster(workdir) as c:
        c.nats()
        c.tison("scheduler", ["scheduler"])
        c.tison("decode", ["decode", "--model", str(model)], cpus="1")
        c.tison("gateway", ["gateway", "--model", str(model), "--port", str(port)])
        c.wait_healthy(url)
"""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from shared.errors import ProcessStartError
from shared.nats_server import NatsServer
from shared.proc import die_with_parent, stop_processes

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(cmd: list[str], cpus: str | None) -> list[str]:
    """`cmd` under `taskset -c cpus` when cpus are given and taskset exists."""
    if cpus is None:
        return cmd
    if shutil.which("taskset") is None:
        raise ProcessStartError("taskset not found (util-linux); cannot pin to CPUs " + cpus)
    return ["taskset", "-c", cpus, *cmd]


def http_status(url: str) -> int:
    """HTTP status of a GET (0 when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


class Cluster:
    """Owns the processes of one scenario step; a context manager that stops them all."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self._nats: NatsServer | None = None

    @property
    def nats_url(self) -> str:
        if self._nats is None:
            raise ProcessStartError("start the NATS server first")
        return self._nats.url

    def nats(self) -> str:
        """Start a NATS server; its URL."""
        self._nats = NatsServer(self.workdir / "nats").start()
        return self._nats.url

    def start(self, name: str, cmd: list[str], cpus: str | None = None, env=None) -> None:
        """Run `cmd` as process `name`."""
        log = open(self.workdir / f"{name}.log", "ab")
        full_env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", **(env or {}))
        self.procs[name] = subprocess.Popen(
            pinned(cmd, cpus),
            cwd=REPO_ROOT,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
        log.close()

    def tison(self, name: str, args: list[str], cpus: str | None = None, nats: bool = True):
        """Run `tison *args` (with `--nats-url` of this cluster's server when `nats`)."""
        tail = ["--nats-url", self.nats_url] if nats else []
        self.start(name, [sys.executable, "-m", "services.cli", *args, *tail], cpus)

    def up(self, model: Path, *flags: str) -> str:
        """`tison up` on `model` (its own NATS) on a free port; its URL once healthy. The
        process is procs["up"]."""
        port = free_port()
        self.tison("up", ["up", "--model", str(model), "--port", str(port), *flags], nats=False)
        url = f"http://127.0.0.1:{port}"
        self.wait_healthy(url + "/health")
        return url

    def wait_healthy(self, health_url: str, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while http_status(health_url) != 200:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise ProcessStartError(f"{name} exited with {proc.returncode}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise ProcessStartError(
                    f"{health_url} not healthy in {timeout_s} s:\n{self.logs()}"
                )
            time.sleep(0.2)

    def logs(self, tail_chars: int = 2000) -> str:
        parts = []
        for path in sorted(self.workdir.glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail_chars:]}")
        return "\n".join(parts)

    def stop_all(self, timeout_s: float = 20.0) -> None:
        """SIGTERM everything (SIGKILL after `timeout_s`), then the NATS server."""
        procs, self.procs = list(self.procs.values()), {}
        stop_processes(procs, timeout_s)
        if self._nats is not None:
            self._nats.stop()
            self._nats = None

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
