"""ModelRunner: one rank's share of a forward pass (its layers and heads) and, on the last
stage, sampling. With pipeline stages, hidden states arrive from the previous stage's rank of
the same TP rank and leave for the next one. With data-parallel attention (--dp) each rank runs
the requests of the step that are its own (none, at times: it still joins the MoE layers'
exchanges), and rank 0 samples from every rank's final hidden states, gathered."""

import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from shared.engine.batch import build_batch, output_rows
from shared.engine.decode_inputs import DecodeInputs
from shared.engine.graphs import DecodeGraphs
from shared.engine.prompt_logprobs import PromptLogprobChunk, score_prompts
from shared.engine.scheduler import SchedulerOutput
from shared.kv.cache import KVCache
from shared.models.layer_attention import distinct_masks
from shared.models.layers.moe import FusedMoE
from shared.parallel.comm import RankComm
from shared.parallel.group import SINGLE, TPGroup
from shared.parallel.pipeline import WHOLE_MODEL, PPStage
from shared.sampling.batch import SamplingBatch, SamplingRow, plain_greedy
from shared.sampling.sampler import SamplerOutput, sample, sample_greedy
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
        dp: TPGroup = SINGLE,  # the data-parallel ranks (--dp)
        decode_rows: int = 0,  # rows of the persistent decode inputs (0: none)
        max_pages: int = 0,  # the most pages a request's block table holds
    ):
        self.model = model
        self.kv = kv
        self.vocab_size = vocab_size
        # one attention metadata a step per distinct mask among this stage's layers
        layers = model.config.layer_attention[stage.start_layer : stage.end_layer]
        self.masks = distinct_masks(layers)
        self.device = kv.device  # the engine's (EngineConfig.device): the pool is there
        self.tp, self.stage, self.comm, self.dp = tp, stage, comm, dp
        # --dp: the MoE layers' experts, in layer order, which a step without requests of this
        # rank's only joins (FusedMoE.idle)
        moe = dp.size > 1
        self.experts = [m for m in model.modules() if moe and isinstance(m, FusedMoE)]
        self.hidden_size = model.config.hidden_size
        self.dtype = kv.spec.dtype
        # after each layer of a forward pass: (global layer index, the step) -> push its new KV
        self.on_layer_done = on_layer_done
        self.graphs = None if on_layer_done is not None else graphs
        self.busy_s = 0.0  # seconds in execute, less those blocked on the previous stage
        self.decode = self._persistent_decode(decode_rows, max_pages)

    def _persistent_decode(self, rows: int, max_pages: int) -> DecodeInputs | None:
        """Decode-only steps' inputs, written in place for the model's one C call through its
        LM head (its decode_call), where this rank runs such steps whole: one stage, one
        tensor- and data-parallel rank, no KV pushed layer by layer; else None."""
        stage, ranks = self.stage, self.tp.size * self.dp.size
        if not rows or ranks > 1 or not (stage.is_first and stage.is_last):
            return None
        if self.on_layer_done is not None or self.device.type != "cpu":
            return None
        call = self.model.decode_call(self.kv, rows, max_pages)
        return None if call is None else DecodeInputs(call, self.kv.spec.page_size)

    @property
    def samples(self) -> bool:
        """Whether this rank samples the steps (and scores the prompts)."""
        return self.stage.is_last and self.tp.rank == 0 and self.dp.rank == 0

    def execute(
        self,
        out: SchedulerOutput,
        rows: list[SamplingRow] | None = None,
        masks: Future[TokenMasks | None] | None = None,
    ) -> tuple[list[int], SamplerOutput | None, list[PromptLogprobChunk]]:
        """Runs this rank's part of the step; returns (indices into out.scheduled that sampled,
        their samples, the prompt logprobs it computed). Samples and scores prompts only on TP
        rank 0 of the last stage of data-parallel rank 0 (None and [] elsewhere).
        rows: sampling states when out holds planned (not engine) requests; masks: the grammar
        rows' allowed tokens, awaited just before sampling (filled meanwhile). The time it
        takes, less the time spent waiting for the previous stage's hidden states, adds to
        busy_s (a stage's utilisation: its forward work, not the Python around the steps)."""
        start, waited = time.perf_counter(), self._waited_s()
        try:
            if self.decode is not None and self.graphs is None:
                decoded = self._decode_step(out, rows, masks)  # no autograd state to guard
                if decoded is not None:
                    return decoded
            return self._execute(out, rows, masks)
        finally:
            self.busy_s += time.perf_counter() - start - (self._waited_s() - waited)

    def _waited_s(self) -> float:
        return 0.0 if self.comm is None else self.comm.wait_s

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput, rows: list[SamplingRow] | None, masks):
        max_rows = getattr(getattr(self.model, "model", None), "fused_rows", 0)
        own = out if self.dp.size == 1 else self._own(out)
        batch = build_batch(own, self.kv.spec.page_size, self.masks, self.device, max_rows)
        hook = self.on_layer_done
        after_layer = None if hook is None else (lambda layer: hook(layer, own))
        hidden = residual = None
        if not self.stage.is_first:
            hidden, residual = self._recv_hidden(len(batch.input_ids))
        if self._fuses_head(out, batch):
            rows = rows or [_sampling_row(out.scheduled[i].request) for i in batch.sample_index]
            greedy = masks is None and all(row.plain_greedy for row in rows)
            fused = self.model.decode_logits(
                batch.input_ids, batch.positions, self.kv, batch.meta, batch.logits_rows, greedy,
                hidden, residual,
            )  # fmt: skip
            if fused is not None:
                logits, tokens = fused
                if tokens is not None:
                    return batch.sample_index, SamplerOutput(tokens, None, None, None), []
                return batch.sample_index, self._sample(logits, rows, masks), []
        if not own.scheduled:  # --dp: other ranks' requests only
            for experts in self.experts:
                experts.idle()
            hidden = torch.empty((0, self.hidden_size), dtype=self.dtype, device=self.device)
        elif self.graphs is not None and self.graphs.fits(out):
            hidden, residual = self.graphs.run(batch, hidden, residual)
        else:
            hidden, residual = self.model(
                batch.input_ids, batch.positions, self.kv, batch.meta, hidden, residual, after_layer
            )
        if not self.stage.is_last:
            self._send_hidden(hidden, residual)
            return [], None, []
        rows_of = batch.logits_rows, batch.sample_index, batch.prompt_rows
        if self.dp.size > 1:  # rank 0 samples every rank's rows
            hidden = self._gather(out, hidden)
            if self.dp.rank:
                return [], None, []
            rows_of = output_rows(out, self.device)
        logits_rows, sample_index, prompt_rows = rows_of
        keep = self.tp.rank == 0
        compute_logits = self.model.compute_logits
        prompt = score_prompts(hidden, prompt_rows, compute_logits, self.vocab_size, keep)
        if not sample_index:
            return [], None, prompt
        logits = compute_logits(hidden[logits_rows])  # (N, vocab)
        if not keep:
            return sample_index, None, prompt
        if rows is None:
            rows = [_sampling_row(out.scheduled[i].request) for i in sample_index]
        return sample_index, self._sample(logits, rows, masks), prompt

    def _decode_step(self, out: SchedulerOutput, rows: list[SamplingRow] | None, masks):
        """A decode-only step through the persistent inputs (self.decode) and the model's one
        call to its logits and, where every row is plain greedy, their argmax; None, with
        nothing computed, where out is not such a step."""
        num_rows = self.decode.fill(out.scheduled)
        if not num_rows:
            return None
        requests = [s.request for s in out.scheduled]
        if rows is not None:
            greedy = all(row.plain_greedy for row in rows)
        else:
            greedy = all(
                plain_greedy(r.params, len(r.output_token_ids), r.stop_token_ids) for r in requests
            )
        greedy = greedy and masks is None
        logits, tokens = self.decode.call(num_rows, self.decode.strides, greedy)
        index = list(range(num_rows))
        if tokens is not None:
            return index, SamplerOutput(tokens, None, None, None), []
        rows = rows or [_sampling_row(req) for req in requests]
        return index, self._sample(logits, rows, masks), []

    def _fuses_head(self, out: SchedulerOutput, batch) -> bool:
        """Whether to ask the model for the step's logits (and greedy tokens) from its fused
        decode call (decode_logits): a last stage's step that samples and scores no prompt, on
        one tensor-parallel and data-parallel rank (the head whole), not pushing KV layer by
        layer nor replaying a decode graph."""
        return (
            self.stage.is_last
            and self.tp.size == 1
            and self.dp.size == 1
            and self.on_layer_done is None
            and bool(batch.sample_index)
            and not batch.prompt_rows
            and (self.graphs is None or not self.graphs.fits(out))
        )

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], masks) -> SamplerOutput:
        """The rows' tokens from their logits (N, vocab): plain greedy rows' argmax at once,
        else through a SamplingBatch, with the grammar rows' masks once they are filled."""
        if masks is None and all(row.plain_greedy for row in rows):
            return sample_greedy(logits)
        allowed = None if masks is None else masks.result()
        sampling = SamplingBatch.build(rows, self.vocab_size, logits.device, allowed)
        return sample(logits, sampling)

    def _own(self, out: SchedulerOutput) -> SchedulerOutput:
        """The requests of the step that this data-parallel rank computes."""
        return SchedulerOutput([s for s in out.scheduled if s.request.dp_rank == self.dp.rank])

    def _gather(self, out: SchedulerOutput, hidden: torch.Tensor) -> torch.Tensor:
        """(T, H) the step's final hidden states from every data-parallel rank's (T_d, H), in
        out.scheduled's order: the scheduler puts each rank's requests after the previous
        rank's (data_parallel.py)."""
        sizes = [0] * self.dp.size
        for s in out.scheduled:
            sizes[s.request.dp_rank] += s.num_tokens
        return self.dp.all_gather_rows(hidden, sizes)

    def _recv_hidden(self, num_tokens: int):
        both = self.comm.recv_hidden((2, num_tokens, self.hidden_size), self.dtype)
        return both[0], both[1]  # (T, H) hidden, (T, H) residual

    def _send_hidden(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        self.comm.send_hidden(torch.stack([hidden, residual]))  # (2, T, H)


def _sampling_row(req) -> SamplingRow:
    return SamplingRow(
        params=req.params,
        seed=req.seed,
        prompt_token_ids=req.prompt_token_ids,
        output_token_ids=req.output_token_ids,
        stop_token_ids=req.stop_token_ids,
    )
