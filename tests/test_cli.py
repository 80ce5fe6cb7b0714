"""The `tison` command line: each subcommand's parser comes from the module SUBCOMMANDS names,
and the processes that never run a model do not import torch to parse their flags."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import SUBCOMMANDS, build_parser

REPO_ROOT = Path(__file__).resolve().parents[1]


def _choices(parser: argparse.ArgumentParser) -> list[str]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(action.choices)


def test_every_subcommand_is_added_by_the_module_it_maps_to():
    assert _choices(build_parser()) == list(SUBCOMMANDS)  # all, in --help order
    for name, module in SUBCOMMANDS.items():
        assert name in _choices(build_parser([name, "--help"])), module


def test_an_unknown_subcommand_is_refused_with_every_choice_listed(capsys):
    with pytest.raises(SystemExit):
        build_parser(["upp"]).parse_args(["upp"])
    assert "'gateway'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["up", "gateway", "scheduler", "fake-worker", "batch"])
def test_services_without_a_model_do_not_import_torch(command):
    code = (
        "import sys; from services.cli import build_parser; "
        f"build_parser([{command!r}]); print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--batch-max-share", "0"),
        ("--batch-max-share", "1.5"),
        ("--batch-max-share", "half"),
        ("--batch-prefill-tokens", "0"),
        ("--max-waiting-batch", "-1"),
    ],
)
def test_scheduler_batch_flags_are_checked_with_one_line(flag, value, capsys):
    parser = build_parser(["scheduler"])
    with pytest.raises(SystemExit):
        parser.parse_args(["scheduler", flag, value])
    assert f"argument {flag}: must be" in capsys.readouterr().err
    args = parser.parse_args(["scheduler", "--batch-max-share", "1", "--max-waiting-batch", "0"])
    assert (args.batch_max_share, args.max_waiting_batch, args.batch_prefill_tokens) == (1, 0, 1024)
