"""After loading: swap bf16 CPU weights for oneDNN-packed ones (see layers/cpu_pack.py)."""

import torch
from torch import nn

from shared.models.layers.cpu_pack import PackedLinear
from shared.models.layers.embedding import ParallelLMHead
from shared.models.layers.linear import LinearBase


def pack_linears(model: nn.Module) -> None:
    """Packs the weight of every linear layer (and an untied LM head) of a bf16 CPU model."""
    for module in model.modules():
        tied = isinstance(module, ParallelLMHead) and getattr(
            model.config, "tie_word_embeddings", False
        )
        if isinstance(module, LinearBase) or (isinstance(module, ParallelLMHead) and not tied):
            module.packed = PackedLinear(module.weight.data, getattr(module, "bias", None))
            module.weight = nn.Parameter(
                torch.empty(0, dtype=module.weight.dtype), requires_grad=False
            )
