"""The parsers by vLLM's --tool-call-parser names, and which one a model speaks."""

import re
from collections.abc import Iterable

from shared.errors import InvalidRequestError
from shared.tool_calls import deepseek_v3, hermes, kimi_k2, mistral
from shared.tool_calls.base import ToolParser
from shared.tool_calls.deepseek_v3 import DeepSeekV3Parser
from shared.tool_calls.hermes import HermesParser
from shared.tool_calls.kimi_k2 import KimiK2Parser
from shared.tool_calls.llama3_json import PYTHON_TAG, Llama3JsonParser
from shared.tool_calls.mistral import MistralParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (Llama3JsonParser, HermesParser, MistralParser, DeepSeekV3Parser, KimiK2Parser)
}

# Each family's own markers, most specific first: Qwen 2.5's template also spells out JSON
# calls, which alone would look like Llama 3's.
_MARKERS = (
    (KimiK2Parser.name, kimi_k2.SECTION_BEGIN),
    (DeepSeekV3Parser.name, deepseek_v3.SECTION_BEGIN),
    (MistralParser.name, mistral.MARKER),
    (HermesParser.name, hermes.OPEN),
    (Llama3JsonParser.name, PYTHON_TAG),
)
# Llama 3's templates write the calls they render as `{"name": ..., "parameters": ...}`.
_LLAMA_CALL = re.compile(r'"name": .*"parameters"', re.S)
# Qwen3-Coder's calls sit in <tool_call> too, but are XML (<function=...>): not hermes.
_XML_CALL = "<function="


def parser_for(name: str) -> type[ToolParser]:
    """The parser class of that name; InvalidRequestError("tool_call_parser", ...) if none."""
    if name not in PARSERS:
        known = ", ".join(PARSERS)
        raise InvalidRequestError("tool_call_parser", f"unknown parser {name!r}; known: {known}")
    return PARSERS[name]


def detect_parser(chat_template: str | None, special_tokens: Iterable[str]) -> str | None:
    """The name of the parser for the format a model calls tools in, found from its chat
    template's source and its tokenizer's special and added tokens; None when it speaks none
    of them (its output is then not parsed for calls)."""
    template = chat_template or ""
    tokens = set(special_tokens)
    for name, marker in _MARKERS:
        if marker in tokens or marker in template:
            if name == HermesParser.name and _XML_CALL in template:
                return None
            return name
    return Llama3JsonParser.name if _LLAMA_CALL.search(template) else None
