"""KV-aware routing without NATS: the workers' event streams, the scheduler's index, the KV
cost, round robin, session affinity, conditional disaggregation, the fake prefix cache."""

import pytest
from router_helpers import PAGE, beat

from services.fake_worker.prefix import FakePrefixCache
from services.scheduler.affinity import Pin, SessionTable
from services.scheduler.kv_index import KVIndex
from services.scheduler.policy import Router
from services.scheduler.routing import RoutingConfig
from shared.kv.block_hash import page_hashes
from shared.kv.events import KVEventStream
from shared.protocol import KVEventsMsg, SubmitMsg
from shared.sampling.params import SamplingParams


def submit(prompt, request_id="r", session="", salt=""):
    sampling = SamplingParams(max_tokens=2, cache_salt=salt)
    return SubmitMsg(request_id, "gw", tuple(prompt), sampling, 100.0, session_id=session)


def router(*beats, **config):
    r = Router(config=RoutingConfig(**config))
    for b in beats:
        r.observe(b, 0.0)
    return r


def holds(r: Router, worker_id: str, prompt, salt="", role="decode"):
    """The worker's cache names the prompt's full pages (a snapshot from it)."""
    hashes = tuple(page_hashes(list(prompt), PAGE, salt))
    assert r.observe_kv(KVEventsMsg(worker_id, role, 0, stored=hashes, reset=True))


PROMPT = list(range(100, 140))  # 40 tokens: 10 pages


# --- the worker's stream and the scheduler's index --------------------------------------------


def test_stream_sends_a_snapshot_first_then_net_changes():
    stream = KVEventStream("w", "decode")
    first = stream.messages([1, 2], [])
    assert [(m.seq, m.reset, set(m.stored), m.evicted) for m in first] == [(0, True, {1, 2}, ())]
    # 3 named then dropped within one report: never sent; 1 dropped then named again: kept.
    (delta,) = stream.messages([3, 4, 1], [3, 1])
    assert (delta.seq, delta.reset, delta.stored, delta.evicted) == (1, False, (4,), ())
    (drop,) = stream.messages([], [2])
    assert (drop.stored, drop.evicted) == ((), (2,))
    assert stream.named == {1, 4}
    (empty,) = stream.messages([], [])  # one message an interval, even empty: gaps show
    assert (empty.seq, empty.stored, empty.evicted) == (3, (), ())


def test_long_snapshots_and_deltas_continue_in_the_next_numbers():
    stream = KVEventStream("w", "prefill", max_hashes=2)
    msgs = stream.messages([1, 2, 3, 4, 5], [])
    assert [m.seq for m in msgs] == [0, 1, 2] and [m.reset for m in msgs] == [True, False, False]
    assert all(len(m.stored) + len(m.evicted) <= 2 for m in msgs)
    index = KVIndex()
    assert all(index.apply(m) for m in msgs)
    assert index.num_pages("w") == 5
    for m in stream.messages([6], [1, 2]):
        assert index.apply(m)
    assert index.num_pages("w") == 4 and index.overlap("w", [3, 4, 5, 6, 7]) == 4


def test_a_lost_message_drops_the_worker_until_the_snapshot_it_asks_for():
    stream, index = KVEventStream("w", "decode"), KVIndex()
    for m in stream.messages([1, 2], []):
        assert index.apply(m)
    stream.messages([3], [])  # lost on the way
    (after,) = stream.messages([4], [])
    assert not index.apply(after)  # gap: nothing is credited rather than something wrong
    assert index.num_pages("w") == 0 and index.overlap("w", [1, 2]) == 0
    (next_one,) = stream.messages([], [])
    assert not index.apply(next_one)  # still waiting: asks again
    stream.ask_snapshot()
    (snapshot,) = stream.messages([5], [1])
    assert snapshot.reset and index.apply(snapshot)
    assert index.overlap("w", [2, 3, 4, 5]) == 4 and index.num_pages("w") == 4


def test_a_scheduler_started_after_the_worker_asks_for_a_snapshot():
    stream = KVEventStream("w", "decode")
    stream.messages([1], [])  # before the scheduler was up
    index = KVIndex()
    assert not index.apply(stream.messages([2], [])[0])
    stream.ask_snapshot()
    assert index.apply(stream.messages([], [])[0]) and index.num_pages("w") == 2


def test_overlap_is_the_leading_run_of_named_pages():
    index = KVIndex()
    index.apply(KVEventsMsg("w", "decode", 0, stored=(1, 2, 4), reset=True))
    assert index.overlap("w", [1, 2, 3, 4]) == 2
    assert index.overlap("w", [9, 1, 2]) == 0 and index.overlap("other", [1]) == 0
    index.forget("w")
    assert index.overlap("w", [1, 2]) == 0


# --- KV cost ----------------------------------------------------------------------------------


