"""What DeepSeek V3's and Kimi K2's formats share: calls in a section between markers, each
call between its own begin and end markers, its arguments one JSON object; a family reads the
call's head (name, id) between its begin marker and its arguments."""

from abc import abstractmethod
from typing import ClassVar

from shared.tool_calls.base import ToolParser
from shared.tool_calls.json_reader import ArgsReader

MAX_HEAD_CHARS = 256  # a call's head this long without its end is not one


class SectionParser(ToolParser):
    """A call whose head or arguments do not parse is content, markers included (the section's
    markers are dropped); at the end of the output a valid call whose end marker never came
    is still a call. A call's begin marker outside a section starts one."""

    section_begin: ClassVar[str]
    section_end: ClassVar[str]
    call_begin: ClassVar[str]
    call_end: ClassVar[str]

    def __init__(self, tools):
        super().__init__(tools)
        self._state = self._in_content
        self._arguments = ArgsReader()

    def _step(self, final: bool) -> bool:
        return self._state(final)

    @abstractmethod
    def _call_head(self, final: bool) -> bool:
        """The state after a call's begin marker: reads up to the arguments, then calls
        `_begin_args` (or `_fail`)."""

    def _in_content(self, final: bool) -> bool:
        marker = self._content_until([self.section_begin, self.call_begin], final)
        if marker is None:
            return False
        if marker == self.section_begin:
            self._take(len(marker))
        self._state = self._in_section
        return True

    def _in_section(self, final: bool) -> bool:
        """Between calls: the next one, the section's end, or back to content."""
        self._skip_space()
        if self._buf.startswith(self.call_begin):
            self._open_call()
            self._take(len(self.call_begin))
            self._state = self._call_head
        elif self._buf.startswith(self.section_end):
            self._take(len(self.section_end))
            self._state = self._in_content
        elif not final and (
            self.call_begin.startswith(self._buf) or self.section_end.startswith(self._buf)
        ):
            return False
        else:
            self._state = self._in_content
        return True

    def _begin_args(self, name: str, call_id: str | None = None) -> None:
        self._start_call(name, call_id)
        self._arguments = ArgsReader()
        self._state = self._in_args

    def _in_args(self, final: bool) -> bool:
        ok = self._arguments.step(self, final)
        if ok is None:
            return False
        self._state = self._after_args if ok else self._fail
        return True

    def _after_args(self, final: bool) -> bool:
        """What may come between the arguments and the call's end marker: nothing here."""
        return self._call_end(final)

    def _call_end(self, final: bool) -> bool:
        self._skip_space()
        found = self._expect(self.call_end, final)
        if found is None:
            return False
        if not found and self.call_end.startswith(self._buf):  # the output ended before it
            self._take(len(self._buf))
            found = True
        if not found:
            return self._fail(final)
        self._close_call(ok=True)
        self._state = self._in_section
        return True

    def _head_end(self, marker: str, final: bool) -> int | None:
        """Where `marker` ends the part of a call's head being read: its index; None while it
        may still come; -1 when it cannot (the call's end marker comes first, or the head
        would be over MAX_HEAD_CHARS), whatever the chunking."""
        limit = MAX_HEAD_CHARS + len(marker)
        end = self._buf.find(marker, 0, limit)
        stop = self._buf.find(self.call_end, 0, limit)
        if end >= 0 and (stop < 0 or end < stop):
            return end
        if stop >= 0 or final or len(self._buf) >= limit:
            return -1
        return None

    def _fail(self, final: bool) -> bool:
        """A failed call: its text up to its end marker (or the end) goes with it."""
        end = self._buf.find(self.call_end)
        if end < 0 and not final:
            self._state = self._fail
            return False
        self._take(len(self._buf) if end < 0 else end + len(self.call_end))
        self._close_call(ok=False)
        self._state = self._in_section
        return True
