"""Top-k, top-p (nucleus) and min-p filtering of temperature-scaled logits, batched per row.

Top-k and top-p reduce each row to sorted candidates (values and token ids), so only those
need noise. None of the filters ever removes a row's most likely token.
"""

import torch
import torch.nn.functional as F

_NEG_INF = float("-inf")


def top_k_top_p(
    x: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor | None,
    num_candidates: int,
    wide_nucleus: bool,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The tokens each row may still draw after top-k and then top-p, as sorted candidates.

    x: (R, V) scaled logits. top_k: (R,) int64 in [1, V], V where a row has none. top_p: (R,)
    float32, 1.0 where a row has none; None when no row uses it. num_candidates (C) is at
    least every row's top_k below V. wide_nucleus: some row has top-p without top-k, so its
    nucleus is measured over the whole row and may not fit in the C candidates.

    Returns (values, token_ids), both (R, C), best first, with dropped candidates at -inf; or
    None when some row's nucleus reaches past the C candidates (ask again with C = V).
    """
    values, token_ids = x.topk(num_candidates, dim=-1)  # (R, C) each, descending
    positions = torch.arange(num_candidates, device=x.device)
    keep = positions[None, :] < top_k[:, None]  # (R, C): a prefix of every row
    if top_p is not None:
        in_nucleus = _nucleus(x, values.masked_fill(~keep, _NEG_INF), top_k, top_p, wide_nucleus)
        if in_nucleus is None:
            return None
        keep &= in_nucleus
    return values.masked_fill_(~keep, _NEG_INF), token_ids


def _nucleus(
    x: torch.Tensor, values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, wide: bool
) -> torch.Tensor | None:
    """(R, C) bool: candidates whose more likely predecessors hold less than top_p of the mass.

    values: (R, C) top-k-masked sorted logits. A row with top-k has its nucleus taken from its
    top-k alone; one without from the whole row, known complete only if the candidates hold
    mass >= top_p (None otherwise).
    """
    log_norm = values.logsumexp(dim=-1)  # (R,)
    within = top_k <= values.shape[-1]  # (R,): the row's top-k ends inside the candidates
    if wide:
        log_norm = torch.where(within, log_norm, x.logsumexp(dim=-1))
    cumulative = (values - log_norm[:, None]).exp_().cumsum_(dim=-1)  # (R, C)
    if wide and not bool((within | (cumulative[:, -1] >= top_p)).all()):
        return None
    mass_before = F.pad(cumulative[:, :-1], (1, 0))  # (R, C), zero for the top candidate
    return (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)


def min_p(x: torch.Tensor, log_min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's top probability.

    x: (R, N) scaled logits (a whole row or its candidates); log_min_p: (R,) log(min_p), -inf
    where a row has none. p_i >= min_p * p_max reads x_i >= x_max + log(min_p): no softmax is
    needed, and the kept set is the same whether top-k/top-p ran first or not (both keep the
    top token and leave the probability ratios alone).
    """
    threshold = x.amax(dim=-1, keepdim=True) + log_min_p[:, None]  # (R, 1)
    return x.masked_fill(x < threshold, _NEG_INF)


__all__ = ["top_k_top_p", "min_p"]
