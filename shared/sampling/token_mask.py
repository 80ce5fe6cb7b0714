"""Allowed-token bitmasks of the rows under a grammar, as the sampler applies them.

One bit per token, 32 to an int32 word (llguidance's and xgrammar's layout): token t is
allowed where bit t % 32 of word t // 32 is set. Masks travel as these words (1 KiB a row at
a 32k vocabulary) and are unpacked only in the sampler, for the rows that have one.
"""

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kernels.cpu import library
from kernels.cpu.token_mask import token_mask_


@dataclass(frozen=True)
class TokenMasks:
    """The step's grammar masks: the engine fills them (shared/engine/grammars.py)."""

    row_ids: torch.Tensor  # (R,) int64 rows of the sampling batch that have a grammar
    bitmask: torch.Tensor  # (R, W) int32, W >= ceil(V / 32): bit t set = token t allowed

    def to(self, device: torch.device | str) -> "TokenMasks":
        return TokenMasks(self.row_ids.to(device), self.bitmask.to(device))


def ready(masks: TokenMasks | None) -> "Future[TokenMasks | None]":
    """A future already holding `masks` (the masks a step plan carried to another rank)."""
    future: Future[TokenMasks | None] = Future()
    future.set_result(masks)
    return future


# byte value -> its 8 bits as additive logits: 0.0 where set (allowed), -inf where clear
_BYTE_BITS = (torch.arange(256)[:, None] >> torch.arange(8)) & 1  # (256, 8), low bit first
_BYTE_PENALTY = torch.zeros(256, 8).masked_fill_(_BYTE_BITS == 0, float("-inf"))


def penalty(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, V) float32, 0 where the token is allowed and -inf where not, from (R, W) int32
    words: one table lookup per byte (little-endian words: byte k of word w holds tokens
    32w + 8k ...), measured several times faster on CPU than shifting out each bit."""
    table = _BYTE_PENALTY.to(bitmask.device)
    data = bitmask.contiguous().view(torch.uint8).view(-1).int()  # (R * W * 4,)
    return table.index_select(0, data).view(bitmask.shape[0], -1)[:, :vocab_size]


def apply_(x: torch.Tensor, masks: TokenMasks) -> None:
    """Sets the disallowed logits of the masked rows of x (B, V) to -inf, in place: in C on
    CPU (kernels/cpu/token_mask.c, ~10x faster at 32 x 32k: it skips the all-allowed words
    and fills the all-disallowed ones, where the torch path unpacks every bit), else by the
    torch path on any device."""
    if library.usable(x) and masks.bitmask.device == x.device:
        token_mask_(x, masks.row_ids, masks.bitmask)
    else:
        _apply_torch_(x, masks)


def _apply_torch_(x: torch.Tensor, masks: TokenMasks) -> None:
    """apply_ in torch ops (the fallback, and the reference of the kernel's tests): adding
    -inf, one pass over the masked rows. The same as setting -inf for finite logits; a
    disallowed inf or NaN becomes NaN here, -inf in the kernel (a masked_fill_ that would
    match it measured 3x slower)."""
    x.index_add_(0, masks.row_ids, penalty(masks.bitmask, x.shape[1]).to(x.dtype))


__all__ = ["TokenMasks", "apply_", "penalty", "ready"]
