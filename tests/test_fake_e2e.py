"""End to end over real processes: NATS, scheduler, gateway, one fake prefill and one fake decode
worker, driven with the official `openai` client (and aiohttp for malformed requests)."""

import asyncio
import json

import aiohttp
import pytest

from services.fake_worker.tokens import FakeModelInfo, fake_token, prompt_digest
from shared.tokenizer.tokenizer import Tokenizer

from services_harness import Services, metric, nats_bytes_per_request, wait_pages_free

STEP_S = 0.01  # decode step time of the fake decode worker


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama):
    with Services(tmp_path_factory.mktemp("services"), tiny_llama) as s:
        s.scheduler()
        s.fake_worker("prefill", "prefill")
        s.fake_worker("decode", "decode", "--step-time", str(STEP_S))
        s.gateway()
        s.wait_healthy()
        yield s


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return Tokenizer.from_dir(tiny_llama)


@pytest.fixture(scope="module")
def info(tiny_llama):
    return FakeModelInfo.from_dir(tiny_llama)


def expected_text(tokenizer, info, prompt_ids, num_tokens):
    """What the gateway must return: the fake tokens, detokenized after the prompt."""
    out = [fake_token(info, prompt_digest(tuple(prompt_ids)), i) for i in range(num_tokens)]
    return tokenizer.decode(prompt_ids + out)[len(tokenizer.decode(prompt_ids)) :]


async def test_models_and_health(client, cluster, tiny_llama):
    models = await client.models.list()
    assert [m.id for m in models.data] == [tiny_llama.name]
    assert cluster.health() == 200


async def test_32_concurrent_streams_complete_with_usage(
    client, tokenizer, info, tiny_llama, cluster
):
    async def one(i):
        prompt = f"Once upon a time {i}"
        stream = await client.completions.create(
            model=tiny_llama.name,
            prompt=prompt,
            max_tokens=10 + i % 5,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return prompt, text, usage, finish

    results = await asyncio.gather(*(one(i) for i in range(32)))
    for i, (prompt, text, usage, finish) in enumerate(results):
        ids = tokenizer.encode(prompt)
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 10 + i % 5)
        assert usage.total_tokens == len(ids) + 10 + i % 5 and finish == "length"
        assert text == expected_text(tokenizer, info, ids, 10 + i % 5)
    await wait_pages_free(cluster)
    assert await metric(cluster, "tison_kv_pages_total", "decode") == 4096


