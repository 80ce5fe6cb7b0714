"""A stage's decoder layers, for decode steps, in one C call (kernels/cpu/decode_layer.py), on
every CPU tier. It takes steps whose rows all decode, bfloat16, one tensor-parallel rank (no
all-reduce inside) and linears on the C linear (kernels/cpu/linear.py); an MLP is dense or
routed experts with softmax top-k (Mixtral, Qwen3-MoE; not expert parallelism, not Llama 4's
sigmoid routing); everything else stays op by op."""

import torch

from kernels.cpu.decode_layer import DecodeLayerSpec, decode_layers
from kernels.cpu.linear import linear_max_rows
from shared.kv.cache import KVCache
from shared.models.layers.attention import AttentionMetadata
from shared.models.layers.moe import SOFTMAX


def _experts_fit(experts) -> bool:
    """Whether decode_layer.c runs these FusedMoE experts: on the C linear, on one rank (no
    all-reduce, no expert parallelism), softmax routing with each output weighted."""
    return (
        experts.c_linear
        and experts.ep is None
        and experts.tp.size == 1
        and experts.scoring == SOFTMAX
        and not experts.apply_weights_on_input
        and experts.w13.is_contiguous()
        and experts.w2.is_contiguous()
    )


def layer_spec(
    *, input_norm, qkv, q_norm, k_norm, rotary, attn, o, post_norm,
    gate_up=None, down=None, router=None, experts=None,
) -> tuple[DecodeLayerSpec, list[torch.Tensor]] | None:  # fmt: skip
    """One decoder layer's spec and the tensors it points into, or None where the fused call
    cannot run it (a linear not on the C linear, more than one tensor-parallel rank, an
    unsupported head shape or routing). Its MLP: gate_up and down (dense), or router (H -> E)
    and experts (a FusedMoE)."""
    moe = experts is not None
    linears = (qkv, o, router) if moe else (qkv, o, gate_up, down)
    if moe and not _experts_fit(experts):
        return None
    if not (
        all(getattr(m, "c_linear", False) for m in linears)
        and all(getattr(m, "tp", None) is None or m.tp.size == 1 for m in linears)
        and attn.kernel_ok
        and input_norm.weight.dtype == torch.bfloat16
    ):
        return None
    tensors = [
        input_norm.weight, qkv.weight, qkv.bias, None if q_norm is None else q_norm.weight,
        None if k_norm is None else k_norm.weight, o.weight, post_norm.weight,
        None if moe else gate_up.weight, None if moe else down.weight, rotary.cos, rotary.sin,
        router.weight if moe else None, experts.w13 if moe else None,
        experts.w2 if moe else None,
    ]  # fmt: skip
    if any(t is not None and not t.is_contiguous() for t in tensors):
        return None
    routing = (experts.num_experts, experts.top_k, int(experts.renormalize)) if moe else (0,) * 3
    spec = DecodeLayerSpec(
        *(None if t is None else t.data_ptr() for t in tensors),
        input_norm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim,
        experts.w2.shape[2] if moe else down.weight.shape[1], *routing,
        input_norm.eps, input_norm.eps if q_norm is None else q_norm.eps, attn.scale,
    )  # fmt: skip
    return spec, [t for t in tensors if t is not None]


class FusedDecoder:
    """A stage's decoder layers, for decode steps: their specs, in order, and the tensors the
    specs point into (kept alive with them)."""

    def __init__(self, specs: list[tuple[DecodeLayerSpec, list[torch.Tensor]]], rotary):
        self.specs = (DecodeLayerSpec * len(specs))(*(spec for spec, _ in specs))
        self._tensors = [t for _, tensors in specs for t in tensors]
        self.rotary = rotary

    @staticmethod
    def max_rows() -> int:
        """The most rows a fused step takes (the C linear's, which beats F.linear up to there)."""
        return linear_max_rows()

    @staticmethod
    def takes(x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step can run fused: every row decodes (a prompt's tokens too, as
        shared/engine/batch.py's prefills_as_rows makes them), in order, few enough rows."""
        d = meta.decode
        return (
            d is not None
            and d.rows is None
            and not meta.prefills
            and x.shape[0] <= FusedDecoder.max_rows()
            and x.dtype == torch.bfloat16
        )

    def __call__(
        self, positions, x: torch.Tensor, residual: torch.Tensor | None, kv: KVCache, meta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As the layers op by op: x (T, H), residual (T, H) or None (first layer) ->
        (last layer's output, residual), residual updated in place (x itself when None)."""
        self.rotary.check(positions)
        d = meta.decode
        first = residual is None
        if first:
            residual = x
        out = decode_layers(
            self.specs, x, residual, first, positions, meta.slot_mapping, kv.data,
            d.block_table, d.context_lens, d.page_size, d.window,
        )  # fmt: skip
        return out, residual
