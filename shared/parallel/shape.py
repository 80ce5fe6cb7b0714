"""A worker's shape `--tp T --pp P [--ep]`: T x P ranks, checked against the model and the
machine before any process starts. Rank r is TP rank r % T of pipeline stage r // T. With `--ep`
a stage's T ranks hold whole experts of its MoE layers, E / T each, instead of 1/T of every
expert (shared/models/layers/moe_ep.py); attention stays tensor-parallel."""

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

    def __post_init__(self) -> None:
        for flag, value in (("--tp", self.tp), ("--pp", self.pp)):
            if not isinstance(value, int) or value < 1:
                raise InvalidRequestError(flag, f"must be an integer >= 1, got {value!r}")
        if self.pp_layers is not None:
            object.__setattr__(self, "pp_layers", tuple(self.pp_layers))
            if len(self.pp_layers) != self.pp or min(self.pp_layers) < 1:
                raise InvalidRequestError(
                    "--pp-layers", f"needs {self.pp} counts >= 1 (one per stage)"
                )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

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
                "--tp/--pp",
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
        index = rank // self.tp
        start, end = self.stage_bounds(num_layers)[index]
        return PPStage(rank=index, size=self.pp, start_layer=start, end_layer=end)

    def rank_of(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank


SINGLE_RANK = ParallelConfig()
