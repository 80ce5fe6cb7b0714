"""Turns a SchedulerOutput into the flat tensors of one forward pass, on the engine's device."""

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.engine.request import PromptTargets
from shared.engine.scheduler import SchedulerOutput
from shared.models.layer_attention import CHUNKED, GLOBAL_MASK, AttentionMask
from shared.models.layers.attention import (
    AttentionMetadata,
    DecodeRows,
    PrefillSpan,
    StepMetadata,
)

CPU = torch.device("cpu")


def _ints(values: Sequence[int], device: torch.device, dtype=torch.long) -> torch.Tensor:
    """torch.tensor(values, dtype, device) for int64 or int32 values, in a third of its time
    from a list (a step builds ~6 of them; ~3 us each on a CPU otherwise)."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    t = torch.frombuffer(array("q" if dtype == torch.long else "i", values), dtype=dtype)
    return t if device.type == "cpu" else t.to(device)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: StepMetadata
    logits_rows: torch.Tensor  # (N,) rows of T whose next token is sampled
    sample_index: list[int]  # indices into scheduled of the N sampling requests
    # requests that score prompt tokens: (index into scheduled, the row of T of targets.first,
    # targets); its rows follow on, one per target
    prompt_rows: list[tuple[int, int, PromptTargets]]


# Keys that a step's prompt tokens may read in all as decode rows (prefills_as_rows): a row
# reads its whole context, where prefill attention reads a chunk's context once for all its
# queries. Measured (Zen 5; bench_engine's 150M model, prompts in chunks of 64): a 2,000-token
# prompt prefilled in 1.80 s with no rows, 1.79 s at 32K keys, 1.29 s at 128K, 1.42 s always
# rows; shorter prompts gained at every bound; the avx2 tier (up to 512 rows a fused step) took
# a 300-token prompt in 318 ms as rows against 377 ms.
ROW_KEYS = 1 << 17


def prefills_as_rows(out: SchedulerOutput, max_rows: int) -> bool:
    """Whether the step's prompt chunks attend as decode rows, one row a token, so that the
    whole step is decode rows and runs in the fused decoder's one C call (which takes up to
    max_rows rows; 0: there is none) instead of op by op: a short prompt's prefill then costs
    about its linears' work, not ~15 module calls a layer. Only while the rows read few keys
    (ROW_KEYS): a row attends to its whole context, prefill attention reads it once a chunk."""
    tokens = sum(s.num_tokens for s in out.scheduled)
    if tokens > max_rows or all(s.num_tokens == 1 for s in out.scheduled):
        return False
    keys = sum(s.num_tokens * (s.start + s.num_tokens) for s in out.scheduled if s.num_tokens > 1)
    return keys <= ROW_KEYS


def build_batch(
    out: SchedulerOutput,
    page_size: int,
    masks: Sequence[AttentionMask] = (GLOBAL_MASK,),
    device: torch.device = CPU,
    max_rows: int = 0,
) -> ForwardBatch:
    """masks: the distinct masks of the layers that run the step, one metadata each (a capped
    chunked layer's with its page group: shared/kv/chunk_cache.py).
    max_rows: the fused decoder's (0: none), for prefills_as_rows."""
    ids: list[int] = []
    positions: list[int] = []
    for s in out.scheduled:
        end = s.start + s.num_tokens
        ids += s.request.token_ids(s.start, end)
        positions += range(s.start, end)
    as_rows = prefills_as_rows(out, max_rows)
    by_mask = {mask: _mask_metadata(out, page_size, mask, device, as_rows) for mask in masks}
    logits_rows, sample_index, prompt_rows = output_rows(out, device)
    return ForwardBatch(
        input_ids=_ints(ids, device),
        positions=_ints(positions, device),
        meta=StepMetadata(by_mask),
        logits_rows=logits_rows,
        sample_index=sample_index,
        prompt_rows=prompt_rows,
    )


def output_rows(out: SchedulerOutput, device: torch.device = CPU):
    """ForwardBatch's (logits_rows, sample_index, prompt_rows) of a step whose tokens are
    out.scheduled's, in order."""
    logits_rows: list[int] = []
    sample_index: list[int] = []
    prompt_rows: list[tuple[int, int, PromptTargets]] = []
    row = 0
    for i, s in enumerate(out.scheduled):
        if s.samples:
            logits_rows.append(row + s.num_tokens - 1)
            sample_index.append(i)
        targets = s.request.prompt_targets(s.start, s.start + s.num_tokens)
        if targets is not None:
            prompt_rows.append((i, row + targets.first - s.start, targets))
        row += s.num_tokens
    return _ints(logits_rows, device), sample_index, prompt_rows


def request_pages(req, mask: AttentionMask) -> tuple[list[int], int]:
    """(pages, offset): the request's pages under `mask` and the logical page of pages[0] (a
    capped chunked layer's group keeps logical pages req.chunk_first_page on; others, all)."""
    if mask.group:
        return req.chunk_page_ids[mask.group - 1], req.chunk_first_page
    return req.page_ids, 0


def slot_of(pages: list[int], offset: int, position: int, page_size: int) -> int:
    """The pool slot of `position` on pages (pages[0] the logical page `offset`)."""
    return pages[position // page_size - offset] * page_size + position % page_size


def decode_row(pages: list[int], offset: int, ctx: int, page_size: int, mask: AttentionMask):
    """A decode query at position ctx - 1 as the kernel reads it under `mask`: (context, its
    table: pages from the first one it reads on, first_key: the offset in that page of its
    first key). A chunked query sees keys from its chunk's start c = mask.first_key(ctx - 1)
    on, so its table starts at page c // S and its context counts from there; others see all."""
    if mask.kind != CHUNKED:
        return ctx, pages, 0
    start = mask.first_key(ctx - 1)
    first_page = start // page_size
    return ctx - first_page * page_size, pages[first_page - offset :], start % page_size


def _mask_metadata(out, page_size, mask, device, as_rows) -> AttentionMetadata:
    """One mask's metadata; its slots and tables index its layers' pages (request_pages).
    as_rows: prompt tokens are decode rows too, each over its context so far."""
    slots: list[int] = []
    decode: list[tuple[int, int, list[int], int]] = []  # (row, context, pages, first page)
    prefills: list[tuple[int, int, int, list[int], int]] = []  # (row, start, n, pages, first)
    row = 0
    for s in out.scheduled:
        pages, offset = request_pages(s.request, mask)
        end = s.start + s.num_tokens
        slots += [slot_of(pages, offset, p, page_size) for p in range(s.start, end)]
        if s.num_tokens == 1 or as_rows:
            decode += [(row + j, s.start + j + 1, pages, offset) for j in range(s.num_tokens)]
        else:
            prefills.append((row, s.start, s.num_tokens, pages, offset))
        row += s.num_tokens
    return AttentionMetadata(
        slot_mapping=_ints(slots, device),
        decode=_decode_rows(decode, row, page_size, mask, device) if decode else None,
        prefills=[_prefill_span(*p, page_size, mask, device) for p in prefills],
    )


def _decode_rows(
    decode: list[tuple[int, int, list[int], int]],
    num_tokens: int,
    page_size: int,
    mask: AttentionMask,
    device: torch.device,
) -> DecodeRows:
    i32 = torch.int32
    rows = [row for row, *_ in decode]
    read = [decode_row(pages, offset, ctx, page_size, mask) for _, ctx, pages, offset in decode]
    contexts, tables, first_keys = zip(*read)
    max_pages = max(-(-ctx // page_size) for ctx in contexts)
    table: list[int] = []  # (B * Pmax,) each row's pages, padded with page 0
    for t in tables:
        table += t[:max_pages]
        table += [0] * (max_pages - len(t))
    return DecodeRows(
        rows=None if len(rows) == num_tokens else _ints(rows, device),
        block_table=_ints(table, device, i32).view(len(tables), max_pages),  # (B, Pmax)
        context_lens=_ints(contexts, device, i32),  # (B,)
        page_size=page_size,
        window=mask.window if mask.kind != CHUNKED else None,
        first_key=_ints(first_keys, device, i32) if any(first_keys) else None,
    )


def _prefill_span(
    row: int,
    start: int,
    n: int,
    page_ids: list[int],
    offset: int,  # the logical page of page_ids[0]
    page_size: int,
    mask: AttentionMask,
    device: torch.device,
) -> PrefillSpan:
    ctx = start + n
    first_page = 0
    if mask.kind == CHUNKED:  # keys from the first query's chunk on: pages before are unseen
        first_page = mask.first_key(start) // page_size
    key_pos = torch.arange(first_page * page_size, ctx, device=device)  # (keys,)
    pages = page_ids[first_page - offset : -(-ctx // page_size) - offset]  # (ceil(ctx/S) - first,)
    pages = torch.tensor(pages, dtype=torch.long, device=device)
    visible = None
    if start > 0 or mask.restricts(ctx):
        query_pos = torch.arange(start, ctx, device=device)[:, None]  # (n, 1)
        visible = mask.visible(query_pos, key_pos[None, :])  # (n, keys)
    return PrefillSpan(start=row, end=row + n, pages=pages, ctx=len(key_pos), mask=visible)
