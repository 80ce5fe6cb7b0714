import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import library
from kernels.cpu.activation import silu_mul
from kernels.cuda import activation as cuda_activation
from kernels.cuda import runtime as cuda


class SiluAndMul(nn.Module):
    """(T, 2 * d) gate|up -> (T, d) silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if library.usable(x):
            return silu_mul(x)
        if cuda.usable(x) and x.is_contiguous():
            return cuda_activation.silu_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