async def test_chat_non_stream_and_stream_shapes(client, tokenizer, info, tiny_llama):
    messages = [{"role": "user", "content": "hello there"}]
    ids = tokenizer.encode_chat(messages)
    full = await client.chat.completions.create(
        model=tiny_llama.name, messages=messages, max_completion_tokens=6
    )
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == expected_text(tokenizer, info, ids, 6)
    assert full.usage.prompt_tokens == len(ids) and full.usage.completion_tokens == 6
    chunks = [
        c
        async for c in await client.chat.completions.create(
            model=tiny_llama.name, messages=messages, max_tokens=6, stream=True
        )
    ]
    assert (
        chunks[0].object == "chat.completion.chunk"
        and chunks[0].choices[0].delta.role == "assistant"
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


async def test_logprobs_shapes(client, tiny_llama):
    chat = await client.chat.completions.create(
        model=tiny_llama.name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert content[0].top_logprobs[0].token == content[0].token
    assert content[0].bytes == list(content[0].token.encode())
    text = await client.completions.create(
        model=tiny_llama.name, prompt="hi", max_tokens=4, logprobs=1
    )
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == text.choices[0].text


async def test_stop_string_ends_request_and_frees_pages(
    client, tokenizer, info, tiny_llama, cluster
):
    prompt = "The quick brown fox"
    full = expected_text(tokenizer, info, tokenizer.encode(prompt), 40)
    stop = full[10:13]
    out = await client.completions.create(
        model=tiny_llama.name, prompt=prompt, max_tokens=40, stop=[stop, "\x00"]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[: full.index(stop)]
    assert out.usage.completion_tokens < 40
    await wait_pages_free(cluster)


async def test_client_disconnect_frees_pages_on_both_workers(cluster, tiny_llama):
    body = {
        "model": tiny_llama.name,
        "prompt": "Once upon a time",
        "max_tokens": 200,
        "stream": True,
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(cluster.base_url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")
            await resp.content.readuntil(b"\n\n")
            assert await metric(cluster, "tison_requests_running") == 1
            # the response is closed here, mid-stream (200 tokens take >= 2 s)
    await wait_pages_free(cluster)
    assert await metric(cluster, "tison_requests_running") == 0


async def test_nats_bytes_do_not_grow_with_kv_size(cluster, client, tiny_llama):
    """Only token ids and page numbers cross NATS: bytes per extra prompt token stay far below the
    KV size of a token (tiny model: 2 layers x 2 KV heads x 16 dims x K,V x 4 B = 512 B)."""

    async def nats_bytes(num_words):
        async def send():
            await client.completions.create(
                model=tiny_llama.name, prompt=[7] * num_words, max_tokens=4
            )

        return await nats_bytes_per_request(cluster, send)

    short, long = await nats_bytes(10), await nats_bytes(210)
    per_token = (long - short) / 200
    assert short > 0 and per_token <= 8, (short, long)


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("completions", b"{not json", 400, "body"),
        ("completions", {"prompt": "x"}, 400, "model"),
        ("completions", {"model": "M"}, 400, "prompt"),
        ("completions", {"model": "M", "prompt": 5}, 400, "prompt"),
        ("completions", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("completions", {"model": "M", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("completions", {"model": "M", "prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
        ("completions", {"model": "M", "prompt": "x", "temperature": 2.5}, 400, "temperature"),
        ("completions", {"model": "M", "prompt": "x", "top_p": 0}, 400, "top_p"),
        ("completions", {"model": "M", "prompt": "x", "n": 0}, 400, "n"),
        ("completions", {"model": "M", "prompt": "x", "stop": [1]}, 400, "stop"),
        ("completions", {"model": "M", "prompt": [1] * 300}, 400, "prompt"),
        ("completions", {"model": "M", "prompt": "x", "max_tokens": 1000}, 400, "max_tokens"),
        ("chat/completions", {"model": "M", "messages": []}, 400, "messages"),
        ("chat/completions", {"model": "M", "messages": [{"content": "x"}]}, 400, "messages[0]"),
        (
            "chat/completions",
            {
                "model": "M",
                "messages": [{"role": "user", "content": "x"}],
                "top_logprobs": 30,
                "logprobs": True,
            },
            400,
            "top_logprobs",
        ),
    ],
)
async def test_malformed_requests_get_openai_errors(cluster, tiny_llama, path, body, status, param):
    if isinstance(body, dict) and body.get("model") == "M":
        body = {**body, "model": tiny_llama.name}
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{cluster.base_url}/v1/{path}", **kwargs) as resp:
            assert resp.status == status
            error = (await resp.json())["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    assert cluster.health() == 200


async def test_running_usage_counts_every_token_for_the_load_generator(cluster, tiny_llama):
    """stream_options.continuous_usage_stats (vLLM's): every chunk carries the usage so far, so
    the load generator counts the tokens of each event, however many the gateway put in it."""
    from loadtest.client import send
    from loadtest.target import Target
    from loadtest.workloads import RequestSpec

    target = Target(cluster.base_url, tiny_llama.name, ignore_eos=True)
    body = {**target.body(RequestSpec("Once upon a time", 40, 5)), "max_tokens": 40}
    so_far = []
    async with aiohttp.ClientSession() as session:
        async with session.post(target.url, json=body) as resp:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        so_far.append(chunk["usage"]["completion_tokens"])
        result = await send(session, target, RequestSpec("Once upon a time", 40, 5), 0.0)
    assert so_far == sorted(so_far) and so_far[-1] == 40 and len(so_far) <= 40
    assert result.ok and result.output_len == 40 and result.itl_per_token
    assert len(result.itl_s) == 39  # a gap for every token after the first
    async with aiohttp.ClientSession() as session:
        bad = {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": 1}}
        async with session.post(target.url, json=bad) as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
            assert err["param"] == "stream_options.continuous_usage_stats"
