"""How every service process runs: logging, uvloop where available, stop on SIGINT/SIGTERM."""

import asyncio
import gc
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine

from shared.errors import TisonError
from shared.proc import process_age_s

log = logging.getLogger(__name__)


def run_service(main: Callable[[asyncio.Event], Awaitable[None]], log_level: str = "INFO") -> int:
    """Run `main(stop)` on a fresh event loop; `stop` is set on SIGINT or SIGTERM."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    age_s = process_age_s()
    if age_s is not None:  # start-up phases (loadtest/startup.py): interpreter and imports
        log.info("process started %.2f s ago (interpreter and imports)", age_s)
    try:
        import uvloop
    except ImportError:  # uvloop is not built for every platform
        uvloop = None

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    try:
        (uvloop.run if uvloop is not None else asyncio.run)(runner())
    except TisonError as e:  # bad flags, model folder or shape: the message names it
        log.error("%s", e)
        return 2
    return 0


def freeze_heap() -> None:
    """Moves every object alive once a service has started (torch, a worker's model modules:
    ~190K of them there) out of the garbage collector's view, as vLLM does: a full collection
    walks them all (~70-85 ms in a worker on a Zen 5 core), a stall of the decode loop or of
    the gateway's streams whenever the collector decides to run one. What the service
    allocates from here on is collected as before."""
    gc.collect()
    gc.freeze()
    log.info("froze %d objects out of the garbage collector's view", gc.get_freeze_count())


class TaskSet:
    """Tasks a service starts and does not await at once: referenced until they end (asyncio
    keeps only weak references), a failure logged, all cancelled at stop."""

    def __init__(self, what: str):
        self.what = what  # for the log: "placing a request", "a message handler"
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait_any(self, timeout: float) -> None:
        """Until one of the tasks ends, or `timeout` seconds."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", self.what, exc_info=task.exception())

    async def cancel_all(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
