"""GPU decoder of the weight codec: a cupy RawModule over codec_decode.cu. Weights stay
compressed in device memory (EncodedTensor.to("cuda")) and are decoded there just before
use. Its reference is the CPU decoder (shared.codec.decode_tensor); tests/gpu compares the
two bit for bit."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

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

SOURCE = Path(__file__).with_name("codec_decode.cu")
THREADS = 128  # threads per block, one segment each
_kernels: dict = {}


@dataclass(frozen=True)
class LaunchPlan:
    """Host-side inputs of both kernels, shared with the CPU shim test."""

    table: np.ndarray  # uint16[2**lut_bits], symbol << 4 | code length
    lut_bits: int
    parts: np.ndarray  # int64, (bits, shift, plane offset) per raw part
    num_segments: int
    width: int  # bytes per element
    k: int


def plan(encoded: EncodedTensor) -> LaunchPlan:
    """Validates the planes' sizes and code table (ModelFolderError otherwise) and builds
    the kernels' tables."""
    table, bits = decode_table(full_lengths(encoded))
    planes = encoded.planes
    parts = np.array(raw_layout(encoded.num_elements, planes.k + 1), dtype=np.int64)
    width = LAYOUTS[encoded.dtype].width // 8
    return LaunchPlan(
        table, bits, parts.reshape(-1), num_segments(planes.total_bits), width, planes.k
    )


def decode_on_device(encoded: EncodedTensor) -> torch.Tensor:
    """Decodes a tensor whose planes live on a CUDA device, on that device, on torch's
    current stream. Raises ModelFolderError if the stream contradicts its block index."""
    if encoded.planes is None:
        return encoded.data
    import cupy

    planes = encoded.planes
    device = planes.stream.device
    if device.type != "cuda":
        raise ValueError(f"{encoded.name}: planes are on {device}, not on a CUDA device")
    launch = plan(encoded)
    n = encoded.num_elements
    out = torch.empty(encoded.shape, dtype=encoded.dtype, device=device)
    lut = torch.from_numpy(launch.table.view(np.int16)).to(device)
    parts = torch.from_numpy(launch.parts).to(device)
    counts = torch.empty(launch.num_segments, dtype=torch.int64, device=device)
    stream = planes.stream.view(torch.int32)  # 32-bit words, byte order kept
    grid = (-(-launch.num_segments // THREADS),)
    common = (stream, planes.gaps, lut, np.int32(launch.lut_bits))
    common += (np.int64(planes.total_bits), np.int64(launch.num_segments), np.int32(SEG_BITS))
    with cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream):
        count, decode = _functions(cupy)
        count(grid, (THREADS,), _args(cupy, *common, counts))
        first = torch.cumsum(counts, 0) - counts
        blocks = first[::SEGS_PER_BLOCK] != planes.block_first.to(torch.int64)
        if bool(blocks.any()) or int(first[-1] + counts[-1]) != n:
            raise ModelFolderError(
                encoded.source,
                f"tensor {encoded.name!r}: code stream does not match its block index",
            )
        tail = (first, np.int64(n), planes.raw, parts, np.int32(len(launch.parts) // 3))
        out_bits = out.view(LAYOUTS[encoded.dtype].int_dtype)  # cupy has no bfloat16 / fp8
        tail += (np.int32(launch.width), np.int32(launch.k), out_bits)
        decode(grid, (THREADS,), _args(cupy, *common, *tail))
    return out


def _functions(cupy):
    if not _kernels:
        module = cupy.RawModule(code=SOURCE.read_text(), options=("--std=c++14",))
        _kernels["count"] = module.get_function("tison_codec_count")
        _kernels["decode"] = module.get_function("tison_codec_decode")
    return _kernels["count"], _kernels["decode"]


def _args(cupy, *args):
    """Torch CUDA tensors as cupy arrays (zero copy); numpy scalars as they are."""
    return tuple(cupy.asarray(a) if isinstance(a, torch.Tensor) else a for a in args)
