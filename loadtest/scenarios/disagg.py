"""P/D disaggregation against one colocated engine, on the same two cores, at equal load.

A mixed Poisson load on a small random-weight Llama-shaped model: long prompts with short
answers (prefill-heavy) among short prompts streaming long answers (decode-heavy).

- disaggregated: `tison up` with its defaults (its core plan on two cores: decode alone on
  core 1; prefill, NATS, the scheduler and the gateway on core 0, where this load generator
  runs too);
- colocated: `tison up --colocated` (one engine on both cores, two threads; mixed batches: the
  decode rows and a prompt chunk under a 128-token budget each step).

Every setup is started first and all are loaded in paired rounds (loadtest.paired), each
request generating exactly its tokens (ignore_eos); ITL is per token.

Colocated, every stream waits for the prompt chunk of each step; disaggregated, decode steps
never wait for a prompt, but each role has one core instead of two.

    python -m loadtest.scenarios.disagg [--rate 1] [--out-dir DIR]
"""

import argparse
import shlex
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from loadtest.compare import compare_table
from loadtest.metrics import Slo
from loadtest.paired import Side, median_of, round_ratios, run_rounds, short_outputs, sum_of
from loadtest.plots import compare_plots
from loadtest.report import BenchReport, fmt
from loadtest.runner import Load
from loadtest.scenarios.cluster import Cluster
from loadtest.scenarios.common import build_small_llama, md_table, save, wait_serving, warm_up
from loadtest.target import Target
from loadtest.workloads import LengthDist, PromptMaker, mixed, random_requests
from shared.tokenizer.tokenizer import Tokenizer

DISAGGREGATED, COLOCATED = "disaggregated", "colocated"


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
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds")
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse (or build) the model here")
    ap.add_argument("--out-dir", type=Path, default=Path("loadtest/results/disagg"))
    args = ap.parse_args()
    command = "python -m loadtest.scenarios.disagg " + shlex.join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="tison-disagg-") as tmp, ExitStack() as stack:
        model = build_small_llama(args.model_dir or Path(tmp) / "small-llama")
        specs, text = workload(model, args)
        slo = Slo(ttft_ms=args.slo_ttft, tpot_ms=args.slo_tpot)
        sides = []
        c = stack.enter_context(Cluster(Path(tmp) / "colocated"))
        target = Target(c.up(model, "--colocated"), model.name, ignore_eos=True)
        sides.append(Side(COLOCATED, target))
        c = stack.enter_context(Cluster(Path(tmp) / "disaggregated"))
        target = Target(c.up(model), model.name, ignore_eos=True)
        # the load generator stays on core 0 with prefill and the services, off decode's core
        sides.append(Side(DISAGGREGATED, target, cpus=frozenset({0})))
        for side in sides:
            wait_serving(side.target)
            warm_up(side.target, specs[:4])
        results = run_rounds(sides, specs, [Load(args.rate)], args.rounds, text, slo, command)
    for name, reports in results.items():
        for r, report in enumerate(reports):
            save(report, args.out_dir, f"{stem(name)}-round{r + 1}")
    dis = results.pop(DISAGGREGATED)
    for name, colo in results.items():
        (args.out_dir / f"vs-{stem(name)}.md").write_text(compare_table(colo[0], dis[0]))
        compare_plots(colo[0], dis[0], args.out_dir / f"vs-{stem(name)}")
    print(summary(results, dis, specs))
    print(
        f"\n{text}; SLOs TTFT <= {args.slo_ttft:g} ms, TPOT <= {args.slo_tpot:g} ms; "
        f"{args.rounds} paired rounds"
    )
    print(f"`{command}` — results in {args.out_dir}")


def stem(name: str) -> str:
    return name.replace(", ", "-").replace(" ", "")


COLUMNS = (  # (heading, metric of a Summary)
    ("ITL p99 ms", lambda s: s.itl.p99),
    ("TTFT p99 ms", lambda s: s.ttft.p99),
    ("goodput req/s", lambda s: s.goodput),
    ("ITL p50 ms", lambda s: s.itl.p50),
    ("TTFT p50 ms", lambda s: s.ttft.p50),
    ("TPOT p50 ms", lambda s: s.tpot.p50),
    ("out tok/s", lambda s: s.output_throughput),
)


def summary(colocated: dict[str, list[BenchReport]], dis: list[BenchReport], specs) -> str:
    """Each setup's medians over the rounds (ITL per token), then disaggregated / colocated:
    the median per-round ratio and its range."""
    head = ["setup", *(h for h, _ in COLUMNS), "ok", "short"]

    def row(name, reports):
        done = sum_of(reports, 0, lambda s: s.completed)
        sent = sum_of(reports, 0, lambda s: s.num_requests)
        cells = [fmt(median_of(reports, 0, m), 2 if "goodput" in h else 1) for h, m in COLUMNS]
        return [name, *cells, f"{done}/{sent}", str(short_outputs(reports, 0, specs))]

    rows = [row(f"{name} (tison up --colocated)", r) for name, r in colocated.items()]
    rows.append(row("disaggregated (tison up)", dis))
    for name, reports in colocated.items():
        spreads = [round_ratios(reports, dis, 0, m) for _, m in COLUMNS]
        rows.append(
            [f"disaggregated / {name}", *("–" if s is None else str(s) for s in spreads), "", ""]
        )
    return md_table(head, rows)


if __name__ == "__main__":
    main()
