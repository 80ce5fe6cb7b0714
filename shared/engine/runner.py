"""ModelRunner: one rank's share of a forward pass (its layers and heads) and, on the last
stage, sampling. With pipeline stages, hidden states arrive from the previous stage's rank of
the same TP rank and leave for the next one."""

import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from shared.engine.batch import build_batch
from shared.engine.graphs import DecodeGraphs
from shared.engine.prompt_logprobs import PromptLogprobChunk, score_prompts
from shared.engine.scheduler import SchedulerOutput
from shared.kv.cache import KVCache
from shared.models.layer_attention import distinct_masks
from shared.parallel.comm import HIDDEN, RankComm
from shared.parallel.group import SINGLE, TPGroup
from shared.parallel.pipeline import WHOLE_MODEL, PPStage
from shared.sampling.batch import SamplingBatch, SamplingRow
from shared.sampling.sampler import SamplerOutput, sample
from shared.sampling.token_mask import TokenMasks


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCache,
        vocab_size: int,
        tp: TPGroup = SINGLE,
        stage: PPStage = WHOLE_MODEL,
        comm: RankComm | None = None,  # needed when stage.size > 1
        on_layer_done: Callable[[int, SchedulerOutput], None] | None = None,
        graphs: DecodeGraphs | None = None,  # decode-only steps replay these (graphs.py)
    ):
        self.model = model
        self.kv = kv
        self.vocab_size = vocab_size
        # one attention metadata a step per distinct mask among this stage's layers
        layers = model.config.layer_attention[stage.start_layer : stage.end_layer]
        self.masks = distinct_masks(layers)
        self.device = kv.device  # the engine's (EngineConfig.device): the pool is there
        self.tp, self.stage, self.comm = tp, stage, comm
        self.hidden_size = model.config.hidden_size
        self.dtype = kv.spec.dtype
        # after each layer of a forward pass: (global layer index, the step) -> push its new KV
        self.on_layer_done = on_layer_done
        self.graphs = None if on_layer_done is not None else graphs
        self.busy_s = 0.0  # seconds in execute, less those blocked on the previous stage

    def execute(
        self,
        out: SchedulerOutput,
        rows: list[SamplingRow] | None = None,
        masks: Future[TokenMasks | None] | None = None,
    ) -> tuple[list[int], SamplerOutput | None, list[PromptLogprobChunk]]:
        """Runs this rank's part of the step; returns (indices into out.scheduled that sampled,
        their samples, the prompt logprobs it computed). Samples and scores prompts only on TP
        rank 0 of the last stage (None and [] elsewhere).
        rows: sampling states when out holds planned (not engine) requests; masks: the grammar
        rows' allowed tokens, awaited just before sampling (filled meanwhile). The time it
        takes, less the time spent waiting for the previous stage's hidden states, adds to
        busy_s (a stage's utilisation: its forward work, not the Python around the steps)."""
        start, waited = time.perf_counter(), self._waited_s()
        try:
            return self._execute(out, rows, masks)
        finally:
            self.busy_s += time.perf_counter() - start - (self._waited_s() - waited)

    def _waited_s(self) -> float:
        return 0.0 if self.comm is None else self.comm.wait_s

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput, rows: list[SamplingRow] | None, masks):
        max_rows = getattr(getattr(self.model, "model", None), "fused_rows", 0)
        batch = build_batch(out, self.kv.spec.page_size, self.masks, self.device, max_rows)
        hook = self.on_layer_done
        after_layer = None if hook is None else (lambda layer: hook(layer, out))
        hidden = residual = None
        if not self.stage.is_first:
            hidden, residual = self._recv_hidden(len(batch.input_ids))
        if self.graphs is not None and self.graphs.fits(out):
            hidden, residual = self.graphs.run(batch, hidden, residual)
        else:
            hidden, residual = self.model(
                batch.input_ids, batch.positions, self.kv, batch.meta, hidden, residual, after_layer
            )
        if not self.stage.is_last:
            self._send_hidden(hidden, residual)
            return [], None, []
        keep = self.tp.rank == 0
        compute_logits = self.model.compute_logits
        prompt = score_prompts(hidden, batch.prompt_rows, compute_logits, self.vocab_size, keep)
        if not batch.sample_index:
            return [], None, prompt
        logits = compute_logits(hidden[batch.logits_rows])  # (N, vocab)
        if not keep:
            return batch.sample_index, None, prompt
        if rows is None:
            rows = [_sampling_row(out.scheduled[i].request) for i in batch.sample_index]
        allowed = None if masks is None else masks.result()
        sampling = SamplingBatch.build(rows, self.vocab_size, logits.device, allowed)
        return batch.sample_index, sample(logits, sampling), prompt

    def _recv_hidden(self, num_tokens: int):
        src = self.comm.rank - self.comm.shape.tp  # same TP rank, previous stage
        both = self.comm.recv_tensor((2, num_tokens, self.hidden_size), self.dtype, src, HIDDEN)
        return both[0], both[1]  # (T, H) hidden, (T, H) residual

    def _send_hidden(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        dst = self.comm.rank + self.comm.shape.tp
        self.comm.send_tensor(torch.stack([hidden, residual]), dst, HIDDEN)  # (2, T, H)


def _sampling_row(req) -> SamplingRow:
    return SamplingRow(
        params=req.params,
        seed=req.seed,
        prompt_token_ids=req.prompt_token_ids,
        output_token_ids=req.output_token_ids,
        stop_token_ids=req.stop_token_ids,
    )
