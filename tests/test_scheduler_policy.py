"""Scheduler policy without NATS: admission statuses, routing by load, the bounded queue."""

from services.scheduler.admission import AdmissionQueue, Pending
from services.scheduler.policy import Router
from services.scheduler.routing import LOCAL_PREFILL_TOKENS
from shared import protocol
from shared.protocol import HeartbeatMsg, SubmitMsg
from shared.sampling.params import SamplingParams


def beat(worker_id, role="decode", **load):
    load.setdefault("page_size", 4)
    return HeartbeatMsg(worker_id, role, "m", 256, 0.5, **load)


def submit(request_id="r", prompt_len=6, max_tokens=2, deadline=100.0):
    sampling = SamplingParams(max_tokens=max_tokens)
    return SubmitMsg(request_id, "gw", tuple(range(prompt_len)), sampling, deadline)


def router(*beats, now=0.0):
    r = Router()
    for b in beats:
        r.observe(b, now)
    return r


def test_admission_needs_both_roles_and_a_big_enough_pool():
    only_decode = router(beat("d", free_pages=10, total_pages=10))
    assert only_decode.admission_status(submit(), 0.0)[0] == protocol.NO_WORKERS
    r = router(beat("d", free_pages=1, total_pages=2), beat("p", role="prefill"))
    assert r.admission_status(submit(prompt_len=6, max_tokens=2), 0.0) == (protocol.ACCEPTED, 8)
    assert r.admission_status(submit(prompt_len=6, max_tokens=3), 0.0) == (protocol.TOO_LONG, 8)
    assert r.admission_status(submit(), 10.0)[0] == protocol.NO_WORKERS  # all expired
    # a worker whose capped chunked layers share its pool holds fewer tokens of one sequence
    capped = beat("d", free_pages=20, total_pages=20, max_sequence_tokens=40)
    r = router(capped, beat("p", role="prefill"))
    assert r.admission_status(submit(prompt_len=38, max_tokens=2), 0.0) == (protocol.ACCEPTED, 40)
    assert r.admission_status(submit(prompt_len=39, max_tokens=2), 0.0) == (protocol.TOO_LONG, 40)


def test_a_data_parallel_worker_has_room_for_what_one_rank_holds():
    """Two ranks of 2 free pages each: a request of 2 pages fits, one of 3 does not (its
    pages would be one rank's), though 4 pages are free in all."""
    dp = beat("d-dp", free_pages=4, rank_free_pages=2, total_pages=8)
    r = router(dp, beat("p", role="prefill"))
    assert r.choose(submit(prompt_len=6, max_tokens=2), 0.0).decode.worker_id == "d-dp"
    assert r.choose(submit(prompt_len=10, max_tokens=2), 0.0) is None


def test_routes_to_least_loaded_decode_with_room_and_counts_assignments():
    r = router(
        beat("d-busy", free_pages=50, total_pages=50, running_seqs=5, decoding_seqs=5),
        beat("d-full", free_pages=1, total_pages=50, running_seqs=0),
        beat("d-idle", free_pages=9, total_pages=50, running_seqs=1, decoding_seqs=1),
        beat("p1", role="prefill", queued_tokens=100),
        beat("p2", role="prefill", queued_tokens=10),
    )
    req = submit(prompt_len=6, max_tokens=2)  # 2 pages
    choice = r.choose(req, 0.0)
    assert (choice.decode.worker_id, choice.prefill.worker_id) == ("d-idle", "p2")
    # Until the next heartbeats, assignments add to the reported load.
    for _ in range(4):
        r.record(r.choose(req, 0.0), req)
    # d-idle: 1 + 4 seqs, 9 - 8 pages = 1 free → no room; d-busy takes over; p2 has 10 + 24.
    choice = r.choose(req, 0.0)
    assert choice.decode.worker_id == "d-busy"
    assert choice.prefill.worker_id == "p2"
    r.observe(beat("d-idle", free_pages=9, total_pages=50, running_seqs=1, decoding_seqs=1), 0.1)
    assert r.choose(req, 0.1).decode.worker_id == "d-idle"
    r.refused("d-idle")
    assert r.choose(req, 0.1).decode.worker_id == "d-busy"


