"""tests/gpu/device_check.sh, the one command of the GPU checks, on this CPU: a --dry-run of a
fast subset end to end, its report and table, how a raising, slow or skipping check is
recorded, and the decode timing's code at a CPU scale."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

GPU_DIR = Path(__file__).resolve().parent / "gpu"
sys.path.insert(0, str(GPU_DIR))

import device_check  # noqa: E402
from device_common import Context, Skip  # noqa: E402
from device_report import FAILED, PASSED, SKIPPED, CheckResult, report, status_of, table  # noqa: E402

SCRIPT = GPU_DIR / "device_check.sh"
FAST = "graphs,serve"  # an engine check and a services check: ~40 s on 2 cores


def test_a_dry_run_of_a_fast_subset_reports_every_check(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHON=sys.executable)
    started = time.monotonic()
    proc = subprocess.run(
        [str(SCRIPT), "--dry-run", "--only", FAST, "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    checks = {c["name"]: c for c in doc["checks"]}
    assert list(checks) == list(device_check.CHECKS)
    assert doc["mode"] == "dry-run" and doc["ok"] and doc["wall_s"] < time.monotonic() - started
    assert isinstance(doc["missing_modules"], list) and doc["expected_gpu_s"] > 0
    for name, check in device_check.CHECKS.items():
        got = checks[name]
        assert got["status"] in (PASSED, SKIPPED), got
        if check.gpu_only:
            assert got["status"] == SKIPPED and got["reason"] == "needs a GPU (dry run)"
        elif name in FAST.split(","):
            assert got["status"] == PASSED and got["records"], got
            assert all(r.get("ok", True) for r in got["records"])
        else:
            assert got["reason"] == "not selected (--only)"
    assert "check" in proc.stdout and "total" in proc.stdout  # the table at the end


def test_status_summary_table_and_json():
    graded = [{"ok": True, "summary": "chat 16 tokens"}, {"ok": True}, {"gb_per_s": 3.5}]
    assert status_of(graded) == PASSED
    assert status_of([*graded, {"ok": False}]) == FAILED
    assert status_of(graded, error="Traceback ... ValueError: x") == FAILED
    results = [
        CheckResult("serve", PASSED, 12.34, 75, records=graded),
        CheckResult("hbm", SKIPPED, gpu_only=True, reason="needs a GPU (dry run)"),
        CheckResult("parity", FAILED, 80.0, 75, error="Traceback...\nTimeoutError: too slow"),
    ]
    assert results[0].summary == "2/2 ok; chat 16 tokens"
    assert results[2].summary == "TimeoutError: too slow"
    text = table(results)
    lines = text.splitlines()
    assert lines[0].split() == ["check", "status", "wall", "s", "budget", "summary"]
    assert lines[2].split()[:4] == ["serve", "passed", "12.3", "75"]
    assert "needs a GPU (dry run)" in lines[3]
    assert lines[-1].split() == ["total", "92.3", "1", "passed,", "1", "failed,", "1", "skipped"]
    doc = json.loads(json.dumps(report(results, "gpu", "NVIDIA H200", 95.0, expected_gpu_s=300)))
    assert doc["ok"] is False and doc["device"] == "NVIDIA H200" and doc["expected_gpu_s"] == 300
    assert [c["status"] for c in doc["checks"]] == [PASSED, SKIPPED, FAILED]
    assert doc["checks"][0]["records"] == graded and doc["checks"][0]["summary"]


def test_only_takes_check_names(capsys):
    assert device_check.parse_args(["--only", "serve, hbm"]).only == ["serve", "hbm"]
    assert device_check.parse_args([]).only == list(device_check.CHECKS)
    with pytest.raises(SystemExit):
        device_check.parse_args(["--only", "serve,warp"])
    assert "unknown check(s) warp" in capsys.readouterr().err


def test_a_long_summary_is_cut_to_the_table():
    long = CheckResult("kernels", PASSED, 1.0, 2.0, records=[{"summary": "x" * 500}])
    assert max(len(line) for line in table([long]).splitlines()) <= 100


# checks for the next test, run by device_check's child processes (tests/ is on their path)
def raising(ctx: Context):
    yield {"ok": True, "step": 1}
    raise ZeroDivisionError("boom")


def slow(ctx: Context):
    yield {"measure": "before the deadline"}
    time.sleep(60)


def skipping(ctx: Context):
    raise Skip("the cuda_ipc transport is not there yet")
    yield


def test_a_raising_slow_or_skipping_check_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    Check = device_check.Check
    checks = {
        "raising": Check("test_device_check:raising", 30, 30),
        "slow": Check("test_device_check:slow", 3, 3),
        "skipping": Check("test_device_check:skipping", 30, 30),
    }
    monkeypatch.setattr(device_check, "CHECKS", checks)
    args = device_check.parse_args(["--dry-run"])
    results = {r.name: r for r in device_check.run_all(args, tmp_path)}
    raised, timed_out, skipped = results["raising"], results["slow"], results["skipping"]
    assert raised.status == FAILED and "ZeroDivisionError: boom" in raised.error
    assert raised.records == [{"ok": True, "step": 1}]  # what it recorded before is kept
    assert timed_out.status == FAILED and "timed out after its budget of 3 s" in timed_out.error
    assert timed_out.records == [{"measure": "before the deadline"}] and timed_out.wall_s < 20
    assert skipped.status == SKIPPED and skipped.reason == "the cuda_ipc transport is not there yet"


def test_decode_roofline_runs_at_cpu_scale(tmp_path, monkeypatch):
    """The decode timing's code (folder, engine, batches, graphs on and off, roofline) on a
    small Llama on the CPU: what the GPU run does with the 8B shape."""
    import device_timings
    import torch
    from device_model import build_llama_folder, llama_shapes, weight_bytes_read
    from safetensors import safe_open

    monkeypatch.setattr(device_timings, "PROMPT_TOKENS", 24)
    monkeypatch.setattr(device_timings, "TIMED_STEPS", 3)
    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=512)
    folder, shapes = build_llama_folder(tmp_path, 2, "cpu", num_key_value_heads=2, **small)
    try:
        assert shapes == llama_shapes(json.loads((folder / "config.json").read_text()))
        stored = {}
        for path in folder.glob("*.safetensors"):
            with safe_open(str(path), "pt") as f:
                stored |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        assert {k: tuple(t.shape) for k, t in stored.items()} == shapes
        embedding = stored.pop("model.embed_tokens.weight")
        assert embedding.dtype == torch.bfloat16
        assert weight_bytes_read(shapes) == sum(t.numel() * 2 for t in stored.values())
        bandwidth = device_timings.copy_bandwidth("cpu", 1 << 20, 2)
        records = list(device_timings.decode_roofline(folder, shapes, "cpu", bandwidth, (1, 3)))
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    steps = [r for r in records if r["measure"] == "decode_step"]
    assert [(r["batch"], r["mode"]) for r in steps] == [
        (1, "graphs"), (1, "eager"), (3, "graphs"), (3, "eager"),
    ]  # fmt: skip
    for r in steps:
        assert r["step_ms"] > 0 and 0 < r["pct_of_roofline"] and r["weight_bytes"] > 0
        per_token = 2 * 2 * 2 * 16 * 2  # layers x (K, V) x KV heads x head_dim x bf16
        assert 24 < r["kv_bytes"] / (r["batch"] * per_token) < 24 + 2 * (3 + 3) + 2  # contexts
    assert "meets_target" in steps[0]


def test_kv_copy_writes_and_checksums_at_cpu_scale(monkeypatch):
    """kv_copy's pages, write and checksum on a CPU pool (the GPU run opens the decode side's
    over CUDA IPC): what is read back from the scattered slots is what was sent."""
    import device_kv_copy as m
    import torch

    from shared.protocol import KVRankPool
    from shared.transfer.base import LayerKV
    from shared.transfer.pools import MappedPool, write_layer

    for name, value in dict(LAYERS=2, PROMPT_TOKENS=64, NUM_PAGES=8).items():
        monkeypatch.setattr(m, name, value)
    kv, dst = m.spec(), m.slots()
    assert len(set(dst.tolist())) == 64 and int(dst.max()) < 8 * m.PAGE
    data = torch.zeros(kv.pool_shape(m.NUM_PAGES), dtype=kv.dtype)
    pools = [MappedPool(KVRankPool((0, 2), (0, m.KV_HEADS), ""), kv, data)]
    gen = torch.Generator().manual_seed(0)
    payloads = [
        torch.randn(2, 64, m.KV_HEADS, m.HEAD_DIM, generator=gen).bfloat16() for _ in range(2)
    ]
    for layer, payload in enumerate(payloads):
        write_layer(kv, pools, LayerKV(layer, (0, m.KV_HEADS), dst, payload))
    back = [kv.read(data, layer, dst, (0, m.KV_HEADS)) for layer in range(2)]
    assert m.checksum(back) == m.checksum(payloads)
    assert m.checksum([payloads[0].flip(1), payloads[1]]) != m.checksum(payloads)  # positions count
