"""The gateway's view of the schedulers: is one answering, and is the one that holds a request
still alive.

A submit goes to the scheduler queue group; the scheduler that takes it acknowledges at once
(SubmitReplyMsg QUEUED, with its id) and answers once the request is placed or refused. Each
scheduler beats on scheduler_heartbeat(id); a submit whose scheduler stops beating for
BEAT_MISSES intervals fails at once (it died holding the request: no answer will come), as
does every waiting submit when no scheduler answers the pings or the gateway loses NATS. Without
the acknowledgement, a scheduler restarted faster than the pings notice left its requests to
wait out the queue timeout (60 s).
"""

import asyncio
import dataclasses
import time

import nats
from nats.aio.msg import Msg

from shared import protocol, subjects
from shared.errors import ProtocolError
from shared.protocol import SchedulerBeatMsg, SubmitMsg, SubmitReplyMsg

SCHEDULER_PING_S, PING_MISSES = 1.0, 3  # the schedulers are lost after 3 missed pings
BEAT_MISSES = 3  # a scheduler silent this many beat intervals is dead
POLL_S = 0.1  # how often a waiting submit checks that its scheduler lives
NO_RESPONDERS = "503"  # the Status header NATS replies with when nobody subscribes


def _refused(submit: SubmitMsg, reason: str) -> SubmitReplyMsg:
    return SubmitReplyMsg(submit.request_id, protocol.NO_WORKERS, reason=reason)


class SchedulerLink:
    def __init__(self, nc: nats.NATS):
        self._nc = nc
        self.lost = asyncio.Event()  # set while no scheduler answers the pings
        self.nats_losses = 0  # the gateway's NATS connection dropped this many times
        self._beats: dict[str, tuple[float, float]] = {}  # id -> (monotonic seen, interval)

    async def subscribe(self) -> None:
        await self._nc.subscribe(subjects.all_scheduler_heartbeats(), cb=self._on_beat)

    @protocol.on_message(SchedulerBeatMsg)
    async def _on_beat(self, beat: SchedulerBeatMsg, msg: Msg) -> None:
        self._beats[beat.scheduler_id] = (time.monotonic(), beat.interval_s)

    def dead(self, scheduler_id: str) -> bool:
        """A scheduler heard beating once and silent since for BEAT_MISSES intervals."""
        seen = self._beats.get(scheduler_id)
        return seen is not None and time.monotonic() - seen[0] > BEAT_MISSES * seen[1]

    async def answers(self, timeout_s: float = 1.0) -> bool:
        """Whether NATS is reachable and a scheduler answers a ping within `timeout_s`."""
        if not self._nc.is_connected:
            return False
        try:
            await self._nc.request(subjects.scheduler_ping(), b"", timeout=timeout_s)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return False
        return True

    async def ping_forever(self) -> None:
        """Every SCHEDULER_PING_S: lost after PING_MISSES missed pings in a row, found again at
        its first answer."""
        missed = 0
        while True:
            await asyncio.sleep(SCHEDULER_PING_S)
            if await self.answers():
                missed = 0
                self.lost.clear()
            else:
                missed += 1
                if missed >= PING_MISSES:
                    self.lost.set()
            for sid in [s for s in self._beats if self.dead(s)]:
                if time.monotonic() - self._beats[sid][0] > 60:  # long gone: forget it
                    del self._beats[sid]

    async def submit(self, submit: SubmitMsg, timeout_s: float) -> SubmitReplyMsg:
        """The scheduler's answer to `submit`, or a NO_WORKERS reply saying why none will come."""
        if not self._nc.is_connected:
            return _refused(submit, "NATS is unreachable from the gateway")
        losses = self.nats_losses
        inbox = self._nc.new_inbox()
        sub = await self._nc.subscribe(inbox)
        try:
            asked = protocol.encode(dataclasses.replace(submit, acknowledge=True))
            await self._nc.publish(subjects.scheduler_submit(), asked, inbox)
            deadline, holder = time.monotonic() + timeout_s, ""
            while True:
                if self.nats_losses != losses:
                    return _refused(submit, "the gateway lost its connection to NATS while "
                                            "the request waited")  # fmt: skip
                if self.lost.is_set():
                    return _refused(submit, "the scheduler stopped answering while the "
                                            "request waited")  # fmt: skip
                if holder and self.dead(holder):
                    return _refused(submit, f"scheduler {holder} died holding the request")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return _refused(submit, "the scheduler did not answer (TimeoutError)")
                try:
                    msg = await sub.next_msg(timeout=min(POLL_S, remaining))
                except nats.errors.TimeoutError:
                    continue
                if msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
                    return _refused(submit, "the scheduler did not answer (no scheduler)")
                try:
                    reply = protocol.decode(msg.data, SubmitReplyMsg)
                except ProtocolError as e:
                    return _refused(submit, str(e))
                if reply.status != protocol.QUEUED:
                    return reply
                holder = reply.scheduler_id
        finally:
            await sub.unsubscribe()
