"""Chunked layers' KV bounded to their chunk (Llama 4), in one page budget with the rest.

A query at position p of a chunked layer sees keys [p // C * C, p] only, so those layers keep a
sequence's pages from its window on, while the other (full) layers keep every token. Both kinds
take their pages from one pool and one allocator, as vLLM's hybrid KV cache does: a *unit page*
holds one page of tokens of `slots` layers, and the layers of a rank fall in page groups of at
most `slots` layers each. Group 0 holds the full layers and follows a request's `page_ids`; the
chunked layers fill groups 1..R, and group k follows `Request.chunk_page_ids[k - 1]`, which
holds logical pages `chunk_first_page` on (one list a group, all as long). A chunked logical
page thus costs R units, a full one 1. Scout (12 full, 36 chunked layers) gets R = 3 groups of
12: its pool grows by the full layers' 49,152 bytes a token, each sequence's window costs the
chunked layers' bytes, and whichever kind the requests need takes the free pages.

The scheduler trims pages before the window of a step it schedules (shared/kv/pages.py's
`chunk_window`) and adds those the step writes; a step plan carries them to the other ranks of a
T x P engine. Engines that push no KV only: a decode worker caps, and a prefill worker writes the
chunked layers' KV of a prompt's last chunk into the pages the decode worker reserved for them
(shared/transfer/handoff.py), each layer's group by `KVRankPool.kv_groups`."""

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from shared.kv.cache import KVCache
from shared.kv.pages import pages_for
from shared.kv.spec import MHAKVSpec


def chunk_pages_per_seq(chunk: int, page_size: int, max_num_batched_tokens: int) -> int:
    """Chunked logical pages one sequence holds at most: its chunk, one step's tokens, and a
    page at each end where the chunk does not start a page."""
    return pages_for(chunk, page_size) + pages_for(max_num_batched_tokens, page_size) + 2


def unit_slots(chunked: Sequence[bool], groups: int) -> int:
    """Layers a unit page holds on a rank whose layers are `chunked` (each: whether it is a
    chunked one) when its chunked layers fill `groups` groups: the full layers, or the chunked
    ones spread evenly, whichever is more."""
    num_chunked = sum(chunked)
    return max(len(chunked) - num_chunked, pages_for(num_chunked, groups))


def chunk_groups(stages: Sequence[Sequence[bool]]) -> int:
    """R, the number of chunked page groups, for a model whose stages hold these layers (page
    ids are the same on every rank, so R is too): the fewest groups that make the largest unit
    page smallest (fewer groups: a window costs fewer units; smaller units: more pages)."""
    most = max(sum(chunked) for chunked in stages)
    return min(
        range(1, most + 1), key=lambda r: (max(unit_slots(c, r) for c in stages), r), default=0
    )


def layer_groups(chunked: Sequence[bool], groups: int) -> tuple[int, ...]:
    """Each layer's page group (0: full; chunked layer c among the chunked ones: 1 + c // slots)."""
    slots, c, out = unit_slots(chunked, groups), 0, []
    for is_chunked in chunked:
        out.append(1 + c // slots if is_chunked else 0)
        c += is_chunked
    return tuple(out)


def group_slots(kv_groups: Sequence[int]) -> tuple[int, list[int]]:
    """(slots of a unit page, each layer's slot: its index among the layers of its group)."""
    seen: dict[int, int] = {}
    places = []
    for group in kv_groups:
        places.append(seen.get(group, 0))
        seen[group] = places[-1] + 1
    return max(seen.values(), default=0), places


class GroupedKVCache(KVCache):
    """The KV of one rank whose chunked layers are capped: a pool of unit pages (`slots` layers
    each; `num_pages` of them, in one /dev/shm file when shm_path is given), layer(i) the slot
    of layer i of `spec`, which page ids of its group (`kv_groups[i]`) index."""

    def __init__(
        self,
        spec: MHAKVSpec,
        kv_groups: tuple[int, ...],  # per local layer: its page group (layer_groups)
        num_pages: int,
        device: torch.device | str = "cpu",
        shm_path: Path | None = None,
        shm_optional: bool = False,
    ):
        self.kv_groups = kv_groups
        slots, self._slot = group_slots(kv_groups)
        spec = replace(spec, num_layers=slots)
        super().__init__(spec, num_pages, shm_path, device, shm_optional)

    def layer(self, index: int) -> torch.Tensor:
        return super().layer(self._slot[index])
