"""The fake worker process: one or both roles over one NATS connection, plus heartbeats."""

import asyncio
import contextlib
import logging

from services.fake_worker.config import FakeWorkerConfig
from services.fake_worker.decode import FakeDecode
from services.fake_worker.prefill import FakePrefill
from services.fake_worker.tokens import FakeModelInfo
from services.runtime import connect_nats
from shared import protocol, subjects
from shared.protocol import HeartbeatMsg

log = logging.getLogger(__name__)
ROLE_CLASSES = {"prefill": FakePrefill, "decode": FakeDecode}


async def run_fake_worker(config: FakeWorkerConfig, stop: asyncio.Event) -> None:
    """Serve the configured roles until `stop` is set."""
    info = FakeModelInfo.from_dir(config.model_dir)
    nc = await connect_nats(config.nats_url, f"tison-{config.worker_id}")
    roles = [ROLE_CLASSES[r](nc, config, info, wid) for r, wid in config.role_ids().items()]
    for role in roles:
        await role.subscribe()
    log.info("fake worker %s up: %s", config.worker_id, [r.worker_id for r in roles])
    tasks = [asyncio.create_task(role.run()) for role in roles]
    tasks.append(asyncio.create_task(_heartbeats(nc, config, info, roles)))
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):  # NATS may be gone already at shutdown
            await nc.drain()


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
                **role.load(),
            )
            await nc.publish(subjects.heartbeat(role.role, role.worker_id), protocol.encode(beat))
        await asyncio.sleep(config.heartbeat_s)
