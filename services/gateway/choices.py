"""The sequences of one request (its n choices, or best_of candidates), run together.

The first is submitted alone and the others once its first output arrived: by then its
prompt's KV pages are in the workers' prefix caches, so the other samples compute only the
prompt's last partial page instead of the whole prompt again. Their Deltas come out merged,
each tagged with its sequence's index.
"""

import asyncio
import logging
from collections.abc import AsyncIterator

from services.gateway.generation import Generation, Refused
from services.gateway.request_state import Delta

log = logging.getLogger(__name__)


class Choices:
    def __init__(self, generations: list[Generation]):
        self.generations = generations
        self._queue: asyncio.Queue[tuple[int, Delta | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Submits the first sequence (Refused propagates: nothing was sent yet), then starts
        every sequence's pump."""
        await self.generations[0].submit()
        self._tasks = [asyncio.create_task(self._pump(i)) for i in range(len(self.generations))]

    async def merged(self) -> AsyncIterator[tuple[int, Delta]]:
        """(sequence index, delta) as they come, until every sequence ended."""
        ended = 0
        while ended < len(self.generations):
            index, delta = await self._queue.get()
            if delta is None:
                ended += 1
            else:
                yield index, delta

    async def _pump(self, index: int) -> None:
        generation = self.generations[index]
        try:
            if index:
                await self.generations[0].started.wait()
                await generation.submit()
            async for delta in generation.deltas():
                self._queue.put_nowait((index, delta))
        except Refused as e:
            self._queue.put_nowait((index, generation.stream.fail(str(e))))
        except Exception as e:  # a NATS failure: this sequence fails, the others go on
            log.exception("sequence %s failed", generation.request_id)
            self._queue.put_nowait((index, generation.stream.fail(f"gateway error: {e}")))
        finally:
            self._queue.put_nowait((index, None))

    async def close(self) -> None:
        """Stops the pumps and cancels on the workers what they did not finish."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for generation in self.generations:
            await generation.close()
