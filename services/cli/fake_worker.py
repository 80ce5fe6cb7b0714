"""`tison fake-worker`: a prefill and/or decode worker with deterministic fake tokens."""

import argparse
import functools
from pathlib import Path

from services import nats_client
from services.fake_worker.config import ROLES, FakeWorkerConfig
from services.fake_worker.worker import run_fake_worker
from services.runtime import run_service

D = FakeWorkerConfig


def register(subparsers) -> None:
    p = subparsers.add_parser("fake-worker", help="run a fake prefill/decode worker (no model)")
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--model", type=Path, required=True, help="model folder (config, tokenizer)")
    p.add_argument("--nats-url", default=D.nats_url)
    nats_client.add_flags(p)
    p.add_argument("--worker-id", default="")
    p.add_argument("--served-model-name", default="")
    p.add_argument("--num-pages", type=int, default=D.num_pages)
    p.add_argument("--page-size", type=int, default=D.page_size)
    p.add_argument("--step-time", type=float, default=D.step_s, help="seconds per decode step")
    p.add_argument("--prefill-token-time", type=float, default=D.prefill_token_s)
    p.add_argument("--heartbeat", type=float, default=D.heartbeat_s, help="seconds")
    p.add_argument("--max-model-len", type=int, default=D.max_model_len)
    p.add_argument("--eos-after", type=int, default=None, help="emit EOS at this output index")
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="name no pages and publish empty KV events",
    )
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    config = FakeWorkerConfig(
        role=args.role,
        model_dir=args.model,
        nats_url=args.nats_url,
        nats=nats_client.NatsClientOptions.from_args(args),
        worker_id=args.worker_id,
        served_model_name=args.served_model_name,
        num_pages=args.num_pages,
        page_size=args.page_size,
        step_s=args.step_time,
        prefill_token_s=args.prefill_token_time,
        heartbeat_s=args.heartbeat,
        max_model_len=args.max_model_len,
        eos_after=args.eos_after,
        prefix_caching=args.prefix_caching,
    )
    return run_service(functools.partial(run_fake_worker, config), args.log_level)
