"""Comparing servers on a shared machine by paired, interleaved rounds: every round loads each
server in turn, in reverse order every other round (A B, B A, A B, ...), all of them started
beforehand and idle while another is loaded, so the machine's drift falls on all alike. A
ratio is the median of the per-round ratios, given with their spread.

    results = run_rounds([Side("a", target_a), Side("b", target_b)], specs, loads, rounds=3)
    spread = round_ratios(results["a"], results["b"], 0, lambda s: s.output_throughput)
"""

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from loadtest.metrics import Slo, Spread, Summary
from loadtest.report import BenchReport
from loadtest.runner import Load
from loadtest.scenarios.common import bench
from loadtest.target import Target
from loadtest.workloads import RequestSpec


@dataclass(frozen=True)
class Side:
    """One server under comparison."""

    name: str
    target: Target
    cpus: frozenset[int] | None = None  # where the load generator runs while loading it


def round_order(sides: list, round_index: int) -> list:
    """The sides in the order round `round_index` loads them: as given, then reversed."""
    return list(sides) if round_index % 2 == 0 else list(reversed(sides))


def run_rounds(
    sides: list[Side],
    specs: list[RequestSpec],
    loads: list[Load],
    rounds: int,
    workload: str = "",
    slo: Slo | None = None,
    command: str = "",
    max_duration_s: float = 300.0,
) -> dict[str, list[BenchReport]]:
    """Each load point, `rounds` times, on every side in round_order -> per side, one report a
    round (its runs: the load points)."""
    runs: dict[str, list[list]] = {s.name: [[] for _ in range(rounds)] for s in sides}
    meta: dict[str, dict] = {}
    cpus = os.sched_getaffinity(0)
    try:
        for load in loads:
            for r in range(rounds):
                for side in round_order(sides, r):
                    os.sched_setaffinity(0, side.cpus or cpus)
                    label = f"{side.name}, round {r + 1} of {rounds}"
                    report = bench(
                        side.target, specs, [load], label, workload, max_duration_s, slo, command
                    )
                    meta.setdefault(side.name, report.meta)
                    runs[side.name][r].append(report.runs[0])
    finally:
        os.sched_setaffinity(0, cpus)
    return {
        name: [BenchReport({**meta[name], "label": name}, tuple(rs)) for rs in per_round]
        for name, per_round in runs.items()
    }


def round_ratios(
    a: list[BenchReport],
    b: list[BenchReport],
    run: int,
    metric: Callable[[Summary], float | None],
) -> Spread | None:
    """b / a of `metric` at load point `run`, round by round -> their median and range; None
    when a round lacks the metric on either side (or it is 0 on a)."""
    ratios = []
    for ra, rb in zip(a, b, strict=True):
        va, vb = metric(ra.runs[run].summary), metric(rb.runs[run].summary)
        if va is None or vb is None or va == 0:
            return None
        ratios.append(vb / va)
    return Spread.of(ratios)


def median_of(reports: list[BenchReport], run: int, metric: Callable[[Summary], float | None]):
    """The median over rounds of `metric` at load point `run` (None if any round lacks it)."""
    values = [metric(r.runs[run].summary) for r in reports]
    return None if any(v is None for v in values) else statistics.median(values)


def sum_of(reports: list[BenchReport], run: int, metric: Callable[[Summary], int]) -> int:
    """The sum over rounds of a count at load point `run` (requests completed, sent, ...)."""
    return sum(metric(r.runs[run].summary) for r in reports)


def short_outputs(reports: list[BenchReport], run: int, specs: list[RequestSpec]) -> int:
    """Completed requests at load point `run`, over every round, that produced fewer tokens
    than they asked for (a server that stopped at an end-of-sequence token despite
    ignore_eos): their sides did not do the same work. A run's requests are the specs sent,
    in order."""
    return sum(
        r.ok and r.output_len < spec.max_tokens
        for report in reports
        for r, spec in zip(report.runs[run].requests, specs)
    )
