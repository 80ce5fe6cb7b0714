"""The agent API end to end over real NATS, a prefill and a decode worker running the tiny
model, and the gateway, driven by the official `openai` client: n > 1 with per-choice seeds,
best_of, echo, logit_bias, structured outputs (JSON schema, 100 samples at temperature 1),
tool calls (parsed from the model's output in its family's format, and forced), the
Responses API, /tokenize and /detokenize.

The model folder is the tiny model with a Qwen 2.5 style (Hermes `<tool_call>`) chat
template: the gateway picks the hermes parser from it. A guided_regex makes the random model
write a known tool call, so the parser runs on real output."""

import json
import re
import shutil
from pathlib import Path

import aiohttp
import jsonschema
import pytest

from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.sampling.params import SamplingParams
from shared.tokenizer.tokenizer import Tokenizer

from services_harness import cluster_for, metric, wait_metric, wait_pages_free

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
    "additionalProperties": False,
}
PAGE = EngineConfig.page_size  # the workers' default
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def agent_model(tiny_model_factory, tmp_path_factory):
    """The tiny model with a Hermes-format (Qwen 2.5 style) chat template, and a context that
    holds its rendering of two tools."""
    out = tmp_path_factory.mktemp("agent") / "tiny-agent"
    shutil.copytree(tiny_model_factory("llama", max_position_embeddings=2048), out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (TEMPLATES / "qwen2_5.jinja").read_text()
    config_path.write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, agent_model):
    s = cluster_for(tmp_path_factory, agent_model, "auto")
    yield s
    s.stop_all()


@pytest.fixture(scope="module")
def llm(agent_model):
    return LLM(agent_model, dtype="float32")


def literal(text: str) -> str:
    """A regex matching exactly `text`."""
    return "".join(re.escape(c) if not c.isalnum() else c for c in text)


async def test_n_choices_each_honour_their_seed(client, cluster, llm, agent_model):
    prompt = "The quick brown fox"
    kw = dict(temperature=1.0, max_tokens=12, seed=77)
    out = await client.completions.create(model=agent_model.name, prompt=prompt, n=4, **kw)
    refs = [llm.generate(prompt, SamplingParams(**{**kw, "seed": 77 + i}))[0] for i in range(4)]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [r.text for r in refs]
    assert len({c.text for c in out.choices}) > 1
    assert out.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    # streamed: chunks of both choices interleave; each reassembles to the same text
    texts = {0: "", 1: ""}
    stream = await client.completions.create(
        model=agent_model.name, prompt=prompt, n=2, stream=True, **kw
    )
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [r.text for r in refs[:2]]
    await wait_pages_free(cluster)


async def test_the_other_choices_reuse_the_first_ones_prompt_pages(client, cluster, agent_model):
    """n = 4 computes the prompt once: choices 1..3 are submitted after choice 0's first token,
    and the prefix caches hold its pages by then."""
    prompt = "import sys\n" + " ".join(f"word{i}" for i in range(60))  # several pages
    count = len(llm_tokens(agent_model, prompt))
    before = await metric(cluster, "tison_prefix_cache_hit_tokens")
    await client.completions.create(
        model=agent_model.name, prompt=prompt, n=4, max_tokens=2, temperature=1.0
    )
    cached = 3 * PAGE * ((count - 1) // PAGE)  # whole pages, the last token computed anew
    await wait_metric(
        cluster,
        "tison_prefix_cache_hit_tokens",
        lambda hits: hits >= before + cached,
        f"{cached} prompt tokens of choices 1-3 found in the caches",
    )


def llm_tokens(model_dir, text: str) -> list[int]:
    return Tokenizer.from_dir(model_dir).encode(text)


async def test_best_of_returns_the_candidate_of_best_mean_logprob(client, llm, agent_model):
    prompt = "import os"
    kw = dict(temperature=1.0, max_tokens=8, seed=5)
    out = await client.completions.create(model=agent_model.name, prompt=prompt, best_of=3, **kw)
    refs = [
        llm.generate(prompt, SamplingParams(**{**kw, "seed": 5 + i}, logprobs=0))[0]
        for i in range(3)
    ]
    best = max(refs, key=lambda r: sum(e.logprob for e in r.logprobs) / len(r.logprobs))
    assert [c.text for c in out.choices] == [best.text]
    assert out.choices[0].logprobs is None  # not asked: used for ranking only


async def test_echo_leads_with_the_prompt(client, llm, agent_model):
    prompt = "def fibonacci(n):"
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6))[0]
    out = await client.completions.create(
        model=agent_model.name, prompt=prompt, echo=True, max_tokens=6, temperature=0
    )
    assert out.choices[0].text == prompt + ref.text
    with_lp = await client.completions.create(
        model=agent_model.name, prompt=prompt, echo=True, max_tokens=6, temperature=0, logprobs=1
    )
    lp = with_lp.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(ref.prompt_token_ids) + len(ref.token_ids)
    assert all(v <= 0 for v in lp.token_logprobs[1:])


