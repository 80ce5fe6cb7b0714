"""Paired, interleaved rounds (loadtest.paired): the order the sides are loaded in, against two
real in-process HTTP servers, and the per-round ratios the tables print."""

import asyncio
import json
import threading

import pytest
from aiohttp import web

from loadtest.metrics import RequestResult, summarize
from loadtest.paired import (
    Side,
    median_of,
    round_order,
    round_ratios,
    run_rounds,
    short_outputs,
    sum_of,
)
from loadtest.report import BenchReport, RunRecord
from loadtest.runner import Load
from loadtest.target import Target
from loadtest.workloads import RequestSpec


def test_rounds_alternate_the_order():
    assert [round_order(["a", "b", "c"], r) for r in range(3)] == [
        ["a", "b", "c"],
        ["c", "b", "a"],
        ["a", "b", "c"],
    ]


def report(tokens_per_s: float, outputs=(4, 4)) -> BenchReport:
    """One load point whose requests made `outputs` tokens over a duration giving tokens_per_s."""
    results = [RequestResult(True, 3, n, latency_s=0.1, ttft_s=0.05) for n in outputs]
    summary = summarize(results, sum(outputs) / tokens_per_s)
    return BenchReport({}, (RunRecord(Load(), summary, tuple(results)),))


def test_ratios_are_paired_round_by_round():
    """b/a per round, not best of b over best of a: round 2 is slow for both (drift)."""
    a = [report(100.0), report(50.0), report(110.0)]
    b = [report(200.0), report(110.0), report(200.0)]
    spread = round_ratios(a, b, 0, lambda s: s.output_throughput)
    assert (spread.median, spread.lo, spread.hi) == pytest.approx((2.0, 200 / 110, 2.2))
    assert str(spread) == "2.00x (1.82-2.20)"
    assert median_of(a, 0, lambda s: s.output_throughput) == pytest.approx(100.0)
    assert round_ratios(a, b, 0, lambda s: s.goodput) is None  # no SLO: no goodput


def test_short_outputs_are_counted():
    specs = [RequestSpec("x", 4, 3), RequestSpec("y", 4, 3)]
    assert short_outputs([report(1.0), report(1.0, outputs=(4, 2))], 0, specs) == 1
    assert sum_of([report(1.0), report(2.0)], 0, lambda s: s.completed) == 4


@pytest.fixture
def servers():
    """Two completions servers in a thread of their own; each request noted as (server, n)."""
    seen: list[str] = []
    loop = asyncio.new_event_loop()
    runners, urls = [], []

    def handler(name):
        async def completions(request: web.Request) -> web.Response:
            await request.json()
            seen.append(name)
            usage = {"prompt_tokens": 3, "completion_tokens": 2}
            return web.json_response({"choices": [{"text": "ab"}], "usage": usage})

        return completions

    async def start():
        for name in ("a", "b"):
            app = web.Application()
            app.router.add_post("/v1/completions", handler(name))
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield urls, seen
    for runner in runners:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_run_rounds_loads_each_side_in_turn(servers, tmp_path):
    (url_a, url_b), seen = servers
    sides = [
        Side("a", Target(url_a, "m", stream=False)),
        Side("b", Target(url_b, "m", stream=False)),
    ]
    specs = [RequestSpec(f"p{i}", 2, 3) for i in range(2)]
    loads = [Load(concurrency=1), Load(concurrency=2)]
    results = run_rounds(sides, specs, loads, rounds=2, workload="w")
    # per load point: round 1 a then b, round 2 b then a; each run sends both specs
    assert seen == list("aabbbbaa" * 2)
    assert sorted(results) == ["a", "b"]
    for name, reports in results.items():
        assert len(reports) == 2 and all(len(r.runs) == 2 for r in reports)
        assert reports[0].label == name
        assert json.loads(json.dumps(reports[1].to_json()))["runs"][1]["load"]["concurrency"] == 2
        assert all(run.summary.completed == 2 for r in reports for run in r.runs)
