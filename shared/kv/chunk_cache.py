"""Chunked layers' KV bounded to their chunk (Llama 4): a query at position p of a chunked layer
sees keys [p // C * C, p] only, so those layers keep a sequence's pages from its window on, in a
pool of their own (few pages), while the other layers keep every token in the main pool.

A request's chunked pages are `Request.chunk_page_ids`, logical pages `chunk_first_page` on:
the scheduler trims pages before the window of a step it schedules (shared/kv/pages.py's
`chunk_window`) and adds those the step writes; a step plan carries them to the other ranks
of a T x P engine. Engines that push no KV only: a decode worker caps, and a prefill worker
writes the chunked layers' KV of a prompt's last chunk into the pages the decode worker reserved
for them (shared/transfer/handoff.py); a decode worker's two pools are two /dev/shm files."""

from dataclasses import replace
from pathlib import Path

import torch

from shared.kv.cache import KVCache
from shared.kv.pages import pages_for
from shared.kv.spec import MHAKVSpec


def chunk_pages_per_seq(chunk: int, page_size: int, max_num_batched_tokens: int) -> int:
    """Chunked pages one sequence holds at most: its chunk, one step's tokens, and a page at
    each end where the chunk does not start a page."""
    return pages_for(chunk, page_size) + pages_for(max_num_batched_tokens, page_size) + 2


def chunk_shm_path(path: Path | None) -> Path | None:
    """The chunked pool's file beside the main pool's `path` (None: in process memory)."""
    return None if path is None else path.with_name(f"{path.name}-chunked")


def split_places(chunked) -> list[tuple[bool, int]]:
    """Each layer's place in a split pool, from whether each is chunked (in layer order):
    (chunked, its index among the layers of its kind)."""
    counts = {True: 0, False: 0}
    places = []
    for c in chunked:
        places.append((bool(c), counts[bool(c)]))
        counts[bool(c)] += 1
    return places


class SplitKVCache:
    """The KV of one rank as two pools: `full` (layers that see the whole sequence, `num_pages`
    pages) and `chunked` (chunked layers, `num_chunk_pages`), each in its own /dev/shm file
    when shm_path is given (`chunk_shm_path` for the chunked one). layer(i) as KVCache's."""

    def __init__(
        self,
        spec: MHAKVSpec,
        chunked: tuple[bool, ...],  # per local layer: whether it is a chunked one
        num_pages: int,
        num_chunk_pages: int,
        device: torch.device | str = "cpu",
        shm_path: Path | None = None,
    ):
        self.spec, self.num_pages, self.num_chunk_pages = spec, num_pages, num_chunk_pages
        self.device = torch.device(device)
        num_chunked = sum(chunked)
        self.full = KVCache(
            replace(spec, num_layers=len(chunked) - num_chunked), num_pages, shm_path, device
        )
        self.chunked = KVCache(
            replace(spec, num_layers=num_chunked), num_chunk_pages, chunk_shm_path(shm_path), device
        )
        self._where = [(self.chunked if c else self.full, i) for c, i in split_places(chunked)]

    def layer(self, index: int) -> torch.Tensor:
        cache, i = self._where[index]
        return cache.layer(i)

    @property
    def nbytes(self) -> int:
        return self.full.nbytes + self.chunked.nbytes

    def close(self) -> None:
        self.full.close()
        self.chunked.close()


def pool_sizes(
    stages: list[tuple[int, int]], budget_bytes: int, per_seq: int, max_num_seqs: int
) -> tuple[int, int]:
    """(main pages, chunked pages) from each rank's KV budget, for stages whose pages cost
    `stages` = [(main page bytes, chunked page bytes)] (either 0 where a stage has no such
    layer): the chunked pool holds every sequence's window where every stage's budget allows,
    else both pools get as many pages as the tightest stage holds of both (a chunked page list
    never outgrows the main one). Every rank has the same page counts (page ids are global)."""
    want = per_seq * max_num_seqs
    if all(budget_bytes >= want * chunk for _, chunk in stages):
        full = min(
            ((budget_bytes - want * chunk) // main for main, chunk in stages if main), default=want
        )
        if full >= want:
            return full, want
    even = min(budget_bytes // (main + chunk) for main, chunk in stages)
    return even, even
