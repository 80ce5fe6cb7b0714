"""Chunked layers' KV bounded to their chunk (Llama 4): a query at position p of a chunked layer
sees keys [p // C * C, p] only, so those layers keep a sequence's pages from its window on, in a
pool of their own (few pages), while the other layers keep every token in the main pool.

A request's chunked pages are `Request.chunk_page_ids`, logical pages `chunk_first_page` on:
the scheduler trims pages before the window of a step it schedules (shared/kv/pages.py's
`chunk_window`) and adds those the step writes; a step plan carries them to the other ranks
of a T x P engine. Engines without a KV handoff only (workers never cap: the handoff moves one
page list)."""

from dataclasses import replace

import torch

from shared.kv.cache import KVCache
from shared.kv.pages import pages_for
from shared.kv.spec import MHAKVSpec


def chunk_pages_per_seq(chunk: int, page_size: int, max_num_batched_tokens: int) -> int:
    """Chunked pages one sequence holds at most: its chunk, one step's tokens, and a page at
    each end where the chunk does not start a page."""
    return pages_for(chunk, page_size) + pages_for(max_num_batched_tokens, page_size) + 2


class SplitKVCache:
    """The KV of one rank as two pools: `full` (layers that see the whole sequence, `num_pages`
    pages) and `chunked` (chunked layers, `num_chunk_pages`). layer(i) as KVCache's."""

    def __init__(
        self,
        spec: MHAKVSpec,
        chunked: tuple[bool, ...],  # per local layer: whether it is a chunked one
        num_pages: int,
        num_chunk_pages: int,
        device: torch.device | str = "cpu",
    ):
        self.spec, self.num_pages, self.num_chunk_pages = spec, num_pages, num_chunk_pages
        self.device = torch.device(device)
        num_chunked = sum(chunked)
        self.full = KVCache(
            replace(spec, num_layers=len(chunked) - num_chunked), num_pages, None, device
        )
        self.chunked = KVCache(replace(spec, num_layers=num_chunked), num_chunk_pages, None, device)
        counts = {True: 0, False: 0}
        self._where: list[tuple[KVCache, int]] = []
        for c in chunked:
            self._where.append((self.chunked if c else self.full, counts[c]))
            counts[c] += 1

    def layer(self, index: int) -> torch.Tensor:
        cache, i = self._where[index]
        return cache.layer(i)

    @property
    def nbytes(self) -> int:
        return self.full.nbytes + self.chunked.nbytes

    def close(self) -> None:
        pass  # in process memory: nothing to unlink


def pool_sizes(
    full_page_bytes: int, chunk_page_bytes: int, budget_bytes: int, per_seq: int, max_num_seqs: int
) -> tuple[int, int]:
    """(main pages, chunked pages) from a KV budget: the chunked pool holds every sequence's
    window if the budget allows, else as many pages as the main one (a chunked page list never
    outgrows the main one)."""
    want = per_seq * max_num_seqs
    full = (budget_bytes - want * chunk_page_bytes) // full_page_bytes
    if full >= want:
        return full, want
    even = budget_bytes // (full_page_bytes + chunk_page_bytes)
    return even, even
