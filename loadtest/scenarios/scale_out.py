"""Scale-out: the time to first token of a fresh decode worker joining a running service, its
weights read from disk (the raw or the compressed folder) or taken from a peer.

    PYTHONPATH=. python -m loadtest.scenarios.scale_out [--models small,1g] [--rounds 3]
        [--cache DIR] [--out FILE.json]

The service runs throughout: NATS, the scheduler, the gateway and one prefill worker, which
holds TISON_KV_SECRET and so serves its model folder to peers. Each round starts a new
`tison decode` process per side and times from its spawn to the first token of a 1-token
completion through the gateway (asked every 50 ms: until a decode worker has joined, the
scheduler refuses it), then stops that worker and waits until the scheduler has dropped it.
That is what a user adding a replica waits for: imports, NATS, the weights, the KV pool, the
first heartbeat, a prefill and a step.

Sides: "disk raw" and "disk compressed" read their own folder, left warm in the page cache
(as on a host whose model store was read recently); "peer raw" and "peer compressed" start
with no model folder (`--weights-from peer`) and take the prefill worker's weights over
loopback TCP, raw or compressed on the wire. A peer serves one folder, so the service runs
twice, once over each, and each run pairs its peer side with "disk raw": the issue's
"within 1.2x of a warm local load" is the ratio of those two in the same run. Rounds alternate
the order of the sides. Every process shares this machine's cores: on two hosts the sending
is the other host's work.

Models: "small" is the 30M Llama of the scenarios (common.SMALL_LLAMA), "1g" a ~1 GB one
(10 layers of hidden 2048), both bf16 with random weights and the bundled tokenizer, built
once (and their `tison compress` copies) under --cache.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from loadtest.paired import round_order
from loadtest.random_model import llama_fields, save_random_llama
from loadtest.scenarios.cluster import Cluster, free_port, http_status
from loadtest.scenarios.common import SMALL_LLAMA, TOKENIZER_FILES
from loadtest.scenarios.output import emit
from shared.default_model import default_model_dir

MODELS = {
    "small": SMALL_LLAMA,
    "1g": {
        **SMALL_LLAMA,
        **llama_fields(8192, 2048, 5632, 10, 16, 8),
        "tie_word_embeddings": False,
    },
}
NAME = "scale-out"  # the served model name of every worker
SECRET = "bench-scale-out"
COMMON = ["--served-model-name", NAME, "--dtype", "bfloat16", "--heartbeat", "0.2"]
POLL_S = 0.05


def build(cache: Path, model: str) -> dict[str, Path]:
    """{"raw": folder, "compressed": folder} of the model (with the bundled tokenizer)."""
    import torch

    from shared.codec import compress_dir

    raw, compressed = cache / model / "raw", cache / model / "compressed"
    if not (raw / "model.safetensors").is_file():
        save_random_llama(raw, MODELS[model], torch.bfloat16)
        for name in TOKENIZER_FILES:
            shutil.copy(default_model_dir() / name, raw / name)
    if not (compressed / "tison-codec.json").is_file():
        compress_dir(raw, compressed)
    return {"raw": raw, "compressed": compressed}


def complete(url: str, timeout_s: float) -> int:
    """The HTTP status of a 1-token completion (0: no answer)."""
    body = json.dumps({"model": NAME, "prompt": "Hello", "max_tokens": 1, "temperature": 0})
    ask = urllib.request.Request(
        url + "/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(ask, timeout=timeout_s) as reply:
            reply.read()
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def wait_listening(c: Cluster, url: str, timeout_s: float = 120) -> None:
    """Until the gateway answers /health at all (503 until a decode worker joins)."""
    deadline = time.monotonic() + timeout_s
    while http_status(url + "/health") == 0:
        exited = [name for name, proc in c.procs.items() if proc.poll() is not None]
        if exited or time.monotonic() > deadline:
            raise RuntimeError(f"the service did not start ({exited} exited):\n{c.logs()}")
        time.sleep(0.2)


def join(c: Cluster, url: str, name: str, args: list[str], timeout_s: float = 600) -> float:
    """Starts decode worker `name`; seconds from its spawn to the first token it serves."""
    spawned = time.monotonic()
    c.tison(name, ["decode", *args, *COMMON])
    while complete(url, 30) != 200:
        if c.procs[name].poll() is not None:
            raise RuntimeError(f"{name} exited with {c.procs[name].returncode}:\n{c.logs()}")
        if time.monotonic() - spawned > timeout_s:
            raise RuntimeError(f"{name} served nothing in {timeout_s} s:\n{c.logs()}")
        time.sleep(POLL_S)
    return time.monotonic() - spawned


def leave(c: Cluster, url: str, name: str) -> None:
    """Stops worker `name` and waits until the scheduler no longer routes to it."""
    proc = c.procs.pop(name)
    proc.terminate()
    proc.wait(60)
    deadline = time.monotonic() + 60
    while complete(url, 5) == 200:
        if time.monotonic() > deadline:
            raise RuntimeError(f"requests still served 60 s after {name} stopped")
        time.sleep(POLL_S)


def service_run(folders: dict[str, Path], served: str, rounds: int, work: Path) -> dict:
    """One service whose prefill worker serves folders[served]; side -> TTFTs of the rounds."""
    sides = {
        "disk raw": ["--model", str(folders["raw"]), "--weights-from", "disk"],
        f"peer {served}": [
            "--model",
            str(work / "absent" / NAME),
            "--weights-from",
            "peer",
            "--cache-dir",
            str(work / "cache"),
        ],  # fmt: skip
    }
    if served == "raw":
        sides["disk compressed"] = ["--model", str(folders["compressed"]), "--weights-from", "disk"]
    ttft: dict[str, list[float]] = {side: [] for side in sides}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with Cluster(work / f"service-{served}") as c:
        c.nats()
        c.tison("scheduler", ["scheduler"])
        c.tison("prefill", ["prefill", "--model", str(folders[served]), *COMMON])
        gateway = ["gateway", "--model", str(folders["raw"]), "--port", str(port)]
        c.tison("gateway", [*gateway, "--served-model-name", NAME])
        wait_listening(c, url)
        warm_up_s = join(c, url, "warm-up", sides["disk raw"])  # imports and kernels cached
        leave(c, url, "warm-up")
        print(f"[{served}] warm-up worker: {warm_up_s:.2f} s", file=sys.stderr)
        for r in range(rounds):
            for i, side in enumerate(round_order(list(sides), r)):
                name = f"decode-{r}-{i}"
                ttft[side].append(join(c, url, name, sides[side]))
                leave(c, url, name)
                print(f"[{served}] round {r} {side}: {ttft[side][-1]:.2f} s", file=sys.stderr)
    return ttft


def summarize(ttft: dict[str, list[float]], base: str = "disk raw") -> dict:
    out = {}
    for side, values in ttft.items():
        ratios = [v / b for v, b in zip(values, ttft[base], strict=True)]
        out[side] = dict(
            ttft_s=dict(median=statistics.median(values), min=min(values), max=max(values)),
            vs_disk_raw=dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios)),
        )
    return out


def table(model: str, runs: dict[str, dict]) -> str:
    lines = [
        f"### {model}",
        "",
        "| service's peer folder | side | TTFT of the fresh worker, s | vs disk raw (range) |",
        "|---|---|---|---|",
    ]
    for served, sides in runs.items():
        for side, m in sides.items():
            t, r = m["ttft_s"], m["vs_disk_raw"]
            lines.append(
                f"| {served} | {side} | {t['median']:.2f} ({t['min']:.2f}-{t['max']:.2f}) | "
                f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f}) |"
            )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small,1g", help=f"comma-separated, of {sorted(MODELS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/tison-bench-scale-out"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    os.environ["TISON_KV_SECRET"] = SECRET  # every process of the service, and the new workers
    result = dict(rounds=args.rounds, cpus=os.cpu_count(), models={})
    tables = []
    for model in args.models.split(","):
        folders = build(args.cache, model)
        runs = {}
        for served in ("raw", "compressed"):
            work = args.cache / model / "runs"
            shutil.rmtree(work, ignore_errors=True)
            runs[served] = summarize(service_run(folders, served, args.rounds, work))
        result["models"][model] = runs
        tables.append(table(model, runs))
    print("\n".join(tables), file=sys.stderr)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
