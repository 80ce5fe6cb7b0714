"""The MoE layer: router policies against a brute-force reference, FusedMoE against a per-token
loop, its tensor-parallel shards, its weight loader's checkpoint layouts, and the C linear on
bf16 reading only the active experts."""

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import library
from kernels.cpu.linear import linear_fits, linear_max_rows
from shared.models.layers import cpu_linear, moe
from shared.models.layers.moe import (
    DOWN,
    DOWN_T,
    GATE,
    GATE_UP,
    GATE_UP_T,
    SIGMOID,
    SOFTMAX,
    UP,
    FusedMoE,
    route,
)
from shared.models.packing import pad_experts
from shared.parallel.group import SINGLE, TPGroup

E, H, I = 8, 64, 32  # noqa: E741


def brute_route(logits, k, scoring, renormalize):
    """Per token: rank the experts by score in Python, keep the first k."""
    weights, ids = [], []
    for row in logits.float().tolist():
        scores = torch.tensor(row).softmax(0).tolist() if scoring == SOFTMAX else row
        best = sorted(range(len(row)), key=lambda e: -scores[e])[:k]
        w = [
            scores[e] if scoring == SOFTMAX else float(torch.tensor(row[e]).sigmoid()) for e in best
        ]
        if renormalize:
            w = [v / sum(w) for v in w]
        weights.append(w)
        ids.append(best)
    return torch.tensor(weights), torch.tensor(ids)


