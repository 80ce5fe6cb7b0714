"""Linear layers that hold one tensor-parallel shard of their weight (Megatron style).

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that narrows the
checkpoint tensor (a lazily read TensorSlice, or a tensor) to this rank's shard, so the model
loader is a plain loop over tensors."""

import torch
from torch import nn

from shared.checkpoint import materialize
from shared.models.layers import fp8_weights
from shared.models.layers.cpu_linear import linear
from shared.parallel.group import SINGLE, TPGroup


class LinearBase(nn.Module):
    fp8_block: tuple[int, int] | None = None  # set where the weight stays FP8 (fp8_weights.py)

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_block is not None:
            return fp8_weights.forward(self, x)
        return linear(self, x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self._place(param, loaded)

    def _place(self, param, loaded, dim=0, start=0, length=None, offset=0) -> None:
        """param's rows from offset <- loaded.narrow(dim, start, length) (length None: loaded
        whole). The weight of an FP8 checkpoint on a GPU is placed as stored instead."""
        if param is self.weight and fp8_weights.place(self, loaded, dim, start, length, offset):
            return
        if length is None:
            _copy(param.data, loaded)
        elif dim == 0:
            _copy(param.data.narrow(0, offset, length), loaded.narrow(0, start, length))
        else:
            _copy(param.data, loaded.narrow(dim, start, length))


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: (T, in) -> (T, out / tp)."""

    def __init__(
        self, in_features, out_features, bias=False, dtype=torch.float32, tp: TPGroup = SINGLE
    ):
        self.tp = tp
        super().__init__(in_features, tp.shard(out_features, "output features"), bias, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        rows = param.shape[0]
        self._place(param, loaded, 0, self.tp.rank * rows, rows)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_proj + up_proj); shard_id picks one."""

    def __init__(
        self, in_features, output_sizes: list[int], bias=False, dtype=torch.float32, tp=SINGLE
    ):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, dtype, tp)

    def weight_loader(self, param, loaded, shard_id=None):
        size = self.output_sizes[shard_id] // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        self._place(param, loaded, 0, self.tp.rank * size, size, offset)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul. Output: (T, (nh + 2 * nkv) * hd / tp).

    When tp exceeds the KV heads, each KV head is replicated on tp / num_kv_heads ranks."""

    def __init__(
        self, hidden, head_dim, num_heads, num_kv_heads, bias=False, dtype=torch.float32, tp=SINGLE
    ):
        self.head_dim = head_dim
        self.num_heads = tp.shard(num_heads, "num_attention_heads")
        if tp.size >= num_kv_heads:
            if tp.size % num_kv_heads:
                raise ValueError(
                    f"tensor-parallel size {tp.size} must be a multiple of "
                    f"num_key_value_heads={num_kv_heads}"
                )
            self.num_kv_heads, self.kv_replicas = 1, tp.size // num_kv_heads
        else:
            self.num_kv_heads, self.kv_replicas = tp.shard(num_kv_heads, "num_key_value_heads"), 1
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        super().__init__(hidden, out, bias, dtype, tp)

    def weight_loader(self, param, loaded, shard_id=None):
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, src_rank = 0, q_size, self.tp.rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, src_rank = kv_size, self.tp.rank // self.kv_replicas
        self._place(param, loaded, 0, src_rank * size, size, offset)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums all-reduced: (T, in / tp) -> (T, out).
    reduce=False leaves the partial sum, for a caller that adds more before one all-reduce."""

    def __init__(
        self,
        in_features,
        out_features,
        bias=False,
        dtype=torch.float32,
        tp: TPGroup = SINGLE,
        reduce: bool = True,
    ):
        self.tp, self.reduce = tp, reduce
        super().__init__(tp.shard(in_features, "input features"), out_features, bias, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # bias: added once, on rank 0
            bias = materialize(loaded)
            _copy(param.data, bias if self.tp.rank == 0 else torch.zeros_like(bias))
            return
        cols = param.shape[1]
        self._place(param, loaded, 1, self.tp.rank * cols, cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x)
        return self.tp.all_reduce(out) if self.reduce else out


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Replicated parameters (norms): the checkpoint tensor as it is."""
    _copy(param.data, loaded)


def _copy(dst: torch.Tensor, src) -> None:
    """src: a tensor or a checkpoint TensorSlice (read here, whole)."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"weight shape {tuple(src.shape)} does not match parameter {tuple(dst.shape)}"
        )
    dst.copy_(materialize(src))
