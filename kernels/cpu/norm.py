"""RMSNorm, with the residual add fused in (rms_norm.c)."""

import torch

from kernels.cpu import library
from kernels.cpu.checks import check, row_stride


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x (n, [heads,] dim) -> normalised (n, [heads,] dim) times weight (dim,). With residual
    (n, dim): residual += x first (in place) and the sum is normalised. After
    library.usable(x)."""
    dim, n = x.shape[-1], x.shape[0]
    heads = x.shape[1] if x.dim() == 3 else 1
    check("rms_norm weight", weight, x.dtype, dim)
    if residual is not None:
        check("rms_norm residual", residual, x.dtype, n, dim)
        if not residual.is_contiguous() or heads != 1:
            raise ValueError("rms_norm: the residual must be contiguous (n, dim)")
    out = torch.empty(x.shape, dtype=x.dtype)
    library.functions["tk_rms_norm", x.dtype](
        x.data_ptr(), row_stride("rms_norm x", x), out.data_ptr(), heads * dim,
        None if residual is None else residual.data_ptr(), weight.data_ptr(),
        n, heads, dim, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out
