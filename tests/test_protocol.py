"""Wire contract: round trips, rejection of malformed messages, subjects, and a real nats-server."""

import asyncio

import msgpack
import nats
import pytest

from shared import protocol, subjects
from shared.errors import ProtocolError
from shared.nats_server import NatsServer
from shared.protocol import (
    CancelMsg,
    DecodeAssignMsg,
    DecodeAssignReplyMsg,
    HeartbeatMsg,
    KVEventsMsg,
    KVPool,
    KVRankPool,
    KvReadyMsg,
    KVSnapshotAskMsg,
    PrefillAssignMsg,
    PrefixStats,
    SubmitMsg,
    SubmitReplyMsg,
    TokenItem,
    TokenLogprob,
    TokensMsg,
    Usage,
    WeightsAskMsg,
    WeightsOfferMsg,
)
from shared.sampling.params import SamplingParams
from shared.sampling.structured import JSON, StructuredOutput

POOL = KVPool(
    "mha:L2:H2:D8:S16:bfloat16",
    "host-1",
    (KVRankPool((0, 2), (0, 1), "/dev/shm/a"), KVRankPool((0, 2), (1, 2), "/dev/shm/a-r1")),
    tcp="h:1",
)
SAMPLING = SamplingParams(max_tokens=7, temperature=0.5, stop=("x", "yz"), seed=3, logprobs=2)
CONSTRAINED = SamplingParams(
    structured=StructuredOutput(JSON, '{"type": "integer"}'), logit_bias={5: -100, 2: 0.5}
)

EXAMPLES = [
    SubmitMsg("r1", "gw1", (1, 2, 3), SAMPLING, deadline=123.5),
    SubmitReplyMsg("r1", protocol.QUEUE_FULL, reason="busy", retry_after_s=1.0),
    SubmitReplyMsg("r1", protocol.ACCEPTED, prefill_worker="p1", decode_worker="d1"),
    CancelMsg("r1", reason="disconnect"),
    HeartbeatMsg("d1", "decode", "m", 256, 0.5, free_pages=3),
    HeartbeatMsg("d1", "decode", "m", 256, 0.5, prefix=PrefixStats(4, 2, 64, 32, 1, 9)),
    KVEventsMsg("d1", "decode", 3, stored=(2**64 - 1, 5), evicted=(7,)),
    KVEventsMsg("d1", "decode", 0, stored=(1,), reset=True),
    KVSnapshotAskMsg("d1", reason="gap at 4"),
    WeightsAskMsg("tiny-llama"),
    WeightsOfferMsg("d1", "tiny-llama", "10.0.0.2:4711", compressed=True),
    SubmitMsg("r2", "gw1", (1,), SAMPLING, deadline=1.0, session_id="chat-7"),
    SubmitMsg("r3", "gw1", (1,), CONSTRAINED, deadline=1.0),
    SubmitMsg("r4", "gw1", (1,), SAMPLING, deadline=1.0, priority=protocol.BATCH),
    DecodeAssignMsg("r1", "gw1", "p1", (5, 6), SAMPLING),
    DecodeAssignReplyMsg("r1", True, page_ids=(4, 9), kv=POOL),
    PrefillAssignMsg("r1", "gw1", (5, 6), SAMPLING, "d1", POOL, (4, 9)),
    KvReadyMsg("r1", "p1", True, 42, TokenLogprob(42, -0.25, (42, 7), (-0.25, -2.0))),
    KvReadyMsg("r1", "p1", False, error="transfer failed"),
    KvReadyMsg(
        "r1",
        "p1",
        True,
        42,
        prompt_logprobs=(TokenLogprob(6, -1.5, (3, 6), (-0.5, -1.5)), TokenLogprob(9, -0.75)),
    ),
    TokensMsg(
        "d1",
        (
            TokenItem("r1", 1, (4, 5), finish_reason="length", usage=Usage(2, 3)),
            TokenItem("r2", 0, (), finish_reason="error", error="boom"),
            TokenItem("r3", 0, (8,), prompt_logprobs=(TokenLogprob(5, -2.0, (1,), (-0.125,)),)),
        ),
    ),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert protocol.decode(protocol.encode(msg), type(msg)) == msg


def test_body_carries_version_and_kind():
    body = msgpack.unpackb(protocol.encode(CancelMsg("r9")))
    assert body == {"v": protocol.SCHEMA_VERSION, "t": "cancel", "request_id": "r9", "reason": ""}


def _body(msg, **changes):
    body = msgpack.unpackb(protocol.encode(msg))
    body.update(changes)
    return msgpack.packb(body)


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1garbage",
        msgpack.packb([1, 2]),
        _body(CancelMsg("r"), v=2),
        _body(CancelMsg("r"), t="submit"),
        _body(CancelMsg("r"), request_id=5),
        msgpack.packb({"v": 1, "t": "cancel"}),
    ],
)
def test_malformed_cancel_is_rejected(data):
    with pytest.raises(ProtocolError):
        protocol.decode(data, CancelMsg)


def test_nested_fields_are_type_checked():
    submit = EXAMPLES[0]
    bad_sampling = dict(msgpack.unpackb(protocol.encode(submit))["sampling"], temperature=-1)
    for change in (
        {"prompt_token_ids": [1, "a"]},
        {"prompt_token_ids": 3},
        {"sampling": bad_sampling},
        {"deadline": True},
    ):
        with pytest.raises(ProtocolError):
            protocol.decode(_body(submit, **change), SubmitMsg)


