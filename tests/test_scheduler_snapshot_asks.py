"""The scheduler asks a worker whose KV events are out of step for a snapshot once, not once a
message: every message until the snapshot comes is out of step too (a reconnect, or a
scheduler that started after the workers, delivers a run of them). A real scheduler on a real
nats-server; the worker's side is this test, publishing its messages by hand."""

import asyncio

import nats
import pytest

from services.scheduler import service
from services.scheduler.service import Scheduler, SchedulerConfig
from shared import protocol, subjects
from shared.nats_server import NatsServer
from shared.protocol import KVEventsMsg, KVSnapshotAskMsg

from waiting import until


@pytest.fixture
async def scheduler(tmp_path, monkeypatch):
    # A window far longer than the burst below takes, even on a loaded host.
    monkeypatch.setattr(service, "SNAPSHOT_ASK_S", 3.0)
    with NatsServer(tmp_path / "nats") as server:
        stop = asyncio.Event()
        task = asyncio.create_task(Scheduler(SchedulerConfig(nats_url=server.url)).run(stop))
        nc = await nats.connect(server.url)
        try:
            yield nc
        finally:
            await nc.close()
            stop.set()
            await task


async def test_a_run_of_out_of_step_messages_gets_one_ask(scheduler):
    nc = scheduler
    asks: list[KVSnapshotAskMsg] = []

    async def on_ask(msg) -> None:
        asks.append(protocol.decode(msg.data, KVSnapshotAskMsg))

    await nc.subscribe(subjects.kv_snapshot("decode", "d9"), cb=on_ask)

    async def send(seq: int, reset: bool = False) -> None:
        events = KVEventsMsg("d9", "decode", seq, stored=(seq,), reset=reset)
        await nc.publish(subjects.kv_events("decode", "d9"), protocol.encode(events))
        await nc.flush()

    # Numbered past 0: the scheduler never saw this worker's set. It may not have subscribed
    # yet (it starts beside this client), so the first messages go until it answers.
    seq = 5
    async with asyncio.timeout(10):
        while not asks:
            await send(seq)
            seq += 1
            await asyncio.sleep(0.02)
    more = seq
    for seq in range(more, more + 10):  # ten more, out of step too
        await send(seq)
    await asyncio.sleep(0.3)
    assert [a.worker_id for a in asks] == ["d9"]  # one, for all of them

    await asyncio.sleep(service.SNAPSHOT_ASK_S)  # still out of step a while later: asked again
    await send(seq + 1)
    await until(lambda: len(asks) == 2, 5, "the second ask")

    snapshot = seq + 2
    await send(snapshot, reset=True)  # the snapshot: in step from here
    for seq in range(snapshot + 1, snapshot + 4):
        await send(seq)
    await asyncio.sleep(0.3)
    assert len(asks) == 2
    await send(seq + 10)  # a gap after being in step: asked at once
    await until(lambda: len(asks) == 3, 5, "the ask after a gap")