@pytest.mark.parametrize(
    "k,scoring,renormalize", [(2, SOFTMAX, True), (4, SOFTMAX, False), (1, SIGMOID, False)]
)
def test_route_matches_brute_force(k, scoring, renormalize):
    logits = torch.randn(13, E, generator=torch.Generator().manual_seed(k))
    weights, ids = route(logits, k, scoring, renormalize)
    ref_w, ref_ids = brute_route(logits, k, scoring, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (13, k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w)


def random_moe(k=2, scoring=SOFTMAX, renormalize=True, on_input=False, tp=SINGLE, seed=0):
    layer = FusedMoE(E, k, H, I, torch.float32, tp, scoring, renormalize, on_input)
    g = torch.Generator().manual_seed(seed)
    full13, full2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    layer.weight_loader(layer.w13, full13, (None, GATE_UP))
    layer.weight_loader(layer.w2, full2, (None, DOWN))
    return layer, full13, full2


def per_token_reference(x, logits, full13, full2, k, scoring, renormalize, on_input):
    """Each token through each of its k experts, one at a time."""
    weights, ids = brute_route(logits, k, scoring, renormalize)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            h = x[t] * w if on_input else x[t]
            gate, up = (full13[e] @ h).chunk(2)
            y = full2[e] @ (F.silu(gate) * up)
            out[t] += y if on_input else w * y
    return out


@pytest.mark.parametrize(
    "k,scoring,renormalize,on_input",
    [(2, SOFTMAX, True, False), (3, SOFTMAX, False, False), (1, SIGMOID, False, True)],
)
@pytest.mark.parametrize("T", [1, 5, 40])
def test_fused_moe_matches_per_token_loop(T, k, scoring, renormalize, on_input):
    layer, full13, full2 = random_moe(k, scoring, renormalize, on_input)
    g = torch.Generator().manual_seed(T)
    x, logits = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
    ref = per_token_reference(x, logits, full13, full2, k, scoring, renormalize, on_input)
    torch.testing.assert_close(layer(x, logits), ref, rtol=1e-4, atol=1e-3)


class _Sum:
    """A stand-in process group: all_reduce leaves each rank's partial sum, summed by the test."""

    def allreduce(self, tensors):
        return self

    def wait(self):
        pass


def test_tp_ranks_sum_to_the_whole():
    whole, _, _ = random_moe()
    g = torch.Generator().manual_seed(1)
    x, logits = torch.randn(9, H, generator=g), torch.randn(9, E, generator=g)
    parts = [random_moe(tp=TPGroup(r, 2, _Sum()))[0] for r in range(2)]
    assert parts[0].w13.shape == (E, I, H) and parts[0].w2.shape == (E, H, I // 2)
    # rank r's gate rows then up rows: the whole's gate and up rows of its half of I
    half = I // 2
    torch.testing.assert_close(parts[1].w13[:, :half], whole.w13[:, half:I])
    torch.testing.assert_close(parts[1].w13[:, half:], whole.w13[:, I + half :])
    total = sum(p(x, logits) for p in parts)
    torch.testing.assert_close(total, whole(x, logits), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rank", [0, 1])
def test_checkpoint_layouts_load_alike(rank):
    """Per-expert nn.Linear tensors (Mixtral w1/w3/w2, Qwen3-MoE gate/up/down_proj), the fused
    (E, 2I, H) / (E, H, I) tensors, and Llama 4's transposed (E, H, 2I) / (E, I, H) give the
    same shard."""
    tp = TPGroup(rank, 2, _Sum())
    ref, full13, full2 = random_moe(tp=tp)
    per_expert = FusedMoE(E, 2, H, I, torch.float32, tp)
    for e in range(E):
        per_expert.weight_loader(per_expert.w13, full13[e, :I], (e, GATE))
        per_expert.weight_loader(per_expert.w13, full13[e, I:], (e, UP))
        per_expert.weight_loader(per_expert.w2, full2[e], (e, DOWN))
    llama4 = FusedMoE(E, 1, H, I, torch.float32, tp, SIGMOID, False, True)
    llama4.weight_loader(llama4.w13, full13.transpose(1, 2).contiguous(), (None, GATE_UP_T))
    llama4.weight_loader(llama4.w2, full2.transpose(1, 2).contiguous(), (None, DOWN_T))
    for other in (per_expert, llama4):
        assert torch.equal(other.w13, ref.w13) and torch.equal(other.w2, ref.w2)


def test_weight_loader_rejects_a_wrong_shape():
    layer = FusedMoE(E, 2, H, I, torch.float32)
    with pytest.raises(ValueError, match="does not match"):
        layer.weight_loader(layer.w13, torch.zeros(I, H + 1), (0, GATE))


@pytest.mark.skipif(not library.usable(torch.zeros(1)), reason="no C kernels on this machine")
@pytest.mark.parametrize("T", [1, 3, 2 * linear_max_rows() + 1])
def test_bf16_c_linear_reads_only_active_experts(T, monkeypatch):
    """bf16 on the C linear (few rows per expert) or torch (many): close to float32, and only
    the routed experts' weights are touched."""
    layer, full13, full2 = random_moe()
    bf = FusedMoE(E, 2, H, I, torch.bfloat16)
    bf.w13.data.copy_(full13)
    bf.w2.data.copy_(full2)
    bf.c_linear = True
    g = torch.Generator().manual_seed(T)
    x, logits = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
    ref = layer(x.bfloat16().float(), logits)
    read, kernel_rows = [], []
    plain, plain_kernel = moe.linear, cpu_linear.linear_bf16

    def spy(module, x, weight, bias=None):
        read.append(weight.data_ptr())
        return plain(module, x, weight, bias)

    def spy_kernel(x, weight, bias):
        kernel_rows.append(x.shape[0])
        return plain_kernel(x, weight, bias)

    monkeypatch.setattr(moe, "linear", spy)
    monkeypatch.setattr(cpu_linear, "linear_bf16", spy_kernel)
    out = bf(x.bfloat16(), logits)
    scale = ref.abs().max()
    assert (out.float() - ref).abs().max() < 0.02 * scale
    active = route(logits, 2, SOFTMAX, True)[1].unique().tolist()
    assert sorted(set(read)) == sorted(
        p for e in active for p in (bf.w13[e].data_ptr(), bf.w2[e].data_ptr())
    )
    if T <= linear_max_rows():  # every expert's rows few enough for the C linear
        assert len(kernel_rows) == 2 * len(active)


@pytest.mark.skipif(not library.usable(torch.zeros(1)), reason="no C kernels on this machine")
def test_experts_of_an_unaligned_share_are_padded_for_the_c_linear():
    """A TP rank's share of each expert's I (here 16 of 32) that the C linear cannot take as
    w2's input: packing.pad_experts adds zero rows at the end of each expert's gate and up
    halves and zero columns at the end of w2; the C linear then takes them, and the outputs
    are the unpadded experts' (torch's, on the weights widened) within bf16's rounding. An
    aligned share is left as it is."""
    tp = TPGroup(1, 2, _Sum())
    ref, _, _ = random_moe(tp=tp)
    bf = FusedMoE(E, 2, H, I, torch.bfloat16, tp)
    bf.w13.data.copy_(ref.w13), bf.w2.data.copy_(ref.w2)
    g = torch.Generator().manual_seed(3)
    x, logits = torch.randn(5, H, generator=g).bfloat16(), torch.randn(5, E, generator=g)
    before = bf(x, logits)
    pad_experts(bf)
    half, padded = I // 2, 32
    assert bf.w13.shape == (E, 2 * padded, H) and bf.w2.shape == (E, H, padded)
    rows = bf.w13.view(E, 2, padded, H)
    assert torch.equal(rows[:, :, :half], ref.w13.bfloat16().view(E, 2, half, H))
    assert torch.equal(bf.w2[..., :half], ref.w2.bfloat16())
    assert not rows[:, :, half:].any() and not bf.w2[..., half:].any()
    assert bf.w13.weight_loader == bf.w2.weight_loader == bf.weight_loader
    assert linear_fits(bf.w13[0]) and linear_fits(bf.w2[0])
    bf.c_linear = True
    after = bf(x, logits)
    assert (after.float() - before.float()).abs().max() < 0.02 * before.float().abs().max()
    aligned = FusedMoE(E, 2, H, I, torch.bfloat16)
    w13 = aligned.w13
    pad_experts(aligned)
    assert aligned.w13 is w13


@pytest.mark.parametrize("rank", [0, 1])
def test_expert_parallel_ranks_hold_whole_experts(rank):
    """--ep: rank r holds experts [r * E/2, (r + 1) * E/2) whole, from any checkpoint layout;
    the token exchange itself is tested on real ranks (test_moe_ep.py) and end to end
    (test_moe_models.py, test_llama4.py)."""
    whole, full13, full2 = random_moe()
    tp = TPGroup(rank, 2, _Sum(), expert_parallel=True)
    mine = slice(rank * E // 2, (rank + 1) * E // 2)
    stacked = random_moe(tp=tp)[0]
    per_expert = FusedMoE(E, 2, H, I, torch.float32, tp)
    for e in range(E):
        per_expert.weight_loader(per_expert.w13, full13[e, :I], (e, GATE))
        per_expert.weight_loader(per_expert.w13, full13[e, I:], (e, UP))
        per_expert.weight_loader(per_expert.w2, full2[e], (e, DOWN))
    for layer in (stacked, per_expert):
        assert layer.w13.shape == (E // 2, 2 * I, H) and layer.w2.shape == (E // 2, H, I)
        assert torch.equal(layer.w13, whole.w13[mine]) and torch.equal(layer.w2, whole.w2[mine])


def test_route_breaks_exact_ties_toward_the_lower_expert():
    """bf16 router logits tie exactly now and then: the lower id wins, as in the fused
    decoder's moe.c (topk's own choice follows its partial sort)."""
    logits = torch.tensor([[3.0, 2.0, 2.0, 0.5, 0.0, 0.0, 0.0, 0.0]]).bfloat16()
    weights, ids = route(logits, 2, SOFTMAX, False)
    assert ids.tolist() == [[0, 1]]
    assert weights[0, 1] == logits.float().softmax(-1)[0, 2]
