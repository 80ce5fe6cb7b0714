"""End to end under pressure and failure: a full scheduler queue (429), and kill -9 of the decode
worker mid-stream (every stream ends with an error in bounded time; a new worker takes over)."""

import asyncio
import time

import aiohttp
import openai
import pytest

from services_harness import Services, metric, stream_until_error, wait_pages_free
from waiting import until

FAILURE_BOUND_S = 10.0


async def queue_full(cluster) -> bool:
    """4 requests running, 2 waiting in the scheduler's queue (its --max-waiting)."""
    running = await metric(cluster, "tison_requests_running")
    return (running, await metric(cluster, "tison_requests_waiting")) == (4, 2)


async def streaming(client, model: str, count: int) -> list[asyncio.Task]:
    """`count` streams of 200 tokens, once each has its first token: tasks that return when
    and how it ended."""
    starts = [asyncio.Event() for _ in range(count)]
    tasks = [
        asyncio.create_task(stream_until_error(client, model, s, max_tokens=200)) for s in starts
    ]
    await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 10)
    return tasks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama):
    with Services(tmp_path_factory.mktemp("chaos"), tiny_llama) as s:
        s.scheduler("--max-waiting", "2", "--retry-after", "2")
        s.fake_worker("prefill", "prefill")
        # 64 pages of 16 tokens: four 240-token prompts (and their next tokens) at a time.
        s.fake_worker("decode", "decode", "--step-time", "0.5", "--num-pages", "64")
        s.gateway()
        s.wait_healthy()
        yield s


async def test_full_queue_answers_429_with_retry_after(cluster, tiny_llama):
    # A decode worker admits a request when its prompt and next token fit (max_tokens reserves
    # nothing): 16 pages each, and no more pages as they decode (8 s) up to 256 tokens.
    body = {"model": tiny_llama.name, "prompt": [100] * 240, "max_tokens": 16, "stream": True}
    url = cluster.base_url + "/v1/completions"
    async with aiohttp.ClientSession() as http:
        streams = [asyncio.create_task(http.post(url, json=body)) for _ in range(6)]

        await until(lambda: queue_full(cluster), 30, "4 running and 2 waiting in the scheduler")
        async with http.post(url, json=body) as resp:
            assert resp.status == 429 and resp.headers["Retry-After"] == "2"
            error = (await resp.json())["error"]
            assert error["type"] == "rate_limit_exceeded" and "queue is full" in error["message"]
        for task in streams:
            (await task).close()  # client disconnect: the gateway cancels them
    await wait_pages_free(cluster)
    assert await metric(cluster, "tison_requests_running") == 0
    assert cluster.health() == 200


async def test_kill_decode_mid_stream_fails_streams_then_recovers(cluster, tiny_llama):
    client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)

    tasks = await streaming(client, tiny_llama.name, 4)
    cluster.kill("decode")
    killed_at = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*tasks), FAILURE_BOUND_S + 5)
    for ended_at, error in results:
        assert error is not None and "died" in error
        assert ended_at - killed_at < FAILURE_BOUND_S
    # The prefill worker freed its pages; the dead decode worker's series are gone.
    assert await metric(cluster, "tison_kv_pages_used", "prefill") == 0
    assert await metric(cluster, "tison_kv_pages_total", "decode") == 0
    assert cluster.health() == 503
    with pytest.raises(openai.APIStatusError) as refused:
        await client.completions.create(model=tiny_llama.name, prompt="hello", max_tokens=5)
    assert refused.value.status_code == 503

    cluster.fake_worker("decode2", "decode", "--step-time", "0.5", "--num-pages", "64")  # as before
    await asyncio.to_thread(cluster.wait_healthy)
    out = await client.completions.create(model=tiny_llama.name, prompt="hello", max_tokens=5)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    await wait_pages_free(cluster)
    await client.close()


async def test_a_dead_scheduler_fails_its_queue_fast_and_health_says_so(cluster, tiny_llama):
    """4 requests run and 2 wait in the scheduler's queue when it is killed: the 2 waiting get
    a 503 within FAILURE_BOUND_S (no reply will ever come; they used to wait 65 s), /health
    is 503 while no scheduler answers, and a new scheduler brings it back."""
    assert cluster.health() == 200
    body = {"model": tiny_llama.name, "prompt": [100] * 240, "max_tokens": 16}
    url = cluster.base_url + "/v1/completions"
    async with aiohttp.ClientSession() as http:

        async def status() -> tuple[int, float]:
            async with http.post(url, json=body) as resp:
                await resp.read()
                return resp.status, time.monotonic()

        requests = [asyncio.create_task(status()) for _ in range(6)]

        await until(lambda: queue_full(cluster), 30, "4 running and 2 waiting in the scheduler")
        cluster.kill("scheduler")
        killed_at = time.monotonic()
        results = await asyncio.gather(*requests)
    failed = [at - killed_at for code, at in results if code == 503]
    assert len(failed) == 2 and max(failed) < FAILURE_BOUND_S, results
    await until(lambda: cluster.health() == 503, 10, "/health 503 without a scheduler")
    cluster.scheduler("--max-waiting", "2", "--retry-after", "2")
    await until(lambda: cluster.health() == 200, 30, "/health 200 with a new scheduler")
    await wait_pages_free(cluster)


