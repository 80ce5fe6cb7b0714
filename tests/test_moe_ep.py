"""Expert parallelism over two real gloo ranks: tokens go to their experts' ranks and back with
all-to-all, and every rank ends with what one rank holding every expert computes; with
data-parallel attention (own_tokens) each rank its own tokens' rows, a rank without tokens
still serving its experts."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from shared.models.layers.moe_ep import ExpertParallel, token_slices
from shared.parallel.group import TPGroup, process_group

from services_harness import free_port
from spawning import spawn

E, H, K = 4, 8, 2


def expert_weights() -> torch.Tensor:
    return torch.randn(E, H, H, generator=torch.Generator().manual_seed(0))  # (E, H, H)


def routed(num_tokens: int, k: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, H, generator=g)
    logits = torch.randn(num_tokens, E, generator=g)
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    return x, ids, weights


def reference(num_tokens: int, k: int, on_input: bool) -> torch.Tensor:
    w = expert_weights()
    x, ids, weights = routed(num_tokens, k)
    out = torch.zeros(num_tokens, H)
    for t in range(num_tokens):
        for j in range(k):
            e, p = ids[t, j], weights[t, j]
            out[t] += torch.tanh((p * x[t]) @ w[e]) if on_input else p * torch.tanh(x[t] @ w[e])
    return out


def _rank(rank: int, port: int, cases, out_dir, own_tokens: bool = False) -> None:
    """Each case through the exchange; own_tokens: this rank's rows of it only (the first
    rank takes the first `split` tokens)."""
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=30))
    tp = TPGroup(rank, 2, process_group(store, rank, 2, "cpu", timedelta(seconds=30)))
    ep = ExpertParallel(tp, E, own_tokens)
    mine = expert_weights()[ep.first : ep.first + ep.local]  # whole experts of this rank

    def experts(rows, local_ids):
        return torch.tanh(torch.bmm(rows[:, None], mine[local_ids]))[:, 0]

    exchanges = []  # each call's all-to-alls (this process's group is the only one)
    all_to_all = TPGroup.all_to_all
    TPGroup.all_to_all = lambda group, *args: exchanges.append(1) or all_to_all(group, *args)
    outs = []
    for num_tokens, k, on_input, *split in cases:
        x, ids, weights = routed(num_tokens, k)
        if own_tokens:
            rows = slice(0, split[0]) if rank == 0 else slice(split[0], num_tokens)
            x, ids, weights = x[rows], ids[rows], weights[rows]
        outs.append(ep(x, ids, weights, experts, on_input))
        # the counts, the rows with their expert ids, the results
        assert len(exchanges) == 3, exchanges
        exchanges.clear()
    torch.save(outs, out_dir / f"rank{rank}.pt")


CASES = [(7, K, False), (1, K, False), (6, 1, True), (0, K, False)]


def test_two_ranks_compute_what_one_rank_with_every_expert_does(tmp_path):
    spawn(_rank, args=(free_port(), CASES, tmp_path), nprocs=2)
    for rank in range(2):
        for (num_tokens, k, on_input), out in zip(CASES, torch.load(tmp_path / f"rank{rank}.pt")):
            expected = reference(num_tokens, k, on_input)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# (tokens, k, weights on the input, rank 0's tokens): both ranks with tokens, then one idle
OWN_CASES = [(7, K, False, 4), (5, K, False, 5), (6, 1, True, 0), (3, K, False, 1)]


def test_data_parallel_ranks_get_their_own_tokens_rows(tmp_path):
    spawn(_rank, args=(free_port(), OWN_CASES, tmp_path, True), nprocs=2)
    for rank in range(2):
        outs = torch.load(tmp_path / f"rank{rank}.pt")
        for (num_tokens, k, on_input, split), out in zip(OWN_CASES, outs):
            expected = reference(num_tokens, k, on_input)
            expected = expected[:split] if rank == 0 else expected[split:]
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "tokens, size, expected", [(7, 2, [4, 3]), (1, 2, [1, 0]), (8, 4, [2] * 4)]
)
def test_each_rank_routes_an_even_slice(tokens, size, expected):
    assert token_slices(tokens, size) == expected


def test_experts_must_divide_over_the_ranks():
    with pytest.raises(ValueError, match="num_experts"):
        ExpertParallel(TPGroup(0, 3), E)
