"""What every tool-call parser shares: the OpenAI-shaped results, and one reader per family that
both `parse` and streaming run, so that the two cannot disagree on well-formed output.

A family's reader is a small state machine over `_buf`, the text not consumed yet. It consumes
only what is certain, holding back a tail that may still turn out to be a marker, and reports
events: content, a call's start (name and id), argument fragments, a call's close (ok or not).
Streaming sends the events out as they come; `parse` runs the same reader over the whole text
at once and then replaces each call that failed (invalid JSON, a missing marker, cut short) by
its raw text as content. A stream cannot take back a call whose name it has sent, so there a
failed call keeps the arguments sent so far and its text is not repeated as content.
"""

import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from shared.errors import InvalidRequestError


@dataclass(frozen=True)
class ToolCall:
    """One call, as OpenAI's message.tool_calls[k] (type "function")."""

    id: str  # "call_" + 24 hex chars, or the format's own id (Kimi K2), or 9 chars (Mistral)
    name: str  # as the model wrote it: possibly not one of the request's tools
    arguments: str  # JSON text of the arguments object, as OpenAI returns it


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output split into content and calls."""

    content: str | None  # text outside the calls, ends stripped; None when there is none
    tool_calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of a call, as OpenAI's chunk.choices[0].delta.tool_calls[k]."""

    index: int  # which call of the output (0, 1, ...)
    id: str | None = None  # on the call's first delta only
    name: str | None = None  # on the call's first delta only
    arguments: str = ""  # a fragment: a call's fragments concatenated are its arguments


@dataclass(frozen=True)
class StreamDelta:
    """What one `feed` (or `finish`) sends out."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


class _EdgeTrim:
    """Streams a text without the whitespace at its two ends: drops it at the start and holds
    a trailing run back until more text follows (it is dropped at the end), so that what is
    sent equals the whole text's strip()."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def feed(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body) :]
        return body


class ToolParser(ABC):
    """Splits one request's output into content and tool calls: `parse` for a whole output, or
    `feed` each text delta and `finish` at the end when streaming (so one instance per request).

    Never raises on model output: what cannot be read as a call is content. Names are returned
    as the model wrote them even when they are not among the request's tools (OpenAI clients
    validate them), so `tool_names` is only for the caller to check against.
    """

    name: ClassVar[str]  # vLLM's --tool-call-parser name
    skip_special_tokens: ClassVar[bool]  # False when the markers are special tokens

    def __init__(self, tools: Sequence[Mapping]):
        if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
            raise InvalidRequestError("tools", "must be a list of tools")
        if not all(isinstance(t, Mapping) for t in tools):
            raise InvalidRequestError("tools", "each tool must be an object")
        self.tools = tuple(tools)
        functions = [t.get("function") for t in self.tools]
        names = (f.get("name") for f in functions if isinstance(f, Mapping))
        self.tool_names = frozenset(n for n in names if isinstance(n, str))
        self._buf = ""  # text fed and not consumed by the reader yet
        self._raw: list[str] | None = None  # text of the call being read, None outside one
        self._started = False  # whether the call being read has sent its start
        # What the reader reported since the last flush: ("content", text), ("start", name,
        # id), ("args", fragment), ("end", ok, the call's raw text).
        self._events: list[tuple] = []
        self._num_calls = 0  # calls started on the stream
        self._trim = _EdgeTrim()

    def parse(self, text: str) -> ParsedOutput:
        """The whole output at once. A call that does not parse is returned as content."""
        reader = type(self)(self.tools)
        reader._buf = text
        reader._run(final=True)
        content: list[str] = []
        calls: list[ToolCall] = []
        for kind, *args in reader._events:
            if kind == "content":
                content.append(args[0])
            elif kind == "start":
                name, call_id, fragments = args[0], args[1], []
            elif kind == "args":
                fragments.append(args[0])
            elif args[0]:  # a call's end, ok
                calls.append(ToolCall(call_id, name, "".join(fragments)))
            else:
                content.append(args[1])
        return ParsedOutput("".join(content).strip() or None, tuple(calls))

    def feed(self, delta: str) -> StreamDelta:
        """Streaming: the next text delta in, what is certain of it out."""
        self._buf += delta
        self._run(final=False)
        return self._flush()

    def finish(self) -> StreamDelta:
        """End of stream: whatever was held back, read as the end of the output."""
        self._run(final=True)
        return self._flush()

    @abstractmethod
    def _step(self, final: bool) -> bool:
        """Consume what is certain at the front of `_buf` and report it; False when nothing
        more can be done until more text comes (with final, until `_buf` is empty)."""

    def _new_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def _run(self, final: bool) -> None:
        while self._step(final):
            pass

    def _flush(self) -> StreamDelta:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        for kind, *args in self._events:
            if kind == "content":
                content.append(self._trim.feed(args[0]))
            elif kind == "start":
                deltas.append(ToolCallDelta(self._num_calls, args[1], args[0]))
                self._num_calls += 1
            elif kind == "args":
                last = deltas.pop() if deltas else ToolCallDelta(self._num_calls - 1)
                deltas.append(
                    ToolCallDelta(last.index, last.id, last.name, last.arguments + args[0])
                )
        self._events.clear()
        return StreamDelta("".join(content), tuple(deltas))

    # --- for the readers ---

    def _take(self, n: int) -> str:
        """Consume the first n characters of `_buf` (part of the call's raw text in a call)."""
        text, self._buf = self._buf[:n], self._buf[n:]
        if self._raw is not None:
            self._raw.append(text)
        return text

    def _skip_space(self) -> None:
        self._take(len(self._buf) - len(self._buf.lstrip()))

    def _expect(self, literal: str, final: bool) -> bool | None:
        """Consume `literal` at the front: True; None while `_buf` may still become it (never
        with final); False when it cannot."""
        if self._buf.startswith(literal):
            self._take(len(literal))
            return True
        return None if literal.startswith(self._buf) and not final else False

    def _content_until(self, markers: Sequence[str], final: bool) -> str | None:
        """Send the content before the first marker; return that marker (still in `_buf`), or
        None after sending all but a tail that may be the start of one (with final, all)."""
        found = [(i, m) for m in markers if (i := self._buf.find(m)) >= 0]
        if found:
            i, marker = min(found)
            self._content(self._take(i))
            return marker
        keep = 0 if final else max(_partial_suffix(self._buf, m) for m in markers)
        self._content(self._take(len(self._buf) - keep))
        return None

    def _content(self, text: str) -> None:
        if text:
            self._events.append(("content", text))

    def _open_call(self) -> None:
        """The text from here may be a call: keep it, to return it as content if it is not."""
        if self._raw is None:
            self._raw, self._started = [], False

    def _start_call(self, name: str, call_id: str | None = None) -> None:
        self._events.append(("start", name, call_id or self._new_id()))
        self._started = True

    def _args(self, fragment: str) -> None:
        if fragment:
            self._events.append(("args", fragment))

    def _close_call(self, ok: bool) -> None:
        """End the call being read. One that never started is content, as is (for `parse`)
        one that started and failed."""
        raw = "".join(self._raw or ())
        if self._started:
            self._events.append(("end", ok, raw))
        else:
            self._content(raw)
        self._raw, self._started = None, False


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
