"""A quantized checkpoint read as a plain one: the loader sees `<module>.weight` of each
quantized linear with its logical shape (out, in) and gets float32 weights back, so no layer
or weight_loader knows about quantization.

Why dequantize once at load, on the CPU: the CPU linears (layers/cpu_linear.py) multiply dense
bf16 or float32 weights; there is no FP8 or INT4 GEMM kernel for them yet, and dequantizing in
every forward would redo per step what one pass at load does once. The cost is memory: a weight
takes its bf16 size in RAM (2x FP8, 4x INT4) and load time. loadtest/bench_quant_load.py, a
random 205M-parameter Llama loaded in bf16 on an AMD EPYC (best of 5 processes, page cache
warm), 2 threads / 1 thread: bf16 (414 MB on disk) 0.16 / 0.24 s, peak RSS 1072 MB; FP8
128x128 (273 MB) 0.62 / 0.87 s, 1002 MB; INT4 group 32 (211 MB) 0.50 / 0.96 s, 916 MB (peak
RSS counts the memory-mapped file, smaller when quantized)."""

from pathlib import Path

import torch

from shared.checkpoint import Checkpoint, materialize
from shared.errors import ModelFolderError
from shared.models.quant import fp8, int4
from shared.models.quant.scheme import FP8, QuantScheme, read_scheme

SCALE_INV = ".weight_scale_inv"  # fp8: float32 (ceil(out / rows), ceil(in / cols))
PACKED = ".weight_packed"  # int4: int32 (out, ceil(in / 8))
SCALE = ".weight_scale"  # int4: bf16 (out, ceil(in / group_size))
SHAPE = ".weight_shape"  # int4: int32 [out, in]
ZERO_POINT = ".weight_zero_point"  # asymmetric int4: refused


def open_checkpoint(model_dir: str | Path, raw_config: dict, weights=None):
    """The folder's weights (Checkpoint.open; or `weights`, a checkpoint read from elsewhere,
    e.g. a PeerCheckpoint), dequantized on read if config.json says they are quantized.
    raw_config: config.json as a dict (ModelConfig.raw)."""
    scheme = read_scheme(raw_config, str(Path(model_dir) / "config.json"))
    checkpoint = Checkpoint.open(model_dir) if weights is None else weights
    return checkpoint if scheme is None else QuantizedCheckpoint(checkpoint, scheme)


class QuantizedCheckpoint:
    """names() / get_slice() / get() of a Checkpoint or CompressedCheckpoint, with each
    quantized linear's stored parts (weight + scale_inv, or packed + scale + shape) shown as
    one logical `<module>.weight`. Unquantized tensors pass through unchanged."""

    def __init__(self, inner, scheme: QuantScheme):
        self.inner, self.scheme = inner, scheme
        stored = inner.names()
        self._quantized, self._names = _logical_names(stored, set(stored), scheme, self._error)

    def names(self) -> list[str]:
        return list(self._names)

    def get(self, name: str) -> torch.Tensor:
        return materialize(self.get_slice(name))

    def get_slice(self, name: str):
        """A lazy slice (narrow / read give float32) of a quantized linear's weight; any other
        tensor as the inner checkpoint gives it."""
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in self._quantized:
            if self.scheme.method == FP8:
                parts = self._part(name), self._part(module + SCALE_INV)
                return Fp8Slice(*parts, self.scheme.block, lambda p: self._error(name, p))
            parts = self._part(module + PACKED), self._part(module + SCALE)
            shape = materialize(self._part(module + SHAPE))
            error = lambda p: self._error(name, p, module + PACKED)  # noqa: E731
            return Int4Slice(*parts, shape, self.scheme.group_size, error)
        part = self._part(name)
        if self.scheme.method == FP8 and part.dtype == torch.float8_e4m3fn:
            raise self._error(name, f"float8 weight without its {SCALE_INV.lstrip('.')}")
        return part

    def close(self) -> None:
        self.inner.close()

    def _part(self, name: str):
        """A stored tensor, unread where the inner checkpoint can slice (a tensor otherwise)."""
        read = getattr(self.inner, "get_slice", self.inner.get)
        return read(name)

    def _error(self, name: str, problem: str, stored: str | None = None) -> ModelFolderError:
        """Names the file holding `stored` (default: `name`) and the tensor `name`."""
        path = self.inner.file_of(stored or name)
        return ModelFolderError(str(path), f"tensor {name!r}: {problem}")


class _QuantizedSlice:
    """A 2-D quantized weight, read by rows or columns (dim -2 / -1 too)."""

    shape: tuple[int, int]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % 2
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(f"rows/columns {start}:{start + length} outside shape {self.shape}")
        return self._read(dim, start, length)

    def read(self) -> torch.Tensor:
        return self._read(0, 0, self.shape[0])


