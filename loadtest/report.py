"""A bench result file (JSON) and its Markdown rendering.

    {"schema": "tison-bench/1", "meta": {...}, "runs": [{"load", "summary", "requests"}, ...]}

`meta` describes the target, workload, SLOs and price; each run is one load point with its
summary and every request's timings, so any metric can be recomputed later.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from loadtest.metrics import Dist, RequestResult, Summary, ttft_by_turn
from loadtest.runner import Load
from shared.errors import InvalidRequestError

SCHEMA = "tison-bench/1"
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))


@dataclass(frozen=True)
class RunRecord:
    """One load point."""

    load: Load
    summary: Summary
    requests: tuple[RequestResult, ...]

    def to_json(self) -> dict:
        return {
            "load": self.load.to_json(),
            "summary": self.summary.to_json(),
            "requests": [r.to_json() for r in self.requests],
        }

    @classmethod
    def from_json(cls, body: dict) -> "RunRecord":
        return cls(
            Load.from_json(body["load"]),
            Summary.from_json(body["summary"]),
            tuple(RequestResult.from_json(r) for r in body["requests"]),
        )


@dataclass(frozen=True)
class BenchReport:
    """Every load point of one `tison bench run` (a sweep has several)."""

    meta: dict
    runs: tuple[RunRecord, ...]

    @property
    def label(self) -> str:
        return self.meta.get("label") or self.meta.get("target", "bench")

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "meta": self.meta, "runs": [r.to_json() for r in self.runs]}

    @classmethod
    def from_json(cls, body: dict) -> "BenchReport":
        if not isinstance(body, dict) or body.get("schema") != SCHEMA:
            raise InvalidRequestError("report", f"not a {SCHEMA} file")
        return cls(body["meta"], tuple(RunRecord.from_json(r) for r in body["runs"]))

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n")

    @classmethod
    def load(cls, path: Path) -> "BenchReport":
        try:
            body = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise InvalidRequestError("report", f"{path}: {e}") from None
        return cls.from_json(body)


def fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def summary_table(report: BenchReport) -> str:
    """One row per load point: throughput, goodput, the main percentiles, errors, cost."""
    head = ["load", "done", "req/s", "out tok/s", "goodput req/s"]
    head += [f"{name} {p}" for _, name in LATENCIES for p in ("p50", "p99")]
    head += ["$/M out tok", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in report.runs:
        s = run.summary
        errors = ", ".join(f"{k} {v}" for k, v in s.errors.items()) or "0"
        cells = [
            run.load.label,
            f"{s.completed}/{s.num_requests}",
            fmt(s.request_throughput, 2),
            fmt(s.output_throughput),
            fmt(s.goodput, 2),
            *(fmt(getattr(getattr(s, k), p)) for k, _ in LATENCIES for p in ("p50", "p99")),
            fmt(s.cost_per_m_output, 3),
            errors,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail_table(summary: Summary) -> str:
    """Mean and percentiles (ms) of every latency of one run."""
    lines = ["| ms | mean | p50 | p90 | p99 | n |", "|---|---|---|---|---|---|"]
    for key, name in LATENCIES:
        d: Dist = getattr(summary, key)
        cells = [fmt(d.mean, 2), fmt(d.p50, 2), fmt(d.p90, 2), fmt(d.p99, 2), str(d.count)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def turn_table(requests: tuple[RequestResult, ...]) -> str:
    """TTFT (ms) of the completed requests of each agent turn; "" when none has a turn."""
    by_turn = ttft_by_turn(list(requests))
    if not by_turn:
        return ""
    lines = ["| turn | TTFT mean | p50 | p90 | p99 | n |", "|---|---|---|---|---|---|"]
    for turn, d in by_turn.items():
        cells = [fmt(d.mean, 2), fmt(d.p50, 2), fmt(d.p90, 2), fmt(d.p99, 2), str(d.count)]
        lines.append(f"| {turn + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(meta: dict) -> list[str]:
    """Bullet lines of what was measured and how."""
    slo = meta.get("slo") or {}
    slos = [
        f"{k} ≤ {v} ms"
        for k, v in (
            ("TTFT", slo.get("ttft_ms")),
            ("TPOT", slo.get("tpot_ms")),
            ("E2E", slo.get("e2e_ms")),
        )
        if v is not None
    ]
    cost = meta.get("cost")
    lines = [
        f"- target: `{meta.get('target')}` model `{meta.get('model')}`, "
        f"{meta.get('api')} API, {'streaming' if meta.get('stream') else 'not streaming'}",
        f"- workload: {meta.get('workload')}",
        f"- SLOs for goodput: {', '.join(slos) or 'none'}",
        f"- host: {meta.get('host')} ({meta.get('cpu_count')} CPUs, load average "
        f"{meta.get('loadavg_at_start')} at start), started {meta.get('started')}",
    ]
    if cost:
        lines.append(f"- price: {cost['gpu_hour_cost']} per device-hour × {cost['num_devices']}")
    if meta.get("command"):
        lines.append(f"- command: `{meta['command']}`")
    return lines


def markdown(report: BenchReport, plots: list[str] = ()) -> str:
    """The whole report: what was run, the summary table, per-run details, plots."""
    parts = [f"# Bench: {report.label}", "", *describe(report.meta), "", summary_table(report)]
    parts += ["", "Latencies in ms; goodput counts requests meeting every SLO; ITL per token.", ""]
    if per_event := sum(run.summary.itl_per_event for run in report.runs):
        parts += [
            f"ITL of {per_event} requests is per event, not per token: the server sent several "
            "tokens an event and no running usage to count them.",
            "",
        ]
    for run in report.runs:
        parts += [f"## {run.load.label}", "", detail_table(run.summary), ""]
        if turns := turn_table(run.requests):
            parts += [turns, ""]
    parts += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(parts).rstrip() + "\n"
