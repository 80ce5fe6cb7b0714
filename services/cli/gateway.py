"""`tison gateway`: the OpenAI-compatible HTTP front end."""

import argparse
import functools
import os
from pathlib import Path

from services import nats_client
from services.gateway.app import run_gateway
from services.gateway.config import GatewayConfig
from services.runtime import run_service

D = GatewayConfig


def register(subparsers) -> None:
    p = subparsers.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway")
    p.add_argument("--model", type=Path, required=True, help="model folder (tokenizer)")
    p.add_argument("--served-model-name", default="")
    p.add_argument("--host", default=D.host)
    p.add_argument("--port", type=int, default=D.port)
    p.add_argument("--nats-url", default=D.nats_url)
    nats_client.add_flags(p)
    p.add_argument("--queue-timeout", type=float, default=D.queue_timeout_s)
    p.add_argument(
        "--batch-queue-timeout", type=float, default=D.batch_queue_timeout_s,
        help="seconds a batch request (x-tison-priority: batch) may wait in the scheduler's "
        "queue (at most --request-timeout)",
    )  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=D.request_timeout_s)
    p.add_argument("--miss-limit", type=int, default=D.miss_limit)
    p.add_argument("--max-model-len", type=int, default=D.max_model_len)
    p.add_argument(
        "--api-key", default=os.environ.get("TISON_API_KEY", ""),
        help="require `Authorization: Bearer KEY` on /v1 (default: $TISON_API_KEY; none)",
    )  # fmt: skip
    p.add_argument(
        "--max-body-bytes", type=int, default=D.max_body_bytes,
        help="larger request bodies get a 413 (default: 64 bytes a token of the context)",
    )  # fmt: skip
    p.add_argument(
        "--tool-call-parser", default=D.tool_call_parser,
        help="how tool calls are read from the output: llama3_json, hermes, mistral, "
        "deepseek_v3, kimi_k2, auto (from the chat template; default) or none",
    )  # fmt: skip
    p.add_argument(
        "--batch-runners", type=int, default=D.batch_runners,
        help="batch lines (/v1/batches, tison batch) this gateway runs at once; 0: none",
    )  # fmt: skip
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    config = GatewayConfig(
        model_dir=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        nats_url=args.nats_url,
        nats=nats_client.NatsClientOptions.from_args(args),
        queue_timeout_s=args.queue_timeout,
        batch_queue_timeout_s=args.batch_queue_timeout,
        request_timeout_s=args.request_timeout,
        miss_limit=args.miss_limit,
        max_model_len=args.max_model_len,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        tool_call_parser=args.tool_call_parser,
        batch_runners=args.batch_runners,
    )
    return run_service(functools.partial(run_gateway, config), args.log_level)
