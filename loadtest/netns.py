"""Test hosts on one machine: a network namespace per host, each with one link (a veth pair) to
a switch (a bridge in a namespace of its own), addresses in a private /24 no interface here uses.
This process joins the switch too (the `client` address), so it dials every host directly.

    with Network() as net:
        a, b = net.add_host("prefill"), net.add_host("decode")
        subprocess.Popen(a.command(["python", "-m", ...]))
        b.limit(mbit=1000)        # tc tbf, both directions of b's link
        b.cut(); b.heal()         # its link down, then up
        b.counters()              # (rx_bytes, tx_bytes) of its interface

Each host's /etc/hosts (`ip netns exec` mounts /etc/netns/<ns>/hosts over it) names every host,
as Compose's DNS does for service names. Everything is removed on exit, after a failure too; a
run killed before that is cleaned up by the next one (namespace names carry the owner's pid).
Needs root and iproute2: `unavailable()` says why not, for a test's skip."""

import ipaddress
import itertools
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

PREFIX = "tsn-"  # every namespace this module makes: tsn-<owner pid, hex>x<n>-<host>
NETNS_ETC = Path("/etc/netns")
_RUN_DIR = Path("/run/netns")
_COUNT = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why this machine cannot make test hosts, or None when it can."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    probe = f"{PREFIX}{os.getpid():x}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    ns: str
    address: str
    dev: str  # its end of the link, inside ns
    port: str  # the switch's end
    switch: str  # the switch's namespace

    def command(self, argv: list[str]) -> list[str]:
        """argv run inside this host."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def counters(self) -> tuple[int, int]:
        """(bytes received, bytes sent) on this host's interface."""
        info = json.loads(_ip("-n", self.ns, "-s", "-j", "link", "show", "dev", self.dev).stdout)
        stats = info[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    def cut(self) -> None:
        """Unplug the link at the switch: packets are lost both ways, no connection is reset."""
        _ip("-n", self.switch, "link", "set", self.port, "down")

    def heal(self) -> None:
        _ip("-n", self.switch, "link", "set", self.port, "up")

    def limit(self, mbit: float) -> None:
        """A token bucket of `mbit` Mbit/s on both directions of the link."""
        rate = int(mbit * 1e6)
        burst = max(256 * 1024, rate // 8 // 200)  # above a GSO packet; ~5 ms of the rate
        for ns, dev in ((self.ns, self.dev), (self.switch, self.port)):
            tc = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate}bit"]
            subprocess.run(
                ["ip", "netns", "exec", ns, *tc, "burst", str(burst), "latency", "100ms"],
                check=True,
                capture_output=True,
            )

    def unlimit(self) -> None:
        for ns, dev in ((self.ns, self.dev), (self.switch, self.port)):
            subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                capture_output=True,
            )


class Network:
    """A switch and the hosts on it; owns every namespace, link and hosts file it made."""

    def __init__(self):
        clean_stale()
        self.tag = f"{os.getpid():x}x{next(_COUNT)}"  # interface names stay under 16 bytes
        self.switch = f"{PREFIX}{self.tag}-switch"
        self.subnet = _free_subnet()
        self.hosts: dict[str, Host] = {}
        self._addresses = self.subnet.hosts()
        self.client = ""  # this process's address on the switch
        self._root_dev = f"t{self.tag}r"

    def __enter__(self) -> "Network":
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            self.client = str(next(self._addresses))
            port = f"t{self.tag}rs"
            _ip(
                "link",
                "add",
                self._root_dev,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                self.switch,
            )
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("addr", "add", f"{self.client}/{self.subnet.prefixlen}", "dev", self._root_dev)
            _ip("link", "set", self._root_dev, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_host(self, name: str) -> Host:
        """A new host on the switch, its link up; every host's hosts file names it."""
        i = len(self.hosts)
        ns = f"{PREFIX}{self.tag}-{name}"
        dev, port = f"t{self.tag}h{i}", f"t{self.tag}s{i}"
        address = str(next(self._addresses))
        _ip("netns", "add", ns)
        _ip("link", "add", dev, "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("link", "set", dev, "netns", ns)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", dev)
        _ip("-n", ns, "link", "set", dev, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        host = Host(name, ns, address, dev, port, self.switch)
        self.hosts[name] = host
        self.name_hosts({})
        return host

    def name_hosts(self, aliases: dict[str, str]) -> None:
        """Write every host's /etc/hosts: localhost, each host's name, and `aliases` (name ->
        host name) the way Compose's DNS answers a service's name."""
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{h.address} {h.name}" for h in self.hosts.values()]
        lines += [f"{self.hosts[target].address} {alias}" for alias, target in aliases.items()]
        for host in self.hosts.values():
            folder = NETNS_ETC / host.ns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("\n".join(lines) + "\n")

    def close(self) -> None:
        for host in self.hosts.values():
            _remove_namespace(host.ns)
        self.hosts = {}
        _ip("link", "del", self._root_dev, check=False)
        _remove_namespace(self.switch)


def _remove_namespace(ns: str) -> None:
    _ip("netns", "del", ns, check=False)  # its veth ends go with it, and their peers
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def clean_stale() -> None:
    """Remove the namespaces and hosts files of runs that died (this side's link to a switch
    goes with the switch's namespace)."""
    names = {p.name for p in _RUN_DIR.glob(f"{PREFIX}*")} if _RUN_DIR.exists() else set()
    names |= {p.name for p in NETNS_ETC.glob(f"{PREFIX}*")} if NETNS_ETC.exists() else set()
    for ns in names:
        try:
            owner = int(ns[len(PREFIX) :].split("x")[0], 16)
        except ValueError:
            continue
        if not Path(f"/proc/{owner}").exists():
            _remove_namespace(ns)


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.250-254.x.0/24 that no address or route of this namespace overlaps."""
    taken = []
    for line in (
        _ip("-o", "-4", "addr").stdout.splitlines() + _ip("-4", "route").stdout.splitlines()
    ):
        for word in line.split():
            try:
                taken.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    start = os.getpid() % 1250
    for k in range(1250):
        n = (start + k) % 1250
        candidate = ipaddress.ip_network(f"10.{250 + n // 250}.{n % 250}.0/24")
        if not any(candidate.overlaps(t) for t in taken if t.prefixlen > 0):
            return candidate
    raise RuntimeError("no free 10.250-254.x.0/24 subnet for test hosts")
