"""Serving overhead: what the service adds to the decode engine's own step, per streamed token.

`tison up` with its defaults serves the small random Llama; at each concurrency B, B streams of
chats with exactly N tokens out. Measured in the same run, in paired rounds (the order of the
two reversed each round; the other one idle meanwhile):

- client: ITL p50 per token (loadtest.client, the gateway's running usage);
- engine: the decode engine's own step at batch B: an LLMEngine in a process of its own,
  pinned to the decode worker's cores (read from /proc), with B requests of the same lengths (median
  step, the prefills excluded);
- inside the service, from the gateway's /metrics over the load: the decode batch (requests
  per tokens message: long outputs keep it near B), the decode worker's engine
  step (`tison_decode_step_seconds`), its step-to-step cycle (`tison_decode_cycle_seconds`:
  the step plus its loop's publish and commands) and the worker-to-gateway transit.

The load generator runs off the decode worker's cores (beside the services and prefill, as
clients elsewhere would leave them). ITL p50 / engine step is the overhead the issue bounds
(<= 1.15 at 32 streams); the rest says where a token's time goes: served step / engine step
(the service's processes sharing cores with the worker), cycle - step (the worker's loop),
and ITL - cycle (NATS, the gateway's demux, detokenizer and SSE, the client).

    python -m loadtest.scenarios.overhead [--concurrency 1,4,16,32] [--rounds 3]
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np

from loadtest.bench import run_sync, served_model
from loadtest.report import fmt
from loadtest.runner import Load
from loadtest.scenarios.cluster import REPO_ROOT, Cluster
from loadtest.scenarios.common import bench, build_small_llama, md_table, wait_serving, warm_up
from loadtest.target import Target
from loadtest.workloads import LengthDist, PromptMaker, random_requests
from shared.parallel.cores import available_cores, format_cpulist, parse_cpulist
from shared.tokenizer.tokenizer import Tokenizer

SERVICE_METRICS = {  # our name: the gateway's histogram
    "served batch": "tison_decode_batch_size",
    "served step": "tison_decode_step_seconds",
    "cycle": "tison_decode_cycle_seconds",
    "transit": "tison_tokens_transit_seconds",
}


def histogram_totals(metrics_url: str) -> dict[str, tuple[float, float]]:
    """{our name: (sum, count)} of the gateway's histograms now."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    totals = {}
    for name, metric in SERVICE_METRICS.items():
        total = re.search(rf"^{metric}_sum (\S+)$", text, re.M)
        count = re.search(rf"^{metric}_count (\S+)$", text, re.M)
        totals[name] = (float(total.group(1)), float(count.group(1)))
    return totals


def mean_between(before: dict, after: dict) -> dict[str, float]:
    """Mean of each histogram over what was observed between two readings (times in ms)."""
    means = {}
    for name, metric in SERVICE_METRICS.items():
        total = after[name][0] - before[name][0]
        count = after[name][1] - before[name][1]
        scale = 1e3 if metric.endswith("_seconds") else 1.0
        means[name] = scale * total / count if count else float("nan")
    return means


def engine_steps(model: Path, batches: list[int], prompt_len: int, new_tokens: int) -> dict:
    """{batch: median decode step ms} of an LLMEngine in this process (run pinned, below)."""
    from loadtest.decode_steps import median_step_s
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model_dir=model))
    rng = np.random.default_rng(1)
    steps = {}
    for batch in [1, *batches]:  # the first, batch 1, warms up
        prompts = [rng.integers(3, 1000, prompt_len).tolist() for _ in range(batch)]
        steps[batch] = 1e3 * median_step_s(engine, prompts, new_tokens)
    engine.close()
    return steps


