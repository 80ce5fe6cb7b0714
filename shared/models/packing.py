"""After loading, the CPU bf16 linears pick their kernel (see layers/cpu_linear.py): where AMX
runs, each layer whose weight fits the AMX kernel is marked for it and keeps its plain weight;
the others have their weight swapped for a oneDNN-packed one. Decoder layers whose linears all
run on AMX then run decode steps in one C call (layers/decode_layer.py)."""

import torch
from torch import nn

from shared.models.layers import cpu_kernels
from shared.models.layers.cpu_linear import PackedLinear
from shared.models.layers.embedding import ParallelLMHead
from shared.models.layers.linear import LinearBase


def prepare_cpu_linears(model: nn.Module) -> None:
    """For a bf16 CPU model: every linear layer and the LM head (an untied one, for oneDNN)."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    amx = cpu_kernels.amx_ready()
    for module in model.modules():
        if not isinstance(module, (LinearBase, ParallelLMHead)):
            continue
        if amx and cpu_kernels.amx_fits(module.weight):
            module.amx = True
        elif isinstance(module, LinearBase) or not tied:
            module.packed = PackedLinear(module.weight.data, getattr(module, "bias", None))
            module.weight = nn.Parameter(
                torch.empty(0, dtype=module.weight.dtype), requires_grad=False
            )
    for module in model.modules():  # decoder stacks whose linears all run on AMX
        if hasattr(module, "prepare_fused_decode"):
            module.prepare_fused_decode()
