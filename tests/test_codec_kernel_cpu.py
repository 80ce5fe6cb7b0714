"""The CUDA kernels of kernels/cuda/codec_decode.cu, compiled for the CPU with
tests/gpu/kernel_cpu_shim.c and run one thread after another, against the CPU decoder:
their logic is checked here even where no GPU is (tests/gpu checks them on a GPU)."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.codec import decode_tensor, encode_tensor
from shared.codec.format import LAYOUTS, SEGS_PER_BLOCK
from shared.codec.gpu import plan

SHIM = Path(__file__).parent / "gpu" / "kernel_cpu_shim.c"


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    lib_path = tmp_path_factory.mktemp("shim") / "shim.so"
    flags = ["-O2", "-shared", "-fPIC", "-fno-strict-aliasing", "-Wall", "-Werror"]
    subprocess.run([compiler, *flags, "-o", str(lib_path), str(SHIM)], check=True)
    return ctypes.CDLL(str(lib_path))


def addr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def run_kernels(shim, encoded) -> tuple[np.ndarray, np.ndarray]:
    """(the kernels' output bits, the per-segment code counts)."""
    launch = plan(encoded)
    planes = {name: t.numpy() for name, t in encoded.planes.tensors().items()}
    i64, i32 = ctypes.c_int64, ctypes.c_int
    counts = np.zeros(launch.num_segments, dtype=np.int64)
    common = [addr(planes["stream"]), addr(planes["gaps"]), addr(launch.table)]
    common += [i32(launch.lut_bits), i64(encoded.planes.total_bits)]
    common += [i64(launch.num_segments), i32(launch.seg_bits)]
    shim.shim_count(*common, addr(counts))
    first = np.cumsum(counts) - counts
    n = encoded.num_elements
    out = np.zeros(n, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32}[launch.width])
    shim.shim_decode(
        *common, addr(first), i64(n), addr(planes["raw"]), addr(launch.parts),
        i32(len(launch.parts) // 3), i32(launch.width), i32(launch.k), addr(out),
    )  # fmt: skip
    return out, counts


@pytest.mark.parametrize(
    "dtype,shape",
    [
        (torch.bfloat16, (513, 301)),  # ragged: no segment starts on an 8-byte boundary
        (torch.float16, (200, 97)),
        (torch.float32, (123, 45)),
        (torch.float8_e4m3fn, (257, 129)),
        (torch.float8_e5m2, (64, 33)),
    ],
    ids=str,
)
def test_kernels_match_the_cpu_decoder(shim, dtype, shape):
    g = torch.Generator().manual_seed(1)
    tensor = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    for k in LAYOUTS[dtype].candidate_ks():
        encoded = encode_tensor(tensor, "w", k=k)
        out, counts = run_kernels(shim, encoded)
        expected = decode_tensor(encoded).view(LAYOUTS[dtype].int_dtype).reshape(-1)
        assert np.array_equal(out.view(expected.numpy().dtype), expected.numpy()), k
        first = np.cumsum(counts) - counts
        assert np.array_equal(first[::SEGS_PER_BLOCK], encoded.planes.block_first.numpy())


def test_kernels_stay_in_bounds_on_a_corrupt_stream(shim):
    # Same damage as tests/gpu/test_codec_gpu.py::test_corrupt_stream_is_caught_on_the_gpu.
    g = torch.Generator().manual_seed(7)
    tensor = (torch.randn(300, 200, generator=g) * 0.02).to(torch.bfloat16)
    encoded = encode_tensor(tensor, "w")
    encoded.planes.stream[100:140] = torch.arange(40, dtype=torch.uint8) * 37
    out, counts = run_kernels(shim, encoded)  # the decode guard keeps writes inside `out`
    first = np.cumsum(counts) - counts
    # The host check that kernels/cuda/codec_decode.py runs catches the damage.
    index_ok = np.array_equal(first[::SEGS_PER_BLOCK], encoded.planes.block_first.numpy())
    assert not (index_ok and first[-1] + counts[-1] == tensor.numel())
