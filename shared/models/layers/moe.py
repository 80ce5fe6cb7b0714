"""Mixture of experts: the router policy and the experts of one layer, token-grouped.

`route` picks each token's experts and their weights (Mixtral, Qwen3-MoE: softmax top-k, with or
without renormalisation; Llama 4: sigmoid top-1), `grouped_topk` DeepSeek-V3's (sigmoid scores,
a bias for the choice only, experts in groups). `FusedMoE` holds every expert's SwiGLU
weights stacked, w13 (E, 2 * I, H) (gate rows, then up rows) and w2 (E, H, I), each expert's
intermediate dimension split across tensor-parallel ranks, or with expert parallelism (`--ep`,
TPGroup.expert_parallel) whole experts spread over them, or with data-parallel attention
(`--dp`, TPGroup.experts) whole experts spread over the data-parallel ranks (moe_ep.py); a
forward pass sorts the (token, slot) pairs by expert and runs one matmul per active expert, so a
decode step reads only the active experts' weights."""

import torch
from torch import nn

from shared.checkpoint import materialize
from shared.models.layers.activation import SiluAndMul
from shared.models.layers.cpu_linear import linear
from shared.models.layers.linear import ReplicatedLinear, _copy
from shared.models.layers.moe_ep import ExpertParallel
from shared.parallel.group import SINGLE, TPGroup

SOFTMAX, SIGMOID = "softmax", "sigmoid"

# weight_loader shard ids: (expert, kind). With an expert number the tensor is that expert's, in
# nn.Linear layout: gate and up (I, H), down (H, I). With None it stacks all experts: gate_up
# (E, 2I, H) and down (E, H, I) as transformers 5 holds them in memory, or transposed as Llama 4's
# checkpoints store them: gate_up_t (E, H, 2I) and down_t (E, I, H).
GATE, UP, DOWN, GATE_UP, GATE_UP_T, DOWN_T = "gate", "up", "down", "gate_up", "gate_up_t", "down_t"


