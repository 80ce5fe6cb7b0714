"""Micro-batches for a pipeline of P stages (vLLM's "virtual engines"): the next micro-batch is
scheduled from the requests not in flight, and holds about 1/P of them, so P disjoint groups
rotate through the stages and every stage works while the others do. Pure policy."""

from shared.engine.request import Request
from shared.engine.scheduler import Scheduler, SchedulerOutput


def schedule_micro_batch(
    scheduler: Scheduler, in_flight: set[Request], num_stages: int
) -> SchedulerOutput:
    """The scheduler's choice among requests not in flight, capped at ceil(all / num_stages)
    requests so that num_stages disjoint groups rotate."""
    cap = None
    if num_stages > 1:
        cap = max(1, -(-(len(scheduler.running) + len(scheduler.waiting)) // num_stages))
    return scheduler.schedule(exclude=in_flight, max_requests=cap)


def split_launched(out: SchedulerOutput) -> tuple[SchedulerOutput, SchedulerOutput]:
    """(chunks that sample nothing, the rest). The first kind may count as computed as soon as
    they are launched: a stage runs micro-batches in order, so the next chunk of the same
    prompt finds their KV in place; that lets one long prompt's chunks fill the pipeline."""
    early = [s for s in out.scheduled if not s.samples]
    late = [s for s in out.scheduled if s.samples]
    return SchedulerOutput(early), SchedulerOutput(late, out.preempted)
