"""Paged decode attention on a GPU (paged_attention.cu): one query token a row over the row's
KV pages, flash-decoding style (partitions of the context in parallel blocks, then a merge),
float32 and bfloat16 (float32 accumulation, the output rounded once). Two layouts:

- paged_decode: GQA/MHA pools (2, P, S, nkv, hd); the semantics of shared/'s
  TorchBackend.decode with DecodeRows (context lengths, sliding window, first_key);
- mla_decode: absorbed MLA over a latent pool (P, S, R + Dr) (DeepSeek-V3, Kimi K2): scores
  q_latent . c + q_rope . k_rope, output sum p c (the layer applies W_UV after).

A row that sees no key gets zeros. Block tables must name pages of the pool (not checked: that
would cost a device sync). The torch references below define the results; the wrappers check
dtype, shape, device and contiguity and raise ValueError naming the argument."""

import numpy as np
import torch

from kernels.cuda import runtime

SOURCE = "paged_attention.cu"
DTYPES = (torch.float32, torch.bfloat16)
THREADS = 128  # a block of every kernel: 4 warps
SHARED_BYTES = 48 * 1024  # dynamic shared memory a block may take without opting in
MAX_PARTITION = 512  # keys of a partition, at most (auto choice)
TARGET_BLOCKS = 264  # auto choice: shorter partitions until about 2 blocks a 132-SM H100/H200
MLA_HEADS_PER_BLOCK = 8  # MLA heads sharing a block's latent reads (shared memory: 8 x 576)


def paged_decode(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    first_key: torch.Tensor | None = None,
    partition_size: int | None = None,
) -> torch.Tensor:
    """q (B, nh, hd) over kv_layer (2, P, S, nkv, hd) -> (B, nh, hd). Row b sees the key
    positions p (its block_table (B, Pmax) int32 pages laid end to end) with p <
    context_lens[b], p >= context_lens[b] - window (window given) and p >= first_key[b]
    (first_key (B,) int32 given). partition_size: keys a block takes (None: chosen)."""
    B, nh, hd = _shape(q, "q", 3)
    _check(kv_layer, "kv_layer", q, 5)
    _, _, page_size, nkv, kv_hd = kv_layer.shape
    if kv_layer.shape[0] != 2 or kv_hd != hd:
        raise ValueError(f"kv_layer: shape {tuple(kv_layer.shape)}, expected (2, P, S, nkv, {hd})")
    if nkv == 0 or nh % nkv:
        raise ValueError(f"q: {nh} heads are not a multiple of kv_layer's {nkv} KV heads")
    max_pages = _check_table(block_table, context_lens, B, q)
    if window is not None and window < 1:
        raise ValueError(f"window: {window}, expected at least 1 or None")
    if first_key is not None:
        _check(first_key, "first_key", q, 1, torch.int32)
        if first_key.shape[0] != B:
            raise ValueError(f"first_key: shape {tuple(first_key.shape)}, expected ({B},)")
    group = nh // nkv
    keys = max_pages * page_size
    part = _partition(partition_size, group, hd, B * nkv, keys, "q")
    k_pages, v_pages = kv_layer[0], kv_layer[1]
    vec = _vectorized(q.dtype, (hd, nkv * hd), k_pages, v_pages)
    span = (context_lens, context_lens if first_key is None else first_key)
    span += (np.int32(first_key is not None), np.int32(window or 0))
    args = (q, k_pages, v_pages, block_table, np.int32(max_pages), *span, np.int32(page_size))
    args += (np.int32(nh), np.int32(nkv), np.int32(hd), np.float32(scale), np.int32(part))
    args += (np.int32(vec),)
    grid = (runtime.blocks(keys, part), nkv, B)  # (partitions, KV heads, rows)
    out = torch.empty(B, nh, hd, dtype=q.dtype, device=q.device)
    reduce = (*span, np.int32(keys), np.int32(nh), np.int32(hd), np.int32(part))
    return _run("tison_paged_decode_part", grid, args, _smem(group, hd, part), out, reduce)


def mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_layer: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    partition_size: int | None = None,
    heads_per_block: int = MLA_HEADS_PER_BLOCK,
) -> torch.Tensor:
    """Absorbed MLA decode: q_latent (B, nh, R), q_rope (B, nh, Dr) over a layer's latent pool
    kv_layer (P, S, R + Dr) -> (B, nh, R), sum over the visible positions (< context_lens) of
    softmax(scale * (q_latent . c + q_rope . k_rope)) c. heads_per_block: heads sharing a
    block's latent reads; partition_size as paged_decode's."""
    B, nh, rank = _shape(q_latent, "q_latent", 3)
    _check(q_rope, "q_rope", q_latent, 3)
    rope = q_rope.shape[2]
    if q_rope.shape[:2] != (B, nh):
        raise ValueError(f"q_rope: shape {tuple(q_rope.shape)}, expected ({B}, {nh}, Dr)")
    _check(kv_layer, "kv_layer", q_latent, 3)
    _, page_size, entry = kv_layer.shape
    if entry != rank + rope:
        raise ValueError(f"kv_layer: rows of {entry}, expected R + Dr = {rank + rope}")
    if heads_per_block < 1:
        raise ValueError(f"heads_per_block: {heads_per_block}, expected at least 1")
    max_pages = _check_table(block_table, context_lens, B, q_latent)
    heads = min(heads_per_block, nh)
    keys = max_pages * page_size
    part = _partition(partition_size, heads, entry, B * -(-nh // heads), keys, "heads_per_block")
    vec = _vectorized(q_latent.dtype, (rank, entry), kv_layer)
    args = (q_latent, q_rope, kv_layer, block_table, np.int32(max_pages), context_lens)
    args += (np.int32(page_size), np.int32(nh), np.int32(rank), np.int32(rope))
    args += (np.float32(scale), np.int32(part), np.int32(heads), np.int32(vec))
    grid = (runtime.blocks(keys, part), runtime.blocks(nh, heads), B)  # (partitions, tiles, rows)
    out = torch.empty(B, nh, rank, dtype=q_latent.dtype, device=q_latent.device)
    span = (context_lens, context_lens, np.int32(0), np.int32(0))  # no first key, no window
    reduce = (*span, np.int32(keys), np.int32(nh), np.int32(rank), np.int32(part))
    return _run("tison_mla_decode_part", grid, args, _smem(heads, entry, part), out, reduce)


def paged_decode_reference(q, kv_layer, block_table, context_lens, scale, window=None,
                           first_key=None) -> torch.Tensor:  # fmt: skip
    """paged_decode in float32 torch, rounded to q's dtype once."""
    B, nh, hd = q.shape
    nkv = kv_layer.shape[3]
    pages = block_table.long()  # (B, Pmax)
    keys = kv_layer[0][pages].flatten(1, 2).float()  # (B, L, nkv, hd)
    values = kv_layer[1][pages].flatten(1, 2).float()
    visible = _visible(context_lens, window, first_key, keys.shape[1])  # (B, L)
    query = q.float().view(B, nkv, nh // nkv, hd)  # (B, nkv, G, hd)
    scores = torch.einsum("bkgd,blkd->bkgl", query, keys) * scale  # (B, nkv, G, L)
    scores = scores.masked_fill(~visible[:, None, None], -torch.inf)
    probs = scores.softmax(-1).nan_to_num(0.0)  # a row without keys: zeros
    out = torch.einsum("bkgl,blkd->bkgd", probs, values)  # (B, nkv, G, hd)
    return out.reshape(B, nh, hd).to(q.dtype)


def mla_decode_reference(q_latent, q_rope, kv_layer, block_table, context_lens, scale):
    """mla_decode in float32 torch, rounded to q_latent's dtype once."""
    rank = q_latent.shape[2]
    entries = kv_layer[block_table.long()].flatten(1, 2).float()  # (B, L, R + Dr)
    query = torch.cat([q_latent, q_rope], dim=-1).float()  # (B, nh, R + Dr)
    scores = torch.bmm(query, entries.transpose(1, 2)) * scale  # (B, nh, L)
    visible = _visible(context_lens, None, None, entries.shape[1])  # (B, L)
    probs = scores.masked_fill(~visible[:, None], -torch.inf).softmax(-1).nan_to_num(0.0)
    return torch.bmm(probs, entries[..., :rank]).to(q_latent.dtype)  # (B, nh, R)


def _visible(context_lens, window, first_key, num_keys: int) -> torch.Tensor:
    """(B, num_keys) True where a row sees the key position."""
    pos = torch.arange(num_keys, device=context_lens.device)
    ctx = context_lens.long()[:, None]
    visible = pos < ctx
    if window is not None:
        visible &= pos >= ctx - window
    if first_key is not None:
        visible &= pos >= first_key.long()[:, None]
    return visible


def _run(kernel: str, grid, args: tuple, smem: int, out: torch.Tensor, reduce: tuple):
    """Launches `kernel` (args: its arguments before the outputs) over grid, and with several
    partitions the reduce kernel (reduce: its arguments from context_lens to partition_size).
    Returns out (B, nh, dim)."""
    suffix = runtime.suffix(out.dtype)
    B, nh, dim = out.shape
    num_partitions = grid[0]
    if out.numel() == 0:  # no row (a CUDA grid has no empty dimension)
        return out
    f32 = dict(dtype=torch.float32, device=out.device)
    launch = runtime.function(SOURCE, f"{kernel}_{suffix}")
    if num_partitions == 1:  # the block writes out itself; the partials are never touched
        unused = torch.empty(1, **f32)
        launch(grid, (THREADS,), (*args, unused, unused, unused, out), smem)
        return out
    stats = torch.empty(2, B, nh, num_partitions, **f32)  # each partition's max and sum
    partials = torch.empty(B, nh, num_partitions, dim, **f32)  # its unnormalised output
    launch(grid, (THREADS,), (*args, stats[0], stats[1], partials, out), smem)
    merge = runtime.function(SOURCE, f"tison_decode_reduce_{suffix}")
    merge((nh, B), (THREADS,), (*stats, partials, *reduce, np.int32(num_partitions), out))
    return out


def _shape(t: torch.Tensor, what: str, dims: int) -> tuple[int, ...]:
    """The shape of a query tensor, after checking it (float32 or bfloat16, contiguous)."""
    runtime.check(t, what, DTYPES, dims)
    return tuple(t.shape)


def _check(t, what: str, like: torch.Tensor, dims: int, dtype: torch.dtype | None = None) -> None:
    """ValueError naming `what` unless t is a contiguous tensor of dims dimensions, of dtype
    (like's by default), on like's device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what}: expected a tensor, got {type(t).__name__}")
    runtime.check(t, what, [dtype or like.dtype], dims)
    if t.device != like.device:
        raise ValueError(f"{what}: on {t.device}, the query on {like.device}")


def _check_table(block_table, context_lens, B: int, like: torch.Tensor) -> int:
    """Checks a batch's block table (B, Pmax) and context lengths (B,); returns Pmax."""
    _check(block_table, "block_table", like, 2, torch.int32)
    _check(context_lens, "context_lens", like, 1, torch.int32)
    if block_table.shape[0] != B:
        raise ValueError(f"block_table: shape {tuple(block_table.shape)}, expected ({B}, Pmax)")
    if context_lens.shape[0] != B:
        raise ValueError(f"context_lens: shape {tuple(context_lens.shape)}, expected ({B},)")
    return block_table.shape[1]


def _partition(requested: int | None, heads: int, dk: int, work: int, keys: int, what: str) -> int:
    """Keys a block takes: requested, or up to 512 as the block's shared memory allows, halved
    (down to ~128) while `work` (row, head group) pairs over `keys` positions give fewer than
    TARGET_BLOCKS blocks: few long rows still fill the GPU. what: the argument to blame when
    the heads' queries leave no room."""
    fit = (SHARED_BYTES // 4 - heads * (dk + 2)) // heads  # scores a head, after its query
    if requested is not None:
        if not 1 <= requested <= fit:
            raise ValueError(f"partition_size: {requested}, expected 1 to {fit} here")
        return requested
    if fit < 32:
        raise ValueError(f"{what}: {heads} heads of {dk} in a block overflow its shared memory")
    part = min(MAX_PARTITION, fit // 32 * 32)
    while part >= 256 and work * runtime.blocks(keys, part) < TARGET_BLOCKS:
        part //= 2
    return part


def _smem(heads: int, dk: int, part: int) -> int:
    """Bytes of shared memory of a block (flash_decode.cuh's tison_attend)."""
    return 4 * heads * (dk + part + 2)


def _vectorized(dtype: torch.dtype, sizes: tuple[int, ...], *pools: torch.Tensor) -> bool:
    """Whether the kernels may read the pools in 16-byte pieces: every row size and stride
    (sizes) a whole number of pieces, every pool 16-byte aligned."""
    per = 16 // dtype.itemsize
    return all(s % per == 0 for s in sizes) and all(p.data_ptr() % 16 == 0 for p in pools)
