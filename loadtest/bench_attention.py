"""Decode attention alone (the C kernel of kernels/cpu/attention.py's paged_attention, bfloat16,
the ~150M Llama's 12 query / 4 KV heads of 64, pages of 16 tokens) beside the memory bandwidth
measured in the same run. Each call reads its rows' pages from another draw of block tables out
of a pool far larger than the last-level cache, and a draw comes back only after 4x that cache
has been read, as the engine's layers do (a step reads the weights between), so the K and V come
from memory; the pool is on 2 MiB pages, as the `tison` command puts it. Two layouts of the
pages (--layouts):
- engine: as the engine's scheduler lays them out (its PageAllocator and page rule): `batch`
  requests admitted together with prompts of ctx - 64 tokens (a prompt's pages at once), then
  64 tokens decoded in lockstep (a page a request as it fills), and when the pool runs low the
  live requests finish in random order (their pages freed, handed out again last freed first);
  a row reads runs of consecutive pages, the hardware prefetcher follows them;
- random: each page of a draw a random one of the pool, a pool fragmented page by page (the
  worst case; long-running servers with many short requests come closer to it).
Two timings a case:
- in a team: calls one after another in one OpenMP team (tk_attention_timed), as the fused
  decoder makes them, a layer's attention between its projections: the figure the target is
  read on;
- one call: tk_paged_attention through ctypes with its arguments made beforehand, as the op-by-op
  path makes it less the wrapper's checks (~20 us, most of a batch-1 call): a ctypes call, a
  team started and scratch allocated each time (~3 and a few us).
Beside them, "pages alone": the same pages read with none of the arithmetic (membw.c's
read_pages_xor, a few pages at once a thread), the most this machine reads them at; "of pages"
is the in-team rate's share of it.
Bandwidth and attention are measured in turn; a share is the median of the per-round ratios
(the bandwidth of this shared machine drifts), with their spread.

    python -m loadtest.bench_attention [--isa avx2] [--pairs 5] [--batches 1 32] [--layouts random]
"""

import argparse
import glob
import os
import statistics
import time

import torch

from kernels.cpu import isa, library
from kernels.cpu.attention import paged_attention
from loadtest.bench_engine import memory_bandwidth_gbs, read_probes
from shared.huge_pages import restart_with_huge_pages
from shared.kv.allocator import PageAllocator
from shared.kv.pages import pages_to_admit, pages_to_grow

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 12, 4, 64, 16
POOL_BYTES = 512 << 20  # K and V of the pool: 16x this machine's 32 MiB L3
CACHE_COVER = 4  # a case's block tables read this many times the last-level cache in all
DECODED = 64  # the engine layout: tokens each request decodes after its prompt
LAYOUTS = ("engine", "random")


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


