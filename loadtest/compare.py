"""Two bench results side by side: each metric of A, of B, B/A and which is better. Pure."""

from dataclasses import dataclass

from loadtest.metrics import Summary
from loadtest.report import BenchReport, fmt


@dataclass(frozen=True)
class Metric:
    """A number read from a Summary; `higher_is_better` decides the "better" column."""

    name: str
    path: tuple[str, ...]  # attribute names from the Summary
    higher_is_better: bool

    def of(self, summary: Summary) -> float | None:
        value = summary
        for attr in self.path:
            value = getattr(value, attr)
        return value


METRICS = (
    Metric("requests/s", ("request_throughput",), True),
    Metric("output tokens/s", ("output_throughput",), True),
    Metric("goodput req/s", ("goodput",), True),
    *(
        Metric(f"{name} {p} ms", (key, p), False)
        for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))
        for p in ("p50", "p99", "mean")
    ),
    Metric("$/M output tokens", ("cost_per_m_output",), False),
)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return b / a


def better(metric: Metric, a: float | None, b: float | None) -> str:
    if a is None or b is None or a == b:
        return ""
    return "B" if (b > a) == metric.higher_is_better else "A"


def compare_runs(a: Summary, b: Summary) -> list[tuple[str, float | None, float | None]]:
    """(metric, A, B) for every metric either side measured."""
    rows = [(m.name, m.of(a), m.of(b)) for m in METRICS]
    return [row for row in rows if row[1] is not None or row[2] is not None]


def compare_table(a: BenchReport, b: BenchReport) -> str:
    """Markdown: one table per load point, matched by position in the sweep."""
    parts = [f"A: {a.label}", f"B: {b.label}", ""]
    for run_a, run_b in zip(a.runs, b.runs):
        loads = (
            run_a.load.label
            if run_a.load == run_b.load
            else (f"A {run_a.load.label} / B {run_b.load.label}")
        )
        parts += [f"### {loads}", "", "| metric | A | B | B/A | better |", "|---|---|---|---|---|"]
        by_name = {m.name: m for m in METRICS}
        for name, va, vb in compare_runs(run_a.summary, run_b.summary):
            r = ratio(va, vb)
            cells = [
                name,
                fmt(va, 2),
                fmt(vb, 2),
                "–" if r is None else f"{r:.2f}x",
                better(by_name[name], va, vb),
            ]
            parts.append("| " + " | ".join(cells) + " |")
        parts.append("")
    if len(a.runs) != len(b.runs):
        parts.append(
            f"(A has {len(a.runs)} load points, B {len(b.runs)}: compared the first "
            f"{min(len(a.runs), len(b.runs))})"
        )
    return "\n".join(parts).rstrip() + "\n"
