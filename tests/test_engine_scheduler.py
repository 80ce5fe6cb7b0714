"""The engine's scheduler as pure policy: counters, pages, budgets; no model, no torch."""

from shared.engine.request import FinishReason, Request
from shared.engine.scheduler import Scheduler
from shared.kv.allocator import PageAllocator
from shared.kv.block_hash import group_hash, page_hashes
from shared.kv.prefix_cache import PrefixCache
from shared.sampling.params import SamplingParams

PAGE = 4


def request(rid: str, prompt_len: int, arrival: int, max_tokens: int = 8) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(3, 3 + prompt_len)),
        params=SamplingParams(temperature=0, max_tokens=max_tokens),
        seed=0,
        stop_token_ids=frozenset({2}),
        max_total_tokens=1000,
        arrival=arrival,
    )


def scheduler(num_pages=16, budget=64, max_seqs=8) -> Scheduler:
    return Scheduler(PageAllocator(num_pages), PAGE, budget, max_seqs)


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {x.request: token for x in out.scheduled if x.samples}
    return out, s.update(out, sampled)


def capped_cache_scheduler(num_pages: int) -> tuple[PageAllocator, PrefixCache, Scheduler]:
    """A prefix-caching scheduler whose chunked layers (chunks of 8) are capped in 2 groups."""
    pool = PageAllocator(num_pages)
    cache = PrefixCache(pool, PAGE)
    return pool, cache, Scheduler(cache, PAGE, 64, 8, chunk_groups=2, chunk=8)


def run_to_end(s: Scheduler, req: Request) -> None:
    while not req.finished:
        run_step(s)


def test_chunked_prefill_respects_the_token_budget():
    s = scheduler(budget=10)
    a, b = request("a", 25, 0), request("b", 3, 1)
    s.add(a)
    s.add(b)
    out, _ = run_step(s)
    assert [(x.request.request_id, x.num_tokens) for x in out.scheduled] == [("a", 10)]
    out, _ = run_step(s)
    assert [(x.request.request_id, x.num_tokens) for x in out.scheduled] == [("a", 10)]
    out, _ = run_step(s)  # a's last 5 prompt tokens, then b's whole prompt in the same step
    assert [(x.request.request_id, x.num_tokens, x.samples) for x in out.scheduled] == [
        ("a", 5, True),
        ("b", 3, True),
    ]
    assert a.output_token_ids == [7] and b.output_token_ids == [7]
    out, _ = run_step(s)  # both decode one token each
    assert [x.num_tokens for x in out.scheduled] == [1, 1]


def test_a_long_prompt_never_stalls_running_streams():
    """Mixed batches: every step has each decoding stream's token, then a chunk of the long
    prompt in what the budget leaves, even when the prompt is older (a recomputed one keeps
    its arrival)."""
    s = scheduler(num_pages=64, budget=8)
    streams = [request(f"s{i}", 2, 1 + i, max_tokens=30) for i in range(3)]
    for r in streams:
        s.add(r)
    run_step(s)  # the streams' prompts; they decode from now on
    long = request("long", 40, 0)
    s.add(long)
    steps = 0
    while long.num_computed_tokens < long.num_prompt_tokens:
        out, _ = run_step(s)
        steps += 1
        rows = {x.request.request_id: x.num_tokens for x in out.scheduled}
        assert all(rows.get(r.request_id) == 1 for r in streams), rows  # no stream waits
        assert rows["long"] == min(8 - len(streams), 40 - 5 * (steps - 1))
    assert steps == 8  # 40 prompt tokens, 5 a step
    assert all(len(r.output_token_ids) == steps + 1 for r in streams)


