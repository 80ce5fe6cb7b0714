"""Data-parallel attention's scheduling as pure policy (shared/engine/data_parallel.py): which
rank a request goes to, one step of every rank's requests in rank order, each rank's pages its
own; and a data-parallel decode worker's KV inbox, which writes a request's frames into its
rank's pool alone. The model side is tested end to end in test_moe_models.py (with a decode
worker of 2 ranks), test_llama4.py and test_deepseek_v3.py."""

import time

import torch
from test_engine_scheduler import PAGE, request

from shared.engine.data_parallel import DataParallelPages, DataParallelScheduler
from shared.engine.request import FinishReason
from shared.engine.scheduler import Scheduler
from shared.engine.shard import rank_pools
from shared.kv.allocator import PageAllocator
from shared.kv.cache import KVCache
from shared.kv.prefix_cache import PrefixCache
from shared.kv.spec import MHAKVSpec
from shared.parallel.shape import ParallelConfig
from shared.transfer.inbox import KVInbox
from shared.transfer.pools import map_pools


def dp_scheduler(
    ranks: int = 2, num_pages: int = 16, caching: bool = False, budget: int = 64
) -> tuple[DataParallelScheduler, DataParallelPages]:
    pools = [PageAllocator(num_pages) for _ in range(ranks)]
    if caching:
        pools = [PrefixCache(pool, PAGE) for pool in pools]
    schedulers = [Scheduler(pool, PAGE, budget, 8) for pool in pools]
    return DataParallelScheduler(schedulers), DataParallelPages(pools)


def step(s: DataParallelScheduler, token: int = 7):
    out = s.schedule()
    sampled = {x.request: token for x in out.scheduled if x.samples}
    return out, s.update(out, sampled)


def test_requests_go_to_the_rank_with_fewest_and_stay_there():
    s, pages = dp_scheduler()
    reqs = [request(str(i), 6, i) for i in range(5)]
    for req in reqs:
        s.add(req)
    assert [r.dp_rank for r in reqs] == [0, 1, 0, 1, 0]
    out, _ = step(s)
    # rank 0's requests first, then rank 1's: the order the ranks' hidden states are gathered
    assert [x.request.request_id for x in out.scheduled] == ["0", "2", "4", "1", "3"]
    assert pages.num_used == 3 * 2 + 2 * 2  # 6 tokens and the next: 2 pages each
    assert [p.num_used for p in pages.pools] == [6, 4]
    for req in reqs:
        while not req.finished:
            step(s)
    assert [r.dp_rank for r in reqs] == [0, 1, 0, 1, 0]
    assert pages.num_used == 0 and not s.has_work()


def test_ties_go_to_the_ranks_in_turn():
    """Requests that end before the next arrives: every rank is as empty each time."""
    s, _ = dp_scheduler(ranks=3)
    ranks = []
    for i in range(5):
        req = request(str(i), 6, i, max_tokens=1)
        s.add(req)
        while not req.finished:
            step(s)
        ranks.append(req.dp_rank)
    assert ranks == [0, 1, 2, 0, 1]


def test_each_rank_has_the_budget_of_one_engine():
    """Two 40-token prompts under a 48-token budget: one step takes both, one on each rank."""
    s, _ = dp_scheduler(budget=48)
    a, b = request("a", 40, 0), request("b", 40, 1)
    s.add(a)
    s.add(b)
    out, _ = step(s)
    assert [(x.request, x.num_tokens) for x in out.scheduled] == [(a, 40), (b, 40)]


def test_a_cached_prompt_goes_back_to_the_rank_that_holds_it_among_the_least_loaded():
    s, pages = dp_scheduler(caching=True)
    first = request("first", 12, 0)
    s.add(first)
    assert first.dp_rank == 0
    while not first.finished:
        step(s)
    again = request("again", 12, 1)  # the same 12 tokens: 2 full pages cached on rank 0
    s.add(again)  # both ranks empty, rank 1's turn: the cache decides
    assert again.dp_rank == 0
    step(s)
    assert [p.stats.hit_tokens for p in pages.pools] == [2 * PAGE, 0]
    assert pages.stats.hit_tokens == 2 * PAGE
    third = request("third", 12, 2)  # rank 0 runs `again`: rank 1 has fewer requests
    s.add(third)
    assert third.dp_rank == 1


