"""KV-aware routing end to end over a real NATS server: a scheduler, a gateway and 2 fake
prefill + 2 fake decode workers (each naming its admitted prompts' pages and publishing KV
events), in-process; the test speaks HTTP to the gateway and watches which workers serve."""

import asyncio
import re

import aiohttp
import nats
import pytest

from services.fake_worker.config import FakeWorkerConfig
from services.fake_worker.worker import run_fake_worker
from services.gateway.app import run_gateway
from services.gateway.config import GatewayConfig
from services.scheduler.routing import RoutingConfig
from services.scheduler.service import Scheduler, SchedulerConfig
from shared import protocol, subjects
from shared.nats_server import NatsServer
from shared.protocol import HeartbeatMsg, KvReadyMsg, TokensMsg

from services_harness import free_port, scheduler_routes, wait_metric
from waiting import until

BEAT_S = 0.05
# Routing, not liveness, is under test: a worker counts as dead only after 2 s without a beat,
# so a loaded CI host that stalls this loop for 150 ms (3 beats) does not unregister them all.
MISS_LIMIT = 40
WORKERS = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}


class Cluster:
    """Scheduler, gateway and fake workers as tasks of this loop; which workers served each
    request, from the messages they send (tokens: decode; KV ready: prefill)."""

    def __init__(self, url: str, model_dir, routing: str):
        self.url, self.model_dir, self.routing = url, model_dir, routing
        self.stop = asyncio.Event()
        self.decode_of: dict[str, str] = {}
        self.prefill_of: dict[str, str] = {}
        self.beats: dict[str, list[HeartbeatMsg]] = {w: [] for w in WORKERS}
        self.port = free_port()

    async def __aenter__(self):
        self.scheduler_stop = asyncio.Event()
        self.scheduler = Scheduler(
            SchedulerConfig(
                nats_url=self.url, routing=RoutingConfig(mode=self.routing), miss_limit=MISS_LIMIT
            )
        )
        gateway = GatewayConfig(
            self.model_dir,
            port=self.port,
            nats_url=self.url,
            gateway_id="gw",
            miss_limit=MISS_LIMIT,
        )
        workers = [
            FakeWorkerConfig(
                role=role,
                model_dir=self.model_dir,
                nats_url=self.url,
                worker_id=wid,
                heartbeat_s=BEAT_S,
                step_s=0.02,
            )
            for wid, role in WORKERS.items()
        ]
        self.tasks = [asyncio.create_task(self.scheduler.run(self.scheduler_stop))]
        self.tasks += [asyncio.create_task(run_fake_worker(w, self.stop)) for w in workers]
        self.tasks.append(asyncio.create_task(run_gateway(gateway, self.stop)))
        self.nc = await nats.connect(self.url)
        await self.nc.subscribe(subjects.gateway_tokens("gw"), cb=self._on_tokens)
        await self.nc.subscribe(subjects.all_heartbeats(), cb=self._on_beat)
        for wid in ("d0", "d1"):
            await self.nc.subscribe(subjects.decode_kv(wid), cb=self._on_kv_ready)
        await until(lambda: scheduler_routes(self.nc), 30, "the scheduler to know workers")
        await until(self._all_heard, 30, "the scheduler to hear all four workers")
        self.http = aiohttp.ClientSession(self.base_url)
        await until(self._gateway_healthy, 30, "the gateway's /health")
        return self

    async def __aexit__(self, *exc):
        await self.http.close()
        self.scheduler_stop.set()
        self.stop.set()
        await asyncio.gather(*self.tasks)
        await self.nc.close()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _all_heard(self) -> bool:
        return all(self.scheduler.router.registry.get(w) for w in WORKERS)

    async def _gateway_healthy(self) -> bool:
        try:
            async with self.http.get("/health") as resp:
                return resp.status == 200
        except aiohttp.ClientError:
            return False

    async def _on_tokens(self, msg):
        tokens = protocol.decode(msg.data, TokensMsg)
        for item in tokens.items:
            self.decode_of[item.request_id] = tokens.worker_id

    async def _on_beat(self, msg):
        beat = protocol.decode(msg.data, HeartbeatMsg)
        self.beats[beat.worker_id].append(beat)

    async def _on_kv_ready(self, msg):
        ready = protocol.decode(msg.data, KvReadyMsg)
        self.prefill_of[ready.request_id] = ready.prefill_worker

    async def complete(self, prompt, max_tokens=3, headers=None) -> tuple[str, str]:
        """Run a completion to its end; (its decode worker, its prefill worker)."""
        body = {"model": self.model_dir.name, "prompt": list(prompt), "max_tokens": max_tokens}
        async with self.http.post("/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            request_id = (await resp.json())["id"]
        return self.decode_of[request_id], self.prefill_of[request_id]

    async def cached(self, worker_id: str, num_pages: int) -> None:
        """Until the scheduler's index holds at least num_pages pages of the worker."""
        index = self.scheduler.router.index
        what = f"{num_pages} pages of {worker_id} in the index"
        await until(lambda: index.num_pages(worker_id) >= num_pages, 30, what)

    def metrics(self) -> str:
        """The scheduler's /metrics text."""
        return self.scheduler.metrics.render().decode()

    def running(self, worker_id: str) -> int:
        """Requests running on the worker, as its last heartbeat to the scheduler says."""
        return self.scheduler.router.registry.get(worker_id).running_seqs

    async def idle(self) -> None:
        """Until both decode workers report an empty batch in a heartbeat sent after this call
        (the second one heard from now: the first may have left before)."""
        seen = {w: len(self.beats[w]) for w in ("d0", "d1")}

        def idle() -> bool:
            beats = [self.beats[w] for w in seen]
            fresh = all(len(self.beats[w]) >= seen[w] + 2 for w in seen)
            return fresh and not any(b[-1].running_seqs for b in beats)

        await until(idle, 30, "the decode workers to report no running requests")

    async def while_d0_busy(self, prompt, **kw) -> tuple[str, str]:
        """Complete `prompt` while a long request runs on d0 (idle workers tie: d0 first)."""
        await self.idle()
        long_run = asyncio.create_task(self.complete(range(200, 240), max_tokens=40))
        await until(lambda: self.running("d0"), 30, "the long request to run on d0")
        served = await self.complete(prompt, **kw)
        assert (await long_run)[0] == "d0"
        return served


def conversation(first: int, turns: int) -> list[list[int]]:
    """The growing prompts of one conversation: each turn adds 20 tokens to the last."""
    prompts, prompt = [], []
    for turn in range(turns):
        prompt = prompt + [first + turn] * 20
        prompts.append(prompt)
    return prompts


@pytest.fixture
async def nats_url(tmp_path):
    with NatsServer(tmp_path / "nats") as server:
        yield server.url


async def test_turns_follow_their_prefix_and_sessions_stay_pinned(nats_url, tiny_llama):
    async with Cluster(nats_url, tiny_llama, "kv") as c:
        a, b = conversation(10, 3), conversation(50, 3)
        assert (await c.complete(a[0]))[0] == "d0"  # idle workers tie: d0 first
        assert (await c.while_d0_busy(b[0]))[0] == "d1"
        for turn in (1, 2):
            await c.cached("d0", turn)  # a's pages: 1, then 2 (20 and 40 tokens, pages of 16)
            await c.cached("d1", turn)
            await c.idle()  # the load rule alone would pick d0 for both
            assert (await c.complete(a[turn]))[0] == "d0"
            assert (await c.complete(b[turn]))[0] == "d1"
        decisions = c.metrics()
        assert 'decisions_total{reason="kv_overlap",role="decode"} 4.0' in decisions
        # turns 2 and 3: 1 then 2 cached pages each, in the gateway's metrics
        what = "the decode workers' prefix hits in /metrics"
        await wait_metric(
            c, "tison_prefix_cache_hit_tokens", lambda n: n == 2 * (16 + 32), what, "decode"
        )

        # The session header pins: a prompt no worker holds follows its session, not the load.
        pinned = {"x-session-affinity": "agent-7"}
        assert (await c.while_d0_busy(range(300, 340), headers=pinned))[0] == "d1"
        await c.idle()
        assert (await c.complete(range(100, 120), headers=pinned))[0] == "d1"
        assert (await c.complete(range(120, 140)))[0] == "d0"
        decisions = c.metrics()
        assert 'decisions_total{reason="affinity",role="decode"} 1.0' in decisions


async def test_round_robin_alternates(nats_url, tiny_llama):
    async with Cluster(nats_url, tiny_llama, "round-robin") as c:
        served = [await c.complete(range(10, 50)) for _ in range(4)]
        assert [d for d, _ in served] == ["d0", "d1", "d0", "d1"]
        assert [p for _, p in served] == ["p0", "p1", "p0", "p1"]


async def test_a_restarted_scheduler_gets_snapshots_of_the_caches(nats_url, tiny_llama):
    async with Cluster(nats_url, tiny_llama, "kv") as c:
        prompt = conversation(10, 2)
        assert (await c.while_d0_busy(prompt[0]))[0] == "d1"
        await c.cached("d1", 1)
        c.scheduler_stop.set()
        await c.tasks[0]
        # The new scheduler hears deltas numbered past 0: it asks each worker for its set.
        c.scheduler_stop = asyncio.Event()
        c.scheduler = Scheduler(SchedulerConfig(nats_url=nats_url))
        c.tasks[0] = asyncio.create_task(c.scheduler.run(c.scheduler_stop))
        await c.cached("d1", 1)
        await c.cached("d0", 2)  # the long request's pages
        asks = re.search(r"^tison_scheduler_kv_snapshot_asks_total (\S+)$", c.metrics(), re.M)
        assert float(asks[1]) >= 4  # one per worker at least
        await until(c._all_heard, 30, "the new scheduler to hear all four workers")
        await until(lambda: scheduler_routes(c.nc), 30, "the new scheduler to route")
        await c.idle()
        assert (await c.complete(prompt[1]))[0] == "d1"  # the load rule alone: d0
