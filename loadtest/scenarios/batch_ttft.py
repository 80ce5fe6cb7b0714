"""Interactive time to first token while a large batch runs: `tison up` on the bundled model;
each round measures a probe of interactive streaming chats (one every --gap-s seconds) twice,
alone and while a batch of --batch-lines lines runs (its lines admitted behind interactive
requests, x-tison-priority: batch), in alternating order. Reports TTFT p50 / p99 of each, the
per-round ratio of the p50s, and the batch lines finished during the probe (what the batch
kept doing). The batch issue's bound: TTFT p50 with the batch within 1.5x of without.

    python -m loadtest.scenarios.batch_ttft [--rounds 3] [--out results/batch_ttft.json]
"""

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import aiohttp

from loadtest.scenarios.cluster import Cluster
from loadtest.scenarios.output import emit
from shared.default_model import default_model_dir

CHAT = "/v1/chat/completions"
BOUND = 1.5


async def ttft(http: aiohttp.ClientSession, url: str, model: str, prompt: str) -> float:
    """Seconds from sending a streaming chat to its first content chunk."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    async with http.post(url + CHAT, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter() - start
                async for _ in resp.content:  # read the rest: the request ends normally
                    pass
                return first
    raise RuntimeError("the stream ended without content")


async def probe(http, url: str, model: str, count: int, gap_s: float) -> list[float]:
    tasks = []
    for i in range(count):
        tasks.append(
            asyncio.ensure_future(ttft(http, url, model, f"Question {i}: what is {i}+{i}?"))
        )
        await asyncio.sleep(gap_s)
    return list(await asyncio.gather(*tasks))


async def start_batch(http, url: str, model: str, lines: int, words: int, tokens: int) -> str:
    filler = " ".join(f"word{j % 97}" for j in range(words))  # a long document to work on
    text = "\n".join(
        json.dumps({
            "custom_id": f"b{i}", "method": "POST", "url": CHAT,
            "body": {"model": model, "max_tokens": tokens, "temperature": 0,
                     "messages": [{"role": "user", "content": f"{filler} Summarize item {i}."}]},
        })
        for i in range(lines)
    )  # fmt: skip
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", text.encode(), filename="batch.jsonl")
    async with http.post(url + "/v1/files", data=form) as resp:
        file_id = (await resp.json())["id"]
    spec = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
    async with http.post(url + "/v1/batches", json=spec) as resp:
        return (await resp.json())["id"]


async def completed(http, url: str, batch_id: str) -> int:
    async with http.get(f"{url}/v1/batches/{batch_id}") as resp:
        batch = await resp.json()
    counts = batch["request_counts"]
    if counts["failed"]:  # a scenario whose lines fail measures nothing
        raise RuntimeError(f"batch lines failed: {counts} (error file {batch['error_file_id']})")
    return counts["completed"]


async def with_batch(http, url: str, model: str, args) -> tuple[list[float], int]:
    batch_id = await start_batch(
        http, url, model, args.batch_lines, args.batch_prompt_words, args.batch_max_tokens
    )
    while await completed(http, url, batch_id) < 8:  # the batch is well under way
        await asyncio.sleep(0.5)
    before = await completed(http, url, batch_id)
    times = await probe(http, url, model, args.probes, args.gap_s)
    done = await completed(http, url, batch_id) - before
    async with http.post(f"{url}/v1/batches/{batch_id}/cancel") as resp:
        assert resp.status == 200, await resp.text()
    await asyncio.sleep(3.0)  # its running lines end
    return times, done


def summary(times: list[float]) -> dict:
    ms = sorted(1000 * t for t in times)
    return {"p50_ms": round(statistics.median(ms), 1), "p99_ms": round(ms[-1], 1), "n": len(ms)}


async def run(url: str, model: str, args) -> dict:
    rounds = []
    async with aiohttp.ClientSession() as http:
        await probe(http, url, model, 4, 0.1)  # warm up
        for r in range(args.rounds):
            first_alone = r % 2 == 0
            if first_alone:
                alone = await probe(http, url, model, args.probes, args.gap_s)
            busy, batch_done = await with_batch(http, url, model, args)
            if not first_alone:
                alone = await probe(http, url, model, args.probes, args.gap_s)
            a, b = summary(alone), summary(busy)
            rounds.append(
                {
                    "alone": a,
                    "with_batch": b,
                    "p50_ratio": round(b["p50_ms"] / a["p50_ms"], 2),
                    "batch_lines_during_probe": batch_done,
                }
            )
            print(json.dumps(rounds[-1]), flush=True)
    ratios = sorted(r["p50_ratio"] for r in rounds)
    return {
        "rounds": rounds,
        "p50_ratio_median": statistics.median(ratios),
        "p50_ratio_range": [ratios[0], ratios[-1]],
        "bound": BOUND,
        "pass": statistics.median(ratios) <= BOUND,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--probes", type=int, default=20, help="interactive requests a probe")
    parser.add_argument("--gap-s", type=float, default=0.5, help="between probe requests")
    parser.add_argument("--batch-lines", type=int, default=2000)
    parser.add_argument("--batch-max-tokens", type=int, default=64, help="of each batch line")
    parser.add_argument(
        "--batch-prompt-words", type=int, default=0, help="words before each batch question"
    )
    parser.add_argument("--up-flags", default="", help="more `tison up` flags, one string")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tison-batch-ttft"))
    args = parser.parse_args()
    model = default_model_dir()
    with Cluster(args.workdir) as cluster:
        url = cluster.up(model, *args.up_flags.split())
        result = asyncio.run(run(url, model.name, args))
    emit(result, args.out)


if __name__ == "__main__":
    main()
