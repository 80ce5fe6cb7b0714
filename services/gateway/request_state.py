"""The output of one request as its token items arrive: ordering, text, stop strings, finish.

Items come from two publishers (the prefill worker sends output index 0, the decode worker the
rest), so they may arrive out of order or twice: each carries the output index of its first
token, and RequestStream applies them strictly in index order, dropping what it already has.
An error or abort item ends the request at once, whatever its index.
"""

from dataclasses import dataclass

from shared import protocol
from shared.protocol import TokenItem, TokenLogprob, Usage
from shared.sampling.params import SamplingParams
from shared.tokenizer.detokenizer import IncrementalDetokenizer
from shared.tokenizer.stop import StopStringMatcher
from shared.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True)
class Delta:
    """What the client gets next: text, the logprobs of the tokens behind it, maybe the end."""

    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # "stop", "length", or FINISH_ERROR / FINISH_ABORT
    error: str = ""  # with FINISH_ERROR
    tokens: int = 0  # output tokens behind it (a held-back partial character: text "")


def coalesce(deltas: list[Delta]) -> list[Delta]:
    """Consecutive deltas merged into one (up to one that finishes); an error or abort delta
    stays on its own, so what came before it still reaches the client."""
    merged: list[Delta] = []
    for delta in deltas:
        failed = delta.finish_reason in (protocol.FINISH_ERROR, protocol.FINISH_ABORT)
        if failed or not merged or merged[-1].finish_reason is not None:
            merged.append(delta)
            continue
        prev = merged[-1]
        merged[-1] = Delta(
            prev.text + delta.text,
            prev.logprobs + delta.logprobs,
            delta.finish_reason,
            tokens=prev.tokens + delta.tokens,
        )
    return merged


class RequestStream:
    """Turns the TokenItems of one request into Deltas. Pure apart from the tokenizer."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids, sampling: SamplingParams):
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=sampling.skip_special_tokens
        )
        self._stops = StopStringMatcher(sampling.stop)
        self._pending: list[TokenItem] = []  # arrived ahead of their turn
        self.num_output = 0  # tokens applied; the next expected output index
        self.finish_reason: str | None = None
        self.error = ""
        self.stopped_by_string = False  # the gateway ended it: the workers must be told
        self._usage: Usage | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def usage(self) -> Usage:
        return self._usage or Usage(self.num_prompt_tokens, self.num_output)

    def fail(self, error: str) -> Delta:
        """End the request with an error (worker died, timeout)."""
        self.finish_reason, self.error = protocol.FINISH_ERROR, error
        return Delta(finish_reason=protocol.FINISH_ERROR, error=error)

    def accept(self, item: TokenItem) -> Delta | None:
        """Apply an item (and any pending ones it unblocks); the Delta to send, if any."""
        if self.done:
            return None
        if item.finish_reason in (protocol.FINISH_ERROR, protocol.FINISH_ABORT):
            self.finish_reason, self.error = item.finish_reason, item.error or "request aborted"
            return Delta(finish_reason=item.finish_reason, error=self.error)
        self._pending.append(item)
        before = self.num_output
        texts: list[str] = []
        logprobs: list[TokenLogprob] = []
        while not self.done and (ready := self._next_ready()) is not None:
            self._apply(ready, texts, logprobs)
        if not texts and not logprobs and not self.done:
            return None
        return Delta(
            "".join(texts), tuple(logprobs), self.finish_reason, tokens=self.num_output - before
        )

    def _next_ready(self) -> TokenItem | None:
        for item in self._pending:
            if item.index <= self.num_output:
                self._pending.remove(item)
                return item
        return None

    def _apply(self, item: TokenItem, texts: list[str], logprobs: list[TokenLogprob]) -> None:
        skip = self.num_output - item.index  # tokens of this item already applied
        new_ids = item.token_ids[skip:]
        logprobs.extend(item.logprobs[skip:])
        bypass_stops = self.num_output < self.sampling.min_tokens
        self.num_output += len(new_ids)
        text = self._detok.add(new_ids) if new_ids else ""
        if bypass_stops:
            texts.append(text)
        else:
            emit, stopped = self._stops.feed(text)
            texts.append(emit)
            if stopped:
                self.finish_reason, self.stopped_by_string = protocol.FINISH_STOP, True
                return
        if item.finish_reason is not None and item.index + len(item.token_ids) <= self.num_output:
            texts.append(self._final_text())
            self.finish_reason, self._usage = item.finish_reason, item.usage

    def _final_text(self) -> str:
        emit, stopped = self._stops.feed(self._detok.flush())
        if stopped:
            self.stopped_by_string = True
            return emit
        return emit + self._stops.flush()
