"""A checkpoint coded on this machine decodes on ARM64 bit for bit: the planes of several
tensors, coded here by the C encoder, decoded by the codec's C decoder built for aarch64 and run
under qemu-user (tests/native/codec_decode.c; 2 threads, each tensor split in runs, CRC-32C
verified), and by the same program built for this machine."""

import struct
from pathlib import Path

import pytest
import torch

from kernels.cpu import isa
from shared.codec import native
from shared.codec.tensor import encode_tensor

from compilers import aarch64_tools, program_build, run_at_once

pytestmark = pytest.mark.skipif(not isa.is_x86(), reason="codes on x86-64, decodes on aarch64")
DRIVER = Path(__file__).with_name("native") / "codec_decode.c"
FIELDS = ("stream", "raw", "lengths", "gaps")


def coded_tensors() -> list:
    """Weight-like tensors of every coded dtype, of sizes that split into several runs and of
    ones that end inside a block, each Huffman-coded (not kept raw)."""
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(512, 1024, generator=g).to(torch.bfloat16) * 0.02,
        torch.randn(257, 131, generator=g).to(torch.bfloat16),
        torch.randn(300, 300, generator=g).to(torch.float16) * 0.05,
        torch.randn(64, 999, generator=g) * 0.1,
    ]
    coded = [encode_tensor(t, f"t{i}") for i, t in enumerate(tensors)]
    assert all(c.planes is not None for c in coded)
    return list(zip(tensors, coded))


def planes_file(coded) -> bytes:
    """codec_decode.c's input: the count, then each tensor's fields and planes."""
    data = [struct.pack("<q", len(coded))]
    for _, c in coded:
        p = c.planes
        planes = [getattr(p, name).numpy().tobytes() for name in FIELDS]
        index = p.block_first.contiguous()
        head = [*map(len, planes), index.numel(), index.element_size(), p.first_symbol]
        head += [p.total_bits, c.num_elements, c.dtype.itemsize, p.k]
        data += [struct.pack("<11q", *head), *planes, index.numpy().tobytes()]
    return b"".join(data)


def test_planes_coded_here_decode_on_aarch64_bit_for_bit(tmp_path):
    gcc, cross, qemu = aarch64_tools()
    x86, arm = tmp_path / "decode", tmp_path / "decode-aarch64"
    builds = run_at_once(
        [
            program_build(compiler, DRIVER, native._SOURCES, native.flags(), out, *extra)
            for compiler, out, extra in ((gcc, x86, []), (cross, arm, ["-static"]))
        ]
    )
    assert [b.returncode for b in builds] == [0, 0], b"".join(b.stderr for b in builds).decode()
    coded = coded_tensors()
    (tmp_path / "planes").write_bytes(planes_file(coded))
    runs = run_at_once(
        [
            [str(x86), str(tmp_path / "planes"), str(tmp_path / "x86.out")],
            [qemu, str(arm), str(tmp_path / "planes"), str(tmp_path / "arm.out")],
        ]
    )
    assert [r.returncode for r in runs] == [0, 0], b"".join(r.stderr for r in runs).decode()
    arm_bytes = (tmp_path / "arm.out").read_bytes()
    same = arm_bytes == (tmp_path / "x86.out").read_bytes()  # (no megabyte diffs on failure)
    assert same, "the aarch64 decoder's output differs from this machine's"
    at = 0
    for tensor, c in coded:
        status, crc = struct.unpack_from("<qq", arm_bytes, at)
        size = tensor.numel() * tensor.element_size()
        decoded = arm_bytes[at + 16 : at + 16 + size]
        assert (status, crc) == (0, c.crc32c), c.name
        same = decoded == tensor.contiguous().view(torch.uint8).numpy().tobytes()
        assert same, c.name
        at += 16 + size
    assert at == len(arm_bytes)
