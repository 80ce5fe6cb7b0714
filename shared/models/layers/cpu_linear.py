"""bfloat16 matmuls on CPU. Where the CPU has AMX, decode-sized inputs (up to AMX_MAX_ROWS
rows) run in our AMX kernel on the plain weight (amx_linear.c), which reads weights ~1.4x faster
than oneDNN at 1-32 rows; larger inputs (prefill) go to F.linear, whose oneDNN kernel packs the
weight on the fly. Elsewhere, oneDNN's prepacked layout runs the decode GEMMs ~1.3-2x faster
than plain F.linear, bit for bit: the packed tensor replaces the plain one, once, after loading."""

import torch
import torch.nn.functional as F
from torch import nn

from shared.models.layers import cpu_kernels

AMX_MAX_ROWS = 256  # measured: above this oneDNN's large-M kernel is the faster one


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype == torch.bfloat16 and device.type == "cpu" and torch.backends.mkldnn.is_available()


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
    """F.linear, through the packed weight when the module has one, through the AMX kernel when
    the module is marked `amx` (see packing.py) and x has few rows. x (T, in) -> (T, out)."""
    packed = getattr(module, "packed", None)
    if packed is not None:
        return packed(x)
    if getattr(module, "amx", False) and x.dim() == 2 and x.shape[0] <= AMX_MAX_ROWS:
        return cpu_kernels.linear_bf16(x, weight, bias)
    return F.linear(x, weight, bias)
