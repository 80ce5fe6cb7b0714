"""Executors run the engine's micro-batches on its ranks. `launch` starts one (rank 0 runs its
own stage part at once), `collect` returns the oldest one's samples. Up to `depth` micro-batches
are in flight: one without pipeline stages, P with P stages. `masks`: the grammar masks of the
micro-batch's sampling rows, filled beside its forward pass (shared/engine/grammars.py)."""

import itertools
import logging
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from shared.engine import device as devices
from shared.engine.config import EngineConfig
from shared.engine.graphs import DecodeGraphs, graph_sizes
from shared.engine.plan import decode_result, encode_plan, encode_stop
from shared.engine.prompt_logprobs import PromptLogprobChunk
from shared.engine.ranks import RankProcesses
from shared.engine.runner import ModelRunner
from shared.engine.scheduler import SchedulerOutput
from shared.engine.shard import build_shard
from shared.kv.cache import KVCache
from shared.kv.chunk_cache import GroupedKVCache
from shared.kv.spec import KVSpec
from shared.models.config import ModelConfig
from shared.parallel.comm import RankComm
from shared.parallel.cores import pin, rank_cores
from shared.parallel.group import SINGLE
from shared.parallel.pipeline import WHOLE_MODEL
from shared.sampling.sampler import SamplerOutput
from shared.sampling.token_mask import TokenMasks
from shared.transfer import ipc_handles
from shared.transfer.error_board import ErrorBoard
from shared.transfer.handoff import KVHandoff

log = logging.getLogger(__name__)
Masks = Future[TokenMasks | None] | None  # filled by shared/engine/grammars.py


@dataclass
class StepResult:
    out: SchedulerOutput  # what was launched
    sample_index: list[int]  # indices into out.scheduled that sampled
    samples: SamplerOutput | None
    prompt_logprobs: list[PromptLogprobChunk] = field(default_factory=list)
    error: Exception | None = None  # the step failed; its requests fail, the others go on


class LocalExecutor:
    """One rank (T = P = 1): a micro-batch runs to its end inside `launch`."""

    depth = 1

    def __init__(self, runner: ModelRunner, handoff: KVHandoff | None = None):
        self.runner = runner
        self.handoff = handoff  # prefill workers: rank 0's KV handoff
        self._done: deque[StepResult] = deque()

    @property
    def num_in_flight(self) -> int:
        return len(self._done)

    def launch(self, out: SchedulerOutput, masks: Masks = None) -> None:
        self._done.append(_run(self.runner, out, masks))

    def collect(self) -> StepResult:
        return self._done.popleft()

    def pool_handles(self) -> tuple[bytes, ...]:
        """Each rank's pool_handle, in rank order."""
        return (pool_handle(self.runner.kv),)

    def close(self) -> None:
        _close(self.runner, self.handoff)


class RankExecutor:
    """Rank 0 of T x P ranks: sends each micro-batch's plan to every other rank, runs its own
    part (stage 0, TP rank 0), and with P > 1 returns at once; results come back from the last
    stage's TP rank 0 in launch order. A prefill worker's plans carry its KV handoff's news."""

    def __init__(
        self,
        runner: ModelRunner,
        comm: RankComm,
        ranks: RankProcesses,
        handoff: KVHandoff | None = None,
        threads: int | None = None,  # this process's torch threads before rank 0 took its share
    ):
        self.runner, self.comm, self.ranks = runner, comm, ranks
        self.handoff = handoff
        self._threads = threads
        self.depth = comm.shape.pp
        self._ids = itertools.count()
        self._pending: deque[StepResult] = deque()
        self.last_stage_busy_s = 0.0  # the last stage's seconds of work, as it last reported

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    def launch(self, out: SchedulerOutput, masks: Masks = None) -> None:
        """With P > 1 the last stage samples: the plan carries the masks, so they are filled
        before it leaves (with P = 1 rank 0 samples, and they fill beside its forward pass)."""
        extras = self.handoff.plan_extras(out) if self.handoff is not None else None
        shipped = None if masks is None or self.depth == 1 else masks.result()
        plan = encode_plan(next(self._ids), out, extras, shipped)
        self.comm.send_plan(plan)
        self._pending.append(_run(self.runner, out, masks))

    def collect(self) -> StepResult:
        result = self._pending.popleft()
        if self.depth > 1:  # the samples and prompt logprobs come from the last stage
            reply = decode_result(self.comm.recv_result())
            result.sample_index, result.samples = reply.sample_index, reply.samples
            result.prompt_logprobs = reply.prompt_logprobs
            self.last_stage_busy_s = reply.busy_s
        return result

    def pool_handles(self) -> tuple[bytes, ...]:
        """Each rank's pool_handle, in rank order (the others' as they stored them)."""
        others = [self.ranks.store.get(f"kv_ipc{r}") for r in range(1, self.comm.shape.world_size)]
        return (pool_handle(self.runner.kv), *others)

    def close(self) -> None:
        self.ranks.stop(self.comm, encode_stop())
        _close(self.runner, self.handoff)
        if self._threads is not None:
            torch.set_num_threads(self._threads)


