"""kill -9 of a real decode worker mid-stream: every open stream ends with an error within the
bound, then a restarted decode worker serves new requests."""

import asyncio
import time

import openai

from services_harness import cluster_for, metric, stream_until_error, wait_pages_free

FAILURE_BOUND_S = 10.0


async def test_kill_decode_mid_stream_then_recover(tmp_path_factory, tiny_llama):
    cluster = cluster_for(tmp_path_factory, tiny_llama, "auto")
    client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0)
    try:
        starts = [asyncio.Event() for _ in range(4)]
        tasks = [
            asyncio.create_task(
                stream_until_error(
                    client,
                    tiny_llama.name,
                    s,
                    max_tokens=240,
                    extra_body={"ignore_eos": True, "min_tokens": 240},
                )
            )
            for s in starts
        ]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 30)
        cluster.kill("decode")
        killed_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks), FAILURE_BOUND_S + 5)
        for ended_at, error in results:
            assert error is not None, "a stream of the killed worker ended without an error"
            assert ended_at - killed_at < FAILURE_BOUND_S
        assert await metric(cluster, "tison_kv_pages_used", "prefill") == 0

        cluster.start(
            "decode",
            "decode",
            "--model",
            str(tiny_llama),
            "--dtype",
            "float32",
            "--heartbeat",
            "0.2",
        )
        await asyncio.to_thread(cluster.wait_healthy, 90)
        out = await client.completions.create(
            model=tiny_llama.name, prompt="hello", max_tokens=5, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
        await wait_pages_free(cluster)
    finally:
        await client.close()
        cluster.stop_all()
