import torch
import torch.nn.functional as F
from torch import nn

from shared.models.layers import cpu_kernels


class SiluAndMul(nn.Module):
    """(T, 2 * d) gate|up -> (T, d) silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.usable(x):
            return cpu_kernels.silu_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
