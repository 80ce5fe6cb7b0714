"""Decoding on a GPU: weights stay compressed in device memory (EncodedTensor.to("cuda")) and
are decoded there just before use, by kernels/cuda/codec_decode.py. Its reference is the CPU
decoder (shared.codec.decode_tensor); tests/gpu compares the two bit for bit."""

import numpy as np
import torch

from kernels.cuda.codec_decode import LaunchPlan, decode
from shared.codec.format import (
    LAYOUTS,
    SEG_BITS,
    SEGS_PER_BLOCK,
    EncodedTensor,
    num_segments,
    raw_layout,
)
from shared.codec.huffman import decode_table
from shared.codec.tensor import full_lengths
from shared.errors import ModelFolderError


def plan(encoded: EncodedTensor) -> LaunchPlan:
    """Validates the planes' sizes and code table (ModelFolderError otherwise) and builds
    the kernels' tables."""
    table, bits = decode_table(full_lengths(encoded))
    planes = encoded.planes
    parts = np.array(raw_layout(encoded.num_elements, planes.k + 1), dtype=np.int64)
    width = LAYOUTS[encoded.dtype].width // 8
    return LaunchPlan(
        table, bits, parts.reshape(-1), num_segments(planes.total_bits), SEG_BITS,
        SEGS_PER_BLOCK, width, planes.k,
    )  # fmt: skip


def decode_on_device(
    encoded: EncodedTensor, out: torch.Tensor | None = None, launch: LaunchPlan | None = None
) -> torch.Tensor:
    """Decodes a tensor whose planes live on a CUDA device, on that device, on torch's
    current stream, into `out` (contiguous, the tensor's shape and dtype, on that device; a
    new tensor if None). launch: plan(encoded), made once by a caller that decodes the same
    planes again and again (its code table is read on the host). Raises ModelFolderError if
    the stream contradicts its block index."""
    if encoded.planes is None:
        return encoded.data if out is None else out.copy_(encoded.data)
    device = encoded.planes.stream.device
    if device.type != "cuda":
        raise ValueError(f"{encoded.name}: planes are on {device}, not on a CUDA device")
    if out is None:
        out = torch.empty(encoded.shape, dtype=encoded.dtype, device=device)
    out_bits = out.view(LAYOUTS[encoded.dtype].int_dtype)  # cupy has no bfloat16 / fp8
    if not decode(launch or plan(encoded), encoded.planes, out_bits):
        raise ModelFolderError(
            encoded.source, f"tensor {encoded.name!r}: code stream does not match its block index"
        )
    return out
