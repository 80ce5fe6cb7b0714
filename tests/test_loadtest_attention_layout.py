"""loadtest/bench_attention.py's "engine" layout of the KV pages: the block tables it reads are
the ones the engine's own scheduler hands out for the same batch (prompts admitted together,
then decoded in lockstep), and every draw's pages are distinct pool pages, page 0 (where the
bench writes) left out, also once the pool has filled and the requests' pages came back."""

import torch

from loadtest.bench_attention import DECODED, PAGE_SIZE, engine_tables
from shared.engine.request import Request
from shared.engine.scheduler import Scheduler
from shared.kv.allocator import PageAllocator
from shared.sampling.params import SamplingParams


def scheduled_tables(num_pages: int, batch: int, ctx: int) -> list[list[int]]:
    """Each request's pages once the scheduler has computed ctx tokens of it: `batch` prompts
    of ctx - DECODED tokens, arriving together, decoded one token a step."""
    allocator = PageAllocator(num_pages)
    allocator.allocate(1)  # the bench's page 0
    scheduler = Scheduler(allocator, PAGE_SIZE, max_num_batched_tokens=1 << 16, max_num_seqs=64)
    params = SamplingParams(temperature=0, max_tokens=ctx)
    requests = [
        Request(f"r{i}", [5] * (ctx - DECODED), params, 0, frozenset(), 1 << 20, arrival=i)
        for i in range(batch)
    ]
    for req in requests:
        scheduler.add(req)
    while requests[0].num_computed_tokens < ctx:
        out = scheduler.schedule()
        scheduler.update(out, {s.request: 7 for s in out.scheduled if s.samples})
    assert all(req.num_computed_tokens == ctx for req in requests)
    return [req.page_ids for req in requests]


def test_the_engine_layout_is_the_schedulers():
    for batch, ctx in ((1, 256), (3, 256), (4, 200), (2, 1024)):
        table = engine_tables(4000, batch, ctx, 1, torch.Generator().manual_seed(0))[0]
        assert table.tolist() == scheduled_tables(4000, batch, ctx)


def test_one_request_reads_consecutive_pages():
    (table,) = engine_tables(4000, 1, 512, 1, torch.Generator().manual_seed(0))
    assert table.tolist() == [list(range(1, 1 + 512 // PAGE_SIZE))]


def test_every_draw_holds_distinct_pages_once_the_pool_has_filled():
    batch, ctx, width = 4, 256, 256 // PAGE_SIZE
    num_pages = 3 * batch * width  # two batches fit, then the requests finish
    draws = engine_tables(num_pages, batch, ctx, 7, torch.Generator().manual_seed(1))
    reused = set()
    for i, table in enumerate(draws):
        assert table.shape == (batch, width)
        pages = table.flatten().tolist()
        assert len(set(pages)) == len(pages)
        assert 0 < min(pages) and max(pages) < num_pages
        if i >= 2:
            reused.update(pages)
    assert reused & set(draws[0].flatten().tolist())  # the first batch's pages came back
