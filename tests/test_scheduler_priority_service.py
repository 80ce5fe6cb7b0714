"""The scheduler's shell with the batch lane, NATS replaced by a stub that accepts every
reservation: a batch request held back by the share cap waits in its lane while interactive
requests arriving later are placed at once, and it is placed once a heartbeat shows room."""

import asyncio
import time
from types import SimpleNamespace

from services.scheduler.service import Scheduler, SchedulerConfig
from shared import protocol
from shared.protocol import (
    BATCH,
    INTERACTIVE,
    DecodeAssignMsg,
    DecodeAssignReplyMsg,
    HeartbeatMsg,
    SubmitMsg,
    SubmitReplyMsg,
)
from shared.sampling.params import SamplingParams


class StubNats:
    """Accepts every reservation; keeps the replies sent to the gateway's inboxes."""

    def __init__(self) -> None:
        self.replies: dict[str, str] = {}  # request id → last SubmitReplyMsg.status

    async def request(self, subject: str, data: bytes, timeout: float):
        ask = protocol.decode(data, DecodeAssignMsg)
        reply = DecodeAssignReplyMsg(ask.request_id, True, page_ids=(1, 2))
        return SimpleNamespace(data=protocol.encode(reply))

    async def publish(self, subject: str, data: bytes) -> None:
        if subject.startswith("inbox."):
            reply = protocol.decode(data, SubmitReplyMsg)
            self.replies[reply.request_id] = reply.status


def beat(worker_id: str, role: str, **load) -> HeartbeatMsg:
    return HeartbeatMsg(worker_id, role, "m", 4096, 0.5, page_size=4, **load)


async def submit(scheduler: Scheduler, request_id: str, priority: str) -> None:
    sampling, deadline = SamplingParams(max_tokens=2), time.time() + 60
    msg = SubmitMsg(request_id, "gw", (1,) * 6, sampling, deadline, priority=priority)
    data, inbox = protocol.encode(msg), f"inbox.{request_id}"
    await scheduler._on_submit(SimpleNamespace(data=data, subject="submit", reply=inbox))
    await asyncio.gather(*scheduler._placements._tasks)


async def test_a_held_back_batch_request_does_not_block_later_interactive_ones():
    scheduler = Scheduler(SchedulerConfig())
    scheduler._nc = nats = StubNats()
    scheduler._started = time.time() - 60  # past the start-up grace
    now = time.time()
    scheduler.router.observe(beat("d", "decode", free_pages=10, total_pages=10), now)
    scheduler.router.observe(beat("p", "prefill"), now)
    for name in ("b1", "b2", "b3"):  # 2 pages each; a share of 0.5 is 5 of the 10 pages
        await submit(scheduler, name, BATCH)
    assert nats.replies == {"b1": protocol.ACCEPTED, "b2": protocol.ACCEPTED}
    assert len(scheduler.queue.lane(BATCH)) == 1
    await submit(scheduler, "i1", INTERACTIVE)
    await scheduler._dispatch()
    await submit(scheduler, "i2", INTERACTIVE)
    assert nats.replies["i1"] == nats.replies["i2"] == protocol.ACCEPTED
    assert "b3" not in nats.replies  # still over the share
    scheduler.router.observe(beat("d", "decode", free_pages=10, total_pages=10), time.time())
    await scheduler._dispatch()
    await asyncio.gather(*scheduler._placements._tasks)
    assert nats.replies["b3"] == protocol.ACCEPTED and len(scheduler.queue) == 0
