"""The codec on Tison's own trained default model: the packaged BF16 folder compresses, loads
transparently, and every tensor comes back bit for bit."""

import torch
from safetensors.torch import load_file

from shared.codec import CompressedCheckpoint, compress_dir
from shared.default_model import default_model_dir


def test_default_model_round_trips_and_shrinks(tmp_path):
    src = default_model_dir()
    out = tmp_path / "compressed"
    compress_dir(src, out)
    original = load_file(src / "model.safetensors")
    packed = CompressedCheckpoint(out)
    try:
        assert sorted(packed.names()) == sorted(original)
        for name, tensor in original.items():
            back = packed.get(name)
            assert back.dtype == tensor.dtype and back.shape == tensor.shape
            assert back.view(torch.int16).equal(tensor.view(torch.int16)), name  # bit for bit
    finally:
        packed.close()
    stored = sum(f.stat().st_size for f in out.glob("*.tison"))
    assert stored < 0.75 * (src / "model.safetensors").stat().st_size  # trained weights: >25% saved
