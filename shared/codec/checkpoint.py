"""A compressed model folder read like a plain one: names() and get(name) as in
shared/checkpoint.py's Checkpoint, decoding each tensor when asked for it."""

from collections.abc import Iterator
from contextlib import ExitStack
from importlib.util import find_spec
from pathlib import Path

import torch

from shared.codec.container import MANIFEST, ShardReader, read_manifest
from shared.codec.format import EncodedTensor
from shared.codec.tensor import check_stored, decode_tensor, decode_tensors, full_lengths
from shared.errors import ModelFolderError


def is_compressed_dir(path: str | Path) -> bool:
    """True if `path` is a folder written by `tison compress` (it holds the manifest)."""
    return (Path(path) / MANIFEST).is_file()


class CompressedCheckpoint:
    """Tensor name -> tensor over the shards of a compressed folder. Tensors come back bit
    for bit as they were compressed, checked against their CRC-32C; a corrupt file raises
    ModelFolderError naming the file and the tensor."""

    def __init__(self, path: str | Path, num_threads: int | None = None, verify: bool = True):
        self.path = Path(path)
        self.num_threads = num_threads
        self.verify = verify
        self._shards: dict[str, ShardReader] = {}  # tensor name -> reader of its shard
        for info in read_manifest(self.path):
            reader = ShardReader(self.path / info.file)
            for name in info.tensors:
                self._shards[name] = reader

    def names(self) -> list[str]:
        return list(self._shards)

    def file_of(self, name: str) -> Path:
        """The shard holding the tensor, for errors."""
        return self._reader(name).path

    def meta(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype name, shape) of a tensor, without reading it."""
        return self._reader(name).meta(name)

    def get(self, name: str) -> torch.Tensor:
        """The tensor, decoded on the CPU (checked against the CRC-32C of the original)."""
        encoded = self._reader(name).encoded(name)
        return decode_tensor(encoded, num_threads=self.num_threads, verify=self.verify)

    def get_many(self, names: list[str]) -> list[torch.Tensor]:
        """get() of each name, decoded in one call: small tensors decode side by side on the
        decoder's threads instead of one after another."""
        encoded = [self._reader(name).encoded(name) for name in names]
        return decode_tensors(encoded, num_threads=self.num_threads, verify=self.verify)

    decodes_on_gpus = True  # tensors(device=...) decodes on a GPU device (loader.py asks)

    def tensors(
        self, names: list[str], whole: bool = True, device: torch.device | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of each name, pipelined (shared/readahead.py): a reader thread reads
        the planes in file order, a bounded number of bytes ahead; batches of them decode on
        all threads while the caller places the batch before. Every tensor is decoded whole
        (a TP rank narrows it), so `whole` is ignored. With a CUDA `device`, where cupy
        imports, the planes move there still compressed and are decoded by the codec's CUDA
        kernel (gpu.py): the host moves ~2/3 of the bytes and never decodes; tensors come back
        on that device. Otherwise they are decoded on the CPU."""
        # here, not at the top: shared.readahead reads shared.codec.format, whose package
        # imports this module
        from shared.readahead import (
            ReadLimit,
            as_stored,
            open_fd,
            pipelined,
            pread_tensor,
            read_header,
        )

        on_gpu = device is not None and device.type == "cuda" and find_spec("cupy") is not None
        readers = {name: self._reader(name) for name in names}
        stored = {r.path: read_header(r.path) for r in set(readers.values())}
        jobs, parts = [], {}
        for name, reader in readers.items():
            parts[name], decoded = reader.stored_names(name)
            where = [stored[reader.path].get(part) for part in parts[name]]
            if None in where:
                missing = parts[name][where.index(None)]
                raise ModelFolderError(str(reader.path), f"tensor {name!r}: no {missing!r}")
            read_bytes = sum(w.nbytes for w in where)
            jobs.append((str(reader.path), where[0].start, name, read_bytes, decoded))
        jobs.sort()
        limit = ReadLimit.from_env()
        with ExitStack() as files:
            fds = {path: open_fd(path, files) for path in stored}

            def read(name: str) -> EncodedTensor:
                reader = readers[name]
                path, header = reader.path, stored[reader.path]
                planes = {
                    part: as_stored(pread_tensor(fds[path], header[part], limit, path, part),
                                    header[part], path, part)
                    for part in parts[name]
                }  # fmt: skip
                return reader.encoded(name, planes)

            def decode(batch: list[EncodedTensor]) -> list[torch.Tensor]:
                if on_gpu:
                    return decode_on_gpu(batch, device, self.verify)
                return decode_tensors(batch, num_threads=self.num_threads, verify=self.verify)

            yield from pipelined([(n, r, d) for _, _, n, r, d in jobs], read, decode)

    def get_encoded(self, name: str) -> EncodedTensor:
        """The tensor still compressed (planes on the CPU, checked for size, a valid code
        table and, if verify, their CRC-32C), e.g. to keep it compressed on a device and
        decode it there just in time (gpu.py)."""
        encoded = self._reader(name).encoded(name)
        if encoded.planes is not None:
            full_lengths(encoded)
        if self.verify:
            check_stored(encoded)
        return encoded

    def _reader(self, name: str) -> ShardReader:
        reader = self._shards.get(name)
        if reader is None:
            raise ModelFolderError(str(self.path / MANIFEST), f"no tensor {name!r}")
        return reader

    def close(self) -> None:
        for reader in set(self._shards.values()):
            reader.close()


def decode_on_gpu(
    batch: list[EncodedTensor], device: torch.device, verify: bool
) -> list[torch.Tensor]:
    """Each tensor decoded on the CUDA `device` (on this thread's current stream of it). What
    is checked, if verify: the stored planes' CRC-32C, on the host before they move (the CPU
    decoder checks its output's instead; the GPU kernel has no CRC). A stream that contradicts
    its block index raises ModelFolderError either way."""
    from shared.codec.gpu import decode_on_device  # kernels.cuda: imported where a GPU decodes

    out = []
    with torch.cuda.device(device):
        for encoded in batch:
            if verify:
                check_stored(encoded)
            out.append(decode_on_device(encoded.to(device)))
    return out
