"""What a decode step costs beyond its fused C call, in this process: the engine's Python
(scheduling, writing the step's rows into the persistent inputs, the runner, the update) and
the calls around the one C call that runs every layer, the LM head and the greedy argmax.
Decode steps of bench_engine's model are timed whole, and the fused call inside each by a
wrapper on its C function (~0.3 us); the difference is what a batch-1 step's roofline share
loses to the host side. That Python runs on the caches the weights' stream has just flushed,
at ~2x its cost in a hot loop. Decode steps that do not run the fused call (none on the
bench models in bf16) are left out.

    python -m loadtest.bench_step_overhead [--model-kind moe] [--batch 1] [--rounds 3]
"""

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kernels.cpu import isa, library
from loadtest.bench_engine import MODELS, run_at_tier
from loadtest.decode_steps import prefill
from loadtest.random_model import save_random_llama
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.huge_pages import restart_with_huge_pages

FUSED = ("tk_decode_layers_bf16", torch.bfloat16)  # library.functions' key of the fused call


def timed_steps(engine: LLMEngine, batch: int, new_tokens: int, tag: str) -> list[tuple]:
    """(step seconds, seconds in the fused call) of each decode step of `batch` requests."""
    kernel, inside = library.functions[FUSED], []

    def fused(*args):
        start = time.perf_counter()
        try:
            return kernel(*args)
        finally:
            inside.append(time.perf_counter() - start)

    library.functions[FUSED] = fused
    try:
        prefill(engine, [[5] * 32] * batch, new_tokens, tag)
        steps = []
        while engine.has_unfinished():
            inside.clear()
            start = time.perf_counter()
            engine.step()
            if len(inside) == 1:
                steps.append((time.perf_counter() - start, inside[0]))
        return steps
    finally:
        library.functions[FUSED] = kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-kind", default="moe", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--isa", choices=isa.TIER_NAMES, help="run at this tier (TISON_CPU_ISA)")
    args = ap.parse_args()
    run_at_tier(args.isa)
    restart_with_huge_pages()  # as the `tison` command does
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        save_random_llama(folder, MODELS[args.model_kind], torch.bfloat16)
        config = EngineConfig(
            model_dir=folder, dtype="bfloat16", kv_cache_bytes=2 << 30, enable_prefix_caching=False
        )
        engine = LLMEngine(config)
        if engine.model.model.fused is None:
            raise SystemExit("no fused decode call here (no C kernels?): nothing to measure")
        gc.collect()
        gc.freeze()  # as a worker does once its engine is built
        steps = []
        for r in range(args.rounds):
            steps += timed_steps(engine, args.batch, args.new_tokens, f"round{r}")
        engine.close()
    step = statistics.median(s for s, _ in steps)
    call = statistics.median(c for _, c in steps)
    rest = statistics.median(s - c for s, c in steps)
    print(
        f"{args.model_kind}, batch {args.batch}, {len(steps)} decode steps: step "
        f"{step * 1e3:.3f} ms, the fused call {call * 1e3:.3f} ms, the rest {rest * 1e6:.0f} us "
        f"a step ({rest / step:.1%})"
    )


if __name__ == "__main__":
    main()
