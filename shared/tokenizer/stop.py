"""Stop strings over streamed text (OpenAI semantics: the output ends before the stop string,
which is never emitted). Pure code."""

from collections.abc import Iterable

from shared.errors import InvalidRequestError


class StopStringMatcher:
    """Feeds text deltas and says what is safe to emit and whether a stop string was reached.

    A tail that could begin a stop string is held back until the next delta settles it. The
    first stop string to be completed in the text wins (on a tie, the one starting earlier),
    which is where generation would have stopped had the text come one character at a time:
    the result does not depend on how the text was split into deltas.
    """

    def __init__(self, stop_strings: Iterable[str]):
        self._stops = tuple(dict.fromkeys(stop_strings))
        if not all(self._stops):
            raise InvalidRequestError("stop", "stop strings must not be empty")
        self._held = ""  # a tail that might be the start of a stop string
        self.stopped = False
        self.matched: str | None = None  # the stop string that stopped the text (stop_reason)

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit now, stopped). After a stop, every call returns ("", True)."""
        if self.stopped:
            return "", True
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, self.matched = match
            self.stopped = True
            self._held = ""
            return text[:start], True
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Release the held-back tail when the sequence ended for another reason."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the stop string that ends first in `text` (on a tie, the one
        starting earlier)."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else best[1:]

    def _partial_tail(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
