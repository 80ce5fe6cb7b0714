"""Decode reservations never strand pages: a retried reservation gets the pages it holds, one
whose KV never comes is dropped after its lease (a real decode worker over real NATS)."""

import asyncio

import nats

from shared import protocol, subjects
from shared.protocol import DecodeAssignMsg, DecodeAssignReplyMsg
from shared.sampling.params import SamplingParams

from services_harness import Services, next_heartbeat

GREEDY = SamplingParams(temperature=0, max_tokens=12)


async def test_a_reservation_retried_is_the_same_and_one_never_used_expires(
    tiny_model_factory, tmp_path
):
    """The scheduler retries a reservation whose reply it missed: the decode worker answers
    with the pages it holds (not "already running"); a reservation whose KV never comes frees
    its pages after the lease (here 1 s)."""

    model_dir = tiny_model_factory("llama")
    with Services(tmp_path, model_dir) as s:
        s.start("decode", "decode", "--model", str(model_dir), "--dtype", "float32",
                "--worker-id", "d0", "--heartbeat", "0.2", "--reservation-lease", "1")  # fmt: skip
        idle = await next_heartbeat(s.nats.url, "decode")
        nc = await nats.connect(s.nats.url)
        ask = DecodeAssignMsg("r1", "gw", "p0", tuple(range(3, 40)), GREEDY)
        replies = []
        for _ in range(2):
            msg = await nc.request(
                subjects.assign("decode", "d0"), protocol.encode(ask), timeout=30
            )
            replies.append(protocol.decode(msg.data, DecodeAssignReplyMsg))
        await nc.close()
        assert all(r.accepted for r in replies) and replies[0].page_ids == replies[1].page_ids
        held = await next_heartbeat(s.nats.url, "decode")
        assert held.free_pages == idle.free_pages - len(replies[0].page_ids)
        await asyncio.sleep(1.5)
        assert (await next_heartbeat(s.nats.url, "decode")).free_pages == idle.free_pages
        assert "reservation dropped" in s.logs()
