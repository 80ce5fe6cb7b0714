"""Counter-based random numbers for sampling: Gumbel noise from (seed, output index, token id).

A request's draw at output index `step` has one 32-bit key, `row_key(seed, step)` (two rounds
of splitmix64 on exact integers, top 32 bits); token t of that draw gets the uniform number
lowbias32(key + (t + 1) * GOLDEN). Nothing is stateful, so a request draws the same numbers
whatever else is in the batch, at any batch position, on any device, and again after
preemption and recompute; noise can be drawn for a few candidate ids or a vocabulary slice.

The per-token hash runs as int32 tensor ops (half the memory traffic of int64, the hot loop
of a sampling step on CPU): multiplication wraps modulo 2**32 as unsigned arithmetic would,
and right shifts are made logical by masking off the sign-extended bits.
"""

import torch

_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15  # splitmix64's increment
_GOLDEN32 = 0x9E3779B9
_SPLITMIX_MUL = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_LOWBIAS_MUL = (0x21F0AAAD, 0x735A2D97)  # lowbias32 (C. Wellons, hash-prospector)
_UNIFORM_BITS = 24  # a float32 holds 24 significant bits exactly


def _int32(value: int) -> int:
    """The int32 with the same 32 bits as the unsigned `value`."""
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def _splitmix64(z: int) -> int:
    z = (z + _GOLDEN64) & _MASK64
    z = ((z ^ (z >> 30)) * _SPLITMIX_MUL[0]) & _MASK64
    z = ((z ^ (z >> 27)) * _SPLITMIX_MUL[1]) & _MASK64
    return z ^ (z >> 31)


def row_key(seed: int, step: int) -> int:
    """The int32 key of a request's draw at output index `step` (any int seed, taken mod 2**64)."""
    return _int32(_splitmix64(_splitmix64(seed) ^ step) >> 32)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 values: arithmetic shift, sign-extended bits masked off."""
    return (z >> bits).bitwise_and_((1 << (32 - bits)) - 1)


def uniform_bits(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """(R, N) int32 in [0, 2**24): random bits of every (row key, token id) pair.

    keys: (R,) int32. token_ids: (N,) ids shared by all rows, or (R, N) ids per row. Bits of
    (key, t): z = key + (t + 1) * GOLDEN, then lowbias32 without its last xorshift, top 24 bits
    of the second product (mod 2**32 throughout).
    """
    ids = token_ids.to(torch.int32)
    z = keys[:, None] + (ids + 1).mul_(_int32(_GOLDEN32))  # (R, N), wraps mod 2**32
    z.bitwise_xor_(_shift_right(z, 16)).mul_(_LOWBIAS_MUL[0])
    z.bitwise_xor_(_shift_right(z, 15)).mul_(_LOWBIAS_MUL[1])
    return _shift_right(z, 32 - _UNIFORM_BITS)


def gumbel_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """(R, N) float32 standard Gumbel noise for the given row keys and token ids.

    argmax(log p + noise) over a row draws a token from p (the Gumbel-max trick).
    """
    u = uniform_bits(keys, token_ids).to(torch.float32)
    u.add_(0.5).mul_(2.0**-_UNIFORM_BITS)  # uniform in (0, 1), never 0 or 1
    return u.log_().neg_().log_().neg_()  # -log(-log(u))


__all__ = ["row_key", "uniform_bits", "gumbel_noise"]
