"""Compressed files on disk (FORMAT.md): each `.tison` shard is a safetensors file holding
the planes of its tensors plus per-tensor metadata in its header; `tison-codec.json` lists a
folder's shards. Reading never trusts the file: every problem is a ModelFolderError naming
the file and, where one is being read, the tensor."""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shared.codec.format import (
    DTYPE_NAMES,
    DTYPES_BY_NAME,
    FORMAT_NAME,
    FORMAT_VERSION,
    HUFFMAN,
    RAW,
    CodedPlanes,
    EncodedTensor,
)
from shared.errors import ModelFolderError

MANIFEST = "tison-codec.json"
SHARD_SUFFIX = ".tison"
PLANE_SEP = "::"  # a coded tensor `w` is stored as planes `w::stream`, `w::raw`, ...
PLANES = ("stream", "raw", "lengths", "gaps", "block_first")


@dataclass(frozen=True)
class ShardInfo:
    """One compressed shard of a folder, as the manifest lists it."""

    file: str  # path of the .tison file, relative to the folder
    original: str  # path of the safetensors file it came from, relative to the folder
    tensors: tuple[str, ...]  # names of the original tensors it holds


def write_shard(path: Path, tensors: list[EncodedTensor], original_metadata: dict | None) -> None:
    """Writes encoded tensors (in this order) and the original file's metadata to `path`."""
    stored: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    for enc in tensors:
        entry = {"dtype": DTYPE_NAMES[enc.dtype], "shape": list(enc.shape), "crc32c": enc.crc32c}
        if enc.planes is None:
            entry["encoding"] = RAW
            stored[enc.name] = enc.data.contiguous()
        else:
            p = enc.planes
            entry.update(
                encoding=HUFFMAN,
                k=p.k,
                total_bits=p.total_bits,
                first_symbol=p.first_symbol,
                planes_crc32c=p.crc32c,
            )
            for plane, t in p.tensors().items():
                stored[f"{enc.name}{PLANE_SEP}{plane}"] = t.contiguous()
        entries[enc.name] = entry
    metadata = {
        "format": FORMAT_NAME,
        "version": str(FORMAT_VERSION),
        "tensors": json.dumps(entries),
        "original_metadata": json.dumps(original_metadata),
    }
    save_file(stored, str(path), metadata=metadata)


class ShardReader:
    """Reads encoded tensors of one .tison file; opened lazily on first use."""

    def __init__(self, path: Path):
        self.path = path
        self._handle = None
        self._entries: dict[str, dict] = {}
        self.original_metadata: dict | None = None

    def encoded(self, name: str, stored: dict[str, torch.Tensor] | None = None) -> EncodedTensor:
        """The stored form of tensor `name` (planes or raw data, on the CPU), from the file
        or from `stored` (the file's tensors stored_names(name), read by the caller)."""
        entry = self._entry(name)
        get = self._handle.get_tensor if stored is None else stored.__getitem__
        try:
            return self._build(name, entry, get)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise self._error(name, f"invalid entry or planes ({e})") from e
        except Exception as e:  # safetensors' own error types on truncated data
            raise self._error(name, f"unreadable ({e})") from e

    def meta(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype name, shape) of tensor `name`, from the header alone."""
        entry = self._entry(name)
        try:
            return str(entry["dtype"]), tuple(int(d) for d in entry["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise self._error(name, f"invalid entry ({e})") from e

    def stored_names(self, name: str) -> tuple[list[str], int]:
        """(the file's tensors that hold tensor `name`: itself if raw, else its planes; the
        bytes it decodes to)."""
        entry = self._entry(name)
        try:
            numel = 1
            for d in entry["shape"]:
                numel *= int(d)
            nbytes = numel * DTYPES_BY_NAME[entry["dtype"]].itemsize
            coded = entry["encoding"] != RAW
        except (KeyError, TypeError, ValueError) as e:
            raise self._error(name, f"invalid entry ({e})") from e
        return [f"{name}{PLANE_SEP}{p}" for p in PLANES] if coded else [name], nbytes

    def _entry(self, name: str) -> dict:
        self._open(name)
        entry = self._entries.get(name)
        if not isinstance(entry, dict):
            raise self._error(name, "not in this file")
        return entry

    def _open(self, name: str) -> None:
        if self._handle is not None:
            return
        try:
            handle = safe_open(str(self.path), framework="pt")
            metadata = handle.metadata() or {}
        except Exception as e:
            raise self._error(name, f"not a readable safetensors file ({e})") from e
        if metadata.get("format") != FORMAT_NAME:
            raise self._error(name, f"not a {FORMAT_NAME} file")
        if metadata.get("version") != str(FORMAT_VERSION):
            version = metadata.get("version")
            raise self._error(
                name, f"format version {version!r} is not supported (reads {FORMAT_VERSION})"
            )
        try:
            self._entries = json.loads(metadata["tensors"])
            self.original_metadata = json.loads(metadata.get("original_metadata", "null"))
            if not isinstance(self._entries, dict):
                raise ValueError("the tensor table is not a JSON object")
        except (KeyError, ValueError) as e:
            raise self._error(name, f"invalid header metadata ({e})") from e
        self._handle = handle

    def _build(self, name: str, entry: dict, get) -> EncodedTensor:
        dtype = DTYPES_BY_NAME[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        crc = int(entry["crc32c"])
        if entry["encoding"] == RAW:
            data = get(name)
            if data.dtype != dtype or tuple(data.shape) != shape:
                raise ValueError(f"stored as {data.dtype}{list(data.shape)}")
            return EncodedTensor(name, str(self.path), dtype, shape, crc, None, data)
        if entry["encoding"] != HUFFMAN:
            raise ValueError(f"unknown encoding {entry['encoding']!r}")
        planes = {p: get(f"{name}{PLANE_SEP}{p}") for p in PLANES}
        coded = CodedPlanes(
            **planes,
            k=int(entry["k"]),
            total_bits=int(entry["total_bits"]),
            first_symbol=int(entry["first_symbol"]),
            crc32c=int(entry["planes_crc32c"]),
        )
        return EncodedTensor(name, str(self.path), dtype, shape, crc, coded, None)

    def _error(self, name: str, problem: str) -> ModelFolderError:
        return ModelFolderError(str(self.path), f"tensor {name!r}: {problem}")

    def close(self) -> None:
        self._handle = None


def write_manifest(folder: Path, shards: list[ShardInfo]) -> None:
    body = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "shards": [
            {"file": s.file, "original": s.original, "tensors": list(s.tensors)} for s in shards
        ],
    }
    (folder / MANIFEST).write_text(json.dumps(body, indent=1) + "\n")


def read_manifest(folder: Path) -> list[ShardInfo]:
    path = folder / MANIFEST
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelFolderError(str(path), f"unreadable ({e})") from e
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        raise ModelFolderError(str(path), f"not a {FORMAT_NAME} manifest")
    if body.get("version") != FORMAT_VERSION:
        raise ModelFolderError(
            str(path),
            f"format version {body.get('version')!r} is not supported (reads {FORMAT_VERSION})",
        )
    try:
        return [
            ShardInfo(str(s["file"]), str(s["original"]), tuple(str(t) for t in s["tensors"]))
            for s in body["shards"]
        ]
    except (KeyError, TypeError) as e:
        raise ModelFolderError(str(path), f"invalid shard list ({e})") from e


def shard_name(original: str) -> str:
    """`sub/model-00001-of-00002.safetensors` -> `sub/model-00001-of-00002.tison`."""
    return str(Path(original).with_suffix(SHARD_SUFFIX))
