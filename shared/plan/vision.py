"""Parameters of the vision towers the engine skips (it serves multimodal checkpoints text-only):
counted for the model's published total and its checkpoint's size, never loaded. From the
config's `vision_config`, as transformers builds them (tests/test_plan.py checks each formula
against transformers' own modules on the meta device)."""

import math


def vision_parameters(raw: dict) -> int:
    """Parameters of the vision tower and its projector of a config.json; 0 without one."""
    v = raw.get("vision_config")
    if not v:
        return 0
    if v.get("model_type") == "llama4_vision_model":
        return _llama4(v, int(raw["text_config"]["hidden_size"]))
    if "vt_hidden_size" in v:  # Kimi K2.5's MoonViT and its patch merger
        return _kimi_k25(v)
    raise ValueError(f"vision_config of model_type {v.get('model_type')!r} is not counted")


def _vit_layers(hidden: int, inner: int, layers: int) -> int:
    """Pre-norm ViT blocks: q, k, v, o with biases, a 2-layer MLP with biases, 2 LayerNorms."""
    attention = 4 * (hidden * hidden + hidden)
    mlp = 2 * hidden * inner + inner + hidden
    return layers * (attention + mlp + 4 * hidden)


def _llama4(v: dict, text_hidden: int) -> int:
    h, inner = int(v["hidden_size"]), int(v.get("intermediate_size", 5632))
    patch, channels = int(v["patch_size"]), int(v.get("num_channels", 3))
    patches = (int(v["image_size"]) // patch) ** 2
    embeddings = h + (patches + 1) * h + h * channels * patch * patch + 4 * h  # + LN pre/post
    shuffled = int(h / float(v.get("pixel_shuffle_ratio", 0.5)) ** 2)  # channels after shuffle
    into, out = int(v.get("projector_input_dim", 4096)), int(v.get("projector_output_dim", 4096))
    adapter = shuffled * into + into * out
    projector = int(v.get("vision_output_dim", 4096)) * text_hidden
    return _vit_layers(h, inner, int(v["num_hidden_layers"])) + embeddings + adapter + projector


def _kimi_k25(v: dict) -> int:
    h, inner, patch = int(v["vt_hidden_size"]), int(v["vt_intermediate_size"]), int(v["patch_size"])
    grid = int(v.get("init_pos_emb_height", 64)) * int(v.get("init_pos_emb_width", 64))
    embeddings = h * 3 * patch * patch + h + grid * h
    tower = embeddings + _vit_layers(h, inner, int(v["vt_num_hidden_layers"])) + 2 * h  # final LN
    merge = int(v["mm_hidden_size"]) * math.prod(map(int, v.get("merge_kernel_size", [2, 2])))
    text = int(v["text_hidden_size"])
    projector = 2 * int(v["mm_hidden_size"]) + (merge * merge + merge) + (merge * text + text)
    return tower + projector
