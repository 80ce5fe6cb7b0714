"""loadtest.startup reads start-up phases from `tison up`'s output lines."""

import time
from datetime import datetime

from loadtest.startup import Run, record, table


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def test_phases_are_read_per_child_with_the_durations_lines_report():
    launched, run = time.time(), Run()
    lines = [
        (0.2, f"{_stamp(launched + 0.2)} INFO tison.up: started prefill-0 (pid 12)"),
        (1.5, f"[prefill-0] {_stamp(launched + 1.5)} INFO services.runtime: "
              "process started 1.30 s ago (interpreter and imports)"),
        (1.7, f"[prefill-0] {_stamp(launched + 1.6)} INFO shared.engine.shard: "
              "rank 0: model loaded in 0.10 s"),
        (1.7, f"[prefill-0] {_stamp(launched + 1.6)} INFO shared.engine.shard: "
              "rank 1: model loaded in 0.30 s"),
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
