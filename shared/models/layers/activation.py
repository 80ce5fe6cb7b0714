import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import library
from kernels.cpu.activation import silu_mul


class SiluAndMul(nn.Module):
    """(T, 2 * d) gate|up -> (T, d) silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if library.usable(x):
            return silu_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
