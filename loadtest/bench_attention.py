"""Decode attention alone (the C kernel of kernels/cpu/attention.py's paged_attention, bfloat16,
the ~150M Llama's 12 query / 4 KV heads of 64, pages of 16 tokens) beside the memory bandwidth
measured in the same run. Each call reads its rows' pages from another random draw out of a pool
far larger than the last-level cache, and a draw comes back only after 4x that cache has been
read, as the engine's layers do (a step reads the weights between), so the K and V come from
memory; the pool is on 2 MiB pages, as the `tison` command puts it. The kernel is called as the
fused decoder calls it, with its arguments made beforehand (the Python wrapper adds ~20 us a
call, which is most of a batch-1 call). Bandwidth and attention are measured in turn; the figure
is the median of the per-pair ratios (the bandwidth of this shared machine drifts), with their
spread.

    python -m loadtest.bench_attention [--isa avx2] [--pairs 5] [--batches 1 32]
"""

import argparse
import glob
import os
import statistics
import time

import torch

from kernels.cpu import isa, library
from kernels.cpu.attention import paged_attention
from loadtest.bench_engine import memory_bandwidth_gbs
from shared.huge_pages import restart_with_huge_pages

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 12, 4, 64, 16
POOL_BYTES = 512 << 20  # K and V of the pool: 16x this machine's 32 MiB L3
CACHE_COVER = 4  # a case's block tables read this many times the last-level cache in all


def last_level_cache_bytes() -> int:
    """The CPU's last-level cache as Linux reports it (32 MiB when it does not)."""
    caches = sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"))
    sizes = []
    for path in caches:
        text = open(path).read().strip()
        unit = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * unit)
    return max(sizes, default=32 << 20)


def draws_for(batch: int, ctx: int) -> int:
    """Block tables a case uses in turn: enough that one round of them reads CACHE_COVER times
    the last-level cache, so no call finds its pages left in cache by an earlier one (at
    least 16)."""
    return max(16, -(-CACHE_COVER * last_level_cache_bytes() // kv_bytes(batch, ctx)))


def pool() -> torch.Tensor:
    """(2, P, S, nkv, hd) bfloat16 of random values."""
    page_bytes = PAGE_SIZE * KV_HEADS * HEAD_DIM * 2
    pages = POOL_BYTES // (2 * page_bytes)
    return torch.randn(2, pages, PAGE_SIZE, KV_HEADS, HEAD_DIM).to(torch.bfloat16)


def tables(num_pages: int, batch: int, ctx: int, g: torch.Generator) -> list[torch.Tensor]:
    """draws_for(batch, ctx) block tables (batch, ctx / S) int32, each of distinct random pages
    of the pool (page 0 left out: the new tokens' K/V are written there)."""
    width = -(-ctx // PAGE_SIZE)
    return [
        (torch.randperm(num_pages - 1, generator=g)[: batch * width] + 1)
        .view(batch, width)
        .to(torch.int32)
        for _ in range(draws_for(batch, ctx))
    ]


def attention_seconds(kv: torch.Tensor, batch: int, ctx: int, budget: float) -> float:
    """Median seconds of one decode-attention call over `budget` seconds of calls."""
    g = torch.Generator().manual_seed(batch * 100_000 + ctx)
    draws = tables(kv.shape[1], batch, ctx, g)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    k, v = torch.zeros(2, batch, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    slots = torch.arange(batch, dtype=torch.int64) % PAGE_SIZE  # page 0, which no row reads
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    out = torch.empty_like(q)
    ref = torch.empty_like(q)  # the wrapper's answer for the first draw: the same call
    paged_attention(
        q, k, v, kv, slots, HEAD_DIM**-0.5, ref, block_table=draws[0], context_lens=lens
    )
    fn = library.kernel("tk_paged_attention", torch.bfloat16)
    row = KV_HEADS * HEAD_DIM
    calls = [
        (k.data_ptr(), row, v.data_ptr(), row, slots.data_ptr(), batch, q.data_ptr(),
         HEADS * HEAD_DIM, None, kv[0].data_ptr(), kv[1].data_ptr(), table.data_ptr(),
         table.stride(0), lens.data_ptr(), batch, HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, 0,
         HEAD_DIM**-0.5, out.data_ptr(), torch.get_num_threads())
        for table in draws
    ]  # fmt: skip
    fn(*calls[0])
    if not torch.equal(out, ref):
        raise AssertionError("the kernel called directly differs from paged_attention")
    times, end, i = [], time.perf_counter() + budget, 0
    while len(times) < 5 or time.perf_counter() < end:
        args = calls[i % len(calls)]
        i += 1
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def kv_bytes(batch: int, ctx: int) -> int:
    return 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2  # K and V, bfloat16


def run_case(kv: torch.Tensor, batch: int, ctx: int, pairs: int) -> dict:
    """`pairs` (bandwidth, attention) measures in turn -> the figures of one table row."""
    stream, attn = [], []
    for _ in range(pairs):
        stream.append(memory_bandwidth_gbs(seconds=0.3))
        attn.append(kv_bytes(batch, ctx) / attention_seconds(kv, batch, ctx, 0.4) / 1e9)
    ratios = sorted(a / s for a, s in zip(attn, stream))
    return dict(
        batch=batch, ctx=ctx, us=kv_bytes(batch, ctx) / statistics.median(attn) / 1e3,
        kv_gbs=statistics.median(attn), stream_gbs=statistics.median(stream),
        share=statistics.median(ratios), lo=ratios[0], hi=ratios[-1],
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", choices=isa.TIER_NAMES, help="run as this tier's CPU")
    parser.add_argument("--pairs", type=int, default=5, help="bandwidth/attention pairs")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2048])
    args = parser.parse_args()
    restart_with_huge_pages()  # the pool on 2 MiB pages, as in the engine
    if args.isa:  # read when the kernels load, at the first call
        os.environ[isa.ENV_VAR] = args.isa
    kv = pool()
    library.usable(kv)  # loads the library now, at the tier asked for
    print(f"tier {library.built_tier().name}, {torch.get_num_threads()} threads")
    print("batch   ctx      us  KV GB/s  stream GB/s  share (min-max)")
    for batch in args.batches:
        for ctx in args.contexts:
            r = run_case(kv, batch, ctx, args.pairs)
            print(
                f"{r['batch']:5d} {r['ctx']:5d} {r['us']:7.0f} {r['kv_gbs']:8.1f} "
                f"{r['stream_gbs']:12.1f}  {r['share']:5.0%} ({r['lo']:.0%}-{r['hi']:.0%})"
            )


if __name__ == "__main__":
    main()
