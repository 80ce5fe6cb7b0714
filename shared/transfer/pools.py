"""A decode worker's rank pools as one writer: a layer's KV of some units, written into every
rank that holds part of them (by head for MHA, every replica for MLA). Used by the same-host
transport (the prefill rank maps the pools) and the TCP server (the decode worker's own)."""

from dataclasses import dataclass, replace

import torch

from shared.kv.cache import KVCache, map_pool
from shared.kv.chunk_cache import SplitKVCache, split_places
from shared.kv.spec import KVSpec
from shared.protocol import KVRankPool
from shared.transfer.base import LayerKV
from shared.transfer.ipc_handles import open_pool


@dataclass
class MappedPool:
    desc: KVRankPool  # global layers and units it holds (and which of them are capped)
    spec: KVSpec  # the model's spec sharded to its layers and units
    data: torch.Tensor  # its pool tensor; split: its full layers' (spec.pool_shape of them)
    chunked: torch.Tensor | None = None  # split: its capped chunked layers' pool tensor

    def __post_init__(self) -> None:
        (first, end), capped = self.desc.layers, self.desc.chunked_layers
        parts = {False: (self.data, self.spec)}  # a split pool: each part with its own spec
        if capped:
            parts[False] = (self.data, _part(self.spec, self.spec.num_layers - len(capped)))
            parts[True] = (self.chunked, _part(self.spec, len(capped)))
        places = split_places(layer in capped for layer in range(first, end))
        self._where = [(*parts[chunked], index) for chunked, index in places]

    def where(self, layer: int) -> tuple[torch.Tensor, KVSpec, int]:
        """Global layer `layer`'s pool tensor, that tensor's spec and the layer's index in it."""
        return self._where[layer - self.desc.layers[0]]


def _part(spec: KVSpec, num_layers: int) -> KVSpec:
    """The spec of a split pool's part (its layers are alike: MHA, chunked_cache.py)."""
    return replace(spec, num_layers=num_layers)


def map_pools(
    spec: KVSpec,
    ranks: tuple[KVRankPool, ...],
    own: dict[int, KVCache | SplitKVCache] | None = None,
) -> list[MappedPool]:
    """Maps each rank's pool: its file (a split pool: its two files), or its GPU pool's CUDA
    IPC handle; `own`: rank -> the pool of a rank of this process (a process cannot open its
    own IPC handle). `spec` is the whole model's."""
    pools = []
    for rank, desc in enumerate(ranks):
        local = spec.shard(tuple(desc.layers), tuple(desc.units))
        capped = len(desc.chunked_layers)
        if own and rank in own:
            kv = own[rank]
            split = isinstance(kv, SplitKVCache)
            data, chunked = (kv.full.data, kv.chunked.data) if split else (kv.data, None)
        elif desc.cuda_ipc:
            data, chunked = open_pool(desc.cuda_ipc), None
        elif capped:
            data = map_pool(desc.shm, _part(local, local.num_layers - capped))
            chunked = map_pool(desc.chunk_shm, _part(local, capped))
        else:
            data, chunked = map_pool(desc.shm, local), None
        pools.append(MappedPool(desc, local, data, chunked))
    return pools


def write_layer(spec: KVSpec, pools: list[MappedPool], kv: LayerKV) -> int:
    """Writes each pool's part of kv into it (a capped chunked layer into the pool's chunked
    part: kv.slots are then slots of its chunked pages); returns how many pools took a part."""
    written = 0
    for pool in pools:
        (l0, l1), (d0, d1) = pool.desc.layers, pool.desc.units
        h0, h1 = max(kv.units[0], d0), min(kv.units[1], d1)
        if not l0 <= kv.layer < l1 or h0 >= h1:
            continue
        data, local, index = pool.where(kv.layer)
        part = spec.narrow(kv.payload, kv.layer, kv.units, (h0, h1)).to(data.device)
        slots = kv.slots.to(data.device)  # another GPU's pool: a peer copy
        local.write(data, index, slots, (h0 - d0, h1 - d0), part)
        written += 1
    return written
