"""Pipeline benchmark: a steady decode load on a worker of shape (1, 2) with its two ranks pinned
to separate cores, beside (1, 1) on one core, in paired rounds (both built first, then measured
in turn, the order reversed each round). Reports each stage's utilisation (the seconds its rank
spends running its layers of a step, not blocked receiving the previous stage's hidden states,
over the wall time: the scheduler's Python and the plan messages count as idle) and decode
throughput. The pipeline must not starve: both stages >= 80% busy.

    python -m loadtest.bench_pipeline [--requests 16] [--steps 60] [--rounds 3] [--out results.json]
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from loadtest.paired import round_order
from loadtest.random_model import llama_fields, save_random_llama
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.sampling.params import SamplingParams

# ~80M parameters: compute per step well above the per-step Python overhead
MODEL = llama_fields(4096, 768, 3072, layers=8, heads=12, kv_heads=4)


def start(model_dir: Path, pp: int, requests: int, cores: list[int], pp_layers=None):
    """An engine of shape (1, pp), rank 0 on cores[0] and rank i on cores[i], decoding
    `requests` streams past their prefill and warm-up."""
    os.sched_setaffinity(0, {cores[0]})
    config = EngineConfig(
        model_dir=model_dir,
        dtype="float32",
        pp=pp,
        pp_layers=pp_layers,
        num_pages=requests * 40,
        page_size=16,
    )
    engine = LLMEngine(config)
    if pp > 1:
        for proc, core in zip(engine.executor.ranks.procs, cores[1:]):
            os.sched_setaffinity(proc.pid, {core})
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i in range(requests):
        engine.add_request(str(i), [3 + (i * 7 + j) % 4000 for j in range(32)], params)
    for _ in range(10):  # prefill and warm-up
        engine.step()
    return engine


def _measure(engine: LLMEngine, steps: int) -> dict:
    executor = engine.executor
    piped = hasattr(executor, "last_stage_busy_s")
    busy0, last0 = executor.runner.busy_s, getattr(executor, "last_stage_busy_s", 0.0)
    tokens, start = 0, time.perf_counter()
    for _ in range(steps):
        tokens += sum(len(s.new_token_ids) for s in engine.step())
    wall = time.perf_counter() - start
    result = {"tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens}
    result["utilisation"] = {"stage0": (executor.runner.busy_s - busy0) / wall}
    if piped:
        result["utilisation"]["stage1"] = (executor.last_stage_busy_s - last0) / wall
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds")
    parser.add_argument("--pp-layers", default=None, help="layers per stage, e.g. 5,3")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores to pin two pipeline ranks apart")
    split = tuple(int(n) for n in args.pp_layers.split(",")) if args.pp_layers else None
    runs: dict[str, list[dict]] = {"(1,1)": [], "(1,2)": []}
    with tempfile.TemporaryDirectory(prefix="tison-bench-pp-") as tmp:
        model_dir = Path(tmp)
        save_random_llama(model_dir, MODEL, torch.float32)
        engines = {"(1,1)": start(model_dir, 1, args.requests, cores[:1])}
        try:
            engines["(1,2)"] = start(model_dir, 2, args.requests, cores[:2], split)
            for r in range(args.rounds):  # both built first, measured in turn
                for name in round_order(list(engines), r):
                    runs[name].append(_measure(engines[name], args.steps))
        finally:
            for engine in engines.values():
                engine.close()
    speedups = sorted(p["tokens_per_s"] / s["tokens_per_s"] for s, p in zip(*runs.values()))
    busy = {
        stage: statistics.median(run["utilisation"][stage] for run in runs["(1,2)"])
        for stage in ("stage0", "stage1")
    }
    report = {"model": MODEL, "requests": args.requests, "pp_layers": args.pp_layers}
    report.update(runs)
    report["speedup"] = {"median": statistics.median(speedups), "min": speedups[0]}
    report["speedup"]["max"] = speedups[-1]
    report["utilisation_median"] = busy
    report["stages_busy_80pct"] = min(busy.values()) >= 0.8
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if report["stages_busy_80pct"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
