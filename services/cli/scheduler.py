"""`tison scheduler`: admission control and routing of requests to prefill/decode workers."""

import argparse

from services import nats_client
from services.runtime import run_service
from services.scheduler.routing import MODES, RoutingConfig
from services.scheduler.service import Scheduler, SchedulerConfig

R = RoutingConfig


def share_arg(text: str) -> float:
    """--batch-max-share: a fraction of a pool, in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def count_arg(low: int):
    """An integer flag of at least `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


def register(subparsers) -> None:
    p = subparsers.add_parser("scheduler", help="run the scheduler (admission + routing)")
    p.add_argument("--nats-url", default=SchedulerConfig.nats_url)
    nats_client.add_flags(p)
    p.add_argument("--max-waiting", type=int, default=SchedulerConfig.max_waiting)
    p.add_argument(
        "--max-waiting-tokens", type=int, default=SchedulerConfig.max_waiting_tokens,
        help="prompt tokens the admission queue holds at most (0: no bound); beyond: 429",
    )  # fmt: skip
    p.add_argument(
        "--max-waiting-batch", type=count_arg(0), default=SchedulerConfig.max_waiting_batch,
        help="batch requests (x-tison-priority: batch) the queue holds at most; beyond: 429",
    )  # fmt: skip
    p.add_argument(
        "--batch-max-share", type=share_arg, default=R.batch_max_share,
        help="batch requests are placed only while a decode worker's pages in use stay within "
        "this share of its pool (1: no cap)",
    )  # fmt: skip
    p.add_argument(
        "--batch-prefill-tokens", type=count_arg(1), default=R.batch_prefill_tokens,
        help="batch requests are placed only on a computing worker with fewer prompt tokens "
        "queued than this",
    )  # fmt: skip
    p.add_argument("--retry-after", type=float, default=SchedulerConfig.retry_after_s)
    p.add_argument("--assign-timeout", type=float, default=SchedulerConfig.assign_timeout_s)
    p.add_argument("--miss-limit", type=int, default=SchedulerConfig.miss_limit)
    p.add_argument(
        "--routing",
        choices=MODES,
        default=R.mode,
        help="kv: cost of the uncached prompt pages + load; load: least loaded; "
        "round-robin: in turn (a baseline)",
    )
    p.add_argument(
        "--kv-overlap-weight",
        type=float,
        default=R.kv_overlap_weight,
        help="kv routing: weight of a prompt page to compute against a page of load",
    )
    p.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=R.local_prefill_tokens,
        help="a decode worker computes a prompt itself when its uncached part is this short",
    )
    p.add_argument(
        "--max-sessions", type=int, default=R.max_sessions, help="session affinity table bound"
    )
    p.add_argument("--metrics-host", default=SchedulerConfig.metrics_host)
    p.add_argument(
        "--metrics-port",
        type=int,
        default=SchedulerConfig.metrics_port,
        help="serve the routing metrics at /metrics on this port (0: off)",
    )
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    routing = RoutingConfig(
        mode=args.routing,
        kv_overlap_weight=args.kv_overlap_weight,
        local_prefill_tokens=args.local_prefill_tokens,
        max_sessions=args.max_sessions,
        batch_max_share=args.batch_max_share,
        batch_prefill_tokens=args.batch_prefill_tokens,
    )
    config = SchedulerConfig(
        nats_url=args.nats_url,
        nats=nats_client.NatsClientOptions.from_args(args),
        max_waiting=args.max_waiting,
        max_waiting_tokens=args.max_waiting_tokens,
        max_waiting_batch=args.max_waiting_batch,
        retry_after_s=args.retry_after,
        assign_timeout_s=args.assign_timeout,
        miss_limit=args.miss_limit,
        routing=routing,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
    )
    return run_service(Scheduler(config).run, args.log_level)
