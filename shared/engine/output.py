"""Turns a request's tokens into text as they come: incremental detokenization and stop
strings (matched on text, left out of the output, as OpenAI does)."""

from dataclasses import dataclass, field

from shared.sampling.logprobs import TokenLogprob
from shared.tokenizer.detokenizer import IncrementalDetokenizer
from shared.tokenizer.stop import StopStringMatcher


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None  # the stop token id or stop string, if any
    logprobs: list[TokenLogprob] | None = None  # one per output token when requested
    # when requested (params.prompt_logprobs): one per prompt token from the second on
    prompt_logprobs: list[TokenLogprob] | None = None


class TextTracker:
    """Per-request text state; `add` returns (new text, stop string that matched or None)."""

    def __init__(
        self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...], skip_special: bool
    ):
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=skip_special
        )
        self.matcher = StopStringMatcher(list(stop))
        self.stop = stop

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        return self.matcher.feed(self.detokenizer.add(token_ids))

    def flush(self) -> tuple[str, bool]:
        """At the end of the sequence: text held back by the detokenizer and the matcher."""
        text, stopped = self.matcher.feed(self.detokenizer.flush())
        return (text, True) if stopped else (text + self.matcher.flush(), False)
