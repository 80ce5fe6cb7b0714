"""What a model folder's quantization stores, from tensor headers only (no data read): for
`tison inspect` on plain, quantized and compressed folders."""

import json
import math
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from shared.codec.folder import TensorRecord, itemsize, safetensors_files
from shared.errors import ModelFolderError
from shared.models.quant.checkpoint import PACKED, SCALE, SCALE_INV, SHAPE
from shared.models.quant.scheme import FP8, QuantScheme, read_scheme

BF16_BYTES = 2


@dataclass(frozen=True)
class QuantSummary:
    """Bytes of a folder's tensors, split into quantized linears (all their stored parts) and
    everything else."""

    scheme: QuantScheme | None  # None: config.json has no quantization_config
    # (module, stored bytes: weight + scales (+ int4 shape), bytes in bf16) of each quantized
    # linear, sorted by module
    linears: tuple[tuple[str, int, int], ...]
    num_unquantized: int  # every other tensor
    unquantized_bytes: int

    @property
    def num_quantized(self) -> int:
        return len(self.linears)

    @property
    def quantized_bytes(self) -> int:
        return sum(stored for _, stored, _ in self.linears)

    @property
    def dequantized_bytes(self) -> int:
        """The quantized linears in bf16: what loading holds of them in RAM."""
        return sum(bf16 for _, _, bf16 in self.linears)


def summarize_folder(folder: Path, records: list[TensorRecord] | None = None) -> QuantSummary:
    """records: a compressed folder's (inspect_dir); None reads the safetensors headers."""
    folder = Path(folder)
    config = folder / "config.json"
    try:
        raw = json.loads(config.read_text()) if config.is_file() else {}
    except ValueError as e:
        raise ModelFolderError(str(config), f"not valid JSON ({e})") from e
    scheme = read_scheme(raw, str(config))
    tensors = (
        {r.name: (r.shape, r.original_bytes) for r in records}
        if records is not None
        else _header_tensors(folder)
    )
    if not tensors:
        raise ModelFolderError(str(folder), "no *.safetensors weights")
    return summarize(scheme, tensors)


def summarize(scheme: QuantScheme | None, tensors: dict[str, tuple[tuple, int]]) -> QuantSummary:
    """tensors: stored name -> (shape, bytes). A quantized linear: a module with its fp8
    weight and scale_inv, or its int4 packed words (+ scale and shape, counted where stored)."""
    quantized, linears = set(), []
    if scheme is not None:
        int4 = scheme.method != FP8
        primary, companions = (PACKED, (SCALE, SHAPE)) if int4 else (".weight", (SCALE_INV,))
        marker = PACKED if int4 else SCALE_INV
        modules = {n.removesuffix(marker) for n in tensors if n.endswith(marker)}
        modules = {m for m in modules if m + primary in tensors}
        for module in sorted(modules):
            parts = [module + s for s in (primary, *companions) if module + s in tensors]
            quantized.update(parts)
            # int4: the input features rounded up to whole words
            values = math.prod(tensors[module + primary][0]) * (8 if int4 else 1)
            linears.append((module, sum(tensors[p][1] for p in parts), values * BF16_BYTES))
    others = [nbytes for n, (_, nbytes) in tensors.items() if n not in quantized]
    return QuantSummary(scheme, tuple(linears), len(others), sum(others))


def _header_tensors(folder: Path) -> dict[str, tuple[tuple, int]]:
    tensors = {}
    for rel in safetensors_files(folder):
        try:
            with safe_open(str(folder / rel), framework="pt") as f:
                for name in f.keys():
                    lazy = f.get_slice(name)
                    shape = tuple(lazy.get_shape())
                    tensors[name] = shape, math.prod(shape) * itemsize(lazy.get_dtype())
        except (OSError, ValueError, KeyError) as e:
            raise ModelFolderError(str(folder / rel), f"unreadable safetensors header ({e})") from e
    return tensors
