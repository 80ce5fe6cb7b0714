"""Load time of a model's weights from a peer (shared/peer: a WeightsServer on loopback, its
PeerCheckpoint) against the same model from disk, raw and compressed (`tison compress`).

    PYTHONPATH=. python -m loadtest.bench_peer_load [--layers 8] [--rounds 7] [--out DIR]

One process loads each side in turn, every round (page cache warm: the disk side's best case);
a ratio is the median of the per-round ratios to the raw disk load, with their range. Server
and loader share this machine's cores, so the peer's sending competes with the decoding; on
two hosts the server's work is on the other one. The model is a random bf16 Llama
(loadtest/random_model.py), whose exponents compress less than trained weights'."""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from loadtest.random_model import llama_fields, save_random_llama
from shared.codec.folder import compress_dir
from shared.models.config import ModelConfig
from shared.models.loader import load_model
from shared.peer.client import PeerCheckpoint
from shared.peer.server import WeightsServer

SECRET = b"bench"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="peer-bench-"))
    raw, compressed = out / "raw", out / "compressed"
    if not (raw / "config.json").is_file():
        fields = llama_fields(32000, args.hidden, args.hidden * 11 // 4, args.layers, 16, 4)
        save_random_llama(raw, fields, torch.bfloat16)
        compress_dir(raw, compressed)
    servers = {
        name: WeightsServer(folder, SECRET)
        for name, folder in (("raw", raw), ("compressed", compressed))
    }
    endpoints = {name: s.start() for name, s in servers.items()}
    sides = {
        "disk raw": (raw, None),
        "disk compressed": (compressed, None),
        "peer raw": (raw, endpoints["raw"]),
        "peer compressed": (raw, endpoints["compressed"]),
    }
    cfg = ModelConfig.from_dir(raw)
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    wire: dict[str, int] = {}
    for _ in range(args.rounds):
        for side, (folder, endpoint) in sides.items():
            weights = PeerCheckpoint(endpoint, SECRET) if endpoint else None
            start = time.perf_counter()
            load_model(folder, cfg, torch.bfloat16, weights=weights)
            seconds[side].append(time.perf_counter() - start)
            if weights is not None:
                wire[side] = weights.bytes_received
    for s in servers.values():
        s.close()
    base = seconds["disk raw"]
    for side, times in seconds.items():
        ratios = sorted(t / b for t, b in zip(times, base))
        sent = f", {wire[side] / 2**20:.0f} MiB on the wire" if side in wire else ""
        print(
            f"{side:16} median {statistics.median(times):.3f} s, x{statistics.median(ratios):.2f} "
            f"of disk raw ({ratios[0]:.2f}-{ratios[-1]:.2f}){sent}"
        )


if __name__ == "__main__":
    main()