class Fp8Slice(_QuantizedSlice):
    """float8_e4m3fn (out, in) + float32 block scales: a narrow reads only its rows (columns)
    of the weight and the scale blocks covering them."""

    def __init__(self, weight, scale_inv, block: tuple[int, int], error):
        self._weight, self._scale_inv, self.block = weight, scale_inv, block
        self.shape = tuple(weight.shape)
        if len(self.shape) != 2 or weight.dtype != torch.float8_e4m3fn:
            raise error(f"expected a 2-D float8_e4m3fn weight, got {weight.dtype} {self.shape}")
        blocks = tuple(-(-n // b) for n, b in zip(self.shape, block))
        if tuple(scale_inv.shape) != blocks or scale_inv.dtype != torch.float32:
            raise error(
                f"{SCALE_INV.lstrip('.')} is {scale_inv.dtype} {tuple(scale_inv.shape)}, expected "
                f"float32 {blocks} (blocks of {block[0]}x{block[1]} over {self.shape})"
            )

    def stored(self, dim: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (dim 0) or columns (dim 1) start:start + length as stored: float8_e4m3fn and
        the float32 scale blocks covering them (a GPU's FP8 linear keeps them so)."""
        dim = dim % 2
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(f"rows/columns {start}:{start + length} outside shape {self.shape}")
        first, count = _covering(start, length, self.block[dim])
        weight = materialize(self._weight.narrow(dim, start, length))
        return weight, materialize(self._scale_inv.narrow(dim, first, count))

    def _read(self, dim: int, start: int, length: int) -> torch.Tensor:
        origin = (start, 0) if dim == 0 else (0, start)
        return fp8.dequantize(*self.stored(dim, start, length), self.block, origin)


class Int4Slice(_QuantizedSlice):
    """Packed int32 (out, in / 8) + group scales (out, in / group_size): a narrow reads only its
    rows, or the words and scale groups covering its columns."""

    def __init__(self, packed, scale, shape: torch.Tensor, group_size: int, error):
        self._packed, self._scale, self._group_size = packed, scale, group_size
        if shape.numel() != 2:
            raise error(f"{SHAPE.lstrip('.')} holds {shape.tolist()}, expected [out, in]")
        self.shape = out, cols = tuple(int(n) for n in shape.tolist())
        words = (out, -(-cols // int4.VALUES_PER_WORD))
        if tuple(packed.shape) != words or packed.dtype != torch.int32:
            raise error(
                f"{PACKED.lstrip('.')} is {packed.dtype} {tuple(packed.shape)}, expected "
                f"int32 {words} for weight_shape {list(self.shape)}"
            )
        groups = (out, -(-cols // group_size))
        if tuple(scale.shape) != groups or not scale.dtype.is_floating_point:
            raise error(
                f"{SCALE.lstrip('.')} is {scale.dtype} {tuple(scale.shape)}, expected a float "
                f"{groups} (groups of {group_size} over weight_shape {list(self.shape)})"
            )

    def _read(self, dim: int, start: int, length: int) -> torch.Tensor:
        out, cols = self.shape
        if dim == 0:
            packed = self._packed.narrow(0, start, length)
            scale = self._scale.narrow(0, start, length)
            return int4.dequantize(materialize(packed), materialize(scale), self._group_size, cols)
        # the groups covering the columns, then their words (a group is whole words)
        first, count = _covering(start, length, self._group_size)
        begin, end = first * self._group_size, min((first + count) * self._group_size, cols)
        words = _covering(begin, end - begin, int4.VALUES_PER_WORD)
        packed = materialize(self._packed.narrow(1, *words))
        scale = materialize(self._scale.narrow(1, first, count))
        whole = int4.dequantize(packed, scale, self._group_size, end - begin)  # (out, end - begin)
        return whole[:, start - begin : start - begin + length]


def _covering(start: int, length: int, size: int) -> tuple[int, int]:
    """(first, count) of the size-long units (blocks, groups, words) covering elements
    [start, start + length)."""
    first = start // size
    return first, -(-(start + length) // size) - first


def _logical_names(stored: list[str], present: set[str], scheme: QuantScheme, error):
    """(modules stored quantized, the names the loader sees), checking that each quantized
    linear has all its parts and nothing else."""
    quantized, names = set(), []
    for name in stored:
        if scheme.method == FP8:
            if name.endswith(SCALE_INV):
                module = name.removesuffix(SCALE_INV)
                if module + ".weight" not in present:
                    raise error(name, f"a scale without its weight {module}.weight")
                quantized.add(module)
            else:
                names.append(name)
            continue
        if name.endswith(ZERO_POINT):
            raise error(name, "asymmetric int4 (a zero point) is not supported")
        module = name.removesuffix(PACKED).removesuffix(SCALE).removesuffix(SHAPE)
        if module == name:
            names.append(name)
            continue
        for part in (PACKED, SCALE, SHAPE):
            if module + part not in present:
                raise error(name, f"{module + part} is missing")
        if module + ".weight" in present:
            raise error(name, f"stored both packed and as {module}.weight")
        if name.endswith(PACKED):
            quantized.add(module)
            names.append(module + ".weight")
    return quantized, names
