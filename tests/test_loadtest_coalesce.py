"""The gateway's coalescing of deltas that queued up behind a slow client (a control-plane
speed-up made for the load tests): text and logprobs concatenate, errors stay separate."""

from services.gateway.request_state import Delta, coalesce
from shared import protocol
from shared.protocol import TokenLogprob


def lp(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id, -0.5, (token_id,), (-0.5,))


def test_text_and_logprobs_concatenate_and_the_finish_is_kept():
    deltas = [Delta("He", (lp(1),)), Delta("llo", (lp(2),)), Delta("!", (lp(3),), "length")]
    assert coalesce(deltas) == [Delta("Hello!", (lp(1), lp(2), lp(3)), "length")]
    assert coalesce([]) == []
    assert coalesce([Delta("a")]) == [Delta("a")]


def test_an_error_is_not_merged_into_the_text_before_it():
    error = Delta(finish_reason=protocol.FINISH_ERROR, error="worker died")
    assert coalesce([Delta("a"), Delta("b"), error]) == [Delta("ab"), error]
    abort = Delta(finish_reason=protocol.FINISH_ABORT, error="aborted")
    assert coalesce([abort]) == [abort]


def test_nothing_is_merged_after_a_finish():
    done = Delta("x", (), "stop")
    assert coalesce([done, Delta("y")]) == [done, Delta("y")]
