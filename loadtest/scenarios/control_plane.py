"""Control-plane ceiling: gateway → NATS → scheduler → fake workers → gateway, no model compute.

Fake prefill and decode workers answer at once with deterministic tokens, so what is measured
is the services alone (HTTP + SSE, tokenization and detokenization, NATS hops, scheduling) and
the load generator. Two loads: one stream at a time (the TTFT the services add) and many
concurrent streams (the streamed tokens/s ceiling).

    python -m loadtest.scenarios.control_plane [--streams 256] [--out-dir DIR]
"""

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np

from loadtest.report import BenchReport
from loadtest.runner import Load
from loadtest.scenarios.cluster import Cluster, free_port
from loadtest.scenarios.common import bench, md_table, save, wait_serving
from loadtest.target import Target
from loadtest.workloads import LengthDist, PromptMaker, random_requests
from shared.default_model import default_model_dir
from shared.tokenizer.tokenizer import Tokenizer

TARGET_TOKENS_S = 20_000
TARGET_TTFT_MS = 5.0


def start_fake_cluster(c: Cluster, model: Path, gateway_cpus: str | None = None) -> str:
    """NATS, scheduler, gateway and one fake prefill + one fake decode worker; the base URL."""
    port = free_port()
    c.nats()
    c.tison("scheduler", ["scheduler"])
    for role in ("prefill", "decode"):
        c.tison(role, ["fake-worker", "--role", role, "--model", str(model)])
    gateway = ["gateway", "--model", str(model), "--port", str(port), "--log-level", "WARNING"]
    c.tison("gateway", gateway, cpus=gateway_cpus)
    url = f"http://127.0.0.1:{port}"
    c.wait_healthy(url + "/health", timeout_s=60)
    return url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=256, help="concurrent streams at high load")
    ap.add_argument("--num-prompts", type=int, default=768, help="requests at high load")
    ap.add_argument("--output-len", type=int, default=256, help="tokens per request, high load")
    ap.add_argument("--low-load-prompts", type=int, default=300)
    ap.add_argument("--out-dir", type=Path, default=Path("loadtest/results/control_plane"))
    args = ap.parse_args()
    command = "python -m loadtest.scenarios.control_plane " + shlex.join(sys.argv[1:])
    model = default_model_dir()
    maker = PromptMaker(Tokenizer.from_dir(model), np.random.default_rng(0))
    low_specs = random_requests(
        maker, args.low_load_prompts, LengthDist.parse("32"), LengthDist.parse("8")
    )
    high_specs = random_requests(
        maker, args.num_prompts, LengthDist.parse("32"), LengthDist.parse(str(args.output_len))
    )
    with tempfile.TemporaryDirectory(prefix="tison-cp-") as tmp, Cluster(Path(tmp)) as c:
        url = start_fake_cluster(c, model)
        target = Target(url, model.name, "completions", stream=True, ignore_eos=True)
        wait_serving(target)
        low = bench(
            target,
            low_specs,
            [Load(concurrency=1)],
            "fake workers, 1 stream",
            "random: 32 in, 8 out",
            command=command,
        )
        high = bench(
            target,
            high_specs,
            [Load(concurrency=args.streams)],
            f"fake workers, {args.streams} streams",
            f"random: 32 in, {args.output_len} out",
            command=command,
        )
    save(low, args.out_dir, "low_load")
    save(high, args.out_dir, "high_load")
    lo, hi = low.runs[0].summary, high.runs[0].summary
    rows = [
        [
            f"streamed tokens/s, {args.streams} streams",
            f"{hi.output_throughput:,.0f}",
            f">= {TARGET_TOKENS_S:,}",
            _ok(hi.output_throughput >= TARGET_TOKENS_S),
        ],
        [
            "TTFT p50 ms, 1 stream (services added)",
            f"{lo.ttft.p50:.2f}",
            f"<= {TARGET_TTFT_MS}",
            _ok(lo.ttft.p50 <= TARGET_TTFT_MS),
        ],
        ["TTFT p99 ms, 1 stream", f"{lo.ttft.p99:.2f}", "", ""],
        ["ITL p50 / p99 ms, 1 stream", f"{lo.itl.p50:.2f} / {lo.itl.p99:.2f}", "", ""],
        [
            f"TTFT p50 / p99 ms, {args.streams} streams",
            f"{hi.ttft.p50:.1f} / {hi.ttft.p99:.1f}",
            "",
            "",
        ],
        [
            f"ITL p50 / p99 ms, {args.streams} streams",
            f"{hi.itl.p50:.2f} / {hi.itl.p99:.2f}",
            "",
            "",
        ],
        [
            "tokens per SSE event, 1 / N streams",
            f"{per_event(low):.2f} / {per_event(high):.2f}",
            "",
            "",
        ],
        [
            "requests ok",
            f"{lo.completed}/{lo.num_requests}, {hi.completed}/{hi.num_requests}",
            "",
            "",
        ],
    ]
    print(md_table(["measure", "value", "target", ""], rows))
    print(f"\n`{command}` — results in {args.out_dir}")


def per_event(report: BenchReport) -> float:
    """Output tokens per streamed event: above 1 where the gateway merged queued tokens."""
    done = [r for r in report.runs[0].requests if r.ok]
    return sum(r.output_len for r in done) / max(1, sum(len(r.itl_s) + 1 for r in done))


def _ok(passed: bool) -> str:
    return "met" if passed else "MISSED"


if __name__ == "__main__":
    main()
