"""bfloat16 matmuls on CPU. Decode-sized inputs (up to linear_max_rows() rows; on avx2, whose
outer-product kernel beats the float32 fallback below, prefill chunks up to 512 too) run in our
kernel on the plain weight (kernels/cpu/linear.py: AMX tiles or the vector units of the CPU's
tier), which streams the weight at near the memory bandwidth where oneDNN's small-batch kernels
reach two thirds of it. Larger inputs (prefill) go to F.linear: oneDNN's bf16 kernel where the
tier has bf16 arithmetic (avx512_bf16, amx), else a float32 matmul on the weight widened for
the call (torch's own bf16 fallback is ~2.5x slower than that, oneDNN's on plain AVX-512 ~2.5x
too). A weight our kernel cannot take is packed once for oneDNN where it runs bf16 (~1.3-2x
faster than plain F.linear, bit for bit)."""

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import isa
from kernels.cpu.linear import linear_bf16, linear_max_rows


@cache
def onednn_bf16() -> bool:
    """Whether Tison runs bf16 matmuls in oneDNN here: the tier has bf16 arithmetic
    (avx512_bf16 or amx) and torch agrees. On plain AVX-512 oneDNN runs them too, but widens
    in its loops: 512-row prefill linears of the bench model ran at 38-75 GFLOP/s, packed or
    not, where float32 on the weight widened for the call ran at 164-190 (a Zen 4 capped to
    avx512, 2 threads), so that tier widens as AVX2 does."""
    return isa.at_least("avx512_bf16") and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """y = x W^T (+ b) with W in oneDNN's blocked layout. (T, in) -> (T, out)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not x.is_contiguous():
            x = x.reshape(-1, self.in_features).contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def linear(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear, through the packed weight when the module has one, through our kernel when the
    module is marked `c_linear` (see packing.py) and x has few rows. x (T, in) -> (T, out)."""
    packed = getattr(module, "packed", None)
    if packed is not None:
        return packed(x)
    if getattr(module, "c_linear", False) and x.dim() == 2:
        if x.shape[0] <= linear_max_rows():
            return linear_bf16(x, weight, bias)
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and not onednn_bf16():
        wide_bias = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), wide_bias).to(x.dtype)
    return F.linear(x, weight, bias)
