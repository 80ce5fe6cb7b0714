"""The gateway stays responsive while it tokenizes a maximal request: `tison up` on the bundled
model; one chat body just under the gateway's body limit (text of random words, so the
tokenizer and the chat template have the most to do; the prompt is then refused as longer than
the context, after tokenization) while /health is polled every 10 ms. Reports the /health
latencies during the request (p50, p99, max) against those of an idle gateway, and how long
the request took. The issue's bound: /health under 100 ms while a maximal prompt is tokenized.

    python -m loadtest.scenarios.health_under_load [--rounds 3] [--out results/health.json]
"""

import argparse
import json
import random
import statistics
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from loadtest.scenarios.cluster import Cluster
from loadtest.scenarios.output import emit
from shared.default_model import default_model_dir

BODY_BYTES = (1 << 20) - 4096  # just under the default limit for the bundled model (1 MiB)
POLL_S = 0.01


def health_latency(url: str) -> float:
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as resp:
            resp.read()
    except OSError:
        pass
    return time.perf_counter() - start


def poll_while(url: str, running: threading.Event) -> list[float]:
    latencies = []
    while running.is_set():
        latencies.append(health_latency(url))
        time.sleep(POLL_S)
    return latencies


def big_chat(model: str, seed: int) -> bytes:
    rng = random.Random(seed)
    words = ["def", "return", "fibonacci", "import", "über", "東京", "value", "0x1f", "🙂"]
    text, size = [], 0
    while size < BODY_BYTES - 200:
        word = rng.choice(words)
        text.append(word)
        size += len(word.encode()) + 1
    body = {"model": model, "messages": [{"role": "user", "content": " ".join(text)}]}
    return json.dumps(body, ensure_ascii=False).encode()


def one_round(url: str, model: str, seed: int) -> dict:
    idle = [health_latency(url) for _ in range(50)]
    running = threading.Event()
    running.set()
    polled: list[float] = []
    poller = threading.Thread(target=lambda: polled.extend(poll_while(url, running)))
    poller.start()
    time.sleep(0.2)
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=big_chat(model, seed),
        headers={"Content-Type": "application/json"}, method="POST",
    )  # fmt: skip
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=300) as resp:
            status = resp.status
    except urllib.error.HTTPError as e:
        status = e.code
    took = time.perf_counter() - start
    running.clear()
    poller.join()
    ms = sorted(1000 * x for x in polled)
    return {
        "request_status": status,
        "request_s": round(took, 3),
        "health_polls": len(ms),
        "health_p50_ms": round(statistics.median(ms), 2),
        "health_p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 2),
        "health_max_ms": round(ms[-1], 2),
        "idle_health_p50_ms": round(1000 * statistics.median(idle), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tison-health-under-load"))
    args = parser.parse_args()
    model = default_model_dir()
    with Cluster(args.workdir) as cluster:
        url = cluster.up(model)
        rounds = [one_round(url, model.name, seed) for seed in range(args.rounds)]
    result = {"body_bytes": BODY_BYTES, "rounds": rounds}
    emit(result, args.out)


if __name__ == "__main__":
    main()
