"""Quantized copies of a model folder (one safetensors file or shards; written as one file)
in the exact on-disk layout of real checkpoints: DeepSeek-V3's FP8 (float8_e4m3fn `weight` +
float32 `weight_scale_inv` per block) and Kimi K2.5's compressed-tensors INT4 (int32
`weight_packed` + bf16 `weight_scale` per group of 32 + int32 `weight_shape`), unquantized
tensors in bf16. Each returns the float32 weights a loader must produce: the reference
dequantization (compressed-tensors' own for INT4), which save_plain writes as a plain folder
for transformers. Weights are the folder's random ones: not trained weights (their quantized
values spread differently)."""

import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# the linears of every tiny family (attention, MLP, experts; DeepSeek-V3's kv_a_proj_with_mqa),
# not embeddings, norms, routers
LINEARS = re.compile(r"(_proj|_proj_with_mqa|\.w[123])\.weight$")
INDEX = "model.safetensors.index.json"
DEFAULT_IGNORE = ["lm_head", r"re:.*embed_tokens.*", r"re:.*(norm|gate)$"]


def is_linear(name: str) -> bool:
    return bool(LINEARS.search(name))


def fp8_config(block=(128, 128)) -> dict:
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }


def int4_config(group_size: int = 32, ignore=DEFAULT_IGNORE, **weights) -> dict:
    args = dict(num_bits=4, group_size=group_size, strategy="group", symmetric=True, type="int")
    args.update(actorder=None, block_structure=None, dynamic=False, observer="minmax")
    args.update(weights)
    group = dict(input_activations=None, output_activations=None, targets=["Linear"], weights=args)
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": group},
        "ignore": list(ignore),  # what a real quantizer left out (Tison does not read it)
        "kv_cache_scheme": None,
        "quantization_status": "compressed",
    }


def quantize_fp8(
    src: Path, dst: Path, block=(128, 128), which: Callable[[str], bool] = is_linear
) -> dict[str, torch.Tensor]:
    """`which` tensors FP8 with one scale per block (amax / 448, as DeepSeek's quantizer)."""
    stored, reference = {}, {}
    for name, weight in _tensors(src).items():
        if not which(name):
            stored[name] = weight.to(torch.bfloat16)
            reference[name] = stored[name].float()
            continue
        scale_inv = _block_amax(weight, block) / FP8_MAX  # (ceil(out / r), ceil(in / c))
        scale = _expand(scale_inv, block, weight.shape)
        q = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        stored[name], stored[name + "_scale_inv"] = q, scale_inv
        reference[name] = q.float() * scale
    _write(src, dst, stored, fp8_config(block))
    return reference


def quantize_int4(
    src: Path,
    dst: Path,
    group_size: int = 32,
    which: Callable[[str], bool] = is_linear,
    ignore=DEFAULT_IGNORE,
) -> dict[str, torch.Tensor]:
    """`which` tensors INT4 symmetric per group, quantized, packed and dequantized by
    compressed-tensors itself (the reference of the format); `ignore` goes to the config."""
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize

    args = QuantizationArgs(num_bits=4, group_size=group_size, strategy="group", symmetric=True)
    stored, reference = {}, {}
    for name, weight in _tensors(src).items():
        if not which(name):
            stored[name] = weight.to(torch.bfloat16)
            reference[name] = stored[name].float()
            continue
        module = name.removesuffix(".weight")
        amax = weight.abs().unflatten(1, (-1, group_size)).amax(-1)  # (out, in / group_size)
        scale = (amax / 7.5).clamp(min=1e-8).to(torch.bfloat16)  # the minmax observer's range
        q = quantize(weight, scale, None, args, dtype=torch.int8)
        packed = pack_to_int32(q, 4)
        stored[module + ".weight_packed"] = packed
        stored[module + ".weight_scale"] = scale
        stored[module + ".weight_shape"] = torch.tensor(weight.shape, dtype=torch.int32)
        unpacked = unpack_from_int32(packed, 4, weight.shape)
        reference[name] = dequantize(unpacked, scale.float(), None, args, dtype=torch.float32)
    _write(src, dst, stored, int4_config(group_size, ignore))
    return reference


def save_plain(reference: dict[str, torch.Tensor], quantized: Path, dst: Path) -> Path:
    """The dequantized weights as a plain float32 folder (config without quantization)."""
    _copy_others(quantized, dst)
    config = json.loads((quantized / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in reference.items()}, str(dst / "model.safetensors"))
    return dst


def save_bf16(src: Path, dst: Path) -> Path:
    """The folder with its weights cast to bf16 (what checkpoints mostly are); every other
    file, config.json included, copied as it is."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.suffix == ".safetensors":
            tensors = {k: v.to(torch.bfloat16) for k, v in load_file(path).items()}
            save_file(tensors, str(dst / path.name), metadata={"format": "pt"})
        elif path.is_file():
            shutil.copy2(path, dst / path.name)
    return dst


def _tensors(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (one file or shards)."""
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _block_amax(weight: torch.Tensor, block) -> torch.Tensor:
    rows, cols = block
    out, cin = weight.shape
    padded = torch.zeros(math.ceil(out / rows) * rows, math.ceil(cin / cols) * cols)
    padded[:out, :cin] = weight.abs()
    blocks = padded.unflatten(0, (-1, rows)).unflatten(2, (-1, cols))  # (R, r, C, c)
    return blocks.amax(dim=(1, 3)).clamp(min=1e-8)


def _expand(scale: torch.Tensor, block, shape) -> torch.Tensor:
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[: shape[0], : shape[1]]


def _write(src: Path, dst: Path, tensors: dict, quantization_config: dict) -> None:
    _copy_others(src, dst)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    config["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))


def _copy_others(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        skip = path.suffix == ".safetensors" or path.name in ("config.json", INDEX)
        if path.is_file() and not skip:
            shutil.copy2(path, dst / path.name)
