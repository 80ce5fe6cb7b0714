"""A whole bench: make the workload, run every load point of the sweep, write the results.

specs = make_requests(WorkloadConfig(...), tokenizer)
report = asyncio.run(run_bench(BenchConfig(...), specs))
write_outputs(report, Path("out/run"))   # run.json, run.md, run-cdf.png, run-load.png
"""

import asyncio
import datetime
import math
import os
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import numpy as np

from loadtest import workloads
from loadtest.metrics import Cost, Slo, summarize
from loadtest.plots import report_plots
from loadtest.progress import Progress
from loadtest.report import BenchReport, RunRecord, markdown
from loadtest.runner import Load, run_workload
from loadtest.target import Target
from shared.errors import InvalidRequestError
from shared.tokenizer.tokenizer import Tokenizer

WORKLOADS = ("random", "shared-prefix", "sharegpt", "agent")
MAX_REQUESTS = 100_000  # per load point, whatever is asked


@dataclass(frozen=True)
class WorkloadConfig:
    """Which requests to send (the same list at every load point)."""

    kind: str = "random"  # one of WORKLOADS
    num_prompts: int = 100  # agent: unused (num_sessions x num_turns requests)
    input_len: str = "256"  # LengthDist text; shared-prefix: the tail; agent: each user turn
    output_len: str = "128"  # LengthDist text; sharegpt: "" keeps each reply's length
    prefix_len: int = 1024  # shared-prefix, agent: tokens of each common prompt
    num_prefixes: int = 1  # shared-prefix, agent: how many common prompts
    dataset: Path | None = None  # sharegpt: the JSON file
    seed: int = 0
    num_sessions: int = 8  # agent: sessions
    num_turns: int = 4  # agent: turns per session
    think_time_s: float = 0.0  # agent: a turn's completion to the next turn's send

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise InvalidRequestError("workload", f"must be one of {WORKLOADS}")
        if not 1 <= self.num_prompts <= MAX_REQUESTS:
            raise InvalidRequestError("num_prompts", f"must be in [1, {MAX_REQUESTS}]")
        if self.kind == "sharegpt" and self.dataset is None:
            raise InvalidRequestError("dataset", "the sharegpt workload needs --dataset FILE")
        if self.prefix_len < 1 or self.num_prefixes < 1:
            raise InvalidRequestError("prefix_len", "prefix_len and num_prefixes must be >= 1")
        if self.num_sessions < 1 or self.num_turns < 1:
            raise InvalidRequestError("num_sessions", "num_sessions and turns must be >= 1")
        if self.num_sessions * self.num_turns > MAX_REQUESTS:
            raise InvalidRequestError("num_sessions", f"sessions x turns must be <= {MAX_REQUESTS}")
        if not 0 <= self.think_time_s < math.inf:
            raise InvalidRequestError("think_time", "must be a finite number >= 0")

    def describe(self) -> str:
        if self.kind == "sharegpt":
            out = f", output {self.output_len}" if self.output_len else ""
            return f"sharegpt {Path(self.dataset).name}{out}, {self.num_prompts} requests"
        if self.kind == "agent":
            think = f", think time {self.think_time_s:g} s" if self.think_time_s else ""
            return (
                f"agent: {self.num_sessions} sessions x {self.num_turns} turns, "
                f"{self.num_prefixes} shared system prompt(s) of {self.prefix_len} tokens, "
                f"each turn + {self.input_len} user tokens, output {self.output_len} tokens"
                f"{think}, seed {self.seed}"
            )
        prefix = (
            f"{self.num_prefixes} shared prefixes of {self.prefix_len} tokens + "
            if self.kind == "shared-prefix"
            else ""
        )
        return (
            f"{self.kind}: {prefix}input {self.input_len}, output {self.output_len} tokens, "
            f"{self.num_prompts} requests, seed {self.seed}"
        )


