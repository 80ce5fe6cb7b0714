"""Tool-call parsers: each family's outputs (one call, two, content and a call, none, malformed,
cut short) parsed whole, and streamed at every split point and in random chunks, which must
give what parsing the whole text gives."""

import json
import random
import re

import pytest

from shared.errors import InvalidRequestError
from shared.tool_calls import PARSERS, ParsedOutput, StreamDelta, ToolParser, parser_for

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
PARIS = {"city": "Paris"}
# Braces, brackets, quotes and escapes inside strings, and non-ASCII: the arguments' end is
# found by counting brackets outside strings.
TRICKY = {"timezone": "Europe/Paris", "note": 'a "}{" b\\', "list": [1, {"x": "]"}], "é": "東京"}
TRICKY_JSON = json.dumps(TRICKY, ensure_ascii=False)
WEATHER = ("get_weather", PARIS)
TIME = ("get_time", TRICKY)


def case(text, content, calls=(), streams_as_parsed=True):
    """An output, what parse gives (content, [(name, arguments object)]), and whether a stream
    of it gives the same (not when a call fails after its name was sent)."""
    return text, content, list(calls), streams_as_parsed


DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def ds_call(name, args, v31=False):
    if v31:
        return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"
    fenced = f"{name}\n```json\n{args}\n```"
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{fenced}<｜tool▁call▁end｜>"


def kimi_call(call_id, args):
    return f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


K_BEGIN, K_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
W_ARGS = '{"city": "Paris"}'
H_WEATHER = f'<tool_call>\n{{"name": "get_weather", "arguments": {W_ARGS}}}\n</tool_call>'

