"""Hostile but valid input against the real gateway (NATS, scheduler, fake workers): every JSON
body gets a result or an OpenAI-shaped 4xx, never a 5xx (the cases a tester found, then a
property-based fuzz of both endpoints); bodies over the limit get a 413 unread; with an API
key, the /v1 routes need it (401 otherwise)."""

import asyncio
import json
import urllib.error
import urllib.request

import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats_sync import subscribed

from shared import protocol, subjects
from shared.protocol import SubmitMsg

from services_harness import Services
from waiting import until

MAX_TOKENS = 8  # what the fuzzed bodies ask at most when they ask sensibly


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama):
    with Services(tmp_path_factory.mktemp("hostile"), tiny_llama) as s:
        s.scheduler()
        s.fake_worker("prefill", "prefill")
        s.fake_worker("decode", "decode", "--step-time", "0.001")
        s.gateway("--max-body-bytes", str(1 << 20), "--request-timeout", "20")
        s.wait_healthy()
        yield s


def post(cluster, path: str, body: bytes, headers=None, timeout: float = 30.0):
    """(status, decoded JSON or the raw text) of a POST, with the standard library's client."""
    request = urllib.request.Request(
        cluster.base_url + path, data=body, method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def assert_openai_4xx(status: int, body, param: str | None = None) -> None:
    assert 400 <= status < 500, (status, body)
    assert isinstance(body, dict) and isinstance(body["error"]["message"], str), body
    if param is not None:
        assert body["error"]["param"] == param, body


@pytest.mark.parametrize(
    "raw,param",
    [
        ('{"model": "M", "prompt": "\\ud800 lone surrogate"}', "body"),
        ('{"model": "M", "prompt": "x", "seed": 18446744073709551616}', "seed"),
        ('{"model": "M", "prompt": "x", "top_k": 18446744073709551616}', "top_k"),
        ('{"model": "M", "prompt": "x", "stop_token_ids": [18446744073709551616]}',
         "stop_token_ids"),
        ('{"model": "M", "prompt": "x", "stop_token_ids": [-1]}', "stop_token_ids"),
        ('{"model": "M", "prompt": "x", "extra": ' + "[" * 10_000 + "]" * 10_000 + "}", "body"),
    ],
)  # fmt: skip
def test_what_used_to_be_a_500_is_a_400_naming_the_field(cluster, tiny_llama, raw, param):
    raw = raw.replace('"M"', json.dumps(tiny_llama.name))
    status, body = post(cluster, "/v1/completions", raw.encode())
    assert_openai_4xx(status, body, param)
    assert cluster.health() == 200


async def test_the_priority_header_reaches_the_scheduler_or_gets_a_400(cluster, tiny_llama):
    body = json.dumps({"model": tiny_llama.name, "prompt": "hi", "max_tokens": 2}).encode()
    bad = {"x-tison-priority": "urgent"}
    status, reply = await asyncio.to_thread(post, cluster, "/v1/completions", body, bad)
    assert_openai_4xx(status, reply, "x-tison-priority")
    nc = await nats.connect(cluster.nats.url)
    seen: list[SubmitMsg] = []

    async def keep(msg) -> None:
        seen.append(protocol.decode(msg.data, SubmitMsg))

    try:
        await nc.subscribe(subjects.scheduler_submit(), cb=keep)  # a copy: no queue group
        await subscribed(nc)
        batch = {"x-tison-priority": "Batch"}
        status, reply = await asyncio.to_thread(post, cluster, "/v1/completions", body, batch)
        assert status == 200, reply
        await until(lambda: seen, 10, "the gateway's submit")
    finally:
        await nc.close()
    assert protocol.BATCH in {s.priority for s in seen}


def test_a_body_over_the_limit_is_refused_unread(cluster, tiny_llama):
    big = json.dumps({"model": tiny_llama.name, "prompt": "x" * (50 << 20)}).encode()
    status, body = post(cluster, "/v1/completions", big)
    assert status == 413 and body["error"]["message"], body
    assert cluster.health() == 200


# --- property-based: any JSON the parser accepts --------------------------------------------

TEXT = st.text(st.characters(codec=None, categories=None), max_size=12)  # surrogates too
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
SMALL_INT = st.integers(-3, MAX_TOKENS)
SCHEMA = st.sampled_from(
    [{"type": "object"}, {"type": "integer", "maximum": 3}, {"type": "nope"}, {"enum": []}]
)
TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function") | JSON,
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g"]) | JSON}, optional={"parameters": SCHEMA | JSON}
        )
        | JSON,
    }
)
FIELDS = {  # each field: its sensible values, or anything
    "prompt": st.text(max_size=40) | st.lists(st.integers(-2, 400), max_size=6) | JSON,
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "assistant"]) | JSON,
                "content": st.text(max_size=40) | JSON,
            }
        ),  # fmt: skip
        max_size=3,
    )
    | JSON,
    "max_tokens": SMALL_INT | JSON,
    "max_completion_tokens": SMALL_INT | JSON,
    "temperature": st.floats(-1, 3) | JSON,
    "top_p": st.floats(-0.5, 1.5) | JSON,
    "top_k": SMALL_INT | JSON,
    "min_p": st.floats(-0.5, 1.5) | JSON,
    "seed": st.integers(-(2**70), 2**70) | JSON,
    "stop": TEXT | st.lists(TEXT, max_size=3) | JSON,
    "stop_token_ids": st.lists(st.integers(-(2**70), 2**70), max_size=3) | JSON,
    "logprobs": st.booleans() | SMALL_INT | JSON,
    "top_logprobs": SMALL_INT | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JSON})
    | JSON,
    "n": st.integers(0, 2) | JSON,
    "presence_penalty": st.floats(-3, 3) | JSON,
    "repetition_penalty": st.floats(-1, 3) | JSON,
    "ignore_eos": st.booleans() | JSON,
    "cache_salt": TEXT | JSON,
    "tools": st.lists(TOOL, max_size=2) | JSON,
    "tool_choice": st.sampled_from(["auto", "none", "required"])
    | st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]) | JSON}),
        }
    )
    | JSON,
    "parallel_tool_calls": st.booleans() | JSON,
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"]) | JSON},
        optional={"json_schema": st.fixed_dictionaries({}, optional={"schema": SCHEMA})},
    )
    | JSON,
    "guided_regex": st.sampled_from(["[ab]{1,4}", "(", "x*"]) | JSON,
    "guided_choice": st.lists(TEXT, max_size=3) | JSON,
    "guided_grammar": st.sampled_from(['start: "a" | "b"', "start: ("]) | JSON,
    "guided_json": SCHEMA | JSON,
    "best_of": st.integers(0, 3) | JSON,
    "echo": st.booleans() | JSON,
    "logit_bias": st.dictionaries(
        st.integers(-5, 10**6).map(str) | TEXT, st.floats(-200, 200) | JSON, max_size=3
    )
    | JSON,
    "prompt_logprobs": SMALL_INT | JSON,
    "user": TEXT | JSON,
}
RESPONSES_FIELDS = {  # /v1/responses
    "input": st.text(max_size=40)
    | st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "developer", "assistant"]) | JSON,
                "content": st.text(max_size=20) | JSON,
            }
        )
        | st.fixed_dictionaries(
            {
                "type": st.sampled_from(["function_call", "function_call_output", "reasoning"])
                | JSON
            },
            optional={
                "call_id": TEXT | JSON,
                "name": TEXT | JSON,
                "arguments": TEXT | JSON,
                "output": TEXT | JSON,
            },
        ),
        max_size=3,
    )
    | JSON,
    "instructions": TEXT | JSON,
    "tools": st.lists(
        st.fixed_dictionaries(
            {"type": st.just("function") | JSON, "name": st.sampled_from(["f", "g"]) | JSON},
            optional={"parameters": SCHEMA | JSON},
        ),
        max_size=2,
    )
    | JSON,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | JSON,
    "max_output_tokens": SMALL_INT | JSON,
    "text": st.fixed_dictionaries(
        {},
        optional={
            "format": st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "json_object", "json_schema"]) | JSON},
                optional={"schema": SCHEMA},
            )
        },
    )
    | JSON,
    "previous_response_id": TEXT | JSON,
    "store": st.booleans() | JSON,
    "stream": st.booleans() | JSON,
    "temperature": st.floats(-1, 3) | JSON,
}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_no_json_body_gets_a_5xx(cluster, tiny_llama, data):
    path = data.draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    body = data.draw(
        st.fixed_dictionaries(
            {"model": st.just(tiny_llama.name) | JSON},
            optional=dict(FIELDS, max_tokens=SMALL_INT),  # unbounded lengths: slow, not wrong
        )
        | JSON
    )
    status, reply = post(cluster, path, json.dumps(body).encode())
    assert status < 500, (body, status, reply)
    if status >= 400:
        assert_openai_4xx(status, reply)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_no_responses_or_tokenize_body_gets_a_5xx(cluster, tiny_llama, data):
    path = data.draw(st.sampled_from(["/v1/responses", "/tokenize", "/detokenize"]))
    fields = {
        "/v1/responses": RESPONSES_FIELDS,
        "/tokenize": {**FIELDS, "add_special_tokens": st.booleans() | JSON},
        "/detokenize": {"tokens": st.lists(st.integers(-2, 10**5), max_size=4) | JSON},
    }[path]
    body = data.draw(
        st.fixed_dictionaries(
            {"model": st.just(tiny_llama.name) | JSON},
            optional=dict(fields, max_output_tokens=SMALL_INT),
        )
        | JSON
    )
    status, reply = post(cluster, path, json.dumps(body).encode())
    assert status < 500, (body, status, reply)
    if status >= 400:
        assert_openai_4xx(status, reply)


