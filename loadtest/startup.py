"""Start-up time of `tison up`: launch → the "Tison is serving" line (gateway /health 200), with
a per-phase breakdown taken from the children's log lines. Each run starts `tison up` on a free
port, waits for it to be ready and stops it; a warm-up run first (it may compile the kernels)
is left out of the figures, which are the median and range over the runs.

    python -m loadtest.startup [--runs 5] [--warmup 1] [--model DIR] [--out FILE.json]

Times are seconds since launch, from each line's log timestamp (the line's arrival when it has
none); "took" is the duration the line itself reports (imports, model load, KV pool).
"""

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.scenarios.cluster import REPO_ROOT, free_port
from shared.proc import die_with_parent, stop_processes
from shared.startup_log import READY, StartupPhases


@dataclass
class Run:
    ready_s: float | None = None  # launch → READY (None: not ready before the timeout)
    cpu_s: float = 0.0  # CPU seconds of the whole process tree, launch to stopped
    phases: StartupPhases = field(default_factory=StartupPhases)
    lines: list[str] = field(default_factory=list)

    @property
    def at(self) -> dict[tuple[str, str], float]:  # (child, phase) → s since launch
        return self.phases.at

    @property
    def took(self) -> dict[tuple[str, str], float]:  # (child, phase) → s
        return self.phases.took


def record(run: Run, line: str, launched: float, arrived_s: float) -> None:
    """Adds the phase this output line marks (if any) to the run (shared/startup_log)."""
    run.phases.record(line, launched, arrived_s)


def start_up(model: str | None, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(port)]
    if model:
        cmd += ["--model", model]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
        start_new_session=True,
    )


def run_once(model: str | None, timeout_s: float) -> Run:
    """One `tison up` from launch to ready; stops it (SIGINT, as Ctrl-C would) afterwards."""
    run = Run()
    cpu_before = _children_cpu_s()
    launched, start = time.time(), time.monotonic()
    proc = start_up(model, free_port())
    try:
        signal.signal(signal.SIGALRM, lambda *_: proc.kill())  # readline cannot time out
        signal.alarm(int(timeout_s))
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            run.lines.append(line)
            arrived_s = time.monotonic() - start
            if READY in line:
                run.ready_s = arrived_s
                break
            record(run, line, launched, arrived_s)
    finally:
        signal.alarm(0)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        stop_processes([proc], timeout_s=15)
        proc.stdout.close()
    run.cpu_s = _children_cpu_s() - cpu_before
    return run


def _children_cpu_s() -> float:
    """User + system CPU seconds of the reaped children (`tison up` reaps its own)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):5.2f} ({min(values):.2f}-{max(values):.2f})"


def table(runs: list[Run]) -> str:
    """One row per (child, phase) seen: when (s since launch) and what the line says it took."""
    keys = sorted(
        {k for r in runs for k in r.at}, key=lambda k: (min(r.at.get(k, 1e9) for r in runs), k)
    )
    rows = ["| child | phase | at (s since launch) | took (s) |", "|---|---|---|---|"]
    for key in keys:
        at = [r.at[key] for r in runs if key in r.at]
        took = [r.took[key] for r in runs if key in r.took]
        rows.append(f"| {key[0]} | {key[1]} | {spread(at)} | {spread(took)} |")
    ready = [r.ready_s for r in runs if r.ready_s is not None]
    rows.append(f"| up | **ready** (/health 200) | **{spread(ready)}** | |")
    rows.append(f"| all | CPU s, launch to stopped | {spread([r.cpu_s for r in runs])} | |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="measured runs")
    ap.add_argument("--warmup", type=int, default=1, help="runs first, not counted")
    ap.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait per run")
    ap.add_argument("--out", type=Path, default=None, help="also write the runs as JSON here")
    args = ap.parse_args()
    runs = []
    for i in range(args.warmup + args.runs):
        load = os.getloadavg()[0]  # other work on this host skews the figures
        run = run_once(args.model, args.timeout)
        counted = i >= args.warmup
        ready = "not ready" if run.ready_s is None else f"ready in {run.ready_s:.2f} s"
        print(f"run {i + 1}{'' if counted else ' (warm-up)'}: {ready}, load {load:.2f} before")
        if run.ready_s is None:
            print("\n".join(run.lines[-40:]), file=sys.stderr)
            return 1
        if counted:
            runs.append(run)
    print(f"\n{os.cpu_count()} CPUs; median (range) over {len(runs)} runs\n")
    print(table(runs))
    if args.out is not None:
        body = [
            {"ready_s": r.ready_s, "cpu_s": r.cpu_s, "at": _flat(r.at), "took": _flat(r.took)}
            for r in runs
        ]
        args.out.write_text(json.dumps(body, indent=1))
    return 0


def _flat(d: dict[tuple[str, str], float]) -> dict[str, float]:
    return {f"{child}: {phase}": v for (child, phase), v in d.items()}


if __name__ == "__main__":
    sys.exit(main())
