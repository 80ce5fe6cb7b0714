"""FP8 e4m3 weights with one float32 scale per (rows x cols) block (DeepSeek-V3's
`weight_scale_inv`): weight = float(q) * scale_inv of its block, one float32 multiply."""

import torch


def dequantize(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], origin: tuple[int, int]
) -> torch.Tensor:
    """weight: float8_e4m3fn (R, C), the rows and columns of the whole tensor starting at
    origin (r0, c0); scale_inv: float32, the blocks covering them (from block r0 // rows,
    c0 // cols). Returns float32 (R, C)."""
    rows, cols = block
    r, c = origin[0] % rows, origin[1] % cols  # where weight starts inside its first block
    height, width = weight.shape
    scale = scale_inv.float().repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return weight.float() * scale[r : r + height, c : c + width]  # (R, C)
