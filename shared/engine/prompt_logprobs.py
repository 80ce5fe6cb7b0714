"""Prompt logprobs (vLLM's `prompt_logprobs`): the log-probability the model gave each prompt
token given those before it, and the top-n at its position, from the raw logits of the prompt
positions a step computes. Only the rows of requests that asked get logits, a slice of rows at a
time, so a long prompt never materialises (T, vocab) at once."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.engine.request import PromptTargets
from shared.sampling.logprobs import TokenLogprob

# a slice's float32 logits and their log_softmax take at most this many elements each (128 MiB)
MAX_LOGIT_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class PromptLogprobChunk:
    """One request's prompt logprobs computed in one step, in prompt order."""

    index: int  # runner sets: into the step's scheduled requests
    # runner sets: values[0] scores prompt token first + 1 (it is Request.prompt_logprobs[first])
    first: int
    values: list[TokenLogprob]  # runner sets: one per target of PromptTargets


def score_prompts(
    hidden: torch.Tensor,  # (T, H) final hidden states of the step
    prompt_rows: list[tuple[int, int, PromptTargets]],  # ForwardBatch.prompt_rows
    compute_logits: Callable[[torch.Tensor], torch.Tensor],  # (N, H) -> (N, vocab)
    vocab_size: int,
    keep: bool = True,  # False on TP ranks > 0: they join compute_logits's gather, return nothing
    max_rows: int | None = None,  # rows per slice; default: MAX_LOGIT_ELEMENTS // vocab_size
) -> list[PromptLogprobChunk]:
    """log_softmax over the full vocabulary at every row that scores a prompt token: the target
    token's logprob and the top-n, as the sampler's logprobs (raw logits, no penalties)."""
    if not prompt_rows:
        return []
    device = hidden.device
    rows = torch.cat(
        [torch.arange(row, row + len(t.target_ids), device=device) for _, row, t in prompt_rows]
    )  # (R,)
    target_ids = torch.tensor(
        [tok for _, _, t in prompt_rows for tok in t.target_ids], dtype=torch.long, device=device
    )  # (R,)
    max_n = max(t.num_top for _, _, t in prompt_rows)
    step = max_rows or max(1, MAX_LOGIT_ELEMENTS // vocab_size)
    chosen, top_ids, top_values = [], [], []
    for a in range(0, len(rows), step):
        logits = compute_logits(hidden[rows[a : a + step]])  # (S, vocab)
        if not keep:
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # (S, vocab)
        chosen.append(logprobs.gather(1, target_ids[a : a + step, None]).squeeze(1))  # (S,)
        if max_n:
            values, ids = logprobs.topk(max_n, dim=-1)  # (S, max_n) each
            top_values.append(values)
            top_ids.append(ids)
    if not keep:
        return []
    return _chunks(prompt_rows, torch.cat(chosen), top_ids, top_values)


def _chunks(prompt_rows, chosen: torch.Tensor, top_ids: list, top_values: list):
    """The flat (R,) and (R, max_n) results split back into one chunk per request."""
    chosen_list = chosen.tolist()
    ids_list = torch.cat(top_ids).tolist() if top_ids else [[]] * len(chosen_list)
    values_list = torch.cat(top_values).tolist() if top_values else [[]] * len(chosen_list)
    chunks, at = [], 0
    for index, _, targets in prompt_rows:
        n = targets.num_top
        values = [
            TokenLogprob(tok, chosen_list[r], tuple(ids_list[r][:n]), tuple(values_list[r][:n]))
            for r, tok in enumerate(targets.target_ids, start=at)
        ]
        chunks.append(PromptLogprobChunk(index, targets.first, values))
        at += len(targets.target_ids)
    return chunks


def merge(have: list[TokenLogprob], chunk: PromptLogprobChunk) -> list[TokenLogprob]:
    """Appends to `have` (a Request's prompt_logprobs) what `chunk` adds to it, and returns
    that: none of what it holds already (a recompute after preemption scores the same tokens
    again); a gap, which launch order rules out, adds nothing rather than misplace values."""
    if chunk.first > len(have):
        return []
    new = chunk.values[len(have) - chunk.first :]
    have += new
    return new
