"""`tools`, `tool_choice` and `parallel_tool_calls` of a chat request. Pure.

`auto` lets the model choose: its output is parsed with the model family's tool-call parser
(shared/tool_calls). `required` and a named function force a call by constrained decoding, as
vLLM does: the output is JSON that a schema built here admits (a list of {name, parameters}
for `required`, the function's arguments for a named one), read back by `ForcedCalls` into
tool calls whatever the model family. `none` renders the tools into the prompt and parses
nothing.
"""

import json
import uuid
from dataclasses import dataclass
from typing import Any

from shared.errors import InvalidRequestError
from shared.tool_calls import ParsedOutput, StreamDelta, ToolCall, ToolCallDelta

AUTO, NONE, REQUIRED, NAMED = "auto", "none", "required", "named"
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolChoice:
    mode: str = NONE  # AUTO, NONE, REQUIRED or NAMED
    name: str = ""  # NAMED: the function
    parallel: bool = True  # parallel_tool_calls: REQUIRED may return several calls

    @property
    def forced(self) -> bool:
        return self.mode in (REQUIRED, NAMED)


def function_of(tool: dict) -> dict:
    """The `function` part of a chat tool ({"type": "function", "function": {...}})."""
    return tool["function"]


def parse_tools(body: dict) -> tuple[tuple[dict, ...] | None, ToolChoice]:
    """The request's tools (validated) and what it asks of them."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequestError("tools", "must be a list")
        for i, tool in enumerate(tools):
            _check_tool(tool, f"tools[{i}]")
        tools = tuple(tools) or None
    parallel = body.get("parallel_tool_calls", True)
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls", "must be a boolean")
    parallel = parallel is not False
    choice = body.get("tool_choice")
    if choice is None:
        return tools, ToolChoice(AUTO if tools else NONE, parallel=parallel)
    if choice in (AUTO, NONE, REQUIRED):
        if tools is None and choice != NONE:
            raise InvalidRequestError("tool_choice", f"{choice!r} needs `tools`")
        return tools, ToolChoice(choice, parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (
            choice.get("function", {}).get("name")
            if isinstance(choice.get("function"), dict)
            else None
        )
        if not isinstance(name, str):
            raise InvalidRequestError("tool_choice.function.name", "must be a string")
        if name not in {function_of(t)["name"] for t in tools or ()}:
            raise InvalidRequestError("tool_choice.function.name", f"no tool is named {name!r}")
        return tools, ToolChoice(NAMED, name, parallel)
    raise InvalidRequestError(
        "tool_choice",
        'must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
    )


def _check_tool(tool: Any, where: str) -> None:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequestError(where, 'must be {"type": "function", "function": {...}}')
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"{where}.function.name", "is required and must be a string")
    if not function["name"]:
        raise InvalidRequestError(f"{where}.function.name", "must not be empty")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequestError(f"{where}.function.parameters", "must be a JSON schema object")


def forced_schema(tools: tuple[dict, ...], choice: ToolChoice) -> dict:
    """The JSON schema the output must follow to be the call(s) the choice forces."""
    functions = {function_of(t)["name"]: function_of(t) for t in tools}
    if choice.mode == NAMED:
        return functions[choice.name].get("parameters") or _ANY_OBJECT
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [name]},
                "parameters": f.get("parameters") or _ANY_OBJECT,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, f in functions.items()
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not choice.parallel:
        schema["maxItems"] = 1
    return schema


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ForcedCalls:
    """Reads the JSON output of a forced choice back as tool calls, with the interface of a
    shared.tool_calls parser. A named function's arguments stream as they come; the calls of
    `required` leave when the list is complete (its JSON is only known then)."""

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self._text = ""
        self._id = call_id()
        self._sent_first = False

    def parse(self, text: str) -> ParsedOutput:
        if self.choice.mode == NAMED:
            return ParsedOutput(None, (ToolCall(self._id, self.choice.name, text.strip()),))
        try:
            calls = json.loads(text)
        except ValueError:
            return ParsedOutput(text, ())  # cut short (max_tokens): no call to read
        return ParsedOutput(
            None,
            tuple(
                ToolCall(call_id(), c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                for c in calls
            ),
        )

    def feed(self, delta: str) -> StreamDelta:
        self._text += delta
        if self.choice.mode != NAMED or not delta:
            return StreamDelta()
        first = not self._sent_first
        self._sent_first = True
        call = ToolCallDelta(
            0, self._id if first else None, self.choice.name if first else None, delta
        )
        return StreamDelta(tool_calls=(call,))

    def finish(self) -> StreamDelta:
        if self.choice.mode == NAMED:
            return StreamDelta()
        parsed = self.parse(self._text)
        return StreamDelta(
            content=parsed.content or "",
            tool_calls=tuple(
                ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(parsed.tool_calls)
            ),
        )
