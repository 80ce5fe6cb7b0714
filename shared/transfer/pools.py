"""A decode worker's rank pools as one writer: a layer's KV of some units, written into every
rank that holds part of them (by head for MHA, every replica for MLA). Used by the same-host
transport (the prefill rank maps the pools) and the TCP server (the decode worker's own)."""

from dataclasses import dataclass

import torch

from shared.kv.cache import map_pool
from shared.kv.spec import KVSpec
from shared.protocol import KVRankPool
from shared.transfer.base import LayerKV
from shared.transfer.ipc_handles import open_pool


@dataclass
class MappedPool:
    desc: KVRankPool  # global layers and units it holds
    spec: KVSpec  # the model's spec sharded to them
    data: torch.Tensor  # its pool tensor (spec.pool_shape)


def map_pools(
    spec: KVSpec, ranks: tuple[KVRankPool, ...], own: dict[int, torch.Tensor] | None = None
) -> list[MappedPool]:
    """Maps each rank's pool: its file, or its GPU pool's CUDA IPC handle; `own`: rank -> the
    pool tensor of a rank of this process (a process cannot open its own IPC handle). `spec`
    is the whole model's."""
    pools = []
    for rank, desc in enumerate(ranks):
        local = spec.shard(tuple(desc.layers), tuple(desc.units))
        if own and rank in own:
            data = own[rank]
        elif desc.cuda_ipc:
            data = open_pool(desc.cuda_ipc)
        else:
            data = map_pool(desc.shm, local)
        pools.append(MappedPool(desc, local, data))
    return pools


def write_layer(spec: KVSpec, pools: list[MappedPool], kv: LayerKV) -> int:
    """Writes each pool's part of kv into it; returns how many pools took a part."""
    written = 0
    for pool in pools:
        (l0, l1), (d0, d1) = pool.desc.layers, pool.desc.units
        h0, h1 = max(kv.units[0], d0), min(kv.units[1], d1)
        if not l0 <= kv.layer < l1 or h0 >= h1:
            continue
        part = spec.narrow(kv.payload, kv.layer, kv.units, (h0, h1)).to(pool.data.device)
        slots = kv.slots.to(pool.data.device)  # another GPU's pool: a peer copy
        pool.spec.write(pool.data, kv.layer - l0, slots, (h0 - d0, h1 - d0), part)
        written += 1
    return written
