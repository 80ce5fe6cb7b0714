"""Inter-token latency per token, not per SSE event: the load generator's client against a real
in-process aiohttp server that sends several tokens in one event, with and without a running
usage (vLLM's continuous_usage_stats)."""

import json

import aiohttp
import pytest
from aiohttp import web

from loadtest.client import send, token_gaps
from loadtest.metrics import summarize
from loadtest.target import Target
from loadtest.workloads import RequestSpec

# the scripted stream: (tokens in the event, event) - 1, then 3 at once, then 2 at once
EVENTS = ((1, "a"), (3, "bcd"), (2, "ef"))


def test_token_gaps_split_an_event_over_its_tokens():
    assert token_gaps([(1.0, 1), (1.3, 3), (1.5, 2)]) == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.1])
    assert token_gaps([(2.0, 2), (2.4, 1)]) == pytest.approx([0.0, 0.4])  # 2 in the first
    assert token_gaps([(5.0, 1)]) == () and token_gaps([]) == ()


@pytest.fixture
async def server():
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        running = body["stream_options"].get("continuous_usage_stats") and not body.get("old")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        done = 0
        events = [(1, c) for c in "abcdef"] if body.get("closing_usage") else EVENTS
        for tokens, text in events:
            done += tokens
            chunk = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
            if running:
                chunk["usage"] = {"prompt_tokens": 3, "completion_tokens": done}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        end = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": done}}
        closing = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
        if body.get("closing_usage"):  # as transformers serve sends it: on the closing chunk
            closing["usage"], end = end["usage"], None
        for payload in filter(None, (closing, end)):
            await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    await runner.cleanup()


async def test_a_running_usage_gives_a_gap_per_token(server):
    async with aiohttp.ClientSession() as session:
        r = await send(session, Target(server, "m"), RequestSpec("p", 6, 3), 0.0)
    assert r.ok and r.output_len == 6 and r.itl_per_token
    assert len(r.itl_s) == 5  # six tokens: five gaps, though three events
    assert summarize([r], 1.0).itl_per_event == 0


async def test_a_final_usage_on_the_closing_chunk_is_not_a_running_one(server):
    """One token an event and the usage on the last chunk with a choice (transformers serve's
    stream): each event is a token, and the usage is the total, not six more tokens."""
    target = Target(server, "m", extra=(("old", True), ("closing_usage", True)))
    async with aiohttp.ClientSession() as session:
        r = await send(session, target, RequestSpec("p", 6, 3), 0.0)
    assert r.ok and r.output_len == 6 and r.itl_per_token
    assert len(r.itl_s) == 5


async def test_without_counts_the_gaps_stay_per_event_and_say_so(server):
    """A server that puts several tokens in an event and tells nobody: the client cannot split
    the gaps, keeps one an event and marks the request."""
    target = Target(server, "m", extra=(("old", True),))
    async with aiohttp.ClientSession() as session:
        r = await send(session, target, RequestSpec("p", 6, 3), 0.0)
    assert r.ok and r.output_len == 6 and not r.itl_per_token
    assert len(r.itl_s) == 2
    assert summarize([r], 1.0).itl_per_event == 1
