"""Same-host transport: the decode worker's KV pool is a file in /dev/shm that the prefill
worker maps too and writes into directly. A plain memory copy; no bytes cross a socket."""

from pathlib import Path

import torch

from shared.transfer.base import KVSender, KVTarget

ENDPOINT = "shm"  # endpoints["shm"] = path of the pool file


class ShmSender(KVSender):
    def __init__(self, pool_shape: tuple[int, ...], dtype: torch.dtype):
        self.pool_shape = pool_shape[:2] + (-1,) + pool_shape[4:]  # (L, 2, P*S, nkv, hd)
        self.dtype = dtype
        self._pools: dict[str, torch.Tensor] = {}

    def _pool(self, path: str) -> torch.Tensor:
        if path not in self._pools:
            file = Path(path)
            numel = file.stat().st_size // self.dtype.itemsize
            mapped = torch.from_file(path, shared=True, size=numel, dtype=self.dtype)
            self._pools[path] = mapped.view(self.pool_shape)
        return self._pools[path]

    def send_layer(
        self, target: KVTarget, layer: int, kv: torch.Tensor, dst_slots: torch.Tensor
    ) -> int:
        pool = self._pool(target.endpoints[ENDPOINT])
        pool[layer, :, dst_slots] = kv  # (2, n, nkv, hd) into the mapped pages
        return kv.numel() * kv.element_size()

    def finish(self, target: KVTarget) -> None:
        """Stores to a shared mapping are visible to the decode process once made."""

    def close(self) -> None:
        self._pools.clear()