def test_kv_routing_prefers_the_worker_holding_the_prefix():
    r = router(beat("d0"), beat("d1"), beat("p0", "prefill"), beat("p1", "prefill"))
    holds(r, "d1", PROMPT[:32])  # 8 of the prompt's 10 pages
    holds(r, "p1", PROMPT[:16], role="prefill")
    choice = r.choose(submit(PROMPT), 0.0)
    assert (choice.decode.worker_id, choice.decode_reason) == ("d1", "kv_overlap")
    assert (choice.prefill.worker_id, choice.prefill_reason) == ("p1", "kv_overlap")
    assert (choice.decode_cached_tokens, choice.prefill_cached_tokens) == (32, 16)
    assert choice.compute_tokens == 40 - 16  # the prefill worker computes its uncached part
    # Another salt names other pages: nothing cached, the load rule (id order on a tie).
    other = r.choose(submit(PROMPT, salt="tenant-b"), 0.0)
    assert (other.decode.worker_id, other.decode_reason, other.decode_cached_tokens) == (
        "d0",
        "load",
        0,
    )
    # A prompt of whole cached pages still computes its last token: all but its last page.
    whole = r.choose(submit(PROMPT[:32]), 0.0)
    assert whole.decode.worker_id == "d1" and whole.decode_cached_tokens == 28


def test_load_outweighs_a_short_prefix_and_the_weight_tunes_it():
    busy = beat("d1", free_pages=80, total_pages=100)  # 20 pages in use
    beats = (beat("d0"), busy, beat("p", "prefill"))
    r = router(*beats)
    holds(r, "d1", PROMPT[:8])  # 2 pages cached: cost 8 + 20 against 10 + 0
    assert r.choose(submit(PROMPT), 0.0).decode.worker_id == "d0"
    heavy = router(*beats, kv_overlap_weight=20.0)  # 160 + 20 against 200
    holds(heavy, "d1", PROMPT[:8])
    assert heavy.choose(submit(PROMPT), 0.0).decode.worker_id == "d1"
    blind = router(*beats, kv_overlap_weight=0.0)  # pages in use only
    holds(blind, "d1", PROMPT)
    choice = blind.choose(submit(PROMPT), 0.0)
    assert (choice.decode.worker_id, choice.decode_reason) == ("d0", "load")


def test_kv_routing_only_among_workers_with_room():
    r = router(beat("d0"), beat("d1", free_pages=5), beat("p", "prefill"))
    holds(r, "d1", PROMPT)
    assert r.choose(submit(PROMPT), 0.0).decode.worker_id == "d0"  # 11 pages don't fit in 5


def test_load_mode_ignores_the_index_and_reap_forgets_it():
    r = router(beat("d0"), beat("d1"), beat("p", "prefill"), mode="load")
    holds(r, "d1", PROMPT)
    choice = r.choose(submit(PROMPT), 0.0)
    assert (choice.decode.worker_id, choice.decode_reason, choice.decode_cached_tokens) == (
        "d0",
        "load",
        0,
    )
    kv = router(beat("d1"), beat("p", "prefill"))
    holds(kv, "d1", PROMPT)
    kv.reap(10.0)
    assert kv.index.num_pages("d1") == 0


def test_round_robin_cycles_over_workers_with_room():
    r = router(
        beat("d0"),
        beat("d1", free_pages=1),  # no room for a 40-token prompt
        beat("d2"),
        beat("p0", "prefill"),
        beat("p1", "prefill"),
        mode="round-robin",
    )
    holds(r, "d2", PROMPT)  # the index does not matter
    picks = []
    for i in range(4):
        req = submit(PROMPT, f"r{i}")
        choice = r.choose(req, 0.0)
        r.record(choice, req)
        picks.append((choice.decode.worker_id, choice.prefill.worker_id, choice.decode_reason))
    assert picks == [
        ("d0", "p0", "round_robin"),
        ("d2", "p1", "round_robin"),
        ("d0", "p0", "round_robin"),
        ("d2", "p1", "round_robin"),
    ]


# --- session affinity -------------------------------------------------------------------------


