"""Tison beside Hugging Face `transformers serve --continuous-batching` (and llama.cpp's
`llama-server` when installed) on the same model, the same chat workload and the same
concurrency sweep.

Needs `pip install 'transformers[serving]'` (FastAPI, uvicorn); runs offline on a local folder.

- Tison: `tison up` with its defaults (its core plan: a core each for prefill and decode on
  two cores);
- transformers: `transformers serve --continuous-batching --port P MODEL_DIR`;
- llama.cpp, optional: `llama-server -m GGUF -t <cores> --parallel <max streams>` when
  `llama-server` is on PATH and `--gguf` names the same model converted to GGUF (llama.cpp's
  `convert_hf_to_gguf.py MODEL_DIR --outtype bf16`); skipped otherwise.

All run at once (each idle while another is loaded) in paired rounds (loadtest.paired), and
all generate exactly the asked tokens; ITL is per token.

    python -m loadtest.scenarios.peer [--concurrency 1,4,16,32] [--gguf MODEL.gguf]
"""

import argparse
import os
import shlex
import shutil
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from loadtest.bench import run_sync, served_model
from loadtest.compare import compare_table
from loadtest.paired import Side, median_of, round_ratios, run_rounds, short_outputs, sum_of
from loadtest.plots import compare_plots
from loadtest.report import BenchReport, fmt
from loadtest.runner import Load
from loadtest.scenarios.cluster import Cluster, free_port
from loadtest.scenarios.common import build_small_llama, md_table, save, wait_serving, warm_up
from loadtest.target import Target
from loadtest.workloads import LengthDist, PromptMaker, random_requests
from shared.errors import ProcessStartError
from shared.parallel.cores import available_cores
from shared.tokenizer.tokenizer import Tokenizer

PEER, OURS, LLAMA_CPP = "transformers serve", "tison", "llama.cpp"
COLOCATED = "tison --colocated"


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


def start_llama_server(c: Cluster, gguf: Path, streams: int) -> str:
    """llama.cpp's server on every core this process has, a slot per stream."""
    port = free_port()
    cores = len(available_cores())
    cmd = [shutil.which("llama-server"), "-m", str(gguf), "--port", str(port), "-t", str(cores)]
    cmd += ["--parallel", str(streams), "-c", str(streams * 512)]
    c.start(LLAMA_CPP, cmd)
    url = f"http://127.0.0.1:{port}"
    c.wait_healthy(url + "/health")
    return url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,4,16,32", help="comma list of concurrent streams")
    ap.add_argument("--gguf", type=Path, default=None, help="the model as GGUF, for llama-server")
    ap.add_argument(
        "--colocated", action="store_true", help="also `tison up --colocated` (its rows only)"
    )
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per load point")
    ap.add_argument("--input-len", default="uniform:64:192")
    ap.add_argument("--output-len", default="64")
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds per load point")
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse (or build) the model here")
    ap.add_argument("--out-dir", type=Path, default=Path("loadtest/results/peer"))
    args = ap.parse_args()
    command = "python -m loadtest.scenarios.peer " + shlex.join(sys.argv[1:])
    loads = [Load(concurrency=int(n)) for n in args.concurrency.split(",")]
    text = (
        f"chat, random {args.input_len} in, exactly {args.output_len} out, "
        f"{args.num_prompts} requests, {args.rounds} paired rounds"
    )
    with tempfile.TemporaryDirectory(prefix="tison-peer-") as tmp, ExitStack() as stack:
        model = build_small_llama(args.model_dir or Path(tmp) / "small-llama")
        maker = PromptMaker(Tokenizer.from_dir(model), np.random.default_rng(0))
        specs = random_requests(
            maker,
            args.num_prompts,
            LengthDist.parse(args.input_len),
            LengthDist.parse(args.output_len),
        )
        sides = []
        servers = [(PEER, start_transformers), (OURS, lambda c, m: c.up(m))]
        if args.colocated:
            servers.append((COLOCATED, lambda c, m: c.up(m, "--colocated")))
        if args.gguf and shutil.which("llama-server"):
            most = max(load.concurrency for load in loads)
            servers.append((LLAMA_CPP, lambda c, _: start_llama_server(c, args.gguf, most)))
        else:
            print("llama.cpp: skipped (needs llama-server on PATH and --gguf)", file=sys.stderr)
        for name, start in servers:
            c = stack.enter_context(Cluster(Path(tmp) / name.replace(" ", "-")))
            url = start(c, model)
            served = run_sync(served_model(url))
            # Both generate exactly max_tokens: Tison by vLLM's ignore_eos; transformers serve
            # by a generation config of its own, which has no end-of-sequence token.
            target = (
                Target(url, served, "chat", extra=(("generation_config", "{}"),))
                if name == PEER
                else Target(url, served, "chat", ignore_eos=True)  # llama-server has it too
            )
            wait_serving(target)
            warm_up(target, specs[:4])
            sides.append(Side(name, target))
        results = run_rounds(sides, specs, loads, args.rounds, text, command=command)
    for name, reports in results.items():
        for r, report in enumerate(reports):
            save(report, args.out_dir, f"{name.replace(' ', '-')}-round{r + 1}")
    peer, ours = results[PEER], results[OURS]
    (args.out_dir / "compare.md").write_text(compare_table(peer[0], ours[0]))
    compare_plots(peer[0], ours[0], args.out_dir / "compare")
    print(summary(results, specs))
    print(f"\n{text}\n`{command}` — results in {args.out_dir}")


COLUMNS = (  # (heading, metric of a Summary)
    ("out tok/s", lambda s: s.output_throughput),
    ("TTFT p50 ms", lambda s: s.ttft.p50),
    ("TTFT p99 ms", lambda s: s.ttft.p99),
    ("ITL p50 ms", lambda s: s.itl.p50),
    ("ITL p99 ms", lambda s: s.itl.p99),
    ("E2E p50 ms", lambda s: s.e2e.p50),
)


def summary(results: dict[str, list[BenchReport]], specs) -> str:
    """Each server's medians over the rounds, then per peer the median per-round ratio of Tison
    to it and its range; ITL is per token (see loadtest.client)."""
    head = ["server", "streams", *(h for h, _ in COLUMNS), "ok", "short / per-event ITL"]
    rows = []
    for reports in results.values():
        for i, run in enumerate(reports[0].runs):
            done = sum_of(reports, i, lambda s: s.completed)
            sent = sum_of(reports, i, lambda s: s.num_requests)
            per_event = sum_of(reports, i, lambda s: s.itl_per_event)
            rows.append(
                [reports[0].label, str(run.load.concurrency)]
                + [fmt(median_of(reports, i, m)) for _, m in COLUMNS]
                + [f"{done}/{sent}", f"{short_outputs(reports, i, specs)} / {per_event}"]
            )
    ours = results[OURS]
    for name, peer in results.items():
        if name in (OURS, COLOCATED):
            continue
        for i, run in enumerate(peer[0].runs):
            spreads = [round_ratios(peer, ours, i, m) for _, m in COLUMNS]
            rows.append(
                [f"tison / {name}", str(run.load.concurrency)]
                + ["–" if s is None else str(s) for s in spreads]
                + ["", ""]
            )
    return md_table(head, rows)


if __name__ == "__main__":
    main()
