"""A worker's shape `--tp T --pp P [--ep] [--dp D]`: D x T x P ranks, checked against the model
and the machine before any process starts. Rank r is TP rank r % T of pipeline stage
r % (T * P) // T of data-parallel rank r // (T * P). With `--ep` a stage's T ranks hold whole
experts of its MoE layers, E / T each, instead of 1/T of every expert
(shared/models/layers/moe_ep.py); attention stays tensor-parallel. With `--dp D` (data-parallel
attention, T = P = 1 for now) each of D ranks runs the whole model on its own requests, with
its own KV pool, but for the MoE layers' experts: those are spread whole over the D ranks, which
exchange their tokens (SGLang's DP attention, vLLM's data parallel with expert parallelism)."""

import os
from dataclasses import dataclass

from shared.errors import InvalidRequestError
from shared.parallel.pipeline import PPStage, split_layers


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1  # tensor-parallel size: ranks sharing each layer
    pp: int = 1  # pipeline-parallel size: stages of contiguous layers
    pp_layers: tuple[int, ...] | None = None  # layers per stage (--pp-layers 3,1); None: even
    allow_oversubscribe: bool = False  # more ranks than CPU cores (tests on small machines)
    ep: bool = False  # expert parallelism over each stage's TP ranks
    dp: int = 1  # data-parallel attention ranks; MoE experts spread over them

    def __post_init__(self) -> None:
        for flag, value in (("--tp", self.tp), ("--pp", self.pp), ("--dp", self.dp)):
            if not isinstance(value, int) or value < 1:
                raise InvalidRequestError(flag, f"must be an integer >= 1, got {value!r}")
        if self.pp_layers is not None:
            object.__setattr__(self, "pp_layers", tuple(self.pp_layers))
            if len(self.pp_layers) != self.pp or min(self.pp_layers) < 1:
                raise InvalidRequestError(
                    "--pp-layers", f"needs {self.pp} counts >= 1 (one per stage)"
                )
        if self.dp > 1 and (self.tp > 1 or self.pp > 1):
            raise InvalidRequestError("--dp", "data-parallel attention runs with --tp 1 --pp 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def validate(self, num_heads: int, num_kv_heads: int, num_layers: int) -> None:
        """Raises InvalidRequestError naming the flag if this shape cannot run the model here."""
        if num_heads % self.tp:
            raise InvalidRequestError(
                "--tp", f"{self.tp} does not divide the model's {num_heads} attention heads"
            )
        if num_kv_heads % self.tp and self.tp % num_kv_heads:
            raise InvalidRequestError(
                "--tp", f"{self.tp} and the model's {num_kv_heads} KV heads must divide one another"
            )
        if self.pp > num_layers:
            raise InvalidRequestError(
                "--pp", f"{self.pp} stages exceed the model's {num_layers} layers"
            )
        if self.pp_layers is not None and sum(self.pp_layers) != num_layers:
            raise InvalidRequestError(
                "--pp-layers", f"{self.pp_layers} must add up to the {num_layers} layers"
            )
        cores = os.cpu_count() or 1
        if self.world_size > cores and not self.allow_oversubscribe:
            raise InvalidRequestError(
                "--tp/--pp/--dp",
                f"{self.world_size} ranks exceed the {cores} CPU cores "
                "(pass --allow-oversubscribe to run anyway)",
            )

    def stage_bounds(self, num_layers: int) -> list[tuple[int, int]]:
        """(start, end) layers of each stage."""
        if self.pp_layers is None:
            return split_layers(num_layers, self.pp)
        bounds, start = [], 0
        for count in self.pp_layers:
            bounds.append((start, start + count))
            start += count
        return bounds

    def stage_of(self, rank: int, num_layers: int) -> PPStage:
        index = rank % (self.tp * self.pp) // self.tp
        start, end = self.stage_bounds(num_layers)[index]
        return PPStage(rank=index, size=self.pp, start_layer=start, end_layer=end)

    def rank_of(self, stage: int, tp_rank: int) -> int:
        """The rank of a stage's TP rank (of data-parallel rank 0)."""
        return stage * self.tp + tp_rank

    def dp_rank(self, rank: int) -> int:
        return rank // (self.tp * self.pp)


SINGLE_RANK = ParallelConfig()
