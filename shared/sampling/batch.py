"""Per-step sampling inputs: one `SamplingRow` per request, gathered into a `SamplingBatch`.

Building is cheap in the common cases: no penalty tensors when no row uses a penalty, nothing
random when every row is greedy, no stop mask when every row is past its min_tokens, no bias
when no row has a logit_bias, no grammar masks when no row has a grammar.
"""

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from shared.sampling.noise import row_key
from shared.sampling.params import SamplingParams
from shared.sampling.penalties import PenaltyTensors
from shared.sampling.token_mask import TokenMasks

MIN_TEMPERATURE = 1e-5  # below this a row is sampled greedily (as vLLM does)
NUCLEUS_CANDIDATES = 1024  # top-p without top-k looks at this many tokens before the whole row


def request_stop_token_ids(params: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """The token ids that end a request: EOS unless ignore_eos, plus params.stop_token_ids."""
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    return frozenset((*eos, *params.stop_token_ids))


def plain_greedy(p: SamplingParams, num_output: int, stop_token_ids: frozenset[int]) -> bool:
    """Whether a request with num_output tokens so far samples greedily with nothing that
    changes its logits (bias, penalties, stop tokens masked below min_tokens) or returns them
    (logprobs): its token is the raw logits' argmax. A grammar's masks are the step's to check
    (the runner's `masks`)."""
    return (
        p.temperature < MIN_TEMPERATURE
        and p.logprobs is None
        and not p.logit_bias
        and p.repetition_penalty == 1.0
        and not (p.frequency_penalty or p.presence_penalty)
        and (num_output >= p.min_tokens or not stop_token_ids)
    )


@dataclass(frozen=True)
class SamplingRow:
    """One request's sampling state for this step; the engine builds one per scheduled request."""

    params: SamplingParams
    seed: int  # params.seed, or one drawn at admission: fixes the request's random stream
    prompt_token_ids: Sequence[int]  # read only when the request uses repetition_penalty
    output_token_ids: Sequence[int]  # generated so far; its length is the index being drawn
    stop_token_ids: frozenset[int]  # request_stop_token_ids(...): masked below min_tokens

    @property
    def greedy(self) -> bool:
        return self.params.temperature < MIN_TEMPERATURE

    @property
    def plain_greedy(self) -> bool:
        return plain_greedy(self.params, len(self.output_token_ids), self.stop_token_ids)


@dataclass(frozen=True)
class RandomRows:
    """Rows that sample at random, drawn together: either over the whole vocabulary (top_k is
    None) or among the candidates that top-k and top-p leave (see filters.top_k_top_p)."""

    row_ids: torch.Tensor  # (R,) int64 batch rows, ascending
    keys: torch.Tensor  # (R,) int32 noise keys from (seed, output index)
    temperature: torch.Tensor  # (R, 1) float32
    log_min_p: torch.Tensor | None  # (R,) float32 log(min_p), -inf where off; None if unused
    top_k: torch.Tensor | None  # (R,) int64 in [1, V], V where off; None: whole vocabulary
    top_p: torch.Tensor | None  # (R,) float32, 1.0 where off; None when no row uses it
    num_candidates: int  # first guess of the candidates top-k/top-p keep (filters.top_k_top_p)
    wide_nucleus: bool  # some row has top-p without top-k

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        ids: list[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> "RandomRows":
        """The group of batch rows `ids`, whose states are `rows`."""
        params = [r.params for r in rows]
        keys = [row_key(r.seed, len(r.output_token_ids)) for r in rows]
        top_ks = [_top_k(p, vocab_size) for p in params]
        top_ps = [p.top_p for p in params]
        uses_top_p = [p < 1.0 for p in top_ps]
        wide_nucleus = any(on and k == vocab_size for on, k in zip(uses_top_p, top_ks, strict=True))
        filtered = wide_nucleus or any(k < vocab_size for k in top_ks)
        num_candidates = max((k for k in top_ks if k < vocab_size), default=1)
        if wide_nucleus:
            num_candidates = min(vocab_size, max(num_candidates, NUCLEUS_CANDIDATES))
        log_min_ps = [_log(p.min_p) for p in params]
        uses_min_p = any(p.min_p > 0 for p in params)
        return cls(
            row_ids=_tensor(ids, torch.int64, device),
            keys=_tensor(keys, torch.int32, device),
            temperature=_tensor([p.temperature for p in params], torch.float32, device)[:, None],
            log_min_p=_tensor(log_min_ps, torch.float32, device) if uses_min_p else None,
            top_k=_tensor(top_ks, torch.int64, device) if filtered else None,
            top_p=_tensor(top_ps, torch.float32, device) if any(uses_top_p) else None,
            num_candidates=num_candidates,
            wide_nucleus=wide_nucleus,
        )


@dataclass(frozen=True)
class SamplingBatch:
    """Everything the sampler needs for one step of B rows over a vocabulary of V logits."""

    num_rows: int
    vocab_size: int
    any_greedy: bool  # some row takes the argmax
    random: tuple[RandomRows, ...]  # whole-vocabulary rows, top-k/top-p rows; empty groups left out
    penalties: PenaltyTensors | None  # None when no row uses a penalty
    stop_mask: torch.Tensor | None  # (N,) int64 flat row * V + token ids forced to -inf
    max_num_logprobs: int | None  # largest `logprobs` asked by a row; None when none asked
    # logit_bias: (flat row * V + token ids (N,) int64, their biases (N,) float32); None if unused
    bias: tuple[torch.Tensor, torch.Tensor] | None = None
    masks: TokenMasks | None = None  # allowed tokens of the rows under a grammar

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        device: torch.device | str,
        masks: TokenMasks | None = None,
    ) -> "SamplingBatch":
        """Gather per-row parameters into small tensors on `device` (one call per step).
        masks: the grammar rows' allowed tokens, rows indexing `rows`."""
        random_ids = [i for i, r in enumerate(rows) if not r.greedy]
        filtered_ids = [i for i in random_ids if _filters(rows[i].params, vocab_size)]
        filtered = set(filtered_ids)
        groups = ([i for i in random_ids if i not in filtered], filtered_ids)
        params = [r.params for r in rows]
        penalties = PenaltyTensors.build(
            params,
            [r.prompt_token_ids for r in rows],
            [r.output_token_ids for r in rows],
            vocab_size,
            device,
        )
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            any_greedy=len(random_ids) < len(rows),
            random=tuple(
                RandomRows.build([rows[i] for i in ids], ids, vocab_size, device)
                for ids in groups
                if ids
            ),
            penalties=penalties,
            stop_mask=_stop_mask(rows, vocab_size, device, masks),
            max_num_logprobs=max(asked) if asked else None,
            bias=_bias(rows, vocab_size, device),
            masks=None if masks is None else masks.to(device),
        )


