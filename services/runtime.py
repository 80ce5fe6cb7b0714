"""How every service process runs: logging, uvloop where available, stop on SIGINT/SIGTERM."""

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable


def run_service(main: Callable[[asyncio.Event], Awaitable[None]], log_level: str = "INFO") -> int:
    """Run `main(stop)` on a fresh event loop; `stop` is set on SIGINT or SIGTERM."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
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

    if uvloop is not None:
        uvloop.run(runner())
    else:
        asyncio.run(runner())
    return 0
