"""The tensor-parallel group a layer belongs to. Size 1 (no parallelism) is the default.
`process_group` makes the torch.distributed group for a device: gloo on CPU, NCCL on CUDA."""

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shared.parallel.shm_group import ShmGroup


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group; collectives are no-ops at size 1.

    `group` is a torch.distributed ProcessGroup object (gloo or NCCL) of the stage's TP ranks,
    used directly, so that no process-global default group is needed."""

    rank: int = 0
    size: int = 1
    group: object | None = None  # ProcessGroup when size > 1
    expert_parallel: bool = False  # MoE layers spread whole experts over the group (--ep)
    # --dp: the data-parallel ranks that MoE layers spread whole experts over, each rank with
    # tokens of its own (moe_ep.py); None: no data parallelism
    experts: "TPGroup | None" = None
    # same-host CPU ranks: collectives through shared memory (shm_group.py), the process group
    # for parts too large for it; None: the process group's alone
    shm: ShmGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1 and (self.shm is None or not self.shm.all_reduce(x)):
            self.group.allreduce([x]).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's shard along the last dim: (..., n) -> (..., n * size)."""
        if self.size == 1:
            return x
        if self.shm is not None and (out := self.shm.all_gather_last_dim(x)) is not None:
            return out
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows x[sum(send[:d]) : sum(send[:d + 1])] go to rank d; returns the rows every rank
        sent here, in rank order (recv[s] of them from rank s)."""
        if self.size == 1:
            return x
        if self.shm is not None and (out := self.shm.all_to_all(x, send, recv)) is not None:
            return out
        out = x.new_empty((sum(recv), *x.shape[1:]))
        self.group.alltoall_base(out, x.contiguous(), recv, send, dist.AllToAllOptions()).wait()
        return out

    def all_gather_rows(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Concatenate every rank's rows (rank s holds rows[s] of them) along dim 0."""
        if self.size == 1:
            return x
        if self.shm is not None and (out := self.shm.all_gather_rows(x, rows)) is not None:
            return out
        most = max(rows)
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[: len(x)] = x
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self.group.allgather([parts], [padded]).wait()
        return torch.cat([part[:n] for part, n in zip(parts, rows)])

    def shard(self, total: int, what: str) -> int:
        """Per-rank share of `total`; it must divide evenly."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tensor-parallel size {self.size}")
        return total // self.size


SINGLE = TPGroup()


def process_group(
    store: dist.Store, rank: int, size: int, device: torch.device | str, timeout: timedelta
):
    """A ProcessGroup object over `store` for tensors on `device` (the one place that picks
    the torch.distributed backend): gloo on CPU, NCCL on CUDA."""
    kind = torch.device(device).type
    if kind == "cpu":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if kind == "cuda" and dist.is_nccl_available():
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"no torch.distributed backend for {kind} tensors in this torch build")
