"""The quantization scheme of a model folder, read once from config.json's
`quantization_config` (top level, or `text_config`'s as in Kimi K2.5). Two schemes load:
FP8 e4m3 with 2-D block scales (DeepSeek-V3) and compressed-tensors pack-quantized INT4 with
symmetric per-group scales (Kimi K2.5). Anything else is refused up front, naming the field."""

import math
import re
from dataclasses import dataclass

from shared.errors import ModelFolderError

FP8 = "fp8"
COMPRESSED_TENSORS = "compressed-tensors"
PACK_QUANTIZED = "pack-quantized"


@dataclass(frozen=True)
class QuantScheme:
    """How a folder's quantized linears are stored (which ones: those with scale tensors)."""

    method: str  # FP8 or COMPRESSED_TENSORS (quant_method)
    format: str  # "e4m3" (fp8's fmt) or PACK_QUANTIZED (compressed-tensors' format)
    bits: int  # bits per stored weight: 8 (fp8) or 4
    block: tuple[int, int] | None  # fp8: (rows, cols) of the weight sharing one scale
    group_size: int | None  # int4: consecutive input features sharing one scale
    symmetric: bool  # no zero point: weight = q * scale
    ignore: tuple[str, ...] = ()  # modules left unquantized (names or `re:` patterns)

    def quantizes(self, module: str) -> bool:
        """Whether the linear `module` (a checkpoint name, e.g. model.layers.3.mlp.experts.0.
        gate_proj) is stored quantized: fp8 checkpoints quantize every linear of the decoder
        layers; compressed-tensors every one its `ignore` does not name (a name, matched at
        the end, or `re:` a pattern matched from the start, as compressed-tensors does)."""
        for rule in self.ignore:
            if rule.startswith("re:"):
                if re.match(rule[3:], module):
                    return False
            elif module == rule or module.endswith("." + rule):
                return False
        return ".layers." in module

    def stored_bytes(self, out_features: int, in_features: int) -> dict[str, int]:
        """Bytes of one quantized (out, in) linear as stored and as kernels keep it, by stored
        format: its values (float8_e4m3fn, or int4 packed in int32 words), its scales
        (float32 per block, bfloat16 per group) and int4's int32 [2] weight_shape."""
        if self.method == FP8:
            rows, cols = self.block
            blocks = math.ceil(out_features / rows) * math.ceil(in_features / cols)
            return {"float8_e4m3fn": out_features * in_features, "float32": 4 * blocks}
        groups = out_features * math.ceil(in_features / self.group_size)
        values = out_features * in_features * self.bits // 8
        return {"int4": values, "bfloat16": 2 * groups, "int32": 8}

    def describe(self) -> str:
        """One line for `tison inspect`."""
        if self.method == FP8:
            rows, cols = self.block
            return f"{self.method} {self.format}, {self.bits} bits, block {rows}x{cols}, symmetric"
        kind = "symmetric" if self.symmetric else "asymmetric"
        return (
            f"{self.method} {self.format}, int{self.bits}, group {self.group_size}, {kind}, "
            f"{len(self.ignore)} ignore rules"
        )


def read_scheme(raw: dict, source: str = "config.json") -> QuantScheme | None:
    """The scheme of a config.json dict (None: not quantized). Raises ModelFolderError(source)
    naming the `quantization_config` field that Tison cannot load."""
    qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == FP8:
        return _fp8(qc, source)
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors(qc, source)
    raise _unsupported(source, "quant_method", method, f"{FP8}, {COMPRESSED_TENSORS}")


def _fp8(qc: dict, source: str) -> QuantScheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _unsupported(source, "fmt", fmt, "e4m3")
    activations = qc.get("activation_scheme", "dynamic")
    if activations != "dynamic":  # static: per-tensor input scales we would ignore
        raise _unsupported(source, "activation_scheme", activations, "dynamic")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(_positive(b) for b in block)):
        raise _unsupported(source, "weight_block_size", block, "[rows, cols] of positive ints")
    return QuantScheme(FP8, fmt, 8, (block[0], block[1]), None, True)


def _compressed_tensors(qc: dict, source: str) -> QuantScheme:
    fmt = qc.get("format")
    if fmt != PACK_QUANTIZED:
        raise _unsupported(source, "format", fmt, PACK_QUANTIZED)
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _unsupported(source, "config_groups", f"{len(groups)} groups", "exactly one group")
    name, group = next(iter(groups.items()))
    field = f"config_groups.{name}"
    if group.get("input_activations") is not None:
        raise _unsupported(source, f"{field}.input_activations", "set", "null (weight-only)")
    weights = group.get("weights") or {}
    expected = {"num_bits": 4, "type": "int", "strategy": "group", "symmetric": True}
    for key, want in expected.items():
        if weights.get(key) != want:
            raise _unsupported(source, f"{field}.weights.{key}", weights.get(key), want)
    group_size = weights.get("group_size")
    if not _positive(group_size) or group_size % 8:  # a group is whole int32 words
        raise _unsupported(source, f"{field}.weights.group_size", group_size, "a multiple of 8")
    ignore = tuple(qc.get("ignore") or ())
    return QuantScheme(COMPRESSED_TENSORS, fmt, 4, None, group_size, True, ignore)


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _unsupported(source: str, field: str, value, supported) -> ModelFolderError:
    return ModelFolderError(
        source, f"quantization_config.{field} = {value!r} is not supported (supported: {supported})"
    )
