"""Running one load point: requests arrive (Poisson or closed loop), bounded in count and time;
agent sessions start so (each session's turns one after another)."""

import asyncio
import functools
import gc
import math
import time
from dataclasses import dataclass, replace

import aiohttp
import numpy as np

from loadtest.client import exchange, send
from loadtest.metrics import RequestResult
from loadtest.progress import Progress
from loadtest.target import Target
from loadtest.workloads import AgentWorkload, Conversation, RequestSpec
from shared.errors import InvalidRequestError


@dataclass(frozen=True)
class Load:
    """How requests arrive: a Poisson process at `rate` requests/s (inf: all at once), with
    at most `concurrency` in flight (None: no cap). Fixed concurrency is rate=inf plus a cap."""

    rate: float = math.inf
    concurrency: int | None = None
    burstiness: float = 1.0  # gamma shape of the gaps: 1 is Poisson, < 1 burstier (vLLM's)

    def __post_init__(self) -> None:
        if not self.rate > 0 or (self.concurrency is not None and self.concurrency < 1):
            raise InvalidRequestError("load", "rate must be > 0 and concurrency >= 1")
        if not self.burstiness > 0:
            raise InvalidRequestError("burstiness", "must be > 0")

    @property
    def label(self) -> str:
        parts = [] if math.isinf(self.rate) else [f"{self.rate:g} req/s"]
        if self.concurrency is not None:
            parts.append(f"{self.concurrency} concurrent")
        return ", ".join(parts) or "all at once"

    @property
    def offered(self) -> float:
        """The load's size for plots: the rate when finite, else the concurrency."""
        return self.rate if not math.isinf(self.rate) else float(self.concurrency or 0)

    def to_json(self) -> dict:
        rate = None if math.isinf(self.rate) else self.rate
        return {"rate": rate, "concurrency": self.concurrency, "burstiness": self.burstiness}

    @classmethod
    def from_json(cls, body: dict) -> "Load":
        rate = math.inf if body.get("rate") is None else body["rate"]
        return cls(rate, body.get("concurrency"), body.get("burstiness", 1.0))

    def arrival_offsets(self, num: int, rng: np.random.Generator) -> list[float]:
        """Send times from the start of the run; the first request goes at 0."""
        if math.isinf(self.rate):
            return [0.0] * num
        gaps = rng.gamma(self.burstiness, 1.0 / (self.rate * self.burstiness), num)
        gaps[0] = 0.0
        return np.cumsum(gaps).tolist()


async def sleep_until(deadline: float) -> None:
    """Return no earlier than `deadline` on time.perf_counter()'s clock. One asyncio.sleep is
    not enough: uvloop rounds a delay to whole milliseconds (under 0.5 ms: no wait at all) and
    counts it from the loop's cached time, which lags while callbacks run, so a sleep can end
    early, and a request would be sent before its arrival time."""
    while (delay := deadline - time.perf_counter()) > 0:
        await asyncio.sleep(delay)


@dataclass(frozen=True)
class RunOutput:
    """The requests sent in one run and its wall time."""

    results: list[RequestResult]
    duration_s: float


def collector_paused(run):
    """A run with the objects alive before it out of the garbage collector's view (as the
    services keep theirs, services/runtime.py): a full collection over a large process (a
    notebook's, the test suite's: ~0.7 s for 12M objects on a Zen 5) would otherwise stall the
    loop that keeps the arrival times, and inflate every latency measured meanwhile."""

    @functools.wraps(run)
    async def paused(*args, **kwargs):
        gc.collect()
        gc.freeze()
        try:
            return await run(*args, **kwargs)
        finally:
            gc.unfreeze()

    return paused


