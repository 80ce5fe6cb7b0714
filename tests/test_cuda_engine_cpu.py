"""The engine's GPU code path, run on the CPU: the CUDA kernels (kernels/cuda/) execute under
the host emulation (tests/gpu/host_runtime.py), the C kernels are off, and the engine takes the
CUDA attention backend and the layers the CUDA norm, RoPE and SiLU kernels, exactly as on a
GPU, through decode graphs' static buffers. Greedy tokens and float32 logprobs match
transformers: the kernels, their wrappers and their wiring into the engine, without a GPU."""

import pytest

from kernels.cpu import library
from kernels.cuda import runtime
from kernels.cuda.attention import mla_decode, paged_decode
from shared.models.layers import attention_backend, latent_attention
from shared.sampling.params import SamplingParams

from engine_helpers import assert_logprobs_match, new_engine, reference_getter, run_staggered

host_runtime = pytest.importorskip("gpu.host_runtime")
if host_runtime.compiler() is None:
    pytest.skip("no C++ compiler", allow_module_level=True)

LENGTHS = [1, 7, 17, 30]
PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=5)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """The CUDA kernels on the CPU for this module's tests; the C kernels off."""
    backend = host_runtime.HostBackend(tmp_path_factory.mktemp("cuda-host"))
    previous = runtime.use_backend(backend)
    patch = pytest.MonkeyPatch()
    patch.setattr(library, "usable", lambda x: False)
    yield backend
    patch.undo()
    runtime.use_backend(previous)


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    return reference_getter(tiny_model_factory, LENGTHS, max_new_tokens=8)


def count_mla_decodes(monkeypatch) -> list[int]:
    """Rows each CUDA MLA decode launch took, from now on in the test."""
    rows: list[int] = []

    def counted(q_latent, *args, **kwargs):
        rows.append(q_latent.shape[0])
        return mla_decode(q_latent, *args, **kwargs)

    monkeypatch.setattr(latent_attention.cuda_attention, "mla_decode", counted)
    return rows


def count_decodes(monkeypatch) -> list[int]:
    """Rows each CUDA decode-attention launch took, from now on in the test."""
    rows: list[int] = []

    def counted(q, *args, **kwargs):
        rows.append(q.shape[0])
        return paged_decode(q, *args, **kwargs)

    monkeypatch.setattr(attention_backend.cuda_attention, "paged_decode", counted)
    return rows


@pytest.mark.parametrize(
    "family,graphs", [("llama", "on"), ("llama", "off"), ("deepseek_v3", "on")]
)
def test_the_gpu_path_equals_transformers(host, reference, monkeypatch, family, graphs):
    """Dense GQA layers, and MLA ones (the latent write and absorbed decode kernels)."""
    model_dir, prompts, refs, logits = reference(family)
    rows = count_decodes(monkeypatch)
    mla_rows = count_mla_decodes(monkeypatch)
    engine = new_engine(
        model_dir, attention_backend="cuda", decode_graphs=graphs, max_num_seqs=4, num_pages=64
    )
    try:
        if family == "llama":
            layers = engine.model.model.layers
            assert {layer.self_attn.attn.backend.name for layer in layers} == {"cuda"}
        reqs = run_staggered(engine, prompts, PARAMS)
    finally:
        engine.close()
    for req, tokens, lg in zip(reqs, refs, logits):
        assert_logprobs_match(req, tokens[: len(req.output_token_ids)], lg[: len(tokens)])
    ran = rows if family == "llama" else mla_rows
    assert ran  # the CUDA decode kernel ran (under graphs: at padded sizes, 1, 2, 4)
    if graphs == "on":
        assert set(ran) <= {1, 2, 4}
