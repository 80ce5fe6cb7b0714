"""The checks every op wrapper runs before it passes a tensor's address to C."""

import torch


def check(name: str, x: torch.Tensor, dtype: torch.dtype, *shape: int) -> None:
    """x is a CPU tensor of dtype and shape whose last dimension is contiguous; ValueError
    naming `name` otherwise."""
    if x.dtype != dtype or x.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU {dtype} tensor, got {x.dtype} on {x.device}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")
    if x.dim() and x.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous")


def row_stride(name: str, x: torch.Tensor) -> int:
    """Row stride of x (n, ...): all but the first dimension must be packed densely."""
    inner = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        if size > 1 and stride != inner:
            raise ValueError(f"{name}: only the first dimension may be strided")
        inner *= size
    return x.stride(0)
