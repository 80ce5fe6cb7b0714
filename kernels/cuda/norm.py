"""RMSNorm on a GPU, with the residual add fused in (rms_norm.cu); the same call as
kernels/cpu/norm.py's rms_norm. Numerics are torch's F.rms_norm (the RMSNorm layer's torch
code): statistics in float32, the weight multiplied in float32, one rounding at the end. Only
the sum of squares' order and the square root differ from torch's (float32 within a few ulp,
bfloat16 within one ulp), so `reference_rms_norm` is the torch code the tests compare with."""

import numpy as np
import torch

from kernels.cuda import runtime

SOURCE = "rms_norm.cu"
DTYPES = (torch.float32, torch.bfloat16)
VALUES_PER_THREAD = 4  # a block's threads for a vector: dim / 4, 32 to 1024


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x (n, [heads,] dim), its rows possibly strided -> normalised (n, [heads,] dim) times
    weight (dim,), a new contiguous tensor. With residual (n, dim), contiguous: residual += x
    first (in place) and the sum is normalised."""
    if x.dim() not in (2, 3):
        raise ValueError(f"rms_norm x: {x.dim()} dimensions {tuple(x.shape)}, expected 2 or 3")
    runtime.check(x, "rms_norm x", DTYPES, dense_from=1)
    n, heads, dim = x.shape[0], x.shape[1] if x.dim() == 3 else 1, x.shape[-1]
    runtime.check(weight, "rms_norm weight", (x.dtype,), 1, x.device)
    if weight.shape[0] != dim:
        raise ValueError(f"rms_norm weight: shape {tuple(weight.shape)}, expected ({dim},)")
    if residual is not None:
        runtime.check(residual, "rms_norm residual", (x.dtype,), 2, x.device)
        if tuple(residual.shape) != (n, dim) or heads != 1:
            raise ValueError(
                f"rms_norm residual: shape {tuple(residual.shape)} beside x "
                f"{tuple(x.shape)}, expected both (n, dim)"
            )
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    threads = min(1024, 32 * runtime.blocks(dim, 32 * VALUES_PER_THREAD))
    name, stride = runtime.suffix(x.dtype), np.int64(x.stride(0))
    if residual is None:
        launch = runtime.function(SOURCE, f"tison_rms_norm_{name}")
        args = (x, stride, out, weight, np.int32(heads), np.int32(dim), np.float32(eps))
        launch((n * heads,), (threads,), args)
    else:
        launch = runtime.function(SOURCE, f"tison_add_rms_norm_{name}")
        args = (x, stride, residual, out, weight, np.int32(dim), np.float32(eps))
        launch((n,), (threads,), args)
    return out


def reference_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """What rms_norm computes, in torch (residual updated in place likewise)."""
    if residual is not None:
        residual.copy_(x + residual)  # rounded to the dtype, as the layer's x + residual
        x = residual
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * inv * weight.float()).to(x.dtype)
