"""The codec's CUDA decoder against the CPU decoder on a real GPU (skipped without cupy
or a CUDA device). tests/gpu/check_codec_gpu.py runs the same checks as a script and adds
the throughput measurement."""

import importlib.util
from pathlib import Path

import pytest
import torch
from gpu.gpu_testing import gpu_ready

pytestmark = pytest.mark.gpu


if not gpu_ready():
    pytest.skip("needs cupy and a CUDA device", allow_module_level=True)

_spec = importlib.util.spec_from_file_location(
    "check_codec_gpu", Path(__file__).with_name("check_codec_gpu.py")
)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def test_gpu_decode_is_bit_exact():
    records = check.check_exact("cuda")
    assert records and all(r["exact"] for r in records), [r for r in records if not r["exact"]]


def test_gpu_decode_of_a_large_tensor():
    result = check.measure_throughput("cuda", 1 << 24, repeats=3)
    assert result["exact"], result
    assert result["decode_tb_per_s"] > 0


def test_corrupt_stream_is_caught_on_the_gpu():
    from shared.codec import encode_tensor
    from shared.codec.gpu import decode_on_device
    from shared.errors import ModelFolderError

    # Same damage as tests/test_codec_kernel_cpu.py, where the CPU build of the kernels
    # shows that the counts then contradict the block index.
    g = torch.Generator().manual_seed(7)
    tensor = (torch.randn(300, 200, generator=g) * 0.02).to(torch.bfloat16)
    encoded = encode_tensor(tensor, "w")
    encoded.planes.stream[100:140] = torch.arange(40, dtype=torch.uint8) * 37
    with pytest.raises(ModelFolderError, match="'w'"):
        decode_on_device(encoded.to("cuda"))
