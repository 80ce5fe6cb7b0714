"""End to end with real model workers: NATS, scheduler, gateway, a prefill and a decode worker
running the tiny model, driven by the official `openai` client. Outputs must equal the offline
`LLM.generate` token for token; KV pages move peer-to-peer, never over NATS."""

import asyncio
import contextlib

import aiohttp
import nats
import openai
import pytest

from shared import protocol, subjects
from shared.engine.llm import LLM
from shared.protocol import GatewayBeatMsg
from shared.sampling.params import SamplingParams

from services_harness import (
    cluster_for,
    metric,
    nats_bytes_per_request,
    next_heartbeat,
    wait_metric,
    wait_pages_free,
)

STREAMS_DROPPED = 8
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama):
    s = cluster_for(tmp_path_factory, tiny_llama, "auto")
    yield s
    s.stop_all()


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32")


async def completions(client, model, prompt, stream: bool, **kw):
    """(text, finish_reason, usage) of one completion, streamed or not."""
    if not stream:
        out = await client.completions.create(model=model, prompt=prompt, **kw)
        return out.choices[0].text, out.choices[0].finish_reason, out.usage
    chunks = await client.completions.create(
        model=model, prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw
    )
    text, finish, usage = "", None, None
    async for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    return text, finish, usage


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_equal_offline_generate(client, llm, tiny_llama, stream):
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    for prompt, ref in zip(PROMPTS, expected):
        text, finish, usage = await completions(
            client, tiny_llama.name, prompt, stream, max_tokens=24, temperature=0
        )
        assert (text, finish) == (ref.text, ref.finish_reason)
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            len(ref.prompt_token_ids),
            len(ref.token_ids),
        )


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_equals_offline_chat(client, llm, tiny_llama, stream):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
    ]
    ref = llm.chat([messages], SamplingParams(temperature=0, max_tokens=16))[0]
    kw = dict(model=tiny_llama.name, messages=messages, max_tokens=16, temperature=0)
    if stream:
        text = ""
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
    else:
        text = (await client.chat.completions.create(**kw)).choices[0].message.content
    assert text == ref.text


async def test_logprobs_equal_offline_chat(client, llm, tiny_llama):
    """One logprob type from the engine to the response: the first token's (the prefill
    worker's) and the decode worker's are the offline ones."""
    messages = [{"role": "user", "content": "hello there"}]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    ref = llm.chat([messages], params)[0].logprobs
    out = await client.chat.completions.create(
        model=tiny_llama.name,
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    got = out.choices[0].logprobs.content
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in ref], abs=1e-4)
    tops = [[t.logprob for t in e.top_logprobs] for e in got]
    assert tops == [pytest.approx(list(e.top_logprobs), abs=1e-4) for e in ref]


async def test_seeded_sampling_is_the_same_across_prefill_and_decode(client, llm, tiny_llama):
    """The seed drives both workers' draws (prefill samples token 0, decode the rest)."""
    params = dict(temperature=0.9, top_p=0.95, seed=4242, max_tokens=20)
    ref = llm.generate(PROMPTS[1], SamplingParams(**params, ignore_eos=True))[0]
    text, _, _ = await completions(
        client, tiny_llama.name, PROMPTS[1], True, extra_body={"ignore_eos": True}, **params
    )
    assert text == ref.text


