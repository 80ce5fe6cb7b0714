"""The codec's C paths give the same bytes on ARM64 as here, under qemu-user: a checkpoint
coded on this machine decodes on aarch64 bit for bit (the planes of several tensors decoded by
the C decoder built for aarch64, tests/native/codec_decode.c: 2 threads, each tensor split in
runs, CRC-32C verified, and by the same program built for this machine), and the C encoder
built for aarch64 codes the same planes as many.py's batches here (codec_encode.c)."""

import struct
from pathlib import Path

import pytest
import torch

from kernels.cpu import isa
from shared.codec import many, native
from shared.codec.format import MAX_CODE_LEN
from shared.codec.tensor import encode_tensor

from compilers import aarch64_tools, program_build, run_at_once

pytestmark = pytest.mark.skipif(not isa.is_x86(), reason="codes on x86-64, decodes on aarch64")
DRIVER = Path(__file__).with_name("native") / "codec_decode.c"
ENCODER = Path(__file__).with_name("native") / "codec_encode.c"
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


def run_here_and_on_aarch64(driver: Path, data: bytes, tmp_path) -> tuple[bytes, bytes]:
    """What a driver program (built with the codec's sources) writes for the input `data`: built
    for this machine, and built for aarch64 and run under qemu-user."""
    gcc, cross, qemu = aarch64_tools()
    here, arm = tmp_path / f"{driver.stem}-here", tmp_path / f"{driver.stem}-aarch64"
    builds = run_at_once(
        [
            program_build(compiler, driver, native._SOURCES, native.flags(), out, *extra)
            for compiler, out, extra in ((gcc, here, []), (cross, arm, ["-static"]))
        ]
    )
    assert [b.returncode for b in builds] == [0, 0], b"".join(b.stderr for b in builds).decode()
    given, outs = tmp_path / "in", (tmp_path / "here.out", tmp_path / "arm.out")
    given.write_bytes(data)
    runs = run_at_once(
        [[str(here), str(given), str(outs[0])], [qemu, str(arm), str(given), str(outs[1])]]
    )
    assert [r.returncode for r in runs] == [0, 0], b"".join(r.stderr for r in runs).decode()
    return outs[0].read_bytes(), outs[1].read_bytes()


def test_planes_coded_here_decode_on_aarch64_bit_for_bit(tmp_path):
    coded = coded_tensors()
    ours, arm_bytes = run_here_and_on_aarch64(DRIVER, planes_file(coded), tmp_path)
    same = arm_bytes == ours  # (no megabyte diffs on failure)
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


def encoder_input(tensors) -> bytes:
    """codec_encode.c's input: the count and longest code, then each tensor's many.py split
    candidates and bytes."""
    data = [struct.pack("<qq", len(tensors), MAX_CODE_LEN)]
    for t in tensors:
        finest, ncand, _ = many._splits(t)
        data.append(struct.pack("<4q", t.numel(), t.element_size(), finest, ncand))
        data.append(t.contiguous().view(torch.uint8).numpy().tobytes())
    return b"".join(data)


def encoder_output(encoded) -> bytes:
    """What codec_encode.c writes for many.py's results (the same tensors, in order)."""
    data = []
    for e in encoded:
        p = e.planes
        if p is None:
            data.append(struct.pack("<12q", 0, e.crc32c, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0))
            continue
        planes = [p.stream, p.raw, p.lengths, p.gaps, p.block_first.contiguous()]
        raw = [t.view(torch.uint8).numpy().tobytes() for t in planes]
        head = [0, e.crc32c, p.k, p.total_bits, p.first_symbol, p.crc32c, *map(len, raw)]
        data += [struct.pack("<12q", *head, p.block_first.element_size()), *raw]
    return b"".join(data)


def test_tensors_code_to_the_same_planes_on_aarch64(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = [t for t, _ in coded_tensors()] + [
        torch.randn(4096, generator=g).to(torch.bfloat16),  # 1-D: kept raw
        (torch.randn(96, 200, generator=g) * 3).to(torch.float16),
        torch.zeros(128, 64, dtype=torch.bfloat16),  # one symbol
    ]
    here, arm = run_here_and_on_aarch64(ENCODER, encoder_input(tensors), tmp_path)
    encoded = many.encode_batch(native.load(), [(f"t{i}", t) for i, t in enumerate(tensors)], 2)
    assert [e.planes is None for e in encoded] == [False] * 4 + [True, False, False]
    ours = encoder_output(encoded)
    same = here == ours  # (no megabyte diffs on failure)
    assert same, "codec_encode.c here codes other planes than many.py"
    same = arm == ours
    assert same, "the aarch64 encoder codes other planes than this machine's"
