"""The KV pool tensor of one worker rank, in process memory or in shared memory (/dev/shm)
so that a prefill worker on the same host can write pages into it directly."""

import contextlib
import logging
import math
import mmap
import os
from pathlib import Path

import torch

from shared.kv.spec import KVSpec

log = logging.getLogger(__name__)


class KVCache:
    """Owns the pool tensor (its spec's pool_shape); `layer(i)` is the view a layer's attention
    uses (MHA: (2, P, S, nkv, hd))."""

    def __init__(
        self,
        spec: KVSpec,
        num_pages: int,
        shm_path: str | Path | None = None,
        device: torch.device | str = "cpu",  # EngineConfig.device
        shm_optional: bool = False,  # where shm_path has no room: process memory, not an error
    ):
        self.spec = spec
        self.num_pages = num_pages
        self.shm_path = Path(shm_path) if shm_path else None
        self.device = torch.device(device)
        shape = spec.pool_shape(num_pages)
        if self.shm_path is not None and self.device.type != "cpu":
            raise ValueError(f"a KV pool in shared memory is a CPU pool, not one on {device}")
        nbytes = math.prod(shape) * spec.dtype.itemsize
        free = None if self.shm_path is None else free_bytes(self.shm_path.parent)
        if free is not None and nbytes > free:
            # The file is sparse: a page the filesystem had no room for would be a SIGBUS at
            # the first KV write into it, mid-step. So: an error now, or where the pool may
            # live in process memory (a decode worker's own rank: its KV servers write into
            # it in-process), there, and a prefill worker on this host reaches it over TCP
            # (KVHandoff.transport_to looks for the file).
            what = (
                f"a KV pool of {nbytes / 2**20:.0f} MiB does not fit the {free / 2**20:.0f} "
                f"MiB free in {self.shm_path.parent} (a container's /dev/shm is 64 MiB unless "
                "given more: docker run --shm-size, compose shm_size)"
            )
            if not shm_optional:
                raise OSError(f"{what}; or a smaller pool: --kv-cache-bytes, --memory-bytes")
            log.warning("%s: kept in process memory, same-host prefill workers use TCP", what)
            self.shm_path = None
        if self.device.type != "cpu":
            self.data = torch.zeros(shape, dtype=spec.dtype, device=self.device)
        elif self.shm_path is None:
            self.data = zeroed_pages(shape, spec.dtype)
        elif math.prod(shape) == 0:  # no layer here (a stage of capped chunked layers only)
            self.shm_path.touch()  # its file all the same: a peer looks for it
            self.data = torch.zeros(shape, dtype=spec.dtype)
        else:
            # shared=True maps the file MAP_SHARED: writes by any process are seen by all
            self.data = torch.from_file(
                str(self.shm_path), shared=True, size=math.prod(shape), dtype=spec.dtype
            )
            self.data = self.data.view(shape)

    def layer(self, index: int) -> torch.Tensor:
        return self.spec.layer(self.data, index)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def close(self) -> None:
        """Unlinks the shared-memory file (owner only); mappings stay valid until dropped."""
        if self.shm_path is not None and self.shm_path.exists():
            self.shm_path.unlink()


def free_bytes(folder: Path) -> int | None:
    """Bytes an unprivileged process can still write in `folder`'s filesystem; None where it
    cannot be asked (creating a file there then says what is wrong)."""
    try:
        stat = os.statvfs(folder)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def map_pool(path: str | Path, spec: KVSpec) -> torch.Tensor:
    """Another process's pool file, mapped shared (writes land in its pool), shaped by `spec`."""
    if spec.num_layers == 0:  # an empty pool's file (KVCache)
        return torch.zeros(spec.pool_shape(0), dtype=spec.dtype)
    num_pages = spec.pages_in(Path(path).stat().st_size)
    shape = spec.pool_shape(num_pages)
    return torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=spec.dtype).view(
        shape
    )


def zeroed_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor on fresh private anonymous memory, which the kernel zeroes a page at a time
    on first touch: a pool costs nothing until requests use it (torch.zeros wrote all of it
    first: ~0.6 s per GiB). Transparent huge pages where the kernel offers them on request,
    as malloc's would be with `tison`'s glibc.malloc.hugetlb tunable (shared/huge_pages.py)."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE)
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE on this platform
        buf.madvise(mmap.MADV_HUGEPAGE)
    # the tensor holds a reference to buf: the mapping lives as long as the tensor
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)
