"""The batch lane without NATS: interactive requests first, a batch lane of its own bound, and
the router's batch caps (a decode pool's share, a computing worker's queued prompt tokens)."""

import pytest
from router_helpers import PAGE, beat

from services.scheduler.admission import AdmissionQueue, Pending
from services.scheduler.policy import Router
from services.scheduler.routing import RoutingConfig
from shared.errors import InvalidRequestError
from shared.kv.block_hash import page_hashes
from shared.protocol import BATCH, INTERACTIVE, KVEventsMsg, SubmitMsg
from shared.sampling.params import SamplingParams


def submit(request_id="r", priority=INTERACTIVE, prompt_len=6, deadline=100.0):
    sampling = SamplingParams(max_tokens=2)
    prompt = tuple(range(prompt_len))
    return SubmitMsg(request_id, "gw", prompt, sampling, deadline, priority=priority)


def pending(request_id, priority=INTERACTIVE, **kw) -> Pending:
    return Pending(submit(request_id, priority, **kw), f"inbox.{request_id}")


def router(*beats, **config) -> Router:
    r = Router(config=RoutingConfig(**config))
    for b in beats:
        r.observe(b, 0.0)
    return r


def drain(q: AdmissionQueue) -> list[str]:
    order = []
    while (head := q.head()) is not None:
        assert q.pop() is head
        order.append(head.submit.request_id)
    return order


def test_interactive_requests_go_first_whatever_the_arrival_order():
    q = AdmissionQueue(max_waiting=8)
    for name, priority in [("b1", BATCH), ("i1", INTERACTIVE), ("b2", BATCH), ("i2", INTERACTIVE)]:
        assert q.push(pending(name, priority))
    assert len(q) == 4 and q.tokens == 24  # both lanes
    assert q.waiting_ahead(INTERACTIVE) == 2 and q.waiting_ahead(BATCH) == 4
    assert drain(q) == ["i1", "i2", "b1", "b2"]
    assert q.waiting_ahead(BATCH) == 0


def test_fifo_within_the_batch_lane_and_a_requeued_one_keeps_its_turn():
    q = AdmissionQueue(max_waiting=8)
    for name in ("b1", "b2", "b3"):
        assert q.push(pending(name, BATCH))
    first = q.pop()
    q.push(pending("i1"))
    q.push_front(first)  # its reservation was refused
    assert drain(q) == ["i1", "b1", "b2", "b3"]


def test_a_full_batch_lane_refuses_batch_submits_only():
    q = AdmissionQueue(max_waiting=1, max_waiting_tokens=10, max_waiting_batch=2)
    assert q.push(pending("b1", BATCH)) and q.push(pending("b2", BATCH))
    assert not q.push(pending("b3", BATCH))
    assert q.push(pending("i1"))  # the batch lane's requests count neither bound here
    assert not q.push(pending("i2"))  # the interactive lane is full now
    assert len(q.lane(BATCH)) == 2 and q.lane(INTERACTIVE).tokens == 6
    long = pending("b-long", BATCH, prompt_len=50)  # no token bound on the batch lane
    assert q.remove("b1") and q.push(long)


def test_cancel_and_expiry_in_the_batch_lane():
    q = AdmissionQueue(max_waiting=4, max_waiting_batch=4)
    early, late = pending("b-early", BATCH, deadline=5.0), pending("b-late", BATCH, deadline=9.0)
    gone, waiting = pending("b-gone", BATCH), pending("i", deadline=20.0)
    for p in (early, late, gone, waiting):
        assert q.push(p)
    assert q.remove("b-gone") and not q.remove("b-gone")
    assert q.take_expired(6.0) == [early]
    assert q.lane(BATCH).tokens == 6 and q.tokens == 12
    assert q.take_expired(9.0) == [late] and drain(q) == ["i"]
    q.push(early)
    assert q.take_all() == [early] and len(q) == 0 and q.tokens == 0


def test_an_unknown_priority_is_refused_when_built():
    with pytest.raises(InvalidRequestError, match="priority"):
        submit(priority="urgent")


