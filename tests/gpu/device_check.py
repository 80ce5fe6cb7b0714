"""Tison's GPU path in one command, for a machine with one H100/H200 (or, --dry-run, any CPU).

    tests/gpu/device_check.sh [--dry-run] [--only kernels,parity,...] [--out PATH]

Expected run time on one H100/H200: about 5.5 minutes (330 s; estimates per check below). Each
check's budget caps it, and no check starts after --max-s (470 s by default): under 8 minutes.
A --dry-run on a CPU runs every check that has a CPU equivalent (2.5-3 minutes on 2 cores)
and records the GPU-only ones skipped.

checks (GPU / --dry-run), with their estimated GPU time; the first five run 2 at a time on a
GPU (--jobs), the timings alone after them:
  kernels    ~75 s  pytest tests/gpu / the host-emulated kernel tests
  parity     ~35 s  engine on cuda vs transformers (fp32, bf16): dense, MoE, MLA / on cpu
  graphs     ~25 s  captured decode graphs vs eager, padded batches / decode_graphs=on, cpu
  serve      ~35 s  tison up --device cuda + the openai client / tison up --device cpu
  handoff    ~70 s  prefill -> decode worker over cuda_ipc, greedy = offline engine (Llama,
                    and Llama 4 with the decode worker's chunked layers capped) / shm
  hbm        ~10 s  GPU only: device-to-device copy GB/s
  decode     ~75 s  GPU only: Llama-3.1-8B-shaped bf16 decode step vs its roofline, batch
                    1/32/128, graphs and eager (target: >= 70% at batch 1 with graphs)
  codec      ~20 s  GPU only: codec decode TB/s (target: >= 1 TB/s)
  codec_load ~20 s  a compressed folder loaded with its planes decoded on the GPU vs the raw
                    folder: parameters bit-equal, both load times / the same on the CPU
  kv_copy    ~15 s  GPU only: KV pages over cuda_ipc between two processes, GB/s (target:
                    >= 100 GB/s), byte-exact
  attention  ~15 s  GPU only: paged attention kernels' GB/s (test_cuda_attention.measure)
  fp8_linear ~10 s  GPU only: FP8 block-scaled linear's weight GB/s vs bf16 cuBLAS, M 1/8/32
(handoff also records a long prompt's KV rate as the prefill worker counts it.)

Each check runs in a process of its own under its budget; one that fails, raises or runs out
of time is recorded failed and the next one runs. A target missed is recorded (meets_target
false, BELOW in the table), not failed. One JSON file (--out; default
$OUT/device_check.json, else ./device_check.json) and one table at the end; the exit code is 1
if any check failed."""

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from device_common import REPO_ROOT, Context, Skip  # run as a script: tests/gpu is sys.path[0]
from device_report import FAILED, SKIPPED, CheckResult, report, status_of, table, write_report

EXPECTED_GPU_S = 320
MAX_GPU_S = 470  # under 8 minutes
# what the checks import (the engine, the services, the references); the device machine lacks
# some (nats, llguidance, openai, ...): carried as wheels in .whl/, device_check.sh installs them
MODULES = (
    "torch", "transformers", "safetensors", "tokenizers", "numpy", "jinja2", "llguidance",
    "msgpack", "nats", "aiohttp", "prometheus_client", "uvloop", "openai", "pytest", "cupy",
)  # fmt: skip


@dataclass(frozen=True)
class Check:
    target: str  # "module:function" under tests/gpu/
    budget_gpu_s: float
    budget_cpu_s: float
    gpu_only: bool = False  # no CPU equivalent: skipped by --dry-run
    timing: bool = False  # runs alone, after the others (its numbers are timings)


