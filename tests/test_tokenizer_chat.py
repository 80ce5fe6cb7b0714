"""Chat rendering with Hugging Face semantics: HF's jinja environment (tojson, trim/lstrip,
loop controls, namespace, the generation tag, strftime_now), message normalization, OpenAI
content parts, and template failures as InvalidRequestError."""

from datetime import datetime

import pytest
import transformers
from test_tokenizer_folders import copy_tokenizer_files, update_json

from shared.errors import InvalidRequestError
from shared.tokenizer import Tokenizer

HELLO = [{"role": "user", "content": "Hi there"}]

# Each template exercises one piece of HF's environment; rendered by transformers and by Tison.
HF_TEMPLATES = {
    "tojson": "{{ tools | tojson }}|{{ messages[0] | tojson(indent=2) }}",
    "trim_lstrip": (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n[U] {{ m.content }}\n"
        "    {% else %}\n[A] {{ m.content }}\n    {% endif %}\n{% endfor %}"
    ),
    "loopcontrols_namespace": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}"
        "{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{{ m.content }};{% endfor %}{{ ns.n }}"
    ),
    "generation_tag": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    ),
    "kwargs_and_tokens": "{{ bos_token }}{{ enable_thinking }}{{ unk_token }}{{ eos_token }}",
    "none_and_reasoning": (
        "{% for m in messages %}{{ m.tool_calls is defined }}/{{ m.reasoning_content }}"
        "/{{ m.thinking }};{% endfor %}{{ documents is none }}"
    ),
    "content_parts": (
        "{% for m in messages %}{% for p in m['content'] %}{{ p['type'] }}={{ p['text'] }},"
        "{% endfor %}{% endfor %}"
    ),
}
HF_MESSAGES = [
    {"role": "user", "content": "Grüße, 東京 🙂 <tag>", "tool_calls": None},
    {"role": "assistant", "content": "ok", "reasoning": "thought"},
    {"role": "user", "content": "bye"},
]
PART_MESSAGES = [
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
]


@pytest.mark.parametrize("name", sorted(HF_TEMPLATES))
def test_templates_render_as_transformers_does(tiny_llama, tmp_path, name):
    folder = copy_tokenizer_files(tiny_llama, tmp_path)
    update_json(folder / "tokenizer_config.json", chat_template=HF_TEMPLATES[name])
    tok = Tokenizer.from_dir(folder)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    messages = PART_MESSAGES if name == "content_parts" else HF_MESSAGES
    tools = [{"type": "function", "function": {"name": "wetter", "description": "Öl"}}]
    kwargs = dict(tools=tools, enable_thinking=False)
    ours = tok.apply_chat_template(messages, **kwargs)
    assert ours == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert ours  # every template renders something


def test_text_parts_are_joined_for_string_templates(tiny_llama):
    tok = Tokenizer.from_dir(tiny_llama)
    text = tok.apply_chat_template(PART_MESSAGES)
    assert text == tok.apply_chat_template([{"role": "user", "content": "a\nb"}])
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(InvalidRequestError, match="image_url") as info:
        tok.apply_chat_template([{"role": "user", "content": image}])
    assert info.value.field == "messages"


@pytest.mark.parametrize(
    "template, match",
    [
        ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant"),
        ("{{ messages.append(1) }}", "chat template failed"),  # immutable sandbox
        ("{{ ''.__class__.__mro__ }}", "chat template failed"),  # sandboxed attribute
        ("{{ messages[0]['content'] + 1 }}", "chat template failed"),
    ],
)
def test_template_failures_are_invalid_requests(tiny_llama, tmp_path, template, match):
    folder = copy_tokenizer_files(tiny_llama, tmp_path)
    update_json(folder / "tokenizer_config.json", chat_template=template)
    tok = Tokenizer.from_dir(folder)
    with pytest.raises(InvalidRequestError, match=match) as info:
        tok.apply_chat_template(HELLO)
    assert info.value.field == "messages"


@pytest.mark.parametrize("messages", [[], "hello", [["role", "user"]]])
def test_malformed_messages_are_invalid_requests(tiny_llama, messages):
    with pytest.raises(InvalidRequestError) as info:
        Tokenizer.from_dir(tiny_llama).apply_chat_template(messages)
    assert info.value.field == "messages"


def test_strftime_now(tiny_llama, tmp_path):
    folder = copy_tokenizer_files(tiny_llama, tmp_path)
    update_json(folder / "tokenizer_config.json", chat_template="{{ strftime_now('%Y-%m') }}")
    before = datetime.now().strftime("%Y-%m")
    text = Tokenizer.from_dir(folder).apply_chat_template(HELLO)
    assert text in {before, datetime.now().strftime("%Y-%m")}


def test_a_turn_of_tool_calls_keeps_its_null_content(tiny_llama, tmp_path):
    """DeepSeek-V3's template renders the calls alone when `content is none` (as HF passes
    it); other null fields are dropped, so templates that test for a key still work."""
    template = (
        "{% for m in messages %}{% if m['content'] is none %}CALLS:"
        "{{ m['tool_calls'][0]['function']['name'] }}{% else %}{{ m['content'] }}{% endif %}"
        "{% if m['name'] is defined %}!{% endif %};{% endfor %}"
    )
    folder = copy_tokenizer_files(tiny_llama, tmp_path)
    update_json(folder / "tokenizer_config.json", chat_template=template)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    assert Tokenizer.from_dir(folder).apply_chat_template(messages) == "hi;CALLS:f;"
