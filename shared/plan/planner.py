"""`tison plan`'s policy: from a model's config to the worker shapes that fit N devices, each
shape's per-device weights, KV room, tokens and concurrency, the fewest devices that fit, and
a prefill and a decode shape to suggest. Every byte comes from shared/engine/footprint.py (the
engine's own modules, built on the meta device), so the engine started with a memory budget
allocates the pool this predicts."""

from dataclasses import dataclass, field

import torch

from shared.engine.footprint import RankFootprint, pages_for_memory, stage_footprints
from shared.engine.shard import capped_chunk, capped_page_bytes, model_kv_spec, rank_kv_spec
from shared.models.config import ModelConfig
from shared.parallel.shape import ParallelConfig


@dataclass(frozen=True)
class ShapePlan:
    """One worker shape on `devices` devices of `memory` bytes each."""

    shape: ParallelConfig
    weight_bytes: int  # the heaviest device's parameters and buffers
    reserve: int  # per device, held back for activations and workspaces
    kv_bytes: int  # left for KV over all devices
    # tokens that fit (a token takes a slot on every stage and TP rank, of one data-parallel
    # rank)
    kv_tokens: int
    kv_token_bytes: int  # bytes a token takes over all devices (MLA's latent: on each TP rank)
    max_concurrency: int  # sequences of `context` tokens that fit at once
    # the pool an engine with this budget allocates: pages of every layer's KV, or where it
    # caps chunked layers (LLM, decode workers) unit pages (shared/kv/chunk_cache.py)
    engine_pages: int
    stages: list[RankFootprint] = field(repr=False, default_factory=list)

    @property
    def devices(self) -> int:
        return self.shape.world_size

    @property
    def fits(self) -> bool:
        return self.max_concurrency >= 1

    @property
    def label(self) -> str:
        s = self.shape
        return (
            f"tp={s.tp} pp={s.pp}" + (" ep" if s.ep else "") + (f" dp={s.dp}" if s.dp > 1 else "")
        )


def candidate_shapes(cfg: ModelConfig, devices: int) -> list[ParallelConfig]:
    """Every (tp, pp, ep) of `devices` ranks the engine accepts for this model: tp divides the
    heads (and KV heads divide it or it them), pp at most the layers, ep where tp divides the
    experts; and for a MoE model, data-parallel attention over all of them (dp) where they
    divide the experts."""
    shapes = []
    for tp in range(1, devices + 1):
        pp = devices // tp
        if devices % tp or cfg.num_heads % tp or pp > cfg.num_layers:
            continue
        if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
            continue
        shapes.append(ParallelConfig(tp=tp, pp=pp, allow_oversubscribe=True))
        if cfg.num_experts and tp > 1 and cfg.num_experts % tp == 0:
            shapes.append(ParallelConfig(tp=tp, pp=pp, allow_oversubscribe=True, ep=True))
    if cfg.num_experts and devices > 1 and cfg.num_experts % devices == 0:
        shapes.append(ParallelConfig(dp=devices, allow_oversubscribe=True))
    return shapes


def plan_shape(
    cfg: ModelConfig,
    shape: ParallelConfig,
    memory: int,
    reserve: int,
    dtype: torch.dtype,
    context: int,
    page_size: int = 16,
    packed: bool = True,
) -> ShapePlan:
    """A shape's figures. What the weights and the reserve leave a device is its KV room; a
    token takes the growing part of its stage's layers on each device of the stage (MLA: the
    whole latent on every TP rank), windowed layers at most their window a sequence, and the
    stage with the least room per token bounds the tokens and the sequences; data-parallel
    ranks each hold tokens and sequences of their own. packed: quantized linears as stored
    (GPU kernels), else dequantized (the CPU engine)."""
    stages = stage_footprints(cfg, shape, dtype, page_size, packed)
    room = [max(0, memory - fp.weight_bytes - reserve) for fp in stages]  # per device
    tokens = min(r // fp.kv.growing if fp.kv.growing else 0 for r, fp in zip(room, stages))
    sequences = min(r // fp.kv.per_sequence(context) for r, fp in zip(room, stages))
    return ShapePlan(
        shape=shape,
        weight_bytes=max(fp.weight_bytes for fp in stages),
        reserve=reserve,
        kv_bytes=shape.dp * shape.tp * sum(room),
        kv_tokens=shape.dp * tokens,
        kv_token_bytes=shape.tp * sum(fp.kv.growing for fp in stages),
        max_concurrency=shape.dp * sequences,
        engine_pages=_engine_pages(cfg, shape, dtype, page_size, stages, memory, reserve),
        stages=stages,
    )


def _engine_pages(cfg, shape, dtype, page_size, stages, memory: int, reserve: int) -> int:
    """The engine's pool under this budget (pool_size.py's pool_pages)."""
    page_bytes = None
    if capped_chunk(cfg) is not None:
        rank0 = rank_kv_spec(model_kv_spec(cfg, page_size, dtype), shape, 0)
        page_bytes = capped_page_bytes(cfg, shape, rank0.page_size_bytes // rank0.num_layers)
    return pages_for_memory(stages, memory, reserve, page_size, page_bytes)


def plan_devices(
    cfg: ModelConfig, devices: int, memory: int, reserve: int, dtype, context: int,
    packed: bool = True,
) -> list[ShapePlan]:  # fmt: skip
    """Every candidate shape on `devices` devices, feasible or not."""
    return [
        plan_shape(cfg, shape, memory, reserve, dtype, context, packed=packed)
        for shape in candidate_shapes(cfg, devices)
    ]


def fewest_devices(
    cfg: ModelConfig, weight_bytes: int, memory: int, reserve: int, dtype, context: int,
    concurrency: int = 1, packed: bool = True, most: int = 64,
) -> tuple[int, list[ShapePlan]] | None:  # fmt: skip
    """The fewest devices (up to `most`) on which some shape fits `concurrency` sequences of
    `context` tokens, and every shape's plan on them. Counts below the model's `weight_bytes`
    (all of it, on one device) over the room of a device are skipped unplanned."""
    least = max(1, -(-weight_bytes // max(1, memory - reserve)))
    for n in range(least, most + 1):
        plans = plan_devices(cfg, n, memory, reserve, dtype, context, packed)
        if any(p.max_concurrency >= concurrency for p in plans):
            return n, plans
    return None


def suggest(
    plans: list[ShapePlan], concurrency: int = 1
) -> tuple[ShapePlan | None, ShapePlan | None]:
    """(prefill, decode) among the plans that fit `concurrency` sequences. Prefill is
    compute-bound: the most tensor parallelism (every device works on every token's layer),
    then the most KV. Decode is memory-bound: the most KV tokens (concurrency: data-parallel
    attention's, for MLA, whose latent TP ranks each hold whole), then the most tensor
    parallelism (each device reads 1/tp of the weights a step)."""
    feasible = [p for p in plans if p.max_concurrency >= concurrency]
    if not feasible:
        return None, None
    prefill = max(feasible, key=lambda p: (p.shape.tp, p.kv_tokens, p.shape.ep))
    decode = max(feasible, key=lambda p: (p.kv_tokens, p.shape.tp, p.shape.ep))
    return prefill, decode
