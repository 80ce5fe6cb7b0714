"""Repetition, frequency and presence penalties as sparse edits of a batch's logits (vLLM rules).

A row has seen a few hundred or thousand of its V tokens, so the penalties are kept as flat
indices row * V + token into the flattened (B * V) logits, with one value per index: applying
them touches those entries only. They are built only when some row uses a penalty, and only
from the rows that use one.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from shared.errors import InvalidRequestError
from shared.sampling.params import SamplingParams


@dataclass(frozen=True)
class FlatValues:
    """One value per entry of a batch's flattened (B * V) logits."""

    ids: torch.Tensor  # (N,) int64 unique row * V + token
    values: torch.Tensor  # (N,) float32


@dataclass(frozen=True)
class PenaltyTensors:
    """The penalties of one batch; a field is None when no row uses that penalty."""

    repetition: FlatValues | None  # tokens in a row's prompt or output -> the row's penalty
    output_offsets: FlatValues | None  # tokens in a row's output -> freq * count + presence

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> "PenaltyTensors | None":
        """Penalties of the batch whose row i has params[i], prompts[i], outputs[i], or None."""
        repetition = _repetition(params, prompts, outputs, vocab_size, device)
        output_offsets = _output_offsets(params, outputs, vocab_size, device)
        if repetition is None and output_offsets is None:
            return None
        return cls(repetition, output_offsets)

    def apply_(self, flat_logits: torch.Tensor) -> None:
        """Penalize the flattened (B * V) float32 logits in place: repetition, then the others.

        Repetition divides a seen token's positive logit by the penalty and multiplies a
        negative one; frequency and presence subtract freq * count + presence * (count > 0).
        """
        if self.repetition is not None:
            ids, penalty = self.repetition.ids, self.repetition.values
            seen = flat_logits[ids]  # (N,)
            flat_logits[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
        if self.output_offsets is not None:
            offsets = self.output_offsets
            flat_logits.index_add_(0, offsets.ids, offsets.values, alpha=-1)


def _repetition(
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
) -> FlatValues | None:
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return None
    token_lists = [prompts[i] for i in rows] + [outputs[i] for i in rows]
    ids = _flat_ids(rows * 2, token_lists, vocab_size).unique()
    per_row = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
    return FlatValues(ids.to(device), per_row[ids // vocab_size].to(device))


def _output_offsets(
    params: Sequence[SamplingParams],
    outputs: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
) -> FlatValues | None:
    rows = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if not rows:
        return None
    flat_ids = _flat_ids(rows, [outputs[i] for i in rows], vocab_size)
    ids, counts = flat_ids.unique(return_counts=True)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
    row_of = ids // vocab_size
    offsets = frequency[row_of] * counts + presence[row_of]
    return FlatValues(ids.to(device), offsets.to(device))


def _flat_ids(
    rows: Sequence[int], token_lists: Sequence[Sequence[int]], vocab_size: int
) -> torch.Tensor:
    """(N,) int64 row * V + token for every token of token_lists[j], which belongs to rows[j]."""
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64)
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        bad = int(tokens[(tokens < 0) | (tokens >= vocab_size)][0])
        raise InvalidRequestError("prompt", f"token id {bad} is outside [0, {vocab_size})")
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)  # (N,)
    return row_of * vocab_size + tokens


__all__ = ["FlatValues", "PenaltyTensors"]
