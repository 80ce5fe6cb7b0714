"""The prefix cache: its bookkeeping alone (holders, names, reuse order, events), then engines with
the cache on giving the greedy tokens of engines with it off -- a prefix that ends mid-page,
prefixes shared by running requests, eviction under memory pressure, preempted requests
resuming, cache_salt tenants, a (2, 1) and a (1, 2) engine, MLA -- and a prefill worker of (2, 1)
that finds a prefix cached pushing all of it to its decode worker."""

import pytest

from shared.engine.llm import LLM
from shared.kv.allocator import PageAllocator
from shared.kv.block_hash import page_hashes
from shared.kv.prefix_cache import PrefixCache
from shared.sampling.params import SamplingParams

from engine_helpers import make_prompts, new_engine, run_all
from services_harness import (
    Services,
    assert_completions_equal,
    start_prefill_tp2_decode_pp2,
    wait_metric,
)

S = 16  # the engine's default page size
GREEDY = SamplingParams(temperature=0, max_tokens=12)


# --- bookkeeping -----------------------------------------------------------------------------


def cache_of(num_pages: int) -> PrefixCache:
    return PrefixCache(PageAllocator(num_pages), S)


def test_hashes_chain_over_the_whole_prefix_and_the_salt():
    a = list(range(3 * S))
    b = [7] + a[1:]  # differs in page 0 only
    ha, hb = page_hashes(a, S), page_hashes(b, S)
    assert len(ha) == 3 and all(x != y for x, y in zip(ha, hb))  # every later page differs too
    assert page_hashes(a[: 2 * S + 5], S) == ha[:2]  # a partial page has no hash
    assert page_hashes(a, S, salt="tenant") != ha
    assert page_hashes(a, S, parent=ha[0], first_page=1) == ha[1:]


def test_a_page_returns_with_its_last_holder_and_is_found_again():
    cache = cache_of(4)
    pages = cache.allocate(2)
    for page, h in zip(pages, (11, 22)):
        cache.register(page, h)
    assert cache.match([11, 22, 33], 3 * S) == pages  # the third is not cached
    cache.acquire(pages)  # a second holder
    cache.free(pages)
    assert cache.num_free == 2  # still held once
    cache.free(pages)
    assert cache.num_free == 4 and cache.num_used == 0
    found = cache.match([11, 22], 2 * S + 1)
    assert found == pages and cache.num_free_among(found) == 2
    cache.acquire(found)  # taken back from the free pages
    assert cache.num_free == 2
    assert cache.drain_events() == ([11, 22], []) and cache.drain_events() == ([], [])


def test_a_match_leaves_one_token_to_compute():
    cache = cache_of(4)
    pages = cache.allocate(2)
    cache.register(pages[0], 1)
    cache.register(pages[1], 2)
    assert cache.match([1, 2], 2 * S) == pages[:1]  # all tokens cached: the last page recomputed
    assert cache.match([1, 2], 2 * S + 1) == pages


def test_free_pages_are_reused_least_recently_freed_first_and_lose_their_name():
    cache = cache_of(3)
    old, new = cache.allocate(1), cache.allocate(1)
    cache.register(old[0], 1)
    cache.register(new[0], 2)
    cache.free(old)
    cache.free(new)
    third = cache.allocate(1)  # the never used page goes first
    assert cache.match([1], S + 1) == old
    reused = cache.allocate(1)
    assert reused == old and cache.match([1], S + 1) == []  # evicted: LRU first
    assert cache.match([2], S + 1) == new
    assert cache.drain_events() == ([1, 2], [1]) and cache.stats.evicted_pages == 1
    cache.free(third + reused)


def test_blank_pages_go_out_first_the_last_freed_first():
    allocator = PageAllocator(4)
    a, b, c = allocator.allocate(3)
    assert (a, b, c) == (0, 1, 2)
    allocator.free([a])
    allocator.free([b])
    # the most recently freed first (its memory is warm), the never used page after them
    assert [allocator.allocate(1)[0] for _ in range(3)] == [b, a, 3]


def test_cached_pages_are_evicted_only_when_no_blank_page_is_left():
    cache = cache_of(4)
    named, blank = cache.allocate(2)
    cache.register(named, 1)
    cache.free([named, blank])
    assert set(cache.allocate(2)) == {blank, 2}  # a blank one reused, the never used one
    assert cache.match([1], S + 1) == [named]  # still cached
    assert cache.allocate(1) == [3] and cache.match([1], S + 1) == [named]
    assert cache.allocate(1) == [named] and cache.match([1], S + 1) == []  # evicted at last
    assert cache.drain_events() == ([1], [1])


