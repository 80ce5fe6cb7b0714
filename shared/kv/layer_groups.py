"""A pool whose layers differ: each group of layers has its own spec (shared/kv/spec.py)."""

from dataclasses import dataclass

import torch

from shared.kv.spec import KVSpec


@dataclass(frozen=True)
class LayerGroupKVSpec(KVSpec):
    """Layers whose KV differs (heads, head size, or MHA beside MLA): each group of layers has
    its own spec, all with one page size and dtype; page ids are shared by every layer.

    `groups[g]` is (the global layers it holds, in order; its spec for exactly those layers).
    The pool is one flat tensor: each group's pool tensor, in group order."""

    groups: tuple[tuple[tuple[int, ...], KVSpec], ...]

    def __post_init__(self) -> None:
        specs = [spec for _, spec in self.groups]
        if not specs or len({(s.page_size, s.dtype) for s in specs}) != 1:
            raise ValueError("layer groups need one page size and one dtype")
        for layers, spec in self.groups:
            if len(layers) != spec.num_layers:
                raise ValueError(f"group of layers {layers} has a spec of {spec.num_layers}")
        order = sorted(layer for layers, _ in self.groups for layer in layers)
        if order != list(range(len(order))):
            raise ValueError("layer groups must cover layers 0..L-1 once each")

    @property
    def num_layers(self) -> int:
        return sum(len(layers) for layers, _ in self.groups)

    @property
    def page_size(self) -> int:
        return self.groups[0][1].page_size

    @property
    def dtype(self) -> torch.dtype:
        return self.groups[0][1].dtype

    @property
    def layout(self) -> str:
        parts = (f"{','.join(map(str, layers))}={spec.layout}" for layers, spec in self.groups)
        return "groups:" + ";".join(parts)

    @property
    def num_units(self) -> int:
        units = {spec.num_units for _, spec in self.groups}
        if len(units) != 1:
            raise ValueError("layer groups with different unit counts cannot be divided alike")
        return units.pop()

    def _where(self, layer: int) -> tuple[int, int]:
        """(group, index within the group) of a local layer."""
        for g, (layers, _) in enumerate(self.groups):
            if layer in layers:
                return g, layers.index(layer)
        raise IndexError(f"layer {layer} not in this pool")

    def layer_token_bytes(self, layer: int) -> int:
        g, i = self._where(layer)
        return self.groups[g][1].layer_token_bytes(i)

    def _group_numel(self, g: int, num_pages: int) -> int:
        return torch.Size(self.groups[g][1].pool_shape(num_pages)).numel()

    def pool_shape(self, num_pages: int) -> tuple[int, ...]:
        return (sum(self._group_numel(g, num_pages) for g in range(len(self.groups))),)

    def _group_pool(self, pool: torch.Tensor, g: int) -> torch.Tensor:
        num_pages = self.pages_in(pool.numel() * pool.element_size())
        start = sum(self._group_numel(i, num_pages) for i in range(g))
        spec = self.groups[g][1]
        shape = spec.pool_shape(num_pages)
        return pool[start : start + torch.Size(shape).numel()].view(shape)

    def layer(self, pool: torch.Tensor, layer: int) -> torch.Tensor:
        g, i = self._where(layer)
        return self.groups[g][1].layer(self._group_pool(pool, g), i)

    def rank_units(self, tp_rank: int, tp: int) -> tuple[int, int]:
        return self.groups[0][1].rank_units(tp_rank, tp)

    def shard(self, layers: tuple[int, int], units: tuple[int, int]) -> "LayerGroupKVSpec":
        groups = []
        for group_layers, spec in self.groups:
            kept = tuple(x - layers[0] for x in group_layers if layers[0] <= x < layers[1])
            if kept:  # the layers of a group are alike: its shard keeps how many there are
                groups.append((kept, spec.shard((0, len(kept)), units)))
        return LayerGroupKVSpec(tuple(groups))

    def read(self, pool, layer, slots, units):
        g, i = self._where(layer)
        return self.groups[g][1].read(self._group_pool(pool, g), i, slots, units)

    def write(self, pool, layer, slots, units, payload):
        g, i = self._where(layer)
        self.groups[g][1].write(self._group_pool(pool, g), i, slots, units, payload)

    def payload_shape(self, layer, num_tokens, units):
        g, i = self._where(layer)
        return self.groups[g][1].payload_shape(i, num_tokens, units)

    def narrow(self, payload, layer, have, want):
        g, i = self._where(layer)
        return self.groups[g][1].narrow(payload, i, have, want)