@collector_paused
async def run_load(
    target: Target,
    specs: list[RequestSpec],
    load: Load,
    max_duration_s: float,
    seed: int = 0,
    progress: Progress | None = None,
) -> RunOutput:
    """Send `specs` at `load`. At `max_duration_s` no more are sent and those in flight are
    cut (recorded as error "time_limit"); requests never sent are not in the results."""
    offsets = load.arrival_offsets(len(specs), np.random.default_rng(seed))
    cap = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    results: dict[int, RequestResult] = {}
    sent_at: dict[int, float] = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()

        async def one(i: int) -> None:
            if cap is not None:
                await cap.acquire()
            try:
                sent_at[i] = time.perf_counter() - start
                results[i] = await send(session, target, specs[i], start)
                if progress is not None:
                    progress.update(results[i])
            finally:
                if cap is not None:
                    cap.release()

        try:
            async with asyncio.timeout(max_duration_s), asyncio.TaskGroup() as tasks:
                for i, offset in enumerate(offsets):
                    await sleep_until(start + offset)
                    tasks.create_task(one(i))
        except TimeoutError:
            pass
        end = time.perf_counter() - start
    for i in sent_at.keys() - results.keys():
        results[i] = _cut(specs[i], sent_at[i], end)
    ordered = [results[i] for i in sorted(results)]
    last_end = max((r.start_s + r.latency_s for r in ordered), default=end)
    return RunOutput(ordered, min(end, last_end))


def _cut(spec: RequestSpec, sent_at_s: float, end_s: float) -> RequestResult:
    return RequestResult(
        False,
        spec.prompt_len,
        0,
        start_s=sent_at_s,
        latency_s=end_s - sent_at_s,
        error="time_limit",
        detail="cut by the run's time limit",
    )


async def run_workload(
    target: Target,
    work: list[RequestSpec] | AgentWorkload,
    load: Load,
    max_duration_s: float,
    seed: int = 0,
    progress: Progress | None = None,
) -> RunOutput:
    """run_sessions for an agent workload, else run_load."""
    if isinstance(work, AgentWorkload):
        return await run_sessions(target, work, load, max_duration_s, seed, progress)
    return await run_load(target, work, load, max_duration_s, seed, progress)


@collector_paused
async def run_sessions(
    target: Target,
    work: AgentWorkload,
    load: Load,
    max_duration_s: float,
    seed: int = 0,
    progress: Progress | None = None,
) -> RunOutput:
    """Run every session of `work`: sessions start at `load`'s arrival times (the rate is
    session starts/s; the concurrency caps sessions in flight); within a session, turn k + 1 is
    sent `think_time_s` after turn k completed, with its output in the prompt. A failed turn
    ends its session (there is no output to extend). At `max_duration_s` nothing more is sent
    and requests in flight are cut ("time_limit"). Results in (session, turn) order."""
    offsets = load.arrival_offsets(len(work.sessions), np.random.default_rng(seed))
    cap = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    results: dict[tuple[int, int], RequestResult] = {}
    in_flight: dict[tuple[int, int], tuple[RequestSpec, float]] = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        start = time.perf_counter()

        async def session(i: int) -> None:
            conversation = Conversation(work.sessions[i], work.encode)
            while not conversation.finished:
                if conversation.num_done and work.think_time_s > 0:
                    await asyncio.sleep(work.think_time_s)
                key, spec = (i, conversation.num_done), conversation.next_request()
                in_flight[key] = (spec, time.perf_counter() - start)
                result, text = await exchange(http, target, spec, start)
                del in_flight[key]
                results[key] = replace(result, session=i, turn=key[1])
                if progress is not None:
                    progress.update(results[key])
                if not result.ok:
                    return
                conversation.record_output(text)

        async def capped(i: int) -> None:
            if cap is None:
                return await session(i)
            async with cap:
                await session(i)

        try:
            async with asyncio.timeout(max_duration_s), asyncio.TaskGroup() as tasks:
                for i, offset in enumerate(offsets):
                    await sleep_until(start + offset)
                    tasks.create_task(capped(i))
        except TimeoutError:
            pass
        end = time.perf_counter() - start
    for (i, turn), (spec, sent_at) in in_flight.items():
        results[(i, turn)] = replace(_cut(spec, sent_at, end), session=i, turn=turn)
    ordered = [results[k] for k in sorted(results)]
    last_end = max((r.start_s + r.latency_s for r in ordered), default=end)
    return RunOutput(ordered, min(end, last_end))
