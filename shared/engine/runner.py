"""ModelRunner: one forward pass and sampling for a scheduled batch, on this rank's shards."""

from collections.abc import Callable

import torch

from shared.engine.batch import build_batch
from shared.engine.scheduler import SchedulerOutput
from shared.kv.cache import KVCache
from shared.sampling.batch import SamplingBatch, SamplingRow
from shared.sampling.sampler import SamplerOutput, sample


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, kv: KVCache, vocab_size: int, sliding_window: int | None
    ):
        self.model = model
        self.kv = kv
        self.vocab_size = vocab_size
        self.sliding_window = sliding_window
        # after each layer of a forward pass: (global layer index, the step) -> push its new KV
        self.on_layer_done: Callable[[int, SchedulerOutput], None] | None = None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[int], SamplerOutput | None]:
        """Runs the step; returns (indices into out.scheduled that sampled, their samples)."""
        batch = build_batch(out, self.kv.spec.page_size, self.sliding_window)
        hook = self.on_layer_done
        after_layer = None if hook is None else (lambda layer: hook(layer, out))
        hidden, _ = self.model(
            batch.input_ids, batch.positions, self.kv, batch.meta, after_layer=after_layer
        )
        if not batch.sample_index:
            return [], None
        logits = self.model.compute_logits(hidden[batch.logits_rows])  # (N, vocab)
        rows = [_sampling_row(out.scheduled[i].request) for i in batch.sample_index]
        sampling = SamplingBatch.build(rows, self.vocab_size, logits.device)
        return batch.sample_index, sample(logits, sampling)


def _sampling_row(req) -> SamplingRow:
    return SamplingRow(
        params=req.params,
        seed=req.seed,
        prompt_token_ids=req.prompt_token_ids,
        output_token_ids=req.output_token_ids,
        stop_token_ids=req.stop_token_ids,
    )