def test_admission_needs_room_for_the_prompt_and_one_token():
    """shared/kv/pages.py's rule: a waiting request gets the pages of its prompt and its next
    token at once (a chunked prompt too), then grows a page at a time as it decodes."""
    s = scheduler(num_pages=4, budget=4)
    a, b = request("a", 10, 0, max_tokens=20), request("b", 4, 1)
    s.add(a)
    s.add(b)
    out, _ = run_step(s)  # a's first chunk; a holds ceil(11 / 4) = 3 pages already
    assert [x.request.request_id for x in out.scheduled] == ["a"] and len(a.page_ids) == 3
    run_step(s)
    run_step(s)  # a's prompt is done; b (4 + 1 tokens: 2 pages) still waits for room
    assert a.output_token_ids == [7] and s.waiting[0] is b and s.allocator.num_free == 1
    run_step(s)  # a's 11th token fits its pages
    assert len(a.page_ids) == 3
    run_step(s)  # its 12th too; the 13th needs a 4th page, taken at once
    out, _ = run_step(s)
    assert len(a.page_ids) == 4 and [x.num_tokens for x in out.scheduled] == [1]


def test_newest_running_request_is_preempted_and_recomputed():
    s = scheduler(num_pages=4)  # 16 token slots
    old, new = request("old", 7, 0, max_tokens=20), request("new", 6, 1, max_tokens=20)
    s.add(old)
    s.add(new)
    run_step(s)  # both prompts and room for one token each: 2 pages each, pool full
    assert s.allocator.num_free == 0
    run_step(s)  # each decodes a token in its pages
    out, _ = run_step(s)  # old needs a 3rd page for its 9th token -> new is preempted
    assert [r.request_id for r in out.preempted] == ["new"]
    assert new.num_computed_tokens == 0 and new.page_ids == [] and new.num_preemptions == 1
    assert s.waiting[0] is new and new.output_token_ids == [7, 7]  # kept, recomputed
    assert [x.request.request_id for x in out.scheduled] == ["old"]


def test_abort_frees_pages_wherever_the_request_is():
    s = scheduler()
    running, waiting = request("r", 9, 0), request("w", 4, 1)
    s.add(running)
    run_step(s)
    s.add(waiting)
    used = s.allocator.num_used
    assert used == 3
    assert s.abort("r").finish_reason == FinishReason.ABORT
    assert s.allocator.num_used == 0 and s.abort("w") is not None and not s.has_work()
    assert s.abort("missing") is None


def test_reserve_then_activate_with_remote_kv():
    s = scheduler(num_pages=3)
    r = request("r", 9, 0)
    assert s.reserve(r) and r.page_ids == [0, 1, 2]  # ceil((9 + 1) / 4): prompt and a token
    assert not s.schedule().scheduled  # reserved requests wait for their KV
    assert not s.reserve(request("x", 5, 1))  # all or nothing: 2 pages needed, 0 free
    r.num_computed_tokens = 9
    r.output_token_ids.append(5)  # the prefill worker's first token
    s.activate(r, computed=True)
    out, _ = run_step(s)
    assert [(x.start, x.num_tokens) for x in out.scheduled] == [(9, 1)]


def test_stop_token_and_max_tokens_finish_and_free():
    s = scheduler()
    a, b = request("a", 4, 0, max_tokens=2), request("b", 4, 1, max_tokens=5)
    s.add(a)
    s.add(b)
    _, finished = run_step(s, token=9)
    assert finished == []
    _, finished = run_step(s, token=2)  # EOS for both; a also hit max_tokens
    assert {r.request_id: r.finish_reason for r in finished} == {
        "a": FinishReason.STOP,
        "b": FinishReason.STOP,
    }
    assert s.allocator.num_used == 0


def test_in_flight_requests_are_neither_scheduled_nor_preempted():
    s = scheduler(num_pages=4)
    a, b = request("a", 7, 0, max_tokens=20), request("b", 6, 1, max_tokens=20)
    s.add(a)
    s.add(b)
    run_step(s)  # both prompts; the pool is full
    run_step(s)  # a token each, in the pages they hold
    out = s.schedule(exclude={b})  # a needs a 3rd page; b is in flight, so a yields its own
    assert out.scheduled == [] and out.preempted == [a] and len(b.page_ids) == 2
    out = s.schedule(max_requests=1)  # b is back: it runs, a waits
    assert [x.request.request_id for x in out.scheduled] == ["b"] and s.waiting[0] is a


