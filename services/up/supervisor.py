"""Runs the children of `tison up`: starts them, forwards their output with a name prefix,
restarts any that dies, and on stop terminates them all (none is left orphaned: each child
gets SIGKILL from the kernel if this process dies first)."""

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.up.identities import NatsIdentities
from services.up.plan import ChildSpec, RestartPolicy
from shared.proc import child_setup, stop_processes

log = logging.getLogger("tison.up")


@dataclass
class Child:
    spec: ChildSpec
    proc: subprocess.Popen
    started_at: float
    restart_at: float | None = None  # set while waiting to restart
    last_error: str = ""  # its newest ERROR log line (read by _forward's thread)
    failed_with: str = ""  # the error it last exited with before running healthy


class StartupFailure(Exception):
    """A child failed twice in a row with the same error before it ran healthy: restarting it
    again would fail again (a bad flag, a missing file)."""

    def __init__(self, name: str, error: str):
        super().__init__(f"{name}: {error}")


class Supervisor:
    def __init__(
        self,
        specs: list[ChildSpec],
        nats_url: str,
        env: dict[str, str],
        policy: RestartPolicy | None = None,
        identities: NatsIdentities | None = None,  # on tison up's own nats-server
        on_line: Callable[[str, str], None] | None = None,  # (child, line) of its output
    ):
        self.specs, self.nats_url, self.env = specs, nats_url, env
        self.on_line = on_line
        self.identities = identities
        self.policy = policy or RestartPolicy()
        self.children: dict[str, Child] = {}

    def start_all(self) -> None:
        for spec in self.specs:
            self._start(spec)

    def _start(self, spec: ChildSpec) -> None:
        flags, env = self.identities.start(spec) if self.identities else ([], {})
        proc = subprocess.Popen(
            spec.argv(self.nats_url) + flags,
            env={**self.env, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=child_setup(spec.cores),
            start_new_session=True,  # Ctrl-C reaches `tison up` only; it stops children in order
        )
        before = self.children.get(spec.name)
        child = Child(
            spec, proc, time.monotonic(), failed_with=before.failed_with if before else ""
        )
        self.children[spec.name] = child
        forward = (child, proc.stdout, self.on_line)
        threading.Thread(target=_forward, args=forward, daemon=True).start()
        log.info("started %s (pid %d)", spec.name, proc.pid)

    def poll(self) -> None:
        """Restarts children that died, after their backoff; StartupFailure when one failed
        twice in a row with the same error before it ran healthy."""
        now = time.monotonic()
        for child in list(self.children.values()):
            code = child.proc.poll()
            if code is None:
                continue
            if child.restart_at is None:
                ran_for = now - child.started_at
                if ran_for >= self.policy.healthy_after_s:
                    child.failed_with = ""
                elif child.last_error:
                    if child.last_error == child.failed_with:
                        raise StartupFailure(child.spec.name, child.last_error)
                    child.failed_with = child.last_error
                delay = self.policy.delay(child.spec.name, ran_for)
                log.warning("%s exited with %s; restarting in %.0f s", child.spec.name, code, delay)
                child.restart_at = now + delay
            elif now >= child.restart_at:
                self._start(child.spec)

    def stop_all(self, timeout_s: float = 10.0) -> None:
        """SIGTERM to all (gateway first), then SIGKILL whatever is left after the timeout."""
        children = list(reversed(self.children.values()))
        killed = stop_processes([c.proc for c in children], timeout_s)
        for child in children:
            if child.proc in killed:
                log.warning("%s did not stop in %.0f s; killed it", child.spec.name, timeout_s)

    def pids(self) -> dict[str, int]:
        return {name: c.proc.pid for name, c in self.children.items() if c.proc.poll() is None}


def _forward(child: Child, stream, on_line) -> None:
    """The child's output on our stderr, each line prefixed with its name (and to on_line);
    keeps its newest ERROR line (logging's "<time> ERROR <logger>: <message>") for
    StartupFailure."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        sys.stderr.write(f"[{child.spec.name}] {line}")
        if on_line is not None:
            on_line(child.spec.name, line.rstrip("\n"))
        if " ERROR " in line:
            child.last_error = line.split(" ERROR ", 1)[1].split(": ", 1)[-1].strip()
    stream.close()


def child_env(kv_secret: str) -> dict[str, str]:
    """The children's environment: the KV transport's secret (in the environment, not argv)."""
    return dict(os.environ, PYTHONUNBUFFERED="1", TISON_KV_SECRET=kv_secret)
