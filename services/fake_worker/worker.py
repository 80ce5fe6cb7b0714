"""The fake worker process: one or both roles over one NATS connection, plus heartbeats and
each role's KV events (its own FakePrefixCache)."""

import asyncio
import contextlib
import logging

from services.fake_worker.config import FakeWorkerConfig
from services.fake_worker.decode import FakeDecode
from services.fake_worker.prefill import FakePrefill
from services.fake_worker.tokens import FakeModelInfo
from services.nats_client import connect_nats
from services.worker.kv_events import KVEventsPublisher
from shared import protocol, subjects
from shared.protocol import HeartbeatMsg, PrefixStats

log = logging.getLogger(__name__)
ROLE_CLASSES = {"prefill": FakePrefill, "decode": FakeDecode}


async def run_fake_worker(config: FakeWorkerConfig, stop: asyncio.Event) -> None:
    """Serve the configured roles until `stop` is set."""
    info = FakeModelInfo.from_dir(config.model_dir)
    nc = await connect_nats(config.nats_url, f"tison-{config.worker_id}", config.nats)
    roles = [ROLE_CLASSES[r](nc, config, info, wid) for r, wid in config.role_ids().items()]
    publishers = [_kv_publisher(nc, config, role) for role in roles]
    for role, publisher in zip(roles, publishers):
        await role.subscribe()
        await publisher.subscribe()
    log.info("fake worker %s up: %s", config.worker_id, [r.worker_id for r in roles])
    tasks = [asyncio.create_task(role.run()) for role in roles]
    tasks.append(asyncio.create_task(_heartbeats(nc, config, info, roles)))
    tasks += [asyncio.create_task(publisher.run()) for publisher in publishers]
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):  # NATS may be gone already at shutdown
            await nc.drain()


def _kv_publisher(nc, config: FakeWorkerConfig, role) -> KVEventsPublisher:
    async def events() -> tuple[list[int], list[int]]:
        return role.cache.kv_events()

    return KVEventsPublisher(nc, {role.role: role.worker_id}, events, config.heartbeat_s)


async def _heartbeats(nc, config: FakeWorkerConfig, info: FakeModelInfo, roles) -> None:
    model = config.served_model_name or info.name
    max_model_len = config.max_model_len or info.max_model_len
    while True:
        for role in roles:
            beat = HeartbeatMsg(
                worker_id=role.worker_id,
                role=role.role,
                model=model,
                max_model_len=max_model_len,
                interval_s=config.heartbeat_s,
                page_size=config.page_size,
                prefix=PrefixStats(**role.cache.prefix_stats()),
                dropped_messages=protocol.DROPPED.total(),
                **role.load(),
            )
            await nc.publish(subjects.heartbeat(role.role, role.worker_id), protocol.encode(beat))
        await asyncio.sleep(config.heartbeat_s)
