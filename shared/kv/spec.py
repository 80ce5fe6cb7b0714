"""KV-cache layout specs. Pools, transports and the handoff move opaque pages; only a spec knows
what a token's KV is, how a pool tensor is shaped and how tensor-parallel ranks divide it.

A spec describes one pool: the model's whole KV (the "global" spec, whose `layout` both ends of
a handoff compare) or one rank's part of it (`shard`). Ranks divide a layer's KV into `units`:
KV heads for MHA (each rank holds a range of them), one replicated unit for MLA (every rank
holds the whole latent). A slot is `page * page_size + offset`: one token of one layer."""

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch

from kernels.cuda import kv_pages
from kernels.cuda import runtime as cuda


class KVSpec(ABC):
    num_layers: int  # layers whose KV this pool holds
    page_size: int  # tokens per page
    dtype: torch.dtype

    @property
    @abstractmethod
    def layout(self) -> str:
        """Id of the layout: two pools may exchange pages only if their global specs agree."""

    @property
    @abstractmethod
    def num_units(self) -> int:
        """Units of a layer this pool holds (KV heads for MHA; 1 for MLA)."""

    @abstractmethod
    def layer_token_bytes(self, layer: int) -> int:
        """Bytes of one token of one layer (local index)."""

    @abstractmethod
    def pool_shape(self, num_pages: int) -> tuple[int, ...]:
        """Shape of the tensor that holds the pool."""

    @abstractmethod
    def layer(self, pool: torch.Tensor, layer: int) -> torch.Tensor:
        """The view of one layer's pages that the model's attention reads and writes."""

    @abstractmethod
    def rank_units(self, tp_rank: int, tp: int) -> tuple[int, int]:
        """[first, end) units that TP rank `tp_rank` of `tp` holds."""

    @abstractmethod
    def shard(self, layers: tuple[int, int], units: tuple[int, int]) -> "KVSpec":
        """The spec of a pool holding global layers [layers) and units [units) of this one."""

    @abstractmethod
    def read(
        self, pool: torch.Tensor, layer: int, slots: torch.Tensor, units: tuple[int, int]
    ) -> torch.Tensor:
        """A copy of the KV of `slots` of one (local) layer, local units [units)."""

    @abstractmethod
    def write(
        self,
        pool: torch.Tensor,
        layer: int,
        slots: torch.Tensor,
        units: tuple[int, int],
        payload: torch.Tensor,
    ) -> None:
        """Stores a `read` result of the same units into `slots` of one (local) layer."""

    @abstractmethod
    def payload_shape(self, layer: int, num_tokens: int, units: tuple[int, int]) -> tuple:
        """Shape of a `read` of `num_tokens` slots of one layer and units [units)."""

    @abstractmethod
    def narrow(
        self, payload: torch.Tensor, layer: int, have: tuple[int, int], want: tuple[int, int]
    ) -> torch.Tensor:
        """The units [want) of a `read` payload of one layer holding units [have)."""

    def writes(self, tp_rank: int, tp: int) -> bool:
        """Whether this rank sends its units in a handoff: of replicas of a unit, the first."""
        first = self.rank_units(tp_rank, tp)
        return tp_rank == 0 or self.rank_units(tp_rank - 1, tp) != first

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one page across all layers: the unit the memory budget is divided into."""
        return self.page_size * sum(map(self.layer_token_bytes, range(self.num_layers)))

    def pages_for_budget(self, budget_bytes: int) -> int:
        return budget_bytes // self.page_size_bytes

    def pages_in(self, nbytes: int) -> int:
        """Pages of a pool file of `nbytes` (a peer's pool, mapped by size)."""
        return nbytes // self.page_size_bytes

    def slots(self, page_ids, start: int, end: int) -> torch.Tensor:
        """(end - start,) int64 slots of tokens [start, end) of a sequence holding `page_ids`."""
        pos = torch.arange(start, end)
        pages = torch.as_tensor(page_ids, dtype=torch.long)
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_units(units: tuple[int, int], num_units: int, what: str) -> None:
    if not 0 <= units[0] < units[1] <= num_units:
        raise ValueError(f"{what} [{units[0]}, {units[1]}) outside [0, {num_units})")


@dataclass(frozen=True)
class MHAKVSpec(KVSpec):
    """Multi-head (and grouped-query) attention: a K and a V vector per KV head per token.

    The pool is one tensor (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim), so one
    page of one layer is a contiguous block per K and per V. Ranks hold KV heads; with more
    ranks than heads each head is replicated on tp / heads consecutive ranks (vLLM)."""

    num_layers: int
    page_size: int
    num_kv_heads: int  # heads this pool holds
    head_dim: int
    dtype: torch.dtype

    @property
    def layout(self) -> str:
        s = self
        return f"mha:L{s.num_layers}:H{s.num_kv_heads}:D{s.head_dim}:S{s.page_size}:" + (
            _dtype_name(s.dtype)
        )

    @property
    def num_units(self) -> int:
        return self.num_kv_heads

    @property
    def layer_page_bytes(self) -> int:
        """Bytes of one page of one layer, K and V together."""
        return self.page_size * self.layer_token_bytes(0)

    def layer_token_bytes(self, layer: int) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def pool_shape(self, num_pages: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def layer(self, pool: torch.Tensor, layer: int) -> torch.Tensor:
        return pool[layer]  # (2, P, S, nkv, hd)

    def rank_units(self, tp_rank: int, tp: int) -> tuple[int, int]:
        if tp >= self.num_kv_heads:
            head = tp_rank // (tp // self.num_kv_heads)
            return head, head + 1
        share = self.num_kv_heads // tp
        return tp_rank * share, (tp_rank + 1) * share

    def shard(self, layers: tuple[int, int], units: tuple[int, int]) -> "MHAKVSpec":
        _check_units(units, self.num_kv_heads, "KV heads")
        return replace(self, num_layers=layers[1] - layers[0], num_kv_heads=units[1] - units[0])

    def _rows(self, pool: torch.Tensor, layer: int) -> torch.Tensor:
        data = pool[layer]  # (2, P, S, nkv, hd)
        return data.view(2, -1, *data.shape[3:])  # (2, P*S, nkv, hd)

    def read(self, pool, layer, slots, units):
        if cuda.usable(pool):  # one launch: the pages' rows into one payload
            return kv_pages.gather(pool[layer], slots.to(pool.device), units)
        return self._rows(pool, layer)[:, slots, units[0] : units[1]]  # (2, n, h, hd)

    def write(self, pool, layer, slots, units, payload):
        if cuda.usable(pool):
            kv_pages.scatter(pool[layer], slots.to(pool.device), payload.contiguous(), units)
            return
        self._rows(pool, layer)[:, slots, units[0] : units[1]] = payload

    def payload_shape(self, layer, num_tokens, units):
        return (2, num_tokens, units[1] - units[0], self.head_dim)

    def narrow(self, payload, layer, have, want):
        if want == have:
            return payload
        return payload[:, :, want[0] - have[0] : want[1] - have[0]]  # (2, n, h, hd)


@dataclass(frozen=True)
class MLAKVSpec(KVSpec):
    """Multi-head latent attention (DeepSeek-V3, Kimi K2): per token and layer one compressed
    latent (kv_lora_rank) and the shared RoPE key part (rope_dim), the same for every head.

    The pool is one tensor (num_layers, num_pages, page_size, kv_lora_rank + rope_dim). Every TP
    rank holds all of it (one replicated unit): the up-projections split by head, not the cache."""

    num_layers: int
    page_size: int
    kv_lora_rank: int
    rope_dim: int
    dtype: torch.dtype

    @property
    def layout(self) -> str:
        s = self
        return f"mla:L{s.num_layers}:R{s.kv_lora_rank}:P{s.rope_dim}:S{s.page_size}:" + (
            _dtype_name(s.dtype)
        )

    @property
    def num_units(self) -> int:
        return 1

    @property
    def entry_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def layer_token_bytes(self, layer: int) -> int:
        return self.entry_dim * self.dtype.itemsize

    def pool_shape(self, num_pages: int) -> tuple[int, ...]:
        return (self.num_layers, num_pages, self.page_size, self.entry_dim)

    def layer(self, pool: torch.Tensor, layer: int) -> torch.Tensor:
        return pool[layer]  # (P, S, latent + rope)

    def rank_units(self, tp_rank: int, tp: int) -> tuple[int, int]:
        return 0, 1

    def shard(self, layers: tuple[int, int], units: tuple[int, int]) -> "MLAKVSpec":
        _check_units(units, 1, "MLA units")
        return replace(self, num_layers=layers[1] - layers[0])

    def read(self, pool, layer, slots, units):
        if cuda.usable(pool):
            return kv_pages.gather(pool[layer], slots.to(pool.device))
        return pool[layer].view(-1, self.entry_dim)[slots]  # (n, latent + rope)

    def write(self, pool, layer, slots, units, payload):
        if cuda.usable(pool):
            kv_pages.scatter(pool[layer], slots.to(pool.device), payload.contiguous())
            return
        pool[layer].view(-1, self.entry_dim)[slots] = payload

    def payload_shape(self, layer, num_tokens, units):
        return (num_tokens, self.entry_dim)

    def narrow(self, payload, layer, have, want):
        return payload  # one unit: every rank holds all of it
