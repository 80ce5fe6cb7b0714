"""EngineLoop: the single owner of a worker's engine. NATS callbacks hand it commands, which
run between steps in arrival order; each step runs in a thread so the event loop stays free
for heartbeats, assignments and cancels. A reservation need not wait for the step: it runs
while the model computes (`call_now`)."""

import asyncio
import time
from collections.abc import Awaitable, Callable

from services.runtime import TaskSet
from shared.engine.engine import LLMEngine, StepOutput


class EngineLoop:
    def __init__(
        self, engine: LLMEngine, on_outputs: Callable[[list[StepOutput]], Awaitable[None]]
    ):
        self.engine = engine
        self.on_outputs = on_outputs
        self._commands: list[tuple[Callable, tuple, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self.handlers = TaskSet("a message handler")  # see in_tasks
        self.step_s = 0.0  # the last step's time in the engine
        self.cycle_s = 0.0  # from the previous step's end to this one's: step + loop overhead
        self._step_end = 0.0  # 0: the loop was idle since

    def in_tasks(self, callback: Callable[[object], Awaitable[None]]):
        """A NATS callback that handles each message in a task of its own. nats-py runs one
        subscription's callbacks one after another, and a handler awaiting `call` waits for the
        running step: in line, a burst of assignments would join the batch one per step. Tasks
        start in arrival order, so their commands keep it."""

        async def spawn(msg) -> None:
            self.handlers.spawn(callback(msg))

        return spawn

    async def call(self, fn: Callable, *args):
        """fn(*args) on the engine between two steps; returns its result (or raises)."""
        future = asyncio.get_running_loop().create_future()
        self._commands.append((fn, args, future))
        self._wake.set()
        return await future

    async def call_now(self, fn: Callable, *args):
        """fn(*args) at once when nothing waits to run between steps and the engine's step is
        not in its bookkeeping (LLMEngine.lock: free while the model computes); else as `call`.
        Only for commands that add and free nothing (a reservation): see LLMEngine._computing."""
        if not self._commands and self.engine.lock.acquire(blocking=False):
            try:
                return fn(*args)
            finally:
                self.engine.lock.release()
        return await self.call(fn, *args)

    def _apply_commands(self) -> None:
        commands, self._commands = self._commands, []
        for fn, args, future in commands:
            if future.cancelled():
                continue
            try:
                future.set_result(fn(*args))
            except Exception as e:
                future.set_exception(e)

    async def run(self) -> None:
        while True:
            self._apply_commands()
            if not self.engine.has_unfinished():
                self._wake.clear()
                self._step_end = 0.0
                if not self._commands:
                    await self._wake.wait()
                continue
            started = time.perf_counter()
            outputs = await asyncio.to_thread(self.engine.step)
            now = time.perf_counter()
            self.step_s = now - started
            self.cycle_s = now - (self._step_end or started)
            self._step_end = now
            await self.on_outputs(outputs)
