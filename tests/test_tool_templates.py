"""Each family's chat template (tests/fixtures/chat_templates) renders OpenAI tools, tool calls and
tool results in its format, its parser reads the rendered calls back, and detect_parser knows
the family from the template or the tokens; and ChatTemplate gives templates a call's
arguments both as the client's JSON text and as the object it encodes."""

import json
from pathlib import Path

import pytest

from shared.tokenizer import Tokenizer
from shared.tokenizer.chat import ChatTemplate
from shared.tool_calls import PARSERS, detect_parser

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
DEFAULT_MODEL = Path(__file__).parents[1] / "shared" / "default_model" / "tison-tiny-stdlib"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a time zone",
            "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}},
        },
    },
]
CALLS = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"timezone": "Europe/Paris"}')]


class Family:
    def __init__(self, parser, markers, end_of_turn, ids=("call_1", "call_2"), tokens=()):
        self.parser = parser
        self.markers = markers  # what the rendered conversation must contain
        self.end_of_turn = end_of_turn  # ends the assistant's turn; not part of model output
        self.ids = ids  # tool call ids as the family's templates want them
        self.tokens = tokens or markers[:1]  # special tokens that alone name the family


FAMILIES = {
    "llama3_1": Family(
        "llama3_json",
        ["<|start_header_id|>ipython<|end_header_id|>"],
        "<|eot_id|>",
        tokens=["<|python_tag|>", "<|eot_id|>"],
    ),
    "qwen2_5": Family(
        "hermes", ["<tool_call>", "</tool_call>", "<tools>", "<tool_response>"], "<|im_end|>\n"
    ),
    "mistral": Family(
        "mistral",
        ["[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[TOOL_RESULTS]"],
        "</s>",
        ids=("abcDEF123", "ghiJKL456"),
    ),
    "deepseek_v3": Family(
        "deepseek_v3",
        [
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>",
        ],
        "<｜end▁of▁sentence｜>",
    ),
    "kimi_k2": Family(
        "kimi_k2",
        ["<|tool_calls_section_begin|>", "<|tool_call_argument_begin|>", "## Return of"],
        "<|im_end|>",
        ids=("functions.get_weather:0", "functions.get_time:1"),
    ),
}
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}


def conversation(ids):
    calls = [
        {"id": i, "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in zip(ids, CALLS)
    ]
    return [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": ids[0], "content": "18°C and sunny"},
        {"role": "tool", "tool_call_id": ids[1], "content": "14:05"},
    ]


def template(name) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text())


def render(name, messages, add_generation_prompt=True):
    return template(name).render(
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=TOOLS,
        special_tokens=SPECIAL_TOKENS,
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_template_renders_tools_calls_and_results(name):
    family = FAMILIES[name]
    messages = conversation(family.ids)
    before = json.dumps(messages)
    text = render(name, messages)
    assert json.dumps(messages) == before  # the caller's messages are left as they were
    for marker in family.markers:
        assert marker in text
    for tool in TOOLS:
        assert tool["function"]["description"] in text
    for call_name, args in CALLS:
        assert call_name in text and args in text  # the object, not a quoted JSON string
    assert '\\"' not in text
    assert "18°C and sunny" in text and "14:05" in text
    if name == "kimi_k2":
        assert all(f"## Return of {i}" in text for i in family.ids)
    if name == "mistral":
        assert all(f'"call_id": "{i}"' in text for i in family.ids)


@pytest.mark.parametrize("name", FAMILIES)
def test_rendered_calls_parse_back(name):
    """The assistant turn, as the template writes it, is what the model outputs: its parser
    must give back the calls (streamed, character by character, too)."""
    family = FAMILIES[name]
    messages = conversation(family.ids)
    prompt = render(name, messages[:1])
    with_calls = render(name, messages[:2], add_generation_prompt=False)
    assert with_calls.startswith(prompt)
    output = with_calls[len(prompt) :]
    assert output.endswith(family.end_of_turn)
    output = output[: -len(family.end_of_turn)]
    parser = PARSERS[family.parser]
    parsed = parser(TOOLS).parse(output)
    assert parsed.content is None
    got = [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]
    assert got == [(n, json.loads(a)) for n, a in CALLS]
    if name == "kimi_k2":
        assert [c.id for c in parsed.tool_calls] == list(family.ids)
    streamer = parser(TOOLS)
    deltas = [streamer.feed(ch) for ch in output] + [streamer.finish()]
    pieces = [p for d in deltas for p in d.tool_calls]
    assert [p.name for p in pieces if p.name] == [n for n, _ in CALLS]
    for index, call in enumerate(parsed.tool_calls):
        assert "".join(p.arguments for p in pieces if p.index == index) == call.arguments
    assert "".join(d.content for d in deltas) == ""


@pytest.mark.parametrize("name", FAMILIES)
def test_detect_parser(name):
    family = FAMILIES[name]
    assert detect_parser((TEMPLATES / f"{name}.jinja").read_text(), []) == family.parser
    assert detect_parser(None, family.tokens) == family.parser


def test_detect_parser_of_a_model_without_tool_calls():
    tokenizer = Tokenizer.from_dir(DEFAULT_MODEL)
    tokens = [t.content for t in tokenizer.backend.get_added_tokens_decoder().values()]
    assert tokens  # the bundled model has special tokens, none of them a tool marker
    source = tokenizer.chat_templates["default"].source
    assert detect_parser(source, tokens) is None
    assert detect_parser(None, []) is None
    # Qwen3-Coder's calls sit in <tool_call> too, but as XML: not what hermes reads.
    assert detect_parser("<tool_call>\n<function=name>", ["<tool_call>"]) is None


ARGUMENT_VIEWS = (
    "{% for m in messages %}{% for c in m.tool_calls %}{% set a = c.function.arguments %}"
    "{{ a | tojson }}|{{ c.function | tojson }}|{{ a is string }}|{{ 'text:' + a }}|"
    "{% for k, v in a.items() %}{{ k }}={{ v }};{% endfor %}|"
    "{% for k, v in a | items %}{{ k }}={{ v }};{% endfor %}|"
    "{{ a.city }}|{{ a['city'] }}|{{ a[0] }}"
    "{% endfor %}{% endfor %}"
)


def test_arguments_are_text_and_object():
    """OpenAI sends `arguments` as JSON text; templates that serialize it or walk its items
    get the object, those that print it get the client's text unchanged."""
    args = '{"city":"Paris",  "days": [1, 2]}'
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}
    text = ChatTemplate(ARGUMENT_VIEWS).render([{"role": "assistant", "tool_calls": [call]}])
    assert text.split("|") == [
        '{"city": "Paris", "days": [1, 2]}',
        '{"name": "f", "arguments": {"city": "Paris", "days": [1, 2]}}',
        "True",
        "text:" + args,
        "city=Paris;days=[1, 2];",
        "city=Paris;days=[1, 2];",
        "Paris",
        "Paris",
        "{",
    ]
    assert call["function"]["arguments"] == args and type(call["function"]["arguments"]) is str


@pytest.mark.parametrize("args", ["not json", "[1, 2]", {"city": "Paris"}])
def test_other_arguments_reach_the_template_as_they_are(args):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}
    source = "{{ messages[0].tool_calls[0].function.arguments | tojson }}"
    text = ChatTemplate(source).render([{"role": "assistant", "tool_calls": [call]}])
    assert text == json.dumps(args)
