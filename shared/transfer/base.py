"""KV handoff between a prefill and a decode worker: what moves, and the transport interface.

Pages move as token slots (page * page_size + offset) of one layer at a time, K and V together:
the prefill worker sends each layer as soon as its forward pass has written it. Transports move
opaque bytes; only the layout string says what they are."""

import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.kv.cache import KVCache


def layout_id(kv: KVCache) -> str:
    """Both sides must agree on this for pages to be copied as they are."""
    s = kv.spec
    return f"mha:L{s.num_layers}:H{s.num_kv_heads}:D{s.head_dim}:S{s.page_size}:{s.dtype}".replace(
        "torch.", ""
    )


def host_id() -> str:
    """Same value on every process of one boot of one machine: shared memory is reachable."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}-{boot.read_text().strip() if boot.exists() else ''}"


def slots(
    page_ids: list[int] | tuple[int, ...], start: int, end: int, page_size: int
) -> torch.Tensor:
    """(end - start,) pool slots of tokens [start, end) of a sequence holding `page_ids`."""
    pos = torch.arange(start, end)
    pages = torch.as_tensor(page_ids, dtype=torch.long)
    return pages[pos // page_size] * page_size + pos % page_size


@dataclass(frozen=True)
class KVTarget:
    """Where one request's KV goes: the decode worker's reserved pages."""

    request_id: str
    page_ids: tuple[int, ...]  # decode pages, in token order
    endpoints: dict[str, str]  # the decode worker's transport endpoints (DecodeAssignReplyMsg)


class KVSender(ABC):
    """Prefill side of one transport. Called from the prefill worker's step thread."""

    @abstractmethod
    def send_layer(
        self, target: KVTarget, layer: int, kv: torch.Tensor, dst_slots: torch.Tensor
    ) -> int:
        """Writes (2, n, nkv, hd) K/V of one layer into dst_slots; returns the bytes moved."""

    @abstractmethod
    def finish(self, target: KVTarget) -> None:
        """Returns once every byte sent for the request is in the decode worker's pool."""

    @abstractmethod
    def close(self) -> None:
        """Releases connections and mappings."""
