"""A decode-only step's rows, written in place into the persistent inputs of the model's fused
call (shared/models/layers/fused_call.py): what build_batch computes for such a step, without
its tensors and dataclasses, and through ctypes arrays: no torch or numpy call a step."""

from collections.abc import Sequence

from kernels.cpu.decode_layer import int_array
from shared.engine.batch import decode_row, request_pages, slot_of
from shared.engine.scheduler import ScheduledRequest
from shared.models.layer_attention import AttentionMask


class DecodeInputs:
    """Writes steps into `call`'s inputs (a FusedCall's ids, positions, and each mask's slots,
    context lengths and tables) through ctypes arrays over them. strides: each mask's table row
    width in the step last written."""

    def __init__(self, call, page_size: int):
        self.call, self.page_size = call, page_size
        self.strides = [1] * len(call.masks)
        self._ids, self._positions = int_array(call.ids), int_array(call.positions)
        self._outs = [
            (int_array(slots), int_array(lens), int_array(table))
            for slots, lens, table in zip(call.slots, call.context_lens, call.tables)
        ]

    def fill(self, scheduled: Sequence[ScheduledRequest]) -> int:
        """Writes a decode-only step (each request computes one output token after its
        prompt) and returns its row count; 0, with nothing the call reads changed, where the
        step is not one the call takes: a prompt token, more rows than the call holds, a
        chunked layer's chunk that does not start a page, a table wider than the call's."""
        num_rows = len(scheduled)
        if not 0 < num_rows <= self.call.rows:
            return 0
        ids, positions = [], []
        for s in scheduled:
            output = s.start - len(s.request.prompt_token_ids)
            if s.num_tokens != 1 or output < 0:
                return 0
            ids.append(s.request.output_token_ids[output])
            positions.append(s.start)
        by_mask = [self._rows(mask, scheduled) for mask in self.call.masks]
        if any(rows is None for rows in by_mask):
            return 0
        self._ids[:num_rows] = ids
        self._positions[:num_rows] = positions
        for i, ((slots, lens, table, width), (slots_out, lens_out, table_out)) in enumerate(
            zip(by_mask, self._outs)
        ):
            slots_out[:num_rows] = slots
            lens_out[:num_rows] = lens
            table_out[: len(table)] = table
            self.strides[i] = width
        return num_rows

    def _rows(self, mask: AttentionMask, scheduled: Sequence[ScheduledRequest]):
        """(slots, context lengths, table (B * W,) 0-padded, W) of the rows under `mask`, as
        build_batch's metadata holds them; None where the call cannot take them."""
        page_size = self.page_size
        slots, lens, rows = [], [], []
        for s in scheduled:
            pages, offset = request_pages(s.request, mask)
            slots.append(slot_of(pages, offset, s.start, page_size))
            context, table, first_key = decode_row(pages, offset, s.start + 1, page_size, mask)
            if first_key:  # a chunk starting mid-page: the call has no first keys
                return None
            lens.append(context)
            rows.append(table[: -(-context // page_size)])
        width = max(len(row) for row in rows)
        if width > self.call.max_pages:
            return None
        table = []
        for row in rows:
            table += row
            table += [0] * (width - len(row))
        return slots, lens, table, width
