"""The KV cache's token rows on a GPU (kv_pages.cu): the step's new K/V into their slots, and
a layer's rows of some slots gathered into, or scattered from, the contiguous payload of the
KV handoff. Layouts are shared/kv/spec.py's, per layer:
- MHA: kv_layer (2, P, S, nkv, hd), K then V; payload (2, n, h, hd) of KV heads [u0, u1);
- MLA: kv_layer (P, S, R + Dr), one latent|rope row a token; payload (n, R + Dr).
Bits are copied, so every result equals its torch reference exactly. Slots outside the pool
(P * S of them) are skipped, and gather yields zeros there; torch would raise instead."""

import math
from typing import NamedTuple

import numpy as np
import torch

from kernels.cuda import runtime

SOURCE = "kv_pages.cu"
DTYPES = (torch.float32, torch.bfloat16)
MAX_THREADS = 256


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor):
    """k, v (T, nkv, hd), rows possibly strided, into their slots (T,) int64 of kv_layer
    (2, P, S, nkv, hd): TorchBackend.write_kv."""
    _, num_slots, row = _pool(kv_layer, 5)
    n = _check_slots(slots, kv_layer)
    for t, what in ((k, "write_kv k"), (v, "write_kv v")):
        _check_rows(t, what, kv_layer, (n, *kv_layer.shape[3:]))
    parts = (k, np.int64(k.stride(0)), kv_layer[0], np.int32(0), np.int32(row))
    parts += (v, np.int64(v.stride(0)), kv_layer[1], np.int32(0), np.int32(row))
    _write(kv_layer, parts, row, row, slots, num_slots)


def write_latent(latent: torch.Tensor, k_rope: torch.Tensor, kv_layer: torch.Tensor, slots):
    """latent (T, R) and k_rope (T, Dr), rows possibly strided, into their slots (T,) int64 of
    kv_layer (P, S, R + Dr) as one row each: LatentAttention's index_copy_ of their cat."""
    _, num_slots, row = _pool(kv_layer, 3)
    n, rank = _check_slots(slots, kv_layer), latent.shape[-1]
    _check_rows(latent, "write_latent latent", kv_layer, (n, rank))
    _check_rows(k_rope, "write_latent k_rope", kv_layer, (n, row - rank))
    parts = (latent, np.int64(latent.stride(0)), kv_layer, np.int32(0), np.int32(rank))
    parts += (k_rope, np.int64(k_rope.stride(0)), kv_layer, np.int32(rank))
    parts += (np.int32(row - rank),)
    _write(kv_layer, parts, row, max(rank, row - rank), slots, num_slots)


def gather(kv_layer: torch.Tensor, slots: torch.Tensor, units=(0, 1)) -> torch.Tensor:
    """A copy of the rows of slots (n,) int64 of one layer, KV heads [units) for MHA: the
    spec's `read` (MHAKVSpec: (2, n, h, hd); MLAKVSpec: (n, R + Dr), units (0, 1))."""
    part = _part(kv_layer, units, _check_slots(slots, kv_layer))
    payload = torch.empty(part.shape, dtype=kv_layer.dtype, device=kv_layer.device)
    _move("gather", kv_layer, part, payload, slots)
    return payload


def scatter(kv_layer: torch.Tensor, slots: torch.Tensor, payload: torch.Tensor, units=(0, 1)):
    """Stores a `gather` result of the same units into slots (n,) int64 of one layer: the
    spec's `write`. payload contiguous (a narrowed one: .contiguous() first)."""
    part = _part(kv_layer, units, _check_slots(slots, kv_layer))
    runtime.check(payload, "scatter payload", (kv_layer.dtype,), len(part.shape), kv_layer.device)
    if tuple(payload.shape) != part.shape:
        raise ValueError(f"scatter payload: shape {tuple(payload.shape)}, expected {part.shape}")
    _move("scatter", kv_layer, part, payload, slots)


def _pool(kv_layer: torch.Tensor, dims: int | None = None) -> tuple[int, int, int]:
    """(planes, num_slots, row) of a layer's pool: MHA (2, P, S, nkv, hd) has 2 planes of P*S
    rows of nkv*hd; MLA (P, S, D) one plane of P*S rows of D."""
    if kv_layer.dim() not in (3, 5) or dims not in (None, kv_layer.dim()):
        want = dims or "3 (MLA) or 5 (MHA)"
        raise ValueError(f"kv_layer: shape {tuple(kv_layer.shape)}, expected {want} dimensions")
    runtime.check(kv_layer, "kv_layer", DTYPES)
    planes = 2 if kv_layer.dim() == 5 else 1
    pages, page_size, *row = kv_layer.shape[planes - 1 :]  # (P, S, nkv, hd) or (P, S, D)
    return planes, pages * page_size, math.prod(row)