def _close(runner: ModelRunner, handoff: KVHandoff | None) -> None:
    if handoff is not None:
        handoff.close()
    runner.kv.close()


def _run(runner: ModelRunner, out: SchedulerOutput, masks: Masks = None) -> StepResult:
    try:
        return StepResult(out, *runner.execute(out, masks=masks))
    except Exception as e:
        log.exception("step failed; failing its %d requests", len(out.scheduled))
        return StepResult(out, [], None, error=e)


def pool_handle(kv: KVCache) -> bytes:
    """A GPU pool's CUDA IPC handle (transfer/ipc_handles.py), capped chunked layers' unit
    pages too (one tensor); b"" for a CPU pool."""
    if kv.data.device.type != "cuda":
        return b""
    return ipc_handles.export_pool(kv.data)


def rank_handoff(
    config: EngineConfig, spec: KVSpec, kv: KVCache, rank: int, store=None
) -> KVHandoff | None:
    """A prefill worker's KV handoff on one of its ranks; None unless config.kv_push. store:
    the ranks' TCPStore where there are several (their failures reach rank 0 there)."""
    if not config.kv_push:
        return None
    secret = config.kv_secret.encode() or None
    board = None if store is None else ErrorBoard(store)
    shape, transport = config.parallel, config.kv_transport
    return KVHandoff.of_rank(kv, spec, shape, rank, transport, secret, board)


def stage_runner(
    config: EngineConfig,
    cfg: ModelConfig,
    model,
    kv,
    num_pages: int,
    tp=SINGLE,
    stage=WHOLE_MODEL,
    comm: RankComm | None = None,
    hook=None,
    dp=SINGLE,
) -> ModelRunner:
    """A rank's runner, with decode graphs where config asks for them and they apply (not with
    data-parallel ranks: a step's rows differ by rank)."""
    max_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    max_pages = -(-max_len // config.page_size)
    runner = ModelRunner(
        model, kv, cfg.vocab_size, tp, stage, comm, hook, dp=dp,
        decode_rows=config.max_num_seqs, max_pages=max_pages,
    )  # fmt: skip
    masks = runner.masks  # the stage's distinct masks
    if not config.uses_graphs or hook is not None or isinstance(kv, GroupedKVCache):
        return runner
    if dp.size > 1:
        log.info("decode graphs: off (data-parallel ranks); decoding eagerly")
        return runner
    why = DecodeGraphs.unsupported(model, masks, capture=kv.device.type == "cuda")
    if why is not None:
        log.info("decode graphs: off (%s); decoding eagerly", why)
        return runner
    hidden = None if stage.is_first else (cfg.hidden_size, kv.spec.dtype)
    sizes = graph_sizes(config.max_num_seqs)
    graphs = DecodeGraphs(model, kv, masks, sizes, max_pages, num_pages, hidden)
    if kv.device.type == "cuda":
        try:
            graphs.capture()
        except Exception as e:  # an op that syncs or allocates on the host: stay eager
            log.warning("decode graphs: capture failed (%r); decoding eagerly", e)
            return runner
    runner.graphs = graphs
    return runner


def start_executor(
    config: EngineConfig,
    cfg: ModelConfig,
    spec: KVSpec,
    num_pages: int,
    kv_groups: tuple[int, ...] = (),
):
    """The executor for config's shape; with T x P > 1 this starts the other ranks.
    spec: the whole model's KV layout; kv_groups: capped chunked layers' page groups (each
    global layer's, shared/kv/chunk_cache.py)."""
    shape = config.parallel
    if config.cpus:
        pin(rank_cores(config.cpus, shape.world_size, 0))
    devices.use(config.rank_device(0))
    if shape.world_size == 1:
        model, kv = build_shard(config, cfg, SINGLE, WHOLE_MODEL, num_pages, 0, kv_groups)
        handoff = rank_handoff(config, spec, kv, 0)
        hook = None if handoff is None else handoff.on_layer
        runner = stage_runner(config, cfg, model, kv, num_pages, hook=hook)
        return LocalExecutor(runner, handoff)
    # unpinned ranks share this process's threads (torch's: one a physical core by default),
    # rank 0 too until it closes; each taking all of them, the ranks' teams would fight for
    # the cores, and a team whose thread is preempted stalls at every barrier (a decode step
    # at tp=2 ran 10x slower)
    previous = torch.get_num_threads()
    threads = previous if config.cpus else max(1, previous // shape.world_size)
    torch.set_num_threads(threads)
    ranks = comm = None
    try:
        ranks = RankProcesses(config, num_pages, threads, kv_groups)
        comm = ranks.join()
        stage = shape.stage_of(0, cfg.num_layers)
        model, kv = build_shard(config, cfg, comm.tp, stage, num_pages, 0, kv_groups)
        ranks.wait_ready()
    except BaseException:
        if ranks is not None:
            ranks.stop(comm, encode_stop())
        torch.set_num_threads(previous)
        raise
    handoff = rank_handoff(config, spec, kv, 0, ranks.store)
    hook = None if handoff is None else handoff.on_layer
    runner = stage_runner(config, cfg, model, kv, num_pages, comm.tp, stage, comm, hook, comm.dp)
    return RankExecutor(runner, comm, ranks, handoff, previous)
