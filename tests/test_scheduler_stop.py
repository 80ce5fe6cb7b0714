"""The scheduler's dispatch loop stops when cancelled, even as a heartbeat wakes it in the same
instant: asyncio.wait_for (Python < 3.12) swallowed exactly that cancel, and a scheduler
stopped in-process then hung forever (a clean-clone CI run hung in test_kv_routing_e2e)."""

import asyncio

from services.scheduler.service import Scheduler, SchedulerConfig


async def test_the_dispatch_loop_stops_when_cancelled_as_it_is_woken():
    scheduler = Scheduler(SchedulerConfig())
    for _ in range(50):
        task = asyncio.create_task(scheduler._dispatch_loop())
        await asyncio.sleep(0)  # waiting for its wake-up
        scheduler._wake.set()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2)
        assert done, "the cancel was swallowed: the loop runs on"
