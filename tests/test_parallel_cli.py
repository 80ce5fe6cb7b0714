"""--tp/--pp on the command lines: `tison up` hands each role its shape; a bad shape fails
before any rank starts, naming the flag."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.up.plan import UpConfig, plan


def _worker_args(cfg: UpConfig, name: str) -> list[str]:
    return list(next(c for c in plan(cfg) if c.name == name).args)


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_up_gives_each_role_its_shape():
    cfg = UpConfig(model_dir=Path("m"), prefill_tp=2, decode_pp=2, allow_oversubscribe=True)
    prefill, decode = _worker_args(cfg, "prefill-0"), _worker_args(cfg, "decode-0")
    assert (_flag(prefill, "--tp"), _flag(prefill, "--pp")) == ("2", "1")
    assert (_flag(decode, "--tp"), _flag(decode, "--pp")) == ("1", "2")
    assert "--allow-oversubscribe" in prefill and "--allow-oversubscribe" in decode


def test_up_shares_the_gpus_among_its_workers():
    """--device reaches every worker; on GPUs each takes its part of the memory share."""
    cfg = UpConfig(model_dir=Path("m"), device="cuda", gpu_memory_utilization=0.8)
    cfg = UpConfig(**{**cfg.__dict__, "enforce_eager": True})
    for name in ("prefill-0", "decode-0"):
        args = _worker_args(cfg, name)
        assert _flag(args, "--device") == "cuda" and "--enforce-eager" in args
        assert _flag(args, "--gpu-memory-utilization") == "0.4000"  # 0.8 over 2 workers
    cpu = _worker_args(UpConfig(model_dir=Path("m"), device="cpu"), "decode-0")
    assert _flag(cpu, "--device") == "cpu" and "--gpu-memory-utilization" not in cpu
    # enough GPUs for a GPU a rank: each worker its own, from its first GPU on, all of its share
    own = UpConfig(model_dir=Path("m"), device="cuda", gpus=3, decode_tp=2, cores=tuple(range(8)))
    prefill, decode = _worker_args(own, "prefill-0"), _worker_args(own, "decode-0")
    assert (_flag(prefill, "--device"), _flag(decode, "--device")) == ("cuda:0", "cuda:1")
    assert _flag(decode, "--gpu-memory-utilization") == "0.9000"
    too_few = UpConfig(model_dir=Path("m"), device="cuda", gpus=2, decode_tp=2, cores=own.cores)
    assert _flag(_worker_args(too_few, "decode-0"), "--device") == "cuda"  # shared
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        UpConfig(model_dir=Path("m"), gpu_memory_utilization=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_generate_without_a_gpu_refuses_cuda_naming_the_flag(tiny_llama):
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "--model", str(tiny_llama)]
        + ["--device", "cuda", "hello"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "device: cuda: torch sees no GPU" in proc.stderr


def test_generate_with_a_bad_shape_names_the_flag(tiny_llama):
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "--model", str(tiny_llama)]
        + ["--tp", "3", "hello"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--tp: 3 does not divide the model's 4 attention heads" in proc.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tp", "3"], "--tp: 3 does not divide the model's 4 attention heads"),
        (["--cpus", "4095"], "--cpus: cannot run on CPUs 4095"),
    ],
)
def test_a_worker_with_bad_flags_exits_naming_the_flag(tiny_llama, flags, message):
    """Before NATS is even reached: exit code 2 and one line, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "prefill", "--model", str(tiny_llama), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
