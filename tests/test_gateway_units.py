"""Gateway pure parts: OpenAI body parsing, the per-request stream state, response shapes."""

import dataclasses
import logging
import time
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from services.gateway.app import QuietHealthAccessLogger
from services.gateway.completions import CompletionService
from services.gateway.config import GatewayConfig
from services.gateway.generation import Generation
from services.gateway.openai_request import (
    CHAT,
    build_sampling,
    parse_chat,
    parse_completion,
    priority_of,
    session_of,
)
from services.gateway.openai_response import ChoiceResult, ResponseFormat
from services.gateway.request_state import RequestStream
from shared.errors import InvalidRequestError, PromptTooLongError
from shared.protocol import BATCH, INTERACTIVE, TokenItem, TokenLogprob, Usage
from shared.sampling.params import SamplingParams
from shared.tokenizer.tokenizer import Tokenizer
from shared.tool_calls import StreamDelta


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return Tokenizer.from_dir(tiny_llama)


def test_parse_chat_maps_fields_to_sampling():
    parsed = parse_chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 3,
            "seed": 7,
            "stop": "x",
            "logprobs": True,
            "top_logprobs": 2,
            "ignore_eos": True,
            "min_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert parsed.kind == CHAT and parsed.messages[0]["content"] == "hi"
    assert parsed.stream and parsed.include_usage
    sampling = build_sampling(parsed, num_prompt_tokens=10, max_model_len=100)
    assert sampling == SamplingParams(
        max_tokens=5,
        min_tokens=2,
        temperature=0.0,
        top_p=0.5,
        top_k=3,
        seed=7,
        stop=("x",),
        ignore_eos=True,
        logprobs=2,
    )


def test_default_max_tokens_and_context_limits():
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert build_sampling(chat, 10, 100).max_tokens == 90  # the rest of the context
    text = parse_completion({"model": "m", "prompt": [1, 2]})
    assert build_sampling(text, 10, 100).max_tokens == 16
    with pytest.raises(PromptTooLongError, match="context length of 99"):
        build_sampling(text, 100, 100)
    too_many = parse_completion({"model": "m", "prompt": "x", "max_tokens": 95})
    with pytest.raises(InvalidRequestError) as e:
        build_sampling(too_many, 10, 100)
    assert e.value.field == "max_tokens"


@pytest.mark.parametrize(
    "body, field",
    [
        ([], "body"),
        ({"prompt": "x"}, "model"),
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": [-1]}, "prompt"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": -0.1}, "temperature"),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
        ({"model": "m", "prompt": "x", "n": 0}, "n"),
        ({"model": "m", "prompt": "x", "n": 3, "best_of": 2}, "best_of"),
        ({"model": "m", "prompt": "x", "echo": "yes"}, "echo"),
        ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
        (
            {"model": "m", "prompt": "x", "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
        ),
    ],
)
def test_parse_completion_rejects(body, field):
    with pytest.raises(InvalidRequestError) as e:
        parse_completion(body)
    assert e.value.field == field


def test_sampling_validation_errors_name_the_field():
    parsed = parse_completion({"model": "m", "prompt": "x", "top_p": 1.5})
    with pytest.raises(InvalidRequestError) as e:
        build_sampling(parsed, 1, 100)
    assert e.value.field == "top_p"


def stream_of(tokenizer, **sampling):
    return RequestStream(tokenizer, tokenizer.encode("hello"), SamplingParams(**sampling))


def test_stream_applies_items_in_order_and_finishes(tokenizer):
    ids = tokenizer.encode(" world of tiny models", add_special_tokens=False)[:4]
    stream = stream_of(tokenizer, max_tokens=4)
    first = stream.accept(TokenItem("r", 0, (ids[0],)))
    assert first.tokens == 1 and first.finish_reason is None
    rest = stream.accept(TokenItem("r", 1, tuple(ids[1:3])))
    last = stream.accept(TokenItem("r", 3, (ids[3],), finish_reason="length", usage=Usage(2, 4)))
    prompt = tokenizer.encode("hello")
    text = first.text + rest.text + last.text
    assert text == tokenizer.decode(prompt + ids)[len("hello") :]
    assert last.finish_reason == "length" and stream.usage == Usage(2, 4)
    assert stream.accept(TokenItem("r", 4, (ids[0],))) is None  # after the end: ignored


def test_an_item_out_of_order_fails_the_request(tokenizer, caplog):
    """One publisher sends a request's items in order: a gap or a repeat is a protocol error,
    which fails the request rather than show its tokens out of order."""
    ids = tokenizer.encode(" world of tiny models", add_special_tokens=False)[:3]
    for index in (2, 0):  # a gap, a repeat
        stream = stream_of(tokenizer, max_tokens=4)
        stream.accept(TokenItem("r", 0, (ids[0],)))
        with caplog.at_level(logging.ERROR):
            delta = stream.accept(TokenItem("r", index, (ids[index],)))
        assert (delta.finish_reason, stream.done) == ("error", True)
        assert f"output index {index}" in delta.error and "expected 1" in delta.error
        assert stream.accept(TokenItem("r", 1, (ids[1],))) is None
    assert "output index 0 arrived, 1 expected" in caplog.text


