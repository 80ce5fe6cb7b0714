"""Encode one tensor to an EncodedTensor and decode it back, on the C fast path where it
builds and the numpy reference otherwise. Decoding checks the planes against their metadata
and the result against the stored CRC-32; any mismatch raises ModelFolderError naming the
source file and the tensor."""

import dataclasses
import os
import zlib

import numpy as np
import torch

from shared.codec import native, reference
from shared.codec.format import (
    LAYOUTS,
    MAX_SYMBOL_BITS,
    MIN_CODED_ELEMENTS,
    CodedPlanes,
    EncodedTensor,
    FloatLayout,
    PlaneError,
    block_index_dtype,
    num_blocks,
    num_segments,
    padded_plane_bytes,
    raw_plane_bytes,
)
from shared.codec.huffman import code_lengths, pack_lengths, table_problem, unpack_lengths
from shared.errors import ModelFolderError

BACKENDS = ("auto", "native", "reference")


def encode_tensor(
    tensor: torch.Tensor, name: str = "", k: int | None = None, backend: str = "auto"
) -> EncodedTensor:
    """Encodes a CPU tensor. Floats of two or more dimensions with enough elements are
    Huffman-coded at the split point k that stores fewest bytes (or at the given k); every
    other tensor, or one that coding would not shrink, is kept raw."""
    tensor = tensor.detach().contiguous()
    layout = LAYOUTS.get(tensor.dtype)
    if k is not None and (layout is None or not valid_split(layout, k)):
        raise ValueError(f"{name}: cannot code {tensor.dtype} with split point k={k}")
    shape, crc = tuple(tensor.shape), checksum(tensor)
    small = tensor.dim() < 2 or tensor.numel() < MIN_CODED_ELEMENTS
    if layout is not None and tensor.numel() and (k is not None or not small):
        planes = _encode_planes(tensor, layout, k, _library(backend))
        if planes is not None:
            return EncodedTensor(name, "<memory>", tensor.dtype, shape, crc, planes, None)
    return EncodedTensor(name, "<memory>", tensor.dtype, shape, crc, None, tensor)


def decode_tensor(
    encoded: EncodedTensor,
    backend: str = "auto",
    num_threads: int | None = None,
    verify: bool = True,
) -> torch.Tensor:
    """The original CPU tensor, bit for bit. Raises ModelFolderError(source) naming the
    tensor if the planes are inconsistent or (verify) the result fails its CRC-32."""
    try:
        if encoded.planes is None:
            tensor = encoded.data.contiguous()
            crc = checksum(tensor) if verify else encoded.crc32
        else:
            threads = num_threads or default_threads()
            tensor, crc = _decode_planes(encoded, backend, threads, verify)
    except PlaneError as e:
        raise _corrupt(encoded, str(e)) from e
    if verify and crc != encoded.crc32:
        stored = encoded.crc32
        raise _corrupt(encoded, f"checksum mismatch (CRC-32 {crc:#010x}, stored {stored:#010x})")
    return tensor


def check_stored(encoded: EncodedTensor) -> None:
    """ModelFolderError unless the stored bytes (planes, or raw data) still have the CRC-32
    they were written with: for tensors that will be decoded elsewhere, e.g. on a GPU."""
    if encoded.planes is None:
        ok = checksum(encoded.data) == encoded.crc32
    else:
        ok = encoded.planes.planes_crc32() == encoded.planes.crc32
    if not ok:
        raise _corrupt(encoded, "checksum mismatch in the stored bytes")


def full_lengths(encoded: EncodedTensor) -> np.ndarray:
    """The code length of every symbol (uint8[2**symbol_bits]); ModelFolderError if the
    planes do not have the sizes their metadata implies or the table is not a valid code."""
    problem = planes_problem(encoded)
    if problem is None:
        planes = encoded.planes
        symbols = 1 << (LAYOUTS[encoded.dtype].width - 1 - planes.k)
        lengths = unpack_lengths(planes.first_symbol, planes.lengths.cpu().numpy(), symbols)
        problem = "code table does not fit the alphabet" if lengths is None else None
    if problem is None:
        problem = table_problem(lengths)
    if problem is not None:
        raise _corrupt(encoded, problem)
    return lengths


