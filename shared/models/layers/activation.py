import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """(T, 2 * d) gate|up -> (T, d) silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
