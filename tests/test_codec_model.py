"""A compressed model folder loads transparently: every parameter equals the raw load's bit for
bit (float32 and bf16, a PP stage, a TP rank) and the outputs are identical; the pipelined load
(shared/readahead.py) holds a bounded number of bytes, fails on a corrupt tensor naming the file
and the tensor, and leaves no thread behind."""

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from shared.checkpoint import Checkpoint
from shared.codec import CompressedCheckpoint, compress_dir, is_compressed_dir
from shared.engine.llm import LLM
from shared.errors import ModelFolderError
from shared.models.config import ModelConfig
from shared.models.loader import load_model, load_weights
from shared.parallel.group import TPGroup
from shared.parallel.pipeline import WHOLE_MODEL, PPStage
from shared.readahead import READ_LIMIT_ENV, pipelined, read_header
from shared.sampling.params import SamplingParams

from quant_helpers import save_bf16

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "東京 🙂"]


def test_compressed_bf16_model_gives_identical_logprobs(tiny_llama, tmp_path):
    plain = save_bf16(tiny_llama, tmp_path / "bf16")
    packed = tmp_path / "compressed"
    compress_dir(plain, packed)
    assert is_compressed_dir(packed) and not list(packed.glob("*.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True)
    ref = LLM(plain, dtype="bfloat16").generate(PROMPTS, params)
    out = LLM(packed, dtype="bfloat16").generate(PROMPTS, params)
    for a, b in zip(ref, out):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


@pytest.fixture(scope="module")
def folders(tiny_model_factory, tmp_path_factory):
    """dtype -> (raw folder, compressed folder) of a 4-layer tiny Llama."""
    f32 = tiny_model_factory("llama", num_hidden_layers=4, intermediate_size=256)
    tmp = tmp_path_factory.mktemp("pipelined")
    bf16 = save_bf16(f32, tmp / "bf16")
    made = {}
    for name, plain in (("float32", f32), ("bfloat16", bf16)):
        packed = tmp / f"{name}-compressed"
        compress_dir(plain, packed)
        made[name] = plain, packed
    return made


def _params(folder: Path, dtype: torch.dtype, tp: TPGroup, stage: PPStage) -> dict:
    model = load_model(folder, ModelConfig.from_dir(folder), dtype, tp, stage)
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "tp,stage",
    [
        (TPGroup(), WHOLE_MODEL),
        (TPGroup(), PPStage(rank=1, size=2, start_layer=2, end_layer=4)),  # the last stage
        (TPGroup(1, 2), WHOLE_MODEL),
    ],
    ids=["whole", "pp-stage-2-of-2", "tp-rank-1-of-2"],
)
def test_compressed_load_equals_raw_load_bit_for_bit(folders, dtype, tp, stage):
    plain, packed = folders[dtype]
    ref = _params(plain, getattr(torch, dtype), tp, stage)
    out = _params(packed, getattr(torch, dtype), tp, stage)
    assert ref.keys() == out.keys() and ref
    for name, tensor in ref.items():
        assert torch.equal(tensor.view(torch.uint8), out[name].view(torch.uint8)), name


def test_pipelined_raw_load_equals_the_lazy_one(folders):
    plain, _ = folders["float32"]
    cfg = ModelConfig.from_dir(plain)
    lazy = load_model(plain, cfg, torch.float32)  # reference: tensor by tensor, get_slice
    checkpoint = Checkpoint.open(plain)
    model = type(lazy)(cfg, dtype=torch.float32, tp=TPGroup(), stage=WHOLE_MODEL)
    load_weights(model, _Lazy(checkpoint), WHOLE_MODEL, str(plain))
    for name, tensor in lazy.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


class _Lazy:
    """A checkpoint with names() and get_slice() only (as a peer's may be)."""

    def __init__(self, inner):
        self.names, self.get, self.get_slice = inner.names, inner.get, inner.get_slice


def test_pipelined_load_holds_a_bounded_number_of_bytes(folders):
    _, packed = folders["float32"]
    checkpoint = CompressedCheckpoint(packed)
    names = checkpoint.names()
    seen = []

    def read(name):
        seen.append(name)
        return name

    # a 10-byte budget, 4-byte tensors: the reader stays at most 2 ahead of the caller
    for i, _ in enumerate(pipelined([(n, 4, 4) for n in names], read, list, 10, 4)):
        assert len(seen) <= i + 1 + 2, (i, len(seen))
    assert seen == names


def test_corrupt_tensor_fails_naming_file_and_tensor_and_stops_the_threads(folders, tmp_path):
    _, packed = folders["bfloat16"]
    bad = tmp_path / "bad"
    shutil.copytree(packed, bad)
    shard = next(bad.glob("*.tison"))
    header = read_header(shard)
    victim = "model.layers.2.mlp.down_proj.weight"
    where = header[f"{victim}::stream"]
    data = bytearray(shard.read_bytes())
    data[where.start + where.nbytes // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = set(threading.enumerate())
    with pytest.raises(ModelFolderError) as e:
        load_model(bad, ModelConfig.from_dir(bad), torch.bfloat16)
    assert str(shard) in str(e.value) and victim in str(e.value)
    assert set(threading.enumerate()) <= before  # the pipeline's threads were joined


def test_an_error_while_placing_stops_the_pipeline(folders):
    _, packed = folders["float32"]
    checkpoint = CompressedCheckpoint(packed)
    before = set(threading.enumerate())
    pairs = checkpoint.tensors(checkpoint.names())
    next(pairs)
    pairs.close()  # as load_weights does when a weight_loader raises
    assert set(threading.enumerate()) <= before


def test_a_read_limit_slows_the_reads(monkeypatch, folders):
    plain, _ = folders["float32"]
    nbytes = sum(f.stat().st_size for f in plain.glob("*.safetensors"))
    monkeypatch.setenv(READ_LIMIT_ENV, str(nbytes / 1e6 / 0.3))  # the folder in 0.3 s
    checkpoint = Checkpoint.open(plain)
    start = time.monotonic()
    assert len(list(checkpoint.tensors(checkpoint.names()))) == len(checkpoint.names())
    assert time.monotonic() - start > 0.2


def test_a_raw_file_cut_short_fails_naming_file_and_tensor(folders, tmp_path):
    plain, _ = folders["bfloat16"]
    weights = tmp_path / "model.safetensors"
    shutil.copy(plain / "model.safetensors", weights)
    name, where = max(read_header(weights).items(), key=lambda item: item[1].start)
    checkpoint = Checkpoint({name: weights})
    before = set(threading.enumerate())
    with open(weights, "r+b") as f:  # cut after the checkpoint was opened (and checked)
        f.truncate(where.start + 2)
    with pytest.raises(ModelFolderError) as e:
        list(checkpoint.tensors([name]))
    assert str(weights) in str(e.value) and name in str(e.value) and "truncated" in str(e.value)
    assert set(threading.enumerate()) <= before


def test_a_pp_stage_reads_only_its_layers_tensors(folders, monkeypatch):
    _, packed = folders["bfloat16"]
    asked = []
    tensors = CompressedCheckpoint.tensors

    def spy(self, names, whole=True):
        asked.extend(names)
        return tensors(self, names, whole)

    monkeypatch.setattr(CompressedCheckpoint, "tensors", spy)
    stage = PPStage(rank=1, size=2, start_layer=2, end_layer=4)
    load_model(packed, ModelConfig.from_dir(packed), torch.bfloat16, TPGroup(), stage)
    layers = {int(n.split(".")[2]) for n in asked if n.startswith("model.layers.")}
    assert layers == {2, 3} and "model.norm.weight" in asked


def test_the_pipeline_module_imports_first():
    import subprocess
    import sys

    code = "import shared.readahead, shared.codec.checkpoint"  # no import cycle between them
    root = str(Path(__file__).resolve().parent.parent)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={"PYTHONPATH": root})
