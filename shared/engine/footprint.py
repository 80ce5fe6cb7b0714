"""What one rank of a worker holds, from config.json alone: its model shard built on the meta
device (the very modules the engine loads, no memory, no weights), their bytes by component,
and the KV bytes its pool takes per token. `tison plan` and the engine's start-up (a memory
budget: shared/engine/engine.py) read the same figures.

Quantized checkpoints (FP8 block-scaled, INT4 group-32) count as the engine holds them: on CPU
dequantized to the engine's dtype at load; `packed=True` counts them as GPU kernels keep them
(the packed values and their scales), for planning GPU deployments."""

from dataclasses import dataclass

import torch

from shared.engine.shard import model_kv_spec, rank_kv_spec
from shared.models.config import ModelConfig
from shared.models.layer_attention import CHUNKED, SLIDING
from shared.models.layers.attention_backend import TorchBackend
from shared.models.quant.scheme import QuantScheme, read_scheme
from shared.models.registry import model_class
from shared.parallel.group import TPGroup
from shared.parallel.shape import ParallelConfig

# components, in the order tables list them; component_of names each parameter's
EMBEDDING, ATTENTION, MLP, EXPERTS, SHARED_EXPERTS, ROUTER, NORMS, LM_HEAD = (
    "embedding", "attention", "dense MLP", "routed experts", "shared experts", "router",
    "norms", "lm_head",
)  # fmt: skip
COMPONENTS = (EMBEDDING, ATTENTION, MLP, EXPERTS, SHARED_EXPERTS, ROUTER, NORMS, LM_HEAD)


def component_of(name: str) -> str:
    """The component a parameter (or buffer) of our models belongs to, by its name."""
    if name.startswith("model.embed_tokens"):
        return EMBEDDING
    if name.startswith("lm_head"):
        return LM_HEAD
    if "norm" in name.rsplit(".", 2)[-2]:  # input_layernorm, q_a_layernorm, model.norm, ...
        return NORMS
    if ".experts." in name:
        return EXPERTS
    if ".shared_expert" in name:  # shared_expert (Llama 4), shared_experts (DeepSeek)
        return SHARED_EXPERTS
    if ".mlp.gate." in name or ".mlp.router." in name:
        return ROUTER
    if ".self_attn." in name:
        return ATTENTION
    return MLP


@dataclass(frozen=True)
class KVPerToken:
    """KV bytes one rank's pool takes per token: `growing` for every token of a sequence (its
    global layers), `windowed` for each of the last `window` tokens only (sliding-window and
    Llama 4's chunked layers, capped at their window)."""

    growing: int
    windowed: int = 0
    window: int = 0

    def per_sequence(self, context: int) -> int:
        """Bytes of one sequence of `context` tokens."""
        return self.growing * context + self.windowed * min(context, self.window)


@dataclass(frozen=True)
class RankFootprint:
    rank: int
    layers: tuple[int, int]  # [first, end) global layers of its stage
    by_component: dict[str, int]  # bytes of parameters and buffers
    by_format: dict[str, int]  # the same bytes by stored format (dtype name, or int4)
    parameters: int  # their count (parameters only)
    kv: KVPerToken

    @property
    def weight_bytes(self) -> int:
        return sum(self.by_component.values())


def rank_footprint(
    cfg: ModelConfig,
    shape: ParallelConfig,
    rank: int,
    dtype: torch.dtype,
    page_size: int = 16,
    packed: bool = False,
) -> RankFootprint:
    """Rank `rank`'s shard of a worker of `shape`, as the engine builds it (packed: its
    quantized linears as stored, see the module's docstring)."""
    stage = shape.stage_of(rank, cfg.num_layers)
    experts = TPGroup(shape.dp_rank(rank), shape.dp) if shape.dp > 1 else None
    tp = TPGroup(rank % shape.tp, shape.tp, expert_parallel=shape.ep, experts=experts)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, dtype, tp, stage, TorchBackend())
    scheme = read_scheme(cfg.raw) if packed else None
    by_component = dict.fromkeys(COMPONENTS, 0)
    by_format: dict[str, int] = {}
    params = list(model.named_parameters(remove_duplicate=True))
    for name, tensor in [*params, *model.named_buffers()]:
        component = component_of(name)
        stored = scheme and component in _LINEARS and stored_bytes(name, tensor, scheme)
        if not stored:
            stored = {
                str(tensor.dtype).removeprefix("torch."): tensor.numel() * tensor.element_size()
            }
        by_component[component] += sum(stored.values())
        for fmt, n in stored.items():
            by_format[fmt] = by_format.get(fmt, 0) + n
    count = sum(t.numel() for _, t in params)
    layers = (stage.start_layer, cfg.num_layers if stage.end_layer is None else stage.end_layer)
    kv = kv_per_token(cfg, shape, rank, dtype, page_size)
    return RankFootprint(rank, layers, by_component, by_format, count, kv)


