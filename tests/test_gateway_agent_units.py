"""Gateway pure parts of the agent API: tools and tool_choice, structured output fields,
n / best_of / echo / logit_bias, the Responses API's request conversion and stream events."""

import json

import pytest

from services.gateway.choice_output import ChoiceOutput
from services.gateway.openai_request import build_sampling, parse_chat, parse_completion
from services.gateway.openai_response import ChoiceResult, ResponseFormat
from services.gateway.responses_format import ResponseEvents, ResponseObject
from services.gateway.responses_request import ResponseStore, parse_responses
from services.gateway.tool_choice import NAMED, REQUIRED, ForcedCalls, ToolChoice
from shared.errors import InvalidRequestError
from shared.protocol import TokenLogprob, Usage
from shared.sampling.structured import CHOICE, GRAMMAR, JSON, REGEX
from shared.tokenizer.tokenizer import Tokenizer
from shared.tool_calls import StreamDelta, ToolCall, ToolCallDelta

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return parse_chat({"model": "m", "messages": USER, **fields})


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return Tokenizer.from_dir(tiny_llama)


def test_tool_choice_defaults_and_checks():
    assert chat().tool_choice.mode == "none"
    assert chat(tools=[WEATHER]).tool_choice.mode == "auto"
    assert chat(tools=[WEATHER], tool_choice="none").structured is None
    named = chat(
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert named.tool_choice == ToolChoice(NAMED, "get_time")
    assert named.structured.kind == JSON and json.loads(named.structured.value) == {
        "type": "object"
    }
    bad = [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": "all"}, "tools"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
    ]
    for fields, where in bad:
        with pytest.raises(InvalidRequestError) as e:
            chat(**fields)
        assert e.value.field == where, fields


def test_required_tool_choice_schema_admits_only_the_tools():
    parsed = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(parsed.structured.value)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]


def test_forced_calls_read_back_the_json():
    required = ForcedCalls(ToolChoice(REQUIRED))
    text = json.dumps(
        [
            {"name": "get_weather", "parameters": {"city": "Oslo"}},
            {"name": "get_time", "parameters": {}},
        ]
    )
    calls = required.parse(text).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert required.parse(text[:20]).tool_calls == ()  # cut short: no call
    named = ForcedCalls(ToolChoice(NAMED, "get_weather"))
    parts = [named.feed(p) for p in ('{"city"', ': "Oslo"}')]
    assert parts[0].tool_calls[0].name == "get_weather" and parts[1].tool_calls[0].name is None
    assert "".join(p.tool_calls[0].arguments for p in parts) == '{"city": "Oslo"}'
    streamed = ForcedCalls(ToolChoice(REQUIRED))
    assert streamed.feed(text) == StreamDelta()
    assert [d.name for d in streamed.finish().tool_calls] == ["get_weather", "get_time"]


def test_finish_reason_is_tool_calls_unless_named():
    auto = ChoiceOutput(ForcedCalls(ToolChoice(REQUIRED)))
    auto.parse('[{"name": "get_time", "parameters": {}}]')
    assert auto.finish_reason("stop") == "tool_calls" and auto.finish_reason("length") == "length"
    named = ChoiceOutput(ForcedCalls(ToolChoice(NAMED, "get_time")), calls_end_with_stop=True)
    named.parse("{}")
    assert named.finish_reason("stop") == "stop"
    assert ChoiceOutput().finish_reason("stop") == "stop"


