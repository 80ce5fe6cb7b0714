"""Engine benchmark: batch-1 decode, batch-32 decode and prefill throughput of Tison's engine
beside Hugging Face transformers `generate` on the same random-weight ~150M Llama-shaped model,
in the same run, and beside this machine's memory-bandwidth roofline: a decode step reads every
weight once, so at most batch x GB/s / weight bytes tokens/s, with GB/s measured just before
and after that very measure (the bandwidth of this shared machine drifts by 2x in minutes) by
a C read probe (membw.c) on the same threads.

    python -m loadtest.bench_engine [--dtype bfloat16] [--threads 2] [--out results.json]
"""

import argparse
import ctypes
import functools
import json
import tempfile
import time
from pathlib import Path

import torch

from loadtest.random_model import llama_fields, save_random_llama
from shared import cpu_isa
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.huge_pages import restart_with_huge_pages
from shared.models.layers import cpu_kernels
from shared.native_build import build_library
from shared.sampling.params import SamplingParams

MODEL = llama_fields(32000, 768, 2048, layers=16, heads=12, kv_heads=4)  # ~150M parameters


@functools.cache
def _read_probe():
    """membw.c's read_xor, built for the CPU's best tier (or the next that builds)."""
    source = Path(__file__).with_name("membw.c")
    for tier in reversed(cpu_isa.tiers_up_to(cpu_isa.detected())):
        try:
            path = build_library("tison_membw", [source], cpu_kernels.flags(tier))
            fn = ctypes.CDLL(str(path)).read_xor
            break
        except OSError:
            continue
    else:
        raise OSError("cannot build loadtest/membw.c")
    fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return fn


def memory_bandwidth_gbs(seconds: float = 2.0) -> float:
    """Read bandwidth on torch's threads: the best pass of the C probe over a 1 GiB buffer."""
    words = torch.ones(1 << 27, dtype=torch.int64)
    probe, threads = _read_probe(), torch.get_num_threads()
    best, end = 0.0, time.perf_counter() + seconds
    while best == 0.0 or time.perf_counter() < end:
        t = time.perf_counter()
        probe(words.data_ptr(), words.numel(), threads)
        best = max(best, words.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def prompts(batch: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, MODEL["vocab_size"], (batch, length), generator=g).tolist()


def tison_decode(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Decode tokens/s: tokens after the first of each request / time after all prefills."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts(batch, prompt_len)):
        engine.add_request(f"d{batch}-{i}", p, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
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


def hf_decode(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Same measure for transformers: generate(N) minus generate(1) isolates the decode steps."""
    ids = torch.tensor(prompts(batch, prompt_len))
    kwargs = dict(do_sample=False, min_new_tokens=None, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kwargs)
        first = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - t
    return batch * (new_tokens - 1) / max(total - first, 1e-9)


def hf_prefill(model, batch: int, prompt_len: int) -> float:
    ids = torch.tensor(prompts(batch, prompt_len))
    with torch.inference_mode():
        t = time.perf_counter()
        model(ids, logits_to_keep=1)
        return batch * prompt_len / (time.perf_counter() - t)


def measure_round(engine, hf, prompt_len: int, new_tokens: int) -> dict[str, tuple]:
    """One round of every measure, Tison then transformers, each decode measure between two
    bandwidth readings: {name: (tison, transformers, GB/s around it or None for prefill)}."""
    p, n = prompt_len, new_tokens
    result: dict[str, tuple] = {}
    for batch in (1, 32):
        before = memory_bandwidth_gbs(0.3)
        ours, theirs = tison_decode(engine, batch, p, n), hf_decode(hf, batch, p, n)
        gbs = (before + memory_bandwidth_gbs(0.3)) / 2
        result[f"batch-{batch} decode tok/s"] = (ours, theirs, gbs)
    result["prefill tok/s (8 x 512)"] = (
        tison_prefill(engine, 8, 512),
        hf_prefill(hf, 8, 512),
        None,
    )
    return result


def roofline(tokens_per_s: float, batch: int, gbs: float, weight_bytes: int) -> float:
    """Share of the decode roofline: each step reads every weight byte once (compute and KV
    reads ignored), so `batch` tokens per weight_bytes / GB/s seconds at best."""
    return tokens_per_s / (batch * gbs * 1e9 / weight_bytes)


def main() -> None:
    restart_with_huge_pages()  # as the `tison` command does: weights on 2 MiB pages
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--prompt-len", type=int, default=32, help="decode measures: prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds; the best of each is kept"
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        weight_bytes = save_random_llama(Path(tmp), MODEL, dtype)
        engine = LLMEngine(
            EngineConfig(model_dir=Path(tmp), dtype=args.dtype, kv_cache_bytes=2 << 30)
        )
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval()
        tison_decode(engine, 1, 8, 4)  # warm-up
        hf_decode(hf, 1, 8, 4)
        rounds = [
            measure_round(engine, hf, args.prompt_len, args.new_tokens) for _ in range(args.rounds)
        ]
    print(
        f"model: {weight_bytes / 1e6:.0f} MB of {args.dtype} weights; {args.threads} threads; "
        f"best of {args.rounds} interleaved rounds; decode after a {args.prompt_len}-token "
        f"prompt, {args.new_tokens} new tokens; torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )
    print_table(rounds, weight_bytes)
    if args.out:
        args.out.write_text(json.dumps({"weight_bytes": weight_bytes, "rounds": rounds}, indent=1))


def print_table(rounds: list[dict[str, tuple]], weight_bytes: int) -> None:
    """Best of the rounds for each side; the roofline share is the best of the rounds', each
    against the bandwidth measured around it."""
    print(f"| {'measure':24} | {'Tison':>8} | {'transformers':>12} | {'ratio':>6} | roofline |")
    print(f"|{'-' * 26}|{'-' * 10}|{'-' * 14}|{'-' * 8}|----------|")
    for name in rounds[0]:
        ours, theirs = (max(r[name][i] for r in rounds) for i in (0, 1))
        share = ""
        if rounds[0][name][2] is not None:
            batch = int(name.split()[0].removeprefix("batch-"))
            shares = [roofline(r[name][0], batch, r[name][2], weight_bytes) for r in rounds]
            gbs = [r[name][2] for r in rounds]
            share = f"{max(shares):.0%} at {min(gbs):.0f}-{max(gbs):.0f} GB/s"
        print(f"| {name:24} | {ours:8.1f} | {theirs:12.1f} | {ours / theirs:5.2f}x | {share} |")


if __name__ == "__main__":
    main()
