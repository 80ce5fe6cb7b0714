"""DeepSeek V3 / R1: a section of calls, each naming its type, the function and a fenced JSON
object (mind the full-width bars and the U+2581 "▁" in the markers),

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

and DeepSeek V3.1's shorter call, `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":
"Paris"}<｜tool▁call▁end｜>`, in the same section."""

from shared.tool_calls.sections import SectionParser

SECTION_BEGIN, SECTION_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"


class DeepSeekV3Parser(SectionParser):
    """At the end of the output a call cut short in its closing fence is still a call."""

    name = "deepseek_v3"
    skip_special_tokens = False  # the markers are special tokens
    section_begin, section_end = SECTION_BEGIN, SECTION_END
    call_begin, call_end = CALL_BEGIN, CALL_END

    def __init__(self, tools):
        super().__init__(tools)
        self._fenced = True  # V3's call (fenced arguments), not V3.1's
        self._name = ""  # a V3 call's name, read before its fence

    def _call_head(self, final: bool) -> bool:
        """V3 writes the call's type here ("function"), V3.1 the function's name."""
        end = self._head_end(SEP, final)
        if end is None:
            return False
        if end < 0:
            return self._fail(final)
        head = self._take(end).strip()
        self._take(len(SEP))
        if not head:
            return self._fail(final)
        self._fenced = head == "function"
        if self._fenced:
            self._state = self._fenced_name
        else:
            self._begin_args(head)
        return True

    def _fenced_name(self, final: bool) -> bool:
        end = self._head_end("\n", final)
        if end is None:
            return False
        if end < 0:
            return self._fail(final)
        self._name = self._take(end).strip()
        self._skip_space()
        if not self._name:
            return self._fail(final)
        self._state = self._fence_open
        return True

    def _fence_open(self, final: bool) -> bool:
        found = self._expect(FENCE_OPEN, final)
        if found is None:
            return False
        if not found:
            return self._fail(final)
        self._begin_args(self._name)
        return True

    def _after_args(self, final: bool) -> bool:
        if not self._fenced:
            return self._call_end(final)
        self._skip_space()
        found = self._expect(FENCE_CLOSE, final)
        if found is None:
            return False
        if not found and FENCE_CLOSE.startswith(self._buf):  # the output ended in it
            self._take(len(self._buf))
        self._state = self._call_end
        return True
