"""KV handoff between workers of different shapes: a prefill worker of (Tp, Pp) ranks writes
into a decode worker of (Td, Pd) ranks. Every prefill rank writes the layers and heads it
computed into each decode rank that owns them (pages re-sliced by head, routed by layer
range), peer to peer through that rank's shared-memory pool.

Acknowledgement is causal: a rank writes a layer's KV before its stage passes the hidden states
on (and before the last stage's logits all-gather), so once rank 0 holds a micro-batch's
samples every rank's writes for it are in place."""

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.kv.cache import KVCache
from shared.models.config import ModelConfig
from shared.parallel.shape import ParallelConfig
from shared.transfer.base import host_id, slots

RANKS_ENDPOINT = "kv_ranks"  # endpoints["kv_ranks"]: JSON list of RankPool dicts, rank order


def model_layout(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> str:
    """The whole model's KV layout; equals transfer.base.layout_id of a one-rank pool."""
    return (
        f"mha:L{cfg.num_layers}:H{cfg.num_kv_heads}:D{cfg.head_dim}:S{page_size}:{dtype}".replace(
            "torch.", ""
        )
    )


def head_range(tp_rank: int, tp: int, num_kv_heads: int) -> tuple[int, int]:
    """[first, end) global KV heads a TP rank holds (one replicated head when tp > heads)."""
    if tp >= num_kv_heads:
        head = tp_rank // (tp // num_kv_heads)
        return head, head + 1
    share = num_kv_heads // tp
    return tp_rank * share, (tp_rank + 1) * share


@dataclass(frozen=True)
class RankPool:
    """What one rank's KV pool holds and where it lives."""

    layers: tuple[int, int]  # [first, end) global layers
    heads: tuple[int, int]  # [first, end) global KV heads
    shm: str  # path of the pool file

    @classmethod
    def of(cls, cfg: ModelConfig, shape: ParallelConfig, rank: int, shm: str) -> "RankPool":
        stage = shape.stage_of(rank, cfg.num_layers)
        heads = head_range(rank % shape.tp, shape.tp, cfg.num_kv_heads)
        return cls((stage.start_layer, stage.end_layer), heads, shm)


def describe_ranks(pools: list[RankPool]) -> str:
    return json.dumps([[list(p.layers), list(p.heads), p.shm] for p in pools])


def parse_ranks(text: str) -> list[RankPool]:
    return [RankPool(tuple(layers), tuple(heads), shm) for layers, heads, shm in json.loads(text)]


class RankKVPusher:
    """One prefill rank's writer. Rank 0 registers targets (`add`) and ships the step's
    targets in the plan (`plan_extras`); other ranks take them from it (`on_plan`)."""

    def __init__(self, kv: KVCache, mine: RankPool, writes: bool):
        self.kv, self.mine = kv, mine
        self.writes = writes  # False on a replica of a head another TP rank already writes
        self.targets: dict[str, dict] = {}  # request id -> {"pages": [...], "ranks": text}
        self.errors: dict[str, str] = {}
        self.bytes_sent, self.seconds = 0, 0.0
        self._pools: dict[str, torch.Tensor] = {}
        self._step: dict[str, dict] = {}  # this step's targets
        self._slots: dict[str, tuple] = {}  # request id -> (src, dst) slots of this step

    def add(self, request_id: str, page_ids, endpoints: dict[str, str]) -> None:
        if endpoints.get("host") != host_id():
            raise ValueError("KV handoff across shapes needs the decode worker on this host")
        for pool in parse_ranks(endpoints[RANKS_ENDPOINT]):
            if not Path(pool.shm).exists():
                raise ValueError(f"decode KV pool {pool.shm} is gone")
        self.targets[request_id] = {"pages": list(page_ids), "ranks": endpoints[RANKS_ENDPOINT]}

    def plan_extras(self, out) -> dict:
        """Rank 0: the targets of this step's requests, for every rank's plan."""
        self._step = {
            s.request.request_id: self.targets[s.request.request_id]
            for s in out.scheduled
            if s.request.request_id in self.targets
        }
        return self._step

    def on_plan(self, plan, runner) -> None:
        self._step = plan.push

    def on_layer(self, layer: int, out) -> None:
        if not self.writes or not self._step:
            return
        start = time.perf_counter()
        if layer == self.mine.layers[0]:
            self._slots = self._step_slots(out)
        local = self.kv.data[layer - self.mine.layers[0]]  # (2, P, S, nkv, hd)
        local = local.view(2, -1, *local.shape[3:])  # (2, P*S, nkv, hd)
        for rid, (src, dst) in self._slots.items():
            if rid in self.errors:
                continue
            try:
                for pool in parse_ranks(self._step[rid]["ranks"]):
                    self._write(pool, layer, local, src, dst)
            except Exception as e:  # the decode worker went away: fail this request only
                self.errors[rid] = f"KV transfer failed: {e}"
        self.seconds += time.perf_counter() - start

    def _write(self, pool: RankPool, layer: int, local, src, dst) -> None:
        h0, h1 = max(pool.heads[0], self.mine.heads[0]), min(pool.heads[1], self.mine.heads[1])
        if not pool.layers[0] <= layer < pool.layers[1] or h0 >= h1:
            return
        target = self._pool(pool)[layer - pool.layers[0]]  # (2, P*S, nkv_d, hd)
        kv = local[:, src, h0 - self.mine.heads[0] : h1 - self.mine.heads[0]]  # (2, n, h, hd)
        target[:, dst, h0 - pool.heads[0] : h1 - pool.heads[0]] = kv
        self.bytes_sent += kv.numel() * kv.element_size()

    def _pool(self, pool: RankPool) -> torch.Tensor:
        if pool.shm not in self._pools:
            spec = self.kv.spec
            numel = Path(pool.shm).stat().st_size // spec.dtype.itemsize
            mapped = torch.from_file(pool.shm, shared=True, size=numel, dtype=spec.dtype)
            heads = pool.heads[1] - pool.heads[0]
            layers = pool.layers[1] - pool.layers[0]
            self._pools[pool.shm] = mapped.view(layers, 2, -1, heads, spec.head_dim)
        return self._pools[pool.shm]

    def _step_slots(self, out) -> dict:
        page_size, step = self.kv.spec.page_size, {}
        for s in out.scheduled:
            target = self._step.get(s.request.request_id)
            if target is not None:
                end = s.start + s.num_tokens
                src = slots(s.request.page_ids, s.start, end, page_size)
                dst = slots(target["pages"], s.start, end, page_size)
                step[s.request.request_id] = (src, dst)
        return step

    def finish(self, request_id: str) -> str | None:
        """Rank 0, once the request's last chunk came back: None, or why its KV is not in place."""
        target = self.targets.pop(request_id, None)
        error = self.errors.pop(request_id, None)
        return error or (None if target is not None else "no KV target")

    def drop(self, request_id: str) -> None:
        self.targets.pop(request_id, None)
        self.errors.pop(request_id, None)

    def close(self) -> None:
        self._pools.clear()


def rank_pusher(kv: KVCache, cfg: ModelConfig, shape: ParallelConfig, rank: int) -> RankKVPusher:
    """The pusher of one prefill rank; of replicated heads only the first replica writes."""
    mine = RankPool.of(cfg, shape, rank, "")
    tp_rank = rank % shape.tp
    writes = shape.tp <= cfg.num_kv_heads or tp_rank % (shape.tp // cfg.num_kv_heads) == 0
    return RankKVPusher(kv, mine, writes)