CASES = {
    "llama3_json": {
        "one": case('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [WEATHER]),
        "two": case(
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            f'{{"name": "get_time", "arguments": {TRICKY_JSON}}}',
            None,
            [WEATHER, TIME],
        ),
        "call_then_content": case(
            '{"name": "get_weather", "parameters": {"city": "Paris"}}\nChecking.',
            "Checking.",
            [WEATHER],
        ),
        "content_first": case(
            'Sure: {"name": "get_weather", "parameters": {}}',
            'Sure: {"name": "get_weather", "parameters": {}}',
        ),
        "no_call": case("It is sunny in Paris.", "It is sunny in Paris."),
        "keys_reversed": case(
            '{"parameters": {"city": "Paris"}, "name": "get_weather"}', None, [WEATHER]
        ),
        "json_not_a_call": case('{"city": "Paris"}', '{"city": "Paris"}'),
        "malformed": case(
            '{"name": "get_weather", "parameters": {"city": Paris}}',
            '{"name": "get_weather", "parameters": {"city": Paris}}',
            streams_as_parsed=False,
        ),
        "truncated": case(
            '{"name": "get_weather", "parameters": {"city": "Par',
            '{"name": "get_weather", "parameters": {"city": "Par',
            streams_as_parsed=False,
        ),
    },
    "hermes": {
        "one": case(
            f'<tool_call>\n{{"name": "get_weather", "arguments": {W_ARGS}}}\n</tool_call>',
            None,
            [WEATHER],
        ),
        "two": case(
            f'<tool_call>\n{{"name": "get_weather", "arguments": {W_ARGS}}}\n</tool_call>\n'
            f'<tool_call>\n{{"name": "get_time", "arguments": {TRICKY_JSON}}}\n</tool_call>',
            None,
            [WEATHER, TIME],
        ),
        "content_and_call": case(
            "Let me look.\n\n" + H_WEATHER,
            "Let me look.",
            [WEATHER],
        ),
        "no_call": case("It is sunny in <b>Paris</b>.", "It is sunny in <b>Paris</b>."),
        "not_json": case(
            '<tool_call>\nget_weather(city="Paris")\n</tool_call> ok',
            '<tool_call>\nget_weather(city="Paris")\n</tool_call> ok',
        ),
        "unclosed_at_end": case(
            f'<tool_call>\n{{"name": "get_weather", "arguments": {W_ARGS}}}\n</tool_',
            None,
            [WEATHER],
        ),
        "malformed": case(
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
            streams_as_parsed=False,
        ),
        "truncated": case(
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
            streams_as_parsed=False,
        ),
    },
    "mistral": {
        "one": case(
            f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {W_ARGS}}}]', None, [WEATHER]
        ),
        "two": case(
            f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {W_ARGS}, "id": "abcDEF123"}}, '
            f'{{"name": "get_time", "arguments": {TRICKY_JSON}}}]',
            None,
            [WEATHER, TIME],
        ),
        "two_v11": case(
            f"[TOOL_CALLS]get_weather[ARGS]{W_ARGS}[TOOL_CALLS]get_time[ARGS]{TRICKY_JSON}",
            None,
            [WEATHER, TIME],
        ),
        "content_and_call_v11": case(
            f"Let me check. [TOOL_CALLS]get_weather[ARGS]{W_ARGS}", "Let me check.", [WEATHER]
        ),
        "no_call": case("It is [sunny] in Paris.", "It is [sunny] in Paris."),
        "not_a_call": case("[TOOL_CALLS] I cannot.", "[TOOL_CALLS] I cannot."),
        "call_id_too_long": case(
            f"[TOOL_CALLS]get_weather[CALL_ID]{'a' * 70}[ARGS]{W_ARGS}",
            f"[TOOL_CALLS]get_weather[CALL_ID]{'a' * 70}[ARGS]{W_ARGS}",
        ),
        "malformed": case(
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": Paris}}]',
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": Paris}}]',
            streams_as_parsed=False,
        ),
        "truncated_v11": case(
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa',
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa',
            streams_as_parsed=False,
        ),
    },
    "deepseek_v3": {
        "one": case(DS_BEGIN + ds_call("get_weather", W_ARGS) + DS_END, None, [WEATHER]),
        "two": case(
            DS_BEGIN
            + ds_call("get_weather", W_ARGS)
            + "\n"
            + ds_call("get_time", TRICKY_JSON)
            + DS_END,
            None,
            [WEATHER, TIME],
        ),
        "two_v31": case(
            DS_BEGIN
            + ds_call("get_weather", W_ARGS, True)
            + ds_call("get_time", TRICKY_JSON, True)
            + DS_END,
            None,
            [WEATHER, TIME],
        ),
        "content_and_call": case(
            "Checking.\n" + DS_BEGIN + ds_call("get_weather", W_ARGS) + DS_END,
            "Checking.",
            [WEATHER],
        ),
        "no_call": case("It is sunny in Paris.", "It is sunny in Paris."),
        "cut_in_closing_fence": case(
            DS_BEGIN + ds_call("get_weather", W_ARGS)[: -len("`<｜tool▁call▁end｜>")],
            None,
            [WEATHER],
        ),
        "end_before_sep": case(  # the head is read up to the call's end, whatever comes later
            DS_BEGIN + "<｜tool▁call▁begin｜>get_weather<｜tool▁call▁end｜> Then<｜tool▁sep｜>{}",
            "<｜tool▁call▁begin｜>get_weather<｜tool▁call▁end｜>Then<｜tool▁sep｜>{}",
        ),
        "no_name": case(DS_BEGIN + ds_call("", W_ARGS) + DS_END, ds_call("", W_ARGS)),
        "malformed": case(
            DS_BEGIN + ds_call("get_weather", '{"city": Paris}') + DS_END,
            ds_call("get_weather", '{"city": Paris}'),
            streams_as_parsed=False,
        ),
        "truncated": case(
            DS_BEGIN + ds_call("get_weather", W_ARGS)[:-30],
            ds_call("get_weather", W_ARGS)[:-30],
            streams_as_parsed=False,
        ),
    },
    "kimi_k2": {
        "one": case(
            K_BEGIN + kimi_call("functions.get_weather:0", W_ARGS) + K_END, None, [WEATHER]
        ),
        "two": case(
            K_BEGIN
            + kimi_call("functions.get_weather:0", W_ARGS)
            + kimi_call("functions.get_time:1", TRICKY_JSON)
            + K_END,
            None,
            [WEATHER, TIME],
        ),
        "content_and_call": case(
            "Checking." + K_BEGIN + kimi_call("functions.get_weather:0", W_ARGS) + K_END,
            "Checking.",
            [WEATHER],
        ),
        "no_call": case("It is sunny in Paris <|im", "It is sunny in Paris <|im"),
        "no_arguments": case(
            K_BEGIN + "<|tool_call_begin|>functions.get_weather:0<|tool_call_end|>" + K_END,
            "<|tool_call_begin|>functions.get_weather:0<|tool_call_end|>",
        ),
        "end_before_arguments": case(
            K_BEGIN + "<|tool_call_begin|>functions.get_weather:0<|tool_call_end|> Then"
            "<|tool_call_argument_begin|>{}",
            "<|tool_call_begin|>functions.get_weather:0<|tool_call_end|>Then"
            "<|tool_call_argument_begin|>{}",
        ),
        "malformed": case(
            K_BEGIN + kimi_call("functions.get_weather:0", "{city: Paris}") + K_END,
            kimi_call("functions.get_weather:0", "{city: Paris}"),
            streams_as_parsed=False,
        ),
        "truncated": case(
            K_BEGIN + kimi_call("functions.get_weather:0", W_ARGS)[:-20],
            kimi_call("functions.get_weather:0", W_ARGS)[:-20],
            streams_as_parsed=False,
        ),
    },
}
ALL = [(family, name) for family, cases in CASES.items() for name in cases]
STREAMED = [(f, n) for f, n in ALL if CASES[f][n][3]]


