"""A decode worker's rank pools as one writer: a layer's KV of some units, written into every
rank that holds part of them (by head for MHA, every replica for MLA). Used by the same-host
transport (the prefill rank maps the pools) and the TCP server (the decode worker's own). A
decode worker of data-parallel ranks (--dp) holds each request's pages in one rank's pool: its
servers write the request's frames there alone (`request_pools`), and its reply names only
that pool to the prefill worker."""

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from shared.kv.cache import KVCache, map_pool
from shared.kv.chunk_cache import group_slots
from shared.kv.spec import KVSpec
from shared.protocol import KVRankPool
from shared.transfer.base import LayerKV
from shared.transfer.ipc_handles import open_pool


@dataclass
class MappedPool:
    desc: KVRankPool  # global layers and units it holds (and their page groups, if capped)
    spec: KVSpec  # the model's spec sharded to its layers and units
    data: torch.Tensor | None = None  # its pool tensor, pool_spec's

    def __post_init__(self) -> None:
        self.pool_spec, self._slot = self.spec, list(range(self.spec.num_layers))
        if self.desc.kv_groups:  # unit pages: a layer at its slot (shared/kv/chunk_cache.py)
            slots, self._slot = group_slots(self.desc.kv_groups)
            self.pool_spec = replace(self.spec, num_layers=slots)  # MHA's (capped: Llama 4)

    def where(self, layer: int) -> int:
        """Global layer `layer`'s index in the pool tensor (its slot, where capped)."""
        return self._slot[layer - self.desc.layers[0]]


def map_pools(
    spec: KVSpec,
    ranks: tuple[KVRankPool, ...],
    own: dict[int, KVCache] | None = None,
) -> list[MappedPool]:
    """Maps each rank's pool: its file, or its GPU pool's CUDA IPC handle; `own`: rank -> the
    pool of a rank of this process (a process cannot open its own IPC handle). `spec` is the
    whole model's."""
    pools = []
    for rank, desc in enumerate(ranks):
        pool = MappedPool(desc, spec.shard(tuple(desc.layers), tuple(desc.units)))
        if own and rank in own:
            pool.data = own[rank].data
        elif desc.cuda_ipc:
            pool.data = open_pool(desc.cuda_ipc)
        else:
            pool.data = map_pool(desc.shm, pool.pool_spec)
        pools.append(pool)
    return pools


# a data-parallel decode worker's rank holding a request's pages (None: every pool takes part)
RankOf = Callable[[str], int] | None


def request_pools(pools: list[MappedPool], rank_of: RankOf, request_id: str) -> list[MappedPool]:
    """The pools a request's frames are written into: all, or its data-parallel rank's."""
    return pools if rank_of is None else [pools[rank_of(request_id)]]


def write_layer(spec: KVSpec, pools: list[MappedPool], kv: LayerKV) -> int:
    """Writes each pool's part of kv into it (a capped chunked layer at its slot: kv.slots are
    then slots of its page group's pages); returns how many pools took a part."""
    written = 0
    for pool in pools:
        (l0, l1), (d0, d1) = pool.desc.layers, pool.desc.units
        h0, h1 = max(kv.units[0], d0), min(kv.units[1], d1)
        if not l0 <= kv.layer < l1 or h0 >= h1:
            continue
        data = pool.data
        part = spec.narrow(kv.payload, kv.layer, kv.units, (h0, h1)).to(data.device)
        slots = kv.slots.to(data.device)  # another GPU's pool: a peer copy
        pool.pool_spec.write(data, pool.where(kv.layer), slots, (h0 - d0, h1 - d0), part)
        written += 1
    return written
