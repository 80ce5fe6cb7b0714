"""How the chaos scenario (loadtest/scenarios/chaos.py) files a stream's end, and when it calls
that end truthful about the kill."""

import aiohttp

from loadtest.scenarios.chaos_streams import (
    CUT,
    DROPPED,
    ERROR,
    FINISHED,
    HTTP,
    HUNG,
    StreamEnd,
    classify,
    names_victim,
)


def test_classify_each_kind():
    assert classify("length", None, None) == (FINISHED, "length")
    assert classify(None, "worker decode-x died while holding the request", None)[0] == ERROR
    assert classify("error", None, None)[0] == ERROR
    assert classify(None, None, aiohttp.ClientPayloadError("cut"))[0] == DROPPED
    assert classify(None, None, TimeoutError())[0] == HUNG
    assert classify(None, None, None)[0] == CUT
    assert classify(None, "no workers", None, status=503) == (HTTP, "http 503: no workers")


def test_an_error_text_is_truncated():
    kind, detail = classify(None, "x" * 1000, None)
    assert kind == ERROR and len(detail) < 200


def test_truthful_names_the_victim():
    died = StreamEnd(ERROR, "worker decode-vm-1-ab died while holding the request")
    assert names_victim(died, "decode")
    assert not names_victim(died, "nats")  # NATS died, the text blames a worker
    assert names_victim(StreamEnd(FINISHED, "length"), "prefill")  # not served by the victim
    assert names_victim(StreamEnd(DROPPED, "ServerDisconnectedError"), "gateway")
    assert not names_victim(StreamEnd(DROPPED, "ServerDisconnectedError"), "decode")
    assert not names_victim(StreamEnd(HUNG), "scheduler")
