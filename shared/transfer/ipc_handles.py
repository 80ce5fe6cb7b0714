"""CUDA IPC handles of GPU KV pools: a decode worker's rank exports its pool tensor once
(`export_pool`, carried in its KVRankPool), a process on the same node opens it
(`open_pool`) and writes into the same memory. The handle is torch's own
(torch.multiprocessing.reductions: the allocation's cudaIpcMemHandle, offsets and the
producer's reference counter), put on the wire as msgpack, never pickle. The producer keeps its
pool for its life, so the mapping stays valid; a GPU index is the exporter's, so both processes
see the node's GPUs in the same order (CUDA_VISIBLE_DEVICES)."""

import msgpack
import torch
from torch.multiprocessing import reductions

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