_LINEARS = (ATTENTION, MLP, EXPERTS, SHARED_EXPERTS)  # components a checkpoint may quantize
# our merged or stacked parameter -> (a checkpoint linear it holds, how many equal ones: the
# block rounding of fp8 scales is per linear; q, k and v count as one)
_STORED_AS = {
    "qkv_proj": ("q_proj", 1),
    "gate_up_proj": ("gate_proj", 2),
    "experts.w13": ("experts.0.gate_proj", 2),
    "experts.w2": ("experts.0.down_proj", 1),
}


def stored_bytes(name: str, tensor: torch.Tensor, scheme: QuantScheme) -> dict[str, int] | None:
    """Bytes of a linear's weight as its quantized checkpoint stores it, by stored format
    (QuantScheme.stored_bytes); None when the scheme
    leaves that linear unquantized (or the parameter is no linear's weight). Stacked experts
    count as that many experts' linears."""
    if tensor.dim() < 2:
        return None
    module, parts = name.removesuffix(".weight"), 1
    for ours, (stored, count) in _STORED_AS.items():
        if module.endswith(ours):
            module, parts = module.removesuffix(ours) + stored, count
            break
    if not scheme.quantizes(module):
        return None
    experts = tensor.shape[0] if tensor.dim() == 3 else 1
    out, inputs = tensor.shape[-2], tensor.shape[-1]
    each = scheme.stored_bytes(out // parts, inputs)
    return {fmt: experts * parts * n for fmt, n in each.items()}


def kv_per_token(
    cfg: ModelConfig, shape: ParallelConfig, rank: int, dtype: torch.dtype, page_size: int = 16
) -> KVPerToken:
    """From the engine's own KV spec (shard.py): the rank's layers and units (heads, or MLA's
    whole latent), layers with a window or chunk capped at it (their largest; at most one
    window size among a model's layers today)."""
    spec = rank_kv_spec(model_kv_spec(cfg, page_size, dtype), shape, rank)
    first = shape.stage_of(rank, cfg.num_layers).start_layer
    growing = windowed = window = 0
    for local in range(spec.num_layers):
        mask = cfg.layer_attention[first + local].mask
        if mask.kind in (SLIDING, CHUNKED):
            windowed += spec.layer_token_bytes(local)
            window = max(window, mask.window)
        else:
            growing += spec.layer_token_bytes(local)
    return KVPerToken(growing, windowed, window)


def stage_footprints(
    cfg: ModelConfig,
    shape: ParallelConfig,
    dtype: torch.dtype,
    page_size: int = 16,
    packed: bool = False,
) -> list[RankFootprint]:
    """The footprint of each stage's TP rank 0, in stage order. Every TP rank of a stage holds
    as many bytes: heads, experts and the vocabulary are split evenly (the last vocabulary
    shard padded), the rest replicated."""
    return [
        rank_footprint(cfg, shape, s * shape.tp, dtype, page_size, packed) for s in range(shape.pp)
    ]


def pages_for_memory(
    footprints: list[RankFootprint],
    memory: int,
    reserve: int,
    page_size: int,
    page_bytes: list[int] | None = None,
) -> int:
    """KV pages a worker's pool takes when each rank may hold `memory` bytes: its weights, the
    `reserve` (activations, workspaces) and its part of the pool. A page holds every layer's
    KV of page_size tokens, or `page_bytes` (each stage's, in stage order: unit pages of
    capped chunked layers, shared/kv/chunk_cache.py). Page ids are the same on every rank, so
    the rank with the least room decides."""
    if page_bytes is None:
        page_bytes = [page_size * (fp.kv.growing + fp.kv.windowed) for fp in footprints]
    return min(
        max(0, memory - fp.weight_bytes - reserve) // each
        for fp, each in zip(footprints, page_bytes, strict=True)
    )