def test_an_unknown_priority_is_a_malformed_submit():
    submit = EXAMPLES[0]
    assert protocol.decode(protocol.encode(submit), SubmitMsg).priority == protocol.INTERACTIVE
    for bad, problem in [("urgent", "priority: must be one of"), (1, "expected str")]:
        with pytest.raises(ProtocolError, match=problem):
            protocol.decode(_body(submit, priority=bad), SubmitMsg)


def test_logit_bias_pairs_are_checked_as_int_then_float():
    submit = SubmitMsg("r3", "gw1", (1,), CONSTRAINED, deadline=1.0)
    sampling = msgpack.unpackb(protocol.encode(submit))["sampling"]
    assert sampling["logit_bias"] == [[2, 0.5], [5, -100.0]]
    assert sampling["structured"] == {"kind": "json", "value": '{"type": "integer"}'}
    whole = protocol.decode(_body(submit, sampling=dict(sampling, logit_bias=[[2, 1]])), SubmitMsg)
    assert whole.sampling.logit_bias == ((2, 1.0),)  # an integer bias is a number
    for bad, where in [
        ([[2]], "logit_bias"),  # not a pair
        ([[2, 0.5, 1]], "logit_bias"),
        ([[2.0, 0.5]], "logit_bias.[]"),  # the id must be an int
        ([[2, "x"]], "logit_bias.[]"),
        ([[2, 101]], "sampling"),  # SamplingParams' own range check
    ]:
        with pytest.raises(ProtocolError, match=where.replace("[", r"\[")):
            protocol.decode(_body(submit, sampling=dict(sampling, logit_bias=bad)), SubmitMsg)


def test_unknown_fields_are_ignored_and_defaults_filled():
    data = msgpack.packb({"v": 1, "t": "cancel", "request_id": "r", "future": [1]})
    assert protocol.decode(data, CancelMsg) == CancelMsg("r")


def test_subjects():
    assert subjects.heartbeat("decode", "d-1") == "tison.v1.decode.heartbeat.d-1"
    assert subjects.assign("prefill", "p") == "tison.v1.prefill.assign.p"
    assert subjects.gateway_tokens("g") == "tison.v1.gateway.tokens.g"
    assert subjects.decode_kv("d") == "tison.v1.decode.kv.d"
    assert subjects.kv_events("prefill", "p") == "tison.v1.prefill.kv_events.p"
    assert subjects.all_kv_events() == "tison.v1.*.kv_events.*"
    assert subjects.kv_snapshot("decode", "d") == "tison.v1.decode.kv_snapshot.d"
    with pytest.raises(ValueError):
        subjects.heartbeat("decode", "a.b")
    with pytest.raises(ValueError):
        subjects.assign("router", "x")


def _matches(wildcard: str, subject: str) -> bool:
    """NATS matching of `*` tokens (no `>` in these)."""
    want, got = wildcard.split("."), subject.split(".")
    return len(want) == len(got) and all(w in ("*", g) for w, g in zip(want, got, strict=True))


def test_gateway_beats_are_not_worker_heartbeats():
    """Every subscriber of worker heartbeats would drop (and log) a gateway's beat a second."""
    beat = subjects.gateway_heartbeat("gw-1")
    assert _matches(subjects.all_gateway_heartbeats(), beat)
    assert not _matches(subjects.all_heartbeats(), beat)
    assert _matches(subjects.all_heartbeats(), subjects.heartbeat("decode", "d-1"))


async def test_messages_cross_a_real_nats_server(tmp_path):
    with NatsServer(tmp_path / "nats") as server:
        nc = await nats.connect(server.url)
        got: asyncio.Queue = asyncio.Queue()

        async def on_msg(msg):
            await got.put(protocol.decode(msg.data, HeartbeatMsg))

        await nc.subscribe(subjects.all_heartbeats(), cb=on_msg)
        beat = EXAMPLES[4]
        await nc.publish(subjects.heartbeat("decode", "d1"), protocol.encode(beat))
        assert await asyncio.wait_for(got.get(), 5) == beat
        await nc.close()
    assert not server._accepts()


def test_a_pool_nested_in_a_plan_round_trips_and_names_a_bad_field():
    assert protocol.from_plain(KVPool, protocol.to_plain(POOL)) == POOL
    plain = protocol.to_plain(POOL)
    plain["ranks"][1]["units"] = "0-1"
    with pytest.raises(ProtocolError, match=r"KVPool\.ranks\.\[\]\.units"):
        protocol.from_plain(KVPool, plain)


async def test_a_flood_of_garbage_is_counted_and_logged_once(caplog):
    """Every malformed message counts in DROPPED; the log gets one line per kind per
    DROP_LOG_S, not one per message."""

    class Handler:
        handled = 0

        @protocol.on_message(CancelMsg)
        async def on_cancel(self, body, msg) -> None:
            self.handled += 1

    class Msg:
        subject, data = "tison.v1.gateway.cancel", b"\x93not a message"

    handler, before = Handler(), protocol.DROPPED["cancel"]
    with caplog.at_level("WARNING", logger="shared.protocol"):
        for _ in range(100):
            await handler.on_cancel(Msg())
    assert protocol.DROPPED["cancel"] - before == 100 and handler.handled == 0
    assert len([r for r in caplog.records if "dropped cancel" in r.message]) <= 1
