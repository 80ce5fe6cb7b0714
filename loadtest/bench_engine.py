"""Engine benchmark: batch-1 decode, batch-32 decode and prefill throughput of Tison's engine
beside Hugging Face transformers `generate` on the same random-weight ~150M Llama-shaped model
(transformers in its fastest dtype on this CPU), in paired rounds of the same run, and beside
this machine's memory-bandwidth roofline: at most batch x GB/s / the bytes a decode step reads
(roofline.py: linear weights, embedding rows, KV, logits) tokens/s, with GB/s measured just
before and after that very measure (the bandwidth of this shared machine drifts by 2x in
minutes) by a C read probe (membw.c) on the same threads. It prints the CPU tier each kernel
ran at; --isa runs it at a lower tier (as TISON_CPU_ISA does). `--model-kind moe` runs a
Mixtral-shaped mixture of experts of the same size instead, against its active-bytes roofline
(the experts a step's tokens chose, roofline.py). Once both models are built, the process's
objects are frozen out of the garbage collector's view, as a worker's are. `--tp`, `--pp`,
`--ep` and `--dp` run Tison's engine at that shape, its ranks sharing the `--threads` that
transformers and the probe run on (threads / ranks each, as an unpinned engine does; the
roofline stays the one-rank model's bytes a step). `--enforce-eager` decodes op by op (no fused
decoder call).

    python -m loadtest.bench_engine [--isa avx2] [--model-kind moe] [--threads 2] [--out f.json]
    python -m loadtest.bench_engine --model-kind moe --tp 2 [--enforce-eager]
"""

import argparse
import ctypes
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kernels.build import build_library
from kernels.cpu import isa, library
from loadtest.decode_steps import prefill
from loadtest.random_model import llama4_fields, llama_fields, mixtral_fields, save_random_llama
from loadtest.roofline import LlamaShape, mean_step_bytes
from shared.cpu_report import report as env_report
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.huge_pages import restart_with_huge_pages
from shared.models.layers.cpu_linear import onednn_bf16
from shared.sampling.params import SamplingParams

MODELS = {  # ~150M parameters each
    "dense": llama_fields(32000, 768, 2048, layers=16, heads=12, kv_heads=4),
    # 8 experts, top 2: ~140M parameters, ~48M read by a batch-1 decode step
    "moe": mixtral_fields(
        8, 2, vocab=32000, hidden=512, intermediate=1024, layers=8, heads=8, kv_heads=4
    ),
    # Scout's layout: 16 experts (top 1) and a shared one of 512 each, chunks of 64 tokens (a
    # decode crosses one); ~180M parameters, ~37M read by a batch-1 decode step
    "llama4": llama4_fields(
        16, 64, vocab=32000, hidden=512, intermediate=512, layers=8, heads=8, kv_heads=4
    ),
}
VOCAB = 32000  # both models'


@functools.cache
def read_probes() -> ctypes.CDLL:
    """membw.c built for the CPU's best tier (or the next that builds): read_xor (a buffer) and
    read_pages_xor (a list of pages)."""
    source = Path(__file__).with_name("membw.c")
    for tier in reversed(isa.tiers_up_to(isa.detected())):
        try:
            lib = ctypes.CDLL(str(build_library("tison_membw", [source], library.flags(tier))))
            break
        except OSError:
            continue
    else:
        raise OSError("cannot build loadtest/membw.c")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.read_xor.restype = ctypes.c_uint64
    lib.read_xor.argtypes = [ptr, i64, ctypes.c_int, ctypes.c_int]
    lib.read_pages_xor.restype = ctypes.c_uint64
    lib.read_pages_xor.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_int]
    return lib


PROBE_STREAMS = (1, 4)  # streams a thread the probe's passes read in turn (membw.c)


def memory_bandwidth_gbs(seconds: float = 2.0) -> float:
    """Read bandwidth on torch's threads: the best pass of the C probe over a 1 GiB buffer, its
    passes reading one stream a thread and four in turn (at least one of each)."""
    words = torch.ones(1 << 27, dtype=torch.int64)
    probe, threads = read_probes().read_xor, torch.get_num_threads()
    best, passes, end = 0.0, 0, time.perf_counter() + seconds
    while passes < len(PROBE_STREAMS) or time.perf_counter() < end:
        t = time.perf_counter()
        probe(words.data_ptr(), words.numel(), threads, PROBE_STREAMS[passes % len(PROBE_STREAMS)])
        best = max(best, words.nbytes / (time.perf_counter() - t) / 1e9)
        passes += 1
    return best


def prompts(batch: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, VOCAB, (batch, length), generator=g).tolist()


