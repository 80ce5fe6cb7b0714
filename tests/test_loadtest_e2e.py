"""`tison bench` end to end against `tison up` with a tiny model: the CLI as a process, then
the chat API with a shared-prefix workload over a rate sweep, and `tison bench compare`."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from services.cli import main as tison

from services_harness import REPO_ROOT, free_port

ENV = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")


def bench_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "services.cli", "bench", *args]
    return subprocess.run(
        cmd, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=timeout_s
    )


def start_up(model_dir, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--model",
            str(model_dir),
            "--dtype",
            "float32",
            "--port",
            str(port),
            "--threads",
            "1",
        ],
        cwd=REPO_ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "Tison is serving" in line:
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("tison up did not start")


@pytest.fixture(scope="module")
def up_url(tiny_llama):
    port = free_port()
    up = start_up(tiny_llama, port)
    yield f"http://127.0.0.1:{port}"
    up.send_signal(signal.SIGTERM)
    up.wait(timeout=60)


def test_bench_cli_against_tison_up(up_url, tiny_llama, tmp_path):
    done = bench_cli(
        "run",
        "--base-url",
        up_url,
        "--tokenizer",
        str(tiny_llama),
        "--num-prompts",
        "12",
        "--input-len",
        "uniform:8:24",
        "--output-len",
        "6",
        "--ignore-eos",
        "--concurrency",
        "4",
        "--slo-ttft",
        "60000",
        "--slo-tpot",
        "60000",
        "--gpu-hour-cost",
        "2.5",
        "--num-devices",
        "2",
        "--out",
        str(tmp_path / "up"),
        "--no-progress",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "up.json").read_text())
    assert report["meta"]["model"] == tiny_llama.name  # asked /v1/models
    (run,) = report["runs"]
    s = run["summary"]
    assert (s["num_requests"], s["completed"], s["errors"]) == (12, 12, {})
    assert s["total_output_tokens"] == 12 * 6  # the server's usage, ignore_eos honoured
    assert s["good"] == 12 and s["goodput"] == pytest.approx(12 / s["duration_s"])
    assert 0 < s["ttft"]["p50"] <= s["ttft"]["p99"] <= s["e2e"]["p99"]
    assert 0 < s["itl"]["count"] <= 12 * 5 and s["tpot"]["count"] == 12
    hours = s["duration_s"] / 3600
    assert s["cost_per_m_output"] == pytest.approx(2.5 * 2 * hours / 72 * 1e6)
    # no per-request gap count: the gateway may coalesce queued tokens into one SSE event
    assert all(r["start_s"] >= 0 for r in run["requests"])
    md = (tmp_path / "up.md").read_text()
    assert "| 4 concurrent | 12/12 |" in md and "![up-cdf](up-cdf.png)" in md
    assert (tmp_path / "up-cdf.png").stat().st_size > 10_000
    assert "| 4 concurrent | 12/12 |" in done.stdout


def test_chat_shared_prefix_sweep_and_compare(up_url, tiny_llama, tmp_path, capsys):
    common = [
        "--base-url",
        up_url,
        "--tokenizer",
        str(tiny_llama),
        "--api",
        "chat",
        "--workload",
        "shared-prefix",
        "--prefix-len",
        "40",
        "--num-prefixes",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "uniform:4:12",
        "--num-prompts",
        "10",
        "--slo-ttft",
        "20000",
        "--no-progress",
        "--request-rate",
        "20,80",
    ]
    a = tison(["bench", "run", *common, "--out", str(tmp_path / "a"), "--label", "first"])
    b = tison(
        ["bench", "run", *common, "--out", str(tmp_path / "b"), "--label", "second", "--no-plots"]
    )
    assert (a, b) == (0, 0), capsys.readouterr().err
    report = json.loads((tmp_path / "a.json").read_text())
    assert [r["load"]["rate"] for r in report["runs"]] == [20.0, 80.0]
    for run in report["runs"]:
        assert run["summary"]["completed"] == 10
        assert run["summary"]["total_input_tokens"] > 10 * 40  # usage counts the template too
    assert (tmp_path / "a-load.png").is_file() and not (tmp_path / "b-load.png").exists()
    capsys.readouterr()
    vs = ["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    assert tison([*vs, "--out", str(tmp_path / "vs")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("A: first\nB: second") and out.count("### ") == 2
    assert "| output tokens/s |" in out and (tmp_path / "vs-load.png").is_file()


def test_cli_refuses_remote_targets_and_bad_files(tmp_path, capsys):
    assert tison(["bench", "run", "--base-url", "http://192.0.2.1:8000", "--model", "m"]) == 2
    assert "allow-remote" in capsys.readouterr().err
    (tmp_path / "x.json").write_text("[]")
    assert tison(["bench", "compare", str(tmp_path / "x.json"), str(tmp_path / "x.json")]) == 2
    assert "tison-bench/1" in capsys.readouterr().err
