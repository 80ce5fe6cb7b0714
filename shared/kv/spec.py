"""KV-cache layout specs. Pools and transports move opaque pages; only the spec knows shapes."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MHAKVSpec:
    """Multi-head (and grouped-query) attention: a K and a V vector per KV head per token.

    The pool stores one tensor (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim),
    so one page of one layer is a contiguous block per K and per V."""

    num_layers: int  # layers whose KV this worker (PP stage) holds
    page_size: int  # tokens per page
    num_kv_heads: int  # KV heads held by this rank (after TP sharding)
    head_dim: int
    dtype: torch.dtype

    @property
    def layer_page_bytes(self) -> int:
        """Bytes of one page of one layer, K and V together."""
        return 2 * self.page_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one page across all layers: the unit the memory budget is divided into."""
        return self.num_layers * self.layer_page_bytes

    def pool_shape(self, num_pages: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def pages_for_budget(self, budget_bytes: int) -> int:
        return budget_bytes // self.page_size_bytes
