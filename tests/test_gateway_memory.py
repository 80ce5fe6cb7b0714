"""HeapTrimmer (services/gateway/memory.py): a burst of large requests trims the heap once,
when its last request ends; small requests never do; on glibc the trim is the real one."""

import asyncio
import platform

from services.gateway.memory import LARGE_BODY_BYTES, HeapTrimmer


def test_glibc_has_malloc_trim():
    if platform.libc_ver()[0] == "glibc":
        assert HeapTrimmer().available


async def test_a_burst_trims_once_when_its_last_large_request_ends():
    trimmer = HeapTrimmer()
    if not trimmer.available:  # not glibc: nothing is ever trimmed
        async with trimmer.request(LARGE_BODY_BYTES):
            pass
        assert trimmer.trims == 0
        return
    release = asyncio.Event()

    async def request(size: int) -> None:
        async with trimmer.request(size):
            await release.wait()

    tasks = [asyncio.create_task(request(LARGE_BODY_BYTES)) for _ in range(3)]
    tasks.append(asyncio.create_task(request(100)))  # a small one beside them
    await asyncio.sleep(0)
    assert trimmer.in_flight == 3 and trimmer.trims == 0
    release.set()
    await asyncio.gather(*tasks)
    assert trimmer.in_flight == 0 and trimmer.trims == 1
    async with trimmer.request(LARGE_BODY_BYTES - 1):
        pass
    assert trimmer.trims == 1


async def test_a_failing_request_still_trims_and_is_no_longer_counted():
    trimmer = HeapTrimmer()
    try:
        async with trimmer.request(LARGE_BODY_BYTES):
            raise ValueError("handler failed")
    except ValueError:
        pass
    assert trimmer.in_flight == 0
    assert trimmer.trims == (1 if trimmer.available else 0)
