"""A whole model's decode steps, layers to LM head, in one C call over inputs allocated once.

The engine writes each decode-only step's rows into the tensors here (token ids, positions,
and per attention mask the new tokens' slots, the keys each row reads and its block table:
shared/engine/decode_inputs.py), then calls. Every argument of the C call was checked and
converted when the call was built (kernels/cpu/decode_layer.py's DecodeCall): a step pays for
writing its rows, not for ~10 tensors, 5 dataclasses and ~20 ctypes arguments built anew
(vLLM v1's persistent batch, for the CPU's one-call step)."""

import torch

from kernels.cpu.decode_layer import DecodeCall, StepMask, int_array
from shared.kv.cache import KVCache
from shared.models.layer_attention import CHUNKED
from shared.models.layers.decode_layer import FusedDecoder


class FusedCall:
    """`fused`'s layers, then the final norm, the LM head and greedy steps' argmax, for up to
    `rows` decode rows whose tables are at most `max_pages` wide. Inputs: ids, positions (R,)
    int64, and for masks[i] (the decoder's distinct masks, in its order) slots[i] (R,) int64,
    context_lens[i] (R,) int32 and tables[i] (R * max_pages,) int32, each step's rows at the
    stride it passes."""

    def __init__(
        self,
        fused: FusedDecoder,
        kv: KVCache,
        rows: int,
        max_pages: int,
        final_norm: tuple[torch.Tensor, float],
        head: torch.Tensor,  # (V, H) bf16
    ):
        self.masks = fused.masks
        self.rows, self.max_pages = rows, max_pages
        self.ids = torch.zeros(rows, dtype=torch.int64)
        self.positions = torch.zeros(rows, dtype=torch.int64)
        self.slots = [torch.zeros(rows, dtype=torch.int64) for _ in self.masks]
        self.context_lens = [torch.zeros(rows, dtype=torch.int32) for _ in self.masks]
        # only each step's rows are written and read: the rest stays unmapped
        self.tables = [torch.empty(rows * max_pages, dtype=torch.int32) for _ in self.masks]
        windows = [(mask.kind != CHUNKED and mask.window) or 0 for mask in self.masks]
        steps = [
            StepMask(slots.data_ptr(), table.data_ptr(), lens.data_ptr(), max_pages, window)
            for slots, table, lens, window in zip(
                self.slots, self.tables, self.context_lens, windows
            )
        ]
        self._pairs, self._temperature = fused.pairs, fused.temperature
        self._cs = self._temperatures = None
        if fused.pairs is not None:  # (R, hd) each row's cosines then sines
            width = fused.pairs.cos_sin_rows(self.positions[:1]).shape[1]
            self._cs = torch.zeros(rows, width, dtype=torch.float32)
        if fused.temperature is not None:
            self._temperatures = torch.zeros(rows, dtype=torch.float32)
        self._call = DecodeCall(
            fused.specs, fused.embedding, self.ids, self.positions, fused.pools_of(kv), steps,
            kv.spec.page_size, final_norm, head, self._cs, self._temperatures,
            fused.max_positions,
        )  # fmt: skip
        self._tokens, self._positions = int_array(self._call.tokens), self.positions.numpy()
        self._cs_rows = None if self._cs is None else self._cs.numpy()
        self._temperature_rows = None if self._temperatures is None else self._temperatures.numpy()

    def __call__(
        self, num_rows: int, strides: list[int], greedy: bool
    ) -> tuple[torch.Tensor | None, list[int] | None]:
        """The first num_rows rows, mask i's tables at strides[i] -> greedy: (None, the
        logits' argmax, T ints); else (logits (T, V) bf16, valid until the next call,
        None)."""
        if self._cs is not None:
            self._pairs.cos_sin_into(self._positions[:num_rows], self._cs_rows)
        if self._temperatures is not None:
            self._temperature.into(self._positions[:num_rows], self._temperature_rows)
        self._call(num_rows, strides, greedy)
        if greedy:  # ints, not a tensor: building one costs ~40 us on the flushed caches
            return None, self._tokens[:num_rows]
        return self._call.logits[:num_rows], None
