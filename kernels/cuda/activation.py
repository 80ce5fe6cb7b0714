"""SiLU-and-mul on a GPU (silu_mul.cu), as kernels/cpu/activation.py's silu_mul. Numerics are
torch's F.silu(gate) * up (shared/models/layers/activation.py): silu in float32, rounded to
the dtype, times up; e^x is the device's expf, so float32 may differ from torch on the CPU
(its own exp) by a couple of ulp, and bfloat16, rounded after, by at most one ulp, rarely."""

import numpy as np
import torch

from kernels.cuda import runtime

SOURCE = "silu_mul.cu"
DTYPES = (torch.float32, torch.bfloat16)
THREADS = 256
MAX_BLOCKS = 65536  # beyond, the grid-stride loop gives each thread more values


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """(n, 2 * d) gate|up, contiguous -> (n, d) silu(gate) * up."""
    runtime.check(x, "silu_mul x", DTYPES, 2)
    if x.shape[1] % 2:
        raise ValueError(f"silu_mul x: {x.shape[1]} columns, expected gate|up of equal width")
    n, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if out.numel():
        grid = min(MAX_BLOCKS, runtime.blocks(n * d, THREADS))
        launch = runtime.function(SOURCE, f"tison_silu_mul_{runtime.suffix(x.dtype)}")
        launch((grid,), (THREADS,), (x, out, np.int64(n), np.int32(d)))
    return out


def reference_silu_mul(x: torch.Tensor) -> torch.Tensor:
    """What silu_mul computes, in torch."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
