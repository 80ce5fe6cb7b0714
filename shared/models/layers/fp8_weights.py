"""FP8 linears on the GPU path. A linear that an FP8 checkpoint stores quantized (DeepSeek-V3
style: float8_e4m3fn bytes + float32 block scales, shared/models/quant/) keeps those bytes and
scales as they are where the CUDA kernels run on its parameter, instead of the dense weight a
CPU load dequantizes: a decode step reads half the bytes of bf16. Each TP rank keeps its
slice, narrowed by the layer's weight_loader as before (linear.py's `_place` calls `place`).

Which linears: decided at a weight's first placement, by what arrives (an Fp8Slice) and where
the parameter lives (kernels.cuda.runtime.usable: a GPU with cupy, or the tests' CPU
emulation). So the CPU engine loads exactly as before, and no model, loader or config knows
about it. A later placement that is not whole scale blocks (a TP shard or a merged part
starting inside a block) or not FP8 turns the weight dense for good, dequantized as a CPU
load would have: any checkpoint still loads.

On the module (a LinearBase): `weight` holds uint8 (N, K), buffer `weight_scale_inv` float32
(ceil(N / bn), ceil(K / bk)), `fp8_block` (bn, bk), `fp8_dtype` the model's dtype. Forward:
up to MAX_KERNEL_ROWS rows (decode steps) through the fp8_linear kernel; more (prefill
chunks) on a temporary dense weight (the fp8_dequantize kernel) and the dense path's matmul."""

import torch
from torch import nn

from kernels.cuda import fp8_linear as kernels
from kernels.cuda import runtime as cuda
from shared.models.layers.cpu_linear import linear
from shared.models.quant.checkpoint import Fp8Slice

MAX_KERNEL_ROWS = kernels.MAX_ROWS  # 64: beyond, a dequantized matmul is faster


def keeps(module: nn.Module) -> bool:
    """Whether the linear holds its weight as FP8 bytes + scales."""
    return getattr(module, "fp8_block", None) is not None


def place(module, loaded, dim: int, start: int, length: int | None, offset: int) -> bool:
    """Puts loaded.narrow(dim, start, length) (length None: loaded whole) into module.weight
    from row offset as stored, where the module keeps FP8. False: the caller places it dense,
    as it does every placement of the weight from then on."""
    if getattr(module, "fp8_dense", False):
        return False
    fp8 = isinstance(loaded, Fp8Slice)
    if not keeps(module):
        if not cuda.usable(module.weight):  # the CPU engine: as it always loaded
            return False
        if not fp8:  # a dense part first
            module.fp8_dense = True
            return False
        _keep_fp8(module, loaded.block)
    if length is None:
        length = loaded.shape[dim]
    if not (fp8 and _whole_blocks(module, loaded.block, dim, start, length, offset)):
        _densify(module)
        return False
    data, scale_inv = loaded.stored(dim, start, length)
    N, K = module.weight.shape
    expected = (length, K) if dim % 2 == 0 else (N, K)
    if tuple(data.shape) != expected or offset + data.shape[0] > N:
        raise ValueError(
            f"weight shape {tuple(data.shape)} at row {offset} does not match parameter {(N, K)}"
        )
    rows, first = data.shape[0], offset // module.fp8_block[0]
    module.weight.data[offset : offset + rows].copy_(data.view(torch.uint8))
    module.weight_scale_inv[first : first + scale_inv.shape[0]].copy_(scale_inv)
    return True


def forward(module, x: torch.Tensor) -> torch.Tensor:
    """x (..., K) -> (..., N) of x's dtype: x W^T (+ bias)."""
    N, K = module.weight.shape
    rows = x.reshape(-1, K)  # (T, K)
    weight, scale_inv, block = module.weight, module.weight_scale_inv, module.fp8_block
    if rows.shape[0] <= MAX_KERNEL_ROWS:
        y = kernels.fp8_linear(rows, weight, scale_inv, block, module.bias)
    else:  # a temporary (N, K) weight of x's dtype, dropped after the matmul
        dense = kernels.fp8_dequantize(weight, scale_inv, block, x.dtype)
        y = linear(module, rows, dense, module.bias)
    return y.view(*x.shape[:-1], N)


def _keep_fp8(module, block: tuple[int, int]) -> None:
    """The module's weight becomes uint8 (N, K) with its scale blocks, both unset (the
    placements fill them). The Parameter stays the same object: the loader holds it."""
    weight = module.weight
    N, K = weight.shape
    module.fp8_dtype = weight.dtype
    weight.data = torch.empty(N, K, dtype=torch.uint8, device=weight.device)
    blocks = (-(-N // block[0]), -(-K // block[1]))
    scale_inv = torch.empty(blocks, dtype=torch.float32, device=weight.device)
    module.register_buffer("weight_scale_inv", scale_inv)
    module.fp8_block = tuple(block)


def _densify(module) -> None:
    """Back to a dense weight of the model's dtype, what was placed so far dequantized (the
    values a CPU load makes); dense for good."""
    weight = module.weight
    dense = kernels.fp8_dequantize(
        weight.data, module.weight_scale_inv, module.fp8_block, module.fp8_dtype
    )
    weight.data = dense
    del module.weight_scale_inv
    module.fp8_block, module.fp8_dense = None, True


def _whole_blocks(module, block, dim: int, start: int, length: int, offset: int) -> bool:
    """Whether a placement is whole scale blocks on both sides: its scales then copy as they
    are. A part ending inside a block must end the tensor (the last, partial block)."""
    bn, bk = module.fp8_block
    if tuple(block) != (bn, bk):
        return False
    if dim % 2 == 1:  # columns: every row, from column 0 of the parameter
        return start % bk == 0
    N = module.weight.shape[0]
    return offset % bn == 0 and start % bn == 0 and (length % bn == 0 or offset + length == N)
