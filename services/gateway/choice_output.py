"""One choice's output as the client sees it: content and, when tools may be called, the
tool calls a parser finds in the text (the family's parser for `auto`, ForcedCalls for a
forced choice). Without a parser the text is the content as it is."""

from shared import protocol
from shared.tool_calls import ParsedOutput, StreamDelta

TOOL_CALLS = "tool_calls"  # OpenAI's finish_reason when the model called tools


def merge(a: StreamDelta, b: StreamDelta) -> StreamDelta:
    return StreamDelta(a.content + b.content, a.tool_calls + b.tool_calls)


class ChoiceOutput:
    def __init__(self, parser=None, calls_end_with_stop: bool = False):
        self.parser = parser  # a shared.tool_calls parser, ForcedCalls, or None
        # a named tool_choice ends with "stop", as OpenAI's does; other calls with "tool_calls"
        self._calls_end_with_stop = calls_end_with_stop
        self._called = False

    def feed(self, text: str) -> StreamDelta:
        """Streaming: the next text in, what to send."""
        out = StreamDelta(content=text) if self.parser is None else self.parser.feed(text)
        self._called = self._called or bool(out.tool_calls)
        return out

    def finish(self) -> StreamDelta:
        """Streaming: the end of the text; whatever the parser held back."""
        if self.parser is None:
            return StreamDelta()
        out = self.parser.finish()
        self._called = self._called or bool(out.tool_calls)
        return out

    def parse(self, text: str) -> ParsedOutput:
        """Non-streaming: the whole text."""
        if self.parser is None:
            return ParsedOutput(text, ())
        parsed = self.parser.parse(text)
        self._called = bool(parsed.tool_calls)
        return parsed

    def finish_reason(self, reason: str) -> str:
        """The engine's reason, "tool_calls" when a stop ended a turn that called tools."""
        if reason == protocol.FINISH_STOP and self._called and not self._calls_end_with_stop:
            return TOOL_CALLS
        return reason
