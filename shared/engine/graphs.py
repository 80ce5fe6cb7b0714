"""Decode steps replayed from captured CUDA graphs, as vLLM and Infire do: a step of B decode
rows runs the graph captured for the smallest batch size G >= B (SIZES), its inputs copied into
static buffers and rows B..G padded. Launching one graph replaces the hundreds of kernel
launches of an eager step, which at small batches cost more than the kernels themselves.

Padded rows attend to and write a scratch page of their own (the pool holds one page more than
the allocator hands out: `scratch_pages`), so they never touch a request's KV. Each row's block
table is `max_pages` wide, the most a sequence can hold, so one graph serves every context; the
attention kernels read only up to each row's context length.

On the CPU (`decode_graphs="on"`) nothing is captured: each step runs the same forward through
the same static buffers and padding, which is how the tests check them without a GPU. Steps
that are not all decode rows, larger batches, chunked layers and prefill workers (they push KV
layer by layer) run eagerly."""

import logging
from collections.abc import Callable

import torch

from shared.models.layer_attention import CHUNKED, AttentionMask
from shared.models.layers.attention import AttentionMetadata, DecodeRows, StepMetadata
from shared.models.layers.moe import FusedMoE

log = logging.getLogger(__name__)
SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)  # batch sizes captured
Forward = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]  # the stage's model forward


def scratch_pages(uses_graphs: bool) -> int:
    """Pages the pool holds beyond the allocator's: the padded rows' page."""
    return 1 if uses_graphs else 0


def graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes captured: SIZES up to the first that holds max_num_seqs rows."""
    sizes = [s for s in SIZES if s < max_num_seqs]
    return (*sizes, min(max_num_seqs, SIZES[-1]))


class DecodeGraphs:
    """A stage's decode forward at each of `sizes`, over static input buffers on `device`.
    forward(input_ids, positions, kv, meta, hidden, residual, after_layer) is the stage's model;
    hidden_size > 0 on stages after the first (their input is the previous stage's hidden and
    residual), 0 on the first."""

    def __init__(
        self,
        forward: Forward,
        kv,
        masks: list[AttentionMask],
        sizes: tuple[int, ...],
        max_pages: int,
        scratch_page: int,
        hidden: tuple[int, torch.dtype] | None = None,  # (hidden size, dtype) after stage 0
    ):
        self.forward_fn, self.kv, self.masks = forward, kv, masks
        self.sizes = tuple(sorted(sizes))
        self.page_size = kv.spec.page_size
        self.scratch_page, self.scratch_slot = scratch_page, scratch_page * self.page_size
        device, most = kv.device, self.sizes[-1]
        self.device = device
        self.input_ids = torch.zeros(most, dtype=torch.long, device=device)
        self.positions = torch.zeros(most, dtype=torch.long, device=device)
        self.slots = torch.full((most,), self.scratch_slot, dtype=torch.long, device=device)
        self.block_table = torch.full((most, max_pages), scratch_page, dtype=torch.int32)
        self.block_table = self.block_table.to(device)  # (G, max_pages)
        self.context_lens = torch.ones(most, dtype=torch.int32, device=device)
        self.hidden = self.residual = None
        if hidden is not None:
            size, dtype = hidden
            self.hidden = torch.zeros(most, size, dtype=dtype, device=device)
            self.residual = torch.zeros(most, size, dtype=dtype, device=device)
        self._graphs: dict[int, tuple[object, tuple]] = {}  # size -> (graph, its outputs)

    @staticmethod
    def unsupported(model: torch.nn.Module, masks: list[AttentionMask], capture: bool):
        """Why a stage's decode steps cannot run here, or None: chunked layers read from their
        chunk's page on (their tables differ row by row); MoE layers group the rows by expert
        on the host, a sync no capture can hold (the CPU's static buffers take them)."""
        if any(mask.kind == CHUNKED for mask in masks):
            return "chunked attention layers"
        if capture and any(isinstance(m, FusedMoE) for m in model.modules()):
            return "MoE layers group rows by expert on the host"
        return None

    def fits(self, out) -> bool:
        """Whether a step runs here: decode rows only (one token each), few enough."""
        n = len(out.scheduled)
        return 0 < n <= self.sizes[-1] and all(s.num_tokens == 1 for s in out.scheduled)

    def capture(self) -> None:
        """Captures every size, largest first, into one memory pool (CUDA only)."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: lazy inits, autotuning, cupy modules
                self._forward(size)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = self._forward(size)
            self._graphs[size] = (graph, outputs)
        log.info("captured decode graphs for batch sizes %s", ",".join(map(str, self.sizes)))

    def run(self, batch, hidden=None, residual=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage's forward of a decode-only batch: (hidden, residual) of its B rows."""
        n = len(batch.input_ids)
        size = next(s for s in self.sizes if s >= n)
        self._fill(batch, n, size, hidden, residual)
        if size in self._graphs:
            graph, (out, res) = self._graphs[size]
            graph.replay()
        else:
            out, res = self._forward(size)
        return out[:n], None if res is None else res[:n]  # the last stage returns no residual

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model over the first `size` rows of the buffers. The metadata is built here, in
        the captured region, so that what a backend derives from it (a mask, say) is captured
        too and recomputed by every replay."""
        table, lens = self.block_table[:size], self.context_lens[:size]
        by_mask = {
            mask: AttentionMetadata(
                self.slots[:size], DecodeRows(None, table, lens, self.page_size, mask.window), []
            )
            for mask in self.masks  # global or sliding: unsupported() turns chunked away
        }
        hidden = None if self.hidden is None else self.hidden[:size]
        residual = None if self.residual is None else self.residual[:size]
        meta = StepMetadata(by_mask)
        ids, positions = self.input_ids[:size], self.positions[:size]
        return self.forward_fn(ids, positions, self.kv, meta, hidden, residual, None)

    def _fill(self, batch, n: int, size: int, hidden, residual) -> None:
        """Copies a batch's n rows into the buffers; rows n..size decode the scratch page."""
        meta = batch.meta.of(self.masks[0])  # global and sliding masks share slots and tables
        decode = meta.decode
        width = decode.block_table.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.block_table[:n, :width].copy_(decode.block_table)
        self.block_table[:n, width:].zero_()  # never read: past each row's context
        self.context_lens[:n].copy_(decode.context_lens)
        if hidden is not None:
            self.hidden[:n].copy_(hidden)
            self.residual[:n].copy_(residual)
        if size > n:  # rows a previous, larger step left: back to the scratch page
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slots[n:size].fill_(self.scratch_slot)
            self.block_table[n:size, 0].fill_(self.scratch_page)
            self.context_lens[n:size].fill_(1)
