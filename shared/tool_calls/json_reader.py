"""Reading JSON off a parser's buffer as it grows: where an object ends (`JsonSpan`), an
arguments object streamed as it comes (`ArgsReader`), and a whole `{"name": ..., "arguments":
{...}}` call (`JsonCallReader`). Each consumes every character it is given at most once."""

import json
import re

from shared.tool_calls.base import ToolParser

_OUTSIDE = re.compile(r'[{}\[\]"]')  # the characters that matter outside a string
_INSIDE = re.compile(r'["\\]')  # ... and inside one
_OPEN, _CLOSE = "{[", "}]"

# The call object's start when it names the function first (as every family's models write it):
# then the name is sent at once and the arguments stream as they come.
_CALL_HEADER = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


class JsonSpan:
    """Finds where one JSON object or array ends, fed its text piece by piece from the opening
    bracket on. It counts brackets outside strings and does not validate: the caller parses
    the span it finds."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False  # the last piece ended inside a string on a backslash
        self.closed = False

    def feed(self, piece: str) -> int | None:
        """How much of `piece` the value takes when it ends in it, else None (all of it)."""
        i = 0
        if self._escaped and piece:
            i, self._escaped = 1, False
        while i < len(piece):
            if self._in_string:
                m = _INSIDE.search(piece, i)
                if m is None:
                    return None
                i = m.end()
                if m.group() == '"':
                    self._in_string = False
                elif i == len(piece):
                    self._escaped = True
                else:
                    i += 1
                continue
            m = _OUTSIDE.search(piece, i)
            if m is None:
                return None
            i, char = m.end(), m.group()
            if char == '"':
                self._in_string = True
            elif char in _OPEN:
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth <= 0:
                    self.closed = True
                    return i
        return None


def _object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class ArgsReader:
    """Streams an arguments object from the front of the buffer (after any whitespace) until
    its closing brace."""

    def __init__(self) -> None:
        self._span = JsonSpan()
        self._text: list[str] = []

    def step(self, parser: ToolParser, final: bool) -> bool | None:
        """True once a valid object is read, False when it is not one (or cut short), None
        while it may still come."""
        if not self._text:
            parser._skip_space()
            if not parser._buf:
                return False if final else None
            if parser._buf[0] != "{":
                return False
        end = self._span.feed(parser._buf)
        piece = parser._take(len(parser._buf) if end is None else end)
        self._text.append(piece)
        parser._args(piece)
        if self._span.closed:
            return _object("".join(self._text)) is not None
        return False if final else None


class JsonCallReader:
    """Reads one call object from the front of the buffer (which starts with "{"), sending its
    start and arguments: as they come when the object names the function first, else once it
    is whole (re-serialized)."""

    def __init__(self) -> None:
        self._span = JsonSpan()
        self._text = ""  # the object's text taken so far
        self._args_at: int | None = None  # where the arguments start, once the name is sent
        self._args_span = JsonSpan()
        self._args_sent = 0  # characters of the arguments sent
        self._name = ""

    def step(self, parser: ToolParser, final: bool) -> bool | None:
        """True once a valid call is read, False when it is not one (or cut short), None while
        it may still come."""
        end = self._span.feed(parser._buf)
        self._text += parser._take(len(parser._buf) if end is None else end)
        if self._args_at is None:
            self._try_header(parser)
        if self._args_at is not None:
            self._send_args(parser)
        if not self._span.closed:
            return False if final else None
        return self._close(parser)

    def _try_header(self, parser: ToolParser) -> None:
        m = _CALL_HEADER.match(self._text)
        if m is None:
            return
        try:
            self._name = json.loads(f'"{m[1]}"')
        except ValueError:
            return
        parser._start_call(self._name)
        self._args_at = self._args_sent = m.end()

    def _send_args(self, parser: ToolParser) -> None:
        if self._args_span.closed:
            return
        piece = self._text[self._args_sent :]
        end = self._args_span.feed(piece)
        piece = piece if end is None else piece[:end]
        parser._args(piece)
        self._args_sent += len(piece)

    def _close(self, parser: ToolParser) -> bool:
        call = _object(self._text)
        if call is None or not isinstance(call.get("name"), str):
            return False
        args = call.get("arguments", call.get("parameters"))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args = args if _object(args) is not None else None
        if self._args_at is not None:  # sent already: check it was the call's
            sent = _object(self._text[self._args_at : self._args_sent])
            return call["name"] == self._name and sent is not None and sent == args
        if isinstance(args, dict):
            parser._start_call(call["name"])
            parser._args(json.dumps(args, ensure_ascii=False))
            return True
        if isinstance(args, str):
            parser._start_call(call["name"])
            parser._args(args)
            return True
        return False
