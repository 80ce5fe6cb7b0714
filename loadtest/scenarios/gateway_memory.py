"""The gateway gives memory back after large requests: a gateway on the bundled model's
tokenizer (NATS, no workers: every prompt is longer than the context, so each request is
parsed, templated and tokenized in full, then refused with a 400) gets bursts of concurrent
chat bodies just under its body limit. Reports its RSS idle, its peak (VmHWM), after each burst
and a few seconds later. The issue's bound: memory is returned (#23: one 50 MB body took the
RSS from 256 MB to 5.6 GB, held).

    python -m loadtest.scenarios.gateway_memory [--bursts 3] [--concurrency 8] [--out FILE]
"""

import argparse
import asyncio
import platform
import time
from pathlib import Path

import aiohttp

from loadtest.scenarios.cluster import Cluster, free_port, http_status
from loadtest.scenarios.health_under_load import big_chat
from loadtest.scenarios.output import emit
from shared.default_model import default_model_dir


def memory_mb(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (peak) of a process, in MB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = round(int(value.split()[0]) / 1024, 1)
    return fields


async def bursts(url: str, body: bytes, pid: int, count: int, concurrency: int) -> list[dict]:
    out = []
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as http:

        async def one() -> int:
            async with http.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                await r.read()
                return r.status

        for i in range(count):
            start = time.perf_counter()
            statuses = await asyncio.gather(*[one() for _ in range(concurrency)])
            took = time.perf_counter() - start
            out.append({"burst": i, "statuses": sorted(set(statuses)), "s": round(took, 2),
                        **memory_mb(pid)})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tison-gateway-memory"))
    args = parser.parse_args()
    model = default_model_dir()
    with Cluster(args.workdir) as cluster:
        cluster.nats()
        port = free_port()
        cluster.tison("gateway", ["gateway", "--model", str(model), "--port", str(port)])
        url = f"http://127.0.0.1:{port}"
        while http_status(url + "/health") == 0:  # 503 without workers: it answers
            time.sleep(0.2)
        pid = cluster.procs["gateway"].pid
        idle = memory_mb(pid)
        body = big_chat(model.name, seed=0)
        rounds = asyncio.run(bursts(url, body, pid, args.bursts, args.concurrency))
        time.sleep(args.settle_s)
        settled = memory_mb(pid)
    result = {
        "cpu": platform.processor() or platform.machine(),
        "body_bytes": len(body),
        "concurrency": args.concurrency,
        "idle_rss_mb": idle["VmRSS"],
        "peak_rss_mb": settled["VmHWM"],
        "bursts": rounds,
        "settled_rss_mb": settled["VmRSS"],
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
