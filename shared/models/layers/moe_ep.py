"""Expert parallelism: whole experts spread over the ranks of a TP group (rank r holds experts
[r * E/n, (r + 1) * E/n)), tokens sent to their experts' ranks and back with all-to-all.

The hidden states enter replicated (attention's all-reduce made them so). Each rank routes a
slice of the tokens, sends each (token, expert) pair's row to the expert's rank (after the
counts: three exchanges a layer, the expert ids riding in the rows), computes the rows that
arrived for its own experts, sends the results back, weighs and sums them into its
slice, and an all-gather of the slices leaves every rank with the whole (T, H) again. Per rank
this reads 1/n of the experts' weights and computes 1/n of the expert rows.

With data-parallel attention (`own_tokens`, --dp) the hidden states differ by rank: each rank
routes all of its own tokens (none, in a step without requests of its own: it still joins every
exchange) and keeps its results; nothing is gathered."""

from collections.abc import Callable

import torch

from shared.parallel.group import TPGroup

# (rows (N, H), local expert ids (N,)) -> (N, H): this rank's experts on the rows sent to them
LocalExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def token_slices(num_tokens: int, size: int) -> list[int]:
    """Tokens each rank routes: an even split, the first ranks one more."""
    share, extra = divmod(num_tokens, size)
    return [share + (r < extra) for r in range(size)]


class ExpertParallel:
    def __init__(self, tp: TPGroup, num_experts: int, own_tokens: bool = False):
        self.tp = tp
        self.own_tokens = own_tokens  # x is this rank's tokens, not the group's (--dp)
        self.local = tp.shard(num_experts, "num_experts (expert parallelism)")
        self.first = tp.rank * self.local  # this rank's first expert

    def __call__(
        self,
        x: torch.Tensor,  # (T, H), the same on every rank (own_tokens: this rank's)
        topk_ids: torch.Tensor,  # (T, k) int64 experts of each token
        topk_weights: torch.Tensor,  # (T, k) float32
        experts: LocalExperts,
        weights_on_input: bool = False,  # scale each row before its expert (Llama 4), not after
    ) -> torch.Tensor:
        n, lo = len(x), 0  # this rank routes tokens [lo, lo + n)
        if not self.own_tokens:
            sizes = token_slices(len(x), self.tp.size)
            n, lo = sizes[self.tp.rank], sum(sizes[: self.tp.rank])
        mine = slice(lo, lo + n)
        ids, weights = topk_ids[mine].reshape(-1), topk_weights[mine].reshape(-1)  # (n*k,)
        token = torch.arange(n, device=x.device).repeat_interleave(topk_ids.shape[1])
        dest = ids // self.local
        order = torch.argsort(dest, stable=True)  # pairs grouped by the rank holding the expert
        ids, weights, token = ids[order], weights[order], token[order]
        send = torch.bincount(dest, minlength=self.tp.size)  # (n,) pairs to each rank
        recv = self.tp.all_to_all(send, [1] * self.tp.size, [1] * self.tp.size)
        send_l, recv_l = send.tolist(), recv.tolist()
        rows = x[mine][token]  # (P, H)
        if weights_on_input:
            rows = (rows.float() * weights[:, None]).to(x.dtype)
        # each row travels with its expert's id in its last columns, the int64's bytes as they
        # are (the exchange copies bytes): one exchange, not one for the rows and one for ids
        H = x.shape[1]
        tagged = torch.cat([rows, ids[:, None].view(x.dtype)], dim=1)  # (P, H + 8 / itemsize)
        arrived = self.tp.all_to_all(tagged, send_l, recv_l)  # (R, H + ...) for its experts
        arrived_ids = arrived[:, H:].contiguous().view(torch.int64)[:, 0] - self.first  # (R,)
        done = self.tp.all_to_all(experts(arrived[:, :H], arrived_ids), recv_l, send_l)  # (P, H)
        scale = torch.ones_like(weights) if weights_on_input else weights
        out = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, token, done.float() * scale[:, None])
        if self.own_tokens:
            return out.to(x.dtype)  # (T, H)
        return self.tp.all_gather_rows(out.to(x.dtype), sizes)  # (T, H)
