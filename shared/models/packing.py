"""After loading, the CPU bf16 linears pick their kernel (see layers/cpu_linear.py): each layer
whose weight our C linear takes is marked `c_linear` and keeps its plain weight; where oneDNN
has bf16, the others have their weight swapped for a oneDNN-packed one; the experts of a MoE
layer are marked when every expert's matrices fit (their few-row matmuls then read only the
active experts). Decoder layers whose linears are all marked then run decode steps in one C
call (layers/decode_layer.py)."""

import torch
from torch import nn

from kernels.cpu import library
from kernels.cpu.linear import linear_fits
from shared.models.layers import cpu_linear, fp8_weights
from shared.models.layers.embedding import ParallelLMHead
from shared.models.layers.linear import LinearBase
from shared.models.layers.moe import FusedMoE


def prepare_cpu_linears(model: nn.Module) -> None:
    """For a bf16 CPU model: every linear layer and the LM head (an untied one, for oneDNN)."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    kernels = library.usable(torch.zeros(1, dtype=torch.bfloat16))
    onednn = cpu_linear.onednn_bf16()
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.c_linear = kernels and linear_fits(module.w13[0]) and linear_fits(module.w2[0])
        if not isinstance(module, (LinearBase, ParallelLMHead)) or fp8_weights.keeps(module):
            continue  # (FP8 bytes on a CPU: only the tests' emulated GPU path)
        if kernels and linear_fits(module.weight):
            module.c_linear = True
        elif onednn and (isinstance(module, LinearBase) or not tied) and not resident(module):
            module.packed = cpu_linear.PackedLinear(
                module.weight.data, getattr(module, "bias", None)
            )
            module.weight = nn.Parameter(
                torch.empty(0, dtype=module.weight.dtype), requires_grad=False
            )
    for module in model.modules():  # decoder stacks whose linears all take the C linear
        if hasattr(module, "prepare_fused_decode"):
            module.prepare_fused_decode()


def resident(module: nn.Module) -> bool:
    """Whether the module's weight stays encoded (models/resident.py): it is decoded anew into
    shared scratch before each use, so no packed copy of it could stay right."""
    return getattr(module.weight, "resident", False)
