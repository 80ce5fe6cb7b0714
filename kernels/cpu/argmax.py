"""Greedy sampling's argmax over rows of logits (argmax.c)."""

import torch

from kernels.cpu import library
from kernels.cpu.checks import check


def argmax(x: torch.Tensor) -> torch.Tensor:
    """(n, d) rows (strided rows allowed) -> (n,) int64 index of each row's first maximum,
    NaN counting as the largest value (as x.max(dim=-1).indices). d must be at least 1. After
    library.usable(x)."""
    n, d = x.shape
    check("argmax x", x, x.dtype, n, d)
    if d == 0:
        raise ValueError("argmax: rows are empty")
    out = torch.empty(n, dtype=torch.int64)
    library.functions["tk_argmax", x.dtype](
        x.data_ptr(), x.stride(0), n, d, out.data_ptr(), torch.get_num_threads()
    )
    return out
