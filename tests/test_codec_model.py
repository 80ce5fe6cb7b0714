"""A compressed model folder loads transparently and the model's outputs are bit-identical."""

import torch

from shared.codec import compress_dir, is_compressed_dir
from shared.engine.llm import LLM
from shared.sampling.params import SamplingParams

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "東京 🙂"]


def test_compressed_bf16_model_gives_identical_logprobs(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    plain = tmp_path / "bf16"
    plain.mkdir()
    for f in tiny_llama.iterdir():
        if f.suffix == ".safetensors":
            tensors = {k: v.to(torch.bfloat16) for k, v in load_file(f).items()}
            save_file(tensors, plain / f.name, metadata={"format": "pt"})
        else:
            (plain / f.name).write_bytes(f.read_bytes())
    packed = tmp_path / "compressed"
    compress_dir(plain, packed)
    assert is_compressed_dir(packed) and not list(packed.glob("*.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True)
    ref = LLM(plain, dtype="bfloat16").generate(PROMPTS, params)
    out = LLM(packed, dtype="bfloat16").generate(PROMPTS, params)
    for a, b in zip(ref, out):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