def route(
    logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E) -> (weights (T, k) float32, expert ids (T, k) int64).

    softmax: the top k of softmax(logits), renormalised to sum 1 if `renormalize`, an exact
    tie going to the lower expert id (bf16 logits tie often enough to matter: topk breaks
    ties as its partial sort happens to, the fused decoder's moe.c by the id);
    sigmoid: the top k of the raw logits, each weighted sigmoid(logit) (Llama 4, k = 1)."""
    logits = logits.float()
    if scoring == SOFTMAX:
        weights, ids = logits.softmax(dim=-1).sort(dim=-1, descending=True, stable=True)
        weights, ids = weights[:, :top_k], ids[:, :top_k]
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    if scoring == SIGMOID:
        top, ids = logits.topk(top_k, dim=-1)
        return top.sigmoid(), ids
    raise ValueError(f"router scoring {scoring!r} (supported: {SOFTMAX}, {SIGMOID})")


def grouped_topk(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (`noaux_tc`), as transformers' DeepseekV3TopkRouter: logits (T, E)
    -> (weights (T, k) float32, ids (T, k) int64). Scores are sigmoid(logits); the choice is
    made on scores + bias (E,) (the load-balancing correction): each group of E / n_group
    experts is ranked by the sum of its two best, the topk_group best groups kept, the top k
    of their experts chosen. Weights are the unbiased scores, renormalised to sum 1 if
    `renormalize`, times `scaling` (routed_scaling_factor)."""
    scores = logits.float().sigmoid()
    choice = scores + bias.float()  # (T, E)
    groups = choice.view(len(choice), n_group, -1)  # (T, G, E / G)
    group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1)[0].sum(-1)  # (T, G)
    kept = group_scores.topk(topk_group, dim=-1)[1]  # (T, topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    choice = choice.masked_fill(~keep[:, :, None].expand_as(groups).reshape_as(choice), -torch.inf)
    ids = choice.topk(top_k, dim=-1)[1]  # (T, k)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class FusedMoE(nn.Module):
    """The routed experts of one layer: x (T, H), router_logits (T, E) -> (T, H), the same on
    every rank of the tensor-parallel group: each rank holds I / tp of every expert's
    intermediate dimension and the outputs are all-reduced, or with tp.expert_parallel E / tp
    whole experts and the tokens travel to them (moe_ep.py). With `apply_weights_on_input`
    (Llama 4, top-1) the expert sees x * weight and its output is summed as is; otherwise each
    output is scaled by its weight."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        tp: TPGroup = SINGLE,
        scoring: str = SOFTMAX,
        renormalize: bool = True,
        apply_weights_on_input: bool = False,
        reduce: bool = True,  # False: each TP rank's partial sum (not with expert parallelism)
    ):
        super().__init__()
        if apply_weights_on_input and top_k != 1:
            raise ValueError("weights on the input need top-1 routing")
        self.num_experts, self.top_k, self.tp = num_experts, top_k, tp
        self.scoring, self.renormalize = scoring, renormalize
        self.apply_weights_on_input = apply_weights_on_input
        self.reduce = reduce
        self.intermediate_size = intermediate_size  # whole, before the TP split
        self.ep = None
        if tp.experts is not None:  # --dp: over the data-parallel ranks, tokens of their own
            self.ep = ExpertParallel(tp.experts, num_experts, own_tokens=True)
        elif tp.expert_parallel and tp.size > 1:
            self.ep = ExpertParallel(tp, num_experts)
        local = num_experts if self.ep is None else self.ep.local  # experts this rank holds
        self.first = 0 if self.ep is None else self.ep.first  # global id of its first
        self.expert_tp = tp if self.ep is None else SINGLE  # who splits each expert's I
        shard = self.expert_tp.shard(intermediate_size, "expert intermediate size")
        self.w13 = nn.Parameter(
            torch.empty(local, 2 * shard, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(local, hidden_size, shard, dtype=dtype), requires_grad=False
        )
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader
        self._loaded: set[tuple[int, str]] = set()  # (local expert, gate | up | down) read
        self.act = SiluAndMul()
        self.c_linear = False  # packing.py: whether each expert's matrices take our C linear

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route(router_logits, self.top_k, self.scoring, self.renormalize)
        return self.forward_routed(x, weights, ids)

    def forward_routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """x (T, H) through the experts `ids` (T, k) chose for each token, weighted by
        `weights` (T, k) float32 -> (T, H) (a router of the family's own: grouped_topk)."""
        if self.ep is not None:
            return self.ep(x, ids, weights, self.run_experts, self.apply_weights_on_input)
        pair_ids = ids.flatten()  # (T * k,): pair p is token p // k's slot p % k
        order = pair_ids.argsort(stable=True)  # pairs grouped by expert
        tokens = order // self.top_k  # (T * k,) each sorted pair's token
        pair_weights = weights.flatten()[order, None]  # (T * k, 1)
        rows = x[tokens]  # (T * k, H)
        if self.apply_weights_on_input:
            rows = rows * pair_weights.to(x.dtype)
        h = self.run_experts(rows, pair_ids[order], grouped=True)  # (T * k, H)
        h = h.float() if self.apply_weights_on_input else h * pair_weights
        out = torch.zeros(x.shape, dtype=torch.float32)  # (T, H), summed in float32
        out = out.index_add_(0, tokens, h).to(x.dtype)
        return self.tp.all_reduce(out) if self.reduce else out

    def idle(self) -> None:
        """A data-parallel rank without tokens this step joins the layer's exchanges: it
        computes the rows other ranks send to its experts (--dp)."""
        H, k, device = self.w13.shape[-1], self.top_k, self.w13.device
        x = self.w13.new_empty((0, H))
        ids = torch.empty((0, k), dtype=torch.long, device=device)
        weights = torch.empty((0, k), device=device)
        self.ep(x, ids, weights, self.run_experts, self.apply_weights_on_input)

    def run_experts(
        self, rows: torch.Tensor, ids: torch.Tensor, grouped: bool = False
    ) -> torch.Tensor:
        """rows (N, H), each through expert ids[i] of this rank's (local ids) -> (N, H):
        one matmul pair per active expert over its rows. grouped: ids are sorted already."""
        order = None if grouped else ids.argsort(stable=True)
        counts = torch.bincount(ids, minlength=self.w13.shape[0])  # (E_local,)
        ends = counts.cumsum(0).tolist()
        out = torch.empty_like(rows)
        for e in counts.nonzero().flatten().tolist():  # the active experts only
            span = slice(ends[e] - int(counts[e]), ends[e])
            sel = span if order is None else order[span]
            h = linear(self, self.act(linear(self, rows[sel], self.w13[e])), self.w2[e])
            out[sel] = h  # (n, H)
        return out

    def weight_loader(self, param: nn.Parameter, loaded, shard_id) -> None:
        """shard_id (expert, kind), see GATE ... DOWN_T: cut this rank's part of I."""
        expert, kind = shard_id
        if expert is None:  # every expert's: this rank's experts of them
            dst, loaded = param.data, loaded.narrow(0, self.first, param.shape[0])
            experts = range(param.shape[0])
        elif not self.first <= expert < self.first + param.shape[0]:
            return  # another rank's expert (expert parallelism)
        else:
            dst = param.data[expert - self.first]
            experts = [expert - self.first]
        self._copy_part(dst, loaded, kind)
        parts = {GATE: (GATE,), UP: (UP,), GATE_UP: (GATE, UP), GATE_UP_T: (GATE, UP)}
        self._loaded.update((e, part) for e in experts for part in parts.get(kind, (DOWN,)))

    def missing_weights(self) -> list[str]:
        """The expert matrices of this rank that no checkpoint tensor filled (loader.py)."""
        return [
            f"expert {self.first + e} {part}"
            for e in range(self.w13.shape[0])
            for part in (GATE, UP, DOWN)
            if (e, part) not in self._loaded
        ]

    def _copy_part(self, dst: torch.Tensor, loaded, kind: str) -> None:
        shard, rank = self.w2.shape[-1], self.expert_tp.rank
        whole = self.intermediate_size
        rows = {GATE: [(0, 0)], UP: [(0, shard)], GATE_UP: [(0, 0), (whole, shard)]}
        if kind in rows:  # (..., I or 2I, H): (first row of gate or up there, its rows in ours)
            for first, offset in rows[kind]:
                part = loaded.narrow(-2, first + rank * shard, shard)
                _copy(dst.narrow(-2, offset, shard), part)
        elif kind == GATE_UP_T:  # (E, H, 2I): gate columns, then up columns
            for first, offset in ((0, 0), (whole, shard)):
                part = materialize(loaded.narrow(2, first + rank * shard, shard))
                _copy(dst.narrow(1, offset, shard), part.transpose(1, 2))
        elif kind == DOWN:  # (..., H, I)
            _copy(dst, loaded.narrow(-1, rank * shard, shard))
        elif kind == DOWN_T:  # (E, I, H)
            _copy(dst, materialize(loaded.narrow(1, rank * shard, shard)).transpose(1, 2))
        else:
            raise ValueError(f"expert weight kind {kind!r}")


class MoEMLP(nn.Module):
    """A decoder layer's MLP of routed experts (Mixtral, Qwen3-MoE): a replicated router
    `gate` (H -> E logits) and the `experts`. (T, H) -> (T, H)."""

    def __init__(
        self, num_experts, top_k, hidden_size, intermediate_size, renormalize, dtype, tp=SINGLE
    ):
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, False, dtype)
        self.experts = FusedMoE(
            num_experts, top_k, hidden_size, intermediate_size, dtype, tp, SOFTMAX, renormalize
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))

    def fused_parts(self) -> dict:
        """What layer_spec takes of this MLP (the fused decoder's routed experts, moe.c)."""
        return dict(router=self.gate, experts=self.experts)
