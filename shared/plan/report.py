"""What `tison plan` reports: a JSON-able dict of the model's bytes by component, its KV per token,
each candidate shape on the chosen device count, the fewest devices, the suggested prefill and
decode shapes; and that dict as the table the command prints."""

import json
from pathlib import Path

import torch

from shared.engine.config import DEFAULT_MEMORY_RESERVE_BYTES, DTYPES
from shared.engine.footprint import COMPONENTS, stage_footprints
from shared.errors import InvalidRequestError, ModelFolderError
from shared.models.config import ModelConfig
from shared.models.quant.scheme import read_scheme
from shared.parallel.shape import ParallelConfig
from shared.plan.devices import CPU, DEFAULT_GPU_RESERVE, DEVICES, GiB
from shared.plan.planner import ShapePlan, fewest_devices, plan_devices, suggest
from shared.plan.vision import vision_parameters

# what Tison's codec saves of each stored format: README's measurements on trained weights
# (all-MiniLM-L6-v2, BF16 33.70%, FP8 17.53%); int4 words are stored raw (shared/codec), and
# other formats (scales, float32) are counted unsaved
CODEC_SAVING = {"bfloat16": 0.3370, "float8_e4m3fn": 0.1753}


def read_config(path: Path) -> ModelConfig:
    """config.json, or a folder's."""
    path = Path(path)
    if path.is_dir():
        return ModelConfig.from_dir(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelFolderError(str(path), f"not a readable config.json ({e})") from e
    return ModelConfig.from_dict(raw, source=str(path))


def build_report(
    model: Path, gpu: str, gpus: int | None, memory: int | None, reserve: int | None,
    context: int, concurrency: int, dtype: str = "auto", codec: bool = False,
) -> dict:  # fmt: skip
    cfg = read_config(model)
    if gpu == CPU and memory is None:
        raise InvalidRequestError("--memory", "the cpu device needs its memory (e.g. 64GiB)")
    device_memory = memory or DEVICES[gpu].memory_bytes
    if reserve is None:
        reserve = DEFAULT_MEMORY_RESERVE_BYTES if gpu == CPU else DEFAULT_GPU_RESERVE
    if context < 1 or concurrency < 1:
        raise InvalidRequestError("--context/--concurrency", "must be >= 1")
    torch_dtype = DTYPES.get(dtype) or _checkpoint_dtype(cfg)
    packed = gpu != CPU  # the CPU engine dequantizes at load; GPU kernels keep them packed
    whole = stage_footprints(cfg, ParallelConfig(), torch_dtype, packed=packed)[0]
    args = (device_memory, reserve, torch_dtype, context)
    found = fewest_devices(cfg, whole.weight_bytes, *args, concurrency, packed)
    fewest, plans = found or (None, [])
    devices = gpus or fewest
    if devices is not None and devices != fewest:
        plans = plan_devices(cfg, devices, *args, packed)
    prefill, decode = suggest(plans, concurrency)
    vision = vision_parameters(cfg.raw)
    scheme = read_scheme(cfg.raw)
    params = whole.parameters
    report = {
        "model": str(model),
        "architecture": cfg.architecture,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "quantization": None if scheme is None else scheme.describe(),
        "quantized_as": "stored (packed)" if packed else "dequantized at load",
        "parameters": {"served": params, "vision_not_loaded": vision, "total": params + vision},
        "bytes_by_component": whole.by_component,
        "weight_bytes": whole.weight_bytes,
        "kv_bytes_per_token": whole.kv.growing,
        "kv_windowed_bytes_per_token": whole.kv.windowed,
        "kv_window": whole.kv.window,
        "kv_layout": _kv_layout(cfg),
        "device": gpu,
        "device_memory": device_memory,
        "reserve_per_device": reserve,
        "context": context,
        "concurrency": concurrency,
        "fewest_devices": fewest,
        "devices": devices,
        "shapes": [_shape_dict(p, concurrency) for p in plans],
        "prefill": None if prefill is None else prefill.label,
        "decode": None if decode is None else decode.label,
    }
    if codec:  # the checkpoint as the engine's dtype stores it, vision tower aside
        stored = (
            whole
            if packed
            else stage_footprints(cfg, ParallelConfig(), torch_dtype, packed=True)[0]
        ).by_format
        coded = sum(n * (1 - CODEC_SAVING.get(fmt, 0.0)) for fmt, n in stored.items())
        report["codec"] = {"stored_bytes": sum(stored.values()), "coded_bytes": int(coded),
                           "stored_by_format": stored}  # fmt: skip
    return report


def _checkpoint_dtype(cfg: ModelConfig) -> torch.dtype:
    """The dtype config.json names (torch_dtype / dtype), else bfloat16: the dtype of every
    checkpoint planned for GPUs that names none (Kimi K2.5's unquantized tensors)."""
    named = cfg.raw.get("torch_dtype") or cfg.raw.get("dtype")
    return DTYPES.get(str(named), torch.bfloat16)


def _kv_layout(cfg: ModelConfig) -> str:
    if cfg.mla is not None:
        m = cfg.mla
        return (f"MLA: latent {m.kv_lora_rank} + RoPE part {m.qk_rope_head_dim} values a token "
                "and layer, whole on every TP rank")  # fmt: skip
    return (f"MHA: K and V of {cfg.num_kv_heads} KV heads x {cfg.head_dim} a token and layer, "
            "split across TP ranks by head")  # fmt: skip


def _shape_dict(p: ShapePlan, concurrency: int) -> dict:
    return {
        "shape": p.label,
        "tp": p.shape.tp,
        "pp": p.shape.pp,
        "ep": p.shape.ep,
        "dp": p.shape.dp,
        "weight_bytes_per_device": p.weight_bytes,
        "kv_bytes": p.kv_bytes,
        "kv_tokens": p.kv_tokens,
        "max_concurrency": p.max_concurrency,
        "engine_pages": p.engine_pages,
        "fits": p.fits and p.max_concurrency >= concurrency,
    }


def format_report(r: dict) -> str:
    p = r["parameters"]
    lines = [
        f"{r['architecture']} ({r['model']}), {r['dtype']}"
        + (f"; {r['quantization']}, {r['quantized_as']}" if r["quantization"] else ""),
        f"parameters: {p['served'] / 1e9:,.2f}B served"
        + (
            f" + {p['vision_not_loaded'] / 1e9:,.2f}B vision tower (not loaded) = "
            f"{p['total'] / 1e9:,.2f}B"
            if p["vision_not_loaded"]
            else ""
        ),  # fmt: skip
        "",
        f"{'component':<16}{'bytes':>12}",
    ]
    for name in COMPONENTS:
        if r["bytes_by_component"][name]:
            lines.append(f"{name:<16}{_gib(r['bytes_by_component'][name]):>12}")
    lines.append(f"{'total':<16}{_gib(r['weight_bytes']):>12}")
    kv = f"KV: {r['kv_bytes_per_token']:,} B a token ({r['kv_layout']})"
    if r["kv_windowed_bytes_per_token"]:
        kv += (f"; + {r['kv_windowed_bytes_per_token']:,} B a token of the last "
               f"{r['kv_window']:,} only (windowed/chunked layers, capped)")  # fmt: skip
    lines += ["", kv, ""]
    if "codec" in r:
        c = r["codec"]
        formats = ", ".join(f"{fmt} {_gib(n)}" for fmt, n in c["stored_by_format"].items())
        lines += [f"checkpoint: {_gib(c['stored_bytes'])} ({formats}); with Tison's codec "
                  f"~{_gib(c['coded_bytes'])} to store and move (decoded at load)", ""]  # fmt: skip
    device = f"{r['device']} ({_gib(r['device_memory'])})"
    lines.append(f"device: {device}, reserve {_gib(r['reserve_per_device'])} a device, "
                 f"context {r['context']:,}, concurrency {r['concurrency']}")  # fmt: skip
    if r["fewest_devices"] is None:
        lines.append("does not fit on up to 64 devices")
        return "\n".join(lines)
    lines.append(f"fewest devices: {r['fewest_devices']}")
    lines += ["", f"on {r['devices']} x {r['device']}:",
              f"{'shape':<14}{'weights/dev':>12}{'KV left':>12}{'KV tokens':>12}"
              f"{'seqs@ctx':>10}  fits"]  # fmt: skip
    for s in r["shapes"]:
        lines.append(
            f"{s['shape']:<14}{_gib(s['weight_bytes_per_device']):>12}{_gib(s['kv_bytes']):>12}"
            f"{s['kv_tokens']:>12,}{s['max_concurrency']:>10,}  {'yes' if s['fits'] else 'no'}"
        )
    lines += ["", f"suggested: prefill {r['prefill']}, decode {r['decode']}"]
    return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GiB:,.1f} GiB"