async def test_32_concurrent_streams_complete_with_usage(client, llm, tiny_llama, cluster):
    async def one(i):
        return await completions(
            client,
            tiny_llama.name,
            f"Once upon a time {i}",
            True,
            max_tokens=8 + i % 4,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    results = await asyncio.gather(*(one(i) for i in range(32)))
    prompts = [f"Once upon a time {i}" for i in range(32)]
    params = [
        SamplingParams(temperature=0, max_tokens=8 + i % 4, ignore_eos=True) for i in range(32)
    ]
    expected = llm.generate(prompts, params)
    for i, (text, finish, usage) in enumerate(results):
        assert text == expected[i].text
        assert finish == "length" and usage.completion_tokens == 8 + i % 4
        assert usage.prompt_tokens == len(llm.tokenizer.encode(f"Once upon a time {i}"))
    await wait_pages_free(cluster)


async def test_an_idle_decode_worker_prefills_part_of_a_burst(client, llm, tiny_llama, cluster):
    """Conditional prefill: a burst of short prompts is split between the prefill worker and
    the idle decode worker (fewer KV bytes pushed than one request's times the burst), and
    every output is the offline one. The router splits what reaches it within one heartbeat
    interval of each worker (0.5 s) while the decode worker reports an empty batch; on a
    loaded host a burst's requests can trickle in slower than that, so up to three bursts are
    sent, and one must split."""

    async def pushed() -> int:
        return (await next_heartbeat(cluster.nats.url, "prefill")).kv_transfer_bytes

    async def one(i: int):
        return await completions(
            client, tiny_llama.name, f"Once upon a time {i}", False, max_tokens=6, temperature=0
        )

    await wait_pages_free(cluster)
    before = await pushed()
    await one(0)  # alone: both queues empty, the prefill worker computes it
    single = await pushed() - before
    assert single > 0
    burst_pushed = []
    for first in (1, 7, 13):  # new prompts each time: none of them cached on either worker
        ids = range(first, first + 6)
        await wait_pages_free(cluster)
        before = await pushed()
        results = await asyncio.gather(*(one(i) for i in ids))
        expected = llm.generate(
            [f"Once upon a time {i}" for i in ids], SamplingParams(temperature=0, max_tokens=6)
        )
        assert [text for text, _, _ in results] == [e.text for e in expected]
        burst_pushed.append(await pushed() - before)
        if burst_pushed[-1] <= 5 * single:  # some prompts never left the decoder
            break
    else:
        pytest.fail(f"no burst split: {burst_pushed} bytes pushed, {single} for one prompt")
    await wait_pages_free(cluster)


async def test_metrics_show_where_a_tokens_time_goes(cluster, client, tiny_llama):
    """Each decode step's tokens message tells the gateway its engine step, its step-to-step
    cycle (never shorter) and its publish time (loadtest/scenarios/overhead.py reads them)."""
    names = {
        "step": "tison_decode_step_seconds",
        "cycle": "tison_decode_cycle_seconds",
        "transit": "tison_tokens_transit_seconds",
    }

    async def read() -> dict[str, tuple[float, float]]:
        return {
            k: (await metric(cluster, f"{n}_sum"), await metric(cluster, f"{n}_count"))
            for k, n in names.items()
        }

    before = await read()
    await client.completions.create(
        model=tiny_llama.name, prompt="hello", max_tokens=12, extra_body={"ignore_eos": True}
    )
    after = await read()
    delta = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in names}
    assert delta["step"][1] >= 10  # the first token is relayed (no step), then a step each
    assert delta["step"][1] == delta["cycle"][1] == delta["transit"][1]
    assert delta["cycle"][0] >= delta["step"][0] > 0
    assert 0 <= delta["transit"][0] / delta["transit"][1] < 1.0


async def test_kv_bytes_go_peer_to_peer_not_over_nats(cluster, client, tiny_llama):
    """Per extra prompt token, NATS carries a few bytes of token ids while the KV transport
    moves the token's KV (2 layers x 2 KV heads x 16 dims x K,V x 4 B = 512 B)."""

    async def kv_bytes() -> int:
        """What the prefill worker has pushed, every request that has ended counted, as the
        gateway's /metrics shows it."""
        pushed = (await next_heartbeat(cluster.nats.url, "prefill")).kv_transfer_bytes
        what = f"/metrics to show the {pushed} KV bytes the prefill worker sent"
        await wait_metric(
            cluster, "tison_kv_transfer_bytes", lambda n: n == pushed, what, "prefill"
        )
        return pushed

    async def measure(num_tokens):
        before = await kv_bytes()

        async def send():
            await client.completions.create(
                model=tiny_llama.name, prompt=[7] * num_tokens, max_tokens=4
            )

        sent = await nats_bytes_per_request(cluster, send)
        return sent, await kv_bytes() - before

    (short_nats, short_kv), (long_nats, long_kv) = await measure(10), await measure(210)
    assert (long_nats - short_nats) / 200 <= 8, (short_nats, long_nats)
    assert (long_kv - short_kv) / 200 == 512, (short_kv, long_kv)


