"""The load generator's client and runner against a real in-process aiohttp server whose SSE
timing and failures are scripted by the prompt text."""

import asyncio
import json
import math
import time

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from loadtest.bench import run_sync
from loadtest.client import send
from loadtest.runner import Load, run_load, sleep_until
from loadtest.target import Target, check_loopback
from loadtest.workloads import RequestSpec
from shared.errors import InvalidRequestError

FIRST_S, GAP_S = 0.05, 0.02  # the scripted stream: first chunk after 50 ms, then every 20 ms


def sse(payload) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def chunk(text: str) -> bytes:
    return sse({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


class Scripted:
    """Counts requests in flight; answers by the prompt's first word. Records when requests
    came in and output went out on the client's clock (time.perf_counter, one process)."""

    def __init__(self):
        self.in_flight = self.max_in_flight = 0
        self.release = asyncio.Event()  # ends the "hang" answers
        self.arrived: list[float] = []  # as each request's handler started
        self.wrote: list[float] = []  # just before each output (a text chunk, a JSON answer)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.arrived.append(time.perf_counter())
        body = await request.json()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._answer(request, body["prompt"].split()[0], body)
        finally:
            self.in_flight -= 1

    async def _answer(self, request, mode: str, body: dict) -> web.StreamResponse:
        if mode == "busy":
            return web.json_response({"error": {"message": "queue full"}}, status=429)
        if mode == "hang":
            await self.release.wait()
        usage = {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
        if not body.get("stream"):
            await asyncio.sleep(FIRST_S)  # simulated compute, the scripted timing under test
            self.wrote.append(time.perf_counter())
            return web.json_response({"choices": [{"text": "abcd"}], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk(""))  # a role-only / empty first chunk is not a token
        await asyncio.sleep(FIRST_S)  # simulated prefill, the scripted timing under test
        await self._token(resp, "a")
        if mode == "broken":
            await resp.write(sse({"error": {"message": "worker died"}}))
        if mode in ("broken", "cut"):
            return resp
        if mode == "no_done":  # ends after a finish reason without [DONE]: still complete
            await resp.write(sse({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}))
            return resp
        for text in "bcd":
            await asyncio.sleep(GAP_S)  # simulated decode step, the scripted timing under test
            await self._token(resp, text)
        closing = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
        await resp.write(sse(closing) + sse({"choices": [], "usage": usage}) + b"data: [DONE]\n\n")
        return resp

    async def _token(self, resp: web.StreamResponse, text: str) -> None:
        self.wrote.append(time.perf_counter())
        await resp.write(chunk(text))


@pytest.fixture
async def server():
    scripted = Scripted()
    app = web.Application()
    app.router.add_post("/v1/completions", scripted.completions)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    scripted.url = f"http://127.0.0.1:{port}"
    yield scripted
    scripted.release.set()
    await runner.cleanup()


def spec(mode: str) -> RequestSpec:
    return RequestSpec(f"{mode} please", max_tokens=4, prompt_len=2)


async def one(target: Target, mode: str):
    async with aiohttp.ClientSession() as session:
        return await send(session, target, spec(mode), run_start=0.0)


async def test_stream_timings_and_usage(server):
    r = await one(Target(server.url, "m"), "ok")
    assert r.ok, r.detail
    assert (r.prompt_len, r.output_len) == (7, 4)  # the server's usage wins
    # The client sent before the server got the request, saw each token no earlier than the
    # server wrote it (the role-only chunk before does not count), and ended after the last.
    seen = r.start_s + r.ttft_s + np.cumsum((0.0, *r.itl_s))
    assert r.start_s <= server.arrived[0] and len(seen) == len(server.wrote) == 4
    assert all(at >= wrote - 1e-6 for at, wrote in zip(seen, server.wrote))
    assert r.start_s + r.latency_s >= seen[-1] - 1e-6
    assert r.ttft_s >= FIRST_S  # at least the server's delay before the first token
    assert r.tpot_s == pytest.approx((r.latency_s - r.ttft_s) / 3)


async def test_a_stream_may_end_after_a_finish_reason_without_done(server):
    r = await one(Target(server.url, "m"), "no_done")
    assert r.ok and r.output_len == 1 and r.ttft_s >= FIRST_S


async def test_not_streamed_ttft_is_the_whole_latency(server):
    r = await one(Target(server.url, "m", stream=False), "ok")
    assert r.ok and r.output_len == 4 and r.itl_s == ()
    assert r.ttft_s == r.latency_s >= FIRST_S


@pytest.mark.parametrize(
    "mode, kind",
    [("busy", "http_429"), ("broken", "stream_error"), ("cut", "bad_response")],
)
async def test_errors_by_kind(server, mode, kind):
    r = await one(Target(server.url, "m"), mode)
    assert not r.ok and r.error == kind and r.output_len == 0


async def test_timeout_and_refused_connection(server):
    r = await one(Target(server.url, "m", timeout_s=0.2), "hang")
    # A hang is never answered: the client gave up by itself, and not before its timeout.
    assert (r.ok, r.error) == (False, "timeout") and r.latency_s >= 0.2
    closed = server.url.rsplit(":", 1)[0] + ":1"
    r = await one(Target(closed, "m"), "ok")
    assert (r.ok, r.error) == (False, "connect")


async def test_concurrency_cap_is_respected(server):
    out = await run_load(Target(server.url, "m"), [spec("ok")] * 12, Load(concurrency=3), 30)
    assert [r.ok for r in out.results] == [True] * 12
    assert server.max_in_flight == 3
    # The run spans the server's work, from the first arrival to the last token written.
    assert out.duration_s >= max(server.wrote) - min(server.arrived)


async def test_rate_spreads_the_sends(server):
    before = time.perf_counter()  # the run starts after this
    out = await run_load(Target(server.url, "m"), [spec("ok")] * 8, Load(rate=20.0), 30, seed=3)
    starts = sorted(r.start_s for r in out.results)
    expected = Load(rate=20.0).arrival_offsets(8, np.random.default_rng(3))
    assert all(s >= e - 1e-9 for s, e in zip(starts, expected))  # never early
    # Each send is dated no later than the server got the request.
    assert all(s <= got - before for s, got in zip(starts, sorted(server.arrived)))


def test_sleep_until_never_ends_early_on_uvloop():
    # uvloop (the loop run_sync picks) rounds a delay to whole ms and counts it from a cached
    # time: a single asyncio.sleep ends early (a CI run sent a session's first turn early)
    async def lateness() -> list[float]:
        out = []
        for delay in [0.0002, 0.0004, 0.0007, 0.0012, 0.0031] * 4:
            await asyncio.sleep(0)  # the loop reads its clock here...
            deadline = time.perf_counter() + 0.002 + delay
            time.sleep(0.002)  # ...and not while a callback works
            await sleep_until(deadline)
            out.append(time.perf_counter() - deadline)
        return out

    assert min(run_sync(lateness())) >= 0


async def test_time_limit_cuts_what_is_in_flight(server):
    load = Load(rate=10.0)
    out = await run_load(Target(server.url, "m"), [spec("hang")] * 8, load, max_duration_s=0.3)
    due = sum(t < 0.3 for t in load.arrival_offsets(8, np.random.default_rng(0)))
    # The first goes at once; those due after the limit were never sent.
    assert 1 <= len(out.results) <= due < 8
    assert {r.error for r in out.results} == {"time_limit"}
    assert out.duration_s >= 0.3  # it ran to the limit, where all in flight were cut
    assert all(r.start_s + r.latency_s == pytest.approx(out.duration_s) for r in out.results)


def test_poisson_gaps_have_the_rate_and_a_unit_coefficient_of_variation():
    offsets = Load(rate=50.0).arrival_offsets(5000, np.random.default_rng(0))
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.07)
    bursty = np.diff(
        Load(rate=50.0, burstiness=0.25).arrival_offsets(5000, np.random.default_rng(0))
    )
    assert bursty.mean() == pytest.approx(1 / 50, rel=0.1)
    assert bursty.std() / bursty.mean() > 1.6  # gamma shape k: CV = 1/sqrt(k) = 2
    assert Load(concurrency=4).arrival_offsets(3, np.random.default_rng(0)) == [0.0] * 3
    assert math.isinf(Load().rate)


def test_bodies_for_both_apis():
    s = RequestSpec("tail", 5, 9, prefix="system text ")
    chat = Target("http://127.0.0.1:1/v1", "m", api="chat", ignore_eos=True).body(s)
    assert chat["messages"] == [
        {"role": "system", "content": "system text "},
        {"role": "user", "content": "tail"},
    ]
    assert chat["ignore_eos"] is True
    assert chat["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    extra = Target("http://127.0.0.1:1", "m", extra=(("generation_config", "{}"),)).body(s)
    assert extra["generation_config"] == "{}" and "ignore_eos" not in extra
    plain = Target("http://127.0.0.1:1", "m", stream=False).body(s)
    assert plain["prompt"] == "system text tail" and "stream" not in plain
    assert Target("http://127.0.0.1:1/v1/", "m", api="chat").url.endswith(":1/v1/chat/completions")


def test_only_loopback_targets_unless_allowed():
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:8000/v1")
    check_loopback("http://[::1]:8000")
    with pytest.raises(InvalidRequestError, match="allow-remote"):
        check_loopback("http://10.1.2.3:8000")
    check_loopback("http://10.1.2.3:8000", allow_remote=True)
    with pytest.raises(InvalidRequestError):
        Target("ftp://127.0.0.1", "m")
