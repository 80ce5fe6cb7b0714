"""Where `tison up`'s start-up time went, read from the log lines its children already write
(interpreter and imports, kernel builds, weight load, KV pool, serving) and from up's own
(children spawned, nats-server started). Pure and torch-free: `tison up` prints its summary
after "Tison is serving", and loadtest/startup.py tabulates the same phases over runs."""

import logging
import re
import time
from dataclasses import dataclass, field
from datetime import datetime

READY = "Tison is serving"
# "[child] 2026-12-01 11:58:36,904 INFO logger: message", or up's own line without "[child] "
LINE = re.compile(
    r"^(?:\[(?P<child>[\w-]+)\] )?(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (?P<msg>.*)$"
)
# (phase, pattern on the message); a "took" group is the duration the line reports, a "name"
# group the child the line is about (up's own lines)
PHASES = [
    ("spawned", re.compile(r"tison\.up: started (?P<name>[\w-]+) \(pid")),
    ("nats-server", re.compile(r"tison\.up: nats-server started in (?P<took>[\d.]+) s")),
    ("imports done", re.compile(r"process started (?P<took>[\d.]+) s ago")),
    ("kernels built", re.compile(r"kernels\.build: built \S+ in (?P<took>[\d.]+) s")),
    # shard.py's: "model loaded from disk in 1.00 s (...)", or "from weights peer ..."
    ("model loaded", re.compile(r"rank 0: model loaded (?:from .+? )?in (?P<took>[\d.]+) s")),
    # "KV pool of 64 pages (16 MiB) in 0.10 s", capped: "64 pages, chunked layers capped: ..."
    ("KV pool", re.compile(r"rank 0: KV pool of \d+ pages[^(]*\(\d+ MiB\) in (?P<took>[\d.]+) s")),
    ("serving", re.compile(r"(worker \S+ serving|gateway \S+ serving|scheduler up on)")),
    ("saw prefill", re.compile(r"prefill worker \S+ joined")),
    ("saw decode", re.compile(r"decode worker \S+ joined")),
]
_SUMMED = {"kernels built"}  # phases a child may log more than once: their durations add up


@dataclass
class StartupPhases:
    """When each (child, phase) was first seen and what its line says it took."""

    at: dict[tuple[str, str], float] = field(default_factory=dict)  # (child, phase) -> s
    took: dict[tuple[str, str], float] = field(default_factory=dict)  # (child, phase) -> s

    def record(self, line: str, launched: float, arrived_s: float) -> None:
        """Adds the phase this output line marks (if any). launched: time.time() at launch;
        arrived_s: seconds since launch the line arrived (used when its stamp is off)."""
        m = LINE.match(line)
        if m is None:
            return
        stamp = datetime.strptime(m["ts"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        at_s = stamp - launched
        if not -1 < at_s < arrived_s + 1:  # not this machine's local clock: when it arrived
            at_s = arrived_s
        for phase, pattern in PHASES:
            found = pattern.search(m["msg"])
            if found is None:
                continue
            child = found.groupdict().get("name") or m["child"] or "up"
            key = (child, phase)
            self.at.setdefault(key, at_s)  # a child's first such line (rank 0 of a worker)
            took = found.groupdict().get("took")
            if took and phase in _SUMMED:
                self.took[key] = self.took.get(key, 0.0) + float(took)
            elif took:
                self.took.setdefault(key, float(took))
            return

    def children(self) -> list[str]:
        """Children seen, in the order they were spawned (up itself first)."""
        names = {child for child, _ in self.at}
        return sorted(names, key=lambda c: (c != "up", self.at.get((c, "spawned"), 1e9), c))


def summary(phases: StartupPhases, ready_s: float) -> list[str]:
    """The lines `tison up` logs once serving: the ready time, then one line per child with
    what each phase took (seconds)."""
    nats = phases.took.get(("up", "nats-server"))
    lines = [f"start-up: ready {ready_s:.2f} s after launch"
             + (f"; nats-server started in {nats:.2f} s" if nats is not None else "")]  # fmt: skip
    for child in phases.children():
        if child == "up":
            continue
        lines.append(f"start-up: {child}: " + ", ".join(_child_parts(phases, child)))
    return lines


def _child_parts(phases: StartupPhases, child: str) -> list[str]:
    at, took = phases.at, phases.took
    parts = []
    if (child, "spawned") in at:
        parts.append(f"spawned at {at[(child, 'spawned')]:.2f}")
    if (child, "imports done") in took:
        parts.append(f"interpreter and imports {took[(child, 'imports done')]:.2f}")
    if (child, "model loaded") in took:  # kernels build on first use, within the load
        built = took.get((child, "kernels built"))
        kernels = "cached" if built is None else f"built in {built:.2f}"
        parts.append(f"kernels {kernels}")
        parts.append(f"weight load {took[(child, 'model loaded')]:.2f}")
    if (child, "KV pool") in took:
        parts.append(f"KV pool {took[(child, 'KV pool')]:.2f}")
    last = max((at[(child, p)] for p in ("KV pool", "imports done") if (child, p) in at),
               default=None)  # fmt: skip
    if (child, "serving") in at:
        serving = at[(child, "serving")]
        if last is not None:
            parts.append(f"warm-up and joining {max(serving - last, 0.0):.2f}")
        parts.append(f"serving at {serving:.2f}")
    return parts or ["no start-up lines seen"]


class PhaseLogHandler(logging.Handler):
    """Feeds `tison up`'s own log records (children spawned, nats-server started) to phases,
    formatted as its log lines are."""

    def __init__(self, phases: StartupPhases, launched: float):
        super().__init__()
        self.phases, self.launched = phases, launched
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.phases.record(self.format(record), self.launched, time.time() - self.launched)