def test_a_prefix_every_request_shares_is_computed_once_a_rank_not_piled_on_one():
    """Ranks step together (a step lasts as long as its busiest rank's part): requests sharing
    a cached system prompt still spread, and each rank caches it once."""
    s, pages = dp_scheduler(caching=True, num_pages=64)
    warm = request("warm", 12, 0)
    s.add(warm)
    while not warm.finished:
        step(s)
    for wave in range(2):  # the same prompt, cached on rank 0 only at first
        reqs = [request(f"{wave}{i}", 12, 1 + 2 * wave + i) for i in range(2)]
        for req in reqs:
            s.add(req)
        assert [r.dp_rank for r in reqs] == [0, 1]
        while s.has_work():
            step(s)
    assert [p.stats.hit_requests for p in pages.pools] == [2, 1]  # rank 1's first computes it


def test_a_reservation_goes_where_pages_are_free():
    """Rank 0 has fewer requests but no free page: the reservation holds rank 1's."""
    s, pages = dp_scheduler(num_pages=8)
    big = request("big", 28, 0)  # 8 pages with its first token: rank 0 full
    s.add(big)
    step(s)
    for i in range(2):  # rank 1: as many requests, then more; they hold no page yet
        s.add(request(f"small{i}", 3, 1 + i))
    held = request("held", 8, 3)
    assert s.ranks_for(held) == [0, 1]
    assert s.reserve(held) and held.dp_rank == 1
    assert s.reserved["held"] is held and pages.pools[1].num_used == 3
    s.activate(held, computed=False)
    assert held in s.waiting
    assert s.abort("held") is held and held.finish_reason == FinishReason.ABORT
    assert pages.pools[1].num_used == 0
    assert not s.reserve(request("huge", 40, 4))  # no rank can hold it


def test_finish_and_abort_free_the_pages_of_the_request_s_rank():
    s, pages = dp_scheduler()
    a, b = request("a", 6, 0), request("b", 6, 1)
    s.add(a)
    s.add(b)
    step(s)
    s.finish(b, FinishReason.STOP)
    assert [p.num_used for p in pages.pools] == [2, 0]
    assert s.abort("a") is a and s.abort("a") is None
    assert pages.num_used == 0 and pages.num_free == 32 and pages.num_pages == 32


def test_pages_freed_during_a_step_wait_for_it_on_every_rank():
    s, pages = dp_scheduler()
    a = request("a", 6, 0)
    s.add(a)
    step(s)
    pages.mark_launched()
    s.abort("a")
    assert pages.num_free == 30  # a's 2 pages in quarantine
    pages.mark_collected()
    assert pages.num_free == 32


def test_a_data_parallel_inbox_writes_each_request_into_its_rank_s_pool():
    """Pages 1 and 2 of rank 0 and of rank 1 belong to different requests: request b's frame
    (rank 1) lands in rank 1's pool and leaves rank 0's as it was."""
    spec = MHAKVSpec(2, PAGE, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    ranks = rank_pools(spec, ParallelConfig(dp=2, allow_oversubscribe=True), None)
    assert [(r.layers, r.units) for r in ranks] == [((0, 2), (0, 2))] * 2  # whole on each
    caches = [KVCache(spec, 4) for _ in ranks]
    pools = map_pools(spec, ranks, own=dict(enumerate(caches)))
    inbox = KVInbox(spec, pools, lambda rid, layer, slots: True, {"a": 0, "b": 1}.__getitem__)
    slots = spec.slots([1, 2], 0, 2 * PAGE)  # (8,)
    for rid, value in (("a", 1.0), ("b", 2.0)):
        payload = torch.full(spec.payload_shape(1, len(slots), (0, 2)), value)
        inbox.write(rid, 1, (0, 2), slots, payload.view(torch.uint8).flatten(), time.perf_counter())
    for kv, value in zip(caches, (1.0, 2.0)):
        got = kv.spec.read(kv.data, 1, slots, (0, 2))
        assert torch.equal(got, torch.full_like(got, value))
    assert inbox.take("b") == inbox.take("a") > 0
