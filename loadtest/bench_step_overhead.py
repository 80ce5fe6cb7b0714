"""What a decode step costs beyond its fused C call, in this process: the engine's Python
(scheduling, writing the step's rows into the persistent inputs, the runner, the update) and
the calls around the one C call that runs every layer, the LM head and the greedy argmax.
Decode steps of bench_engine's model are timed whole, and the fused call inside each by a
wrapper on its C function (~0.3 us); the difference is what a batch-1 step's roofline share
loses to the host side. That Python runs on the caches the weights' stream has just flushed,
at ~10x its cost in a hot loop (the dense model at batch 1 on a Zen 4, 12-07: ~20 us a step
with the call left out, 180-210 us beside it), so each torch or numpy call it leaves out
saves tens of us. Decode steps that do not run the fused call (none on the bench models in
bf16) are left out.

With --ops the fused call runs from a build that times its ops (decode_layer.c's
-DTISON_OP_TIMES: thread 0 marks the end of each op, which every thread reaches at the
team's barrier), and where the call's time goes is printed by op, summed over every layer.

    python -m loadtest.bench_step_overhead [--model-kind moe] [--batch 1] [--rounds 3] [--ops]
"""

import argparse
import ctypes
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
OP_SECONDS = ("tk_op_seconds", torch.bfloat16)
# decode_layer.c's ops in its order: norm is every RMSNorm (the final one too), rope the
# rotation (with q/k norms), experts the routing and routed experts (and the shared expert's
# sum), head the LM head's rows and linear
OPS = (
    "embed", "norm", "qkv", "rope", "kv write", "attention", "o", "all-reduce", "gate_up",
    "act", "down", "experts", "head", "argmax",
)  # fmt: skip


def timed_op_build() -> dict:
    """The C kernels of the loaded library's tier built with -DTISON_OP_TIMES."""
    kernels = library.load_kernels(library.built_tier(), ("-DTISON_OP_TIMES",))
    if kernels is None or kernels[OP_SECONDS](None, 0) != len(OPS):
        raise SystemExit("the C kernels do not build with -DTISON_OP_TIMES")
    return kernels


def op_table(steps: list[tuple]) -> str:
    """Each op's mean ms a step and share of the fused call, over the steps' op seconds; and
    the call's time outside its ops (scratch, the team's start and end)."""
    call = statistics.mean(c for _, c, _ in steps)
    lines = ["| op | ms a step | of the call |", "|---|---|---|"]
    for i, name in enumerate(OPS):
        mean = statistics.mean(ops[i] for _, _, ops in steps)
        if mean > 0:
            lines.append(f"| {name} | {mean * 1e3:.3f} | {mean / call:.1%} |")
    rest = call - statistics.mean(sum(ops) for _, _, ops in steps)
    lines.append(f"| outside the ops | {rest * 1e3:.3f} | {rest / call:.1%} |")
    return "\n".join(lines)


def timed_steps(
    engine: LLMEngine, batch: int, new_tokens: int, tag: str, op_seconds=None
) -> list[tuple]:
    """(step seconds, seconds in the fused call, its ops' seconds or None) of each decode step of
    `batch` requests; op_seconds: the timed build's tk_op_seconds, read after each step."""
    kernel, inside = library.functions[FUSED], []
    ops = (ctypes.c_double * len(OPS))()

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
            if op_seconds is not None:
                op_seconds(ops, len(OPS))  # from 0
            start = time.perf_counter()
            engine.step()
            took = time.perf_counter() - start
            if len(inside) == 1:
                if op_seconds is not None:
                    op_seconds(ops, len(OPS))
                steps.append((took, inside[0], list(ops) if op_seconds is not None else None))
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
    ap.add_argument("--ops", action="store_true", help="time each op inside the fused call")
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
        op_seconds = None
        if args.ops:
            timed = timed_op_build()
            library.functions[FUSED], op_seconds = timed[FUSED], timed[OP_SECONDS]
        gc.collect()
        gc.freeze()  # as a worker does once its engine is built
        steps = []
        for r in range(args.rounds):
            steps += timed_steps(engine, args.batch, args.new_tokens, f"round{r}", op_seconds)
        engine.close()
    step = statistics.median(s for s, _, _ in steps)
    call = statistics.median(c for _, c, _ in steps)
    rest = statistics.median(s - c for s, c, _ in steps)
    print(
        f"{args.model_kind}, batch {args.batch}, {len(steps)} decode steps: step "
        f"{step * 1e3:.3f} ms, the fused call {call * 1e3:.3f} ms, the rest {rest * 1e6:.0f} us "
        f"a step ({rest / step:.1%})"
    )
    if args.ops:
        print(op_table(steps))


if __name__ == "__main__":
    main()
