"""loadtest.startup reads start-up phases from `tison up`'s output lines; `tison up` logs the
same phases per child once serving (shared/startup_log.py)."""

import time
from datetime import datetime

from loadtest.startup import Run, record, table
from shared.startup_log import StartupPhases, summary


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def test_phases_are_read_per_child_with_the_durations_lines_report():
    launched, run = time.time(), Run()
    lines = [
        (0.2, f"{_stamp(launched + 0.2)} INFO tison.up: started prefill-0 (pid 12)"),
        (1.5, f"[prefill-0] {_stamp(launched + 1.5)} INFO services.runtime: "
              "process started 1.30 s ago (interpreter and imports)"),
        (1.7, f"[prefill-0] {_stamp(launched + 1.6)} INFO shared.engine.shard: "
              "rank 0: model loaded from disk in 0.10 s (attention: cpu; decode steps op by op)"),
        (1.7, f"[prefill-0] {_stamp(launched + 1.6)} INFO shared.engine.shard: "
              "rank 1: model loaded from disk in 0.30 s"),
        (1.8, f"[gateway] {_stamp(launched + 1.8)} INFO services.gateway.control: "
              "prefill worker prefill-h-12-ab joined"),
        (1.9, "[gateway] no timestamp here"),
    ]  # fmt: skip
    for arrived_s, line in lines:
        record(run, line, launched, arrived_s)
    assert run.took == {("prefill-0", "imports done"): 1.3, ("prefill-0", "model loaded"): 0.1}
    assert set(run.at) == {
        ("prefill-0", "spawned"),
        ("prefill-0", "imports done"),
        ("prefill-0", "model loaded"),
        ("gateway", "saw prefill"),
    }
    assert abs(run.at[("prefill-0", "model loaded")] - 1.6) < 0.01  # the log's time, not arrival
    run.ready_s = 2.0
    assert "| prefill-0 | model loaded |  1.60 (1.60-1.60) |  0.10 (0.10-0.10) |" in table([run])


def test_up_summarizes_where_each_childs_start_up_went():
    launched, phases = time.time(), StartupPhases()
    lines = [
        f"{_stamp(launched + 0.1)} INFO tison.up: nats-server started in 0.08 s",
        f"{_stamp(launched + 0.2)} INFO tison.up: started decode-0 (pid 12)",
        f"{_stamp(launched + 0.2)} INFO tison.up: started gateway (pid 13)",
        f"[decode-0] {_stamp(launched + 1.5)} INFO services.runtime: "
        "process started 1.30 s ago (interpreter and imports)",
        f"[decode-0] {_stamp(launched + 1.9)} INFO kernels.build: "
        "built tison_cpu_kernels in 0.30 s (cached in /tmp)",
        f"[decode-0] {_stamp(launched + 2.0)} INFO kernels.build: "
        "built tison_codec in 0.10 s (cached in /tmp)",
        f"[decode-0] {_stamp(launched + 2.5)} INFO shared.engine.shard: "
        "rank 0: model loaded from weights peer 10.0.0.2:5000 in 1.00 s (attention: cpu)",
        f"[decode-0] {_stamp(launched + 2.6)} INFO shared.engine.shard: "
        "rank 0: KV pool of 64 pages, chunked layers capped: pages of 12 layers, 3 chunked "
        "groups (16 MiB) in 0.10 s",
        f"[decode-0] {_stamp(launched + 3.0)} INFO services.worker.worker: "
        "worker decode-h-12-ab serving decode",
        f"[gateway] {_stamp(launched + 0.9)} INFO services.runtime: "
        "process started 0.70 s ago (interpreter and imports)",
    ]  # fmt: skip
    for line in lines:
        phases.record(line, launched, 3.1)
    up, worker, gateway = summary(phases, 3.2)
    assert up == "start-up: ready 3.20 s after launch; nats-server started in 0.08 s"
    assert worker == (
        "start-up: decode-0: spawned at 0.20, interpreter and imports 1.30, kernels built in "
        "0.40, weight load 1.00, KV pool 0.10, warm-up and joining 0.40, serving at 3.00"
    )
    assert gateway == "start-up: gateway: spawned at 0.20, interpreter and imports 0.70"


def test_a_worker_whose_kernels_were_cached_says_so():
    launched, phases = time.time(), StartupPhases()
    phases.record(
        f"[prefill-0] {_stamp(launched + 1.0)} INFO shared.engine.shard: "
        "rank 0: model loaded in 0.50 s",
        launched,
        1.0,
    )
    assert "kernels cached, weight load 0.50" in summary(phases, 2.0)[1]
