"""P/D disaggregation against one colocated engine, on the same two cores, at equal load.

A mixed Poisson load on a small random-weight Llama-shaped model: long prompts with short
answers (prefill-heavy) among short prompts streaming long answers (decode-heavy).

- disaggregated: `tison decode` alone on core 1; `tison prefill`, NATS, the scheduler, the
  gateway and the load generator on core 0 (one torch thread per worker);
- colocated: `taskset -c 0,1 tison up --colocated --threads N` (one engine does both; N from
  `--colocated-threads`, a list runs each).

In the colocated engine a long prefill runs inside the decode loop, so every stream stalls
for it; disaggregated, decode steps never wait for a prompt.

    python -m loadtest.scenarios.disagg [--rate 1] [--colocated-threads 1,2] [--out-dir DIR]
"""

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np

from loadtest.compare import compare_table
from loadtest.metrics import Slo
from loadtest.plots import compare_plots
from loadtest.report import BenchReport, fmt
from loadtest.runner import Load
from loadtest.scenarios.cluster import Cluster, free_port
from loadtest.scenarios.common import (
    bench,
    build_small_llama,
    md_table,
    save,
    wait_serving,
    warm_up,
)
from loadtest.target import Target
from loadtest.workloads import LengthDist, PromptMaker, mixed, random_requests
from shared.tokenizer.tokenizer import Tokenizer


def start_disaggregated(c: Cluster, model: Path) -> str:
    """Decode alone on core 1; prefill, NATS, scheduler, gateway (and this load generator, see
    main) on core 0, so nothing that a long prefill pushes off core 0 lands on decode's."""
    port = free_port()
    c.nats()
    c.tison("scheduler", ["scheduler"], cpus="0")
    worker = ["--model", str(model), "--threads", "1"]
    c.tison("prefill", ["prefill", *worker], cpus="0")
    c.tison("decode", ["decode", *worker], cpus="1")
    c.tison("gateway", ["gateway", "--model", str(model), "--port", str(port)], cpus="0")
    url = f"http://127.0.0.1:{port}"
    c.wait_healthy(url + "/health")
    return url


def start_colocated(c: Cluster, model: Path, threads: int) -> str:
    port = free_port()
    up = ["up", "--colocated", "--model", str(model), "--threads", str(threads)]
    up += ["--port", str(port)]
    c.tison("up", up, cpus="0,1", nats=False)
    url = f"http://127.0.0.1:{port}"
    c.wait_healthy(url + "/health")
    return url


def workload(model: Path, args) -> tuple[list, str]:
    maker = PromptMaker(Tokenizer.from_dir(model), np.random.default_rng(args.seed))
    long = random_requests(
        maker, args.num_long, LengthDist.parse(args.long_input), LengthDist.parse("8")
    )
    short = random_requests(
        maker, args.num_short, LengthDist.parse("uniform:32:128"), LengthDist.parse("128")
    )
    text = (
        f"{args.num_long} long prompts ({args.long_input} tokens, 8 out) mixed with "
        f"{args.num_short} short ones (32-128 tokens, 128 out), Poisson {args.rate} req/s"
    )
    return mixed(maker.rng, long, short), text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=1.0, help="offered load, requests/s")
    ap.add_argument("--num-long", type=int, default=16)
    ap.add_argument("--num-short", type=int, default=32)
    ap.add_argument("--long-input", default="uniform:1024:2048")
    ap.add_argument("--slo-ttft", type=float, default=2000.0, help="ms")
    ap.add_argument("--slo-tpot", type=float, default=50.0, help="ms")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--colocated-threads", default="1", help="torch threads; a list: one run each")
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse (or build) the model here")
    ap.add_argument("--out-dir", type=Path, default=Path("loadtest/results/disagg"))
    args = ap.parse_args()
    command = "python -m loadtest.scenarios.disagg " + shlex.join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="tison-disagg-") as tmp:
        model = build_small_llama(args.model_dir or Path(tmp) / "small-llama")
        specs, text = workload(model, args)
        slo = Slo(ttft_ms=args.slo_ttft, tpot_ms=args.slo_tpot)
        threads = [int(n) for n in args.colocated_threads.split(",")]
        setups = [(f"colocated, {n} thread{'s' * (n > 1)}", start_colocated, n) for n in threads]
        setups.append(("disaggregated", start_disaggregated, None))
        all_cpus = os.sched_getaffinity(0)
        reports = {}
        for name, start, threads in setups:
            # The disaggregated run keeps this process (the client, NATS) on core 0 with prefill.
            os.sched_setaffinity(0, {0} if threads is None else all_cpus)
            with Cluster(Path(tmp) / name.replace(" ", "")) as c:
                url = start(c, model) if threads is None else start(c, model, threads)
                target = Target(url, model.name, ignore_eos=True)
                wait_serving(target)
                warm_up(target, specs[:4])
                reports[name] = bench(
                    target, specs, [Load(args.rate)], name, text, slo=slo, command=command
                )
            save(reports[name], args.out_dir, name.replace(", ", "-").replace(" ", ""))
    dis = reports.pop("disaggregated")
    for name, colo in reports.items():
        stem = name.replace(", ", "-").replace(" ", "")
        (args.out_dir / f"vs-{stem}.md").write_text(compare_table(colo, dis))
        compare_plots(colo, dis, args.out_dir / f"vs-{stem}")
    print(summary(reports, dis))
    print(f"\n{text}; SLOs TTFT <= {args.slo_ttft:g} ms, TPOT <= {args.slo_tpot:g} ms")
    print(f"`{command}` — results in {args.out_dir}")


def summary(colocated: dict[str, BenchReport], dis: BenchReport) -> str:
    """Both setups' ITL p99, TTFT p99 and goodput, and disaggregated / colocated ratios."""
    head = [
        "setup",
        "ITL p99 ms",
        "TTFT p99 ms",
        "goodput req/s",
        "ITL p50 ms",
        "TTFT p50 ms",
        "TPOT p50 ms",
        "out tok/s",
        "ok",
    ]

    def row(name, s):
        return [
            name,
            fmt(s.itl.p99),
            fmt(s.ttft.p99),
            fmt(s.goodput, 2),
            fmt(s.itl.p50),
            fmt(s.ttft.p50),
            fmt(s.tpot.p50),
            fmt(s.output_throughput),
            f"{s.completed}/{s.num_requests}",
        ]

    b = dis.runs[0].summary
    firsts = [
        row(f"{name} (tison up --colocated)", r.runs[0].summary) for name, r in colocated.items()
    ]
    ratios = []
    for name, report in colocated.items():
        a = report.runs[0].summary
        gain = f"{b.goodput / a.goodput:.2f}x" if a.goodput else "–"
        ratios.append(
            [
                f"disaggregated / {name}",
                f"{b.itl.p99 / a.itl.p99:.2f}x",
                f"{b.ttft.p99 / a.ttft.p99:.2f}x",
                gain,
                "",
                "",
                "",
                "",
                "",
            ]
        )
    rows = [*firsts, row("disaggregated (decode alone on core 1)", b), *ratios]
    return md_table(head, rows)


if __name__ == "__main__":
    main()