async def test_kill_prefill_mid_prompt_fails_its_requests_then_recovers(cluster, tiny_llama):
    """2 prompts of 240 tokens take the (slow) prefill worker 12 s each: killed at once, each of
    their requests ends with an error naming the dead worker within FAILURE_BOUND_S, its
    reserved decode pages return, and a new prefill worker serves again."""
    cluster.kill("prefill")  # replaced by a slow one, once every service saw it gone
    await until(lambda: cluster.health() == 503, 10, "the gateway seeing the old one gone")
    cluster.fake_worker("prefill-slow", "prefill", "--prefill-token-time", "0.05")
    await asyncio.to_thread(cluster.wait_healthy)  # the scheduler routes to the slow one
    client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)
    body = dict(model=tiny_llama.name, prompt=[100] * 240, max_tokens=4)

    async def ends() -> tuple[float, str | None]:
        try:
            await client.completions.create(**body)
        except openai.APIError as e:
            return time.monotonic(), str(e)
        return time.monotonic(), None

    tasks = [asyncio.create_task(ends()) for _ in range(2)]

    async def placed() -> bool:  # both reserved on the decode worker: the prefill has them
        return await metric(cluster, "tison_kv_pages_used", "decode") >= 2 * 16

    await until(placed, 30, "both prompts' pages reserved (their prefill under way)")
    cluster.kill("prefill-slow")
    killed_at = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*tasks), FAILURE_BOUND_S + 5)
    for ended_at, error in results:
        assert error is not None and "died" in error, results
        assert ended_at - killed_at < FAILURE_BOUND_S
    await until(lambda: cluster.health() == 503, 10, "the gateway seeing the slow one gone")
    cluster.fake_worker("prefill-again", "prefill")
    await asyncio.to_thread(cluster.wait_healthy)
    out = await client.completions.create(model=tiny_llama.name, prompt="hello", max_tokens=3)
    assert out.usage.completion_tokens == 3
    await wait_pages_free(cluster)
    await client.close()


async def test_kill_nats_mid_stream_fails_streams_saying_so_then_recovers(cluster, tiny_llama):
    """kill -9 of the nats-server under 4 streams: each ends within FAILURE_BOUND_S with an
    error naming NATS (not a worker, which only fell silent); the server back on its port,
    every service reconnects by itself and serves again, and no page stays reserved."""
    client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)
    tasks = await streaming(client, tiny_llama.name, 4)
    cluster.nats._proc.kill()
    killed_at = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*tasks), FAILURE_BOUND_S + 5)
    for ended_at, error in results:
        assert error is not None and "NATS" in error, error
        assert ended_at - killed_at < FAILURE_BOUND_S
    cluster.nats.restart()

    async def serves() -> bool:
        try:
            out = await client.completions.create(
                model=tiny_llama.name, prompt="hello", max_tokens=5
            )
        except openai.APIStatusError:
            return False
        return out.usage.completion_tokens == 5

    await until(serves, 15, "a completion after NATS came back")
    await wait_pages_free(cluster)
    await client.close()


async def test_a_scheduler_restarted_at_once_fails_what_it_held_fast(cluster, tiny_llama):
    """A scheduler killed and replaced before the gateway's pings miss it (tison up restarts
    one within ~1.5 s): the 2 requests the dead one queued fail within FAILURE_BOUND_S, the
    error naming it (they acknowledged by it, and its beats stop), not at the 60 s queue
    timeout; the new scheduler serves."""
    body = {"model": tiny_llama.name, "prompt": [100] * 240, "max_tokens": 16}
    url = cluster.base_url + "/v1/completions"
    async with aiohttp.ClientSession() as http:

        async def outcome() -> tuple[int, str, float]:
            async with http.post(url, json=body) as resp:
                text = await resp.text()
                return resp.status, text, time.monotonic()

        requests = [asyncio.create_task(outcome()) for _ in range(6)]

        await until(lambda: queue_full(cluster), 30, "4 running and 2 waiting in the scheduler")
        cluster.kill("scheduler")
        killed_at = time.monotonic()
        cluster.scheduler("--max-waiting", "2", "--retry-after", "2")
        results = await asyncio.gather(*requests)
    failed = [(at - killed_at, text) for code, text, at in results if code == 503]
    assert len(failed) == 2, results
    for after, text in failed:
        assert after < FAILURE_BOUND_S and "died holding the request" in text, (after, text)
    assert sum(code == 200 for code, _, _ in results) == 4
    await until(lambda: cluster.health() == 200, 30, "/health 200 with the new scheduler")
    await wait_pages_free(cluster)