def test_a_session_keeps_its_workers_while_they_live_and_have_room():
    r = router(beat("d0"), beat("d1"), beat("p0", "prefill"), beat("p1", "prefill"))
    first = submit(PROMPT, "t1", session="s")
    r.record(r.choose(first, 0.0), first)  # d0, p0 (ties); a second request loads them
    other = submit(range(7), "x")
    r.record(r.choose(other, 0.0), other)  # the load rule sends it to d1, p1
    r.observe(beat("d1", running_seqs=0), 0.0)
    r.observe(beat("d0", running_seqs=3), 0.0)  # now d0 is the busier one
    again = r.choose(submit(PROMPT, "t2", session="s"), 0.0)
    assert (again.decode.worker_id, again.prefill.worker_id) == ("d0", "p0")
    assert again.decode_reason == again.prefill_reason == "affinity"
    assert r.choose(submit(PROMPT, "t2"), 0.0).decode.worker_id == "d1"  # no session: load
    # Pinned worker without room (here: it refused): re-routed, and re-pinned there.
    r.refused("d0")
    moved_req = submit(PROMPT, "t3", session="s")
    moved = r.choose(moved_req, 0.0)
    assert (moved.decode.worker_id, moved.decode_reason) == ("d1", "load")
    r.record(moved, moved_req)
    r.observe(beat("d0"), 0.0)
    assert r.choose(submit(PROMPT, "t4", session="s"), 0.0).decode.worker_id == "d1"
    # A dead pinned worker: the session goes elsewhere.
    r = router(beat("d0"), beat("p0", "prefill"))
    r.sessions.pin("s", Pin("p-gone", "d-gone"))
    choice = r.choose(submit(PROMPT, session="s"), 0.0)
    assert (choice.decode.worker_id, choice.decode_reason) == ("d0", "load")


def test_session_table_is_a_bounded_lru():
    table = SessionTable(max_sessions=2)
    table.pin("a", Pin("p", "d0"))
    table.pin("b", Pin("p", "d1"))
    assert table.get("a") == Pin("p", "d0")  # a is now the most recent
    table.pin("c", Pin("p", "d2"))
    assert len(table) == 2 and table.get("b") is None and table.get("a") is not None
    with pytest.raises(ValueError):
        SessionTable(max_sessions=0)


# --- conditional disaggregation ---------------------------------------------------------------


def local_router(**decode_load):
    d = beat("d", local_prefill=True, **decode_load)
    return router(d, beat("p", "prefill"), local_prefill_tokens=16)


def test_a_decode_worker_extends_a_cached_conversation_in_place():
    r = local_router(decoding_seqs=3)  # streams running: today's rule keeps prompts away
    turn = PROMPT + [7] * 6  # 46 tokens, 40 cached on the decode worker
    assert not r.choose(submit(turn), 0.0).local
    holds(r, "d", PROMPT)
    choice = r.choose(submit(turn), 0.0)
    assert choice.local and choice.prefill_worker == "d" and choice.compute_tokens == 6
    assert choice.prefill_reason == "local_prefill" and choice.decode_cached_tokens == 40
    long_turn = PROMPT + [7] * 17  # 17 uncached tokens > local_prefill_tokens
    assert not r.choose(submit(long_turn), 0.0).local


def test_the_prefill_worker_keeps_a_turn_it_computes_sooner():
    r = local_router(decoding_seqs=1, queued_tokens=10)  # the decode worker has 10 to compute
    holds(r, "d", PROMPT[:36])
    holds(r, "p", PROMPT, role="prefill")
    # The decode worker would finish 10 queued + 4 uncached tokens (within the bound of 16);
    # the prefill worker, holding it all, only the last page's 4 tokens: it keeps the turn.
    assert not r.choose(submit(PROMPT), 0.0).local
    r = local_router(decoding_seqs=1, queued_tokens=2)
    holds(r, "d", PROMPT[:36])
    r.observe(beat("p", "prefill", queued_tokens=300), 0.0)  # a long prefill queue
    assert r.choose(submit(PROMPT), 0.0).local  # 2 + 4 against 300 + 40


def test_an_idle_decode_worker_still_shares_a_burst_of_short_prompts():
    r = local_router()
    r.observe(beat("p", "prefill", queued_tokens=20), 0.0)
    assert r.choose(submit(range(10)), 0.0).local  # batch empty, shorter queue: today's rule
    assert not r.choose(submit(range(17)), 0.0).local  # over --local-prefill-tokens


# --- the fake worker's cache ------------------------------------------------------------------


def test_fake_prefix_cache_names_pages_counts_hits_and_evicts_lru():
    cache = FakePrefixCache(page_size=PAGE, capacity=3)
    assert cache.admit(tuple(range(10)), "") == 0  # 2 full pages named
    assert cache.admit(tuple(range(13)), "") == 8  # 2 pages hit, a 3rd named
    stored, evicted = cache.kv_events()
    assert stored == page_hashes(list(range(13)), PAGE) and evicted == []
    cache.admit((9, 9, 9, 9), "")  # a 4th page: the least recently used goes
    stored, evicted = cache.kv_events()
    assert evicted == page_hashes(list(range(4)), PAGE) and len(stored) == 1
    assert cache.prefix_stats() == dict(
        queried_requests=3,
        hit_requests=1,
        queried_tokens=27,
        hit_tokens=8,
        evicted_pages=1,
        cached_pages=3,
    )
    off = FakePrefixCache(PAGE, 3, enabled=False)
    assert off.admit(tuple(range(8)), "") == 0 and off.kv_events() == ([], [])