def test_an_idle_decode_worker_computes_short_prompts_of_a_burst():
    """Join the shorter queue: while the decode worker's batch is empty, a short prompt goes to
    it when it has fewer prompt tokens to compute than the prefill worker."""
    idle = beat("d", free_pages=100, total_pages=100, local_prefill=True)
    r = router(idle, beat("p", role="prefill"))
    burst = [submit(f"r{i}", prompt_len=8) for i in range(4)]
    sides = []
    for req in burst:
        choice = r.choose(req, 0.0)
        r.record(choice, req)
        sides.append(choice.prefill_worker)
    # the first: both queues empty, the prefill worker; then the shorter queue each time
    assert sides == ["p", "d", "p", "d"]
    roomy = beat("d", free_pages=10_000, total_pages=10_000, local_prefill=True)
    r = router(roomy, beat("p", role="prefill"))
    local = 0
    for i in range(6):
        req = submit(f"b{i}", prompt_len=LOCAL_PREFILL_TOKENS // 2)
        choice = r.choose(req, 0.0)
        r.record(choice, req)
        local += choice.local
    assert local == 2  # then the decode worker's share (LOCAL_PREFILL_TOKENS) is full
    long = submit("long", prompt_len=LOCAL_PREFILL_TOKENS + 1)
    r = router(roomy, beat("p", "prefill", queued_tokens=9))
    assert not r.choose(long, 0.0).local  # long prompts: always the prefill worker
    assert r.choose(submit(), 0.0).local
    busy = beat("d", free_pages=100, total_pages=100, decoding_seqs=1, local_prefill=True)
    r = router(busy, beat("p", role="prefill", queued_tokens=500))
    assert not r.choose(submit(), 0.0).local  # running streams never wait for a prompt
    fake = beat("d", free_pages=100, total_pages=100)  # cannot compute prompts
    assert not router(fake, beat("p", "prefill", queued_tokens=500)).choose(submit(), 0.0).local


def test_no_choice_when_no_decode_worker_has_room():
    r = router(beat("d", free_pages=1, total_pages=10), beat("p", role="prefill"))
    assert r.choose(submit(prompt_len=6, max_tokens=2), 0.0) is None
    assert r.choose(submit(prompt_len=2, max_tokens=2), 0.0) is not None


def test_room_is_the_prompt_and_one_token_whatever_max_tokens():
    """The decode worker admits a request when its prompt and next token fit and grows it as it
    decodes: a long max_tokens neither keeps a request from a worker nor counts against it."""
    r = router(beat("d", free_pages=2, total_pages=40), beat("p", role="prefill"))
    long = submit("long", prompt_len=7, max_tokens=150)  # 8 tokens now: 2 pages of 4
    assert r.admission_status(long, 0.0)[0] == protocol.ACCEPTED
    r.record(r.choose(long, 0.0), long)
    assert r.choose(submit(prompt_len=1), 0.0) is None  # its 2 pages count until the next beat
    r = router(beat("d", free_pages=1, total_pages=40), beat("p", role="prefill"))
    assert r.choose(submit(prompt_len=4, max_tokens=1), 0.0) is None  # 4 + 1 tokens: 2 pages


def test_reap_forgets_dead_workers():
    r = router(beat("d", free_pages=9, total_pages=9), beat("p", role="prefill"))
    assert {b.worker_id for b in r.reap(5.0)} == {"d", "p"}
    assert r.choose(submit(), 5.0) is None


def test_admission_queue_bound_cancel_and_deadlines():
    q = AdmissionQueue(max_waiting=2)
    a, b, c = (
        Pending(submit(n, deadline=d), f"inbox.{n}") for n, d in [("a", 5), ("b", 9), ("c", 9)]
    )
    assert q.push(a) and q.push(b) and not q.push(c)
    assert q.remove("b") and not q.remove("b")
    assert q.push(c) and len(q) == 2
    assert q.take_expired(6.0) == [a]
    assert q.head() is c and q.pop() is c
    q.push_front(c)
    assert q.take_all() == [c] and len(q) == 0


def test_admission_queue_bounds_its_prompt_tokens():
    """A burst of long prompts is refused (429) once the queued tokens would exceed the bound;
    a lone request longer than the bound still waits alone; every way out returns its tokens."""
    q = AdmissionQueue(max_waiting=10, max_waiting_tokens=100)

    def pending(name: str, tokens: int) -> Pending:
        return Pending(submit(name, prompt_len=tokens), f"inbox.{name}")

    a, b, c, huge = pending("a", 60), pending("b", 40), pending("c", 1), pending("h", 500)
    assert q.push(a) and q.push(b) and q.tokens == 100
    assert not q.push(c)  # 101 tokens
    assert q.pop() is a and q.push(c) and q.tokens == 41
    assert q.remove("b") and q.remove("c") and q.tokens == 0
    assert q.push(huge) and not q.push(c) and q.take_all() == [huge] and q.tokens == 0
