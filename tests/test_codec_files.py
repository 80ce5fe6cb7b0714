"""Compressed files against bad input: truncation, corrupted planes, checksum mismatches,
unknown format versions. Every case raises ModelFolderError naming the file and the
tensor; none returns wrong weights."""

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shared.codec import CompressedCheckpoint, compress_dir, is_compressed_dir
from shared.codec.container import MANIFEST, PLANE_SEP
from shared.errors import ModelFolderError

CODED = "model.layers.0.mlp.up_proj.weight"


def make_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        CODED: (torch.randn(160, 96, generator=g) * 0.02).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": (torch.randn(96, 160, generator=g) * 0.02).to(
            torch.bfloat16
        ),
        "model.norm.weight": torch.ones(96, dtype=torch.bfloat16),
        "position_ids": torch.arange(64).reshape(1, 64),
    }


@pytest.fixture
def compressed(tmp_path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    save_file(make_tensors(), str(src / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    compress_dir(src, out)
    return out


def data_range(path: Path, key: str) -> tuple[int, int]:
    """Byte range of a stored tensor inside a safetensors file."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + header_len])[key]["data_offsets"]
    return 8 + header_len + begin, 8 + header_len + end


def corrupt_bytes(path: Path, key: str, count: int = 3) -> None:
    begin, end = data_range(path, key)
    raw = bytearray(path.read_bytes())
    middle = (begin + end) // 2 - count // 2
    for i in range(middle, middle + count):
        raw[i] ^= 0x5A
    path.write_bytes(bytes(raw))


def rewrite(path: Path, edit_metadata) -> None:
    """Rewrites a safetensors file with edited header metadata."""
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = edit_metadata(dict(f.metadata()))
    save_file(tensors, str(path), metadata=metadata)


def assert_names_file_and_tensor(error: pytest.ExceptionInfo, path: Path, tensor: str) -> None:
    assert error.value.path == str(path)
    assert tensor in str(error.value)


def test_reads_back_every_tensor(compressed):
    assert is_compressed_dir(compressed)
    ckpt = CompressedCheckpoint(compressed)
    original = make_tensors()
    assert sorted(ckpt.names()) == sorted(original)
    for name, tensor in original.items():
        got = ckpt.get(name)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor)
        assert ckpt.get_encoded(name).name == name
    ckpt.close()


def test_reads_many_tensors_in_one_call(compressed):
    original = make_tensors()
    ckpt = CompressedCheckpoint(compressed, num_threads=2)
    for name, got in zip(original, ckpt.get_many(list(original))):
        assert got.dtype == original[name].dtype and torch.equal(got, original[name])


@pytest.mark.parametrize("plane", ["stream", "raw", "lengths", "block_first"])
@pytest.mark.parametrize("many", [False, True])
def test_corrupt_plane_is_caught_when_decoding(compressed, plane, many):
    shard = compressed / "model.tison"
    corrupt_bytes(shard, f"{CODED}{PLANE_SEP}{plane}", count=1 if plane == "lengths" else 3)
    ckpt = CompressedCheckpoint(compressed)
    with pytest.raises(ModelFolderError) as error:
        ckpt.get_many(list(make_tensors())) if many else ckpt.get(CODED)
    assert_names_file_and_tensor(error, shard, CODED)


@pytest.mark.parametrize("plane", ["stream", "raw", "gaps", "block_first"])
def test_corrupt_plane_is_caught_before_device_decoding(compressed, plane):
    shard = compressed / "model.tison"
    corrupt_bytes(shard, f"{CODED}{PLANE_SEP}{plane}", count=1)
    with pytest.raises(ModelFolderError) as error:
        CompressedCheckpoint(compressed).get_encoded(CODED)
    assert_names_file_and_tensor(error, shard, CODED)


def test_corrupt_raw_tensor_is_caught(compressed):
    shard = compressed / "model.tison"
    corrupt_bytes(shard, "model.norm.weight")
    with pytest.raises(ModelFolderError, match="checksum mismatch") as error:
        CompressedCheckpoint(compressed).get("model.norm.weight")
    assert_names_file_and_tensor(error, shard, "model.norm.weight")


def test_checksum_mismatch(compressed):
    shard = compressed / "model.tison"

    def wrong_crc(metadata):
        entries = json.loads(metadata["tensors"])
        entries[CODED]["crc32c"] ^= 1
        return {**metadata, "tensors": json.dumps(entries)}

    rewrite(shard, wrong_crc)
    with pytest.raises(ModelFolderError, match="checksum mismatch") as error:
        CompressedCheckpoint(compressed).get(CODED)
    assert_names_file_and_tensor(error, shard, CODED)


@pytest.mark.parametrize("cut", [0.5, 0.99])
def test_truncated_shard(compressed, cut):
    shard = compressed / "model.tison"
    raw = shard.read_bytes()
    shard.write_bytes(raw[: int(len(raw) * cut)])
    with pytest.raises(ModelFolderError) as error:
        CompressedCheckpoint(compressed).get(CODED)
    assert_names_file_and_tensor(error, shard, CODED)


@pytest.mark.parametrize("version", ["1", "3"])
def test_unknown_shard_version(compressed, version):
    # Version 1 (zlib's CRC-32 checksums) is no longer read: recompress such folders.
    shard = compressed / "model.tison"
    rewrite(shard, lambda metadata: {**metadata, "version": version})
    with pytest.raises(ModelFolderError, match=f"version '{version}' is not supported") as error:
        CompressedCheckpoint(compressed).get(CODED)
    assert_names_file_and_tensor(error, shard, CODED)


def test_unknown_encoding(compressed):
    shard = compressed / "model.tison"

    def strange(metadata):
        entries = json.loads(metadata["tensors"])
        entries[CODED]["encoding"] = "arithmetic"
        return {**metadata, "tensors": json.dumps(entries)}

    rewrite(shard, strange)
    with pytest.raises(ModelFolderError, match="arithmetic") as error:
        CompressedCheckpoint(compressed).get(CODED)
    assert_names_file_and_tensor(error, shard, CODED)


def test_unknown_manifest_version(compressed):
    manifest = compressed / MANIFEST
    body = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**body, "version": 99}))
    with pytest.raises(ModelFolderError, match="version 99") as error:
        CompressedCheckpoint(compressed)
    assert error.value.path == str(manifest)


def test_missing_tensor_is_named(compressed):
    with pytest.raises(ModelFolderError, match="no tensor 'lm_head.weight'"):
        CompressedCheckpoint(compressed).get("lm_head.weight")
