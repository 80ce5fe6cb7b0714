"""Overload over real processes (NATS, scheduler, gateway, fake workers): 300 concurrent requests
against a small admission limit each get a result or a 429 with Retry-After, none a 5xx or a
long wait for nothing; afterwards no page stays reserved and no reservation was retried."""

import asyncio

import aiohttp
import pytest

from services_harness import Services, wait_pages_free


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama):
    with Services(tmp_path_factory.mktemp("overload"), tiny_llama) as s:
        s.scheduler("--max-waiting", "16", "--max-waiting-tokens", "400")
        s.fake_worker("prefill", "prefill")
        s.fake_worker("decode", "decode", "--num-pages", "64", "--step-time", "0.005")
        s.gateway("--queue-timeout", "30")
        s.wait_healthy()
        yield s


async def test_300_concurrent_requests_get_a_result_or_a_429(cluster, tiny_llama):
    body = {"model": tiny_llama.name, "prompt": "def fibonacci(n):", "max_tokens": 64}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:

        async def one() -> tuple[int, str | None]:
            async with http.post(cluster.base_url + "/v1/completions", json=body) as resp:
                reply = await resp.json()
                if resp.status == 200:
                    assert reply["choices"][0]["text"]
                else:
                    assert reply["error"]["message"]
                return resp.status, resp.headers.get("Retry-After")

        results = await asyncio.gather(*(one() for _ in range(300)))
    statuses = [status for status, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 16 and statuses.count(429) >= 1  # the limit was reached
    assert all(int(after) >= 1 for status, after in results if status == 429)
    await wait_pages_free(cluster)
    assert "already running" not in cluster.logs()