async def test_malformed_nats_messages_are_dropped_counted_and_served_through(
    cluster, client, llm, tiny_llama
):
    """Garbage on a worker's assignment subject, the KV subject and a gateway's token stream:
    each process drops it, counts it in /metrics (the workers through their heartbeats), and
    serves on."""
    beat = await next_heartbeat(cluster.nats.url, "decode")
    nc = await nats.connect(cluster.nats.url)
    try:
        alive = await nc.subscribe(subjects.all_gateway_heartbeats())
        gateway = protocol.decode((await alive.next_msg(timeout=10)).data, GatewayBeatMsg)
        for subject in (
            subjects.assign("decode", beat.worker_id),
            subjects.decode_kv(beat.worker_id),
            subjects.gateway_tokens(gateway.gateway_id),
        ):
            await nc.publish(subject, b"\x93not a message")
        await nc.flush()
    finally:
        await nc.close()
    await wait_metric(
        cluster, "tison_worker_dropped_messages", lambda n: n >= 2, "decode drops", "decode"
    )
    await wait_metric(cluster, "tison_gateway_dropped_messages", lambda n: n >= 1, "gateway drop")
    text, _, _ = await completions(
        client, tiny_llama.name, PROMPTS[0], False, max_tokens=4, temperature=0
    )
    ref = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))[0]
    assert text == ref.text


async def test_client_disconnect_frees_pages_on_both_workers(cluster, tiny_llama):
    """Streams that their clients drop mid-way: their pages come back. Several at once, so
    that they decode for many heartbeats (one alone could end before the decode worker's next
    one reports its pages in use)."""
    body = {
        "model": tiny_llama.name,
        "prompt": "Once upon a time",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession() as http, contextlib.AsyncExitStack() as streams:
        for _ in range(STREAMS_DROPPED):
            resp = await streams.enter_async_context(
                http.post(cluster.base_url + "/v1/completions", json=body)
            )
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")
        what = "the decode worker to report pages in use"
        await wait_metric(cluster, "tison_kv_pages_used", lambda n: n > 0, what, "decode")
    await wait_pages_free(cluster)
    assert await metric(cluster, "tison_requests_running") == 0


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "M", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "M", "prompt": "x", "temperature": 5}, 400, "temperature"),
        ({"model": "M", "prompt": "x " * 400}, 400, "prompt"),
        ({"model": "nope", "prompt": "x"}, 404, "model"),
    ],
)
async def test_bad_requests_get_4xx_and_service_stays_healthy(
    cluster, tiny_llama, body, status, param
):
    body = dict(body, model=tiny_llama.name) if body["model"] == "M" else body
    async with aiohttp.ClientSession() as http:
        async with http.post(cluster.base_url + "/v1/completions", json=body) as resp:
            assert resp.status == status
            error = (await resp.json())["error"]
    assert error["param"] == param and error["message"]
    assert cluster.health() == 200


@pytest.mark.parametrize("layout", ["colocated", "tcp"])
async def test_colocated_and_tcp_give_the_same_tokens(
    tmp_path_factory, tiny_llama, llm, layout, monkeypatch
):
    monkeypatch.setenv("TISON_KV_SECRET", "test-secret")
    s = cluster_for(tmp_path_factory, tiny_llama, layout)
    try:
        async with openai.AsyncOpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0) as c:
            expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
            for prompt, ref in zip(PROMPTS, expected):
                text, finish, _ = await completions(
                    c, tiny_llama.name, prompt, True, max_tokens=24, temperature=0
                )
                assert (text, finish) == (ref.text, ref.finish_reason)
            if layout == "tcp":
                what = "the decode worker to report KV bytes received over TCP"
                await wait_metric(s, "tison_kv_transfer_bytes", lambda n: n > 0, what, "decode")
        await wait_pages_free(s)
    finally:
        s.stop_all()
