"""The engine's grammar matchers: one llguidance matcher per request with params.structured,
owned here from admission to the request's end.

Each launched step asks for the masks of its sampling rows (`masks`): a row's mask depends only
on the tokens its matcher consumed, all known at launch, so they are filled on a worker thread
(llguidance's batch fill drops the GIL) while the forward pass runs, the sampler waiting for
them. On 2 cores whose 2 torch threads run the forward the overlap gains nothing measurable:
batch-32 decode under a schema ran at 0.86-0.96x of unconstrained beside the forward and
0.82-1.01x before it over four runs (loadtest/bench_structured.py); with cores to spare the
fill (~2-3 ms a 32-row step at a 32k vocabulary) leaves the critical path.

Each sampled token then advances its matcher (`advance`), which says when the request must end:
STOP once nothing may follow, ERROR if the token was not allowed (should not happen).
"""

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance
import torch
from tokenizers import Tokenizer

from shared.engine.request import FinishReason, Request
from shared.errors import InvalidRequestError
from shared.sampling.structured import grammar_of
from shared.sampling.token_mask import TokenMasks, ready

log = logging.getLogger(__name__)
FIELD = "structured"  # SamplingParams' field: the errors name it
LIMITS = llguidance.LLParserLimits(verbose_errors=False)  # logs name the token, not the schema


class Grammars:
    """The matchers of one engine's requests, keyed by request id; the engine adds one at
    admission and drops it whenever the request leaves (finish, abort, error)."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: frozenset[int]):
        self.model_dir, self.vocab_size = Path(model_dir), vocab_size
        self.eos_token_ids = eos_token_ids
        # fill masks beside the forward pass when torch leaves a core free, else before it on
        # every core: beside, on 2 cores busy with 2 torch threads, a bf16 batch-32 decode
        # under a schema ran at 0.86x of none against 0.92x before (bench_structured)
        self.background = _cores() > torch.get_num_threads()
        self._tokenizer: llguidance.LLTokenizer | None = None  # built at the first grammar
        self._executors: dict[bool, llguidance.LLExecutor] = {}  # by background
        self._thread: ThreadPoolExecutor | None = None
        self._matchers: dict[str, llguidance.LLMatcher] = {}

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, req: Request) -> None:
        """A matcher for `req` if it has a grammar; InvalidRequestError if it cannot compile."""
        spec = req.params.structured
        if spec is None:
            return
        grammar = grammar_of(spec, FIELD)
        matcher = llguidance.LLMatcher(self._tokenizer_info(), grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise InvalidRequestError(
                FIELD, f"cannot compile the {spec.kind}: {matcher.get_error()}"
            )
        self._matchers[req.request_id] = matcher

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def masks(self, sampling: list[Request]) -> Future[TokenMasks | None] | None:
        """The allowed tokens of the rows of `sampling` (a step's sampling requests, in row
        order) that have a grammar, as a future; None when none has one."""
        if not self._matchers:
            return None
        found = ((i, self._matchers.get(r.request_id)) for i, r in enumerate(sampling))
        rows = [(i, m) for i, m in found if m is not None]
        if not rows:
            return None
        if not self.background:
            return ready(self._fill(rows))
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="tison-grammar")
        return self._thread.submit(self._fill, rows)

    def _fill(self, rows: list[tuple[int, llguidance.LLMatcher]]) -> TokenMasks:
        words = -(-self._tokenizer_info().vocab_size // 32)
        bitmask = torch.zeros((len(rows), words), dtype=torch.int32)  # (R, W)
        targets = [(m, k) for k, (_, m) in enumerate(rows)]
        fill = self._executor().unsafe_compute_mask_ptr
        fill(targets, bitmask.data_ptr(), words * 4, len(rows))
        row_ids = torch.tensor([i for i, _ in rows], dtype=torch.int64)
        return TokenMasks(row_ids, bitmask)

    def advance(self, req: Request, token: int) -> FinishReason | None:
        """Feeds the request's new token to its matcher; why the request must end, if it must."""
        matcher = self._matchers.get(req.request_id)
        if matcher is None:
            return None
        if not matcher.consume_token(token):
            log.error(
                "request %s: the grammar rejected token %d (%s); ending it",
                req.request_id,
                token,
                matcher.get_error(),
            )
            return FinishReason.ERROR
        return FinishReason.STOP if matcher.is_stopped() else None

    def _tokenizer_info(self) -> llguidance.LLTokenizer:
        """llguidance's view of the model folder's tokenizer (~0.1-1 s: once per engine). Its
        vocabulary is the model's when that is larger: ids past the tokenizer's never match."""
        if self._tokenizer is None:
            path = self.model_dir / "tokenizer.json"
            if not path.is_file():
                raise InvalidRequestError(FIELD, f"the model folder has no {path.name}")
            text = path.read_text(encoding="utf-8")
            words = Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
            n_vocab = max(self.vocab_size, words)
            eos = sorted(self.eos_token_ids) or None
            self._tokenizer = llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos)
        return self._tokenizer

    def _executor(self) -> llguidance.LLExecutor:
        """llguidance's parallel fill: on every core before the forward pass (2 threads halve
        a 32-row fill at a 32k vocabulary), on the cores torch leaves free beside it."""
        executor = self._executors.get(self.background)
        if executor is None:
            cores = _cores()
            spare = cores - torch.get_num_threads() if self.background else cores
            executor = self._executors[self.background] = llguidance.LLExecutor(max(1, spare))
        return executor

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown()
        self._matchers.clear()


def _cores() -> int:
    """The cores this process may run on (a pinned worker's, under tison up)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
