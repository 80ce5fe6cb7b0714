"""Load time and peak RSS of a quantized checkpoint dequantized at load (FP8 128x128 blocks,
INT4 groups of 32) against the same model stored in bf16, and what the weight codec stores
for each kind of quantized tensor.

    PYTHONPATH=. python -m loadtest.bench_quant_load [--layers 12] [--out /tmp/quant-bench]

The model is a random Llama (gaussian weights quantized the way DeepSeek-V3 / Kimi K2.5 are;
not trained weights, whose quantized values spread differently). Each load runs in a fresh
process, so its peak RSS is its own: torch + the model + what loading held at once."""

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

from loadtest.random_model import llama_fields, save_random_llama

# runs in the child: load one folder in bf16, print seconds and peak RSS
_CHILD = """
import json, sys, time
import torch
from shared.models.config import ModelConfig
from shared.models.loader import load_model
torch.set_num_threads(int(sys.argv[2]))
start, cpu = time.perf_counter(), time.process_time()
model = load_model(sys.argv[1], ModelConfig.from_dir(sys.argv[1]), torch.bfloat16)
seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork + exec (the parent's peak)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
peak_rss = int(status["VmHWM"].split()[0]) * 1024
print(json.dumps(dict(seconds=seconds, cpu_s=cpu_s, peak_rss=peak_rss)))
"""


def build(out: Path, layers: int) -> dict[str, Path]:
    """The bf16 model and its FP8 and INT4 copies (tests/quant_helpers.py's writers)."""
    from tests.quant_helpers import quantize_fp8, quantize_int4

    folders = {"bf16": out / "bf16", "fp8-128x128": out / "fp8", "int4-g32": out / "int4"}
    if not (folders["bf16"] / "model.safetensors").is_file():
        fields = llama_fields(32000, 1024, 2816, layers, 16, 8)
        save_random_llama(folders["bf16"], fields, torch.bfloat16)
        for name, quantize in (("fp8-128x128", quantize_fp8), ("int4-g32", quantize_int4)):
            quantize(folders["bf16"], folders[name])
    return folders


def measure_load(folder: Path, threads: int, rounds: int) -> dict:
    runs = []
    for _ in range(rounds):
        args = [sys.executable, "-c", _CHILD, str(folder), str(threads)]
        done = subprocess.run(args, capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    best = min(runs, key=lambda r: r["seconds"])
    stored = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    cpu_s = min(r["cpu_s"] for r in runs)  # less disturbed than wall time by other processes
    peak_rss = max(r["peak_rss"] for r in runs)
    return dict(stored_bytes=stored, seconds=best["seconds"], cpu_s=cpu_s, peak_rss=peak_rss)


def measure_codec(folder: Path, out: Path) -> dict[str, list[int]]:
    """(tensors, raw bytes, stored bytes) per kind of tensor (name suffix, dtype, encoding)."""
    import shutil

    from shared.codec import compress_dir

    shutil.rmtree(out, ignore_errors=True)
    kinds: dict[str, list[int]] = {}
    for r in compress_dir(folder, out):
        row = kinds.setdefault(f"{r.name.rsplit('.', 1)[-1]} {r.dtype} {r.encoding}", [0, 0, 0])
        row[0] += 1
        row[1] += r.original_bytes
        row[2] += r.stored_bytes
    return kinds


def nibble_entropy(folder: Path) -> float:
    """Entropy (bits) of the INT4 values in the weight_packed words: a Huffman code of whole
    nibbles could store them in about this many bits of 4."""
    from safetensors import safe_open

    counts = torch.zeros(16, dtype=torch.float64)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for name in (n for n in f.keys() if n.endswith("weight_packed")):
            nibbles = (f.get_tensor(name).unsqueeze(-1) >> torch.arange(0, 32, 4)) & 0xF
            counts += torch.bincount(nibbles.flatten(), minlength=16).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log2()).sum())


def _mb(n: float) -> str:
    return f"{n / 1e6:8.1f} MB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("/tmp/quant-bench"))
    args = ap.parse_args()
    folders = build(args.out, args.layers)
    print(f"{'checkpoint':<12} {'on disk':>11} {'load s':>7} {'CPU s':>6} {'peak RSS':>11}")
    for name, folder in folders.items():
        m = measure_load(folder, args.threads, args.rounds)
        times = f"{m['seconds']:7.2f} {m['cpu_s']:6.2f}"
        print(f"{name:<12} {_mb(m['stored_bytes'])} {times} {_mb(m['peak_rss'])}")
    for name in ("fp8-128x128", "int4-g32"):
        print(f"\ncodec on {name}: {'tensors':>40} {'raw':>11} {'stored':>11}   saved")
        codec = measure_codec(folders[name], args.out / f"{name}-codec")
        for kind, (count, raw, stored) in codec.items():
            saved = (raw - stored) / raw if raw else math.nan
            print(f"  {kind:<50} {count:5d} {_mb(raw)} {_mb(stored)} {saved:7.2%}")
    bits = nibble_entropy(folders["int4-g32"])
    print(
        f"\nINT4 values: entropy {bits:.3f} bits of 4 (nibble Huffman: at most "
        f"{1 - bits / 4:.1%} of weight_packed saved)"
    )


if __name__ == "__main__":
    main()
