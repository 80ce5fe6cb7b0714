"""`tison env`: what Tison sees of this CPU and what it runs there (the tier, its kernels,
torch's own choice, threads), to check a machine or to attach to a bug report."""

import argparse
import json

from shared.cpu_report import report


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "env", help="CPU flags seen, tier chosen, kernels built, threads; GPUs seen"
    )
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    facts = report()
    if args.json:
        print(json.dumps(facts))
        return 0
    for key, value in facts.items():
        if key == "cpu_flags":
            value = " ".join(f if on else f"-{f}" for f, on in value.items())
        print(f"{key:22} {value}")
    return 0