def test_batch_fills_a_decode_pool_up_to_its_share_and_resumes_after_a_heartbeat():
    r = router(beat("d"), beat("p", "prefill"))  # 100 pages, share 0.5
    batch, interactive = submit("b", BATCH), submit("i")  # 2 pages each
    for _ in range(25):  # 50 pages: the share
        choice = r.choose(batch, 0.0)
        assert choice is not None
        r.record(choice, batch)
    assert r.choose(batch, 0.0) is None  # 52 of 100 pages would be in use
    assert r.choose(interactive, 0.0) is not None  # interactive requests take the rest
    r.observe(beat("d", free_pages=52), 0.1)  # 48 in use: 2 more pages stay within the share
    assert r.choose(batch, 0.1) is not None
    r.observe(beat("d", free_pages=51), 0.2)
    assert r.choose(batch, 0.2) is None
    r.observe(beat("d", free_pages=100), 0.3)  # the load dropped
    assert r.choose(batch, 0.3) is not None


def test_the_share_picks_among_decode_workers_and_one_means_no_cap():
    d1, d2 = beat("d1", free_pages=40), beat("d2", free_pages=90, running_seqs=3)
    r = router(d1, d2, beat("p", "prefill"))
    assert r.choose(submit("i"), 0.0).decode.worker_id == "d1"  # fewer running sequences
    assert r.choose(submit("b", BATCH), 0.0).decode.worker_id == "d2"  # within the share
    r = router(beat("d", free_pages=3), beat("p", "prefill"), batch_max_share=1.0)
    assert r.choose(submit("b", BATCH), 0.0) is not None  # 99 of 100 pages in use after


def test_an_idle_decode_worker_takes_a_batch_prompt_larger_than_the_share():
    r = router(beat("d", free_pages=10, total_pages=10), beat("p", "prefill"))
    big = submit("b", BATCH, prompt_len=27)  # 7 of 10 pages
    assert r.choose(big, 0.0) is not None  # nothing else is there: it would never run otherwise
    r.observe(beat("d", free_pages=9, total_pages=10), 0.1)
    assert r.choose(big, 0.1) is None


def test_batch_waits_while_the_prefill_queue_is_long_and_resumes_after_a_heartbeat():
    r = router(beat("d"), beat("p", "prefill", queued_tokens=1024))  # the default cap
    batch = submit("b", BATCH)
    assert r.choose(batch, 0.0) is None
    assert r.choose(submit("i"), 0.0) is not None
    r.observe(beat("p", "prefill", queued_tokens=1023), 0.1)
    assert r.choose(batch, 0.1) is not None
    # what was assigned since the heartbeat counts too
    r = router(beat("d"), beat("p", "prefill"), batch_prefill_tokens=12)
    r.record(r.choose(batch, 0.0), batch)  # 6 tokens queued
    r.record(r.choose(batch, 0.0), batch)  # 12
    assert r.choose(batch, 0.0) is None
    r.observe(beat("p", "prefill", queued_tokens=0), 0.1)
    assert r.choose(batch, 0.1) is not None


def test_a_batch_prompt_is_not_computed_by_a_decode_worker_with_a_long_queue():
    """The cap holds for whichever worker computes the prompt: the decode worker's own queue
    stops it computing a batch prompt, which then goes to the prefill worker."""
    prompt = tuple(range(100, 116))  # 16 tokens; the decode worker holds 12 of them
    d = beat("d", local_prefill=True, decoding_seqs=1, queued_tokens=50)
    r = router(d, beat("p", "prefill", queued_tokens=40), batch_prefill_tokens=50)
    hashes = tuple(page_hashes(list(prompt), PAGE, ""))
    assert r.observe_kv(KVEventsMsg("d", "decode", 0, stored=hashes, reset=True))
    sampling = SamplingParams(max_tokens=2)
    interactive = SubmitMsg("i", "gw", prompt, sampling, 100.0)
    assert r.choose(interactive, 0.0).local  # it extends the KV it holds
    choice = r.choose(SubmitMsg("b", "gw", prompt, sampling, 100.0, priority=BATCH), 0.0)
    assert not choice.local and choice.prefill_worker == "p"


@pytest.mark.parametrize(
    "config", [dict(batch_max_share=0), dict(batch_max_share=1.5), dict(batch_prefill_tokens=0)]
)
def test_batch_caps_are_validated(config):
    with pytest.raises(ValueError, match="batch_"):
        RoutingConfig(**config)