def planes_problem(encoded: EncodedTensor) -> str | None:
    """What is wrong with the planes' dtypes and sizes, or None."""
    layout = LAYOUTS.get(encoded.dtype)
    planes = encoded.planes
    if layout is None or not valid_split(layout, planes.k) or planes.total_bits < 0:
        return f"cannot decode {encoded.dtype} split at k={planes.k} from {planes.total_bits} bits"
    n_seg = num_segments(planes.total_bits)
    symbols = 1 << (layout.width - 1 - planes.k)
    expected = {
        "stream": (torch.uint8, padded_plane_bytes(planes.total_bits)),
        "raw": (torch.uint8, raw_plane_bytes(encoded.num_elements, planes.k + 1)),
        "lengths": (torch.uint8, min(planes.lengths.numel(), symbols // 2 + 1)),
        "gaps": (torch.uint8, -(-n_seg // 2)),
        "block_first": (block_index_dtype(encoded.num_elements), num_blocks(planes.total_bits)),
    }
    for plane, (dtype, size) in expected.items():
        t = getattr(planes, plane)
        if t.dtype != dtype or t.dim() != 1 or t.numel() != size:
            return f"plane {plane!r} is {t.dtype}[{t.numel()}], expected {dtype}[{size}]"
    return None


def valid_split(layout: FloatLayout, k: int) -> bool:
    return 0 <= k and 0 < layout.width - 1 - k <= MAX_SYMBOL_BITS


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 (zlib) of the tensor's bytes."""
    flat = tensor.contiguous().reshape(-1)
    if flat.numel() == 0:
        return zlib.crc32(b"")
    return zlib.crc32(flat.view(torch.uint8).numpy())


def default_threads() -> int:
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


def _decode_planes(encoded: EncodedTensor, backend: str, num_threads: int, verify: bool):
    planes = {name: t.cpu().numpy() for name, t in encoded.planes.tensors().items()}
    planes["lengths"] = full_lengths(encoded)
    planes["block_first"] = planes["block_first"].astype(np.int64)
    k, total_bits = encoded.planes.k, encoded.planes.total_bits
    out = torch.empty(encoded.shape, dtype=encoded.dtype)
    flat = _bits(out).reshape(-1)
    lib = _library(backend)
    if lib is not None:
        return out, native.decode(lib, planes, k, total_bits, flat, num_threads, verify)
    width = LAYOUTS[encoded.dtype].width
    flat[:] = reference.decode(planes, width, k, total_bits, flat.size).astype(flat.dtype)
    return out, zlib.crc32(flat.view(np.uint8)) if verify else None


def _encode_planes(
    tensor: torch.Tensor, layout: FloatLayout, k: int | None, lib
) -> CodedPlanes | None:
    """The planes at the chosen split point, or None if raw storage is no bigger."""
    flat = _bits(tensor).reshape(-1)
    choice = _choose_split(lib, flat, layout, k)
    if choice is None:
        return None
    k, lengths, sizes = choice
    if lib is None:
        planes = reference.encode(flat, layout.width, k, lengths)
    else:
        planes = native.encode(lib, flat, k, lengths, sizes)
    first_symbol, packed = pack_lengths(lengths)
    coded = CodedPlanes(
        stream=torch.from_numpy(planes["stream"]),
        raw=torch.from_numpy(planes["raw"]),
        lengths=torch.from_numpy(packed),
        gaps=torch.from_numpy(planes["gaps"]),
        block_first=torch.from_numpy(planes["block_first"]).to(block_index_dtype(flat.size)),
        k=k,
        total_bits=sizes["total_bits"],
        first_symbol=first_symbol,
        crc32=0,
    )
    return dataclasses.replace(coded, crc32=coded.planes_crc32())


def _choose_split(lib, flat: np.ndarray, layout: FloatLayout, k: int | None):
    """(k, code lengths, plane sizes) of the split point storing fewest bytes (or of the
    given k), or None if storing the tensor raw is no bigger."""
    ks = layout.candidate_ks() if k is None else [k]
    finest = min(ks)
    if lib is None:
        symbols, _ = reference.split(flat, layout.width, finest)
        counts = np.bincount(symbols, minlength=1 << (layout.width - 1 - finest))
    else:
        counts = native.histogram(lib, flat, finest)
    best, best_bytes = None, flat.size * flat.itemsize if k is None else None
    for candidate in ks:
        # Symbols at a coarser split are the finer ones shifted right: sum runs of counts.
        merged = counts.reshape(-1, 1 << (candidate - finest)).sum(axis=1)
        lengths = code_lengths(merged)
        sizes = _plane_sizes(int(np.dot(merged, lengths.astype(np.int64))), flat.size, candidate)
        index_bytes = sizes["block_first"] * (4 if flat.size < 1 << 31 else 8)
        stored = sizes["stream"] + sizes["raw"] + sizes["gaps"] + index_bytes
        stored += len(pack_lengths(lengths)[1])
        if best_bytes is None or stored < best_bytes:
            best, best_bytes = (candidate, lengths, sizes), stored
    return best


def _plane_sizes(total_bits: int, n: int, k: int) -> dict:
    n_seg = num_segments(total_bits)
    return {
        "total_bits": total_bits,
        "num_segments": n_seg,
        "stream": padded_plane_bytes(total_bits),
        "raw": raw_plane_bytes(n, k + 1),
        "gaps": -(-n_seg // 2),
        "block_first": num_blocks(total_bits),
    }


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """A float tensor's element bits as an unsigned numpy array sharing its memory."""
    layout = LAYOUTS[tensor.dtype]
    unsigned = {8: np.uint8, 16: np.uint16, 32: np.uint32}[layout.width]
    return tensor.view(layout.int_dtype).numpy().view(unsigned)


def _library(backend: str):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    if backend == "reference":
        return None
    lib = native.load()
    if lib is None and backend == "native":
        raise RuntimeError("the codec's C fast path could not be built (see the log)")
    return lib


def _corrupt(encoded: EncodedTensor, problem: str) -> ModelFolderError:
    return ModelFolderError(encoded.source, f"tensor {encoded.name!r}: {problem}")
