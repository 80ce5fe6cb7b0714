"""Per-layer attention: which keys each layer's queries see and whether it rotates q and k.

Layers of one model may differ: Qwen2/3 and Gemma mix sliding-window and full layers
(`layer_types`, or Qwen2's `max_window_layers`), Llama 4 mixes chunked RoPE layers with global
NoPE ones (`attention_chunk_size`, `no_rope_layers`). `layers_from_hf` normalises those fields once;
the engine builds one step's attention metadata per distinct AttentionMask, so a model whose
layers all attend alike builds exactly one."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.errors import ModelFolderError

GLOBAL, SLIDING, CHUNKED = "global", "sliding", "chunked"
_HF_TYPES = {"full_attention": GLOBAL, "sliding_attention": SLIDING, "chunked_attention": CHUNKED}
NO_ROPE_INTERVAL = 4  # Llama 4 (HF no_rope_layer_interval): every 4th layer has no RoPE


@dataclass(frozen=True)
class AttentionMask:
    """Which keys a query at position p sees, its own included: global: [0, p]; sliding: the
    last `window`, (p - window, p]; chunked: those of its chunk, [p // window * window, p]."""

    kind: str = GLOBAL
    window: int | None = None  # sliding: keys per query; chunked: the chunk size; global: None
    # which of a request's page lists holds the KV of the layers with this mask: 0 its main
    # one; k >= 1 the k-th group of a capped chunked layer's (shared/kv/chunk_cache.py), whose
    # layers then get a metadata of their own
    group: int = 0

    def __post_init__(self) -> None:
        if self.kind not in (GLOBAL, SLIDING, CHUNKED):
            raise ValueError(f"attention mask kind {self.kind!r}")
        if (self.kind == GLOBAL) != (self.window is None) or (self.window or 1) < 1:
            raise ValueError(f"{self.kind} attention: window {self.window!r}")

    def first_key(self, position: int) -> int:
        """The first key position a query at `position` sees."""
        if self.kind == SLIDING:
            return max(0, position - self.window + 1)
        if self.kind == CHUNKED:
            return position // self.window * self.window
        return 0

    def restricts(self, num_keys: int) -> bool:
        """Whether a context of num_keys keys hides any key from a causal query (else the plain
        causal mask is this one)."""
        return self.kind != GLOBAL and num_keys > self.window

    def visible(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """query_pos (n, 1), key_pos (1, m) int64 -> (n, m) bool: True where a key is seen."""
        seen = key_pos <= query_pos
        if self.kind == SLIDING:
            seen &= key_pos > query_pos - self.window
        elif self.kind == CHUNKED:
            seen &= (
                key_pos >= torch.div(query_pos, self.window, rounding_mode="floor") * self.window
            )
        return seen


GLOBAL_MASK = AttentionMask()


@dataclass(frozen=True)
class LayerAttention:
    """One decoder layer's attention: its mask, and whether it applies RoPE to q and k."""

    mask: AttentionMask = GLOBAL_MASK
    rope: bool = True


def distinct_masks(layers: Sequence[LayerAttention]) -> tuple[AttentionMask, ...]:
    """The masks of these layers, each once, in order of first use."""
    return tuple(dict.fromkeys(layer.mask for layer in layers))


def layers_from_hf(raw: dict, num_layers: int, source: str) -> tuple[LayerAttention, ...]:
    """Each layer's attention from a (text) config.json, as transformers reads it."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    types = raw.get("layer_types") or _default_types(raw, num_layers, window, source)
    if len(types) != num_layers:
        raise ModelFolderError(source, f"layer_types has {len(types)} entries, not {num_layers}")
    rope = _rope_layers(raw, num_layers, source)
    return tuple(
        LayerAttention(_mask(t, window, raw.get("attention_chunk_size"), source), r)
        for t, r in zip(types, rope)
    )


def _default_types(raw: dict, num_layers: int, window: int | None, source: str) -> list[str]:
    """layer_types where config.json has none (transformers derives them the same way)."""
    if "max_window_layers" in raw:  # Qwen2/3: layers from max_window_layers on slide
        if not raw.get("use_sliding_window", False):
            window = None
        first = int(raw["max_window_layers"])
        return [
            "sliding_attention" if window and i >= first else "full_attention"
            for i in range(num_layers)
        ]
    if raw.get("attention_chunk_size"):  # Llama 4: chunked where RoPE is, global where not
        rope = _rope_layers(raw, num_layers, source)
        return ["chunked_attention" if r else "full_attention" for r in rope]
    return ["sliding_attention" if window else "full_attention"] * num_layers  # Mistral


def _rope_layers(raw: dict, num_layers: int, source: str) -> list[bool]:
    """Llama 4's no_rope_layers (1: the layer uses RoPE, 0: NoPE), or one NoPE layer every
    no_rope_layer_interval; every layer rotates in other families."""
    flags = raw.get("no_rope_layers")
    if not flags and str(raw.get("model_type", "")).startswith("llama4"):
        interval = int(raw.get("no_rope_layer_interval") or NO_ROPE_INTERVAL)
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not flags:
        return [True] * num_layers
    if len(flags) != num_layers:
        raise ModelFolderError(source, f"no_rope_layers has {len(flags)} entries, not {num_layers}")
    return [bool(f) for f in flags]


def _mask(hf_type: str, window: int | None, chunk: int | None, source: str) -> AttentionMask:
    kind = _HF_TYPES.get(hf_type)
    if kind is None:
        raise ModelFolderError(
            source, f"layer type {hf_type!r} is not supported (supported: {', '.join(_HF_TYPES)})"
        )
    size = {GLOBAL: None, SLIDING: window, CHUNKED: chunk}[kind]
    if not size:  # global; or as transformers, a sliding layer without a window is full
        return GLOBAL_MASK
    return AttentionMask(kind, int(size))
