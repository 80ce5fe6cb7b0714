"""Executors run the engine's micro-batches on its ranks. `launch` starts one (rank 0 runs its
own stage part at once), `collect` returns the oldest one's samples. Up to `depth` micro-batches
are in flight: one without pipeline stages, P with P stages."""

import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.engine.config import EngineConfig
from shared.engine.plan import decode_result, encode_plan, encode_stop
from shared.engine.ranks import RankProcesses
from shared.engine.runner import ModelRunner
from shared.engine.scheduler import SchedulerOutput
from shared.engine.shard import build_shard
from shared.models.config import ModelConfig
from shared.parallel.comm import PLAN, RESULT, RankComm
from shared.parallel.cores import pin, rank_cores
from shared.parallel.group import SINGLE
from shared.parallel.pipeline import WHOLE_MODEL
from shared.sampling.sampler import SamplerOutput

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    out: SchedulerOutput  # what was launched
    sample_index: list[int]  # indices into out.scheduled that sampled
    samples: SamplerOutput | None
    error: Exception | None = None  # the step failed; its requests fail, the others go on


class LocalExecutor:
    """One rank (T = P = 1): a micro-batch runs to its end inside `launch`."""

    depth = 1

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.plan_extras: Callable[[SchedulerOutput], dict] | None = None  # as RankExecutor's
        self._done: deque[StepResult] = deque()

    @property
    def num_in_flight(self) -> int:
        return len(self._done)

    def launch(self, out: SchedulerOutput) -> None:
        if self.plan_extras is not None:
            self.plan_extras(out)
        self._done.append(_run(self.runner, out))

    def collect(self) -> StepResult:
        return self._done.popleft()

    def close(self) -> None:
        self.runner.kv.close()


class RankExecutor:
    """Rank 0 of T x P ranks: sends each micro-batch's plan to every other rank, runs its own
    part (stage 0, TP rank 0), and with P > 1 returns at once; results come back from the last
    stage's TP rank 0 in launch order. `plan_extras(out)` adds fields to the plan (KV push)."""

    def __init__(self, runner: ModelRunner, comm: RankComm, ranks: RankProcesses):
        self.runner, self.comm, self.ranks = runner, comm, ranks
        shape = comm.shape
        self.depth = shape.pp
        self.last_rank = shape.rank_of(shape.pp - 1, 0)
        self.plan_extras: Callable[[SchedulerOutput], dict] | None = None
        self._ids = itertools.count()
        self._pending: deque[StepResult] = deque()
        self.last_stage_busy_s = 0.0  # the last stage's seconds of work, as it last reported

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    def launch(self, out: SchedulerOutput) -> None:
        extras = self.plan_extras(out) if self.plan_extras is not None else None
        plan = encode_plan(next(self._ids), out, extras)
        for rank in range(1, self.comm.shape.world_size):
            self.comm.send_bytes(plan, rank, PLAN)
        self._pending.append(_run(self.runner, out))

    def collect(self) -> StepResult:
        result = self._pending.popleft()
        if self.depth > 1:  # the samples come from the last stage
            reply = decode_result(self.comm.recv_bytes(self.last_rank, RESULT))
            result.sample_index, result.samples = reply.sample_index, reply.samples
            self.last_stage_busy_s = reply.busy_s
        return result

    def close(self) -> None:
        self.ranks.stop(self.comm, encode_stop())
        self.runner.kv.close()


def _run(runner: ModelRunner, out: SchedulerOutput) -> StepResult:
    try:
        return StepResult(out, *runner.execute(out))
    except Exception as e:
        log.exception("step failed; failing its %d requests", len(out.scheduled))
        return StepResult(out, [], None, e)


def start_executor(config: EngineConfig, cfg: ModelConfig, num_pages: int):
    """The executor for config's shape; with T x P > 1 this starts the other ranks."""
    shape = config.parallel
    if config.cpus:
        pin(rank_cores(config.cpus, shape.world_size, 0))
    if shape.world_size == 1:
        model, kv = build_shard(config, cfg, SINGLE, WHOLE_MODEL, num_pages)
        return LocalExecutor(ModelRunner(model, kv, cfg.vocab_size))
    ranks = RankProcesses(config, num_pages, torch.get_num_threads())
    comm = None
    try:
        comm = ranks.join()
        stage = shape.stage_of(0, cfg.num_layers)
        model, kv = build_shard(config, cfg, comm.tp, stage, num_pages)
        ranks.wait_ready()
    except BaseException:
        ranks.stop(comm, encode_stop())
        raise
    runner = ModelRunner(model, kv, cfg.vocab_size, comm.tp, stage, comm)
    return RankExecutor(runner, comm, ranks)
