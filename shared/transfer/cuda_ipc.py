"""Same-node GPU transport: each rank of a GPU decode worker exports a CUDA IPC handle of its
pool tensor once (`export_pool`, carried in its KVRankPool), a prefill rank on the same node
opens it once (`open_pool`) and writes each layer's pages into it with the copy engine, on a
stream of its own that waits for the layer's forward pass, GPU to GPU over NVLink or PCIe: the
bytes never visit host memory. `finish` waits for the request's copies.

The handles: transfer/ipc_handles.py."""

import torch

from shared.kv.spec import KVSpec
from shared.transfer.base import KVSender, KVTarget, LayerKV
from shared.transfer.pools import MappedPool, map_pools, write_layer

NAME = "cuda_ipc"


class CudaIpcSender(KVSender):
    """Prefill side: the decode worker's pools, opened once per worker; copies on one stream."""

    def __init__(self, spec: KVSpec):
        self.spec = spec  # the whole model's
        self._pools: dict[tuple[bytes, ...], list[MappedPool]] = {}  # by the pools' handles
        self._stream: torch.cuda.Stream | None = None

    def _mapped(self, target: KVTarget) -> list[MappedPool]:
        key = tuple(rank.cuda_ipc for rank in target.pool.ranks)
        if key not in self._pools:
            self._pools[key] = map_pools(self.spec, target.pool.ranks)
        return self._pools[key]

    def send_layer(self, target: KVTarget, kv: LayerKV) -> int:
        pools = self._mapped(target)
        if self._stream is None:
            self._stream = torch.cuda.Stream(kv.payload.device)
        self._stream.wait_stream(torch.cuda.current_stream(kv.payload.device))  # the layer's KV
        with torch.cuda.stream(self._stream):
            write_layer(self.spec, pools, kv)
            kv.payload.record_stream(self._stream)  # freed only once the copies read it
        return kv.payload.numel() * kv.payload.element_size()

    def finish(self, target: KVTarget) -> None:
        """Every copy issued so far is in the decode worker's pool."""
        if self._stream is not None:
            self._stream.synchronize()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._pools.clear()
