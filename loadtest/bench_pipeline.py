"""Pipeline benchmark: a steady decode load on a worker of shape (1, 2) with its two ranks pinned
to separate cores, beside (1, 1) on one core, in the same run. Reports each stage's utilisation
(busy time / wall time, where idle is the time a rank sits blocked receiving) and decode
throughput. The pipeline must not starve: both stages >= 80% busy.

    python -m loadtest.bench_pipeline [--requests 16] [--steps 60] [--out results.json]
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from loadtest.random_model import llama_fields, save_random_llama
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.sampling.params import SamplingParams

# ~80M parameters: compute per step well above the per-step Python overhead
MODEL = llama_fields(4096, 768, 3072, layers=8, heads=12, kv_heads=4)


def run_shape(
    model_dir: Path, pp: int, requests: int, steps: int, cores: list[int], pp_layers=None
) -> dict:
    """Decode tokens/s and per-rank utilisation over `steps` steady-state engine steps."""
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
    try:
        if pp > 1:
            for proc, core in zip(engine.executor.ranks.procs, cores[1:]):
                os.sched_setaffinity(proc.pid, {core})
        params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        for i in range(requests):
            engine.add_request(str(i), [3 + (i * 7 + j) % 4000 for j in range(32)], params)
        for _ in range(10):  # prefill and warm-up
            engine.step()
        return _measure(engine, steps)
    finally:
        engine.close()


def _measure(engine: LLMEngine, steps: int) -> dict:
    executor = engine.executor
    comm = getattr(executor, "comm", None)
    wait0 = comm.wait_s if comm else 0.0
    last0 = getattr(executor, "last_stage_wait_s", 0.0)
    tokens, start = 0, time.perf_counter()
    for _ in range(steps):
        tokens += sum(len(s.new_token_ids) for s in engine.step())
    wall = time.perf_counter() - start
    result = {"tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens}
    if comm is not None:
        rank0 = 1 - (comm.wait_s - wait0) / wall
        last = 1 - (executor.last_stage_wait_s - last0) / wall
        result["utilisation"] = {"stage0": rank0, "stage1": last}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--pp-layers", default=None, help="layers per stage, e.g. 5,3")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores to pin two pipeline ranks apart")
    with tempfile.TemporaryDirectory(prefix="tison-bench-pp-") as tmp:
        model_dir = Path(tmp)
        save_random_llama(model_dir, MODEL, torch.float32)
        single = run_shape(model_dir, 1, args.requests, args.steps, cores[:1])
        split = tuple(int(n) for n in args.pp_layers.split(",")) if args.pp_layers else None
        piped = run_shape(model_dir, 2, args.requests, args.steps, cores[:2], split)
    report = {"model": MODEL, "requests": args.requests, "pp_layers": args.pp_layers}
    report.update({"(1,1)": single, "(1,2)": piped})
    report["speedup"] = piped["tokens_per_s"] / single["tokens_per_s"]
    report["stages_busy_80pct"] = min(piped["utilisation"].values()) >= 0.8
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if report["stages_busy_80pct"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
