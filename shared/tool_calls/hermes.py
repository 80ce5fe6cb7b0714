"""Hermes 2 Pro, Qwen 2.5 and Qwen 3: each call is a JSON object between markers,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several in a row; the text around them is content."""

from shared.tool_calls.base import ToolParser
from shared.tool_calls.json_reader import JsonCallReader

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    """A call whose JSON does not parse is content, markers included; at the end of the
    output a valid call whose closing marker never came is still a call."""

    name = "hermes"
    skip_special_tokens = False  # Hermes 2 Pro's markers are special tokens

    def __init__(self, tools):
        super().__init__(tools)
        self._state = self._in_content
        self._reader = JsonCallReader()

    def _step(self, final: bool) -> bool:
        return self._state(final)

    def _in_content(self, final: bool) -> bool:
        if self._content_until([OPEN], final) is None:
            return False
        self._open_call()
        self._take(len(OPEN))
        self._state = self._before_json
        return True

    def _before_json(self, final: bool) -> bool:
        self._skip_space()
        if not self._buf and not final:
            return False
        if self._buf.startswith("{"):
            self._reader = JsonCallReader()
            self._state = self._in_json
        else:
            self._state = self._skip_to_close
        return True

    def _in_json(self, final: bool) -> bool:
        ok = self._reader.step(self, final)
        if ok is None:
            return False
        self._state = self._at_close if ok else self._skip_to_close
        return True

    def _at_close(self, final: bool) -> bool:
        self._skip_space()
        closed = self._expect(CLOSE, final)
        if closed is None:
            return False
        if not closed and CLOSE.startswith(self._buf):  # the output ended before it
            self._take(len(self._buf))
            closed = True
        if closed:
            self._close_call(ok=True)
            self._state = self._in_content
        else:
            self._state = self._skip_to_close
        return True

    def _skip_to_close(self, final: bool) -> bool:
        """A failed call: its text up to its closing marker (or the end) goes with it."""
        end = self._buf.find(CLOSE)
        if end < 0 and not final:
            return False
        self._take(len(self._buf) if end < 0 else end + len(CLOSE))
        self._close_call(ok=False)
        self._state = self._in_content
        return True
