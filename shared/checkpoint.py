"""Read the weights of a model folder: model.safetensors, a sharded index, or a Tison-compressed
folder. Tensors are memory-mapped; a rank can read only the slice it owns."""

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from shared.codec.format import DTYPES_BY_NAME
from shared.errors import ModelFolderError
from shared.readahead import ReadLimit, as_stored, open_fd, pipelined, pread_tensor, read_header

INDEX_FILE = "model.safetensors.index.json"


class Checkpoint:
    """Tensor name -> tensor over the safetensors files of one folder."""

    def __init__(self, files: dict[str, Path]):
        self._files = files  # tensor name -> file holding it
        self._handles: dict[Path, object] = {}

    @classmethod
    def open(cls, model_dir: str | Path) -> "Checkpoint":
        """Opens the folder's weights: plain, sharded (index) or compressed."""
        model_dir = Path(model_dir)
        compressed = _open_compressed(model_dir)
        if compressed is not None:
            return compressed
        index = model_dir / INDEX_FILE
        if index.is_file():
            return cls(_files_from_index(index))
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ModelFolderError(
                str(model_dir / "model.safetensors"), "missing (no *.safetensors weights)"
            )
        mapping: dict[str, Path] = {}
        for path in files:
            for name in _open(path).keys():
                mapping[name] = path
        return cls(mapping)

    def names(self) -> list[str]:
        return list(self._files)

    def file_of(self, name: str) -> Path:
        """The file holding the tensor, for errors."""
        return self._files[name]

    def meta(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype name, shape) of a tensor, from its file's header."""
        lazy = self._lazy(name)
        return lazy.get_dtype(), tuple(lazy.get_shape())

    def get(self, name: str) -> torch.Tensor:
        path = self._files[name]
        handle = self._handles.get(path) or self._handles.setdefault(path, _open(path))
        try:
            return handle.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types on truncated data
            raise ModelFolderError(str(path), f"tensor {name!r} unreadable ({e})") from e

    def get_slice(self, name: str) -> "TensorSlice":
        """The tensor, unread: `narrow` reads only the rows or columns asked for."""
        return TensorSlice(self._lazy(name), f"{self._files[name]}: tensor {name!r}")

    def _lazy(self, name: str):
        path = self._files[name]
        handle = self._handles.get(path) or self._handles.setdefault(path, _open(path))
        return handle.get_slice(name)

    def tensors(self, names: list[str], whole: bool = True) -> Iterator[tuple[str, object]]:
        """(name, tensor) of each name, in file order. whole: each tensor read whole by a
        reader thread, a bounded number of bytes ahead of the caller (pipelined in
        shared/readahead.py); else (a TP rank needs only its part) lazy TensorSlices."""
        if not whole:
            yield from ((name, self.get_slice(name)) for name in names)
            return
        paths = sorted({self._files[name] for name in names})
        stored = {path: read_header(path) for path in paths}
        lazy, jobs = [], []
        for name in names:
            where = stored[self._files[name]].get(name)
            if where is None or where.dtype not in DTYPES_BY_NAME:
                lazy.append(name)  # a dtype torch lacks (or not found): the lazy path says why
            else:
                jobs.append((self._files[name], where.start, name, where.nbytes))
        jobs.sort()
        limit = ReadLimit.from_env()
        with ExitStack() as files:
            fds = {path: open_fd(path, files) for path in paths}

            def read(name: str) -> torch.Tensor:
                path = self._files[name]
                where = stored[path][name]
                return as_stored(
                    pread_tensor(fds[path], where, limit, path, name), where, path, name
                )

            yield from pipelined([(n, size, size) for _, _, n, size in jobs], read, list)
        yield from ((name, self.get_slice(name)) for name in lazy)

    def close(self) -> None:
        self._handles.clear()


class TensorSlice:
    """A checkpoint tensor read lazily from its memory-mapped file (a TP rank's shard only)."""

    def __init__(self, lazy, what: str):
        self._lazy = lazy  # safetensors PySafeSlice
        self._what = what
        self.shape = tuple(lazy.get_shape())
        self.dtype = DTYPES_BY_NAME.get(lazy.get_dtype())  # None: a dtype torch lacks

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._read(tuple(index))

    def read(self) -> torch.Tensor:
        return self._read(tuple(slice(None) for _ in self.shape))

    def _read(self, index: tuple) -> torch.Tensor:
        try:
            return self._lazy[index]
        except Exception as e:  # safetensors raises its own error types on truncated data
            raise ModelFolderError(self._what, f"unreadable ({e})") from e


def materialize(tensor) -> torch.Tensor:
    """A whole tensor from a TensorSlice or a tensor."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.read()


def _open_compressed(model_dir: Path):
    from shared.codec import CompressedCheckpoint, is_compressed_dir

    return CompressedCheckpoint(model_dir) if is_compressed_dir(model_dir) else None


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:
        raise ModelFolderError(str(path), f"not a readable safetensors file ({e})") from e


def _files_from_index(index: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelFolderError(str(index), f"not a valid index ({e})") from e
    files = {name: index.parent / fname for name, fname in weight_map.items()}
    for path in set(files.values()):
        if not path.is_file():
            raise ModelFolderError(str(path), f"missing (listed in {INDEX_FILE})")
    return files
