"""Orphans: a gateway killed while its streams decode. No client can read their tokens any more,
so the decode worker (a real one, over real NATS) cancels them once the gateway's beats stop,
and every page returns, long before max_tokens."""

import aiohttp

from services_harness import Services, next_heartbeat
from waiting import until


async def test_a_dead_gateways_requests_are_cancelled_and_their_pages_freed(
    tiny_model_factory, tmp_path
):
    model_dir = tiny_model_factory("llama", max_position_embeddings=8192)  # room to run long
    with Services(tmp_path, model_dir) as s:
        common = ["--model", str(model_dir), "--dtype", "float32", "--heartbeat", "0.2"]
        s.scheduler()
        s.start("prefill", "prefill", *common)
        s.start("decode", "decode", *common)
        s.gateway()
        s.wait_healthy()
        idle = await next_heartbeat(s.nats.url, "decode")
        body = {"model": model_dir.name, "prompt": "def fibonacci(n):", "max_tokens": 6000,
                "ignore_eos": True, "stream": True}  # fmt: skip
        async with aiohttp.ClientSession() as http:
            streams = [await http.post(s.base_url + "/v1/completions", json=body) for _ in range(4)]
            for stream in streams:  # every stream is decoding
                await stream.content.readline()
            s.kill("gateway")
            for stream in streams:
                stream.close()

        async def pages_back() -> bool:
            return (await next_heartbeat(s.nats.url, "decode")).free_pages == idle.free_pages

        await until(pages_back, 20, "the decode worker's pages free again")
        assert s.logs().count("is gone; cancelled") == 4
