"""The worker's EngineLoop with a real engine: commands run between steps, a burst of
messages handled `in_tasks` joins the batch at the next step together, not one per step, and a
decode worker numbers its items right when a step overtakes one of its handlers."""

import asyncio
import functools
import threading

import nats

from services.scheduler.kv_index import KVIndex
from services.worker.decode import DecodeRole
from services.worker.kv_events import KVEventsPublisher
from services.worker.loop import EngineLoop
from shared import protocol, subjects
from shared.kv.block_hash import page_hashes
from shared.nats_server import NatsServer
from shared.protocol import (
    DecodeAssignMsg,
    DecodeAssignReplyMsg,
    KVEventsMsg,
    KVPool,
    KvReadyMsg,
    KVSnapshotAskMsg,
    TokensMsg,
)
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


async def test_the_engines_kv_events_reach_an_index_over_nats(tiny_llama, tmp_path):
    """What a real worker publishes (services/worker/kv_events.py over its EngineLoop) keeps a
    scheduler's KVIndex equal to the engine's cache: names after a request, a snapshot when
    asked, and the hashes are the router's own page_hashes of the prompt."""
    engine = new_engine(tiny_llama, page_size=4)
    loop = EngineLoop(engine, lambda outputs: asyncio.sleep(0))
    runner = asyncio.create_task(loop.run())
    index, got = KVIndex(), []
    with NatsServer(tmp_path / "nats") as server:
        nc = await nats.connect(server.url)

        async def on_events(msg) -> None:
            events = protocol.decode(msg.data, KVEventsMsg)
            got.append(events)
            index.apply(events)

        try:
            await nc.subscribe(subjects.all_kv_events(), cb=on_events)
            events = functools.partial(loop.call, engine.kv_events)
            publisher = KVEventsPublisher(nc, {"decode": "w"}, events, interval_s=1.0)
            await publisher.subscribe()
            await publisher.publish_once()  # the first message: an empty snapshot
            prompt = list(range(10, 23))  # 13 tokens: 3 full pages
            params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            await loop.call(engine.add_request, "r", prompt, params)
            await until(lambda: not engine.has_unfinished(), 30, "the request to finish")
            await publisher.publish_once()
            await until(lambda: len(got) == 2, 30, "two KV events messages")
            assert got[0].reset and not got[1].reset and got[1].seq == 1
            hashes = page_hashes(prompt, 4)
            assert index.overlap("w", hashes) == 3
            ask = KVSnapshotAskMsg("w", reason="test")
            await nc.publish(subjects.kv_snapshot("decode", "w"), protocol.encode(ask))

            async def snapshot() -> KVEventsMsg | None:  # one message an interval, as run()
                await publisher.publish_once()
                return next((m for m in got[2:] if m.reset), None)

            sent = await until(snapshot, 30, "a snapshot after the ask")
            assert set(hashes) <= set(sent.stored)
            assert index.overlap("w", hashes) == 3
        finally:
            await nc.close()
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            engine.close()


class StepBeforeTheCallerResumes(EngineLoop):
    """Runs each command, then a step, before the caller of `call` resumes; the step's outputs
    are handled after it. The real loop interleaves so whenever a handler's task is slow to
    resume (a loaded machine): here every time."""

    async def call(self, fn, *args):
        result = fn(*args)
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        self.handlers.spawn(self.on_outputs(outputs))
        return result


