"""`tison compress / decompress / inspect` on whole folders: tiny model folders (float32
and cast to bfloat16), sharded and nested folders; reading a compressed folder through
CompressedCheckpoint gives every tensor back identical."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from services.cli import main
from shared.codec import CompressedCheckpoint, is_compressed_dir
from shared.codec.container import MANIFEST

TISON = Path(sys.executable).with_name("tison")


def bf16_copy(model_dir: Path, out: Path) -> Path:
    """The model folder with its weights cast to bfloat16."""
    shutil.copytree(model_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    save_file(
        {name: t.to(torch.bfloat16) for name, t in weights.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return out


def sharded_nested(model_dir: Path, out: Path) -> Path:
    """The model split into two shards with an index, plus a sub-folder with its own weights."""
    out.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, out / name)
    weights = load_file(str(model_dir / "model.safetensors"))
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, members in shards.items():
        save_file({n: weights[n].to(torch.bfloat16) for n in members}, str(out / file))
        weight_map.update({n: file for n in members})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text('{"pooling": "mean"}')
    save_file({"dense.weight": torch.randn(64, 64)}, str(out / "1_Pooling" / "model.safetensors"))
    return out


def all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(folder.rglob("*.safetensors")):
        for name, t in load_file(str(path)).items():
            tensors[f"{path.relative_to(folder)}:{name}"] = t
    return tensors


def other_files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and p.suffix not in (".safetensors", ".tison") and p.name != MANIFEST
    }


def assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.fixture(params=["float32", "bfloat16", "sharded"])
def model_dir(request, tiny_llama, tmp_path) -> Path:
    if request.param == "float32":
        return tiny_llama
    if request.param == "bfloat16":
        return bf16_copy(tiny_llama, tmp_path / "bf16")
    return sharded_nested(tiny_llama, tmp_path / "sharded")


def test_compress_decompress_round_trip(model_dir, tmp_path, capsys):
    packed, back = tmp_path / "packed", tmp_path / "back"
    assert main(["compress", str(model_dir), str(packed)]) == 0
    report = capsys.readouterr().out
    assert "model.layers.*.mlp.up_proj.weight" in report and "total" in report
    total_line = report.strip().splitlines()[-1]
    assert float(total_line.split()[-1].rstrip("%")) > 10  # the float weights did shrink
    assert is_compressed_dir(packed) and not list(packed.rglob("*.safetensors"))
    assert other_files(packed) == other_files(model_dir)

    assert main(["decompress", str(packed), str(back)]) == 0
    assert_same_tensors(all_tensors(back), all_tensors(model_dir))
    assert other_files(back) == other_files(model_dir)
    for path in model_dir.rglob("*.safetensors"):
        with (
            safe_open(str(path), "pt") as a,
            safe_open(str(back / path.relative_to(model_dir)), "pt") as b,
        ):
            assert a.metadata() == b.metadata()


def test_compressed_folder_loads_tensor_for_tensor(model_dir, tmp_path):
    packed = tmp_path / "packed"
    assert main(["compress", str(model_dir), str(packed)]) == 0
    ckpt = CompressedCheckpoint(packed)
    original = {}
    for path in model_dir.rglob("*.safetensors"):
        original.update(load_file(str(path)))
    assert sorted(ckpt.names()) == sorted(original)
    for name, tensor in original.items():
        got = ckpt.get(name)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
    ckpt.close()


def test_inspect_lists_tensors(tiny_llama, tmp_path):
    packed = tmp_path / "packed"
    assert main(["compress", str(tiny_llama), str(packed)]) == 0
    result = subprocess.run(
        [str(TISON), "inspect", str(packed), "--tensors"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "model.norm.weight  float32  raw" in result.stdout
    assert "lm_head.weight  float32  huffman" in result.stdout


def test_refuses_bad_folders(tiny_llama, tmp_path, capsys):
    packed = tmp_path / "packed"
    assert main(["compress", str(tiny_llama), str(packed)]) == 0
    assert main(["compress", str(tiny_llama), str(packed)]) == 2  # output not empty
    assert main(["compress", str(packed), str(tmp_path / "again")]) == 2  # already compressed
    assert main(["decompress", str(tiny_llama), str(tmp_path / "plain")]) == 2  # no manifest
    assert main(["compress", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    errors = capsys.readouterr().err
    assert "not empty" in errors and "already compressed" in errors and MANIFEST in errors