def test_a_name_moves_from_a_free_page_to_its_content_computed_again():
    cache = cache_of(3)
    old = cache.allocate(1)
    cache.register(old[0], 7)
    cache.free(old)  # free, still named
    again = cache.allocate(1)  # a request that did not start on it computes it again
    cache.register(again[0], 7)
    assert cache.match([7], S + 1) == again
    assert cache.allocate(1) == old and cache.allocate(1) == [2]  # unnamed: blank, first out
    assert cache.match([7], S + 1) == again and cache.stats.evicted_pages == 0
    assert cache.drain_events() == ([7], []) and cache.stats.cached_pages == 1


def test_pages_in_quarantine_are_not_found_until_released():
    allocator = PageAllocator(2)
    cache = PrefixCache(allocator, S)
    page = cache.allocate(1)
    cache.register(page[0], 5)
    cache.mark_launched()  # a micro-batch in flight
    cache.free(page)
    assert cache.match([5], S + 1) == []
    cache.mark_collected()
    assert cache.match([5], S + 1) == page


def test_a_duplicate_page_stays_unnamed():
    cache = cache_of(2)
    a, b = cache.allocate(1), cache.allocate(1)
    cache.register(a[0], 9)
    cache.register(b[0], 9)  # the same content computed twice
    cache.free(a + b)
    assert cache.match([9], S + 1) == a and cache.stats.cached_pages == 1


# --- engines: greedy tokens equal with the cache on and off ----------------------------------


def shared_prefix_prompts(prefix: int, tails: list[int], seed: int = 0) -> list[list[int]]:
    base = make_prompts([prefix], seed=seed)[0]
    return [base + make_prompts([n], seed=seed + 1 + i)[0] for i, n in enumerate(tails)]


def run(model_dir, prompts, cache: bool, one_by_one: bool, **options):
    engine = new_engine(model_dir, enable_prefix_caching=cache, **options)
    outputs: dict = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
        if one_by_one:
            run_all(engine, outputs)
        else:
            for _ in range(2):  # later requests join while earlier ones still run
                for s in engine.step():
                    outputs.setdefault(s.request.request_id, []).extend(s.new_token_ids)
    run_all(engine, outputs)
    assert engine.num_pages_used == 0 and engine.allocator.num_free == engine.allocator.num_pages
    return [outputs[str(i)] for i in range(len(prompts))], engine


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_a_prefix_that_ends_mid_page_is_reused(tiny_model_factory, family):
    """37 shared tokens: 2 full pages cached, the 5 tokens of the third recomputed."""
    model_dir = tiny_model_factory(family)
    prompts = shared_prefix_prompts(37, [0, 3, 20, 9])
    ref, _ = run(model_dir, prompts, cache=False, one_by_one=True)
    ours, engine = run(model_dir, prompts, cache=True, one_by_one=True)
    assert ours == ref
    stats = engine.prefix_stats()
    assert stats["hit_requests"] == 3 and stats["hit_tokens"] == 3 * 2 * S


def test_a_prefix_shared_by_running_requests(tiny_model_factory):
    """Requests join while those with the same prefix still decode: they share its pages."""
    model_dir = tiny_model_factory("llama")
    prompts = shared_prefix_prompts(48, [4, 4, 30, 1, 17])
    ref, _ = run(model_dir, prompts, cache=False, one_by_one=False, max_num_batched_tokens=24)
    ours, engine = run(model_dir, prompts, cache=True, one_by_one=False, max_num_batched_tokens=24)
    assert ours == ref and engine.prefix_stats()["hit_requests"] >= 3


def test_eviction_under_memory_pressure(tiny_model_factory):
    """A pool of 12 pages: cached pages of earlier requests are reused for later ones."""
    model_dir = tiny_model_factory("llama")
    prompts = [p for seed in range(4) for p in shared_prefix_prompts(40, [3, 8], seed=10 * seed)]
    ref, _ = run(model_dir, prompts, cache=False, one_by_one=True, num_pages=12)
    ours, engine = run(model_dir, prompts, cache=True, one_by_one=True, num_pages=12)
    assert ours == ref
    stats = engine.prefix_stats()
    assert stats["evicted_pages"] > 0 and stats["hit_requests"] >= 4