async def test_prompt_logprobs_equal_offline(client, llm, agent_model):
    prompt = "The quick brown fox"
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0]
    out = await client.completions.create(
        model=agent_model.name,
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 2},
    )
    got = out.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ref.prompt_token_ids)
    for entry, want, token in zip(got[1:], ref.prompt_logprobs, ref.prompt_token_ids[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(want.logprob, abs=1e-4)


async def test_logit_bias_forces_and_bans(client, llm, agent_model):
    prompt = "The quick brown fox"
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4))[0]
    banned = greedy.token_ids[0]
    out = await client.completions.create(
        model=agent_model.name,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        logit_bias={str(banned): -100},
    )
    ref = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=4, logit_bias=((banned, -100.0),))
    )[0]
    assert out.choices[0].text == ref.text and ref.token_ids[0] != banned
    forced = llm.tokenizer.encode(" fox", add_special_tokens=False)[-1]
    out = await client.completions.create(
        model=agent_model.name,
        prompt=prompt,
        max_tokens=5,
        temperature=1.0,
        logit_bias={str(forced): 100},
    )
    assert out.choices[0].text == llm.tokenizer.decode([forced] * 5)


@pytest.mark.parametrize("stream", [False, True])
async def test_json_schema_always_validates(client, agent_model, stream):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    texts: list[str] = []
    kw = dict(
        model=agent_model.name,
        messages=[{"role": "user", "content": "a person"}],
        response_format=fmt,
        temperature=1.0,
        max_tokens=110,
        n=50,
    )
    finishes = []
    for seed in (1, 2):
        if not stream:
            out = await client.chat.completions.create(seed=seed, **kw)
            texts += [c.message.content for c in out.choices]
            finishes += [c.finish_reason for c in out.choices]
            continue
        parts: dict[int, str] = {}
        async for chunk in await client.chat.completions.create(seed=seed, stream=True, **kw):
            for c in chunk.choices:
                parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
                if c.finish_reason:
                    finishes.append(c.finish_reason)
        texts += [parts[i] for i in sorted(parts)]
    assert len(texts) == 100 and finishes == ["stop"] * 100
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 10  # sampled, not one answer


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls_parsed_from_the_models_output(client, agent_model, stream):
    """tool_choice auto: the output (made a known Hermes call by a regex) comes back as
    tool_calls, with the text before it as content."""
    text = "Checking." + CALL
    kw = dict(
        model=agent_model.name,
        messages=ASK,
        tools=TOOLS,
        temperature=0,
        max_tokens=120,
        extra_body={"guided_regex": literal(text)},
    )
    if not stream:
        out = await client.chat.completions.create(**kw)
        choice = out.choices[0]
        calls = [
            (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
        ]
        content, finish = choice.message.content, choice.finish_reason
        ids = [c.id for c in choice.message.tool_calls]
    else:
        content, finish, args, names, ids = "", None, {}, {}, []
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for d in delta.tool_calls or ():
                if d.id:
                    ids.append(d.id)
                if d.function.name:
                    names[d.index] = d.function.name
                args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
            finish = chunk.choices[0].finish_reason or finish
        calls = [(names[i], json.loads(args[i])) for i in sorted(names)]
    assert calls == [("get_weather", {"city": "Paris", "days": 3})]
    assert content == "Checking." and finish == "tool_calls"
    assert len(ids) == 1 and ids[0].startswith("call_")


@pytest.mark.parametrize("stream", [False, True])
async def test_required_and_named_tool_choice_force_valid_calls(client, agent_model, stream):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        kw = dict(
            model=agent_model.name, messages=ASK, tools=TOOLS, tool_choice=choice,
            temperature=1.0, seed=3, max_tokens=120, parallel_tool_calls=False,
        )  # fmt: skip
        if not stream:
            out = await client.chat.completions.create(**kw)
            calls = [
                (c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls
            ]
        else:
            names, args = {}, {}
            async for chunk in await client.chat.completions.create(stream=True, **kw):
                for d in chunk.choices[0].delta.tool_calls or ():
                    if d.function.name:
                        names[d.index] = d.function.name
                    args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
            calls = [(names[i], args[i]) for i in sorted(names)]
        assert len(calls) == 1
        name, arguments = calls[0]
        if isinstance(choice, dict):
            assert name == "get_time"
        jsonschema.validate(json.loads(arguments), schemas[name])


async def test_tool_history_renders_and_runs(client, agent_model):
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 1}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = await client.chat.completions.create(
        model=agent_model.name, messages=messages, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert out.choices[0].finish_reason in ("stop", "length")


async def test_responses_api_text_and_tool_call(client, agent_model):
    text = await client.responses.create(
        model=agent_model.name, input="Say something", max_output_tokens=6, temperature=0
    )
    assert text.object == "response" and text.status in ("completed", "incomplete")
    assert text.output_text and text.usage.output_tokens >= 1
    follow = await client.responses.create(
        model=agent_model.name, input="And more?", previous_response_id=text.id, max_output_tokens=4
    )
    assert follow.usage.input_tokens > text.usage.input_tokens  # the history came along
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    called = await client.responses.create(
        model=agent_model.name, input="weather?", tools=tools, tool_choice="required",
        max_output_tokens=120, temperature=0,
    )  # fmt: skip
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) >= 1 and calls[0].call_id.startswith("call_")
    assert calls[0].name in ("get_weather", "get_time") and json.loads(calls[0].arguments)
    kinds, deltas = [], ""
    async with client.responses.stream(
        model=agent_model.name, input="weather?", tools=tools,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=120,
    ) as events:  # fmt: skip
        async for event in events:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                deltas += event.delta
        final = await events.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    (call,) = [i for i in final.output if i.type == "function_call"]
    assert call.name == "get_weather" and call.arguments == deltas
    jsonschema.validate(json.loads(deltas), TOOLS[0]["function"]["parameters"])
    streamed_text = ""
    async for event in await client.responses.create(
        model=agent_model.name,
        input="Say something",
        max_output_tokens=6,
        temperature=0,
        stream=True,
    ):
        if event.type == "response.output_text.delta":
            streamed_text += event.delta
    assert streamed_text == text.output_text


async def test_tokenize_detokenize_and_bad_requests(cluster, agent_model, llm):
    async with aiohttp.ClientSession(cluster.base_url) as http:
        async with http.post("/tokenize", json={"prompt": "hello world"}) as r:
            body = await r.json()
        assert body["tokens"] == llm.tokenizer.encode("hello world") and body["count"] == len(
            body["tokens"]
        )
        async with http.post("/tokenize", json={"messages": ASK, "tools": TOOLS}) as r:
            chat = await r.json()
        assert chat["tokens"] == llm.tokenizer.encode_chat(ASK, tools=TOOLS)
        async with http.post("/detokenize", json={"tokens": body["tokens"]}) as r:
            assert (await r.json())["prompt"] == llm.tokenizer.decode(
                body["tokens"], skip_special_tokens=False
            )
        model = agent_model.name
        for body, param in [
            (
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"schema": {"type": 5}},
                    }
                },
                "response_format",
            ),
            (
                {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                "tool_choice.function.name",
            ),
            ({"guided_grammar": "start: ("}, "guided_grammar"),
            ({"guided_regex": "(a"}, "guided_regex"),
            ({"logit_bias": {"99999999": 5}}, "logit_bias"),
        ]:
            async with http.post(
                "/v1/chat/completions",
                json={"model": model, "messages": ASK, "max_tokens": 2, **body},
            ) as r:
                error = await r.json()
            assert r.status == 400 and error["error"]["param"] == param, (body, error)
        async with http.post("/detokenize", json={"tokens": [-1]}) as r:
            assert r.status == 400
        assert cluster.health() == 200
    await wait_pages_free(cluster)
