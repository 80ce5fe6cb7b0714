"""Rotary position embedding of q and k on a GPU, in place (rope.cu). It takes what
kernels/cpu/rope.py takes (q, k, int64 positions, cos/sin tables read at them) but rotates q
and k where they lie, so views of a fused projection (DeepSeek's q_rope, k_rope) need no copy.

Layouts and rounding follow shared/models/layers/rotary.py exactly, bit for bit:
- rotate half (RotaryEmbedding): tables (max_positions, hd) in q's dtype, each op rounded to it;
- interleaved pairs (InterleavedRotaryEmbedding): its per-step float32 cos/sin (T, hd / 2),
  with positions arange(T) (or (T, hd) float32 when it runs rotate half): float32 arithmetic,
  one rounding to q's dtype at the end.
The rule the kernel follows: arithmetic in the tables' dtype (q's, or float32)."""

import numpy as np
import torch

from kernels.cuda import runtime

SOURCE = "rope.cu"
DTYPES = (torch.float32, torch.bfloat16)
MAX_THREADS = 256


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q (T, nh, hd) and k (T, nkv, hd) in place (each with its last dimension
    contiguous, rows and heads any stride apart) by the rows positions (T,) int64 of cos and
    sin (rows, hd), or (rows, hd / 2) when interleaved, contiguous, of q's dtype or float32.
    Positions are not checked against the tables (RotaryEmbedding.check does). Returns (q, k)."""
    runtime.check(q, "rope q", DTYPES, 3, dense_from=2)
    T, nh, hd = q.shape
    runtime.check(k, "rope k", (q.dtype,), 3, q.device, dense_from=2)
    if k.shape[0] != T or k.shape[2] != hd:
        raise ValueError(f"rope k: shape {tuple(k.shape)}, expected ({T}, nkv, {hd})")
    if hd % 2:
        raise ValueError(f"rope q: head size {hd} is odd")
    runtime.check(positions, "rope positions", (torch.int64,), 1, q.device)
    if positions.shape[0] != T:
        raise ValueError(f"rope positions: shape {tuple(positions.shape)}, expected ({T},)")
    tables = (q.dtype, torch.float32)
    runtime.check(cos, "rope cos", tables, 2, q.device)
    runtime.check(sin, "rope sin", (cos.dtype,), 2, q.device)
    width = hd // 2 if interleaved else hd
    if cos.shape[1] != width or sin.shape != cos.shape:
        raise ValueError(
            f"rope cos/sin: shapes {tuple(cos.shape)} and {tuple(sin.shape)}, expected "
            f"(rows, {width})"
        )
    if T == 0 or nh + k.shape[1] == 0:
        return q, k
    pairs = (nh + k.shape[1]) * (hd // 2)
    threads = min(MAX_THREADS, 32 * runtime.blocks(pairs, 32))
    name = f"tison_rope_{runtime.suffix(q.dtype)}_{runtime.suffix(cos.dtype)}"
    args = (q, np.int64(q.stride(0)), np.int64(q.stride(1)), np.int32(nh))
    args += (k, np.int64(k.stride(0)), np.int64(k.stride(1)), np.int32(k.shape[1]))
    args += (np.int32(hd), positions, cos, sin, np.int32(interleaved))
    runtime.function(SOURCE, name)((T,), (threads,), args)
    return q, k


def reference_rope(q, k, positions, cos, sin, interleaved: bool = False):
    """What rope computes, as rotated copies (torch ops in the tables' dtype)."""
    c, s = cos[positions][:, None], sin[positions][:, None]  # (T, 1, width)
    return _rotate(q, c, s, interleaved), _rotate(k, c, s, interleaved)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    x_c = x.to(cos.dtype)
    if interleaved:
        a, b = x_c.unflatten(-1, (-1, 2)).unbind(-1)  # (T, n, hd / 2) each
        out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x_c[..., half:], x_c[..., :half]], dim=-1)
        out = x_c * cos + rotated * sin
    return out.to(x.dtype)
