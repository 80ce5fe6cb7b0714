"""Chat templates rendered as Hugging Face renders them: a sandboxed jinja2 environment with
trim_blocks + lstrip_blocks, `raise_exception`, `strftime_now`, HF's `tojson`, the
`{% generation %}` tag and loop controls; variables `messages`, `add_generation_prompt`,
`tools`, `documents`, the named special tokens (`bos_token`, `eos_token`, ...) and any kwargs."""

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.filters import do_items
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.errors import InvalidRequestError

# Names a message's reasoning may come under; templates read `reasoning_content` (gpt-oss:
# `thinking`), so every name is filled from the first one present, as HF does.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in HF;
    rendering only needs its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class _JsonArguments(str):
    """A tool call's `arguments` as OpenAI clients send them, JSON text, which templates also
    read as the object it encodes. Some templates serialize it (Llama 3's and Qwen 2.5's
    `arguments | tojson`, Mistral's `function | tojson`) or walk its items, and need the object
    (they would write a quoted JSON string); others print it (`is string` in Kimi K2's and
    Qwen 3's, `+` in DeepSeek V3's), which keeps the client's text. vLLM parses it into a dict
    for every template, which breaks the `+` ones."""

    value: dict

    def __new__(cls, text: str, value: dict) -> "_JsonArguments":
        self = super().__new__(cls, text)
        self.value = value
        return self

    def items(self):
        return self.value.items()

    def keys(self):
        return self.value.keys()

    def __getitem__(self, key):
        return self.value[key] if isinstance(key, str) else super().__getitem__(key)


def _plain(x: Any) -> Any:
    """`x` with every _JsonArguments replaced by its object."""
    if isinstance(x, _JsonArguments):
        return x.value
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # HF's filter: unlike jinja's own it does not HTML-escape, and it takes json.dumps options.
    x = _plain(x)  # tool calls' arguments as the objects they encode
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _items(x: Any) -> Any:
    return do_items(x.value if isinstance(x, _JsonArguments) else x)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters["items"] = _items
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_environment()


def _iterates_content(ast: nodes.Template) -> bool:
    """Whether the template loops over a message's content, i.e. expects OpenAI content parts
    (`{% for part in message['content'] %}`) rather than a string."""
    for loop in ast.find_all(nodes.For):
        target = loop.iter
        if isinstance(target, nodes.Getitem) and isinstance(target.arg, nodes.Const):
            if target.arg.value == "content":
                return True
        if isinstance(target, nodes.Getattr) and target.attr == "content":
            return True
        if isinstance(target, nodes.Name) and "content" in target.name:
            return True
    return False


class ChatTemplate:
    """A compiled chat template. Raises jinja2.TemplateSyntaxError on a malformed source."""

    def __init__(self, source: str):
        self.source = source
        self._template = _ENV.from_string(source)
        # Templates that loop over content take OpenAI parts as they are; the others get the
        # text parts joined into a string (as vLLM does for "string" templates).
        self.accepts_content_parts = _iterates_content(_ENV.parse(source))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation. Bad messages or a template failure raise
        InvalidRequestError("messages", ...)."""
        context = {
            **(special_tokens or {}),
            **kwargs,
            "messages": self._normalize(messages),
            "tools": tools,
            "documents": kwargs.get("documents"),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except Exception as e:  # the template is arbitrary code from the model folder
            raise InvalidRequestError("messages", f"chat template failed: {e}") from e

    def _normalize(self, messages: Sequence[Mapping[str, Any]]) -> list[dict]:
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise InvalidRequestError("messages", "must be a list of messages")
        if not messages:
            raise InvalidRequestError("messages", "must not be empty")
        return [self._normalize_message(i, m) for i, m in enumerate(messages)]

    def _normalize_message(self, index: int, message: Mapping[str, Any]) -> dict:
        if not isinstance(message, Mapping):
            raise InvalidRequestError("messages", f"message {index} is not an object")
        # Drop None values: OpenAI clients send content=None / tool_calls=None, which many
        # templates would render as "None" while they handle a missing key. The content of a
        # turn that calls tools stays None, as HF passes it: templates such as DeepSeek-V3's
        # test `content is none` to render the calls alone.
        out = {k: v for k, v in message.items() if v is not None}
        if message.get("content", "") is None and message.get("tool_calls"):
            out["content"] = None
        reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
        if reasoning is not None:
            out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
        content = out.get("content")
        if isinstance(content, list) and not self.accepts_content_parts:
            out["content"] = _join_text_parts(index, content)
        if isinstance(out.get("tool_calls"), list):
            out["tool_calls"] = [_with_json_arguments(call) for call in out["tool_calls"]]
        return out


def _with_json_arguments(call: Any) -> Any:
    """A copy of an OpenAI tool call whose `function.arguments`, JSON text of an object, is
    also that object to the template (_JsonArguments); anything else is left as it is."""
    function = call.get("function") if isinstance(call, Mapping) else None
    text = function.get("arguments") if isinstance(function, Mapping) else None
    if not isinstance(text, str):
        return call
    try:
        value = json.loads(text)
    except ValueError:
        return call
    if not isinstance(value, dict):
        return call
    return {**call, "function": {**function, "arguments": _JsonArguments(text, value)}}


def _join_text_parts(index: int, parts: list) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidRequestError(
                "messages", f"message {index}: content part {kind!r} is not supported"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError("messages", f"message {index}: text part without text")
        texts.append(text)
    return "\n".join(texts)
