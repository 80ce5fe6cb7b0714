"""Kimi K2: a section of calls, each with the model's own id and a JSON arguments object,

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

(without the line break); the id "functions.NAME:IDX" is kept as the call's id."""

import re

from shared.tool_calls.sections import SectionParser

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
ARGS_BEGIN = "<|tool_call_argument_begin|>"
_CALL_ID = re.compile(r"(?:functions\.)?(.+?)(?::\d+)?")  # the name in the id


class KimiK2Parser(SectionParser):
    name = "kimi_k2"
    skip_special_tokens = False  # the markers are special tokens
    section_begin, section_end = SECTION_BEGIN, SECTION_END
    call_begin, call_end = CALL_BEGIN, CALL_END

    def _call_head(self, final: bool) -> bool:
        end = self._head_end(ARGS_BEGIN, final)
        if end is None:
            return False
        if end < 0:
            return self._fail(final)
        call_id = self._take(end).strip()
        self._take(len(ARGS_BEGIN))
        m = _CALL_ID.fullmatch(call_id)
        if m is None:
            return self._fail(final)
        self._begin_args(m[1], call_id)
        return True