def measure_engine(model: Path, cores: tuple[int, ...], batches, prompt_len, new_tokens) -> dict:
    """engine_steps in a process of its own on `cores`, a thread per core (as the worker)."""
    code = (
        "import json, sys; from shared.parallel.cores import pin; "
        "from loadtest.scenarios.overhead import engine_steps; "
        f"pin({tuple(cores)!r}); "
        f"print(json.dumps(engine_steps(__import__('pathlib').Path({str(model)!r}), "
        f"{list(batches)!r}, {prompt_len}, {new_tokens})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def worker_cores(root_pid: int, role: str) -> tuple[int, ...]:
    """The CPUs the `tison <role>` process below root_pid runs on (its plan, as applied)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
        except OSError:
            continue
        if role.encode() in args[3:4] and _is_below(int(entry.name), root_pid):
            return parse_cpulist(re.search(r"Cpus_allowed_list:\s*(\S+)", status).group(1))
    raise RuntimeError(f"no tison {role} process under pid {root_pid}")


def _is_below(pid: int, root: int) -> bool:
    while pid > 1:
        if pid == root:
            return True
        stat = (Path("/proc") / str(pid) / "stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,4,16,32", help="comma list of concurrent streams")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=256, help="long: decode batch ~ streams")
    ap.add_argument("--requests-per-stream", type=int, default=1, help="1: the batch stays B")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse (or build) the model here")
    args = ap.parse_args()
    command = "python -m loadtest.scenarios.overhead " + shlex.join(sys.argv[1:])
    batches = [int(n) for n in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="tison-overhead-") as tmp, Cluster(Path(tmp)) as c:
        model = build_small_llama(args.model_dir or Path(tmp) / "small-llama")
        url = c.up(model)
        decode_cores = worker_cores(c.procs["up"].pid, "decode")
        # the load generator stands in for clients on other machines: off the decode cores
        client_cores = set(available_cores()) - set(decode_cores) or set(available_cores())
        target = Target(url, run_sync(served_model(url)), "chat", ignore_eos=True)
        maker = PromptMaker(Tokenizer.from_dir(model), np.random.default_rng(0))
        fixed_in = LengthDist.parse(f"{args.input_len}")
        fixed_out = LengthDist.parse(f"{args.output_len}")
        wait_serving(target)
        warm_up(target, random_requests(maker, 4, fixed_in, fixed_out))
        served: dict[int, list[dict]] = {b: [] for b in batches}
        engine: dict[int, list[float]] = {b: [] for b in batches}
        for r in range(args.rounds):
            for side in ("service", "engine") if r % 2 == 0 else ("engine", "service"):
                if side == "engine":
                    steps = measure_engine(
                        model, decode_cores, batches, args.input_len, args.output_len
                    )
                    for b in batches:
                        engine[b].append(steps[b])
                    continue
                for b in batches:
                    specs = random_requests(
                        maker, b * args.requests_per_stream, fixed_in, fixed_out
                    )
                    before = histogram_totals(url + "/metrics")
                    os.sched_setaffinity(0, client_cores)
                    report = bench(target, specs, [Load(concurrency=b)], "tison up", "overhead")
                    os.sched_setaffinity(0, available_cores())
                    means = mean_between(before, histogram_totals(url + "/metrics"))
                    summary = report.runs[0].summary
                    served[b].append(dict(means, itl=summary.itl.p50, ok=summary.completed))
    print(summary_table(served, engine, decode_cores))
    print(
        f"\nchat, {args.input_len} tokens in, exactly {args.output_len} out, "
        f"{args.requests_per_stream} requests per stream, {args.rounds} paired rounds; "
        f"engine on CPU {format_cpulist(decode_cores)}\n`{command}`"
    )


def summary_table(served: dict, engine: dict, cores) -> str:
    """Medians over the rounds (ms), and ITL p50 / engine step with its range over rounds."""
    head = ["streams", "engine step", "batch per step", "served step", "cycle", "transit"]
    head += ["client ITL p50"]
    head += ["ITL / engine step", "ok"]
    rows = []
    for b, rounds in served.items():
        ratios = [s["itl"] / e for s, e in zip(rounds, engine[b])]
        rows.append(
            [str(b), fmt(statistics.median(engine[b]))]
            + [fmt(statistics.median(s[k] for s in rounds)) for k in SERVICE_METRICS]
            + [fmt(statistics.median(s["itl"] for s in rounds))]
            + [f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"]
            + [str(sum(s["ok"] for s in rounds))]
        )
    return md_table(head, rows)


if __name__ == "__main__":
    main()
