"""RMSNorm, with the residual add fused in as the decoder layers use it."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()  # HF computes the variance in float32 and casts back before the weight
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return out if residual is None else (out, residual)
