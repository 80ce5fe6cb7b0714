"""`tison compress IN OUT`, `tison decompress IN OUT`, `tison inspect DIR`: the lossless
weight codec on folders of safetensors files; inspect also shows a folder's quantization."""

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

from shared.codec import (
    TensorRecord,
    compress_dir,
    decompress_dir,
    inspect_dir,
    is_compressed_dir,
    tensor_class,
)
from shared.codec.folder import total_tensor_bytes
from shared.errors import TisonError
from shared.models.quant.summary import QuantSummary, summarize_folder


def register(subparsers) -> None:
    p = subparsers.add_parser("compress", help="losslessly compress a folder of safetensors")
    p.add_argument("in_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--threads", type=int, default=None, help="encoder threads (default: all)")
    p.set_defaults(func=run_compress)
    p = subparsers.add_parser(
        "decompress", help="restore plain safetensors from a compressed folder"
    )
    p.add_argument("in_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--threads", type=int, default=None, help="decoder threads (default: all)")
    p.set_defaults(func=run_decompress)
    p = subparsers.add_parser(
        "inspect", help="show what a model folder stores: its quantization, what the codec saved"
    )
    p.add_argument("dir", type=Path)
    p.add_argument(
        "--tensors",
        action="store_true",
        help="list every tensor (plain folders: every quantized linear)",
    )
    p.set_defaults(func=run_inspect)


def run_compress(args: argparse.Namespace) -> int:
    def work():
        bar = ProgressBar(total_tensor_bytes(args.in_dir), "compress")
        records = compress_dir(args.in_dir, args.out_dir, bar.advance, args.threads)
        bar.finish()
        return records

    return _run("compress", work, lambda records: print(format_savings(records)))


def run_decompress(args: argparse.Namespace) -> int:
    def work():
        bar = ProgressBar(sum(r.original_bytes for r in inspect_dir(args.in_dir)), "decompress")
        records = decompress_dir(args.in_dir, args.out_dir, bar.advance, args.threads)
        bar.finish()
        return records

    def report(records):
        total = sum(r.original_bytes for r in records)
        print(f"restored {len(records)} tensors, {_size(total)}, into {args.out_dir}")

    return _run("decompress", work, report)


def run_inspect(args: argparse.Namespace) -> int:
    def work():
        records = inspect_dir(args.dir) if is_compressed_dir(args.dir) else None
        return records, summarize_folder(args.dir, records)

    def report(result):
        records, summary = result
        if records is not None:  # a compressed folder: what the codec stores
            if args.tensors:
                for r in records:
                    saved = _percent(r.original_bytes, r.stored_bytes)
                    print(f"{r.name}  {r.dtype}  {r.encoding}  {_size(r.original_bytes)} -> "
                          f"{_size(r.stored_bytes)}  ({saved} saved)")  # fmt: skip
            print(format_savings(records))
        if records is None or summary.scheme is not None:
            if records is None and args.tensors:
                for module, stored, bf16 in summary.linears:
                    print(f"{module}  stored {_size(stored)}  bf16 {_size(bf16)}")
            print(format_quantization(summary))

    return _run("inspect", work, report)


def format_quantization(s: QuantSummary) -> str:
    """The scheme and bytes of the quantized linears against the same linears in bf16."""
    lines = [f"quantization: {s.scheme.describe() if s.scheme else 'none'}"]
    if s.num_quantized:
        ratio = s.dequantized_bytes / max(s.quantized_bytes, 1)
        lines.append(
            f"quantized linears: {s.num_quantized}, stored {_size(s.quantized_bytes)}, "
            f"dequantized to bf16 {_size(s.dequantized_bytes)} ({ratio:.2f}x)"
        )
    lines.append(f"unquantized tensors: {s.num_unquantized}, {_size(s.unquantized_bytes)}")
    return "\n".join(lines)


def format_savings(records: list[TensorRecord]) -> str:
    """A table of bytes saved per tensor class, biggest class first, and in total."""
    classes: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for r in records:
        row = classes[tensor_class(r.name)]
        row[0] += 1
        row[1] += r.original_bytes
        row[2] += r.stored_bytes
    width = max([len("tensor class"), *(len(c) for c in classes)])
    lines = [f"{'tensor class':<{width}}  tensors  {'original':>10}  {'stored':>10}  saved"]
    for name, (count, original, stored) in sorted(classes.items(), key=lambda kv: -kv[1][1]):
        lines.append(_row(name, width, count, original, stored))
    original = sum(r.original_bytes for r in records)
    stored = sum(r.stored_bytes for r in records)
    lines.append(_row("total", width, len(records), original, stored))
    return "\n".join(lines)


class ProgressBar:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, total_bytes: int, label: str):
        self.total = max(total_bytes, 1)
        self.label = label
        self.done = 0
        self.start = time.monotonic()
        self.enabled = sys.stderr.isatty()

    def advance(self, record: TensorRecord) -> None:
        self.done += record.original_bytes
        if self.enabled:
            fraction = min(self.done / self.total, 1.0)
            filled = int(30 * fraction)
            rate = self.done / max(time.monotonic() - self.start, 1e-9)
            sys.stderr.write(
                f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {fraction:6.1%} "
                f"{_size(self.done)}/{_size(self.total)} {_size(rate)}/s "
            )
            sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _run(command: str, work, report) -> int:
    try:
        records = work()
    except TisonError as e:
        print(f"tison {command}: {e}", file=sys.stderr)
        return 2
    report(records)
    return 0


def _row(name: str, width: int, count: int, original: int, stored: int) -> str:
    saved = _percent(original, stored)
    return f"{name:<{width}}  {count:>7}  {_size(original):>10}  {_size(stored):>10}  {saved:>6}"


def _percent(original: int, stored: int) -> str:
    return f"{(original - stored) / original:.2%}" if original else "-"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"
