"""What one rank of a worker holds: its model shard (layers of its stage, heads of its TP rank)
and a KV pool for exactly those layers and heads. Page ids are the same on every rank."""

import logging
import time
from pathlib import Path

import torch

from shared.engine.config import EngineConfig
from shared.kv.cache import KVCache
from shared.kv.spec import MHAKVSpec
from shared.models.config import ModelConfig
from shared.models.layers.attention_backend import select_backend
from shared.models.loader import load_model
from shared.parallel.group import TPGroup
from shared.parallel.pipeline import PPStage

log = logging.getLogger(__name__)


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads a rank holds: a share, or one replicated head when TP exceeds them (vLLM)."""
    return max(1, num_kv_heads // tp_size)


def shard_kv_spec(
    cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype, tp_size: int, stage: PPStage
) -> MHAKVSpec:
    end = cfg.num_layers if stage.end_layer is None else stage.end_layer
    heads = local_kv_heads(cfg.num_kv_heads, tp_size)
    return MHAKVSpec(end - stage.start_layer, config.page_size, heads, cfg.head_dim, dtype)


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
) -> tuple[torch.nn.Module, KVCache]:
    dtype, device = config.torch_dtype(cfg.torch_dtype), config.torch_device
    attention = select_backend(device, dtype, config.attention_backend)  # once, for all layers
    start = time.perf_counter()
    model = load_model(config.model_dir, cfg, dtype, tp, stage, device, attention)
    loaded = time.perf_counter()
    log.info(
        "rank %d: model loaded in %.2f s (attention: %s)", rank, loaded - start, attention.name
    )
    spec = shard_kv_spec(cfg, config, dtype, tp.size, stage)
    kv = KVCache(spec, num_pages, rank_shm_path(config.kv_shm_path, rank), device)
    log.info(
        "rank %d: KV pool of %d pages (%.0f MiB) in %.2f s",
        rank,
        num_pages,
        kv.nbytes / 2**20,
        time.perf_counter() - loaded,
    )
    return model, kv
