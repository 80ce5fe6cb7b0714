"""Rotary position embedding of q and k, "rotate half" layout (rope.c)."""

import torch

from kernels.cpu import library
from kernels.cpu.checks import check, row_stride


def rope(q: torch.Tensor, k: torch.Tensor, positions, cos, sin):
    """q (n, nh, hd) and k (n, nkv, hd), rows possibly strided -> rotated copies, contiguous;
    cos/sin (max_positions, hd) tables, contiguous, read at positions (n,) int64 (unchecked:
    the caller keeps them in range). After library.usable(q)."""
    n, nh, hd = q.shape
    nkv = k.shape[1]
    check("rope k", k, q.dtype, n, nkv, hd)
    check("rope positions", positions, torch.int64, n)
    check("rope cos", cos, q.dtype, cos.shape[0], hd)
    check("rope sin", sin, q.dtype, *cos.shape)
    if not (cos.is_contiguous() and sin.is_contiguous() and positions.is_contiguous()):
        raise ValueError("rope: cos, sin and positions must be contiguous")
    q_out, k_out = torch.empty((n, nh, hd), dtype=q.dtype), torch.empty((n, nkv, hd), dtype=q.dtype)
    library.functions["tk_rope", q.dtype](
        q.data_ptr(), row_stride("rope q", q), k.data_ptr(), row_stride("rope k", k), n, nh, nkv,
        hd, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(),
        k_out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return q_out, k_out
