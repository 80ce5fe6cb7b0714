"""A Llama-3.1-8B-shaped model folder with random bf16 weights, for the decode timing: the real
config (tests/gpu/llama-3.1-8b.json, a copy of the fixture) with fewer layers if asked, its
tensors drawn on the device and written by safetensors, a few layers a file. It goes to
/dev/shm when that has room (no disk in the way of the load), else under the check's folder."""

import json
import shutil
from pathlib import Path

from device_common import GPU_TESTS

CONFIG = GPU_TESTS / "llama-3.1-8b.json"
LAYERS_PER_FILE = 4
BF16_BYTES = 2


def llama_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor of a Llama config (no bias, untied head)."""
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, q),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return shapes


def weight_bytes_read(shapes: dict[str, tuple[int, ...]]) -> int:
    """Bytes a decode step reads of the weights: all but the embedding (a row per token)."""
    total = 0
    for name, shape in shapes.items():
        if name != "model.embed_tokens.weight":
            numel = 1
            for n in shape:
                numel *= n
            total += numel * BF16_BYTES
    return total


def folder_root(workdir: Path, nbytes: int) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > nbytes + (4 << 30):
        return shm
    return workdir


def build_llama_folder(
    workdir: Path, layers: int, device: str, **overrides
) -> tuple[Path, dict[str, tuple[int, ...]]]:
    """(the folder, its tensors' shapes); the caller removes the folder."""
    import torch

    cfg = json.loads(CONFIG.read_text()) | {"num_hidden_layers": layers, **overrides}
    shapes = llama_shapes(cfg)
    nbytes = sum(BF16_BYTES * torch.Size(s).numel() for s in shapes.values())
    folder = folder_root(workdir, nbytes) / f"tison-device-check-llama-{layers}l"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    try:
        write_tensors(folder, shapes, device)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder, shapes


def write_tensors(folder: Path, shapes: dict[str, tuple[int, ...]], device: str) -> None:
    """Random bf16 tensors of std 0.02 (norms: ones), drawn on `device`, LAYERS_PER_FILE
    layers a file and the embedding, final norm and head in one more."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator(device=device).manual_seed(0)
    groups: dict[str, list[str]] = {}
    for name in shapes:
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        key = "rest" if layer is None else f"{int(layer) // LAYERS_PER_FILE:03d}"
        groups.setdefault(key, []).append(name)
    for key, names in groups.items():
        tensors = {}
        for name in names:
            shape = shapes[name]
            if len(shape) == 1:  # norms
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                w = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
                tensors[name] = (w * 0.02).cpu()
        save_file(tensors, str(folder / f"model-{key}.safetensors"), metadata={"format": "pt"})