def test_pages_freed_under_in_flight_micro_batches_wait_for_them():
    pages = PageAllocator(4)
    a = pages.allocate(2)
    pages.mark_launched()  # micro-batch 1 may still write into a's pages
    pages.free(a)  # e.g. aborted while in flight
    assert pages.num_free == 2 and pages.num_used == 2  # quarantined, not reusable yet
    pages.mark_launched()  # micro-batch 2
    pages.mark_collected()  # micro-batch 1 done: a's pages are safe again
    assert pages.num_free == 4
    b = pages.allocate(1)
    pages.free(b)  # micro-batch 2 still in flight
    assert pages.num_free == 3
    pages.mark_collected()
    assert pages.num_free == 4 and pages.num_used == 0


def test_a_reservation_never_takes_the_pages_a_preempted_request_waits_for():
    s = scheduler(num_pages=5)
    old, new = request("old", 7, 0, max_tokens=20), request("new", 6, 1, max_tokens=20)
    s.add(old)
    s.add(new)
    for _ in range(3):
        run_step(s)
    out, _ = run_step(s)  # old takes its 3rd page, the last: new is preempted
    assert out.preempted == [new] and s.allocator.num_free == 2
    # new (8 tokens now) needs 3 pages to resume; a 2-token reservation would take 1 of the 2
    assert not s.reserve(request("remote", 2, 2))
    s.finish(old, FinishReason.STOP)  # 5 free: new's 3 and the reservation's 1 both fit
    remote = request("remote", 2, 2)
    assert s.reserve(remote) and len(remote.page_ids) == 1  # its own page only
    assert s.allocator.num_free == 4


def test_background_requests_wait_behind_the_others_and_prefill_in_small_steps():
    """A batch request (Request.background) is admitted after every interactive one waiting,
    whenever it came, and its prompt takes at most max_background_tokens of a step, so an
    interactive request that arrives meanwhile waits one short step at most."""
    s = Scheduler(PageAllocator(64), PAGE, 32, 8, max_background_tokens=6)
    batch = [request(f"b{i}", 10, i) for i in range(2)]
    for r in batch:
        r.background = True
        s.add(r)
    first = request("i0", 5, 10)
    s.add(first)
    assert [r.request_id for r in s.waiting] == ["i0", "b0", "b1"]
    out, _ = run_step(s)
    rows = [(x.request.request_id, x.num_tokens) for x in out.scheduled]
    assert rows == [("i0", 5), ("b0", 6)]  # the interactive prompt whole, 6 batch tokens
    late = request("i1", 12, 11)
    s.add(late)
    out, _ = run_step(s)
    rows = [(x.request.request_id, x.num_tokens) for x in out.scheduled]
    assert rows == [("i0", 1), ("b0", 4), ("i1", 12), ("b1", 2)]
    out, _ = run_step(s)  # decode rows of background requests are not capped
    rows = {x.request.request_id: x.num_tokens for x in out.scheduled}
    assert rows == {"i0": 1, "b0": 1, "i1": 1, "b1": 6}


def test_capped_chunked_layers_take_their_window_from_the_one_pool():
    """Chunks of 8 in 2 page groups (shared/kv/chunk_cache.py): a request holds a page per
    logical page of its tokens and, for its chunked layers, 2 per logical page of its window
    only, all from one allocator; as it moves into a new chunk its window's old pages go back
    to the pool, for any request's pages of either kind. Everything returns at the end."""
    pool = PageAllocator(20)
    s = Scheduler(pool, PAGE, 64, 8, chunk_groups=2, chunk=8)
    a = request("a", 10, 0, max_tokens=20)
    s.add(a)
    run_step(s)  # 10 prompt tokens and the sampled 11th: pages 0-2, window pages 0-2
    assert len(a.page_ids) == 3 and [len(g) for g in a.chunk_page_ids] == [3, 3]
    assert pool.num_used == 3 + 2 * 3
    while a.num_computed_tokens < 17:
        run_step(s)  # decoding token 17 (position 16): its chunk starts at page 4
    assert a.chunk_first_page == 4 and [len(g) for g in a.chunk_page_ids] == [1, 1]
    assert pool.num_used == len(a.page_ids) + 2  # the window's older pages are free again
    b = request("b", 20, 1)  # one step: 6 pages of tokens and 2 x 5 of window, not beside a
    s.add(b)
    out, _ = run_step(s)
    assert [x.request for x in out.scheduled] == [a]
    while not a.finished:
        run_step(s)
    assert pool.num_used == 0
    out, _ = run_step(s)  # now b fits
    assert [x.request for x in out.scheduled] == [b]
    while not b.finished:
        run_step(s)
    assert pool.num_used == 0 and b.chunk_page_ids == []