CHECKS = {
    "kernels": Check("device_kernels:kernels", 150, 400),
    "parity": Check("device_engine:parity", 75, 300),
    "graphs": Check("device_engine:graphs", 45, 150),
    "serve": Check("device_services:serve", 75, 180),
    "handoff": Check("device_services:handoff", 130, 300),
    "hbm": Check("device_timings:hbm", 20, 0, gpu_only=True, timing=True),
    "decode": Check("device_timings:decode", 150, 0, gpu_only=True, timing=True),
    "codec": Check("device_timings:codec", 60, 0, gpu_only=True, timing=True),
    "codec_load": Check("device_timings:codec_load", 45, 120, timing=True),
    "kv_copy": Check("device_kv_copy:kv_copy", 45, 0, gpu_only=True, timing=True),
    "attention": Check("device_timings:attention", 40, 0, gpu_only=True, timing=True),
    "fp8_linear": Check("device_timings:fp8_linear", 30, 0, gpu_only=True, timing=True),
}


def parse_args(argv=None) -> argparse.Namespace:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(
        prog="tests/gpu/device_check.sh",
        description="\n\n".join(doc[:3]),
        epilog="\n\n".join(doc[3:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dry-run", action="store_true", help="on the CPU: skip what needs a GPU")
    p.add_argument("--only", default="", help=f"comma-separated checks of: {', '.join(CHECKS)}")
    out = Path(os.environ["OUT"]) / "device_check.json" if os.environ.get("OUT") else None
    p.add_argument("--out", type=Path, default=out or Path("device_check.json"))
    p.add_argument(
        "--jobs", type=int, default=0, help="checks at once, timings aside (0: GPU 2, CPU 1)"
    )
    p.add_argument("--max-s", type=float, default=0, help="no check starts after this (0: GPU 470)")
    p.add_argument("--decode-layers", type=int, default=32, help="decode: layers of the 8B shape")
    p.add_argument("--keep", action="store_true", help="keep the checks' temporary folders")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)  # internal: run one check
    p.add_argument("--target", default="", help=argparse.SUPPRESS)
    p.add_argument("--records", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, default=60.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.only = [n.strip() for n in args.only.split(",") if n.strip()] or list(CHECKS)
    unknown = [n for n in args.only if n not in CHECKS]
    if unknown:
        p.error(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(CHECKS)}")
    return args


def run_child(args: argparse.Namespace) -> int:
    """In the check's own process: yields its records into args.records, one JSON a line."""
    import importlib

    module, function = args.target.split(":")
    ctx = Context(
        mode="dry-run" if args.dry_run else "gpu",
        device="cpu" if args.dry_run else "cuda",
        deadline=time.monotonic() + args.budget,
        workdir=args.workdir,
        options={"decode_layers": args.decode_layers},
    )
    # at its deadline the check gets SIGTERM: SystemExit runs its `finally`s (servers stopped,
    # the decode timing's model folder removed) before the SIGKILL 5 s later
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with open(args.records, "a") as out:

        def put(record: dict) -> None:
            out.write(json.dumps(record, default=str) + "\n")
            out.flush()  # a check killed at its deadline keeps what it recorded

        try:
            for record in getattr(importlib.import_module(module), function)(ctx):
                put(record)
        except Skip as e:
            put({"__skip__": str(e)})
        except BaseException as e:  # pytest.skip() at import raises a BaseException too
            if type(e).__name__ == "Skipped":
                put({"__skip__": str(e)})
            else:
                put({"__error__": "".join(traceback.format_exception(e))[-3000:]})
                return 1
    return 0


def run_check(name: str, args: argparse.Namespace, budget_s: float, tmp: Path) -> CheckResult:
    """One check in a process (and session) of its own, killed with its children at budget_s."""
    workdir = tmp / name
    workdir.mkdir(parents=True, exist_ok=True)
    records_path = workdir / "records.jsonl"
    cmd = [sys.executable, __file__, "--child", name, "--target", CHECKS[name].target]
    cmd += ["--records", str(records_path)]
    cmd += ["--workdir", str(workdir), "--budget", f"{budget_s:.0f}"]
    cmd += ["--dry-run"] if args.dry_run else []
    cmd += ["--decode-layers", str(args.decode_layers)]
    started = time.monotonic()
    log = open(workdir / "output.log", "wb")
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    log.close()
    timed_out = False
    try:
        proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    stop_group(proc)
    wall_s = time.monotonic() - started
    records, skip, error = read_records(records_path)
    tail = (workdir / "output.log").read_text(errors="replace")[-2000:]
    if timed_out:
        error = f"{error or tail}\ntimed out after its budget of {budget_s:.0f} s"
    elif not error and not skip and proc.returncode != 0:
        error = f"{tail}\nexited with {proc.returncode}"
    status = SKIPPED if skip and not error else status_of(records, error)
    return CheckResult(
        name, status, round(wall_s, 1), budget_s, CHECKS[name].gpu_only, skip, error, records
    )


def read_records(path: Path) -> tuple[list[dict], str, str]:
    """A child's records, and why it skipped or how it failed, if it said so."""
    records, skip, error = [], "", ""
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # cut short: the child was killed while writing it
            continue
        skip = record.get("__skip__", skip)
        error = record.get("__error__", error)
        if not any(k.startswith("__") for k in record):
            records.append(record)
    return records, skip, error


def stop_group(proc: subprocess.Popen) -> None:
    """The check's process group (the servers and workers it started too): SIGTERM, then
    SIGKILL to whatever is left after 5 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def not_run(name: str, reason: str) -> CheckResult:
    return CheckResult(name, SKIPPED, gpu_only=CHECKS[name].gpu_only, reason=reason)


def run_all(args: argparse.Namespace, tmp: Path) -> list[CheckResult]:
    """Every check, in CHECKS order in the results; the non-timing ones `jobs` at a time."""
    gpu = not args.dry_run
    max_s = args.max_s or (MAX_GPU_S if gpu else 3600.0)
    jobs = args.jobs or (2 if gpu else 1)
    deadline = time.monotonic() + max_s
    results: dict[str, CheckResult] = {}

    def one(name: str) -> None:
        check = CHECKS[name]
        left = deadline - time.monotonic()
        if left < 10:
            results[name] = not_run(name, f"the run's --max-s ({max_s:.0f} s) was spent")
            return
        budget = min(check.budget_gpu_s if gpu else check.budget_cpu_s, left)
        print(f"[device-check] {name}: started (budget {budget:.0f} s)", flush=True)
        try:
            result = run_check(name, args, budget, tmp)
        except Exception:  # this script's own fault: still a row, and the next check runs
            result = CheckResult(name, FAILED, budget_s=budget, error=traceback.format_exc())
        results[name] = result
        print(f"[device-check] {name}: {result.status} in {result.wall_s:.1f} s", flush=True)

    for name in CHECKS:
        if CHECKS[name].gpu_only and not gpu:
            results[name] = not_run(name, "needs a GPU (dry run)")
        elif name not in args.only:
            results[name] = not_run(name, "not selected (--only)")
    todo = [n for n in CHECKS if n not in results]
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(one, [n for n in todo if not CHECKS[n].timing]))
    for name in todo:
        if CHECKS[name].timing:
            one(name)  # alone on the GPU
    return [results[n] for n in CHECKS]


def gpu_name(dry_run: bool) -> str:
    if dry_run:
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        return ""
    return torch.cuda.get_device_name(0)


def missing_modules() -> list[str]:
    import importlib.util

    return [name for name in MODULES if importlib.util.find_spec(name) is None]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    started = time.monotonic()
    mode = "dry-run" if args.dry_run else "gpu"
    missing = missing_modules()
    if missing:
        print(f"[device-check] not installed: {', '.join(missing)} (carry wheels in .whl/)")
    device = gpu_name(args.dry_run)
    if not device:
        print("device_check: torch sees no CUDA device; use --dry-run on a CPU", file=sys.stderr)
        results = [CheckResult(n, FAILED, error="no CUDA device") for n in CHECKS]
    else:
        tmp = Path(tempfile.mkdtemp(prefix="device-check-"))
        results = run_all(args, tmp)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"[device-check] kept {tmp}")
    wall_s = time.monotonic() - started
    doc = report(
        results, mode, device or "none", wall_s,
        expected_gpu_s=EXPECTED_GPU_S, missing_modules=missing,
    )  # fmt: skip
    write_report(doc, args.out)
    print(table(results))
    print(f"[device-check] {mode} on {device or 'no GPU'}: {wall_s:.0f} s; wrote {args.out}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
