"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""

import torch
import torch.nn.functional as F
from torch import nn

from shared.models.layers.cpu_linear import linear
from shared.parallel.group import SINGLE, TPGroup


class VocabParallelEmbedding(nn.Module):
    """(T,) token ids -> (T, hidden). Ranks look up their slice; an all-reduce sums them."""

    def __init__(self, vocab_size: int, hidden: int, dtype=torch.float32, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp.size)  # ceil: the last shard may be padded
        self.vocab_start = tp.rank * self.shard_size
        self.weight = nn.Parameter(
            torch.zeros(self.shard_size, hidden, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[1] != param.shape[1] or loaded.shape[0] != self.vocab_size:
            raise ValueError(f"embedding shape {tuple(loaded.shape)} does not match vocab/hidden")
        rows = min(self.shard_size, self.vocab_size - self.vocab_start)
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """(N, hidden) -> (N, vocab) logits; rank slices gathered along the vocab dim."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(self, hidden, self.weight)  # (N, vocab / tp)
        return self.tp.all_gather_last_dim(logits)[:, : self.vocab_size]
