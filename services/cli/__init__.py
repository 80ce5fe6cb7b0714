"""The `tison` command. Each subcommand lives in its own module with a `register(subparsers)`."""

import argparse
import importlib
import sys

from shared import cpu_isa
from shared.huge_pages import restart_with_huge_pages

# Modules under services/cli that add a subcommand; each defines register(subparsers).
SUBCOMMAND_MODULES = [
    "up",
    "generate",
    "codec",
    "gateway",
    "scheduler",
    "fake_worker",
    "worker",
    "bench",
    "env",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tison", description="Tison LLM inference engine")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"services.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the `tison` command itself, not a test calling main([...])
        restart_with_huge_pages()  # before torch is imported; children inherit the setting
    try:
        cpu_isa.cap_torch()  # TISON_CPU_ISA caps torch too (before its first op); children inherit
    except ValueError as e:
        print(f"tison: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
