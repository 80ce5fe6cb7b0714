"""The scheduler process: a thin async shell over policy.Router and admission.AdmissionQueue.

Flow per request: the gateway's submit is answered at once when it cannot run (no workers, too
long, its lane of the queue full). Otherwise it is placed right away if nothing waits ahead of
it (for a batch request: nothing at all) and the router finds room (for a batch request: within
the batch caps, policy.py), else it waits in its lane for the dispatch loop, which places
interactive requests first and batch ones only while no interactive one waits. Placing a request
(one task each, so placements overlap): pick a decode worker D and a prefill worker P, ask D to
reserve pages (request/reply), then answer the gateway (accepted on P and D) and send P its
assignment; if D refuses, the request goes back to the head of the queue. A prefill worker
dying is not retried here: the gateway fails that request (it knows P from the reply), which
keeps each request's state owned by one process.

Workers' KV events feed the router's index (policy.Router.observe_kv); when a worker's
numbering has a gap the scheduler asks it for a snapshot (KVSnapshotAskMsg).
"""

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass

import nats
from nats.aio.msg import Msg

from services.nats_client import NatsClientOptions, beat_forever, connect_nats
from services.runtime import TaskSet
from services.scheduler.admission import DEFAULT_MAX_WAITING_BATCH, AdmissionQueue, Pending
from services.scheduler.metrics import SchedulerMetrics, serve_metrics
from services.scheduler.policy import Choice, Router
from services.scheduler.routing import RoutingConfig
from shared import protocol, subjects
from shared.errors import ProtocolError
from shared.protocol import (
    CancelMsg,
    DecodeAssignMsg,
    DecodeAssignReplyMsg,
    HeartbeatMsg,
    KVEventsMsg,
    KVSnapshotAskMsg,
    PrefillAssignMsg,
    SchedulerBeatMsg,
    SubmitMsg,
    SubmitReplyMsg,
)
from shared.registry import DEFAULT_MISS_LIMIT, WorkerRegistry

