"""`tison plan CONFIG_OR_FOLDER --gpu h100-80gb [--gpus N]`: from a config.json alone, which worker
shapes fit how many devices, with how much KV, and which shape to run prefill and decode on
(shared/plan/planner.py). Prints a table, or with --json the same figures as JSON."""

import argparse
import json
import sys
from pathlib import Path

from shared.errors import TisonError
from shared.plan.devices import CPU, DEFAULT_GPU_RESERVE, DEVICES, GiB, parse_bytes

DEFAULT_CONTEXT = 8192


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="plan devices and worker shapes for a model from its config.json"
    )
    p.add_argument("model", type=Path, help="config.json, or a model folder holding one")
    p.add_argument("--gpu", default="h100-80gb", choices=[*DEVICES, CPU],
                   help="the device kind (cpu: give --memory)")  # fmt: skip
    p.add_argument("--gpus", type=int, default=None, help="devices (default: the fewest that fit)")
    p.add_argument("--memory", type=_bytes, default=None,
                   help="memory of one device, e.g. 64GiB (cpu; overrides the GPU's)")  # fmt: skip
    p.add_argument("--reserve", type=_bytes, default=None,
                   help=f"per device for activations and workspaces (GPU default "
                        f"{DEFAULT_GPU_RESERVE // GiB} GiB; cpu: the engine's)")  # fmt: skip
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="tokens per sequence")
    p.add_argument("--concurrency", type=int, default=1,
                   help="sequences of --context that must fit at once")  # fmt: skip
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--codec", action="store_true",
                   help="also the checkpoint's size coded by Tison's lossless codec")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 64GiB, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from shared.plan.report import build_report, format_report  # torch: after argument errors

    try:
        report = build_report(
            args.model, args.gpu, args.gpus, args.memory, args.reserve, args.context,
            args.concurrency, args.dtype, args.codec,
        )  # fmt: skip
    except TisonError as e:
        print(f"tison plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0 if report["fewest_devices"] is not None else 1