async def test_a_decode_worker_numbers_its_items_when_a_step_overtakes_a_handler(
    tiny_llama, tmp_path
):
    """The KV arrives; the first token leaves; the next step decodes the request's last token
    before the handler resumes. The gateway must get indices 0 and 1 (the finish), nothing else:
    the handler once read the request after the step and sent index 2, a protocol error."""
    engine = new_engine(tiny_llama)
    roles = []
    loop = StepBeforeTheCallerResumes(engine, lambda outputs: roles[0].on_outputs(outputs))
    got: list = []
    with NatsServer(tmp_path / "nats") as server:
        nc = await nats.connect(server.url)
        try:
            role = DecodeRole(nc, loop, "d0", (KVPool(engine.kv_spec.layout, "host", ()),))
            roles.append(role)
            await role.subscribe()

            async def on_tokens(msg) -> None:
                got.extend(protocol.decode(msg.data, TokensMsg).items)

            await nc.subscribe(subjects.gateway_tokens("g0"), cb=on_tokens)
            params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            assign = DecodeAssignMsg("r", "g0", "p0", (5, 6, 7, 8), params)
            reply = await nc.request(subjects.assign("decode", "d0"), protocol.encode(assign), 10)
            assert protocol.decode(reply.data, DecodeAssignReplyMsg).accepted
            ready = KvReadyMsg("r", "p0", ok=True, first_token_id=9)
            await nc.publish(subjects.decode_kv("d0"), protocol.encode(ready))

            async def finished() -> bool:
                return any(item.finish_reason for item in got)

            await until(finished, 30, "the request's last item")
            await asyncio.sleep(0.2)  # anything sent after it would have come by now
            assert [(i.index, len(i.token_ids), i.finish_reason) for i in got] == [
                (0, 1, None),
                (1, 1, "length"),
            ]
            assert engine.num_pages_used == 0
        finally:
            await nc.close()
            await loop.handlers.cancel_all()
            engine.close()


class StepsPerAssignment(DecodeRole):
    """A DecodeRole that counts the engine's steps while each of its assignments is handled."""

    def __init__(self, steps: list, *args):
        super().__init__(*args)
        self.steps, self.spans = steps, []

    async def _on_assign(self, msg) -> None:
        before = len(self.steps)
        await super()._on_assign(msg)
        self.spans.append(len(self.steps) - before)


async def test_a_decode_reservation_waits_for_one_step_at_most(tiny_llama, tmp_path):
    """A reservation is on its request's time to first token (the prefill worker starts once
    it is answered), and every command waits for the step in progress: the assignment must be
    answered after that one step, not after a second (it once made two calls)."""
    engine = new_engine(tiny_llama)
    steps = []

    async def on_outputs(outputs) -> None:
        steps.append(len(outputs))

    loop = EngineLoop(engine, on_outputs)
    runner = asyncio.create_task(loop.run())
    with NatsServer(tmp_path / "nats") as server:
        nc = await nats.connect(server.url)
        try:
            pools = (KVPool(engine.kv_spec.layout, "host", ()),)
            role = StepsPerAssignment(steps, nc, loop, "d0", pools)
            await role.subscribe()
            long = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
            await loop.call(engine.add_request, "running", [5, 6, 7], long)
            await until(lambda: len(steps) >= 3, 30, "the running request's steps")
            params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            for i in range(5):
                assign = DecodeAssignMsg(f"r{i}", "g0", "p0", (5, 6, 7, 8), params)
                reply = await nc.request(
                    subjects.assign("decode", "d0"), protocol.encode(assign), 10
                )
                assert protocol.decode(reply.data, DecodeAssignReplyMsg).accepted
            assert len(role.spans) == 5 and max(role.spans) <= 1, role.spans
        finally:
            await nc.close()
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            await loop.handlers.cancel_all()
            engine.close()


async def test_a_reservation_runs_while_the_model_computes(tiny_llama):
    """call_now takes the engine's lock while a step's forward pass runs: here the forward
    waits for the reservation, which with `call` (between steps) would never come."""
    engine = new_engine(tiny_llama)
    computing, reserved = threading.Event(), threading.Event()
    launch = engine.executor.launch

    def waiting_launch(out, masks=None) -> None:
        computing.set()
        assert reserved.wait(30), "the reservation did not run while the model computed"
        launch(out, masks)

    engine.executor.launch = waiting_launch
    loop = EngineLoop(engine, lambda outputs: asyncio.sleep(0))
    runner = asyncio.create_task(loop.run())
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        await loop.call(engine.add_request, "running", [5, 6, 7], params)
        await until(computing.is_set, 30, "the step's forward pass to start")
        got = await loop.call_now(engine.reserve, "reserved", [5, 6, 7, 8], params)
        reserved.set()
        assert got is not None and engine.reservation("reserved") == got
        await until(lambda: not engine.has_unfinished(), 30, "the running request to finish")
    finally:
        reserved.set()
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        engine.close()
