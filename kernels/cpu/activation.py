"""SiLU-and-mul, the gated MLP's activation (silu_mul.c)."""

import torch

from kernels.cpu import library
from kernels.cpu.checks import check


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """(n, 2 * d) gate|up, contiguous -> (n, d) silu(gate) * up. After library.usable(x)."""
    n, d = x.shape[0], x.shape[1] // 2
    check("silu_mul x", x, x.dtype, n, 2 * d)
    if not x.is_contiguous():
        raise ValueError("silu_mul: x must be contiguous")
    out = torch.empty((n, d), dtype=x.dtype)
    library.functions["tk_silu_mul", x.dtype](
        x.data_ptr(), out.data_ptr(), n, d, torch.get_num_threads()
    )
    return out