def test_a_capped_reservation_holds_its_window_and_an_abort_returns_everything():
    """A decode engine's reservation: the prompt's pages and, in each of 2 groups, the pages of
    the first decoded token's window (chunks of 8: a 13-token prompt's last chunk, positions
    8-13, pages 2-3); aborted before its KV came, every page is free again."""
    pool = PageAllocator(16)
    s = Scheduler(pool, PAGE, 64, 8, chunk_groups=2, chunk=8)
    req = request("r", 13, 0)
    assert s.reserve(req)
    assert len(req.page_ids) == 4 and req.chunk_first_page == 2
    assert [len(g) for g in req.chunk_page_ids] == [2, 2] and pool.num_used == 4 + 2 * 2
    held = set(req.page_ids) | {p for g in req.chunk_page_ids for p in g}
    assert len(held) == pool.num_used  # no page in two lists
    assert s.abort("r") is req and pool.num_used == 0 and req.chunk_page_ids == []


def test_a_capped_prefix_ends_where_its_window_is_cached():
    """With the prefix cache, a request starts on cached pages only as far as each capped
    group still holds its window's pages there: a's chunk (pages 0-1) left its window as it
    decoded, and those group pages went to its own later pages; b shares a's first page, whose
    window (page 0) is gone, so it starts from token 0 though that page is cached. c, b's
    prompt again, starts on b's first page and each group's page 0 of it."""
    pool, cache, s = capped_cache_scheduler(12)
    a = request("a", 14, 0, max_tokens=4)
    s.add(a)
    run_to_end(s, a)
    assert pool.num_used == 0
    b = request("b", 7, 1)  # a's first 7 tokens
    first = page_hashes(b.prompt_token_ids, PAGE)[0]
    assert cache.lookup(first) is not None  # its first page is cached
    s.add(b)
    run_step(s)
    assert b.num_cached_pages == 1 and cache.stats.hit_tokens == 0  # computed from token 0
    run_to_end(s, b)
    c = request("c", 7, 2)  # b's prompt: b named its first page and its groups' page 0 too
    windows = [cache.lookup(group_hash(first, group)) for group in (1, 2)]
    s.add(c)
    run_step(s)
    assert cache.stats.hit_tokens == 4 and c.chunk_first_page == 0
    assert [g[0] for g in c.chunk_page_ids] == windows and None not in windows
    stored, evicted = cache.drain_events()  # the router's index hears of prompts' pages only
    assert first in stored and {group_hash(first, g) for g in (1, 2)}.isdisjoint(stored + evicted)


def test_a_capped_reservation_starts_on_a_cached_prefix_and_its_window():
    """A decode engine's reservation of a prompt it has computed before: the cached pages up
    to its last page, and of each group the cached pages of the prompt's last chunk below
    them (page 2 of pages 2-3); the prefill worker writes only the rest. Computed here after
    all (start_local), it lets them go and starts again on the cache, from its own chunk."""
    pool, cache, s = capped_cache_scheduler(40)
    a = request("a", 14, 0, max_tokens=2)
    s.add(a)
    run_to_end(s, a)
    b = request("b", 14, 1)  # a's prompt
    assert s.reserve(b)
    assert b.num_computed_tokens == 12 and b.chunk_first_page == 2
    assert [len(g) for g in b.chunk_page_ids] == [2, 2]  # page 2 cached, page 3 new
    assert cache.stats.hit_tokens == 12
    s.activate(b, computed=False)
    assert b.page_ids == [] and b.num_computed_tokens == 0  # released: all of it comes again
    run_to_end(s, b)
    assert cache.stats.hit_tokens == 24 and pool.num_used == 0
