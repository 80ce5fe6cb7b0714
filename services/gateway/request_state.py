"""The output of one request as its token items arrive: text, stop strings, finish.

Every item of a request comes from its decode worker, in order (it relays the prefill worker's
first token as output index 0), so each item starts where the previous one ended. One that does
not is a protocol error: the request fails with it rather than show tokens out of order. An
error or abort item ends the request at once, whatever its index.
"""

import logging
from dataclasses import dataclass

from shared import protocol
from shared.protocol import TokenItem, TokenLogprob, Usage
from shared.sampling.params import SamplingParams
from shared.tokenizer.detokenizer import IncrementalDetokenizer
from shared.tokenizer.stop import StopStringMatcher
from shared.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)


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
        self.first_prompt_token = prompt_token_ids[0] if prompt_token_ids else None
        self.sampling = sampling
        # token ids whose text a stop leaves out (the detokenizer keeps special tokens when
        # skip_special_tokens is off, as tool-call parsers need)
        self._stop_ids = frozenset(tokenizer.eos_token_ids) | set(sampling.stop_token_ids)
        self.prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # with output index 0
        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=sampling.skip_special_tokens
        )
        self._stops = StopStringMatcher(sampling.stop)
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
        """Apply the request's next item; the Delta to send (None once the request is done)."""
        if self.done:
            return None
        if item.finish_reason in (protocol.FINISH_ERROR, protocol.FINISH_ABORT):
            self.finish_reason, self.error = item.finish_reason, item.error or "request aborted"
            return Delta(finish_reason=item.finish_reason, error=self.error)
        if item.index != self.num_output:
            log.error(
                "request %s: output index %d arrived, %d expected",
                item.request_id,
                item.index,
                self.num_output,
            )
            return self.fail(
                f"protocol error: the worker sent output index {item.index}, "
                f"expected {self.num_output}"
            )
        if item.index == 0 and self.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = item.prompt_logprobs
        before = self.num_output
        text = self._apply(item)
        return Delta(text, item.logprobs, self.finish_reason, tokens=self.num_output - before)

    def _apply(self, item: TokenItem) -> str:
        """The text the item's tokens add (up to a stop string), finishing the request if the
        item or a stop string ends it."""
        bypass_stops = self.num_output < self.sampling.min_tokens
        self.num_output += len(item.token_ids)
        ids = item.token_ids
        if item.finish_reason == protocol.FINISH_STOP and ids and ids[-1] in self._stop_ids:
            ids = ids[:-1]  # the stop token ends the text, it is not part of it
        text = self._detok.add(ids) if ids else ""
        if not bypass_stops:
            text, stopped = self._stops.feed(text)
            if stopped:
                self.finish_reason, self.stopped_by_string = protocol.FINISH_STOP, True
                return text
        if item.finish_reason is not None:
            text += self._final_text()
            self.finish_reason, self._usage = item.finish_reason, item.usage
        return text

    def _final_text(self) -> str:
        emit, stopped = self._stops.feed(self._detok.flush())
        if stopped:
            self.stopped_by_string = True
            return emit
        return emit + self._stops.flush()
