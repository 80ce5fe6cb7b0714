"""The batched sampler: next-token logits (B, V) -> one token per row, per-row parameters.

Order (vLLM v1): logit_bias added; the tokens a row's grammar disallows set to -inf; stop
tokens masked below min_tokens (not on grammar rows); repetition penalty; frequency and
presence penalties; greedy rows take the argmax; the other rows are divided by their
temperature, filtered by top-k, top-p and min-p, and sampled with the Gumbel-max trick on
counter-based noise (shared.sampling.noise), so a seeded row draws the same token whatever
else is in the batch and wherever it sits. No Python loop runs over rows here.

Logprobs are those of the raw logits (before bias, grammar masks, penalties and temperature),
as vLLM returns by default (its logprobs_mode "raw_logprobs").
"""

from dataclasses import dataclass

import torch

from kernels.cpu import library
from kernels.cpu.argmax import argmax
from shared.errors import TisonError
from shared.sampling import filters
from shared.sampling.batch import (
    MIN_TEMPERATURE,
    NUCLEUS_CANDIDATES,
    RandomRows,
    SamplingBatch,
    SamplingRow,
    request_stop_token_ids,
)
from shared.sampling.noise import gumbel_noise
from shared.sampling.token_mask import apply_ as apply_masks_


@dataclass(frozen=True)
class SamplerOutput:
    """One step's tokens and, when any row asked for them, logprobs (on the logits' device).

    The logprob fields cover every row; a row that asked for none, or for n below the batch's
    max_n, ignores the values or the extra columns. Top entries are sorted best first.
    """

    token_ids: torch.Tensor | list[int]  # (B,) int64; ints from the fused decode call's argmax
    logprobs: torch.Tensor | None  # (B,) float32: log-probability of token_ids[b]
    top_logprob_ids: torch.Tensor | None  # (B, max_n) int64: the max_n most likely tokens
    top_logprobs: torch.Tensor | None  # (B, max_n) float32: their log-probabilities

    def token_list(self) -> list[int]:
        """token_ids as Python ints, whichever kind they are."""
        ids = self.token_ids
        return ids if isinstance(ids, list) else ids.tolist()


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Pick one token per row of `logits` (B, V), float32 or bfloat16, as `batch` says."""
    if tuple(logits.shape) != (batch.num_rows, batch.vocab_size):
        raise TisonError(
            f"logits of shape {tuple(logits.shape)} do not match the sampling batch "
            f"({batch.num_rows}, {batch.vocab_size})"
        )
    groups = batch.random
    plain_greedy = not groups and not _changes_logits(batch)
    if plain_greedy and batch.max_num_logprobs is None:  # no float copy of the logits needed
        return sample_greedy(logits)
    if not groups and batch.max_num_logprobs is None and _only_fills(batch):
        # greedy rows whose logits change only by -inf fills (grammar masks, stop tokens),
        # exact in any dtype: a copy in the logits' own (bf16: half the bytes of a float copy)
        return SamplerOutput(_argmax(_penalized(logits, batch, False)), None, None, None)
    raw = logits.float()  # the only conversion; written to only when nothing reads it after
    spare = raw is not logits and batch.max_num_logprobs is None  # a copy only _penalized reads
    x = _penalized(raw, batch, spare)
    if not batch.any_greedy and len(groups) == 1:  # one group holds every row, in order
        token_ids = _draw(x, groups[0], batch.vocab_size)
    else:
        token_ids = _argmax(x)  # greedy rows; random ones are overwritten below
        for group in groups:
            drawn = _draw(x.index_select(0, group.row_ids), group, batch.vocab_size)
            token_ids.index_copy_(0, group.row_ids, drawn)
    if batch.max_num_logprobs is None:
        return SamplerOutput(token_ids, None, None, None)
    return _with_logprobs(raw, token_ids, batch.max_num_logprobs)


def sample_greedy(logits: torch.Tensor) -> SamplerOutput:
    """What `sample` gives for rows that are all SamplingRow.plain_greedy, without a grammar:
    each row's argmax, with no SamplingBatch to build."""
    return SamplerOutput(_argmax(logits), None, None, None)


def _changes_logits(batch: SamplingBatch) -> bool:
    return any(v is not None for v in (batch.bias, batch.masks, batch.stop_mask, batch.penalties))


def _only_fills(batch: SamplingBatch) -> bool:
    return batch.bias is None and batch.penalties is None


def _penalized(raw: torch.Tensor, batch: SamplingBatch, spare: bool) -> torch.Tensor:
    """Raw logits with bias, grammar masks, stop tokens masked below min_tokens and penalties
    (changed in a copy, unless raw is a spare copy: bf16 logits without logprobs)."""
    if not _changes_logits(batch):
        return raw
    x = raw if spare else raw.clone()
    flat = x.view(-1)  # (B * V): bias, stop masks and penalties address row * V + token
    if batch.bias is not None:
        flat.index_add_(0, *batch.bias)
    if batch.masks is not None:
        apply_masks_(x, batch.masks)
    if batch.stop_mask is not None:
        flat.index_fill_(0, batch.stop_mask, float("-inf"))
    if batch.penalties is not None:
        batch.penalties.apply_(flat)
    return x


def _draw(x: torch.Tensor, group: RandomRows, vocab_size: int) -> torch.Tensor:
    """(R,) tokens drawn for a group from its rows' logits x (R, V).

    argmax(x + Gumbel noise) draws from softmax(x). Noise depends on (key, token id) only, so
    drawing among top-k/top-p candidates picks what a whole-row draw with them masked would.
    """
    x = x / group.temperature
    if group.top_k is None:
        token_ids = torch.arange(vocab_size, device=x.device)  # (V,) shared by all rows
    else:
        x, token_ids = _candidates(x, group.top_k, group, vocab_size)  # (R, C) each
    if group.log_min_p is not None:
        x = filters.min_p(x, group.log_min_p)
    choice = _argmax(gumbel_noise(group.keys, token_ids).add_(x))  # (R,)
    if token_ids.dim() == 1:
        return choice
    return token_ids.gather(1, choice[:, None]).squeeze(1)


def _candidates(
    x: torch.Tensor, top_k: torch.Tensor, group: RandomRows, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k/top-p candidates (values, token ids) of the group's scaled logits x (R, V)."""
    top_p = group.top_p
    found = filters.top_k_top_p(x, top_k, top_p, group.num_candidates, group.wide_nucleus)
    if found is None:  # some nucleus is wider than the first guess: sort whole rows
        found = filters.top_k_top_p(x, top_k, top_p, vocab_size, False)
    return found


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """(R,) index of each row's first maximum: in C on CPU (~10x faster than max().indices at
    32 x 32k), else max().indices (~3x faster than argmax on CPU)."""
    if library.usable(x) and x.shape[-1] > 0:
        return argmax(x)
    return x.max(dim=-1).indices


def _with_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, max_n: int) -> SamplerOutput:
    logprobs = torch.log_softmax(raw, dim=-1)  # (B, V)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)  # (B,)
    top_logprobs, top_ids = logprobs.topk(max_n, dim=-1)  # (B, max_n) each
    return SamplerOutput(token_ids, chosen, top_ids, top_logprobs)


__all__ = [
    "MIN_TEMPERATURE",
    "NUCLEUS_CANDIDATES",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingRow",
    "request_stop_token_ids",
    "sample",
    "sample_greedy",
]
