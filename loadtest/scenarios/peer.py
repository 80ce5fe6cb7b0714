"""Tison beside Hugging Face `transformers serve --continuous-batching` on the same model folder,
the same chat workload and the same concurrency sweep.

Needs `pip install 'transformers[serving]'` (FastAPI, uvicorn); runs offline on a local folder.

- Tison: `tison up --threads 1` (a prefill and a decode worker, one torch thread each);
- transformers: `transformers serve --continuous-batching --port P MODEL_DIR`.

    python -m loadtest.scenarios.peer [--concurrency 8,32] [--out-dir loadtest/results/peer]
"""

import argparse
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from loadtest.bench import run_sync, served_model
from loadtest.compare import compare_table
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
from loadtest.workloads import LengthDist, PromptMaker, random_requests
from shared.errors import ProcessStartError
from shared.tokenizer.tokenizer import Tokenizer


def start_tison(c: Cluster, model: Path) -> str:
    port = free_port()
    c.tison("up", ["up", "--model", str(model), "--threads", "1", "--port", str(port)], nats=False)
    url = f"http://127.0.0.1:{port}"
    c.wait_healthy(url + "/health")
    return url


def start_transformers(c: Cluster, model: Path) -> str:
    exe = shutil.which("transformers", path=os.path.dirname(sys.executable)) or shutil.which(
        "transformers"
    )
    if exe is None:
        raise ProcessStartError("`transformers` CLI not found: pip install 'transformers[serving]'")
    port = free_port()
    cmd = [exe, "serve", "--continuous-batching", "--port", str(port), str(model)]
    c.start("transformers", cmd, env={"HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    c.wait_healthy(url + "/health")
    return url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="8,32", help="comma list of concurrent streams")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per load point")
    ap.add_argument("--input-len", default="uniform:64:192")
    ap.add_argument("--output-len", default="64")
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse (or build) the model here")
    ap.add_argument("--out-dir", type=Path, default=Path("loadtest/results/peer"))
    args = ap.parse_args()
    command = "python -m loadtest.scenarios.peer " + shlex.join(sys.argv[1:])
    loads = [Load(concurrency=int(n)) for n in args.concurrency.split(",")]
    text = f"chat, random {args.input_len} in, {args.output_len} out, {args.num_prompts} requests"
    with tempfile.TemporaryDirectory(prefix="tison-peer-") as tmp:
        model = build_small_llama(args.model_dir or Path(tmp) / "small-llama")
        maker = PromptMaker(Tokenizer.from_dir(model), np.random.default_rng(0))
        specs = random_requests(
            maker,
            args.num_prompts,
            LengthDist.parse(args.input_len),
            LengthDist.parse(args.output_len),
        )
        reports = {}
        for name, start in (("transformers serve", start_transformers), ("tison", start_tison)):
            with Cluster(Path(tmp) / name.replace(" ", "-")) as c:
                url = start(c, model)
                target = Target(url, run_sync(served_model(url)), "chat")
                wait_serving(target)
                warm_up(target, specs[:4])
                reports[name] = bench(target, specs, loads, name, text, command=command)
            save(reports[name], args.out_dir, name.replace(" ", "-"))
    peer, ours = reports["transformers serve"], reports["tison"]
    (args.out_dir / "compare.md").write_text(compare_table(peer, ours))
    compare_plots(peer, ours, args.out_dir / "compare")
    print(summary(peer, ours))
    print(f"\n{text}\n`{command}` — results in {args.out_dir}")


def summary(peer: BenchReport, ours: BenchReport) -> str:
    head = [
        "server",
        "streams",
        "out tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "E2E p50 ms",
        "ok",
    ]
    rows = []
    for report in (peer, ours):
        for run in report.runs:
            s = run.summary
            rows.append(
                [
                    report.label,
                    str(run.load.concurrency),
                    fmt(s.output_throughput),
                    fmt(s.ttft.p50),
                    fmt(s.ttft.p99),
                    fmt(s.itl.p50),
                    fmt(s.itl.p99),
                    fmt(s.e2e.p50),
                    f"{s.completed}/{s.num_requests}",
                ]
            )
    for a, b in zip(peer.runs, ours.runs):
        sa, sb = a.summary, b.summary
        rows.append(
            [
                "tison / transformers",
                str(a.load.concurrency),
                f"{sb.output_throughput / sa.output_throughput:.2f}x",
                f"{sb.ttft.p50 / sa.ttft.p50:.2f}x",
                f"{sb.ttft.p99 / sa.ttft.p99:.2f}x",
                f"{sb.itl.p50 / sa.itl.p50:.2f}x",
                f"{sb.itl.p99 / sa.itl.p99:.2f}x",
                f"{sb.e2e.p50 / sa.e2e.p50:.2f}x",
                "",
            ]
        )
    return md_table(head, rows)


if __name__ == "__main__":
    main()
