"""`tison scheduler`: admission control and routing of requests to prefill/decode workers."""

import argparse

from services.runtime import run_service
from services.scheduler.service import Scheduler, SchedulerConfig


def register(subparsers) -> None:
    p = subparsers.add_parser("scheduler", help="run the scheduler (admission + routing)")
    p.add_argument("--nats-url", default=SchedulerConfig.nats_url)
    p.add_argument("--max-waiting", type=int, default=SchedulerConfig.max_waiting)
    p.add_argument("--retry-after", type=float, default=SchedulerConfig.retry_after_s)
    p.add_argument("--assign-timeout", type=float, default=SchedulerConfig.assign_timeout_s)
    p.add_argument("--miss-limit", type=int, default=SchedulerConfig.miss_limit)
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    config = SchedulerConfig(
        nats_url=args.nats_url,
        max_waiting=args.max_waiting,
        retry_after_s=args.retry_after,
        assign_timeout_s=args.assign_timeout,
        miss_limit=args.miss_limit,
    )
    return run_service(Scheduler(config).run, args.log_level)
