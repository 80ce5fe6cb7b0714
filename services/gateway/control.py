"""The gateway's side of NATS: submit, cancel, token demultiplexing, worker liveness.

Every open request has a queue that this module fills with its TokenItems (demultiplexed by
request id from the gateway's token subject). A watchdog fails a request whose decode worker
died, or whose prefill worker died before decode took over, by queueing an error item: nothing
waits on a dead worker for longer than its missed heartbeats plus one grace period. When the
gateway's own NATS connection drops, every open request fails at once, saying so: NATS does
not replay what was published to it meanwhile, so its tokens cannot be complete.
"""

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import nats
from nats.aio.msg import Msg

from services.gateway.metrics import GatewayMetrics
from services.gateway.scheduler_link import SchedulerLink
from services.nats_client import NatsClientOptions, beat_forever, connect_nats
from shared import protocol, subjects
from shared.protocol import (
    CancelMsg,
    GatewayBeatMsg,
    HeartbeatMsg,
    SubmitMsg,
    SubmitReplyMsg,
    TokenItem,
    TokensMsg,
)
from shared.registry import WorkerRegistry

log = logging.getLogger(__name__)
WATCHDOG_S = 0.1
GATEWAY_BEAT_S = 1.0  # decode workers cancel a gateway's requests after 3 missed beats
# After NATS is back, the cancels of the requests its loss failed go out again at these
# delays: a worker that reconnects after the gateway did must still hear them.
RECANCEL_AFTER_S = (0.0, 1.0, 2.0, 4.0, 8.0)


@dataclass
class OpenRequest:
    """A request between submit and its end, as seen from the NATS side."""

    request_id: str
    items: asyncio.Queue = field(default_factory=asyncio.Queue)  # TokenItems, in arrival order
    prefill_worker: str = ""  # from the submit reply
    decode_worker: str = ""
    accepted_at: float = 0.0  # unix time of the submit reply; 0 before
    decode_started: bool = False  # an item arrived: the decode worker has it, prefill is done
    failed: bool = False  # the watchdog queued an error item


