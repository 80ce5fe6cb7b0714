"""Same-node GPU transport: each rank of a GPU decode worker exports a CUDA IPC handle of its
pool tensor once (`export_pool`, carried in its KVRankPool), a prefill rank on the same node
opens it once (`open_pool`) and writes each layer's pages into it with the copy engine, on a
stream of its own that waits for the layer's forward pass, GPU to GPU over NVLink or PCIe: the
bytes never visit host memory. `finish` waits for the request's copies.

The handle is torch's own (torch.multiprocessing.reductions: the allocation's cudaIpcMemHandle,
offsets and the producer's reference counter), put on the wire as msgpack, never pickle. The
producer keeps its pool for its life, so the importer's mapping stays valid; a GPU index is
the exporter's, so both workers see the node's GPUs in the same order (CUDA_VISIBLE_DEVICES)."""

import msgpack
import torch
from torch.multiprocessing import reductions

from shared.kv.spec import KVSpec
from shared.transfer.base import KVSender, KVTarget, LayerKV
from shared.transfer.pools import MappedPool, map_pools, write_layer

NAME = "cuda_ipc"
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.uint8)}


def export_pool(data: torch.Tensor) -> bytes:
    """The handle of a GPU pool tensor, for KVRankPool.cuda_ipc."""
    if data.device.type != "cuda":
        raise ValueError(f"only a GPU pool has a CUDA IPC handle, not one on {data.device}")
    _, args = reductions.reduce_tensor(data)
    # (cls, size, stride, offset, storage cls, dtype, device, handle, storage bytes,
    #  storage offset, requires_grad, ref counter handle, ref counter offset, event, sync)
    _, size, stride, offset, _, dtype, *rest = args
    return msgpack.packb([list(size), list(stride), offset, str(dtype), *rest])


def open_pool(blob: bytes) -> torch.Tensor:
    """Another process's pool tensor, mapped into this one (writes land in its pool)."""
    size, stride, offset, dtype, *rest = msgpack.unpackb(blob)
    if dtype not in _DTYPES:
        raise ValueError(f"a CUDA IPC pool of unknown dtype {dtype!r}")
    storage_cls = torch.storage.TypedStorage
    args = (torch.Tensor, torch.Size(size), tuple(stride), offset, storage_cls, _DTYPES[dtype])
    return reductions.rebuild_cuda_tensor(*args, *rest)


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
