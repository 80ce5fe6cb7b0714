"""Resident compressed weights (EngineConfig.resident_codec): the linear weights of every
decoder layer (attention qkv and o, MLP gate_up and down, MoE routers and experts) stay encoded
on the model's device as the codec's planes (shared/codec/) and are decoded just before their
layer runs into a scratch buffer that all layers share, one per weight slot (its name in the
layer, shape and dtype). A model's weights then take about their compressed size plus one
layer decoded.

Two steps around the ordinary load (loader.py's load_model):
- before it, `ResidentWeights(model, checkpoint, targets)` points each such parameter at its
  slot's scratch, so load_weights, through the layers' own weight_loaders and checks, decodes
  every tensor once (its CRC-32C checked) into scratch that the next layer overwrites;
- after it, `attach` reads each tensor's planes (CompressedCheckpoint.get_encoded: checked
  against their CRC-32C) and wraps each layer in a ResidentLayer whose FixedDecode writes them
  into the block of the scratch its weight_loader filled (`destination`), before the layer.

Why a wrapper rather than a forward pre-hook: the decode is a module of the tree (printed,
profiled, found by `weight_bytes`), its state has one owner, and a wrapped layer has no fused
decode spec, so decode_layer.c, which reads every layer's weights in one call, never runs over
weights that exist a layer at a time. One rank only (EngineConfig refuses more)."""

import importlib.util
from dataclasses import dataclass

import torch
from torch import nn

from shared.codec import CompressedCheckpoint
from shared.codec.format import DTYPES_BY_NAME
from shared.codec.resident import FixedDecode
from shared.errors import InvalidRequestError
from shared.models.layers.cpu_linear import PackedLinear
from shared.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from shared.models.layers.moe import DOWN, GATE, GATE_UP, UP, FusedMoE

FIELD = "resident_codec"
_WHOLE = (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear)  # one tensor, whole
_LINEARS = (*_WHOLE, MergedColumnParallelLinear, QKVParallelLinear)


def destination(module: nn.Module, param: torch.Tensor, shard_id) -> torch.Tensor | None:
    """The block of `param` (a linear's weight, a FusedMoE's w13 or w2) that the checkpoint
    tensor of `shard_id` fills on one rank, as the module's weight_loader places it; None
    where that is no block of rows (Llama 4's transposed experts: loaded as usual)."""
    kind = type(module)
    if kind is QKVParallelLinear:
        q, kv = module.num_heads * module.head_dim, module.num_kv_heads * module.head_dim
        start, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        return param.narrow(0, start, size)
    if kind is MergedColumnParallelLinear:
        sizes = module.output_sizes
        return param.narrow(0, sum(sizes[:shard_id]), sizes[shard_id])
    if kind is FusedMoE:
        expert, part = shard_id
        if expert is None:  # every expert's, stacked as w13 (gate rows, then up) or w2
            return param if part in (GATE_UP, DOWN) else None
        rows, size = param[expert], module.intermediate_size  # (2I, H) or (H, I)
        blocks = {GATE: (0, size), UP: (size, size)}
        return rows if part == DOWN else rows.narrow(0, *blocks[part]) if part in blocks else None
    return param if kind in _WHOLE and shard_id is None else None


class ResidentLayer(nn.Module):
    """A decoder layer whose linear weights stay encoded: each forward first decodes them into
    the scratch its linears read (`weights`), then runs the layer unchanged."""

    def __init__(self, layer: nn.Module, weights: FixedDecode):
        super().__init__()
        self.layer, self.weights = layer, weights

    def forward(self, *args, **kwargs):
        self.weights()
        return self.layer(*args, **kwargs)

    def decode_spec(self) -> None:
        """Never fused (LlamaModel.prepare_fused_decode): decode_layer.c runs all layers in one
        call, over weights that here exist one layer at a time."""
        return None


