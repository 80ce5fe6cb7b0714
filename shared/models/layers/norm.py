"""RMSNorm, with the residual add fused in as the decoder layers use it."""

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import library
from kernels.cpu.norm import rms_norm
from kernels.cuda import norm as cuda_norm
from kernels.cuda import runtime as cuda


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual); the sum may
        be written into residual's storage. x (T, [heads,] size); residual (T, size)."""
        kernel = rms_norm if library.usable(x) else cuda_norm.rms_norm if cuda.usable(x) else None
        if kernel is not None:  # one pass, no dispatch per op
            return (
                kernel(x, self.weight, self.eps)
                if residual is None
                else (kernel(x, self.weight, self.eps, residual), residual)
            )
        if residual is not None:
            x = x + residual
            residual = x
        # one fused kernel; statistics in float32 as HF computes them
        out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return out if residual is None else (out, residual)
