"""The `tison` command. Each subcommand lives in its own module with a `register(subparsers)`."""

import argparse
import importlib
import sys

from kernels.cpu import isa
from shared.errors import NatsOptionsError
from shared.huge_pages import restart_with_huge_pages

# Subcommand -> the module under services/cli that adds it (each defines register(subparsers)),
# in the order `tison --help` lists them.
SUBCOMMANDS = {
    "up": "up",
    "generate": "generate",
    "compress": "codec",
    "decompress": "codec",
    "inspect": "codec",
    "plan": "plan",
    "gateway": "gateway",
    "batch": "batch",
    "scheduler": "scheduler",
    "fake-worker": "fake_worker",
    "prefill": "worker",
    "decode": "worker",
    "colocated": "worker",
    "bench": "bench",
    "env": "env",
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `tison` parser. When the command line names a subcommand, only its module is imported:
    the others may import torch (~2 s of a 2-core machine, per process) that `tison up`, the
    gateway and the scheduler never use. Otherwise (`tison --help`, a typo) every one is added."""
    parser = argparse.ArgumentParser(prog="tison", description="Tison LLM inference engine")
    subparsers = parser.add_subparsers(dest="command", required=True)
    named = argv[0] if argv else None
    modules = [SUBCOMMANDS[named]] if named in SUBCOMMANDS else dict.fromkeys(SUBCOMMANDS.values())
    for name in modules:
        importlib.import_module(f"services.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the `tison` command itself, not a test calling main([...])
        restart_with_huge_pages()  # before torch is imported; children inherit the setting
        argv = sys.argv[1:]
    try:
        isa.cap_torch()  # TISON_CPU_ISA caps torch too (before its first op); children inherit
    except ValueError as e:
        print(f"tison: {e}", file=sys.stderr)
        return 2
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except NatsOptionsError as e:  # a flag the command could not use: one line, not a trace
        print(f"tison: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
