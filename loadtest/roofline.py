"""The bytes a decode step reads, for rooflines: a step streams every linear weight once (the
LM head included), one embedding row per token (not the table), each sequence's K and V of
every layer, and writes the logits. Benchmarks divide measured GB/s by these bytes; the
embedding table of an untied model (a sixth of the bench model) is not read by a decode step,
so counting it, as a plain parameter count does, inflates the share.

A mixture of experts reads only its active experts: at batch 1 the top-k of each layer; at
batch B the experts any of the B tokens chose, E * (1 - (1 - k/E)^B) of them in expectation
under uniform routing (the active-bytes roofline), the router's weights and a shared expert
where there is one (Llama 4). Llama 4's chunked layers read at most their chunk of KV; this
counts every key (an overcount of ~1% at the benchmark's contexts)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaShape:
    """What the byte count needs of a Llama-shaped config (HF field names in from_fields)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    experts: int = 0  # routed experts per layer (Mixtral's num_local_experts); 0: dense
    top_k: int = 0  # experts per token
    expert_intermediate: int = 0  # each expert's intermediate size (Mixtral: intermediate_size)
    shared_intermediate: int = 0  # a shared expert's beside them (Llama 4); 0: none

    @classmethod
    def from_fields(cls, f: dict) -> "LlamaShape":
        heads = f["num_attention_heads"]
        experts = f.get("num_local_experts") or f.get("num_experts") or 0
        llama4 = f.get("model_type", "").startswith("llama4")
        if llama4 and f.get("interleave_moe_layer_step", 1) != 1:
            raise ValueError("roofline: Llama 4 with dense layers between the MoE ones")
        return cls(
            vocab=f["vocab_size"], hidden=f["hidden_size"], intermediate=f["intermediate_size"],
            layers=f["num_hidden_layers"], heads=heads,
            kv_heads=f.get("num_key_value_heads", heads),
            head_dim=f.get("head_dim") or f["hidden_size"] // heads,
            tied=f.get("tie_word_embeddings", False),
            experts=experts, top_k=f.get("num_experts_per_tok", 0) if experts else 0,
            expert_intermediate=(
                f.get("moe_intermediate_size") or f["intermediate_size"] if experts else 0
            ),
            shared_intermediate=f["intermediate_size"] if llama4 else 0,
        )  # fmt: skip

    def active_experts(self, batch: int) -> float:
        """Experts a decode step of `batch` tokens reads per layer (uniform routing)."""
        if batch == 1:
            return float(self.top_k)
        return self.experts * (1 - (1 - self.top_k / self.experts) ** batch)

    def layer_weights(self, batch: int = 1) -> float:
        """Elements of one decoder layer's linears and norms that a step of `batch` reads."""
        h, hd = self.hidden, self.head_dim
        qkv = h * (self.heads + 2 * self.kv_heads) * hd
        attention = qkv + self.heads * hd * h + 2 * h
        if not self.experts:
            return attention + 3 * h * self.intermediate
        expert = 3 * h * self.expert_intermediate
        shared = 3 * h * self.shared_intermediate
        return attention + h * self.experts + self.active_experts(batch) * expert + shared


def decode_step_bytes(shape: LlamaShape, contexts: list[int], weight_bytes: int = 2) -> float:
    """Bytes one decode step of len(contexts) sequences reads and writes: the sequences'
    contexts (keys attended, the new one included), elements of weight_bytes bytes (weights
    and KV alike), float32 logits."""
    batch = len(contexts)
    weights = shape.layers * shape.layer_weights(batch) + shape.hidden  # + the final norm
    weights += shape.vocab * shape.hidden  # the LM head (the tied embedding is this table)
    embedding_rows = batch * shape.hidden
    kv = sum(contexts) * shape.layers * 2 * shape.kv_heads * shape.head_dim
    logits = batch * shape.vocab * 4
    return (weights + embedding_rows + kv) * weight_bytes + logits


def mean_step_bytes(shape: LlamaShape, batch: int, prompt: int, new_tokens: int, wb=2) -> float:
    """decode_step_bytes averaged over the decode steps after a prompt of `prompt` tokens (the
    first new token comes from the prefill): contexts prompt + 1 ... prompt + new_tokens - 1."""
    steps = [decode_step_bytes(shape, [prompt + s] * batch, wb) for s in range(1, new_tokens)]
    return sum(steps) / len(steps)
