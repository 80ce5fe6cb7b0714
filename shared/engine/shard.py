"""What one rank of a worker holds: its model shard (layers of its stage, heads of its TP rank)
and a KV pool for exactly those layers and heads. Page ids are the same on every rank."""

import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from shared.engine.config import EngineConfig
from shared.engine.graphs import scratch_pages
from shared.kv.cache import KVCache
from shared.kv.chunk_cache import GroupedKVCache, chunk_groups, group_slots, layer_groups
from shared.kv.spec import KVSpec, MHAKVSpec, MLAKVSpec
from shared.models.config import ModelConfig
from shared.models.layer_attention import CHUNKED
from shared.models.layers.attention_backend import select_backend
from shared.models.loader import load_model
from shared.parallel.group import TPGroup
from shared.parallel.pipeline import PPStage
from shared.parallel.shape import ParallelConfig
from shared.peer.client import PeerCheckpoint, for_stage
from shared.protocol import KVRankPool

log = logging.getLogger(__name__)


def model_kv_spec(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> KVSpec:
    """The whole model's KV layout (every layer, every head): MLA's latent + RoPE part, or
    MHA's K and V heads."""
    if cfg.mla is not None:
        m = cfg.mla
        return MLAKVSpec(cfg.num_layers, page_size, m.kv_lora_rank, m.qk_rope_head_dim, dtype)
    return MHAKVSpec(cfg.num_layers, page_size, cfg.num_kv_heads, cfg.head_dim, dtype)


def rank_layers(shape: ParallelConfig, rank: int, num_layers: int) -> tuple[int, int]:
    """[first, end) global layers of a rank's stage."""
    stage = shape.stage_of(rank, num_layers)
    return stage.start_layer, num_layers if stage.end_layer is None else stage.end_layer


def model_kv_groups(cfg: ModelConfig, shape: ParallelConfig) -> tuple[int, tuple[int, ...]]:
    """Where chunked layers are capped (shared/kv/chunk_cache.py): R, the chunked page groups,
    and each global layer's page group, every stage's layers laid out on their own."""
    stages = []
    for stage in range(shape.pp):
        first, end = rank_layers(shape, stage * shape.tp, cfg.num_layers)
        stages.append([a.mask.kind == CHUNKED for a in cfg.layer_attention[first:end]])
    groups = chunk_groups(stages)
    return groups, tuple(g for chunked in stages for g in layer_groups(chunked, groups))


def capped_chunk(cfg: ModelConfig) -> int | None:
    """The chunk of the model's chunked layers, which engines that push no KV cap (one chunk
    size among them; None: no chunked layers)."""
    chunks = {a.mask.window for a in cfg.layer_attention if a.mask.kind == CHUNKED}
    return chunks.pop() if len(chunks) == 1 else None


def capped_page_bytes(cfg: ModelConfig, shape: ParallelConfig, layer_page: int) -> list[int]:
    """Each stage's page bytes on a rank where chunked layers are capped: a unit page of its
    layers' layout (model_kv_groups), `layer_page` bytes a layer (the rank's heads)."""
    _, kv_groups = model_kv_groups(cfg, shape)
    bounds = [rank_layers(shape, stage * shape.tp, cfg.num_layers) for stage in range(shape.pp)]
    return [group_slots(kv_groups[first:end])[0] * layer_page for first, end in bounds]


def grouped_config(cfg: ModelConfig, kv_groups: tuple[int, ...]) -> ModelConfig:
    """cfg with each layer's mask keyed by its page group (a metadata of its own each)."""
    layers = tuple(
        replace(a, mask=replace(a.mask, group=g)) for a, g in zip(cfg.layer_attention, kv_groups)
    )
    return replace(cfg, layer_attention=layers)


def rank_kv_spec(spec: KVSpec, shape: ParallelConfig, rank: int) -> KVSpec:
    """What a rank's pool holds: its stage's layers, its TP rank's units (heads)."""
    units = spec.rank_units(rank % shape.tp, shape.tp)
    return spec.shard(rank_layers(shape, rank, spec.num_layers), units)


def rank_pools(
    spec: KVSpec,
    shape: ParallelConfig,
    shm_path: Path | None,
    handles: tuple[bytes, ...] = (),
    kv_groups: tuple[int, ...] = (),
) -> tuple[KVRankPool, ...]:
    """Each rank's layers, units and pool: its file (CPU pools in shared memory), or its CUDA
    IPC handle (GPU pools, `handles` in rank order): a decode worker's KVPool.ranks.
    `kv_groups`: each global layer's page group where chunked layers are capped."""
    pools = []
    for rank in range(shape.world_size):
        first, end = rank_layers(shape, rank, spec.num_layers)
        path = rank_shm_path(shm_path, rank)
        pools.append(
            KVRankPool(
                (first, end),
                spec.rank_units(rank % shape.tp, shape.tp),
                "" if path is None else str(path),
                handles[rank] if handles else b"",
                kv_groups[first:end],
            )
        )
    return tuple(pools)


def rank_shm_path(path: Path | None, rank: int) -> Path | None:
    """Rank 0 keeps the worker's pool path; rank r appends -r<r>."""
    if path is None or rank == 0:
        return path
    return path.with_name(f"{path.name}-r{rank}")


def build_shard(
    config: EngineConfig,
    cfg: ModelConfig,
    tp: TPGroup,
    stage: PPStage,
    num_pages: int,
    rank: int = 0,
    kv_groups: tuple[int, ...] = (),  # capped chunked layers: each global layer's page group
) -> tuple[torch.nn.Module, KVCache]:
    """The model's part and the KV pool of rank `rank` (TP rank tp.rank of stage `stage`)."""
    dtype, device = config.torch_dtype(cfg.torch_dtype), config.rank_device(rank)
    if kv_groups:
        cfg = grouped_config(cfg, kv_groups)
    attention = select_backend(device, dtype, config.attention_backend)  # once, for all layers
    start = time.perf_counter()
    weights = None
    if config.weights_peer:  # only this stage's layers; a TP rank only its slices of them
        weights = PeerCheckpoint(
            config.weights_peer,
            config.kv_secret.encode(),
            for_stage(stage),
            read_timeout_s=config.weights_timeout_s,
            sliced=tp.size > 1,
        )
    model = load_model(
        config.model_dir, cfg, dtype, tp, stage, device, attention, weights,
        config.resident_codec, fused_decode=config.decode_graphs != "off",
    )  # fmt: skip
    loaded = time.perf_counter()
    source = f"from {weights.source}" if weights is not None else "from disk"
    fused = getattr(getattr(model, "model", None), "fused", None)  # decode_layer.py's
    log.info(
        "rank %d: model loaded %s in %.2f s (attention: %s; decode steps %s)",
        rank, source, loaded - start, attention.name,
        "op by op" if fused is None else f"in one call, {len(fused.masks)} mask(s)",
    )  # fmt: skip
    spec = rank_kv_spec(model_kv_spec(cfg, config.page_size, dtype), config.parallel, rank)
    shm = rank_shm_path(config.kv_shm_path, rank)
    # rank 0's pool may stay in process memory where /dev/shm has no room for it (the
    # worker's KV servers write into it in-process); other ranks' pools are theirs to share
    optional = rank == 0
    capped = ""
    if not kv_groups:  # with decode graphs, the padded rows' scratch page too
        pages = num_pages + scratch_pages(config.uses_graphs)
        kv = KVCache(spec, pages, shm, device, optional)
    else:
        first, end = rank_layers(config.parallel, rank, cfg.num_layers)  # the stage's layers
        kv = GroupedKVCache(spec, kv_groups[first:end], num_pages, device, shm, optional)
        slots = kv.spec.num_layers
        capped = (
            f", chunked layers capped: pages of {slots} layer{'s' * (slots != 1)}, "
            f"{max(kv_groups)} chunked groups"
        )
    log.info(
        "rank %d: KV pool of %d pages%s (%.0f MiB) in %.2f s",
        rank,
        num_pages,
        capped,
        kv.nbytes / 2**20,
        time.perf_counter() - loaded,
    )
    return model, kv