def test_stream_stop_string_truncates(tokenizer):
    ids = tokenizer.encode(" the quick brown fox", add_special_tokens=False)
    stream = stream_of(tokenizer, max_tokens=50, stop=["brown"])
    texts = [stream.accept(TokenItem("r", i, (t,))) for i, t in enumerate(ids)]
    text = "".join(d.text for d in texts if d)
    assert text == " the quick " and stream.finish_reason == "stop" and stream.stopped_by_string
    assert stream.usage.completion_tokens < len(ids)


def test_stream_error_ends_at_once(tokenizer):
    stream = stream_of(tokenizer, max_tokens=5)
    delta = stream.accept(TokenItem("r", 3, (), finish_reason="error", error="boom"))
    assert (delta.finish_reason, delta.error, stream.done) == ("error", "boom", True)


def test_response_shapes(tokenizer):
    lp = [TokenLogprob(70, -0.5, (70, 71), (-0.5, -1.5))]
    chat = ResponseFormat.for_request("chat", "chatcmpl-1", "m", tokenizer)
    full = chat.full([ChoiceResult("hi", "stop", lp)], Usage(3, 1))
    assert full["object"] == "chat.completion" and full["usage"]["total_tokens"] == 4
    entry = full["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == tokenizer.decode([70]) and len(entry["top_logprobs"]) == 2
    first = chat.chunk(0, StreamDelta("a"), None, None, first=True, usage_field=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert first["usage"] is None and chat.usage_chunk(Usage(1, 1))["choices"] == []
    text = ResponseFormat.for_request("completion", "cmpl-1", "m", tokenizer)
    lps = text.full([ChoiceResult("hi", "length", lp)], Usage(3, 1))["choices"][0]["logprobs"]
    assert lps["token_logprobs"] == [-0.5] and len(lps["top_logprobs"][0]) == 2


def test_the_access_log_leaves_out_health_polls(caplog):
    access = QuietHealthAccessLogger(logging.getLogger("aiohttp.access"), '"%r" %s')
    with caplog.at_level(logging.INFO, logger="aiohttp.access"):
        for path in ("/health", "/v1/models", "/health?verbose=1"):
            access.log(make_mocked_request("GET", path), web.Response(status=200), 0.001)
    assert [r.getMessage() for r in caplog.records] == ['"GET /v1/models HTTP/1.1" 200']


def test_session_affinity_header_then_body_session_id_then_user():
    body = {"model": "m", "prompt": "hi"}
    plain = parse_completion(body)
    assert session_of({}, plain) == ""
    by_user = parse_chat({"model": "m", "messages": [{"role": "user"}], "user": "alice"})
    assert session_of({}, by_user) == "alice"
    both = parse_completion({**body, "user": "alice", "session_id": "chat-9"})
    assert session_of({}, both) == "chat-9"
    assert session_of({"x-session-affinity": " s-1 "}, both) == "s-1"
    with pytest.raises(InvalidRequestError):
        parse_completion({**body, "user": 7})


def test_the_priority_header_picks_the_lane_and_the_queue_timeout(tokenizer, tiny_llama):
    assert priority_of({}) == INTERACTIVE
    assert priority_of({"x-tison-priority": " Batch "}) == BATCH
    assert priority_of({"x-tison-priority": "INTERACTIVE"}) == INTERACTIVE
    with pytest.raises(InvalidRequestError) as e:
        priority_of({"x-tison-priority": "urgent"})
    assert e.value.field == "x-tison-priority"
    config = GatewayConfig(tiny_llama, queue_timeout_s=5.0, batch_queue_timeout_s=50.0)
    control = SimpleNamespace(gateway_id="gw")
    service = CompletionService(config, tokenizer, control, metrics=None)
    interactive, batch = service.timing({}), service.timing({"x-tison-priority": "batch"})
    assert (interactive.queue_timeout_s, interactive.priority) == (5.0, INTERACTIVE)
    assert (batch.queue_timeout_s, batch.priority) == (50.0, BATCH)
    short = dataclasses.replace(config, request_timeout_s=20.0)
    capped = CompletionService(short, tokenizer, control, metrics=None)
    assert capped.timing({"x-tison-priority": "batch"}).queue_timeout_s == 20.0
    sampling = SamplingParams(max_tokens=2)
    gen = Generation(control, None, tokenizer, "r", [1, 2], sampling, "", batch)
    submit = gen._submit  # what the scheduler gets
    assert submit.priority == BATCH and 40 < submit.deadline - time.time() <= 50


async def test_short_texts_tokenize_on_the_event_loop_and_long_ones_in_a_thread(
    tokenizer, tiny_llama, monkeypatch
):
    """The thread-pool hop is skipped only where tokenizing costs less than it (INLINE_CHARS);
    both ways give the same ids."""
    from services.gateway import completions

    service = CompletionService(GatewayConfig(tiny_llama), tokenizer, None, metrics=None)
    threaded = []
    to_thread = completions.asyncio.to_thread

    async def counted(fn, *args):
        threaded.append(args[0])
        return await to_thread(fn, *args)

    monkeypatch.setattr(completions.asyncio, "to_thread", counted)
    short = parse_completion({"model": "m", "prompt": "def fibonacci(n):"})
    long = parse_completion({"model": "m", "prompt": "x = 1\n" * 100})  # 600 characters
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_tools = dataclasses.replace(chat, tools=tuple(tools))
    for parsed in (short, long, chat, with_tools):
        assert await service.tokenize_soon(parsed) == service.tokenize(parsed)
    assert threaded == [long, with_tools]
    assert completions.INLINE_CHARS < 600
