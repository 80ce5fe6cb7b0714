"""Fake worker: its pure batch, then scheduler + fake workers over a real NATS server, in-process,
with the test acting as the gateway."""

import asyncio
import time

import aiohttp
import nats
import pytest

from services.fake_worker.batch import DecodeBatch
from services.fake_worker.config import FakeWorkerConfig
from services.fake_worker.prefill import FakePrefill
from services.fake_worker.tokens import FakeModelInfo, fake_token, prompt_digest
from services.fake_worker.worker import run_fake_worker
from services.scheduler.service import Scheduler, SchedulerConfig
from shared import protocol, subjects
from shared.kv.allocator import PageAllocator
from shared.nats_server import NatsServer
from shared.protocol import (
    CancelMsg,
    DecodeAssignMsg,
    HeartbeatMsg,
    KvReadyMsg,
    PrefillAssignMsg,
    SubmitMsg,
    SubmitReplyMsg,
    TokensMsg,
)
from shared.sampling.params import SamplingParams

from services_harness import scheduler_routes
from waiting import until


@pytest.fixture(scope="module")
def info(tiny_llama):
    return FakeModelInfo.from_dir(tiny_llama)


def test_model_info_excludes_special_tokens(info):
    assert info.name.startswith("model-llama") and info.eos_token_id == 2
    assert info.max_model_len == 256 and 2 not in info.ordinary_ids and 0 not in info.ordinary_ids


def test_decode_batch_steps_finishes_and_frees(info):
    batch = DecodeBatch(info, PageAllocator(8), page_size=4, eos_after=None)
    prompt = (10, 11, 12)
    sampling = SamplingParams(max_tokens=4, logprobs=2)
    # The prompt and one token: one page each, whatever max_tokens says.
    assert batch.reserve(DecodeAssignMsg("a", "gw", "p", prompt, sampling)) == (0,)
    assert batch.reserve(DecodeAssignMsg("b", "gw2", "p", prompt, SamplingParams(max_tokens=1)))
    assert batch.step() == {}  # nothing has its KV yet
    digest = prompt_digest(prompt)
    first = fake_token(info, digest, 0)
    # The prefill's first token goes out at once, as output index 0.
    gateway, item = batch.kv_ready(KvReadyMsg("a", "p", True, first))
    assert (gateway, item.index, item.token_ids, item.finish_reason) == ("gw", 0, (first,), None)
    gateway, done = batch.kv_ready(KvReadyMsg("b", "p", True, first))  # max_tokens=1: finished
    assert (gateway, done.index, done.token_ids, done.finish_reason) == (
        "gw2",
        0,
        (first,),
        "length",
    )
    assert done.usage.completion_tokens == 1
    out = [batch.step()["gw"][0] for _ in range(3)]
    assert [item.token_ids[0] for item in out] == [fake_token(info, digest, i) for i in (1, 2, 3)]
    assert [item.index for item in out] == [1, 2, 3]
    assert (
        out[0].logprobs[0].top_ids[0] == out[0].token_ids[0]
        and len(out[0].logprobs[0].top_ids) == 2
    )
    assert out[-1].finish_reason == "length" and out[-1].usage == protocol.Usage(3, 4)
    assert batch.pages.num_used == 0 and batch.step() == {}


def test_prompt_logprobs_go_from_the_fake_prefill_to_the_first_item(info, tiny_llama):
    """As with the real workers: the prefill's KvReadyMsg carries fake logprobs of every
    prompt token from the second on, and the decode batch relays them in the item of index 0
    (also when that token ends the request); none when not asked."""
    config = FakeWorkerConfig(role="prefill", model_dir=tiny_llama)
    prefill = FakePrefill(None, config, info, "p")
    batch = DecodeBatch(info, PageAllocator(8), page_size=4, eos_after=None)
    prompt = (10, 11, 12, 13)
    for rid, sampling in [
        ("a", SamplingParams(max_tokens=3, prompt_logprobs=2)),
        ("b", SamplingParams(max_tokens=1, prompt_logprobs=0)),
        ("c", SamplingParams(max_tokens=3)),
    ]:
        assert batch.reserve(DecodeAssignMsg(rid, "gw", "p", prompt, sampling))
        ready = prefill._ready(PrefillAssignMsg(rid, "gw", prompt, sampling, "d", None, ()))
        _, item = batch.kv_ready(ready)
        assert item.index == 0 and item.prompt_logprobs == ready.prompt_logprobs
        top_n = sampling.prompt_logprobs
        if top_n is None:
            assert ready.prompt_logprobs == ()
            continue
        assert [v.token_id for v in ready.prompt_logprobs] == list(prompt[1:])
        assert all(len(v.top_ids) == top_n for v in ready.prompt_logprobs)
    assert batch.step()["gw"][0].prompt_logprobs == ()  # later items carry none