def test_a_preempted_request_resumes_on_its_cached_pages(tiny_model_factory):
    """9 pages for 4 requests of 2-3 pages that grow: the newest are preempted, and on
    resuming find their computed pages (and the shared prefix) still cached."""
    model_dir = tiny_model_factory("llama")
    prompts = shared_prefix_prompts(33, [2, 5, 9, 1])
    params = SamplingParams(temperature=0, max_tokens=40)

    def go(cache):
        engine = new_engine(model_dir, enable_prefix_caching=cache, num_pages=9)
        reqs = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
        run_all(engine)
        assert engine.num_pages_used == 0
        return [r.output_token_ids for r in reqs], reqs, engine

    ref, _, _ = go(False)
    ours, reqs, engine = go(True)
    assert ours == ref
    assert sum(r.num_preemptions for r in reqs) > 0
    assert engine.prefix_stats()["queried_requests"] > len(prompts)  # resumptions looked up


def test_tenants_with_different_salts_never_share_pages(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    prompt = make_prompts([50])[0]
    engine = new_engine(model_dir)
    for i, salt in enumerate(["a", "b", "", "a"]):
        params = SamplingParams(temperature=0, max_tokens=4, cache_salt=salt)
        engine.add_request(str(i), prompt, params)
        run_all(engine)
        hits = engine.prefix_stats()["hit_tokens"]
        assert hits == (3 * S if i == 3 else 0), salt  # only the second "a" finds "a"'s pages


@pytest.mark.parametrize("family,tp,pp", [("llama", 2, 1), ("deepseek_v3", 1, 2)])
def test_parallel_engines_with_the_cache_equal_those_without(tiny_model_factory, family, tp, pp):
    model_dir = tiny_model_factory(family)
    prompts = shared_prefix_prompts(40, [2, 11, 25])
    outs = {}
    for cache in (False, True):
        with LLM(
            model_dir, dtype="float32", tp=tp, pp=pp, allow_oversubscribe=True,
            enable_prefix_caching=cache, max_num_batched_tokens=24,
        ) as llm:  # fmt: skip
            outs[cache] = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
            hits = llm.engine.prefix_stats()["hit_requests"]
            assert hits == (2 if cache else 0)
    assert outs[True] == outs[False]


async def test_a_prefill_worker_with_a_cached_prefix_pushes_all_of_it(tiny_model_factory, tmp_path):
    """The second prompt's first 32 tokens are cached on the (2, 1) prefill worker: it computes
    the rest, and both ranks push the cached pages with the new ones to the (1, 2) decode
    worker, which decodes as the offline engine does."""
    model_dir = tiny_model_factory("llama")
    shared = "def fibonacci(n):\n    if n < 2:\n        return n\n" * 3
    prompts = [shared + "print(1)", shared + "import os"]
    with LLM(model_dir, dtype="float32", enable_prefix_caching=False) as llm:
        expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    with Services(tmp_path, model_dir) as s:
        start_prefill_tp2_decode_pp2(s, model_dir)
        await assert_completions_equal(s, model_dir.name, prompts, expected, 16)


async def test_a_follow_up_turn_moves_only_the_pages_its_decode_worker_lacks(
    tiny_model_factory, tmp_path, monkeypatch
):
    """Turn 2 extends turn 1's prompt: the (1, 2) decode worker holds turn 1's 2 full pages
    (cached once decoded), so the (2, 1) prefill worker sends over TCP the KV of the 28 tokens
    after them only (the scheduler told not to prefill on the decode worker), and the
    completion is the offline engine's. Allowed to, the scheduler has the decode worker
    compute turn 3's few uncached tokens itself: nothing moves."""
    monkeypatch.setenv("TISON_KV_SECRET", "test-secret")  # the workers inherit it: TCP is on
    model_dir = tiny_model_factory("llama")
    turn1 = make_prompts([40])[0]
    turn2 = turn1 + make_prompts([20], seed=1)[0]
    turn3 = turn2 + make_prompts([10], seed=2)[0]
    with LLM(model_dir, dtype="float32", enable_prefix_caching=False) as llm:
        expected = llm.generate([turn1, turn2, turn3], SamplingParams(temperature=0, max_tokens=8))
        spec = llm.engine.kv_spec
    token_bytes = spec.page_size_bytes // spec.page_size  # all layers and heads
    for local, turns in ((0, [(turn1, 40), (turn2, 60 - 32)]), (256, [(turn1, 40), (turn3, 0)])):
        with Services(tmp_path / f"local-{local}", model_dir) as s:
            start_prefill_tp2_decode_pp2(
                s, model_dir, "tcp", ("--local-prefill-tokens", str(local))
            )
            moved = 0
            for prompt, new_tokens in turns:
                ref = expected[[turn1, turn2, turn3].index(prompt)]
                await assert_completions_equal(s, model_dir.name, [prompt], [ref], 8)
                moved += new_tokens * token_bytes
                what, done = f"{moved} KV bytes received over TCP", moved
                await wait_metric(
                    s, "tison_kv_transfer_bytes", lambda n, m=done: n == m, what, "decode"
                )
