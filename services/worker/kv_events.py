"""Publishes a worker process's KV events (shared/kv/events.py has the protocol): once a
heartbeat interval, for each of its role ids, what its prefix cache named and dropped. Torch-
free, so the fake worker publishes through it too."""

import asyncio
import logging
from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.aio.msg import Msg

from shared import protocol, subjects
from shared.kv.events import KVEventStream
from shared.protocol import KVSnapshotAskMsg

log = logging.getLogger(__name__)

Events = Callable[[], Awaitable[tuple[list[int], list[int]]]]  # the engine's kv_events()


class KVEventsPublisher:
    """One stream per role id of the process, all fed by one cache (a colocated worker's roles
    share an engine); the owner of those streams."""

    def __init__(self, nc: Client, role_ids: dict[str, str], events: Events, interval_s: float):
        self.nc, self.events, self.interval_s = nc, events, interval_s
        self.streams = {wid: KVEventStream(wid, role) for role, wid in role_ids.items()}

    async def subscribe(self) -> None:
        for stream in self.streams.values():
            subject = subjects.kv_snapshot(stream.role, stream.worker_id)
            await self.nc.subscribe(subject, cb=self._on_ask)

    @protocol.on_message(KVSnapshotAskMsg)
    async def _on_ask(self, ask: KVSnapshotAskMsg, msg: Msg) -> None:
        stream = self.streams.get(ask.worker_id)
        if stream is not None:
            log.info("KV snapshot asked of %s (%s)", ask.worker_id, ask.reason)
            stream.ask_snapshot()

    async def publish_once(self) -> None:
        """One engine report to every role's stream, and their messages out."""
        stored, evicted = await self.events()
        for stream in self.streams.values():
            subject = subjects.kv_events(stream.role, stream.worker_id)
            for msg in stream.messages(stored, evicted):
                await self.nc.publish(subject, protocol.encode(msg))

    async def run(self) -> None:
        """Publish every interval until cancelled."""
        while True:
            await self.publish_once()
            await asyncio.sleep(self.interval_s)
