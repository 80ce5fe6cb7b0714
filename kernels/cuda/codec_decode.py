"""GPU decoder of the weight codec (format: shared/codec/FORMAT.md): a cupy RawModule over
codec_decode.cu. It takes the planes as they lie on the device and the host-side tables of a
LaunchPlan; shared/codec/gpu.py builds the plan from an encoded tensor and checks the result."""

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

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
    seg_bits: int  # code-stream bits of a segment (one thread's)
    segs_per_block: int  # segments of a block of the block index
    width: int  # bytes per element
    k: int


class DevicePlanes(Protocol):
    """The coded planes the kernels read, 1-D CUDA tensors (shared.codec's CodedPlanes)."""

    stream: torch.Tensor  # uint8, the codes, MSB-first, padded to 32-bit words
    raw: torch.Tensor  # uint8, the raw fields, one packed plane per part
    gaps: torch.Tensor  # uint8, 4-bit offsets of each segment's first code
    block_first: torch.Tensor  # int32 or int64, first element of each block
    total_bits: int  # length of the code stream in bits


def decode(launch: LaunchPlan, planes: DevicePlanes, out_bits: torch.Tensor) -> bool:
    """Decodes the planes into out_bits (the output's n elements as unsigned ints of
    launch.width bytes, on the planes' device) on torch's current stream. False (out_bits
    then unspecified) when the code stream contradicts its block index."""
    import cupy

    device, n = planes.stream.device, out_bits.numel()
    lut = torch.from_numpy(launch.table.view(np.int16)).to(device)
    parts = torch.from_numpy(launch.parts).to(device)
    counts = torch.empty(launch.num_segments, dtype=torch.int64, device=device)
    stream = planes.stream.view(torch.int32)  # 32-bit words, byte order kept
    grid = (-(-launch.num_segments // THREADS),)
    common = (stream, planes.gaps, lut, np.int32(launch.lut_bits))
    common += (np.int64(planes.total_bits), np.int64(launch.num_segments))
    common += (np.int32(launch.seg_bits),)
    with cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream):
        count, decode_segments = _functions(cupy)
        count(grid, (THREADS,), _args(cupy, *common, counts))
        first = torch.cumsum(counts, 0) - counts
        blocks = first[:: launch.segs_per_block] != planes.block_first.to(torch.int64)
        if bool(blocks.any()) or int(first[-1] + counts[-1]) != n:
            return False
        tail = (first, np.int64(n), planes.raw, parts, np.int32(len(launch.parts) // 3))
        tail += (np.int32(launch.width), np.int32(launch.k), out_bits)
        decode_segments(grid, (THREADS,), _args(cupy, *common, *tail))
    return True


def _functions(cupy):
    if not _kernels:
        module = cupy.RawModule(code=SOURCE.read_text(), options=("--std=c++14",))
        _kernels["count"] = module.get_function("tison_codec_count")
        _kernels["decode"] = module.get_function("tison_codec_decode")
    return _kernels["count"], _kernels["decode"]


def _args(cupy, *args):
    """Torch CUDA tensors as cupy arrays (zero copy); numpy scalars as they are."""
    return tuple(cupy.asarray(a) if isinstance(a, torch.Tensor) else a for a in args)
