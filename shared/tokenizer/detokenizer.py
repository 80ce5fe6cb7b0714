"""Incremental detokenization: token ids in, text deltas out, as vLLM and TGI do it.

Decoding tokens one at a time breaks on two things: a UTF-8 character split over several
byte-level or byte-fallback tokens (each piece alone decodes to U+FFFD), and SentencePiece's
leading space, which the decoder strips from the first token of whatever it decodes. So each
step decodes a short window, "prefix" tokens already emitted plus the pending ones, and emits
what the window's text adds to the prefix's text, holding it back while it ends in U+FFFD.
"""

from collections.abc import Sequence

from shared.tokenizer.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Tokens kept as decoding context: of the prompt before the first output token, and of the
# emitted text afterwards (vLLM uses 5).
_NUM_CONTEXT_TOKENS = 5
# A character still in flight has at most 3 of its bytes yet, so it starts in one of the last
# 3 tokens (every token kept in the window carries at least one byte); this also bounds how far
# the context is widened when it starts inside a character.
_MAX_INCOMPLETE_TOKENS = 3
# A tail still ending in U+FFFD after this many pending tokens is invalid bytes, not a character
# in flight; it is emitted so that the window, and each step's cost, stay bounded. Never reached
# by output that decodes to valid UTF-8.
_MAX_PENDING_TOKENS = 16


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas whose concatenation (plus `flush()`)
    is the text the output adds after the prompt; with an empty prompt that is
    `tokenizer.decode(output_ids)`. Never emits U+FFFD for a character still in flight."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Skipped tokens decode to nothing: leaving them out of the window changes no text.
        self._skipped_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        tail = self._last_kept(prompt_token_ids, _NUM_CONTEXT_TOKENS + _MAX_INCOMPLETE_TOKENS)
        # The window holds context tokens (already emitted, or prompt) and then pending ones.
        self._window, self._prefix_text = self._context(tail)
        self._read = len(self._window)  # window tokens before this index are emitted

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append output tokens; return the text they complete (possibly "")."""
        self._window.extend(self._kept(new_token_ids))
        end = len(self._window)
        # Emit up to the last token that completes a character: the whole window, or a cut
        # before a character in flight.
        for cut in range(end, max(self._read, end - _MAX_INCOMPLETE_TOKENS - 1), -1):
            text = self._decode(self._window[:cut])
            if len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT_CHAR):
                return self._advance(cut, text)
        if end - self._read > _MAX_PENDING_TOKENS:
            cut = end - _MAX_INCOMPLETE_TOKENS
            return self._advance(cut, self._decode(self._window[:cut]))
        return ""

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back (only ever non-empty when
        the output ends in bytes that are not valid UTF-8, which decode shows as U+FFFD)."""
        return self._advance(len(self._window), self._decode(self._window))

    def _advance(self, cut: int, text: str) -> str:
        """Emit `text` (the window's first `cut` tokens decoded) past the prefix; the last
        tokens just emitted become the context of the next steps."""
        delta = text[len(self._prefix_text) :]
        context, self._prefix_text = self._context(self._window[:cut])
        self._window = context + self._window[cut:]
        self._read = len(context)
        return delta

    def _context(self, ids: list[int]) -> tuple[list[int], str]:
        """The last few of `ids`, widened while they start inside a multi-byte character, and
        their text."""
        start = max(len(ids) - _NUM_CONTEXT_TOKENS, 0)
        lowest = max(start - _MAX_INCOMPLETE_TOKENS, 0)
        text = self._decode(ids[start:])
        while start > lowest and text.startswith(REPLACEMENT_CHAR):
            start -= 1
            text = self._decode(ids[start:])
        return ids[start:], text

    def _kept(self, ids: Sequence[int]) -> list[int]:
        return [i for i in ids if i not in self._skipped_ids]

    def _last_kept(self, ids: Sequence[int], count: int) -> list[int]:
        """The last `count` kept ids, without walking a long prompt."""
        tail: list[int] = []
        for i in reversed(ids):
            if len(tail) == count:
                break
            if i not in self._skipped_ids:
                tail.append(i)
        return tail[::-1]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