def tables(
    num_pages: int, batch: int, ctx: int, g: torch.Generator, layout: str
) -> list[torch.Tensor]:
    """draws_for(batch, ctx) block tables (batch, ctx / S) int32 of distinct pages of the pool,
    laid out as `layout` says (page 0 left out: the new tokens' K/V are written there)."""
    draws = draws_for(batch, ctx)
    if layout == "engine":
        return engine_tables(num_pages, batch, ctx, draws, g)
    width = -(-ctx // PAGE_SIZE)
    return [
        (torch.randperm(num_pages - 1, generator=g)[: batch * width] + 1)
        .view(batch, width)
        .to(torch.int32)
        for _ in range(draws)
    ]


def engine_tables(
    num_pages: int, batch: int, ctx: int, draws: int, g: torch.Generator
) -> list[torch.Tensor]:
    """Block tables as the engine's scheduler lays out `draws` batches of `batch` requests in
    turn: prompts of ctx - DECODED tokens admitted together, DECODED tokens decoded in lockstep;
    when the pool cannot take another batch, the live requests finish in random order."""
    allocator, width = PageAllocator(num_pages), -(-ctx // PAGE_SIZE)
    allocator.allocate(1)  # page 0
    prompt = max(1, ctx - DECODED)
    live, out = [], []
    for _ in range(draws):
        if not allocator.can_allocate(batch * (width + 1)):
            for i in torch.randperm(len(live), generator=g).tolist():
                allocator.free(live[i])
            live = []
        rows = [allocator.allocate(pages_to_admit(prompt, PAGE_SIZE)) for _ in range(batch)]
        for tokens in range(prompt + 2, ctx + 1):  # the prompt's pages hold its next token
            for pages in rows:
                pages += allocator.allocate(pages_to_grow(len(pages), tokens, PAGE_SIZE))
        live += rows
        out.append(torch.tensor([pages[:width] for pages in rows], dtype=torch.int32))
    return out


def case_inputs(kv: torch.Tensor, batch: int, ctx: int, layout: str) -> dict:
    """The block tables, q and context lengths of one case, and paged_attention's answer."""
    g = torch.Generator().manual_seed(batch * 100_000 + ctx)
    draws = tables(kv.shape[1], batch, ctx, g, layout)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    k, v = torch.zeros(2, batch, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    slots = torch.arange(batch, dtype=torch.int64) % PAGE_SIZE  # page 0, which no row reads
    ref = torch.empty_like(q)
    paged_attention(
        q, k, v, kv, slots, HEAD_DIM**-0.5, ref, block_table=draws[0], context_lens=lens
    )
    return dict(draws=draws, q=q, lens=lens, k=k, v=v, slots=slots, ref=ref)


def call_seconds(kv: torch.Tensor, case: dict, budget: float) -> float:
    """Median seconds of one tk_paged_attention call (as attention.py makes it, less the
    wrapper's checks: a ctypes call, a team started, scratch allocated) over `budget` seconds."""
    q, lens, out = case["q"], case["lens"], torch.empty_like(case["q"])
    batch, row = q.shape[0], KV_HEADS * HEAD_DIM
    fn = library.kernel("tk_paged_attention", torch.bfloat16)
    calls = [
        (case["k"].data_ptr(), row, case["v"].data_ptr(), row, case["slots"].data_ptr(), batch,
         q.data_ptr(), HEADS * HEAD_DIM, None, kv[0].data_ptr(), kv[1].data_ptr(),
         table.data_ptr(), table.stride(0), lens.data_ptr(), batch, HEADS, KV_HEADS, HEAD_DIM,
         PAGE_SIZE, 0, HEAD_DIM**-0.5, out.data_ptr(), torch.get_num_threads())
        for table in case["draws"]
    ]  # fmt: skip
    fn(*calls[0])
    if not torch.equal(out, case["ref"]):
        raise AssertionError("the kernel called directly differs from paged_attention")
    times, end, i = [], time.perf_counter() + budget, 0
    while len(times) < 5 or time.perf_counter() < end:
        args = calls[i % len(calls)]
        i += 1
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def team_seconds(kv: torch.Tensor, case: dict, calls: int) -> float:
    """Median seconds of a call among `calls` made in one team by tk_attention_timed, as the
    fused decoder makes them (no ctypes call, team start or allocation a call), the case's
    block tables in turn."""
    q, lens, out = case["q"], case["lens"], torch.empty_like(case["q"])
    draws = case["draws"]
    stacked = torch.stack([draws[i % len(draws)] for i in range(calls)])
    seconds = torch.zeros(calls, dtype=torch.float64)
    status = library.kernel("tk_attention_timed", torch.bfloat16)(
        q.data_ptr(), HEADS * HEAD_DIM, kv[0].data_ptr(), kv[1].data_ptr(), stacked.data_ptr(),
        calls, stacked.shape[2], lens.data_ptr(), q.shape[0], HEADS, KV_HEADS, HEAD_DIM,
        PAGE_SIZE, HEAD_DIM**-0.5, out.data_ptr(), torch.get_num_threads(), seconds.data_ptr(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("tk_attention_timed: no memory for its scratch")
    if calls % len(draws) == 1 and not torch.equal(out, case["ref"]):  # the last: draws[0]
        raise AssertionError("the timed calls differ from paged_attention")
    return statistics.median(seconds.tolist())


def pages_gbs(kv: torch.Tensor, case: dict, calls: int) -> float:
    """GB/s at which membw.c's read_pages_xor reads the K and V pages of `calls` of the case's
    block tables in turn (those team_seconds reads), with none of attention's arithmetic: the
    most this machine reads these pages at."""
    draws = case["draws"]
    pages = torch.cat([draws[i % len(draws)].flatten() for i in range(calls)])
    page_words = PAGE_SIZE * KV_HEADS * HEAD_DIM * 2 // 8
    t = time.perf_counter()
    read_probes().read_pages_xor(
        kv[0].data_ptr(), kv[1].data_ptr(), pages.data_ptr(), len(pages), page_words,
        torch.get_num_threads(),
    )  # fmt: skip
    return 2 * len(pages) * page_words * 8 / (time.perf_counter() - t) / 1e9


def kv_bytes(batch: int, ctx: int) -> int:
    return 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2  # K and V, bfloat16


def run_case(kv: torch.Tensor, batch: int, ctx: int, pairs: int, layout: str) -> dict:
    """`pairs` rounds of (bandwidth, the pages alone, attention in a team, attention a call)
    measured in turn -> the figures of one table row: each rate's share of the bandwidth (or of
    the pages alone), the median of the rounds' ratios, the team's with their spread."""
    case = case_inputs(kv, batch, ctx, layout)
    draws = len(case["draws"])
    probe = call_seconds(kv, case, 0.1)  # calls enough for ~0.4 s, whole rounds of the draws
    calls = draws * max(1, round(0.4 / probe / draws)) + 1
    stream, pages, team, call = [], [], [], []
    for _ in range(pairs):
        stream.append(memory_bandwidth_gbs(seconds=0.3))
        pages.append(pages_gbs(kv, case, calls))
        team.append(kv_bytes(batch, ctx) / team_seconds(kv, case, calls) / 1e9)
        call.append(kv_bytes(batch, ctx) / call_seconds(kv, case, 0.4) / 1e9)
    team_ratios = sorted(a / s for a, s in zip(team, stream))
    return dict(
        batch=batch, ctx=ctx, stream_gbs=statistics.median(stream),
        team_us=kv_bytes(batch, ctx) / statistics.median(team) / 1e3,
        team_gbs=statistics.median(team), share=statistics.median(team_ratios),
        lo=team_ratios[0], hi=team_ratios[-1],
        of_pages=statistics.median(a / p for a, p in zip(team, pages)),
        call_us=kv_bytes(batch, ctx) / statistics.median(call) / 1e3,
        call_share=statistics.median(a / s for a, s in zip(call, stream)),
        pages_gbs=statistics.median(pages),
        pages_share=statistics.median(p / s for p, s in zip(pages, stream)),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", choices=isa.TIER_NAMES, help="run as this tier's CPU")
    parser.add_argument("--pairs", type=int, default=5, help="bandwidth/attention pairs")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    args = parser.parse_args()
    restart_with_huge_pages()  # the pool on 2 MiB pages, as in the engine
    if args.isa:  # read when the kernels load, at the first call
        os.environ[isa.ENV_VAR] = args.isa
    kv = pool()
    library.usable(kv)  # loads the library now, at the tier asked for
    print(f"tier {library.built_tier().name}, {torch.get_num_threads()} threads")
    for layout in args.layouts:
        print(f"\npages laid out: {layout}")
        print("         in a team (as the fused decoder)              one call       pages alone")
        print(
            "batch   ctx     us  KV GB/s  share (min-max)  of pages     us  share   GB/s  share"
            "  stream GB/s"
        )
        for batch in args.batches:
            for ctx in args.contexts:
                r = run_case(kv, batch, ctx, args.pairs, layout)
                print(
                    f"{r['batch']:5d} {r['ctx']:5d} {r['team_us']:6.0f} {r['team_gbs']:8.1f}  "
                    f"{r['share']:5.0%} ({r['lo']:.0%}-{r['hi']:.0%})  {r['of_pages']:8.0%} "
                    f"{r['call_us']:6.0f}  {r['call_share']:5.0%}  {r['pages_gbs']:5.1f}  "
                    f"{r['pages_share']:5.0%}  {r['stream_gbs']:11.1f}"
                )


if __name__ == "__main__":
    main()
