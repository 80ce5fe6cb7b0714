"""PNG plots of bench results: latency CDFs, and throughput / goodput / tail latency against
offered load. Each takes labelled results so one report and a comparison share the code."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadtest.report import BenchReport, RunRecord  # noqa: E402

CDF_PANELS = (("TTFT", "ttft"), ("inter-token latency", "itl"), ("end-to-end latency", "e2e"))


def _latencies_ms(run: RunRecord, key: str) -> np.ndarray:
    done = [r for r in run.requests if r.ok]
    if key == "ttft":
        values = [r.ttft_s for r in done]
    elif key == "itl":
        values = [gap for r in done for gap in r.itl_s]
    else:
        values = [r.latency_s for r in done]
    return np.sort(np.asarray(values, dtype=np.float64) * 1000.0)


def plot_cdfs(runs: list[tuple[str, RunRecord]], path: Path, title: str) -> Path:
    """One panel per latency, one line per labelled run; log-scale milliseconds (linear for a
    panel with no value above 0)."""
    fig, axes = plt.subplots(1, len(CDF_PANELS), figsize=(15, 4.2), constrained_layout=True)
    for ax, (name, key) in zip(axes, CDF_PANELS, strict=True):
        positive = False  # a log axis needs a value above 0 (one-token runs have no gaps)
        for label, run in runs:
            ms = _latencies_ms(run, key)
            if len(ms):
                ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post", label=label)
                positive = positive or bool((ms > 0).any())
        if positive:
            ax.set_xscale("log")
        ax.set(title=name, xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
        ax.axhline(0.99, color="grey", lw=0.6, ls=":")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _load_axis(report: BenchReport) -> str:
    finite = [r.load.rate for r in report.runs if np.isfinite(r.load.rate)]
    return "request rate (req/s)" if finite else "concurrent requests"


def plot_load(reports: list[BenchReport], path: Path, title: str) -> Path:
    """Output tokens/s, goodput (or requests/s without SLOs) and p99 TTFT / ITL against load."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
    has_slo = any(run.summary.goodput is not None for rep in reports for run in rep.runs)
    for rep in reports:
        x = [run.load.offered for run in rep.runs]
        s = [run.summary for run in rep.runs]
        axes[0].plot(x, [v.output_throughput for v in s], "o-", label=rep.label)
        axes[1].plot(x, [v.request_throughput for v in s], "o--", label=f"{rep.label} req/s")
        if has_slo:
            axes[1].plot(x, [v.goodput or 0 for v in s], "o-", label=f"{rep.label} goodput")
        axes[2].plot(x, [v.ttft.p99 for v in s], "o-", label=f"{rep.label} TTFT p99")
        axes[2].plot(x, [v.itl.p99 for v in s], "s--", label=f"{rep.label} ITL p99")
    axes[0].set(title="output throughput", ylabel="tokens/s")
    axes[1].set(title="goodput and throughput" if has_slo else "throughput", ylabel="requests/s")
    axes[2].set(title="tail latency", ylabel="ms", yscale="log")
    for ax in axes:
        ax.set_xlabel(_load_axis(reports[0]))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def report_plots(report: BenchReport, prefix: Path) -> list[Path]:
    """`<prefix>-cdf.png` (every load point) and `<prefix>-load.png` (sweeps only)."""
    runs = [(run.load.label, run) for run in report.runs]
    paths = [plot_cdfs(runs, Path(f"{prefix}-cdf.png"), f"{report.label}: latency CDFs")]
    if len(report.runs) > 1:
        paths.append(plot_load([report], Path(f"{prefix}-load.png"), f"{report.label}: vs load"))
    return paths


def compare_plots(a: BenchReport, b: BenchReport, prefix: Path) -> list[Path]:
    """CDFs of A and B at each one's heaviest load point, and both against load."""
    runs = [
        (f"A {a.label} ({a.runs[-1].load.label})", a.runs[-1]),
        (f"B {b.label} ({b.runs[-1].load.label})", b.runs[-1]),
    ]
    paths = [plot_cdfs(runs, Path(f"{prefix}-cdf.png"), "A vs B: latency CDFs")]
    if len(a.runs) > 1 or len(b.runs) > 1:
        paths.append(plot_load([a, b], Path(f"{prefix}-load.png"), "A vs B: vs load"))
    return paths