def make_requests(
    cfg: WorkloadConfig, tokenizer: Tokenizer
) -> list[workloads.RequestSpec] | workloads.AgentWorkload:
    maker = workloads.PromptMaker(tokenizer, np.random.default_rng(cfg.seed))
    if cfg.kind == "sharegpt":
        fixed = int(cfg.output_len) if cfg.output_len else None
        return workloads.sharegpt_requests(maker, cfg.dataset, cfg.num_prompts, fixed)
    ins = workloads.LengthDist.parse(cfg.input_len)
    outs = workloads.LengthDist.parse(cfg.output_len)
    if cfg.kind == "agent":
        return workloads.agent_sessions(
            maker,
            cfg.num_sessions,
            cfg.num_turns,
            cfg.prefix_len,
            cfg.num_prefixes,
            ins,
            outs,
            cfg.think_time_s,
        )
    if cfg.kind == "shared-prefix":
        return workloads.shared_prefix_requests(
            maker, cfg.num_prompts, cfg.prefix_len, cfg.num_prefixes, ins, outs
        )
    return workloads.random_requests(maker, cfg.num_prompts, ins, outs)


@dataclass(frozen=True)
class BenchConfig:
    """How to run: the target, the sweep, the limits, SLOs and price."""

    target: Target
    loads: tuple[Load, ...]
    workload: str = ""  # a description for the report
    max_duration_s: float = 600.0  # per load point
    slo: Slo = Slo()
    cost: Cost | None = None
    label: str = ""
    seed: int = 0  # arrival times
    command: str = ""  # how it was started, for the report

    def __post_init__(self) -> None:
        if not self.loads:
            raise InvalidRequestError("loads", "give at least one request rate or concurrency")
        if not 0 < self.max_duration_s < math.inf:
            raise InvalidRequestError("max_duration_s", "must be a finite number > 0")


def sweep(rates: list[float], concurrencies: list[int], burstiness: float = 1.0) -> list[Load]:
    """Load points: rates (each capped by the one concurrency, if given), or concurrencies
    (each at the one rate, if given). Sweeping both at once is refused."""
    if len(rates) > 1 and len(concurrencies) > 1:
        raise InvalidRequestError("loads", "sweep request rates or concurrencies, not both")
    rates = rates or [math.inf]
    caps: list[int | None] = list(concurrencies) or [None]
    return [Load(r, c, burstiness) for r in rates for c in caps]


async def served_model(base_url: str) -> str:
    """The first model id the server lists at /v1/models."""
    root = base_url.rstrip("/")
    root = root if root.endswith("/v1") else root + "/v1"
    async with aiohttp.ClientSession() as http, http.get(root + "/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def run_bench(
    cfg: BenchConfig,
    specs: list[workloads.RequestSpec] | workloads.AgentWorkload,
    show_progress: bool = True,
) -> BenchReport:
    """Run every load point in turn and gather the report (an agent workload: sessions)."""
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    loadavg = round(os.getloadavg()[0], 2)  # other work on this host skews CPU-bound runs
    runs = []
    for i, load in enumerate(cfg.loads):
        bar = Progress(
            specs.num_requests if isinstance(specs, workloads.AgentWorkload) else len(specs),
            f"[{i + 1}/{len(cfg.loads)}] {load.label}",
            sys.stderr if show_progress else None,
        )
        out = await run_workload(cfg.target, specs, load, cfg.max_duration_s, cfg.seed, bar)
        bar.close()
        summary = summarize(out.results, out.duration_s, cfg.slo, cfg.cost)
        runs.append(RunRecord(load, summary, tuple(out.results)))
    meta = {
        "label": cfg.label,
        "target": cfg.target.base_url,
        "model": cfg.target.model,
        "api": cfg.target.api,
        "stream": cfg.target.stream,
        "workload": cfg.workload,
        "slo": asdict(cfg.slo),
        "cost": asdict(cfg.cost) if cfg.cost else None,
        "max_duration_s": cfg.max_duration_s,
        "started": started,
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": loadavg,
        "command": cfg.command,
    }
    return BenchReport(meta, tuple(runs))


def run_sync(coro):
    """Run a coroutine on a fresh event loop, uvloop's where installed (less client overhead)."""
    try:
        import uvloop
    except ImportError:  # not built for every platform
        return asyncio.run(coro)
    return uvloop.run(coro)


def write_outputs(report: BenchReport, prefix: Path, plots: bool = True) -> list[Path]:
    """`<prefix>.json`, `<prefix>.md` and the PNGs; returns the paths written."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = (
        prefix.with_name(prefix.name + ".json"),
        prefix.with_name(prefix.name + ".md"),
    )
    report.save(json_path)
    images = report_plots(report, prefix) if plots else []
    md_path.write_text(markdown(report, [str(p) for p in images]))
    return [json_path, md_path, *images]