# --- the API key -------------------------------------------------------------------------------


def test_an_api_key_guards_the_v1_routes(tmp_path, tiny_llama):
    with Services(tmp_path, tiny_llama) as s:
        s.scheduler()
        s.fake_worker("prefill", "prefill")
        s.fake_worker("decode", "decode")
        s.gateway("--api-key", "sesame")
        s.wait_healthy()  # /health needs no key
        body = json.dumps({"model": tiny_llama.name, "prompt": "hi", "max_tokens": 2}).encode()
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            status, reply = post(s, "/v1/completions", body, headers)
            assert status == 401 and reply["error"]["code"] == "invalid_api_key", reply
        status, reply = post(s, "/v1/completions", body, {"Authorization": "Bearer sesame"})
        assert status == 200 and reply["choices"][0]["text"], reply


# --- the OpenAPI document ----------------------------------------------------------------------


def test_the_openapi_document_covers_every_route_and_fuzzed_field(cluster, tiny_llama):
    from services.gateway.app import build_app
    from services.gateway.completions import CompletionService
    from services.gateway.config import GatewayConfig
    from services.gateway.control import ControlPlane
    from services.gateway.metrics import GatewayMetrics
    from shared.tokenizer.tokenizer import Tokenizer

    with urllib.request.urlopen(cluster.base_url + "/openapi.json", timeout=10) as resp:
        doc = json.loads(resp.read())
    assert doc["openapi"].startswith("3.1") and tiny_llama.name in doc["info"]["description"]
    metrics = GatewayMetrics()
    control = ControlPlane("gw-doc", "nats://127.0.0.1:1", metrics, 3, 1.0)  # never started
    service = CompletionService(
        GatewayConfig(model_dir=tiny_llama), Tokenizer.from_dir(tiny_llama), control, metrics
    )
    routes = {
        (r.method.lower(), r.resource.canonical)
        for r in build_app(service).router.routes()
        if r.method != "HEAD"
    }
    documented = {(m, path) for path, item in doc["paths"].items() for m in item}
    assert routes == documented

    def fields(path: str) -> set[str]:
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        return set(body["schema"]["properties"])

    assert set(FIELDS) <= fields("/v1/chat/completions") | fields("/v1/completions")
    assert set(RESPONSES_FIELDS) <= fields("/v1/responses")