def _check_rows(t: torch.Tensor, what: str, kv_layer: torch.Tensor, shape: tuple) -> None:
    runtime.check(t, what, (kv_layer.dtype,), len(shape), kv_layer.device, dense_from=1)
    if tuple(t.shape) != shape:
        raise ValueError(f"{what}: shape {tuple(t.shape)}, expected {shape}")


def _check_slots(slots: torch.Tensor, kv_layer: torch.Tensor) -> int:
    """How many slots (n,) there are, after checking them."""
    runtime.check(slots, "slots", (torch.int64,), 1, kv_layer.device)
    return slots.shape[0]


class _Part(NamedTuple):
    """What a gather/scatter of n slots moves: elements [offset, offset + width) of each of
    their rows in each plane of the pool; its payload is `shape`."""

    planes: int
    num_slots: int
    row: int
    offset: int
    width: int
    shape: tuple


def _part(kv_layer: torch.Tensor, units, n: int) -> _Part:
    planes, num_slots, row = _pool(kv_layer)
    if planes == 1:  # MLA: one replicated unit
        if tuple(units) != (0, 1):
            raise ValueError(f"units: {tuple(units)}, an MLA layer has the one unit (0, 1)")
        return _Part(1, num_slots, row, 0, row, (n, row))
    nkv, hd = kv_layer.shape[3:]
    if not 0 <= units[0] < units[1] <= nkv:
        raise ValueError(f"units: [{units[0]}, {units[1]}) outside the {nkv} KV heads")
    heads = units[1] - units[0]
    return _Part(2, num_slots, row, units[0] * hd, heads * hd, (2, n, heads, hd))


def _threads(width: int) -> int:
    return min(MAX_THREADS, 32 * runtime.blocks(width, 32))


def _write(kv_layer, parts: tuple, row: int, width: int, slots, num_slots: int) -> None:
    if len(slots):
        name = f"tison_kv_write_{runtime.suffix(kv_layer.dtype)}"
        args = (*parts, np.int32(row), slots, np.int64(num_slots))
        runtime.function(SOURCE, name)((len(slots), 2), (_threads(width),), args)


def _move(kind: str, kv_layer, part: _Part, payload, slots) -> None:
    if len(slots):
        name = f"tison_kv_{kind}_{runtime.suffix(kv_layer.dtype)}"
        args = (kv_layer, np.int32(part.row), np.int32(part.offset), np.int32(part.width))
        args += (payload, slots, np.int64(len(slots)), np.int64(part.num_slots))
        grid = (len(slots), part.planes)
        runtime.function(SOURCE, name)(grid, (_threads(part.width),), args)


def reference_write_kv(k, v, kv_layer, slots) -> None:
    """write_kv in torch (TorchBackend.write_kv's code)."""
    pool = kv_layer.view(2, -1, *k.shape[1:])  # (2, P*S, nkv, hd)
    pool[0].index_copy_(0, slots, k)
    pool[1].index_copy_(0, slots, v)


def reference_write_latent(latent, k_rope, kv_layer, slots) -> None:
    """write_latent in torch (LatentAttention's code)."""
    entries = kv_layer.view(-1, kv_layer.shape[-1])  # (P*S, R + Dr)
    entries.index_copy_(0, slots, torch.cat([latent, k_rope], dim=-1))


def reference_gather(kv_layer, slots, units=(0, 1)) -> torch.Tensor:
    """gather in torch (the specs' read)."""
    if kv_layer.dim() == 3:
        return kv_layer.view(-1, kv_layer.shape[-1])[slots]  # (n, R + Dr)
    return kv_layer.view(2, -1, *kv_layer.shape[3:])[:, slots, units[0] : units[1]]


def reference_scatter(kv_layer, slots, payload, units=(0, 1)) -> None:
    """scatter in torch (the specs' write)."""
    if kv_layer.dim() == 3:
        kv_layer.view(-1, kv_layer.shape[-1])[slots] = payload
    else:
        kv_layer.view(2, -1, *kv_layer.shape[3:])[:, slots, units[0] : units[1]] = payload