class ControlPlane:
    """NATS connection, worker registry and open requests of one gateway."""

    def __init__(
        self,
        gateway_id: str,
        nats_url: str,
        metrics: GatewayMetrics,
        miss_limit: int,
        dead_grace_s: float,
        nats_options: NatsClientOptions | None = None,  # None: the environment's
    ):
        self.gateway_id = gateway_id
        self.nats_url, self.nats_options = nats_url, nats_options
        self.metrics = metrics
        self.registry = WorkerRegistry(miss_limit)
        self.dead_grace_s = dead_grace_s  # a worker unseen this long after the reply is dead
        self._open: dict[str, OpenRequest] = {}
        self._nc: nats.NATS | None = None
        self._watchdog: asyncio.Task | None = None
        self._beats: asyncio.Task | None = None
        self._pings: asyncio.Task | None = None
        self.schedulers: SchedulerLink | None = None  # once connected
        self._lost_with_nats: set[str] = set()  # requests failed by it: cancel them when back
        self._recancels: asyncio.Task | None = None

    async def start(self) -> None:
        self._nc = await connect_nats(
            self.nats_url,
            f"tison-{self.gateway_id}",
            self.nats_options,
            on_lost=self._on_nats_lost,
            on_back=self._on_nats_back,
        )
        await self._nc.subscribe(subjects.gateway_tokens(self.gateway_id), cb=self._on_tokens)
        await self._nc.subscribe(subjects.all_heartbeats(), cb=self._on_heartbeat)
        self.schedulers = SchedulerLink(self._nc)
        await self.schedulers.subscribe()
        self._watchdog = asyncio.create_task(self._watch())
        # decode workers cancel the requests of a gateway that stops beating (orphans)
        beat = protocol.encode(GatewayBeatMsg(self.gateway_id, GATEWAY_BEAT_S))
        subject = subjects.gateway_heartbeat(self.gateway_id)
        self._beats = asyncio.create_task(beat_forever(self._nc, subject, beat, GATEWAY_BEAT_S))
        self._pings = asyncio.create_task(self.schedulers.ping_forever())

    async def close(self) -> None:
        for task in (self._watchdog, self._beats, self._pings, self._recancels):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._nc is not None:
            with contextlib.suppress(Exception):  # NATS may be gone already at shutdown
                await self._nc.drain()

    async def scheduler_answers(self, timeout_s: float = 1.0) -> bool:
        return self.schedulers is not None and await self.schedulers.answers(timeout_s)

    def alive(self, role: str) -> list[HeartbeatMsg]:
        return self.registry.alive(role, time.time())

    def open(self, request_id: str) -> OpenRequest:
        """Start routing this request's tokens to a queue (before submitting it)."""
        request = self._open[request_id] = OpenRequest(request_id)
        return request

    def forget(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    async def submit(self, submit: SubmitMsg, timeout_s: float) -> SubmitReplyMsg:
        """Ask a scheduler to run the request (scheduler_link.py: a NO_WORKERS reply as soon
        as no answer can come)."""
        reply = await self.schedulers.submit(submit, timeout_s)
        request = self._open.get(submit.request_id)
        if reply.status == protocol.ACCEPTED and request is not None:
            request.prefill_worker, request.decode_worker = (
                reply.prefill_worker,
                reply.decode_worker,
            )
            request.accepted_at = time.time()
        return reply

    async def cancel(self, request_id: str, reason: str) -> None:
        """Tell the scheduler and every worker to drop the request and free its pages."""
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.publish(
                subjects.gateway_cancel(), protocol.encode(CancelMsg(request_id, reason))
            )

    @protocol.on_message(TokensMsg)
    async def _on_tokens(self, tokens: TokensMsg, msg: Msg) -> None:
        self.metrics.observe_tokens(tokens, time.time())
        for item in tokens.items:
            request = self._open.get(item.request_id)
            if request is None:
                continue  # finished or cancelled here already
            request.decode_started = True  # every item comes from the decode worker
            request.items.put_nowait(item)

    async def _on_nats_lost(self) -> None:
        """Fails every open request: what was published to this gateway while it is away is
        gone, so no stream could be completed. Their cancels leave once NATS is back."""
        if self.schedulers is not None:
            self.schedulers.nats_losses += 1  # the submits waiting fail
        error = "the gateway lost its connection to NATS (its tokens cannot be complete)"
        for request in self._open.values():
            if not request.failed:
                request.failed = True
                item = TokenItem(
                    request.request_id, 0, finish_reason=protocol.FINISH_ERROR, error=error
                )
                request.items.put_nowait(item)
                self._lost_with_nats.add(request.request_id)

    async def _on_nats_back(self) -> None:
        ids, self._lost_with_nats = self._lost_with_nats, set()
        if ids:
            self._recancels = asyncio.create_task(self._recancel(ids))

    async def _recancel(self, request_ids: set[str]) -> None:
        """The workers keep decoding what nobody reads until a cancel reaches them."""
        waited = 0.0
        for at in RECANCEL_AFTER_S:
            await asyncio.sleep(at - waited)
            waited = at
            for request_id in request_ids:
                await self.cancel(request_id, "the gateway lost its connection to NATS")

    @protocol.on_message(HeartbeatMsg)
    async def _on_heartbeat(self, beat: HeartbeatMsg, msg: Msg) -> None:
        if self.registry.observe(beat, time.time()):
            log.info("%s worker %s joined", beat.role, beat.worker_id)
        self.metrics.observe_worker(beat)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_S)
            now = time.time()
            for beat in self.registry.reap(now):
                log.warning("%s worker %s stopped sending heartbeats", beat.role, beat.worker_id)
                self.metrics.forget_worker(beat)
            for request in list(self._open.values()):
                if not request.failed and (dead := self._dead_worker(request, now)):
                    request.failed = True
                    error = f"worker {dead} died or is unreachable (its heartbeats stopped)"
                    item = TokenItem(
                        request.request_id, 0, finish_reason=protocol.FINISH_ERROR, error=error
                    )
                    request.items.put_nowait(item)

    def _dead_worker(self, request: OpenRequest, now: float) -> str | None:
        if not request.accepted_at or now - request.accepted_at < self.dead_grace_s:
            return None
        if not self.registry.is_alive(request.decode_worker, now):
            return request.decode_worker
        if not request.decode_started and not self.registry.is_alive(request.prefill_worker, now):
            return request.prefill_worker
        return None
