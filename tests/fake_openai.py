"""A fake OpenAI-compatible server for load-generator tests, in a thread of its own (so the
CLI's event loop can load it too): /v1/completions (token-id prompts), /v1/chat/completions,
streamed with a running usage; it records each prompt and answers with text made from it, and
counts prefix-cache-like hits on /metrics (the longest page-aligned prefix seen before)."""

import asyncio
import json
import threading
import time
from contextlib import contextmanager

from aiohttp import web

FIRST_S = 0.02  # the fake server's delay before its first token
PAGE = 16  # tokens a cache page: hits count whole pages


def sse(payload) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def output_words(prompt, max_tokens: int) -> list[str]:
    """The fake server's answer: a function of the prompt, so a test can predict it."""
    return [f" fox{(len(prompt) + i) % 7}" for i in range(max_tokens)]


def cached_prefix(prompt: tuple, seen: list[tuple]) -> int:
    """Tokens of `prompt` a prefix cache of every prompt in `seen` would hold: the longest
    common prefix, in whole pages, leaving at least one token to compute."""
    best = 0
    for other in seen:
        n = 0
        for a, b in zip(prompt, other):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return min(best, len(prompt) - 1) // PAGE * PAGE


class FakeServer:
    """Records (arrived, finished, prompt) per request on time.perf_counter; the prompt is the
    token-id tuple or the ((role, content), ...) messages."""

    def __init__(self):
        self.seen: list[tuple[float, float, tuple]] = []
        self.in_flight = self.max_in_flight = 0
        self.hit_tokens = self.queried_tokens = 0
        self.url = ""

    def reset(self) -> None:
        self.seen.clear()
        self.max_in_flight = 0

    async def answer(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        body = await request.json()
        if "messages" in body:
            prompt = tuple((m["role"], m["content"]) for m in body["messages"])
            key = "delta"
        else:
            prompt, key = tuple(body["prompt"]), "text"
            if not isinstance(body["prompt"], str):
                self.hit_tokens += cached_prefix(prompt, [p for _, _, p in self.seen])
                self.queried_tokens += len(prompt)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(FIRST_S)  # simulated prefill, the timing under test
            words = output_words(prompt, body["max_tokens"])
            for i, word in enumerate(words):
                text = {"content": word} if key == "delta" else word
                usage = {"prompt_tokens": len(prompt), "completion_tokens": i + 1}
                await resp.write(sse({"choices": [{key: text, "finish_reason": None}], **usage}))
            closing = {"choices": [{key: {} if key == "delta" else "", "finish_reason": "length"}]}
            # recorded before the client can see the end: it may finish its run at [DONE]
            self.seen.append((arrived, time.perf_counter(), prompt))
            await resp.write(sse(closing) + b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        lines = [
            "# TYPE tison_prefix_cache_hit_tokens_total counter",
            f'tison_prefix_cache_hit_tokens_total{{worker="p0"}} {self.hit_tokens}',
            "# TYPE tison_prefix_cache_queried_tokens_total counter",
            f'tison_prefix_cache_queried_tokens_total{{worker="p0"}} {self.queried_tokens}',
            "# TYPE tison_requests_running gauge",
            "tison_requests_running 0",
        ]
        return web.Response(text="\n".join(lines) + "\n")


@contextmanager
def fake_server():
    """A FakeServer serving on a free loopback port (its .url) until the block ends."""
    fake, loop, ready = FakeServer(), asyncio.new_event_loop(), threading.Event()

    def serve() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", fake.answer)
        app.router.add_post("/v1/chat/completions", fake.answer)
        app.router.add_get("/v1/models", fake.models)
        app.router.add_get("/metrics", fake.metrics)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        fake.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the fake server did not start")
    try:
        yield fake
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
