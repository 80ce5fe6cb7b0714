"""`tison bench run|compare|report`: load any OpenAI-compatible server, compare two results.

    tison bench run --base-url http://127.0.0.1:8000 --tokenizer DIR --request-rate 1,2,4 \
        --num-prompts 200 --slo-ttft 500 --slo-tpot 50 --out results/tison
    tison bench compare results/colocated.json results/tison.json --out results/vs
    tison bench report results/tison.json          # re-render the Markdown and plots
"""

import argparse
import shlex
import sys
from pathlib import Path

from shared.errors import TisonError


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _add_target_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root or .../v1")
    p.add_argument("--model", default="", help="model name (default: the first of /v1/models)")
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--no-stream", action="store_true", help="ask for whole responses")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--api-key", default="")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback target")


def _add_workload_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload", choices=["random", "shared-prefix", "sharegpt", "agent"], default="random"
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="model folder whose tokenizer builds prompts (default: the bundled model)",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=100,
        help="requests per load point (agent: --num-sessions x --turns)",
    )
    p.add_argument("--input-len", default="256", help="N, uniform:LO:HI, normal:MEAN:STD, exp:MEAN")
    p.add_argument(
        "--output-len",
        default=None,
        help="same forms as --input-len (default 128; sharegpt: each reply's length)",
    )
    p.add_argument(
        "--prefix-len", type=int, default=1024, help="shared-prefix, agent: prefix tokens"
    )
    p.add_argument(
        "--num-prefixes", type=int, default=1, help="shared-prefix, agent: distinct prefixes"
    )
    p.add_argument(
        "--num-sessions",
        type=int,
        default=8,
        help="agent: sessions (--request-rate: session starts/s, --concurrency: sessions at once)",
    )
    p.add_argument("--turns", type=int, default=4, help="agent: turns per session")
    p.add_argument(
        "--think-time", type=float, default=0.0, help="agent: seconds from a turn's end to the next"
    )
    p.add_argument("--dataset", type=Path, default=None, help="sharegpt: ShareGPT JSON file")
    p.add_argument("--seed", type=int, default=0)


def _add_load_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--request-rate",
        type=_floats,
        default=[],
        help="Poisson arrivals, req/s; a comma list sweeps (default: all at once)",
    )
    p.add_argument(
        "--concurrency", type=_ints, default=[], help="max requests in flight; a comma list sweeps"
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-duration", type=float, default=600.0, help="seconds per load point")
    p.add_argument("--slo-ttft", type=float, default=None, help="ms, for goodput")
    p.add_argument("--slo-tpot", type=float, default=None, help="ms, for goodput")
    p.add_argument("--slo-e2e", type=float, default=None, help="ms, for goodput")
    p.add_argument("--gpu-hour-cost", type=float, default=None, help="price per device-hour")
    p.add_argument("--num-devices", type=int, default=1, help="devices the server holds")


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="load-test a server; compare results")
    actions = bench.add_subparsers(dest="bench_command", required=True)
    p = actions.add_parser("run", help="run a workload at one or more loads")
    _add_target_options(p)
    _add_workload_options(p)
    _add_load_options(p)
    p.add_argument("--out", type=Path, default=Path("bench"), help="output path prefix")
    p.add_argument("--label", default="", help="name of this result in reports")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)
    p = actions.add_parser("compare", help="two results side by side, with B/A ratios")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--out", type=Path, default=None, help="also write <out>.md and plots")
    p.set_defaults(func=compare)
    p = actions.add_parser("report", help="re-render the Markdown report and plots of a result")
    p.add_argument("result", type=Path)
    p.set_defaults(func=report)


def _fail(action: str, error: Exception) -> int:
    print(f"tison bench {action}: {error}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from loadtest import bench
    from loadtest.target import check_loopback

    try:
        check_loopback(args.base_url, args.allow_remote)
        config, specs = _bench_config(args)
        report_ = bench.run_sync(bench.run_bench(config, specs, not args.no_progress))
        paths = bench.write_outputs(report_, args.out, plots=not args.no_plots)
    except (TisonError, OSError, ValueError) as e:
        return _fail("run", e)
    from loadtest.report import summary_table

    print(summary_table(report_))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all(r.summary.completed for r in report_.runs) else 1


def _bench_config(args: argparse.Namespace):
    """(BenchConfig, request specs) from the options; asks the server for its model name."""
    from loadtest import bench
    from loadtest.metrics import Cost, Slo
    from loadtest.target import Target
    from services.cli.generate import resolve_model
    from shared.tokenizer.tokenizer import Tokenizer

    model = args.model or bench.run_sync(bench.served_model(args.base_url))
    workload = bench.WorkloadConfig(
        kind=args.workload,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len or ("" if args.workload == "sharegpt" else "128"),
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        dataset=args.dataset,
        seed=args.seed,
        num_sessions=args.num_sessions,
        num_turns=args.turns,
        think_time_s=args.think_time,
    )
    tokenizer = Tokenizer.from_dir(resolve_model(args.tokenizer and str(args.tokenizer)))
    target = Target(
        args.base_url,
        model,
        args.api,
        not args.no_stream,
        args.ignore_eos,
        args.timeout,
        args.api_key,
    )
    cost = None if args.gpu_hour_cost is None else Cost(args.gpu_hour_cost, args.num_devices)
    config = bench.BenchConfig(
        target=target,
        loads=tuple(bench.sweep(args.request_rate, args.concurrency, args.burstiness)),
        workload=workload.describe(),
        max_duration_s=args.max_duration,
        slo=Slo(args.slo_ttft, args.slo_tpot, args.slo_e2e),
        cost=cost,
        label=args.label or model,
        seed=args.seed,
        command="tison " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "",
    )
    return config, bench.make_requests(workload, tokenizer)


def compare(args: argparse.Namespace) -> int:
    from loadtest.compare import compare_table
    from loadtest.report import BenchReport

    try:
        a, b = BenchReport.load(args.a), BenchReport.load(args.b)
        table = compare_table(a, b)
        if args.out is not None:
            from loadtest.plots import compare_plots

            args.out.parent.mkdir(parents=True, exist_ok=True)
            images = compare_plots(a, b, args.out)
            links = "\n".join(f"![{p.stem}]({p.name})" for p in images)
            args.out.with_name(args.out.name + ".md").write_text(f"{table}\n{links}\n")
    except (TisonError, OSError) as e:
        return _fail("compare", e)
    print(table, end="")
    return 0


def report(args: argparse.Namespace) -> int:
    from loadtest.bench import write_outputs
    from loadtest.report import BenchReport

    try:
        result = BenchReport.load(args.result)
        prefix = args.result.with_suffix("")
        paths = write_outputs(result, prefix)
    except (TisonError, OSError) as e:
        return _fail("report", e)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
