"""Turns a SchedulerOutput into the flat tensors of one forward pass, on the engine's device."""

from dataclasses import dataclass

import torch

from shared.engine.scheduler import SchedulerOutput
from shared.models.layers.attention import AttentionMetadata, DecodeRows, PrefillSpan

CPU = torch.device("cpu")


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # (N,) rows of T whose next token is sampled
    sample_index: list[int]  # indices into scheduled of the N sampling requests


def build_batch(
    out: SchedulerOutput,
    page_size: int,
    sliding_window: int | None = None,
    device: torch.device = CPU,
) -> ForwardBatch:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    sample_index: list[int] = []
    decode: list[tuple[int, int, list[int]]] = []  # single-token rows: (row, context, page ids)
    prefills: list[PrefillSpan] = []
    for i, s in enumerate(out.scheduled):
        req, row = s.request, len(ids)
        end = s.start + s.num_tokens
        ids += req.token_ids(s.start, end)
        positions += range(s.start, end)
        slots += [
            req.page_ids[p // page_size] * page_size + p % page_size for p in range(s.start, end)
        ]
        if s.samples:
            logits_rows.append(row + s.num_tokens - 1)
            sample_index.append(i)
        if s.num_tokens == 1:
            decode.append((row, end, req.page_ids))
        else:
            prefills.append(
                _prefill_span(
                    row, s.start, s.num_tokens, req.page_ids, page_size, sliding_window, device
                )
            )
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        decode=_decode_rows(decode, len(ids), page_size, sliding_window, device)
        if decode
        else None,
        prefills=prefills,
    )
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta,
        logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=device),
        sample_index=sample_index,
    )


def _decode_rows(
    decode: list[tuple[int, int, list[int]]], num_tokens: int, page_size: int, window, device
) -> DecodeRows:
    long, i32 = torch.long, torch.int32
    rows, contexts, tables = zip(*decode)
    max_pages = max(-(-ctx // page_size) for ctx in contexts)
    table = [t[:max_pages] + [0] * (max_pages - len(t)) for t in tables]
    return DecodeRows(
        rows=None if len(rows) == num_tokens else torch.tensor(rows, dtype=long, device=device),
        block_table=torch.tensor(table, dtype=i32, device=device),  # (B, Pmax)
        context_lens=torch.tensor(contexts, dtype=i32, device=device),  # (B,)
        page_size=page_size,
        window=window,
    )


def _prefill_span(
    row: int, start: int, n: int, page_ids: list[int], page_size: int, window, device
) -> PrefillSpan:
    ctx = start + n
    key_pos = torch.arange(ctx, device=device)
    pages = page_ids[: -(-ctx // page_size)]  # (ceil(ctx / S),)
    pages = torch.tensor(pages, dtype=torch.long, device=device)
    mask = None
    if start > 0 or (window is not None and ctx > window):
        query_pos = torch.arange(start, ctx, device=device)[:, None]  # (n, 1)
        mask = key_pos[None, :] <= query_pos  # (n, ctx)
        if window is not None:
            mask &= key_pos[None, :] > query_pos - window
    return PrefillSpan(start=row, end=row + n, pages=pages, ctx=ctx, mask=mask)
