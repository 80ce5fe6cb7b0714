"""Shared helpers of the engine tests: prompts, HF greedy references, running an engine."""

import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.sampling.params import SamplingParams

from tiny_models import load_hf

PROMPT_LENGTHS = [1, 3, 7, 16, 17, 30, 45, 60]
GREEDY_32 = SamplingParams(temperature=0, max_tokens=32)


def make_prompts(lengths=PROMPT_LENGTHS, seed: int = 0, vocab: int = 384) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(
    model_dir, prompts: list[list[int]], max_new_tokens: int = 32, eos: int = 2
) -> list[list[int]]:
    """transformers generate(do_sample=False), cut after the first EOS (the engine stops there)."""
    hf = load_hf(model_dir)
    refs = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)
        new = out[0, len(p) :].tolist()
        refs.append(new[: new.index(eos) + 1] if eos in new else new)
    return refs


def new_engine(model_dir, **options) -> LLMEngine:
    options.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model_dir=model_dir, **options))


def run_all(engine: LLMEngine, outputs: dict | None = None) -> dict[str, list[int]]:
    outputs = {} if outputs is None else outputs
    while engine.has_unfinished():
        for s in engine.step():
            outputs.setdefault(s.request.request_id, []).extend(s.new_token_ids)
    return outputs
