"""The KV pool tensor of one worker rank, in process memory or in shared memory (/dev/shm)
so that a prefill worker on the same host can write pages into it directly."""

from pathlib import Path

import torch

from shared.kv.spec import MHAKVSpec


class KVCache:
    """Owns the pool tensor (L, 2, P, S, nkv, hd); `layer(i)` is the (2, P, S, nkv, hd) view."""

    def __init__(self, spec: MHAKVSpec, num_pages: int, shm_path: str | Path | None = None):
        self.spec = spec
        self.num_pages = num_pages
        self.shm_path = Path(shm_path) if shm_path else None
        shape = spec.pool_shape(num_pages)
        if self.shm_path is None:
            self.data = torch.zeros(shape, dtype=spec.dtype)
        else:
            numel = 1
            for d in shape:
                numel *= d
            # shared=True maps the file MAP_SHARED: writes by any process are seen by all
            self.data = torch.from_file(
                str(self.shm_path), shared=True, size=numel, dtype=spec.dtype
            )
            self.data = self.data.view(shape)

    def layer(self, index: int) -> torch.Tensor:
        return self.data[index]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def close(self) -> None:
        """Unlinks the shared-memory file (owner only); mappings stay valid until dropped."""
        if self.shm_path is not None and self.shm_path.exists():
            self.shm_path.unlink()