def test_decode_batch_grows_a_page_at_a_time_and_preempts_the_newest(info):
    """Two requests outgrow a 3-page pool: the newer one waits (pages freed) until the older
    finishes, then resumes with the tokens it would have given."""
    batch = DecodeBatch(info, PageAllocator(3), page_size=4)
    prompt = (10, 11, 12)
    for rid in "ab":
        batch.reserve(DecodeAssignMsg(rid, "gw", "p", prompt, SamplingParams(max_tokens=6)))
        batch.kv_ready(KvReadyMsg(rid, "p", True, fake_token(info, prompt_digest(prompt), 0)))
    assert batch.pages.num_used == 2
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    waiting = []  # per step: the requests preempted after it
    while batch.seqs:
        for item in batch.step().get("gw", []):
            tokens[item.request_id] += item.token_ids
        waiting.append({s.request_id for s in batch.seqs.values() if s.preempted})
    expected = [fake_token(info, prompt_digest(prompt), i) for i in range(1, 6)]
    assert tokens == {"a": expected, "b": expected}
    # b's second token needs a 2nd page while a holds two: b waits until a is done.
    assert waiting[:4] == [set(), {"b"}, {"b"}, {"b"}] and "a" not in set().union(*waiting)
    assert batch.pages.num_used == 0


def test_decode_batch_eos_respects_min_tokens_and_ignore_eos(info):
    batch = DecodeBatch(info, PageAllocator(64), page_size=4, eos_after=1)
    for rid, sampling in [
        ("plain", SamplingParams(max_tokens=9)),
        ("min", SamplingParams(max_tokens=9, min_tokens=3)),
        ("ignore", SamplingParams(max_tokens=5, ignore_eos=True)),
    ]:
        batch.reserve(DecodeAssignMsg(rid, "gw", "p", (5,), sampling))
        assert batch.kv_ready(KvReadyMsg(rid, "p", True, 77))[1].finish_reason is None
    finished = {}
    for _ in range(5):
        for item in batch.step().get("gw", []):
            if item.finish_reason:
                finished[item.request_id] = (item.finish_reason, item.usage.completion_tokens)
    assert finished == {"plain": ("stop", 2), "min": ("stop", 4), "ignore": ("length", 5)}


def test_decode_batch_cancel_and_prefill_error(info):
    batch = DecodeBatch(info, PageAllocator(4), page_size=4)
    batch.reserve(DecodeAssignMsg("a", "gw", "p", (1,), SamplingParams(max_tokens=3)))
    batch.reserve(DecodeAssignMsg("b", "gw", "p", (1,), SamplingParams(max_tokens=3)))
    assert batch.pages.num_used == 2 and batch.cancel("a") and not batch.cancel("a")
    _, item = batch.kv_ready(KvReadyMsg("b", "p", False, error="link down"))
    assert (item.finish_reason, item.error) == ("error", "link down")
    assert batch.pages.num_used == 0


class Cluster:
    """Scheduler + fake workers as tasks of this event loop, and a client acting as a gateway."""

    def __init__(self, url: str, model_dir, **worker_options):
        self.url, self.model_dir, self.worker_options = url, model_dir, worker_options
        self.stop = asyncio.Event()
        self.tokens: dict[str, list] = {}
        self.beats: dict[str, HeartbeatMsg] = {}

    async def __aenter__(self):
        self.scheduler = Scheduler(SchedulerConfig(nats_url=self.url, max_waiting=2))
        worker = FakeWorkerConfig(
            role="both",
            model_dir=self.model_dir,
            nats_url=self.url,
            heartbeat_s=0.1,
            worker_id="w",
            **self.worker_options,
        )
        self.tasks = [
            asyncio.create_task(self.scheduler.run(self.stop)),
            asyncio.create_task(run_fake_worker(worker, self.stop)),
        ]
        self.nc = await nats.connect(self.url)
        await self.nc.subscribe(subjects.gateway_tokens("gw"), cb=self._on_tokens)
        await self.nc.subscribe(subjects.all_heartbeats(), cb=self._on_beat)
        await until(lambda: len(self.beats) == 2, 30, "heartbeats of both fake workers")
        await until(lambda: scheduler_routes(self.nc), 30, "the scheduler to know both workers")
        return self

    async def __aexit__(self, *exc):
        self.stop.set()
        await asyncio.gather(*self.tasks)
        await self.nc.close()

    async def _on_tokens(self, msg):
        for item in protocol.decode(msg.data, TokensMsg).items:
            self.tokens.setdefault(item.request_id, []).append(item)

    async def _on_beat(self, msg):
        beat = protocol.decode(msg.data, HeartbeatMsg)
        self.beats[beat.worker_id] = beat

    async def submit(self, request_id, prompt, **sampling) -> SubmitReplyMsg:
        msg = SubmitMsg(request_id, "gw", prompt, SamplingParams(**sampling), time.time() + 30)
        reply = await self.nc.request(subjects.scheduler_submit(), protocol.encode(msg), timeout=5)
        return protocol.decode(reply.data, SubmitReplyMsg)

    def finished(self, request_id) -> bool:
        return any(item.finish_reason for item in self.tokens.get(request_id, []))

    def pages_used(self) -> int:
        return sum(b.total_pages - b.free_pages for b in self.beats.values())


