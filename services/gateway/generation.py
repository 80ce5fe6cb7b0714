"""One sequence through the workers: submit it, its Deltas as they come, cancel at its end.

A request of n choices (or best_of candidates) runs n Generations of the same prompt. Whatever
way a Generation ends (finished, stop string, client gone, worker dead, timeout), `close`
publishes a cancel unless the decode worker finished it itself, so both workers free its pages.
"""

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.gateway.control import ControlPlane, OpenRequest
from services.gateway.metrics import GatewayMetrics
from services.gateway.request_state import Delta, RequestStream, coalesce
from shared import protocol
from shared.protocol import SubmitMsg, SubmitReplyMsg
from shared.sampling.params import SamplingParams
from shared.tokenizer.tokenizer import Tokenizer

_ENDED_BY_WORKER = (protocol.FINISH_STOP, protocol.FINISH_LENGTH)


class Refused(Exception):
    """The scheduler did not take the sequence (queue full, no workers, expired, too long)."""

    def __init__(self, reply: SubmitReplyMsg):
        super().__init__(reply.reason or reply.status)
        self.reply = reply


@dataclass(frozen=True)
class Timing:
    """Limits of one request: queueing (scheduler) and arrival to last token; and its lane."""

    arrived: float  # time.monotonic() at arrival
    queue_timeout_s: float
    request_timeout_s: float
    priority: str = protocol.INTERACTIVE  # SubmitMsg.priority (x-tison-priority)


class Generation:
    """One sequence: prompt ids + SamplingParams in, Deltas out."""

    def __init__(
        self,
        control: ControlPlane,
        metrics: GatewayMetrics,
        tokenizer: Tokenizer,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        session_id: str,
        timing: Timing,
    ):
        self.control, self.metrics, self.timing = control, metrics, timing
        self.request_id = request_id
        self.stream = RequestStream(tokenizer, prompt_ids, sampling)
        self._submit = SubmitMsg(
            request_id,
            control.gateway_id,
            tuple(prompt_ids),
            sampling,
            deadline=time.time() + timing.queue_timeout_s,
            session_id=session_id,
            priority=timing.priority,
        )
        self._opened: OpenRequest | None = None
        self.started = asyncio.Event()  # its first output (or its end) arrived

    async def submit(self) -> None:
        """Hands the sequence to the scheduler; raises Refused when it is not taken."""
        self._opened = self.control.open(self.request_id)
        reply = await self.control.submit(self._submit, self.timing.queue_timeout_s + 5)
        if reply.status != protocol.ACCEPTED:
            raise Refused(reply)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Deltas until the sequence ends (after `submit`); records TTFT, ITL and E2E. Items
        that queued up while the previous delta was being written leave as one delta."""
        stream, timing = self.stream, self.timing
        deadline = timing.arrived + timing.request_timeout_s
        last_token_at, seen = None, 0
        while not stream.done:
            try:
                items = await _get_queued(self._opened, deadline - time.monotonic())
            except asyncio.TimeoutError:
                self.started.set()
                yield stream.fail(f"no output within {timing.request_timeout_s} s")
                return
            deltas = [d for d in map(stream.accept, items) if d is not None]
            self.started.set()
            now = time.monotonic()
            if stream.num_output > seen:
                new, seen = stream.num_output - seen, stream.num_output
                if last_token_at is None:
                    self.metrics.ttft.observe(now - timing.arrived)
                else:
                    for _ in range(new):
                        self.metrics.itl.observe((now - last_token_at) / new)
                last_token_at = now
            for delta in coalesce(deltas):
                yield delta
        self.metrics.e2e.observe(time.monotonic() - timing.arrived)

    async def close(self) -> None:
        """Stop routing its tokens; cancel it on the workers unless they ended it."""
        self.started.set()
        if self._opened is None:
            return
        self.control.forget(self.request_id)
        stream = self.stream
        if stream.finish_reason not in _ENDED_BY_WORKER or stream.stopped_by_string:
            await self.control.cancel(self.request_id, stream.error or "ended by the gateway")


async def _get_queued(opened: OpenRequest, timeout_s: float) -> list:
    """Every item queued now, waiting up to `timeout_s` for one when there is none."""
    queue = opened.items
    items = [] if queue.qsize() else [await asyncio.wait_for(queue.get(), max(timeout_s, 0.0))]
    while queue.qsize():
        items.append(queue.get_nowait())
    return items