class ResidentWeights:
    """Made before load_weights (it points each resident parameter at its slot's scratch),
    attached after it (it reads the planes and wraps the layers). targets: checkpoint name ->
    (our parameter, its weight_loader's shard id), loader.py's _targets."""

    def __init__(self, model: nn.Module, checkpoint, targets: dict[str, tuple[str, object]]):
        if not isinstance(checkpoint, CompressedCheckpoint):
            raise InvalidRequestError(
                FIELD, "needs a compressed folder on disk (tison compress), not quantized"
            )
        device = next(model.parameters()).device
        if device.type == "cuda" and importlib.util.find_spec("cupy") is None:
            raise InvalidRequestError(
                FIELD, "decoding on a GPU needs cupy (pip install cupy-cuda12x), not installed"
            )
        parts: dict[str, list[tuple[str, object]]] = {}  # parameter -> (stored name, shard id)
        for stored, (target, shard_id) in targets.items():
            parts.setdefault(target, []).append((stored, shard_id))
        # layer index -> (stored name, module, attribute, shard id) of its resident tensors
        self._layers: dict[int, list[tuple[str, nn.Module, str, object]]] = {}
        scratch: dict[tuple, torch.Tensor] = {}  # (name in the layer, shape, dtype) -> buffer
        for name, (index, module, attr, slot) in _slots(model).items():
            param, stored = getattr(module, attr), parts.get(name, [])
            if not stored or not all(_fits(checkpoint, s, module, param, i) for s, i in stored):
                continue
            key = (slot, tuple(param.shape), param.dtype)
            buffer = scratch.setdefault(key, param.data)  # the first layer's own storage
            shared = nn.Parameter(buffer, requires_grad=False)
            shared.weight_loader = param.weight_loader
            shared.resident = True  # packing.py: never repacked for oneDNN; weight_bytes
            setattr(module, attr, shared)
            self._layers.setdefault(index, []).extend((s, module, attr, i) for s, i in stored)
        if not self._layers:
            raise InvalidRequestError(FIELD, "the checkpoint has no linear weight it can keep")

    def attach(self, model: nn.Module, checkpoint: CompressedCheckpoint) -> None:
        """After load_weights: wraps each layer in a ResidentLayer decoding its planes."""
        layers = model.model.layers
        for index, stored in self._layers.items():
            pairs = [
                (checkpoint.get_encoded(name), destination(module, getattr(module, attr), shard))
                for name, module, attr, shard in stored
            ]
            layers[index] = ResidentLayer(layers[index], FixedDecode(pairs))


def _slots(model: nn.Module) -> dict[str, tuple[int, nn.Module, str, str]]:
    """Full parameter name -> (layer index, module, attribute, name in the layer) of each
    parameter that may stay encoded: the weights of the decoder layers' linears and experts."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise InvalidRequestError(FIELD, f"{type(model).__name__} has no decoder layers")
    slots = {}
    for index, layer in enumerate(layers):
        for path, module in layer.named_modules():
            attrs: tuple[str, ...] = ()
            if type(module) in _LINEARS:
                attrs = ("weight",)
            elif type(module) is FusedMoE and module.ep is None:
                attrs = ("w13", "w2")
            for attr in attrs:
                slot = f"{path}.{attr}"
                slots[f"model.layers.{index}.{slot}"] = (index, module, attr, slot)
    return slots


def _fits(checkpoint, stored: str, module: nn.Module, param: torch.Tensor, shard_id) -> bool:
    """Whether the stored tensor decodes straight into its block of `param`; a different
    dtype is refused (decoding converts nothing)."""
    dtype_name, shape = checkpoint.meta(stored)
    block = destination(module, param, shard_id)
    if block is None or tuple(block.shape) != shape or not block.is_contiguous():
        return False  # loaded as usual; a wrong shape fails there, naming the tensor
    stored_dtype = DTYPES_BY_NAME.get(dtype_name)
    if stored_dtype != param.dtype:
        named = str(stored_dtype).removeprefix("torch.")
        raise InvalidRequestError(
            "dtype",
            f"resident_codec decodes weights in the dtype they are stored in: {stored} is "
            f"{named}, the model would run in {str(param.dtype).removeprefix('torch.')} "
            f"(run it in {named})",
        )
    return True


@dataclass(frozen=True)
class WeightBytes:
    """What a model's weights take on its device."""

    encoded: int  # the resident weights' planes (raw data where the codec kept a tensor raw)
    scratch: int  # the decoded buffers the resident weights share (one layer's)
    other: int  # every other parameter (embeddings, norms, LM head), oneDNN-packed ones too

    @property
    def total(self) -> int:
        return self.encoded + self.scratch + self.other


def weight_bytes(model: nn.Module) -> WeightBytes:
    """The bytes of each kind, each storage counted once (tied and shared ones too)."""
    storages: dict[int, tuple[int, bool]] = {}  # address -> (bytes, a resident weight's)
    encoded = packed = 0
    for module in model.modules():
        if isinstance(module, ResidentLayer):
            encoded += module.weights.nbytes()
        if isinstance(module, PackedLinear):  # an opaque oneDNN tensor: no storage to share
            packed += module.packed.numel() * module.packed.element_size()
        for param in module.parameters(recurse=False):
            storage = param.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes(), getattr(param, "resident", False)
    scratch = sum(n for n, resident in storages.values() if resident)
    other = sum(n for n, resident in storages.values() if not resident)
    return WeightBytes(encoded, scratch, other + packed)
