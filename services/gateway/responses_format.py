"""Responses API objects and stream events, in OpenAI's shapes. Pure.

A response's output is a message item (its text) and/or function_call items. Streaming sends
the events OpenAI sends, each with its sequence_number: response.created / in_progress, then
per item output_item.added, its parts and deltas (output_text.delta,
function_call_arguments.delta) and their .done events, output_item.done, and at the end
response.completed (or response.incomplete when max_output_tokens cut it short).
"""

import time
import uuid
from dataclasses import dataclass, field

from shared import protocol
from shared.protocol import Usage
from shared.tool_calls import StreamDelta, ToolCall


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [_text_part(text)] if status == "completed" else []
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def function_item(item_id: str, call: ToolCall, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def usage_body(usage: Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


@dataclass
class ResponseObject:
    """The response's envelope: what every form of it repeats."""

    model: str
    echo: dict  # request fields repeated (instructions, tools, tool_choice, ...)
    previous_response_id: str | None
    max_output_tokens: int | None
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict], usage: Usage | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "output": output,
            "usage": None if usage is None else usage_body(usage),
            "error": None,
            "incomplete_details": incomplete,
            "previous_response_id": self.previous_response_id,
            "max_output_tokens": self.max_output_tokens,
            "instructions": self.echo.get("instructions"),
            "tools": self.echo.get("tools") or [],
            "tool_choice": self.echo.get("tool_choice") or "auto",
            "parallel_tool_calls": True,
            "temperature": self.echo.get("temperature"),
            "top_p": self.echo.get("top_p"),
            "text": {"format": {"type": "text"}},
            "metadata": {},
        }


def status_of(finish_reason: str) -> str:
    return "incomplete" if finish_reason == protocol.FINISH_LENGTH else "completed"


def output_items(text: str | None, calls: tuple[ToolCall, ...]) -> list[dict]:
    """A non-streamed response's output: the message (if any text) then the calls."""
    items = [message_item(new_id("msg"), text)] if text else []
    return items + [function_item(new_id("fc"), c) for c in calls]


class ResponseEvents:
    """Turns a response's StreamDeltas into Responses stream events, in order."""

    def __init__(self, response: ResponseObject):
        self.response = response
        self._seq = 0
        self._items: list[dict] = []  # output items so far (their final form once done)
        self._message: int | None = None  # output index of the open message item
        self._calls: dict[int, int] = {}  # tool call index -> output index
        self.text = ""  # the message text so far

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict]:
        body = self.response.body("in_progress", [])
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def feed(self, delta: StreamDelta) -> list[dict]:
        events = []
        if delta.content:
            events += self._text(delta.content)
        for call in delta.tool_calls:
            events += self._call(call)
        return events

    def _text(self, text: str) -> list[dict]:
        events = []
        if self._message is None:
            self._message = len(self._items)
            item = message_item(new_id("msg"), "", "in_progress")
            self._items.append(item)
            where = {"item_id": item["id"], "output_index": self._message, "content_index": 0}
            events += [
                self._event("response.output_item.added", output_index=self._message, item=item),
                self._event("response.content_part.added", part=_text_part(""), **where),
            ]
        self.text += text
        item = self._items[self._message]
        where = {"item_id": item["id"], "output_index": self._message, "content_index": 0}
        return events + [
            self._event("response.output_text.delta", delta=text, logprobs=[], **where)
        ]

    def _call(self, delta) -> list[dict]:
        events = []
        if delta.index not in self._calls:
            events += self._close_message()
            index = self._calls[delta.index] = len(self._items)
            call = ToolCall(delta.id or "", delta.name or "", "")
            item = function_item(new_id("fc"), call, "in_progress")
            self._items.append(item)
            events.append(self._event("response.output_item.added", output_index=index, item=item))
        index = self._calls[delta.index]
        item = self._items[index]
        if delta.arguments:
            item["arguments"] += delta.arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=delta.arguments,
                )
            )
        return events

    def _close_message(self) -> list[dict]:
        if self._message is None:
            return []
        index, self._message = self._message, None
        item = self._items[index]
        item.update(status="completed", content=[_text_part(self.text)])
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", text=self.text, logprobs=[], **where),
            self._event("response.content_part.done", part=_text_part(self.text), **where),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def finish(self, finish_reason: str, usage: Usage) -> list[dict]:
        events = self._close_message()
        for index in self._calls.values():
            item = self._items[index]
            item["status"] = "completed"
            events += [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                ),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
        status = status_of(finish_reason)
        body = self.response.body(status, self._items, usage)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(kind, response=body)]

    def failed(self, message: str) -> list[dict]:
        body = self.response.body("failed", self._items)
        body["error"] = {"code": "server_error", "message": message}
        return [self._event("response.failed", response=body)]

    def calls(self) -> tuple[ToolCall, ...]:
        """The function calls streamed so far, as ToolCalls (for the store)."""
        return tuple(
            ToolCall(self._items[i]["call_id"], self._items[i]["name"], self._items[i]["arguments"])
            for i in self._calls.values()
        )
