"""The batch runner: runs the lines of batches, inside each gateway process.

Lines come from the work stream through one durable consumer that every runner shares, so
the gateways split the work and a line held by a runner that dies goes to another after
store.ACK_WAIT_S. Each line is posted to this gateway's own HTTP endpoint with
`x-tison-priority: batch`: it gets exactly what the same request sent interactively gets
(validation, chat template, sampling, response body), and the scheduler admits it behind
every interactive request. Its result is stored before the line is acked, and stored once
(store.Batches.put_result), so a line is never lost and never answered twice; a line whose
result is already there (its runner died between the two) is only acked.

A failure that is not the line's own (the gateway unreachable, 429, 5xx: a scheduler or a
worker died, a queue was full) sends the line back to the stream, to run again after a
backoff, MAX_ATTEMPTS times at most; a 4xx is the line's result.
"""

import asyncio
import logging
import time

import aiohttp
import nats.errors
import nats.js.errors
from nats.js import api
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.batch.store import ACK_WAIT_S, EXPIRED_MESSAGE, WORK_STREAM, BatchError, Batches
from services.gateway.openai_request import PRIORITY_HEADER
from services.runtime import TaskSet
from shared import protocol, subjects
from shared.batch_messages import (
    CANCELLED,
    CANCELLING,
    FAILED,
    BatchItemMsg,
    BatchMsg,
    BatchResultMsg,
    unrun,
)
from shared.errors import ProtocolError

log = logging.getLogger("tison.batch")

CONSUMER = "tison-batch-runners"  # the durable consumer all runners share
MAX_ATTEMPTS = 20  # deliveries of a line whose failures are not its own, before they are
RETRY = {429, 500, 502, 503, 504}  # HTTP statuses that are not the line's fault
BATCH_CACHE_S = 2.0  # how long a batch's record is taken as current (cancels show this late)


def backoff_s(attempt: int) -> float:
    """Delay before delivery `attempt` + 1 of a line that failed through no fault of its own."""
    return min(30.0, 0.5 * 2 ** (attempt - 1))


class RunnerMetrics:
    """What a runner did, on the gateway's /metrics."""

    def __init__(self, registry: CollectorRegistry | None = None):
        registry = registry if registry is not None else CollectorRegistry()
        self.lines = Counter(
            "tison_batch_lines",
            "Batch lines a runner ended: ok (HTTP 200), failed (any other result), retried "
            "(sent back to run again), skipped (result there already, or batch cancelled)",
            ["outcome"],
            registry=registry,
        )
        self.running = Gauge("tison_batch_lines_running", "Batch lines running", registry=registry)