def test_structured_fields():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert json.loads(chat(response_format=fmt).structured.value) == schema
    assert chat(response_format={"type": "json_object"}).structured.value == ""
    assert chat(response_format={"type": "text"}).structured is None
    assert chat(guided_regex="[ab]+").structured.kind == REGEX
    assert chat(guided_choice=["yes", "no"]).structured.kind == CHOICE
    assert chat(guided_json=json.dumps(schema)).structured.kind == JSON
    assert chat(guided_grammar='start: "a" | "b"').structured.kind == GRAMMAR
    bad = [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_grammar": "start: ???"}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ]
    for fields, where in bad:
        with pytest.raises(InvalidRequestError) as e:
            chat(**fields)
        assert e.value.field == where, fields


def test_n_best_of_echo_logit_bias():
    body = {"model": "m", "prompt": "hi"}
    assert parse_completion({**body, "n": 3}).best_of == 3
    parsed = parse_completion(
        {**body, "n": 2, "best_of": 4, "echo": True, "logit_bias": {"5": 100, "7": -2.5}}
    )
    assert (parsed.n, parsed.best_of, parsed.echo) == (2, 4, True)
    sampling = build_sampling(parsed, 3, 100)
    assert sampling.logit_bias == ((5, 100.0), (7, -2.5))
    assert sampling.logprobs == 0  # best_of ranks by logprobs
    echoed = build_sampling(parse_completion({**body, "echo": True, "logprobs": 2}), 3, 100)
    assert echoed.prompt_logprobs == 2  # the echoed prompt comes with its logprobs
    for fields, where in [
        ({"n": 0}, "n"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 1000}}, "logit_bias"),
        ({"echo": "yes"}, "echo"),
        ({"prompt_logprobs": 99}, "prompt_logprobs"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            build_sampling(parse_completion({**body, **fields}), 3, 100)
        assert e.value.field == where, fields


def test_tool_call_shapes(tokenizer):
    fmt = ResponseFormat.for_request("chat", "chatcmpl-1", "m", tokenizer)
    call = ToolCall("call_1", "get_time", "{}")
    full = fmt.full([ChoiceResult(None, "tool_calls", tool_calls=(call,))], Usage(3, 2))
    message = full["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            }
        ],
    }
    first = fmt.chunk(
        1,
        StreamDelta(tool_calls=(ToolCallDelta(0, "call_1", "get_time", "{"),)),
        None,
        None,
        True,
        False,
    )
    delta = first["choices"][0]["delta"]
    assert first["choices"][0]["index"] == 1
    assert delta["role"] == "assistant" and delta["content"] is None
    assert delta["tool_calls"] == [
        {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_time", "arguments": "{"},
        }
    ]
    later = fmt.chunk(
        1, StreamDelta(tool_calls=(ToolCallDelta(0, arguments="}"),)), None, None, False, False
    )
    assert later["choices"][0]["delta"] == {
        "tool_calls": [{"index": 0, "function": {"arguments": "}"}}]
    }


def test_echo_logprobs_lead_with_a_null(tokenizer):
    fmt = ResponseFormat.for_request("completion", "cmpl-1", "m", tokenizer)
    entries = (TokenLogprob(71, -1.0, (71,), (-1.0,)), TokenLogprob(72, -0.5, (72,), (-0.5,)))
    out = fmt.logprobs(entries, echoed_token=70)
    assert out["token_logprobs"] == [None, -1.0, -0.5] and out["top_logprobs"][0] is None
    assert out["tokens"][0] == tokenizer.decode([70], skip_special_tokens=False)


def test_responses_input_becomes_chat_history():
    store = ResponseStore(capacity=2)
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 9,
    }
    req = parse_responses(body, store)
    messages = req.chat.messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert req.chat.tool_choice.mode == NAMED and req.chat.max_tokens == 9
    assert [m["role"] for m in req.history] == ["user", "assistant", "tool"]  # no instructions
    store.put("resp_1", req.history)
    follow = parse_responses(
        {"model": "m", "input": "and tomorrow?", "previous_response_id": "resp_1"}, store
    )
    assert [m["role"] for m in follow.chat.messages] == ["user", "assistant", "tool", "user"]
    store.put("resp_2", ())
    store.put("resp_3", ())
    assert store.get("resp_1") is None and len(store) == 2  # bounded
    for fields, where in [
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": [], "content": ""}]}, "input[0].role"),  # the fuzz found it
        ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            parse_responses({"model": "m", **fields}, store)
        assert e.value.field == where, fields


def test_response_events_in_openai_order():
    events = ResponseEvents(ResponseObject("m", {}, None, None))
    out = events.start()
    out += events.feed(StreamDelta(content="Let me check."))
    out += events.feed(StreamDelta(tool_calls=(ToolCallDelta(0, "call_1", "get_time", '{"tz"'),)))
    out += events.feed(StreamDelta(tool_calls=(ToolCallDelta(0, arguments=': "UTC"}'),)))
    out += events.finish("stop", Usage(5, 7))
    kinds = [e["type"] for e in out]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    final = out[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert (
        final["output"][1]["arguments"] == '{"tz": "UTC"}' and final["usage"]["total_tokens"] == 12
    )
    assert events.calls() == (ToolCall("call_1", "get_time", '{"tz": "UTC"}'),)
    cut = ResponseEvents(ResponseObject("m", {}, None, 4))
    cut.feed(StreamDelta(content="abc"))
    assert cut.finish("length", Usage(1, 4))[-1]["type"] == "response.incomplete"