def summary(parsed: ParsedOutput):
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def stream(parser: ToolParser, chunks):
    """Feed the chunks and finish; the content and the calls (id, name, arguments) sent."""
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    calls: dict[int, list] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.index not in calls:
                assert piece.id and piece.name  # a call's first delta carries both
                assert piece.index == len(calls)
                calls[piece.index] = [piece.id, piece.name, ""]
            else:
                assert piece.id is None and piece.name is None
            calls[piece.index][2] += piece.arguments
    return "".join(d.content for d in deltas) or None, list(calls.values())


def streamed_summary(family, chunks):
    content, calls = stream(PARSERS[family](TOOLS), chunks)
    return content, [(name, json.loads(args)) for _, name, args in calls]


@pytest.mark.parametrize("family, name", ALL)
def test_parse(family, name):
    text, content, calls, _ = CASES[family][name]
    parsed = PARSERS[family](TOOLS).parse(text)
    assert summary(parsed) == (content, calls)


@pytest.mark.parametrize("family, name", STREAMED)
def test_stream_split_anywhere_equals_parse(family, name):
    text = CASES[family][name][0]
    parser = PARSERS[family](TOOLS)
    parsed = parser.parse(text)
    expected = summary(parsed)
    for cut in range(len(text) + 1):
        assert streamed_summary(family, [text[:cut], text[cut:]]) == expected, cut
    assert streamed_summary(family, list(text)) == expected
    rng = random.Random(0)
    for _ in range(10):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(8, len(text) + 1)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert streamed_summary(family, chunks) == expected, cuts
    # The arguments streamed are the very text parse returns, not only equal JSON.
    _, calls = stream(PARSERS[family](TOOLS), list(text))
    assert [args for _, _, args in calls] == [c.arguments for c in parsed.tool_calls]


@pytest.mark.parametrize("family, name", [(f, n) for f, n in ALL if not CASES[f][n][3]])
def test_stream_keeps_a_call_that_fails_after_its_name(family, name):
    """A stream cannot take back a call it has named: the call stays, with the arguments sent
    so far, and its text is not sent again as content."""
    text = CASES[family][name][0]
    content, calls = stream(PARSERS[family](TOOLS), list(text))
    assert [call[1] for call in calls] == ["get_weather"]
    assert calls[0][2] in text and calls[0][2].startswith("{")
    assert content is None


MARKER_STARTS = {
    "llama3_json": ("<|python", "_snake"),
    "hermes": ("<tool_c", "ar>"),
    "mistral": ("[TOOL_CA", "LLS"),
    "deepseek_v3": ("<｜tool▁ca", "lls"),
    "kimi_k2": ("<|tool_calls_sec", "tion"),
}


@pytest.mark.parametrize("family", CASES)
def test_stream_holds_back_only_what_may_be_a_marker(family):
    parser = PARSERS[family](TOOLS)
    start, rest = MARKER_STARTS[family]
    if family == "llama3_json":  # calls come first: any text before decides it is content
        assert parser.feed(start).content == ""
        assert parser.feed(rest + " and more").content == start + rest + " and more"
        return
    assert parser.feed("Sure, ").content == "Sure,"  # the trailing space waits for more
    assert parser.feed(start).content == ""
    assert parser.feed(rest + " are fun").content == " " + start + rest + " are fun"
    assert parser.finish() == StreamDelta()


CALL_STARTS = {  # up to the first characters of the arguments, and the name and fragment sent
    "llama3_json": ('{"name": "get_weather", "parameters": {"ci', '{"ci'),
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"ci', '{"ci'),
    "mistral": ('[TOOL_CALLS]get_weather[ARGS]{"ci', '{"ci'),
    "deepseek_v3": (
        DS_BEGIN + '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"ci',
        '{"ci',
    ),
    "kimi_k2": (
        K_BEGIN + '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"ci',
        '{"ci',
    ),
}


