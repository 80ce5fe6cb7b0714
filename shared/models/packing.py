"""After loading, the CPU bf16 linears pick their kernel (see layers/cpu_linear.py): first each
MLP whose intermediate size (a TP rank's share) the C linear cannot take as an input is padded
with zeros to one it takes (dense, routed experts, shared expert: the same numbers out); then
each layer whose weight our C linear takes is marked `c_linear` and keeps its plain weight;
where oneDNN has bf16, the others have their weight swapped for a oneDNN-packed one; the
experts of a MoE layer are marked when every expert's matrices fit (their few-row matmuls then
read only the active experts). Decoder layers whose linears are all marked then run decode
steps in one C call (layers/decode_layer.py)."""

import torch
from torch import nn

from kernels.cpu import library
from kernels.cpu.linear import LINEAR_K_ALIGN, linear_fits
from shared.models.layers import cpu_linear, fp8_weights
from shared.models.layers.embedding import ParallelLMHead
from shared.models.layers.linear import LinearBase
from shared.models.layers.moe import FusedMoE


def prepare_cpu_linears(model: nn.Module, fused_decode: bool = True) -> None:
    """For a bf16 CPU model: every linear layer and the LM head (an untied one, for oneDNN);
    then, with fused_decode, the decoder stacks' fused decode call."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    kernels = library.usable(torch.zeros(1, dtype=torch.bfloat16))
    onednn = cpu_linear.onednn_bf16()
    if kernels:
        for module in model.modules():
            if hasattr(module, "fused_parts"):  # a dense MLP, a shared expert among them
                pad_intermediate(**module.fused_parts())
            if isinstance(module, FusedMoE):
                pad_experts(module)
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
        if fused_decode and hasattr(module, "prepare_fused_decode"):
            module.prepare_fused_decode()


def pad_intermediate(gate_up=None, down=None, **routed) -> None:
    """A dense SwiGLU MLP whose intermediate size I the C linear cannot take as down's input
    features (not a multiple of LINEAR_K_ALIGN: the bundled model's 688) gets it padded to the
    next multiple: zero rows at the end of gate's and of up's halves of gate_up (whose outputs
    there are 0, and silu(0) * 0 = 0) and zero columns at the end of down, which meet those
    zeros. The outputs are the same numbers; every linear then runs on the C linear, and decode
    steps in one call (layers/decode_layer.py). gate_up (2I, H), down (H, I): one TP rank's."""
    if gate_up is None or down is None or resident(gate_up) or resident(down):
        return  # routed experts (their own matrices), or weights decoded anew before each use
    size = down.weight.shape[1]
    padded = _aligned(size)
    if padded == size or down.weight.dtype != torch.bfloat16 or gate_up.weight.shape[0] != 2 * size:
        return
    if gate_up.bias is not None:  # no family's SwiGLU has one (nor does the fused call)
        return
    _replace(gate_up, "weight", _halves_padded(gate_up.weight.data, padded))
    _replace(down, "weight", _columns_padded(down.weight.data, padded))


def pad_experts(experts: FusedMoE) -> None:
    """Routed experts whose intermediate size I (one TP rank's share) is not a multiple of
    LINEAR_K_ALIGN, padded as pad_intermediate pads a dense MLP: zero rows at the end of each
    expert's gate and up halves of w13 (E, 2I, H) and zero columns at the end of its w2
    (E, H, I). The outputs are the same numbers; the experts then run on the C linear, and
    their layers' decode steps in one call (a Mixtral of I 14336 at tp=16: 896 a rank, fine;
    the tests' tiny experts of 32 at tp=2: 16, padded to 32). After loading: the weight
    loaders place the unpadded share."""
    w13, w2 = experts.w13, experts.w2
    if resident(experts) or w2.dtype != torch.bfloat16:
        return
    padded = _aligned(w2.shape[2])
    if padded == w2.shape[2]:
        return
    _replace(experts, "w13", _halves_padded(w13.data, padded))
    _replace(experts, "w2", _columns_padded(w2.data, padded))


def _aligned(size: int) -> int:
    """The C linear's next input size from size on."""
    return -(-size // LINEAR_K_ALIGN) * LINEAR_K_ALIGN


def _halves_padded(t: torch.Tensor, padded: int) -> torch.Tensor:
    """t (..., 2I, C): gate rows, then up rows -> (..., 2 * padded, C), zero rows after each
    half."""
    *lead, rows, cols = t.shape
    wide = t.new_zeros(*lead, 2, padded, cols)
    wide[..., : rows // 2, :] = t.view(*lead, 2, rows // 2, cols)
    return wide.view(*lead, 2 * padded, cols)


def _columns_padded(t: torch.Tensor, padded: int) -> torch.Tensor:
    """t (..., R, I) -> (..., R, padded), zero columns after I."""
    wide = t.new_zeros(*t.shape[:-1], padded)
    wide[..., : t.shape[-1]] = t
    return wide


def _replace(module: nn.Module, name: str, data: torch.Tensor) -> None:
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = getattr(module, name).weight_loader
    setattr(module, name, param)


def resident(module: nn.Module) -> bool:
    """Whether the module's weight stays encoded (models/resident.py): it is decoded anew into
    shared scratch before each use, so no packed copy of it could stay right."""
    weights = (module.w13, module.w2) if isinstance(module, FusedMoE) else (module.weight,)
    return any(getattr(w, "resident", False) for w in weights)
