"""How many KV pages an engine's pool holds (each rank's: page ids are the same on every rank)
and how many of them one sequence can take: from num_pages, else what memory_bytes (or a GPU's
share) leaves beside the weights (footprint.py, as `tison plan` computes it), else
kv_cache_bytes; in unit pages where chunked layers are capped (shared/kv/chunk_cache.py)."""

import logging

from shared.engine import device as devices
from shared.engine.config import EngineConfig
from shared.engine.footprint import pages_for_memory, stage_footprints
from shared.engine.shard import capped_chunk, capped_page_bytes
from shared.errors import InvalidRequestError
from shared.kv.chunk_cache import chunk_pages_per_seq
from shared.models.config import ModelConfig

log = logging.getLogger(__name__)


def capped_chunk_of(config: EngineConfig, cfg: ModelConfig) -> int | None:
    """The chunk size of the chunked layers whose KV is capped (None: nothing capped)."""
    return capped_chunk(cfg) if config.caps_chunked_kv else None


def pool_pages(config: EngineConfig, cfg: ModelConfig, spec, capped: bool):
    """Pages of the pool from config's budget: num_pages, else what memory_bytes leaves each
    rank (footprint.py), else kv_cache_bytes. Unit pages where chunked layers are `capped`,
    whose bytes differ by stage."""
    page_bytes = None  # each stage's page bytes on a rank: its unit page's layers
    if capped:  # MHA layers alike: a layer's page is the rank's page over its layers
        page_bytes = capped_page_bytes(
            cfg, config.parallel, spec.page_size_bytes // spec.num_layers
        )
    pages = config.num_pages or pages_for_budget(config, cfg, spec.dtype, page_bytes)
    if not pages:
        pages = config.kv_cache_bytes // max(page_bytes or [spec.page_size_bytes])
    return pages


def sequence_pages(config: EngineConfig, num_pages: int, groups: int, chunk: int | None) -> int:
    """Pages of the longest sequence's own in a pool of num_pages: with capped chunked layers,
    each of its first pages costs 1 + groups pages, up to the most a chunked layer holds."""
    if chunk is None:
        return num_pages
    most = chunk_pages_per_seq(chunk, config.page_size, config.max_num_batched_tokens)
    return max(num_pages - groups * most, num_pages // (1 + groups))


def pages_for_budget(
    config: EngineConfig, cfg: ModelConfig, dtype, page_bytes: list[int] | None
) -> int | None:
    """The pool's pages when config.memory_bytes bounds each rank (None: unbounded), as
    `tison plan` computes them; InvalidRequestError when the weights leave no page."""
    memory, field = config.memory_bytes, "memory_bytes"
    if memory is None and config.on_gpu:  # each GPU's share, the smallest of the ranks'
        ranks = range(config.parallel.world_size)
        use = config.gpu_memory_utilization
        memory = min(devices.memory_budget(config.rank_device(r), use) for r in ranks)
        field = "gpu_memory_utilization"
    if memory is None:
        return None
    footprints = stage_footprints(cfg, config.parallel, dtype, config.page_size)
    reserve = config.memory_reserve_bytes
    pages = pages_for_memory(footprints, memory, reserve, config.page_size, page_bytes)
    heaviest = max(fp.weight_bytes for fp in footprints)
    if pages < 1:
        raise InvalidRequestError(
            field,
            f"{memory} leaves no KV page: a rank's weights take {heaviest} "
            f"bytes and the reserve {reserve}",
        )
    log.info(
        "KV pool: %d pages (%d tokens) from %.2f GiB a rank: weights %.2f GiB, reserve %.2f GiB",
        pages, pages * config.page_size, memory / 2**30, heaviest / 2**30, reserve / 2**30,
    )  # fmt: skip
    return pages
