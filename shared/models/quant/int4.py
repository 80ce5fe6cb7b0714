"""compressed-tensors pack-quantized INT4 (Kimi K2.5): eight 4-bit values per int32 word
along the input features, value i of a word in bits 4i..4i+3 stored as q + 8 (q in -8..7, as
compressed_tensors' pack_to_int32 writes it); weight = q * scale of its group, in float32.
`tison compress` stores the words raw: no float layout of the codec fits int32 words, and the
4-bit values of gaussian weights carry 3.72 bits of entropy (loadtest/bench_quant_load.py), so
coding nibbles would save at most 7% of them."""

import sys

import torch

VALUES_PER_WORD = 8
OFFSET = 8  # stored = q + OFFSET: the symmetric range -8..7 as unsigned nibbles


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 (R, W) -> int8 (R, 8 W), q in -8..7. Through a byte view (value 2k of a word in
    the low nibble of its byte k, little-endian): 3x faster than shifting whole words."""
    rows, words = packed.shape
    data = packed.contiguous().view(torch.uint8).view(rows, words, 4)
    if sys.byteorder == "big":  # the bytes of each word in memory order, lowest first
        data = data.flip(-1)
    nibbles = torch.stack((data & 0xF, data >> 4), dim=-1)  # (R, W, 4, 2)
    return nibbles.view(rows, words * VALUES_PER_WORD).view(torch.int8) - OFFSET


def dequantize(packed: torch.Tensor, scale: torch.Tensor, group_size: int, cols: int):
    """float32 (R, cols) of whole groups: packed int32 (R, W), the words of those groups (the
    last may be short); scale (R, G) with G = ceil(cols / group_size), any float dtype."""
    rows, groups = scale.shape
    q = unpack(packed)[:, :cols]  # (R, cols)
    if cols < groups * group_size:  # a short last group: pad it, cut it after
        q = torch.nn.functional.pad(q, (0, groups * group_size - cols))
    grouped = q.view(rows, groups, group_size).float() * scale.float().unsqueeze(-1)
    return grouped.view(rows, groups * group_size)[:, :cols]  # (R, cols)