def _top_k(params: SamplingParams, vocab_size: int) -> int:
    return params.top_k if 0 < params.top_k < vocab_size else vocab_size


def _filters(params: SamplingParams, vocab_size: int) -> bool:
    return params.top_p < 1.0 or _top_k(params, vocab_size) < vocab_size


def _stop_mask(
    rows: Sequence[SamplingRow],
    vocab_size: int,
    device: torch.device | str,
    masks: TokenMasks | None,
) -> torch.Tensor | None:
    """Flat indices of the stop tokens of rows that have fewer than min_tokens outputs.

    Ids outside the vocabulary are skipped: the model can never produce them. Rows under a
    grammar are skipped: the grammar decides where the output ends (once it is complete it
    allows only EOS, which min_tokens would leave the row nothing to sample).
    """
    grammar_rows = set() if masks is None else set(masks.row_ids.tolist())
    flat = [
        i * vocab_size + token
        for i, row in enumerate(rows)
        if len(row.output_token_ids) < row.params.min_tokens and i not in grammar_rows
        for token in row.stop_token_ids
        if 0 <= token < vocab_size
    ]
    return torch.tensor(flat, dtype=torch.int64, device=device) if flat else None


def _bias(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Flat indices and values of the rows' logit_bias (ids outside the vocabulary skipped:
    the engine rejects them at admission)."""
    pairs = [
        (i * vocab_size + token, bias)
        for i, row in enumerate(rows)
        for token, bias in row.params.logit_bias
        if token < vocab_size
    ]
    if not pairs:
        return None
    flat, values = zip(*pairs)
    return _tensor(list(flat), torch.int64, device), _tensor(list(values), torch.float32, device)


def _tensor(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _log(value: float) -> float:
    return math.log(value) if value > 0 else -math.inf


__all__ = [
    "MIN_TEMPERATURE",
    "RandomRows",
    "SamplingBatch",
    "SamplingRow",
    "request_stop_token_ids",
]
