"""Same-host transport: each rank of the decode worker keeps its KV pool in a /dev/shm file,
which the prefill rank maps too and writes into directly. A plain memory copy; no bytes cross a
socket, and stores to a shared mapping are visible to the decode process once made."""

from shared.kv.spec import KVSpec
from shared.transfer.base import KVSender, KVTarget, LayerKV
from shared.transfer.pools import MappedPool, map_pools, write_layer

NAME = "shm"


class ShmSender(KVSender):
    def __init__(self, spec: KVSpec):
        self.spec = spec  # the whole model's
        self._pools: dict[tuple[str, ...], list[MappedPool]] = {}  # by the pools' files

    def _mapped(self, target: KVTarget) -> list[MappedPool]:
        key = tuple(rank.shm for rank in target.pool.ranks)
        if key not in self._pools:
            self._pools[key] = map_pools(self.spec, target.pool.ranks)
        return self._pools[key]

    def send_layer(self, target: KVTarget, kv: LayerKV) -> int:
        write_layer(self.spec, self._mapped(target), kv)
        return kv.payload.numel() * kv.payload.element_size()

    def finish(self, target: KVTarget) -> None:
        """Every store was made in send_layer."""

    def close(self) -> None:
        self._pools.clear()