log = logging.getLogger(__name__)
TICK_S = 0.05  # dispatch loop wake-up period without events (deadlines, dead workers)
BEAT_S = 0.5  # gateways fail the submits this scheduler acknowledged after 3 missed beats
SNAPSHOT_ASK_S = 1.0  # a worker out of step is asked for its KV set again this long after


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler settings (CLI flags)."""

    nats_url: str = "nats://127.0.0.1:4222"
    nats: NatsClientOptions | None = None  # credentials and TLS; None: from the environment
    max_waiting: int = 256  # interactive lane bound; beyond it the gateway answers 429
    max_waiting_tokens: int = 0  # ... and of its prompt tokens (0: none)
    max_waiting_batch: int = DEFAULT_MAX_WAITING_BATCH  # the batch lane's bound (admission.py)
    retry_after_s: float = 1.0  # Retry-After suggested with QUEUE_FULL
    assign_timeout_s: float = 5.0  # a decode worker answers reservations between engine steps
    miss_limit: int = DEFAULT_MISS_LIMIT  # missed heartbeats before a worker counts as dead
    startup_grace_s: float = 2.0  # after start, queue requests until workers' first heartbeats
    routing: RoutingConfig = RoutingConfig()  # how workers are picked (routing.py)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # /metrics of the routing decisions; 0: not served

    def __post_init__(self) -> None:
        bounds = (self.max_waiting, self.max_waiting_tokens, self.max_waiting_batch)
        if min(bounds) < 0 or self.retry_after_s <= 0:
            raise ValueError("max_waiting(_tokens, _batch) must be >= 0 and retry_after_s > 0")
        if self.assign_timeout_s <= 0:
            raise ValueError("assign_timeout_s must be > 0")
        if self.miss_limit < 1:
            raise ValueError("miss_limit must be >= 1")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")


class Scheduler:
    """Owns the router and the admission queue; all mutation happens on the event loop."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.router = Router(WorkerRegistry(config.miss_limit), config.routing)
        self.metrics = SchedulerMetrics()
        self.queue = AdmissionQueue(
            config.max_waiting, config.max_waiting_tokens, config.max_waiting_batch
        )
        self._started = float("inf")  # set once heartbeats are heard: the grace counts from then
        self._wake = asyncio.Event()
        self._nc: nats.NATS | None = None
        # Requests being placed (chosen, reservation under way) → cancelled meanwhile?
        self._placing: dict[str, bool] = {}
        self._placements = TaskSet("placing a request")
        self._snapshot_asked: dict[str, float] = {}  # worker id -> when (monotonic)
        self.scheduler_id = f"sched-{uuid.uuid4().hex[:12]}"  # a restart is a new scheduler

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set."""
        self._nc = await connect_nats(self.config.nats_url, "tison-scheduler", self.config.nats)
        nc = self._nc
        await nc.subscribe(subjects.all_heartbeats(), cb=self._on_heartbeat)
        await nc.subscribe(subjects.all_kv_events(), cb=self._on_kv_events)
        self._started = time.time()
        await nc.subscribe(
            subjects.scheduler_submit(), subjects.SCHEDULER_QUEUE_GROUP, cb=self._on_submit
        )
        await nc.subscribe(subjects.gateway_cancel(), cb=self._on_cancel)
        await nc.subscribe(
            subjects.scheduler_ping(), subjects.SCHEDULER_QUEUE_GROUP, cb=self._on_ping
        )
        log.info("scheduler up on %s (%s routing)", self.config.nats_url, self.config.routing.mode)
        served = None
        if self.config.metrics_port:
            host, port = self.config.metrics_host, self.config.metrics_port
            served = await serve_metrics(self.metrics, host, port)
            log.info("routing metrics at http://%s:%d/metrics", host, port)
        dispatcher = asyncio.create_task(self._dispatch_loop())
        beat = protocol.encode(SchedulerBeatMsg(self.scheduler_id, BEAT_S))
        subject = subjects.scheduler_heartbeat(self.scheduler_id)
        beats = asyncio.create_task(beat_forever(nc, subject, beat, BEAT_S))
        try:
            await stop.wait()
        finally:
            if served is not None:
                await served.cleanup()
            dispatcher.cancel()
            beats.cancel()
            await asyncio.gather(
                dispatcher, beats, self._placements.cancel_all(), return_exceptions=True
            )
            with contextlib.suppress(Exception):  # NATS may be gone already at shutdown
                await nc.drain()

    @protocol.on_message(HeartbeatMsg)
    async def _on_heartbeat(self, beat: HeartbeatMsg, msg: Msg) -> None:
        self.router.observe(beat, time.time())
        self._wake.set()

    @protocol.on_message(KVEventsMsg)
    async def _on_kv_events(self, events: KVEventsMsg, msg: Msg) -> None:
        in_step = self.router.observe_kv(events)
        self.metrics.index_pages.labels(events.worker_id).set(
            self.router.index.num_pages(events.worker_id)
        )
        # Out of step: ask for the whole set, once until it has had time to come (every
        # message until then is out of step too: a reconnect would ask once each).
        now = time.monotonic()
        if in_step:
            self._snapshot_asked.pop(events.worker_id, None)
        elif now - self._snapshot_asked.get(events.worker_id, -1e9) >= SNAPSHOT_ASK_S:
            self._snapshot_asked[events.worker_id] = now
            ask = KVSnapshotAskMsg(events.worker_id, reason=f"gap at {events.seq}")
            self.metrics.snapshot_asks.inc()
            subject = subjects.kv_snapshot(events.role, events.worker_id)
            await self._nc.publish(subject, protocol.encode(ask))

    async def _on_ping(self, msg) -> None:
        """The gateway's /health: a scheduler is up and reads NATS."""
        await self._nc.publish(msg.reply, b"")

    @protocol.on_message(CancelMsg)
    async def _on_cancel(self, cancel: CancelMsg, msg: Msg) -> None:
        self.queue.remove(cancel.request_id)
        if cancel.request_id in self._placing:
            self._placing[cancel.request_id] = True

    @protocol.on_message(SubmitMsg)
    async def _on_submit(self, submit: SubmitMsg, msg: Msg) -> None:
        if not msg.reply:
            log.warning("dropped submit %s without a reply subject", submit.request_id)
            return
        pending, now = Pending(submit, msg.reply), time.time()
        status, limit = self.router.admission_status(submit, now)
        if status == protocol.NO_WORKERS and self._starting(now):
            status = protocol.ACCEPTED  # workers are up but not heard from yet: wait for them
        if status == protocol.ACCEPTED and submit.acknowledge:
            # Held from here on: the gateway fails the request at once should we die.
            await self._reply(pending, dict(status=protocol.QUEUED, scheduler_id=self.scheduler_id))
        if status == protocol.ACCEPTED:
            # Placed at once when nothing waits ahead of it; only the rest counts against
            # its lane's bound, so a burst that fits the workers is never refused.
            if not self.queue.waiting_ahead(submit.priority) and self._start_placing(pending, now):
                return
            if self.queue.push(pending):
                return
            status = protocol.QUEUE_FULL
        await self._reply(pending, self._refusal(status, limit, submit.priority))

    def _refusal(self, status: str, limit: int, priority: str = protocol.INTERACTIVE) -> dict:
        if status == protocol.QUEUE_FULL:
            lane = self.queue.lane(priority)
            reason = (
                f"the scheduler's {priority} queue is full "
                f"({len(lane)} waiting, {lane.tokens} tokens)"
            )
            return dict(status=status, reason=reason, retry_after_s=self.config.retry_after_s)
        if status == protocol.TOO_LONG:
            reason = f"no decode worker can hold more than {limit} tokens"
            return dict(status=status, reason=reason, limit=limit)
        if status == protocol.EXPIRED:
            return dict(status=status, reason="deadline passed while queued")
        return dict(status=status, reason="no live prefill and decode workers")

    async def _reply(self, pending: Pending, fields: dict) -> None:
        reply = SubmitReplyMsg(request_id=pending.submit.request_id, **fields)
        await self._nc.publish(pending.reply_to, protocol.encode(reply))

    async def _dispatch_loop(self) -> None:
        while True:
            # Not asyncio.wait_for: before Python 3.12 it swallows a cancel that comes as the
            # event is set (heartbeats set it often), and the scheduler then never stopped.
            woken = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait([woken], timeout=TICK_S)
            finally:
                woken.cancel()
            self._wake.clear()
            try:
                await self._dispatch()
            except Exception:  # a bug here must not stop scheduling for good
                log.exception("dispatch failed")

    async def _dispatch(self) -> None:
        now = time.time()
        for beat in self.router.reap(now):
            log.warning(
                "%s worker %s missed heartbeats; no longer routed to", beat.role, beat.worker_id
            )
            self.metrics.forget_worker(beat.worker_id)
        for pending in self.queue.take_expired(now):
            await self._reply(pending, self._refusal(protocol.EXPIRED, 0))
        while (pending := self.queue.head()) is not None:
            status, limit = self.router.admission_status(pending.submit, now)
            if status == protocol.NO_WORKERS:
                if self._starting(now):
                    return
                for stranded in self.queue.take_all():
                    await self._reply(stranded, self._refusal(status, 0))
                return
            if status == protocol.TOO_LONG:  # queued while no worker had reported its pool yet
                self.queue.pop()
                await self._reply(pending, self._refusal(status, limit))
                continue
            if not self._start_placing(pending, now):
                # no room (a batch head: not within the batch caps): wait for the next
                # heartbeat; an interactive request arriving meanwhile goes ahead of it
                return
            self.queue.pop()

    def _starting(self, now: float) -> bool:
        return now < self._started + self.config.startup_grace_s

    def _start_placing(self, pending: Pending, now: float) -> bool:
        """Pick workers and start placing the request; False when the router finds no room."""
        choice = self.router.choose(pending.submit, now)
        if choice is None:
            return False
        self.router.record(choice, pending.submit)
        self.metrics.observe_choice(choice)
        self._placing[pending.submit.request_id] = False
        self._placements.spawn(self._place(pending, choice))
        return True

    async def _place(self, pending: Pending, choice: Choice) -> None:
        """Reserve pages on D, then answer the gateway and send P its work; requeue if refused."""
        submit = pending.submit
        try:
            reservation = await self._reserve(submit, choice)
        finally:
            cancelled = self._placing.pop(submit.request_id)
        if reservation is None:
            self.router.refused(choice.decode.worker_id)
            if not cancelled:
                self.queue.push_front(pending)
                self._wake.set()
            return
        await self._reply(
            pending,
            dict(
                status=protocol.ACCEPTED,
                prefill_worker=choice.prefill_worker,
                decode_worker=choice.decode.worker_id,
            ),
        )
        if not choice.local:
            await self._assign_prefill(submit, choice, reservation)
        if cancelled:
            # The cancel overtook the reservation: repeat it now that the workers know it.
            cancel = CancelMsg(submit.request_id, reason="cancelled while placing")
            await self._nc.publish(subjects.gateway_cancel(), protocol.encode(cancel))

    async def _assign_prefill(
        self, submit: SubmitMsg, choice: Choice, reservation: DecodeAssignReplyMsg
    ) -> None:
        assignment = PrefillAssignMsg(
            request_id=submit.request_id,
            gateway_id=submit.gateway_id,
            prompt_token_ids=submit.prompt_token_ids,
            sampling=submit.sampling,
            decode_worker=choice.decode.worker_id,
            decode_kv=reservation.kv,
            page_ids=reservation.page_ids,
            decode_cached_tokens=reservation.cached_tokens,
            decode_chunk_page_ids=reservation.chunk_page_ids,
            decode_chunk_first_page=reservation.chunk_first_page,
            background=submit.priority == protocol.BATCH,
        )
        subject = subjects.assign("prefill", choice.prefill.worker_id)
        await self._nc.publish(subject, protocol.encode(assignment))

    async def _reserve(self, submit: SubmitMsg, choice: Choice) -> DecodeAssignReplyMsg | None:
        ask = DecodeAssignMsg(
            request_id=submit.request_id,
            gateway_id=submit.gateway_id,
            prefill_worker=choice.prefill_worker,
            prompt_token_ids=submit.prompt_token_ids,
            sampling=submit.sampling,
            prefill_here=choice.local,
            background=submit.priority == protocol.BATCH,
        )
        subject = subjects.assign("decode", choice.decode.worker_id)
        try:
            msg = await self._nc.request(
                subject, protocol.encode(ask), timeout=self.config.assign_timeout_s
            )
            reply = protocol.decode(msg.data, DecodeAssignReplyMsg)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, ProtocolError) as e:
            log.warning("decode worker %s did not reserve: %r", choice.decode.worker_id, e)
            return None
        if not reply.accepted:
            log.info("decode worker %s refused: %s", choice.decode.worker_id, reply.reason)
            return None
        return reply
