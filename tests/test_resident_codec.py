"""EngineConfig.resident_codec (shared/models/resident.py): a compressed folder's decoder-layer
linears stay encoded and are decoded into shared scratch before each layer, bit for bit: the
same greedy tokens and logprobs as the ordinary load (float32, bf16, a mixture of experts);
their bytes are the planes' plus one layer's scratch; what it cannot run with is refused,
naming the field."""

import pytest
import torch
from gpu.gpu_testing import gpu_ready

from shared.codec import CompressedCheckpoint, compress_dir, encode_tensor
from shared.codec.resident import FixedDecode
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.errors import InvalidRequestError, ModelFolderError
from shared.models.resident import ResidentLayer, weight_bytes
from shared.sampling.params import SamplingParams

from quant_helpers import is_linear, save_bf16

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "東京 🙂"]
PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tiny_model_factory, tmp_path_factory):
    """name -> (plain folder, compressed folder, dtype): a 4-layer tiny Llama in float32 and
    bf16 (test_codec_model.py's), a tiny Mixtral in float32."""
    f32 = tiny_model_factory("llama", num_hidden_layers=4, intermediate_size=256)
    tmp = tmp_path_factory.mktemp("resident")
    plain = {
        "float32": (f32, "float32"),
        "bfloat16": (save_bf16(f32, tmp / "bf16"), "bfloat16"),
        "mixtral": (tiny_model_factory("mixtral"), "float32"),
    }
    made = {}
    for name, (folder, dtype) in plain.items():
        compress_dir(folder, tmp / f"{name}-compressed")
        made[name] = folder, tmp / f"{name}-compressed", dtype
    return made


def _generate(folder, dtype: str, prompt_rows: bool = True, **options):
    """(outputs, model); prompt_rows False: prompts take prefill attention even where the fused
    decoder would take their tokens as rows (batch.prefills_as_rows), as a model that is never
    fused, a resident one, always does."""
    with LLM(folder, dtype=dtype, **options) as llm:
        if not prompt_rows:
            llm.engine.model.model.fused_rows = 0
        return llm.generate(PROMPTS, PARAMS), llm.engine.model


@pytest.mark.parametrize("name", ["float32", "bfloat16", "mixtral"])
def test_same_tokens_and_logprobs_as_the_ordinary_load(folders, name):
    _, packed, dtype = folders[name]
    ref, _ = _generate(packed, dtype, prompt_rows=False)  # the same steps, fused or not
    out, model = _generate(packed, dtype, resident_codec=True)
    assert all(isinstance(layer, ResidentLayer) for layer in model.model.layers)
    assert model.model.fused is None  # decode_layer.c would read every layer's weights at once
    assert model.model.fused_rows == 0
    for a, b in zip(ref, out):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_linears_take_their_planes_and_one_layers_scratch(folders, name):
    _, packed, dtype = folders[name]
    _, normal = _generate(packed, dtype)
    _, model = _generate(packed, dtype, resident_codec=True)
    checkpoint = CompressedCheckpoint(packed)
    linears = [n for n in checkpoint.names() if ".layers." in n and is_linear(n)]
    planes = sum(checkpoint.get_encoded(n).stored_nbytes() for n in linears)
    raw = sum(checkpoint.get_encoded(n).original_nbytes() for n in linears)
    checkpoint.close()
    used, before = weight_bytes(model), weight_bytes(normal)
    assert used.encoded == planes < raw
    assert used.scratch == raw // model.config.num_layers  # one layer's, shared by all
    assert used.other + raw == before.total  # all else as loaded before
    if name == "bfloat16":  # float32's random mantissas barely compress
        assert used.total < before.total


def test_refused_shapes_name_the_field(folders, tiny_model_factory):
    plain, packed, _ = folders["float32"]
    refused = [
        ("resident_codec", dict(model_dir=packed, tp=2, allow_oversubscribe=True)),
        ("resident_codec", dict(model_dir=packed, pp=2, allow_oversubscribe=True)),
        ("decode_graphs", dict(model_dir=packed, decode_graphs="on")),
        ("resident_codec", dict(model_dir=plain)),  # not compressed
    ]
    for field, options in refused:
        with pytest.raises(InvalidRequestError) as e:
            EngineConfig(resident_codec=True, **options)
        assert e.value.field == field, options
    with pytest.raises(InvalidRequestError) as e:  # decoding converts nothing
        LLM(packed, dtype="bfloat16", resident_codec=True)
    assert e.value.field == "dtype"
    assert not EngineConfig(model_dir=packed, resident_codec=True).uses_graphs


def test_fixed_decode_writes_each_tensor_into_its_block_and_catches_bad_planes():
    g = torch.Generator().manual_seed(0)
    small = torch.randn(40, 20, generator=g).to(torch.bfloat16)  # under 1024 elements: raw
    large = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    encoded = [encode_tensor(small, "small"), encode_tensor(large, "large")]
    assert [e.encoding for e in encoded] == ["raw", "huffman"]
    buffer = torch.zeros(small.numel() + large.numel(), dtype=torch.bfloat16)
    outs = [buffer[:800].view(40, 20), buffer[800:].view(64, 64)]
    decode = FixedDecode(list(zip(encoded, outs)))
    with torch.inference_mode():
        decode()
    assert torch.equal(outs[0], small) and torch.equal(outs[1], large)
    assert decode.nbytes() == sum(e.stored_nbytes() for e in encoded)
    encoded[1].planes.block_first[-1] += 1  # the stream no longer lands on its index
    with pytest.raises(ModelFolderError, match="'large'"):
        decode()
    with pytest.raises(ValueError, match="cannot decode into"):
        FixedDecode([(encoded[1], outs[0])])


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs cupy and a CUDA device")
def test_same_tokens_on_a_gpu(folders):
    _, packed, dtype = folders["bfloat16"]
    ref, _ = _generate(packed, dtype, device="cuda")
    out, model = _generate(packed, dtype, device="cuda", resident_codec=True)
    assert isinstance(model.model.layers[0], ResidentLayer)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    for a, b in zip(ref, out):
        assert a.logprobs == b.logprobs