def tison_decode(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Decode tokens/s: tokens after the first of each request / time after all prefills."""
    prefill(engine, prompts(batch, prompt_len), new_tokens, f"d{batch}")
    start = time.perf_counter()
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(s.new_token_ids) for s in engine.step())
    return produced / (time.perf_counter() - start)


def tison_prefill(engine: LLMEngine, batch: int, prompt_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i, p in enumerate(prompts(batch, prompt_len)):
        engine.add_request(f"p{i}", p, params)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return batch * prompt_len / (time.perf_counter() - start)


class _StepClock:
    """A logits processor that only notes when generate asks for each token's logits."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def hf_decode(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Same measure for transformers, in one generate call: tokens after the first over the
    time from the first token's logits to the last's (the prefill excluded)."""
    from transformers import LogitsProcessorList

    ids = torch.tensor(prompts(batch, prompt_len))
    clock = _StepClock()
    kwargs = dict(do_sample=False, min_new_tokens=None, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(
            ids, max_new_tokens=new_tokens, logits_processor=LogitsProcessorList([clock]), **kwargs
        )
    return batch * (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])


def hf_prefill(model, batch: int, prompt_len: int) -> float:
    ids = torch.tensor(prompts(batch, prompt_len))
    with torch.inference_mode():
        t = time.perf_counter()
        model(ids, logits_to_keep=1)
        return batch * prompt_len / (time.perf_counter() - t)


def measure_round(
    engine, hf, prompt_len: int, new_tokens: int, flip: bool, threads: tuple[int, int]
) -> dict:
    """One round of every measure, Tison and transformers back to back (transformers first
    when `flip`, so rounds alternate A, B / B, A), each decode pair between two bandwidth
    readings: {name: (tison, transformers, GB/s around it or None for prefill)}. threads:
    Tison's rank 0's, then transformers' and the probe's."""
    p, n = prompt_len, new_tokens

    def on(count: int, fn, *args):
        torch.set_num_threads(count)
        try:
            return fn(*args)
        finally:
            torch.set_num_threads(threads[1])

    def pair(ours, theirs, *args):
        if flip:
            b = theirs(*args)
            return on(threads[0], ours, *args), b
        return on(threads[0], ours, *args), theirs(*args)

    result: dict[str, tuple] = {}
    for batch in (1, 32):
        before = memory_bandwidth_gbs(0.3)
        ours, theirs = pair(
            lambda b: tison_decode(engine, b, p, n), lambda b: hf_decode(hf, b, p, n), batch
        )
        gbs = (before + memory_bandwidth_gbs(0.3)) / 2
        result[f"batch-{batch} decode tok/s"] = (ours, theirs, gbs)
    ours, theirs = pair(lambda: tison_prefill(engine, 8, 512), lambda: hf_prefill(hf, 8, 512))
    result["prefill tok/s (8 x 512)"] = (ours, theirs, None)
    return result


def fastest_hf(folders: dict[str, Path], prompt_len: int):
    """(dtype name, model, {dtype: batch-32 tok/s}) of transformers' fastest dtype here: a
    short batch-32 decode in each (bfloat16 only where Tison runs oneDNN's bf16 matmuls:
    torch's own bf16 fallback is several times slower than float32, and oneDNN's on plain
    AVX-512 slower too)."""
    import transformers

    speeds, models = {}, {}
    for name, folder in folders.items():
        if name == "bfloat16" and not onednn_bf16():
            continue
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=name).eval()
        hf_decode(model, 32, prompt_len, 4)  # warm-up
        speeds[name], models[name] = hf_decode(model, 32, prompt_len, 12), model
    best = max(speeds, key=speeds.get)
    return best, models[best], speeds


def run_at_tier(tier: str | None) -> None:
    """With --isa: restart this process (the same command: this bench or another that calls
    this) with TISON_CPU_ISA (and torch's caps) set, so the kernels, torch, oneDNN and MKL all
    run at that tier from the first operation."""
    if tier is None or os.environ.get(isa.ENV_VAR) == tier:
        return
    os.environ[isa.ENV_VAR] = tier
    for cap in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        os.environ.pop(cap, None)
    isa.cap_torch()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", choices=isa.TIER_NAMES, help="run at this tier (TISON_CPU_ISA)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--prompt-len", type=int, default=32, help="decode measures: prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4, help="paired rounds (A, B / B, A ...)")
    ap.add_argument("--model-kind", default="dense", choices=sorted(MODELS))
    ap.add_argument("--tp", type=int, default=1, help="Tison's tensor-parallel ranks")
    ap.add_argument("--pp", type=int, default=1, help="Tison's pipeline stages")
    ap.add_argument("--ep", action="store_true", help="... holding whole experts")
    ap.add_argument("--dp", type=int, default=1, help="Tison's data-parallel attention ranks")
    ap.add_argument("--enforce-eager", action="store_true", help="Tison decodes op by op")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    fields = MODELS[args.model_kind]
    run_at_tier(args.isa)
    restart_with_huge_pages()  # as the `tison` command does: weights on 2 MiB pages
    torch.set_num_threads(args.threads)
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        folders = {name: Path(tmp) / name for name in ("bfloat16", "float32")}
        for name, folder in folders.items():
            save_random_llama(folder, fields, getattr(torch, name))
        # Every round sends the same prompts: with the prefix cache on, the rounds after the
        # first would find their prompts computed (prefill rows of 10-20x) and measure nothing.
        config = EngineConfig(
            model_dir=folders[args.dtype],
            dtype=args.dtype,
            kv_cache_bytes=2 << 30,
            enable_prefix_caching=False,
            tp=args.tp,
            pp=args.pp,
            ep=args.ep,
            dp=args.dp,
            allow_oversubscribe=True,
            decode_graphs="off" if args.enforce_eager else "auto",
        )
        engine = LLMEngine(config)
        tison_decode(engine, 1, 8, 4)  # warm-up
        threads = (torch.get_num_threads(), args.threads)  # rank 0's share, all
        torch.set_num_threads(args.threads)
        hf_dtype, hf, trial = fastest_hf(folders, args.prompt_len)
        # as a worker does once its engine is built (services/runtime.py freeze_heap): a full
        # garbage collection of both models' objects would stall a step by ~80 ms, for either
        gc.collect()
        gc.freeze()
        rounds = [
            measure_round(engine, hf, args.prompt_len, args.new_tokens, i % 2 == 1, threads)
            for i in range(args.rounds)
        ]
    facts = env_report()
    ranks = f"tp={args.tp} pp={args.pp}{' ep' if args.ep else ''} dp={args.dp}"
    ranks = f", {threads[0]} a rank of {ranks}" if args.tp * args.pp * args.dp > 1 else ""
    print(
        f"CPU: {facts['cpu']}, tier {facts['tier']} (of {', '.join(facts['tiers_runnable'])});"
        f" linear {facts['linear_kernel']}, other kernels at {facts['kernels_built_for']}, "
        f"fused decoder {'on' if engine.model.model.fused is not None else 'off'}; torch "
        f"{torch.__version__} at {facts['torch_cpu_capability']}, oneDNN bf16 "
        f"{'yes' if facts['onednn_bf16'] else 'no'}; {args.threads} threads{ranks}"
    )
    print(
        f"Model: {args.model_kind} ({hf.num_parameters() / 1e6:.0f}M parameters); "
        f"Tison in {args.dtype}; transformers {transformers.__version__} in {hf_dtype}, its "
        f"fastest here (batch-32 trial: "
        + ", ".join(f"{k} {v:.0f} tok/s" for k, v in trial.items())
        + f"); {args.rounds} paired rounds; decode after a {args.prompt_len}-token prompt, "
        f"{args.new_tokens} new tokens"
    )
    shape = LlamaShape.from_fields(fields)
    print_table(rounds, shape, args.prompt_len, args.new_tokens, torch.finfo(engine.dtype).bits)
    engine.close()  # its other ranks, if any
    if args.out:
        args.out.write_text(json.dumps({"facts": facts, "rounds": rounds}, indent=1))


def print_table(rounds: list[dict], shape: LlamaShape, prompt: int, new: int, bits: int) -> None:
    """Medians of the rounds for each side, the median of the per-round ratios with their
    range, and the median roofline share: tok/s over batch x GB/s / the bytes a decode step
    reads (roofline.py), each round against the bandwidth measured around it; beside it, the
    GB/s Tison read (its median tok/s x those bytes / batch) and the probe's range."""
    print(f"| {'measure':24} | {'Tison':>8} | {'transformers':>12} | ratio (range) | roofline |")
    print(f"|{'-' * 26}|{'-' * 10}|{'-' * 14}|---------------|----------|")
    for name in rounds[0]:
        ours, theirs = (statistics.median(r[name][i] for r in rounds) for i in (0, 1))
        ratios = [r[name][0] / r[name][1] for r in rounds]
        share = ""
        if rounds[0][name][2] is not None:
            batch = int(name.split()[0].removeprefix("batch-"))
            step = mean_step_bytes(shape, batch, prompt, new, bits // 8)
            shares = [r[name][0] / (batch * r[name][2] * 1e9 / step) for r in rounds]
            gbs = [r[name][2] for r in rounds]
            read = statistics.median(r[name][0] * step / batch / 1e9 for r in rounds)
            probe = f"{min(gbs):.0f}-{max(gbs):.0f}"
            share = f"{statistics.median(shares):.0%}: {read:.0f} GB/s of {probe}"
        spread = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        print(f"| {name:24} | {ours:8.1f} | {theirs:12.1f} | {spread:13} | {share} |")


if __name__ == "__main__":
    main()