async def test_requests_flow_and_garbage_is_dropped(tmp_path, tiny_llama, info):
    with NatsServer(tmp_path / "nats") as server:
        async with Cluster(server.url, tiny_llama) as c:
            for subject in (
                subjects.scheduler_submit(),
                subjects.gateway_cancel(),
                subjects.heartbeat("decode", "x"),
                subjects.assign("decode", "w-decode"),
                subjects.assign("prefill", "w-prefill"),
                subjects.decode_kv("w-decode"),
            ):
                await c.nc.publish(subject, b"\x93not a message")
            prompt = (20, 21, 22)
            reply = await c.submit("r1", prompt, max_tokens=5)
            assert (reply.status, reply.prefill_worker, reply.decode_worker) == (
                "accepted",
                "w-prefill",
                "w-decode",
            )
            await until(lambda: c.finished("r1"), 30, "r1 to finish")
            items = c.tokens["r1"]  # all from the decode worker, in order
            assert [item.index for item in items] == list(range(5))
            ids = [t for item in items for t in item.token_ids]
            assert ids == [fake_token(info, prompt_digest(prompt), i) for i in range(5)]
            assert items[-1].usage == protocol.Usage(3, 5)
            too_long = await c.submit("r2", prompt, max_tokens=4096 * 16)
            assert (too_long.status, too_long.limit) == ("too_long", 4096 * 16)
            await until(lambda: c.pages_used() == 0, 30, "the workers to report their pages free")
            # counted, and reported (this process runs the workers and the scheduler: 6 drops)
            await until(
                lambda: all(b.dropped_messages >= 6 for b in c.beats.values()),
                30,
                "heartbeats counting the dropped messages",
            )


async def test_queue_full_and_cancel_frees_pages(tmp_path, tiny_llama):
    with NatsServer(tmp_path / "nats") as server:
        # 2 pages of 16 tokens: a 20-token prompt and its next token need both, so one request
        # runs at a time; the queue holds 2 more.
        async with Cluster(server.url, tiny_llama, num_pages=2, step_s=0.2) as c:
            assert (await c.submit("a", (1,) * 20, max_tokens=10)).status == "accepted"
            waiting = [asyncio.create_task(c.submit(r, (1,) * 20, max_tokens=10)) for r in "bc"]
            await until(lambda: len(c.scheduler.queue) == 2, 30, "b and c to queue behind a")
            full = await c.submit("d", (1,) * 20, max_tokens=10)
            assert (full.status, full.retry_after_s) == ("queue_full", 1.0)
            await until(lambda: c.pages_used() == 2, 30, "a's pages reported in use")
            await c.nc.publish(subjects.gateway_cancel(), protocol.encode(CancelMsg("a")))
            assert (await waiting[0]).status == "accepted"  # b got a's pages
            await c.nc.publish(subjects.gateway_cancel(), protocol.encode(CancelMsg("b")))
            assert (await waiting[1]).status == "accepted"
            await c.nc.publish(subjects.gateway_cancel(), protocol.encode(CancelMsg("c")))
            await until(lambda: c.pages_used() == 0, 30, "the cancels to free every page")
            assert not c.finished("a")


async def subscribed(server: NatsServer, subject: str) -> bool:
    """Whether the NATS server itself holds a subscription to `subject` (a client's subscribe
    returns before the server has it)."""
    url = f"http://{server.host}:{server.monitor_port}/subsz?subs=1&test={subject}"
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return (await resp.json())["total"] > 0


async def test_requests_sent_before_workers_report_wait_for_them(tmp_path, tiny_llama):
    """Right after start the scheduler queues requests until workers' first heartbeats
    (grace period) instead of answering "no workers"; after it, it answers at once."""
    with NatsServer(tmp_path / "nats", monitor=True) as server:
        stop = asyncio.Event()
        # A long grace: the worker started below must report within it however busy the host.
        scheduler = Scheduler(SchedulerConfig(nats_url=server.url, startup_grace_s=30))
        tasks = [asyncio.create_task(scheduler.run(stop))]
        nc = await nats.connect(server.url)
        try:
            submit = subjects.scheduler_submit()
            await until(lambda: subscribed(server, submit), 30, "the scheduler to subscribe")
            msg = SubmitMsg("early", "gw", (5, 6), SamplingParams(max_tokens=4), time.time() + 30)
            early = asyncio.create_task(nc.request(submit, protocol.encode(msg), timeout=30))
            await until(lambda: len(scheduler.queue) == 1, 30, "the early request to queue")
            worker = FakeWorkerConfig(
                role="both",
                model_dir=tiny_llama,
                nats_url=server.url,
                heartbeat_s=0.1,
                worker_id="late",
            )
            tasks.append(asyncio.create_task(run_fake_worker(worker, stop)))
            reply = protocol.decode((await early).data, SubmitReplyMsg)
            assert (reply.status, reply.decode_worker) == ("accepted", "late-decode")
        finally:
            stop.set()
            await asyncio.gather(*tasks)
            await nc.close()
