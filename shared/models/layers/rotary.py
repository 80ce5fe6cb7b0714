"""Rotary position embedding: the GPT-NeoX "rotate half" layout (HF Llama) and the interleaved
one (Llama 4, DeepSeek), with llama3, linear and YaRN scaling, as transformers computes them;
and Llama 4's query temperature, the NoPE layers' factor of the position."""

import math

import numpy as np
import torch
from torch import nn

from kernels.cpu import library
from kernels.cpu.rope import rope
from kernels.cuda import rope as cuda_rope
from kernels.cuda import runtime as cuda


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind is None:
        return inv_freq
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
    raise ValueError(
        f"rope_scaling type {kind!r} is not supported (supported: llama3, linear, yarn)"
    )


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    interpolated (divided by factor), those turning more than beta_fast times kept, a linear
    ramp between (transformers' _compute_yarn_parameters)."""
    factor, old_len = float(s["factor"]), float(s["original_max_position_embeddings"])
    fast, slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension turning `rotations` times
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude correction for a context `scale` times the original."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """What transformers multiplies cos and sin by (YaRN's attention_factor; 1 otherwise)."""
    s = scaling or {}
    if s.get("rope_type", s.get("type")) != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return yarn_mscale(factor, s["mscale"]) / yarn_mscale(factor, s["mscale_all_dim"])
    return yarn_mscale(factor)


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = (
        float(s["factor"]),
        float(s["low_freq_factor"]),
        float(s["high_freq_factor"]),
    )
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q (T, nh, hd) and k (T, nkv, hd) at the given positions (T,)."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, dtype
    ):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (P, hd/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (P, hd)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] = ()

    def check(self, positions: torch.Tensor) -> None:
        """Raises if a position is beyond the tables (the C kernels read them unchecked). Every
        layer of a step shares one check (and one table lookup). Not while a CUDA graph is
        captured (a host sync; the engine's max_model_len bounds the positions anyway)."""
        if positions.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        if positions is not self._positions:
            self._positions = positions
            if len(positions) and int(positions.max()) >= len(self.cos):
                raise IndexError(f"position {int(positions.max())} beyond the rotary tables")
            self._cos_sin = ()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        self.check(positions)
        if library.usable(q):
            return rope(q, k, positions, self.cos, self.sin)
        if cuda.usable(q):
            return cuda_rope.rope(q, k, positions, self.cos, self.sin)
        if not self._cos_sin:
            self._cos_sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        cos, sin = self._cos_sin  # (T, 1, hd) each
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class InterleavedRotaryEmbedding(nn.Module):
    """RoPE on interleaved pairs (x[2i], x[2i+1]) as one complex number each, as Meta's and
    transformers' Llama 4 and DeepSeek-V3 (rope_interleave) apply it; interleaved=False: the
    rotate-half layout. cos/sin are computed per step from the positions: Llama 4's 10M and
    DeepSeek's 163,840 positions are too many for tables. In float32, as transformers, then
    cast back; cos and sin times attention_factor (YaRN)."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict | None,
        interleaved: bool = True,
        attention_factor: float = 1.0,
    ):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (hd/2,)
        self.interleaved, self.attention_factor = interleaved, attention_factor
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] = ()

    def _cos_sin_of(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, 1, hd/2 or hd) cos and sin; every layer of a step shares one computation."""
        if positions is not self._positions:
            freqs = positions.float()[:, None] * self.inv_freq  # (T, hd/2)
            self._positions = positions
            cos, sin = freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
            if not self.interleaved:
                cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # (T, hd)
            self._cos_sin = cos[:, None, :], sin[:, None, :]
        return self._cos_sin

    def cos_sin_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """(T, hd) float32: each position's hd/2 cosines, then its hd/2 sines (interleaved), as
        the fused decoder (decode_layer.c's ROPE_PAIRS) takes them."""
        cos, sin = self._cos_sin_of(positions)
        return torch.cat([cos[:, 0], sin[:, 0]], -1)

    def cos_sin_into(self, positions: np.ndarray, out: np.ndarray) -> None:
        """cos_sin_rows of positions (T,) int64 written into out[:T] (float32), bit for bit,
        in two torch calls instead of ~8 (~0.1 ms of a decode step on flushed caches): the
        products and the copies in numpy (one float32 rounding each, as torch's), cos and sin
        in torch, over the same contiguous (T, hd/2) layout (its vector loop and its scalar
        tail round differently). Interleaved pairs only."""
        if not self.interleaved:
            out[: len(positions)] = self.cos_sin_rows(torch.from_numpy(positions)).numpy()
            return
        inv_freq = self.inv_freq.float().numpy()
        freqs = torch.from_numpy(positions.astype(np.float32)[:, None] * inv_freq)  # (T, hd/2)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        half = len(inv_freq)
        out[: len(positions), :half] = cos.numpy()
        out[: len(positions), half:] = sin.numpy()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self._cos_sin_of(positions)
        if not self.interleaved:
            q_out, k_out = _rotate(q.float(), cos, sin), _rotate(k.float(), cos, sin)
            return q_out.to(q.dtype), k_out.to(k.dtype)
        return _rotate_pairs(q, cos, sin), _rotate_pairs(k, cos, sin)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, n, hd): each pair (a, b) -> (a cos - b sin, a sin + b cos)."""
    pairs = x.float().unflatten(-1, (-1, 2))  # (T, n, hd/2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


class QueryTemperature:
    """Llama 4's NoPE layers' factor on q at position p (attn_temperature_tuning):
    log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1, in float32 as transformers
    computes it."""

    def __init__(self, floor_scale: float, attn_scale: float):
        self.floor_scale, self.attn_scale = floor_scale, attn_scale

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        """(T,) absolute positions -> (T, 1, 1) float32 (1 for p + 1 < floor_scale)."""
        steps = torch.floor((positions.float() + 1.0) / self.floor_scale)
        return (torch.log1p(steps) * self.attn_scale + 1.0)[:, None, None]

    def into(self, positions: np.ndarray, out: np.ndarray) -> None:
        """The factors of positions (T,) int64 written into out[:T] (float32), bit for bit, in
        one torch call (log1p) instead of ~6: the rest in numpy, one float32 rounding each, as
        torch's (a fused decode step's rows; cos_sin_into's reason)."""
        one = np.float32(1.0)
        steps = np.floor((positions.astype(np.float32) + one) / np.float32(self.floor_scale))
        logs = torch.log1p(torch.from_numpy(steps)).numpy()
        out[: len(positions)] = logs * np.float32(self.attn_scale) + one