class BatchRunner:
    def __init__(
        self,
        batches: Batches,
        base_url: str,
        api_key: str,
        concurrency: int,
        metrics: RunnerMetrics | None = None,
    ):
        self.batches, self.base_url, self.concurrency = batches, base_url.rstrip("/"), concurrency
        self.metrics = metrics or RunnerMetrics()
        self._headers = {PRIORITY_HEADER: protocol.BATCH}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._records: dict[str, tuple[float, BatchMsg | None]] = {}  # batch id -> (read at, it)
        self._refreshing: set[str] = set()  # batches with a completion check pending
        self._checks = TaskSet("checking a batch's completion")

    async def run(self, stop: asyncio.Event) -> None:
        """Take and run lines until `stop` is set; the lines still running then go back."""
        sub = await self.batches.js.pull_subscribe(
            subjects.all_batch_work(),
            durable=CONSUMER,
            stream=WORK_STREAM,
            config=api.ConsumerConfig(ack_wait=ACK_WAIT_S, max_deliver=-1, max_ack_pending=-1),
        )
        tasks = TaskSet("running a batch line")
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            try:
                while not stop.is_set():
                    free = self.concurrency - len(tasks)
                    if free <= 0:
                        await tasks.wait_any(1.0)
                        continue
                    try:
                        msgs = await sub.fetch(free, timeout=1.0)
                    except (nats.errors.TimeoutError, asyncio.TimeoutError):  # nothing to run
                        continue
                    except (nats.errors.Error, nats.js.errors.Error, OSError) as e:
                        log.warning("batch: cannot take lines (%r); trying again", e)
                        await asyncio.sleep(1.0)
                        continue
                    for msg in msgs:
                        tasks.spawn(self._line(http, msg))
            finally:
                await tasks.cancel_all()
                await self._checks.cancel_all()

    async def _line(self, http: aiohttp.ClientSession, msg) -> None:
        try:
            with self.metrics.running.track_inprogress():
                await self._run(http, msg)
        except asyncio.CancelledError:
            await _quietly(msg.nak())  # stopping: another runner takes it now
            raise
        except Exception as e:  # NATS lost mid-way and the like: the line comes back
            log.warning("batch line failed (%s); it will be delivered again", e)

    async def _run(self, http: aiohttp.ClientSession, msg) -> None:
        try:
            item = protocol.decode(msg.data, BatchItemMsg)
        except ProtocolError as e:
            protocol.dropped(BatchItemMsg.KIND, msg.subject, e)
            await msg.term()
            return
        batches = self.batches
        if await batches.result(item.batch_id, item.key) is not None:
            await msg.ack_sync()  # it ran; its runner died before acking
            self.metrics.lines.labels("skipped").inc()
            return
        batch = await self._batch(item.batch_id)
        if batch is None or batch.status in (CANCELLING, CANCELLED, FAILED):
            await msg.ack_sync()
            self.metrics.lines.labels("skipped").inc()
            return
        if batches.clock() > batch.expires_at:
            result = unrun(item, "batch_expired", EXPIRED_MESSAGE)
        else:
            status, body = await self._post(http, msg, item)
            attempt = msg.metadata.num_delivered
            if (status is None or status in RETRY) and attempt < MAX_ATTEMPTS:
                log.info("batch line %s: %s; again in %.1f s", item.key, status, backoff_s(attempt))
                await msg.nak(delay=backoff_s(attempt))
                self.metrics.lines.labels("retried").inc()
                return
            if status is None:
                result = unrun(item, "gateway_unreachable", body)
            else:
                result = BatchResultMsg(
                    item.batch_id, item.key, item.custom_id, item.line, status, body
                )
        stored = await batches.put_result(result)
        await msg.ack_sync()
        outcome = "skipped" if not stored else "failed" if result.failed else "ok"
        self.metrics.lines.labels(outcome).inc()
        self._check_done_soon(item.batch_id)

    async def _post(self, http: aiohttp.ClientSession, msg, item: BatchItemMsg):
        """(HTTP status, body text), or (None, why) when the gateway could not be reached.
        Tells the stream the line is in progress while it runs, so it is not given away."""

        async def keep_alive() -> None:
            while True:
                await asyncio.sleep(ACK_WAIT_S / 3)
                await _quietly(msg.in_progress())

        alive = asyncio.ensure_future(keep_alive())
        headers = {**self._headers, "Content-Type": "application/json"}
        try:
            async with http.post(
                self.base_url + item.url, data=item.body.encode(), headers=headers
            ) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            return None, f"the gateway did not answer ({e})"
        finally:
            alive.cancel()

    async def _batch(self, batch_id: str) -> BatchMsg | None:
        read_at, record = self._records.get(batch_id, (0.0, None))
        if time.monotonic() - read_at > BATCH_CACHE_S:
            try:
                record = await self.batches.batch(batch_id)
            except BatchError:  # deleted
                record = None
            self._records[batch_id] = (time.monotonic(), record)
        return record

    def _check_done_soon(self, batch_id: str) -> None:
        """Records the batch as completed once its last line is in: one check per batch and
        half second at most, however many lines land meanwhile."""
        if batch_id in self._refreshing:
            return
        self._refreshing.add(batch_id)

        async def check() -> None:
            try:
                await asyncio.sleep(0.5)
                await self.batches.refresh(batch_id)
            except (nats.errors.Error, nats.js.errors.Error) as e:  # the next poll records it
                log.debug("batch %s: completion check failed (%s)", batch_id, e)
            finally:
                self._refreshing.discard(batch_id)

        self._checks.spawn(check())


async def _quietly(call) -> None:
    try:
        await call
    except Exception:
        pass
