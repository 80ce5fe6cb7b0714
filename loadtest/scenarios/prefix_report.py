"""The prefix-cache scenario's configurations, tables and files (scenarios.prefix_cache).

Figures of a configuration are medians over the paired rounds; a ratio to cache-off is the
median of the per-round ratios with their range (loadtest.paired).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtest.metrics import ttft_by_turn
from loadtest.paired import median_of, round_ratios, sum_of
from loadtest.report import BenchReport, fmt
from loadtest.scenarios.common import md_table, save
from loadtest.scenarios.prefix_counters import PrefixUse

CONFIGS = {  # name -> (label, `tison up` flags)
    "kv": ("cache on, --routing kv", ("--routing", "kv")),
    "off": ("cache off (--no-prefix-caching)", ("--no-prefix-caching",)),
    "rr": ("cache on, --routing round-robin", ("--routing", "round-robin")),
    "plain": ("tison up defaults", ()),
}
BASELINE = "off"
NO_REUSE_SKIPS = ("rr",)  # configurations the no-reuse workload is not run on
TARGET_TTFT_RATIO, TARGET_HIT_RATE, TARGET_NO_REUSE_RATIO = 0.3, 0.8, 1.1


@dataclass(frozen=True)
class Measured:
    """One load on one configuration: the bench report and what the cache counters moved."""

    report: BenchReport
    use: PrefixUse


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def median_use(runs: list[Measured], field: str) -> float | None:
    values = [getattr(m.use, field) for m in runs]
    return None if any(v is None for v in values) else float(np.median(values))


def rows_of(results: dict, kind: str) -> list[list[str]]:
    """A row per configuration: medians over the rounds, ratios to cache-off."""
    base = [m.report for m in results[BASELINE][kind]] if BASELINE in results else None
    rows = []
    for name, by_kind in results.items():
        runs = by_kind[kind]
        if not runs:
            continue
        reports = [m.report for m in runs]
        ratios = [
            round_ratios(base, reports, 0, metric) if base and name != BASELINE else None
            for metric in (lambda s: s.ttft.p50, lambda s: s.ttft.p99)
        ]
        done = sum_of(reports, 0, lambda s: s.completed)
        sent = sum_of(reports, 0, lambda s: s.num_requests)
        rows.append(
            [
                CONFIGS[name][0],
                fmt(median_of(reports, 0, lambda s: s.ttft.p50)),
                fmt(median_of(reports, 0, lambda s: s.ttft.p99)),
                *("–" if s is None else str(s) for s in ratios),
                pct(median_use(runs, "hit_rate")),
                fmt(median_use(runs, "computed_tokens"), 0).replace("–", "n/a"),
                f"{done}/{sent}",
            ]
        )
    return rows


def turn_rows(results: dict, turns: int) -> list[list[str]]:
    """TTFT p50 of each agent turn, median over the rounds."""
    rows = []
    for name, by_kind in results.items():
        per_round = [ttft_by_turn(list(m.report.runs[0].requests)) for m in by_kind["agent"]]
        cells = []
        for t in range(turns):
            values = [d[t].p50 for d in per_round if t in d and d[t].p50 is not None]
            cells.append(fmt(float(np.median(values))) if values else "–")
        rows.append([CONFIGS[name][0], *cells])
    return rows


def targets(results: dict) -> list[list[str]]:
    def ratio(kind: str) -> float | None:
        if "kv" not in results or BASELINE not in results:
            return None
        base = [m.report for m in results[BASELINE][kind]]
        spread = round_ratios(
            base, [m.report for m in results["kv"][kind]], 0, lambda s: s.ttft.p50
        )
        return None if spread is None else spread.median

    hit = median_use(results["kv"]["agent"], "hit_rate") if "kv" in results else None
    checks = [
        ("agent TTFT p50, kv / cache off", ratio("agent"), f"<= {TARGET_TTFT_RATIO}x", "x"),
        ("agent prefix hit rate, kv", hit, f">= {TARGET_HIT_RATE:.0%}", "%"),
        ("no-reuse TTFT p50, kv / cache off", ratio("random"), f"<= {TARGET_NO_REUSE_RATIO}x", "x"),
    ]
    bounds = (TARGET_TTFT_RATIO, TARGET_HIT_RATE, TARGET_NO_REUSE_RATIO)
    rows = []
    for (what, value, target, unit), bound in zip(checks, bounds):
        if value is None:
            rows.append([what, "n/a", target, "n/a"])
            continue
        ok = value <= bound if unit == "x" else value >= bound
        shown = pct(value) if unit == "%" else f"{value:.2f}x"
        rows.append([what, shown, target, "met" if ok else "MISSED"])
    return rows


def write(results: dict, args, workload: str, out: Path) -> str:
    """Every report, prefix_cache.json and prefix_cache.md; the Markdown."""
    for name, by_kind in results.items():
        for kind, runs in by_kind.items():
            for r, m in enumerate(runs):
                save(m.report, out, f"{name}-{kind}-round{r + 1}")
    head = ["configuration", "TTFT p50 ms", "TTFT p99 ms", "p50 / cache off", "p99 / cache off"]
    head += ["prefix hit rate", "prefill tokens computed", "ok"]
    parts = [
        "# Prefix caching: agent workload",
        "",
        f"- {workload}; {args.rounds} paired rounds",
        f"- `tison up`: prefill workers {args.prefill_workers}, decode workers "
        f"{args.decode_workers}",
        f"- command: `{args.command}`",
        "",
        md_table(head, rows_of(results, "agent")),
        "",
        "TTFT p50 ms by turn:",
        "",
        md_table(
            ["configuration", *(f"turn {t + 1}" for t in range(args.turns))],
            turn_rows(results, args.turns),
        ),
        "",
        "No-reuse (random prompts of the agent turns' lengths):",
        "",
        md_table(head, rows_of(results, "random")),
        "",
        md_table(["target", "value", "bound", ""], targets(results)),
    ]
    text = "\n".join(parts) + "\n"
    (out / "prefix_cache.md").write_text(text)
    body = {
        "command": args.command,
        "workload": workload,
        "configs": {
            name: {
                "label": CONFIGS[name][0],
                "flags": list(CONFIGS[name][1]),
                **{
                    k: [
                        {"summary": m.report.runs[0].summary.to_json(), "prefix": m.use.to_json()}
                        for m in runs
                    ]
                    for k, runs in by_kind.items()
                },
            }
            for name, by_kind in results.items()
        },
        "targets": [
            dict(zip(("target", "value", "bound", "verdict"), r)) for r in targets(results)
        ],
    }
    (out / "prefix_cache.json").write_text(json.dumps(body, indent=1) + "\n")
    return text
