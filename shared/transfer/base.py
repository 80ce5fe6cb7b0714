"""KV handoff between a prefill and a decode worker: what moves, and the transport interface.

Pages move as token slots (page * page_size + offset) of one layer at a time: the prefill rank
sends each layer as soon as its forward pass has written it, the KV of the units (heads) it
holds. Transports move opaque payloads; the layout's spec (shared/kv/spec.py) reads and writes
them, and the decode worker's `KVPool` (shared/protocol.py) says which of its ranks holds what."""

import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from shared.protocol import KVPool


def host_id() -> str:
    """Same value on every process of one boot of one machine: shared memory is reachable."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}-{boot.read_text().strip() if boot.exists() else ''}"


@dataclass(frozen=True)
class KVTarget:
    """Where one request's KV goes: the decode worker's reserved pages, and how."""

    request_id: str
    page_ids: tuple[int, ...]  # decode pages, in token order
    pool: KVPool  # the decode worker's pool (DecodeAssignReplyMsg.kv)
    transport: str  # the sender that reaches it (shm | tcp | dist | cuda_ipc)
    # the decode worker's capped chunked layers (KVRankPool.kv_groups): their pages, one
    # list a page group, logical pages chunk_first_page on; only the tokens from that page on
    # go there
    chunk_page_ids: tuple[tuple[int, ...], ...] = ()
    chunk_first_page: int = 0

    @cached_property
    def groups(self) -> dict[int, int]:
        """Global layer -> its page group where the decode worker caps it (k >= 1: its KV goes
        to chunk_page_ids[k - 1]); layers absent go to page_ids."""
        groups = {}
        for rank in self.pool.ranks:
            for i, group in enumerate(rank.kv_groups):
                if group:
                    groups[rank.layers[0] + i] = group
        return groups


@dataclass(frozen=True)
class LayerKV:
    """What moves: the KV of some tokens of one layer, of the units one prefill rank holds."""

    layer: int  # global layer
    units: tuple[int, int]  # [first, end) global units (MHA: KV heads)
    slots: torch.Tensor  # (n,) int64 destination slots
    payload: torch.Tensor  # a spec's `read` of those tokens and units


class KVSender(ABC):
    """Prefill side of one transport. Called from a prefill rank's step thread."""

    @abstractmethod
    def send_layer(self, target: KVTarget, kv: LayerKV) -> int:
        """Writes kv into every decode rank holding some of its units; returns bytes moved."""

    @abstractmethod
    def finish(self, target: KVTarget) -> None:
        """Returns once every byte sent for the request is in the decode worker's pool."""

    @abstractmethod
    def close(self) -> None:
        """Releases connections and mappings."""
