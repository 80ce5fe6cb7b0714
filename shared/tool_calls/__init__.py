"""Tool calls read out of model output, one parser per model family (vLLM's names), for the
gateway to return OpenAI `tool_calls`, whole or streamed."""

from shared.tool_calls.base import ParsedOutput, StreamDelta, ToolCall, ToolCallDelta, ToolParser
from shared.tool_calls.registry import PARSERS, detect_parser, parser_for

__all__ = [
    "PARSERS",
    "ParsedOutput",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "detect_parser",
    "parser_for",
]
