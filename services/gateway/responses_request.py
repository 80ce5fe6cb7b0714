"""`POST /v1/responses` bodies → the chat request the gateway runs. Pure.

The subset of OpenAI's Responses API that vLLM serves: `input` as a string or a list of
message, `function_call` and `function_call_output` items; `instructions`; function `tools`
and `tool_choice`; `text.format` (json_schema / json_object); `max_output_tokens`,
`temperature`, `top_p`, `stream`, `parallel_tool_calls`; `previous_response_id`, whose
conversation the gateway kept (ResponseStore, bounded).
"""

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from services.gateway.openai_request import ParsedRequest, parse_chat
from shared.errors import InvalidRequestError

MAX_STORED = 1024  # responses kept for previous_response_id, oldest dropped first
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# Responses fields passed through to the chat parser under their chat names.
_SAME = ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "seed", "user")


@dataclass(frozen=True)
class ResponsesRequest:
    chat: ParsedRequest  # what runs
    history: tuple[dict, ...]  # the chat messages of the conversation so far (for the store)
    store: bool  # keep this response for a later previous_response_id
    previous_response_id: str | None
    echo: dict  # request fields the response object repeats (instructions, tools, ...)


class ResponseStore:
    """Conversations of recent responses (chat messages, output included), by response id.
    Bounded: the oldest are dropped past `capacity`."""

    def __init__(self, capacity: int = MAX_STORED):
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, ...]] = OrderedDict()

    def put(self, response_id: str, messages: tuple[dict, ...]) -> None:
        self._items[response_id] = messages
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, ...] | None:
        return self._items.get(response_id)

    def __len__(self) -> int:
        return len(self._items)


def parse_responses(body: Any, store: ResponseStore) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    previous = body.get("previous_response_id")
    history: tuple[dict, ...] = ()
    if previous is not None:
        if not isinstance(previous, str):
            raise InvalidRequestError("previous_response_id", "must be a string")
        history = store.get(previous)
        if history is None:
            raise InvalidRequestError(
                "previous_response_id",
                f"no stored response {previous!r} (kept: the last {store.capacity})",
            )
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequestError("instructions", "must be a string")
    messages = list(history) + input_messages(body.get("input"))
    # instructions apply to this response only: they are not carried over to the next one
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat = {k: body[k] for k in _SAME if k in body}
    chat["messages"] = system + messages
    if (tokens := body.get("max_output_tokens")) is not None:
        chat["max_tokens"] = tokens
    if (tools := body.get("tools")) is not None:
        chat["tools"] = _chat_tools(tools)
    if (choice := body.get("tool_choice")) is not None:
        chat["tool_choice"] = _chat_tool_choice(choice)
    if (fmt := _text_format(body.get("text"))) is not None:
        chat["response_format"] = fmt
    store_it = body.get("store", True)
    if not isinstance(store_it, bool):
        raise InvalidRequestError("store", "must be a boolean")
    echo = {
        k: body.get(k) for k in ("instructions", "tools", "tool_choice", "temperature", "top_p")
    }
    return ResponsesRequest(parse_chat(chat), tuple(messages), store_it, previous, echo)


def input_messages(items: Any) -> list[dict]:
    """`input` as chat messages: function calls join the assistant turn they follow, their
    outputs become `tool` messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidRequestError("input", "must be a string or a non-empty list of items")
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = _ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise InvalidRequestError(f"{where}.role", f"must be one of {sorted(_ROLES)}")
            messages.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or "tool_call_id" in last:
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise InvalidRequestError(where, "needs a string call_id and output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise InvalidRequestError(f"{where}.type", f"{kind!r} items are not supported")
    return messages


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                raise InvalidRequestError(f"{where}.content", "only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}.content", "a text part needs its text")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(f"{where}.content", "must be a string or a list of text parts")


def _function_call(item: dict, where: str) -> dict:
    name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
    if not all(isinstance(v, str) for v in (name, arguments, call_id)):
        raise InvalidRequestError(where, "a function_call needs string call_id, name, arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _chat_tools(tools: Any) -> list:
    """Responses' flat function tools ({type, name, parameters}) as chat tools."""
    if not isinstance(tools, list):
        raise InvalidRequestError("tools", "must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequestError(f"tools[{i}].type", 'only "function" tools are supported')
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
        }
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _text_format(text: Any) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidRequestError("text", "must be an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError("text.format", "must be an object")
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return fmt


def output_messages(text: str | None, calls) -> list[dict]:
    """A response's output as the chat message a later turn's history holds."""
    message: dict = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return [message]


__all__ = ["ResponseStore", "ResponsesRequest", "json", "output_messages", "parse_responses"]
