"""TTFT of a long prompt when the link between the prefill and the decode host is slow.

compose.yaml on test hosts (loadtest/multihost.py; needs root): one prefill and one decode
host, SMALL_LLAMA (8 layers, 8 KiB of KV a token in bf16). Each round sends a fresh
2,000-token prompt (max_tokens 2) at every link rate, the order reversed each round, the rate
set with `tc tbf` on the prefill host's link (both directions) between requests. The rates are
Llama-3.1-8B-equivalent: the same seconds of transfer per token, so 1 Gbit/s for its 128 KiB a
token is 1/16 of that here (`--rates` in Gbit/s-equivalent; 0 = unlimited).

A layer's KV goes out as soon as the layer is computed (layer-wise push), so only what cannot
overlap the prefill adds to TTFT: with T_p the prefill (the unlimited TTFT, an upper bound) and
T_x the transfer at that rate (the prefill host's sent bytes over the rate), at least
T_x / L (the last layer's share) and at most max(T_x / L, T_x - T_p (L - 1) / L) when sending
never holds the compute up. The table gives each rate's median TTFT, the added TTFT, T_x and
that bound.

    sudo python -m loadtest.scenarios.link_ttft [--rounds 5] [--rates 0,1,10,25] [--out DIR]
"""

import argparse
import asyncio
import json
import random
import statistics
import tempfile
from pathlib import Path

import aiohttp

from loadtest.client import send
from loadtest.multihost import Deployment
from loadtest.netns import Network, unavailable
from loadtest.scenarios.common import build_small_llama, md_table
from loadtest.target import Target
from loadtest.workloads import RequestSpec
from shared.cpu_report import report as env_report

REFERENCE_KV_BYTES = 131072  # Llama 3.1 8B: 32 layers x 8 KV heads x 128 x (K, V) x bf16
ENV = {"TISON_API_KEY": "link", "TISON_NATS_TOKEN": "link", "TISON_KV_SECRET": "link"}


def kv_bytes_per_token(fields: dict, itemsize: int = 2) -> int:
    head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
    return fields["num_hidden_layers"] * fields["num_key_value_heads"] * head_dim * 2 * itemsize


def report(ttft: dict, wire: dict, rates: list[float], scale: float, layers: int) -> str:
    """The Markdown table: per rate the median TTFT, T_x, the bound and the added TTFT; an
    added TTFT is within the bound up to the unlimited TTFT's own half range (its noise)."""
    unlimited = ttft[0.0]
    base = statistics.median(unlimited)
    noise = (max(unlimited) - min(unlimited)) / 2
    rows = []
    for rate in rates:
        med = statistics.median(ttft[rate])
        row = [f"{rate:g}" if rate else "unlimited", f"{rate * 1000 * scale:.0f}" if rate else "-"]
        row.append(f"{med * 1e3:.0f} ({min(ttft[rate]) * 1e3:.0f}-{max(ttft[rate]) * 1e3:.0f})")
        if rate:
            t_x = statistics.median(wire[rate]) * 8 / (rate * 1e9 * scale)
            bound = max(t_x / layers, t_x - base * (layers - 1) / layers)
            row += [f"{t_x * 1e3:.0f}", f"{bound * 1e3:.0f}", f"{(med - base) * 1e3:.0f}"]
            row.append("yes" if med - base <= bound + noise else "NO")
        else:
            row += ["-", "-", "-", "-"]
        rows.append(row)
    head = ["8B-equiv. Gbit/s", "link Mbit/s", "TTFT ms, median (range)", "transfer T_x ms"]
    head += ["bound ms", "added ms", f"within bound (+/- {noise * 1e3:.0f} ms)"]
    return f"T_p (the unlimited TTFT) {base * 1e3:.0f} ms\n\n{md_table(head, rows)}\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rates", default="0,1,10,25", help="Gbit/s, 8B-equivalent; 0: unlimited")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--model", type=Path, default=None, help="default: SMALL_LLAMA, built")
    p.add_argument("--out", type=Path, default=Path("results/link_ttft"))
    args = p.parse_args(argv)
    if why := unavailable():
        raise SystemExit(f"link_ttft: {why}")
    work = Path(tempfile.mkdtemp(prefix="link-ttft-"))
    model = args.model or build_small_llama(work / "model")
    fields = json.loads((model / "config.json").read_text())
    per_token = kv_bytes_per_token(fields)
    scale = per_token / REFERENCE_KV_BYTES
    rates = sorted({0.0, *(float(r) for r in args.rates.split(","))})  # unlimited: the base
    env = dict(ENV, TISON_MODEL_DIR=str(model))
    with Network() as net, Deployment(net, work / "run", env) as d:
        d.up(timeout_s=300)
        target = Target(d.base_url, model.name, ignore_eos=True, api_key=ENV["TISON_API_KEY"])
        prefill = d.hosts["prefill"]
        rng = random.Random(0)
        vocab = fields["vocab_size"]

        def one(rate: float) -> tuple[float, int]:
            """(TTFT s, bytes the prefill host sent) of a fresh prompt at `rate`."""
            if rate:
                prefill.limit(rate * 1000 * scale)
            else:
                prefill.unlimit()
            ids = tuple(rng.randrange(1, vocab) for _ in range(args.prompt_tokens))
            spec = RequestSpec("", 2, len(ids), prompt_ids=ids)
            sent = prefill.counters()[1]

            async def go():
                async with aiohttp.ClientSession() as session:
                    return await send(session, target, spec, 0.0)

            result = asyncio.run(go())
            if not result.ok:
                raise RuntimeError(f"request failed at {rate} Gbit/s: {result.detail}")
            return result.ttft_s, prefill.counters()[1] - sent

        one(0)  # first-use costs of the long shapes
        ttft: dict[float, list[float]] = {r: [] for r in rates}
        wire: dict[float, list[int]] = {r: [] for r in rates}
        for k in range(args.rounds):
            for rate in rates if k % 2 == 0 else rates[::-1]:
                t, b = one(rate)
                ttft[rate].append(t)
                wire[rate].append(b)
        prefill.unlimit()
    layers = fields["num_hidden_layers"]
    text = report(ttft, wire, rates, scale, layers)
    facts = env_report()
    name = "SMALL_LLAMA, random weights" if args.model is None else model.name
    text = (
        f"CPU: {facts['cpu']} (tier {facts['tier']}, {facts['cores']} cores); model: "
        f"{name} ({layers} layers, {per_token} B of KV a token), prompt "
        f"{args.prompt_tokens} tokens, {args.rounds} rounds\n\n{text}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "link_ttft.md").write_text(text)
    (args.out / "link_ttft.json").write_text(json.dumps({"ttft_s": ttft, "wire_bytes": wire}))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