@pytest.mark.parametrize("family", CASES)
def test_stream_sends_the_name_then_arguments_as_they_come(family):
    parser = PARSERS[family](TOOLS)
    text, fragment = CALL_STARTS[family]
    delta = parser.feed(text)
    assert delta.content == ""
    [call] = delta.tool_calls
    assert (call.index, call.name, call.arguments) == (0, "get_weather", fragment)
    delta = parser.feed('ty": "Par')
    assert [(c.index, c.id, c.arguments) for c in delta.tool_calls] == [(0, None, 'ty": "Par')]


@pytest.mark.parametrize(
    "family, pattern",
    [
        ("llama3_json", r"call_[0-9a-f]{24}"),
        ("hermes", r"call_[0-9a-f]{24}"),
        ("mistral", r"[A-Za-z0-9]{9}"),
        ("deepseek_v3", r"call_[0-9a-f]{24}"),
    ],
)
def test_call_ids(family, pattern):
    parsed = PARSERS[family](TOOLS).parse(CASES[family]["two"][0])
    ids = [c.id for c in parsed.tool_calls]
    assert all(re.fullmatch(pattern, i) for i in ids) and len(set(ids)) == 2


def test_model_ids_are_kept():
    kimi = PARSERS["kimi_k2"](TOOLS).parse(CASES["kimi_k2"]["two"][0])
    assert [c.id for c in kimi.tool_calls] == ["functions.get_weather:0", "functions.get_time:1"]
    text = f"[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{W_ARGS}"
    [call] = PARSERS["mistral"](TOOLS).parse(text).tool_calls
    assert (call.id, call.name, call.arguments) == ("a1b2c3d4e", "get_weather", W_ARGS)
    assert stream(PARSERS["mistral"](TOOLS), list(text)) == (
        None,
        [["a1b2c3d4e", "get_weather", W_ARGS]],
    )


def test_unknown_function_names_are_returned():
    parser = PARSERS["hermes"](TOOLS)
    parsed = parser.parse('<tool_call>{"name": "launch", "arguments": {}}</tool_call>')
    assert [c.name for c in parsed.tool_calls] == ["launch"]
    assert "launch" not in parser.tool_names == {"get_weather", "get_time"}


def test_registry_and_bad_input():
    assert set(PARSERS) == {"llama3_json", "hermes", "mistral", "deepseek_v3", "kimi_k2"}
    assert all(parser_for(name).name == name for name in PARSERS)
    with pytest.raises(InvalidRequestError, match="unknown parser 'pythonic'") as info:
        parser_for("pythonic")
    assert info.value.field == "tool_call_parser"
    for tools in ("get_weather", [1]):
        with pytest.raises(InvalidRequestError) as info:
            PARSERS["hermes"](tools)
        assert info.value.field == "tools"


SOUP = [  # every family's markers and the pieces of its calls, and things that break them
    *("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>"),
    *(DS_BEGIN, DS_END, "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"),
    *(K_BEGIN, K_END, "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    *('{"name": "f", "arguments": ', '{"name": "g", "parameters": ', W_ARGS, "functions.f:0"),
    *("function", "get_weather", "```json\n", "```", "{", "}", "[", "]", '"', "\\", ";", ","),
    *("\n", " ", "x", "é", "<", "<|", "<｜"),
]


@pytest.mark.parametrize("family", CASES)
def test_any_output_parses_and_streams_without_raising(family):
    """Random soups of markers and call pieces (one fixed seed): parse never raises and gives
    valid JSON arguments; a stream in random chunks gives the same, except for the calls it
    sent before they failed."""
    well_formed = [CASES[family][name][0] for name in ("one", "two")]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(SOUP + well_formed * 4) for _ in range(rng.randint(0, 10)))
        parsed = PARSERS[family](TOOLS).parse(text)
        calls = [(c.name, c.arguments) for c in parsed.tool_calls]
        assert all(isinstance(json.loads(args), dict) for _, args in calls)
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(6, len(text) + 1)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        content, sent = stream(PARSERS[family](TOOLS), chunks)
        sent = [(name, args) for _, name, args in sent]
        if sent == calls:
            assert content == parsed.content, text
        else:  # the stream has calls that failed after it sent them; parse's are among them
            rest = iter(sent)
            assert len(sent) > len(calls) and all(c in rest for c in calls), text
