"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the output starts with a call object, optionally after
`<|python_tag|>`, and several are separated by ";",

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ...}

("arguments" is read as well as "parameters"). An output that starts otherwise is all content,
as is the text from the first thing after the calls that is not one."""

from shared.tool_calls.base import ToolParser
from shared.tool_calls.json_reader import JsonCallReader

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    """A JSON object that is not a call (no "name", arguments not an object) is content; so is
    one cut short by the end of the output."""

    name = "llama3_json"
    # The detokenizer may drop <|python_tag|> (the calls then start at "{"): other special
    # tokens would otherwise end up in the content.
    skip_special_tokens = True

    def __init__(self, tools):
        super().__init__(tools)
        self._state = self._at_start
        self._reader = JsonCallReader()

    def _step(self, final: bool) -> bool:
        return self._state(final)

    def _at_start(self, final: bool) -> bool:
        body = self._buf.lstrip()
        if not final and len(body) < len(PYTHON_TAG) and PYTHON_TAG.startswith(body):
            return False  # nothing yet, or maybe the tag
        self._content(self._take(len(self._buf) - len(body)))
        if body.startswith(PYTHON_TAG):
            self._open_call()
            self._take(len(PYTHON_TAG))
            self._state = self._before_call
        elif body.startswith("{"):
            self._state = self._before_call
        else:
            self._state = self._in_content
        return True

    def _before_call(self, final: bool) -> bool:
        self._skip_space()
        if not self._buf and not final:
            return False
        if self._buf.startswith("{"):
            self._open_call()
            self._reader = JsonCallReader()
            self._state = self._in_call
        else:
            self._close_call(ok=False)  # a lone <|python_tag|>, or code after it
            self._state = self._in_content
        return True

    def _in_call(self, final: bool) -> bool:
        ok = self._reader.step(self, final)
        if ok is None:
            return False
        self._close_call(ok)
        self._state = self._after_call if ok else self._in_content
        return True

    def _after_call(self, final: bool) -> bool:
        self._skip_space()
        if not self._buf:
            return False
        if self._buf.startswith(";"):
            self._take(1)
            self._state = self._before_call
        else:
            self._state = self._before_call if self._buf.startswith("{") else self._in_content
        return True

    def _in_content(self, final: bool) -> bool:
        if not self._buf:
            return False
        self._content(self._take(len(self._buf)))
        return True
