"""Compress and decompress whole folders of safetensors files (model folders or not).
Every other file (config, tokenizer, index, ...) is copied as is, so a compressed model
folder keeps working as a model folder through CompressedCheckpoint."""

import math
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from shared.codec.container import (
    MANIFEST,
    SHARD_SUFFIX,
    ShardInfo,
    ShardReader,
    read_manifest,
    shard_name,
    write_manifest,
    write_shard,
)
from shared.codec.format import EncodedTensor
from shared.codec.many import encode_lazily
from shared.codec.tensor import decode_tensor
from shared.errors import ModelFolderError


@dataclass(frozen=True)
class TensorRecord:
    """What compression did to one tensor."""

    name: str
    dtype: str
    encoding: str  # "huffman" or "raw"
    original_bytes: int
    stored_bytes: int
    shape: tuple[int, ...] = ()


OnTensor = Callable[[TensorRecord], None]


def tensor_class(name: str) -> str:
    """Groups a tensor with its siblings in other layers or experts: numbers between dots
    become `*` (`model.layers.3.mlp.experts.7.w1` -> `model.layers.*.mlp.experts.*.w1`)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files under `folder`, relative to it, in a stable order."""
    return sorted(p.relative_to(folder) for p in folder.rglob("*.safetensors") if p.is_file())


def total_tensor_bytes(folder: Path) -> int:
    """Bytes of all tensors in the folder's safetensors files (read from their headers)."""
    total = 0
    for rel in safetensors_files(folder):
        with safe_open(str(folder / rel), framework="pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                numel = 1
                for d in t.get_shape():
                    numel *= d
                total += numel * itemsize(t.get_dtype())
    return total


def compress_dir(
    in_dir: Path, out_dir: Path, on_tensor: OnTensor | None = None, num_threads: int | None = None
) -> list[TensorRecord]:
    """Writes the compressed form of in_dir into out_dir (created; must not hold files), on
    up to num_threads threads (default: default_threads()), file by file (many.py)."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    if (in_dir / MANIFEST).exists():
        raise ModelFolderError(str(in_dir / MANIFEST), "folder is already compressed")
    files = safetensors_files(in_dir)
    if not files:
        raise ModelFolderError(str(in_dir), "no *.safetensors files to compress")
    _prepare_out(out_dir)
    records: list[TensorRecord] = []
    shards = []
    for rel in files:
        encoded, metadata = _encode_file(in_dir / rel, num_threads, records, on_tensor)
        target = out_dir / shard_name(str(rel))
        target.parent.mkdir(parents=True, exist_ok=True)
        write_shard(target, encoded, metadata)
        shards.append(ShardInfo(shard_name(str(rel)), str(rel), tuple(e.name for e in encoded)))
    _copy_others(in_dir, out_dir, skip=lambda p: p.suffix == ".safetensors")
    write_manifest(out_dir, shards)
    return records


def decompress_dir(
    in_dir: Path, out_dir: Path, on_tensor: OnTensor | None = None, num_threads: int | None = None
) -> list[TensorRecord]:
    """Writes plain safetensors files again, tensor for tensor identical to the originals."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    shards = read_manifest(in_dir)
    _prepare_out(out_dir)
    records = []
    for info in shards:
        reader = ShardReader(in_dir / info.file)
        tensors = {}
        for name in info.tensors:
            enc = reader.encoded(name)
            tensors[name] = decode_tensor(enc, num_threads=num_threads)
            records.append(_record(enc))
            if on_tensor is not None:
                on_tensor(records[-1])
        target = out_dir / info.original
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(target), metadata=reader.original_metadata)
        reader.close()
    _copy_others(in_dir, out_dir, skip=lambda p: p.suffix == SHARD_SUFFIX or p.name == MANIFEST)
    return records


def inspect_dir(folder: Path) -> list[TensorRecord]:
    """What each stored tensor costs, without decoding anything."""
    records = []
    for info in read_manifest(Path(folder)):
        reader = ShardReader(Path(folder) / info.file)
        records.extend(_record(reader.encoded(name)) for name in info.tensors)
        reader.close()
    return records


def _encode_file(path: Path, threads: int, records: list, on_tensor: OnTensor | None):
    try:
        handle = safe_open(str(path), framework="pt")
        names = list(handle.keys())
        metadata = handle.metadata()
    except Exception as e:
        raise ModelFolderError(str(path), f"not a readable safetensors file ({e})") from e

    def num_elements(name: str) -> int:
        return math.prod(handle.get_slice(name).get_shape())

    encoded = []

    def done(enc: EncodedTensor) -> None:
        encoded.append(enc)
        records.append(_record(enc))
        if on_tensor is not None:
            on_tensor(records[-1])

    encode_lazily(names, num_elements, handle.get_tensor, threads, done)
    return encoded, metadata


def _record(enc: EncodedTensor) -> TensorRecord:
    return TensorRecord(
        enc.name, str(enc.dtype).removeprefix("torch."), enc.encoding, enc.original_nbytes(),
        enc.stored_nbytes(), tuple(enc.shape),
    )  # fmt: skip


def _prepare_out(out_dir: Path) -> None:
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ModelFolderError(str(out_dir), "output folder exists and is not empty")
    out_dir.mkdir(parents=True, exist_ok=True)


def _copy_others(in_dir: Path, out_dir: Path, skip: Callable[[Path], bool]) -> None:
    for path in sorted(in_dir.rglob("*")):
        if path.is_file() and not skip(path):
            target = out_dir / path.relative_to(in_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


_ITEMSIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2}
_ITEMSIZES.update({"F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8})
_ITEMSIZES["F64"] = 8


def itemsize(dtype_name: str) -> int:
    """Bytes per element of a safetensors dtype name ("BF16" -> 2; 0 if unknown)."""
    return _ITEMSIZES.get(dtype_name, 0)
