"""Quantized checkpoints in the exact on-disk layout of DeepSeek-V3 (FP8, 128x128 block
scales) and Kimi K2.5 (compressed-tensors INT4 pack-quantized, groups of 32), written from
tiny random models (quant_helpers.py): loaded weights equal the reference dequantization bit
for bit at TP ranks 0 and 1 of 2, greedy generation equals transformers on the dequantized
weights, bad folders fail naming the tensor or field, `tison inspect` shows the scheme, and a
codec round trip loads identically. A [16, 16] FP8 block over dims that are not multiples of
16 (intermediate 120) leaves partial blocks and TP shards starting inside a block; Qwen3-MoE's
experts (intermediate 32) give TP shards starting inside an INT4 group."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.cli import main
from shared.checkpoint import Checkpoint
from shared.codec import compress_dir
from shared.engine.llm import LLM
from shared.errors import ModelFolderError
from shared.models.config import ModelConfig
from shared.models.loader import load_model
from shared.models.quant import QuantizedCheckpoint, fp8, open_checkpoint, read_scheme
from shared.parallel.group import TPGroup
from shared.sampling.params import SamplingParams

from engine_helpers import hf_greedy, make_prompts
from quant_helpers import int4_config, is_linear, quantize_fp8, quantize_int4, save_plain

CONFIGS = Path(__file__).parent / "fixtures" / "configs"  # the real models' config.json
KIMI_IGNORE = json.loads((CONFIGS / "kimi-k2.5.json").read_text())["quantization_config"]["ignore"]
# name -> (family, overrides, quantizer, its options)
CASES = {
    "llama-fp8": ("llama", {}, quantize_fp8, {}),
    "llama-fp8-block16": ("llama", dict(intermediate_size=120), quantize_fp8, dict(block=(16, 16))),
    "mixtral-fp8-block16": ("mixtral", {}, quantize_fp8, dict(block=(16, 24))),
    "llama-int4": ("llama", {}, quantize_int4, {}),
    "qwen3_moe-int4": ("qwen3_moe", {}, quantize_int4, {}),
    # DeepSeek-V3 as its checkpoints are: every linear FP8 (MLA's kv_b_proj, 160 x 16, in
    # partial blocks); Kimi K2.5's: only the routed experts INT4, with its ignore list
    "deepseek_v3-fp8": ("deepseek_v3", {}, quantize_fp8, dict(block=(16, 16))),
    "deepseek_v3-int4": (
        "deepseek_v3",
        {},
        quantize_int4,
        dict(which=lambda n: ".mlp.experts." in n, ignore=KIMI_IGNORE),
    ),
}


@pytest.fixture(scope="module")
def folders(tiny_model_factory, tmp_path_factory):
    """name -> (quantized folder, plain folder of its dequantized weights, those weights)."""
    cache = {}

    def get(name):
        if name not in cache:
            family, overrides, quantize, options = CASES[name]
            if quantize is quantize_int4:  # the reference packing comes from compressed-tensors
                pytest.importorskip("compressed_tensors")
            out = tmp_path_factory.mktemp(name)
            src = tiny_model_factory(family, **overrides)
            reference = quantize(src, out / "quantized", **options)
            plain = save_plain(reference, out / "quantized", out / "plain")
            cache[name] = out / "quantized", plain, reference
        return cache[name]

    return get


def state(model_dir, rank: int, size: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, cfg, dtype, tp=TPGroup(rank, size))
    return dict(model.state_dict())


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp_shards_equal_the_reference_dequantization(folders, name):
    """Each rank's parameters, read through the real column/row-parallel and expert loaders
    (narrowed rows and columns), equal those it loads from the dequantized weights stored
    plain: bit for bit in float32. No collective runs while loading."""
    quantized, plain, _ = folders(name)
    for rank in range(2):
        got, want = state(quantized, rank, 2), state(plain, rank, 2)
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), (rank, key)


@pytest.mark.parametrize("name", ["llama-fp8", "qwen3_moe-int4"])
def test_bf16_loads_round_the_dequantized_weights_once(folders, name):
    """In bf16 the float32 dequantization is rounded once, as the plain float32 folder is."""
    quantized, plain, _ = folders(name)
    got, want = state(quantized, 0, 1, torch.bfloat16), state(plain, 0, 1, torch.bfloat16)
    for key in want:
        assert got[key].dtype == torch.bfloat16 and torch.equal(got[key], want[key]), key


@pytest.mark.parametrize(
    "name", ["llama-fp8-block16", "mixtral-fp8-block16", "llama-int4", "qwen3_moe-int4"]
)
def test_narrow_at_any_offset_equals_the_reference(folders, name):
    """Rows and columns at starts inside a block / group / packed word, dims -2 and -1 too."""
    quantized, _, reference = folders(name)
    checkpoint = open_checkpoint(quantized, json.loads((quantized / "config.json").read_text()))
    assert isinstance(checkpoint, QuantizedCheckpoint)
    assert sorted(checkpoint.names()) == sorted(reference)
    g = torch.Generator().manual_seed(0)
    for tensor in [n for n in reference if is_linear(n)][:12]:
        whole = reference[tensor]
        lazy = checkpoint.get_slice(tensor)
        assert tuple(lazy.shape) == tuple(whole.shape)
        assert torch.equal(lazy.read(), whole) and torch.equal(checkpoint.get(tensor), whole)
        for dim in (0, 1, -2, -1):
            size = whole.shape[dim]
            start = int(torch.randint(0, size - 1, (1,), generator=g))
            length = int(torch.randint(1, size - start + 1, (1,), generator=g))
            assert torch.equal(lazy.narrow(dim, start, length), whole.narrow(dim, start, length))
    checkpoint.close()


@pytest.mark.parametrize(
    "name", ["llama-fp8-block16", "qwen3_moe-int4", "deepseek_v3-fp8", "deepseek_v3-int4"]
)
def test_greedy_equals_transformers_on_the_dequantized_weights(folders, name):
    quantized, plain, _ = folders(name)
    prompts = make_prompts([1, 7, 17, 30])
    refs = hf_greedy(plain, prompts, max_new_tokens=16)
    with LLM(quantized, dtype="float32") as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    assert [o.token_ids for o in outs] == refs


def _rewrite(folder, change) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def _load(folder):
    return load_model(folder, ModelConfig.from_dir(folder), torch.float32)


def _copy(folders, name, tmp_path):
    quantized = folders(name)[0]
    return shutil.copytree(quantized, tmp_path / "bad")


FP8_SCALE = "model.layers.0.mlp.up_proj.weight_scale_inv"
INT4_SCALE = "model.layers.1.self_attn.o_proj.weight_scale"


def test_a_scale_of_the_wrong_shape_names_file_and_tensor(folders, tmp_path):
    bad = _copy(folders, "llama-fp8", tmp_path)
    _rewrite(bad, lambda t: t.update({FP8_SCALE: torch.ones(2, 1)}))
    with pytest.raises(ModelFolderError, match=r"model\.safetensors: tensor 'model\.layers\.0\."
                       r"mlp\.up_proj\.weight': weight_scale_inv is torch\.float32 \(2, 1\), "
                       r"expected float32 \(1, 1\)"):  # fmt: skip
        _load(bad)
    bad = _copy(folders, "llama-int4", tmp_path / "int4")
    _rewrite(bad, lambda t: t.update({INT4_SCALE: t[INT4_SCALE][:, :1].contiguous()}))
    with pytest.raises(ModelFolderError, match=r"o_proj\.weight': weight_scale is .* \(64, 1\), "
                       r"expected a float \(64, 2\)"):  # fmt: skip
        _load(bad)


def test_a_missing_scale_names_the_tensor(folders, tmp_path):
    bad = _copy(folders, "llama-fp8", tmp_path)
    _rewrite(bad, lambda t: t.pop(FP8_SCALE))
    with pytest.raises(ModelFolderError, match=r"up_proj\.weight': float8 weight without its "
                       r"weight_scale_inv"):  # fmt: skip
        _load(bad)
    bad = _copy(folders, "llama-int4", tmp_path / "int4")
    _rewrite(bad, lambda t: t.pop(INT4_SCALE))
    with pytest.raises(ModelFolderError, match=r"o_proj\.weight_packed'.*o_proj\.weight_scale is "
                       r"missing"):  # fmt: skip
        _load(bad)


@pytest.mark.parametrize(
    "change,field",
    [
        (lambda qc: qc.update(quant_method="awq"), "quant_method = 'awq'"),
        (lambda qc: qc.update(fmt="e5m2"), "fmt = 'e5m2'"),
        (lambda qc: qc.update(weight_block_size=None), "weight_block_size = None"),
        (lambda qc: qc.update(activation_scheme="static"), "activation_scheme = 'static'"),
    ],
)
def test_unsupported_fp8_configs_name_the_field(folders, tmp_path, change, field):
    bad = _copy(folders, "llama-fp8", tmp_path)
    config = json.loads((bad / "config.json").read_text())
    change(config["quantization_config"])
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match=rf"config\.json: quantization_config\.{field}"):
        _load(bad)


@pytest.mark.parametrize(
    "weights,field",
    [
        (dict(num_bits=8), "config_groups.group_0.weights.num_bits = 8"),
        (dict(symmetric=False), "config_groups.group_0.weights.symmetric = False"),
        (dict(strategy="channel"), "config_groups.group_0.weights.strategy = 'channel'"),
    ],
)
def test_unsupported_int4_configs_name_the_field(weights, field):
    with pytest.raises(ModelFolderError, match=rf"config\.json: quantization_config\.{field}"):
        read_scheme({"quantization_config": int4_config(**weights)})
    config = dict(int4_config(), format="marlin-24")
    with pytest.raises(ModelFolderError, match=r"quantization_config\.format = 'marlin-24'"):
        read_scheme({"text_config": {"quantization_config": config}})  # Kimi keeps one here


def test_kimi_and_deepseek_configs_read():
    kimi = read_scheme(json.loads((CONFIGS / "kimi-k2.5.json").read_text()))
    assert (kimi.method, kimi.format, kimi.bits, kimi.group_size) == (
        "compressed-tensors", "pack-quantized", 4, 32,
    )  # fmt: skip
    assert "re:.*self_attn.*" in kimi.ignore
    deepseek = read_scheme(json.loads((CONFIGS / "deepseek-v3.json").read_text()))
    assert (deepseek.method, deepseek.bits, deepseek.block) == ("fp8", 8, (128, 128))


def test_inspect_shows_the_scheme_and_bytes(folders, tmp_path, capsys):
    assert main(["inspect", str(folders("llama-int4")[0])]) == 0
    out = capsys.readouterr().out
    assert "quantization: compressed-tensors pack-quantized, int4, group 32, symmetric" in out
    # 14 linears: 4 attention + 3 MLP in 2 layers; int4 + bf16 scales per 32: 3.56x smaller
    assert "quantized linears: 14, stored 41.58 KB, dequantized to bf16 147.46 KB (3.55x)" in out
    assert "unquantized tensors: 7" in out
    assert main(["inspect", str(folders("llama-fp8")[0]), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "quantization: fp8 e4m3, 8 bits, block 128x128, symmetric" in out
    # 128 x 64 fp8 + one float32 scale; 2 bytes a weight in bf16
    assert "model.layers.0.mlp.gate_proj  stored 8.20 KB  bf16 16.38 KB" in out
    assert main(["inspect", str(tmp_path)]) == 2  # no weights at all
    assert "no *.safetensors weights" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["llama-fp8-block16", "qwen3_moe-int4"])
def test_codec_round_trip_loads_identically(folders, tmp_path, capsys, name):
    """FP8 weights Huffman-coded, int32 words stored raw (no float layout fits them); loading
    the compressed folder gives the same float32 weights at each rank."""
    quantized = folders(name)[0]
    records = {r.name: r for r in compress_dir(quantized, tmp_path / "packed")}
    encodings = {r.encoding for n, r in records.items() if n.endswith("weight_packed")}
    encodings |= {f"fp8 {r.encoding}" for r in records.values() if r.dtype == "float8_e4m3fn"}
    assert encodings == ({"fp8 huffman"} if "fp8" in name else {"raw"})
    for rank in range(2):
        got, want = state(tmp_path / "packed", rank, 2), state(quantized, rank, 2)
        for key in want:
            assert torch.equal(got[key], want[key]), (rank, key)
    assert main(["inspect", str(tmp_path / "packed")]) == 0
    out = capsys.readouterr().out
    assert "tensor class" in out and "quantization: " in out and "quantized linears: " in out


def test_fp8_table_conversion_is_torchs_bit_for_bit():
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(16, 16)
    assert torch.equal(fp8.to_float32(every).view(torch.int32), every.float().view(torch.int32))


def test_a_plain_folder_passes_through(tiny_model_factory, capsys):
    folder = tiny_model_factory("llama")
    assert isinstance(open_checkpoint(folder, {}), Checkpoint)
    assert main(["inspect", str(folder)]) == 0
    assert capsys.readouterr().out.startswith("quantization: none\nunquantized tensors: 21, ")
