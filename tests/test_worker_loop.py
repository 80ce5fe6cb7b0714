"""The worker's EngineLoop with a real engine: commands run between steps, and a burst of
messages handled `in_tasks` joins the batch at the next step together, not one per step."""

import asyncio

from services.worker.loop import EngineLoop
from shared.sampling.params import SamplingParams

from engine_helpers import new_engine
from waiting import until


async def test_a_burst_of_assignments_joins_one_step(tiny_llama):
    engine = new_engine(tiny_llama)
    steps: list[set[str]] = []

    async def on_outputs(outputs) -> None:
        steps.append({o.request.request_id for o in outputs if o.new_token_ids})

    loop = EngineLoop(engine, on_outputs)
    runner = asyncio.create_task(loop.run())
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def assign(rid: str) -> None:  # as a role's handler does: awaits the engine
        await loop.call(engine.add_request, rid, [5, 6, 7, 8], params)

    try:
        await loop.call(
            engine.add_request, "running", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True)
        )
        handler = loop.in_tasks(assign)
        for i in range(8):  # as nats-py calls a subscription's callback: one after another
            await handler(f"burst-{i}")
        burst = {f"burst-{i}" for i in range(8)}

        async def all_started() -> bool:
            return burst <= set().union(*steps)

        await until(all_started, 30, "a first token of every request of the burst")
        first = next(s for s in steps if s & burst)
        assert first == burst | {"running"}  # all their first tokens in one step
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        engine.close()
