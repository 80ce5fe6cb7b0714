"""compressed-tensors pack-quantized INT4 (Kimi K2.5): eight 4-bit values per int32 word
along the input features, value i of a word in bits 4i..4i+3 stored as q + 8 (q in -8..7, as
compressed_tensors' pack_to_int32 writes it); weight = q * scale of its group, in float32."""

import torch

VALUES_PER_WORD = 8
OFFSET = 8  # stored = q + OFFSET: the symmetric range -8..7 as unsigned nibbles
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # bit position of value i of a word


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 (R, W) -> int8 (R, 8 W), q in -8..7 (shifts, not a byte view: any endianness)."""
    nibbles = (packed.unsqueeze(-1) >> _SHIFTS) & 0xF  # (R, W, 8)
    return (nibbles.flatten(1) - OFFSET).to(torch.int8)


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, group_size: int, start: int, length: int
) -> torch.Tensor:
    """Columns [start, start + length) of the weight, float32 (R, length). packed: the words
    covering them (from word start // 8); scale: the groups covering them (from group
    start // group_size), any float dtype."""
    q = unpack(packed)[:, start % VALUES_PER_WORD :][:, :length]  # (R, length)
    first = start % group_size  # where the columns start inside their first group
    scale = scale.float().repeat_interleave(group_size, 1)[:, first : first + length]
    return q.float() * scale
