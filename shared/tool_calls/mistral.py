"""Mistral: after the `[TOOL_CALLS]` marker, either a JSON list of calls (tokenizers before
v11, e.g. Mistral 7B Instruct v0.3)

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]

or (v11 and later) one marker per call, the name and then the arguments object:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

(v13 puts `[CALL_ID]id` between the name and `[ARGS]`). Text around the calls is content."""

import re
import secrets
import string

from shared.tool_calls.base import ToolParser
from shared.tool_calls.json_reader import ArgsReader, JsonCallReader

MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")  # what a v11 name is made of, up to what follows it
_ID_CHARS = string.ascii_letters + string.digits
_MAX_ID_CHARS = 64  # a [CALL_ID] this long without its [ARGS] is not one


class MistralParser(ToolParser):
    """Call ids are 9 letters and digits, as Mistral's own templates require of the ids sent
    back. A call that does not parse is content (in a list, with the rest of the list up to
    its "]"); at the end of the output a list whose "]" never came keeps the calls read."""

    name = "mistral"
    skip_special_tokens = False  # [TOOL_CALLS] and [ARGS] are special tokens

    def __init__(self, tools):
        super().__init__(tools)
        self._state = self._in_content
        self._reader = JsonCallReader()
        self._arguments = ArgsReader()
        self._name = ""  # a v13 call's name, read before its id

    def _new_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def _step(self, final: bool) -> bool:
        return self._state(final)

    def _in_content(self, final: bool) -> bool:
        if self._content_until([MARKER], final) is None:
            return False
        self._open_call()
        self._take(len(MARKER))
        self._state = self._after_marker
        return True

    def _after_marker(self, final: bool) -> bool:
        self._skip_space()
        if not self._buf and not final:
            return False
        if self._buf.startswith("["):
            self._take(1)
            self._state = self._list_item
        else:
            self._state = self._name_v11
        return True

    # --- the list ---

    def _list_item(self, final: bool) -> bool:
        self._skip_space()
        if not self._buf and not final:
            return False
        if not self._buf.startswith("{"):
            self._close_call(ok=False)
            self._state = self._in_content
            return True
        self._open_call()
        self._reader = JsonCallReader()
        self._state = self._in_item
        return True

    def _in_item(self, final: bool) -> bool:
        ok = self._reader.step(self, final)
        if ok is None:
            return False
        if ok:
            self._close_call(ok=True)
        self._state = self._after_item if ok else self._rest_of_list
        return True

    def _rest_of_list(self, final: bool) -> bool:
        """A failed item: the list's text up to its "]" (or the end) goes with it."""
        end = self._buf.find("]")
        if end < 0 and not final:
            return False
        self._take(len(self._buf) if end < 0 else end + 1)
        self._close_call(ok=False)
        self._state = self._in_content
        return True

    def _after_item(self, final: bool) -> bool:
        self._skip_space()
        if not self._buf and not final:
            return False
        if self._buf.startswith(","):
            self._take(1)
            self._state = self._list_item
        else:
            self._take(1 if self._buf.startswith("]") else 0)
            self._state = self._in_content
        return True

    # --- v11: name[ARGS]{...} ---

    def _name_v11(self, final: bool) -> bool:
        end = _NAME.match(self._buf).end()
        rest = self._buf[end:].lstrip()
        if not final and (ARGS.startswith(rest) or CALL_ID.startswith(rest)):
            return False  # the name, or what follows it, may still be coming
        name = self._buf[:end]
        if not name or not rest.startswith((ARGS, CALL_ID, "{")):
            self._close_call(ok=False)
            self._state = self._in_content
            return True
        self._take(len(self._buf) - len(rest))
        if rest.startswith(CALL_ID):
            self._take(len(CALL_ID))
            self._name = name
            self._state = self._call_id
        else:
            self._take(len(ARGS) if rest.startswith(ARGS) else 0)
            self._begin_args(name, None)
        return True

    def _call_id(self, final: bool) -> bool:
        limit = _MAX_ID_CHARS + len(ARGS)  # looked for in as much text, whatever the chunks
        end = self._buf.find(ARGS, 0, limit)
        if end < 0:
            if not final and len(self._buf) < limit:
                return False
            self._close_call(ok=False)
            self._state = self._in_content
            return True
        call_id = self._take(end).strip()
        self._take(len(ARGS))
        self._begin_args(self._name, call_id or None)
        return True

    def _begin_args(self, name: str, call_id: str | None) -> None:
        self._start_call(name, call_id)
        self._arguments = ArgsReader()
        self._state = self._in_args

    def _in_args(self, final: bool) -> bool:
        ok = self._arguments.step(self, final)
        if ok is None:
            return False
        self._close_call(ok)
        self._state = self._in_content
        return True
