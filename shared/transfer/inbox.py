"""The receiving end of a network KV transport: each frame is checked against the pages
reserved for its request, written into every rank pool of the worker holding part of it
(pools.py) and counted per request, so the decode worker can tell that every prefill rank's
part arrived. The dist server's receiving threads share one inbox (tcp.py's server keeps the
same logic and counts inline)."""

import logging
import math
import threading
import time
from collections.abc import Callable

import torch

from shared.kv.spec import KVSpec
from shared.transfer.base import LayerKV
from shared.transfer.pools import MappedPool, RankOf, request_pools, write_layer

log = logging.getLogger(__name__)


class KVInbox:
    """Writes frames into `pools`; `allowed(request_id, layer, slots)` says whether the slots
    belong to pages reserved for the request (for that layer: a capped chunked layer's are
    its page group's); `rank_of`: a data-parallel worker's rank of a request (pools.py).
    Thread-safe: frames of different pairs land in different slots or units, and the counters
    are locked."""

    def __init__(
        self,
        spec: KVSpec,
        pools: list[MappedPool],
        allowed: Callable[[str, int, torch.Tensor], bool],
        rank_of: RankOf = None,
    ):
        self.spec = spec  # the whole model's
        self.pools = pools
        self.allowed, self.rank_of = allowed, rank_of
        self.bytes_received = 0
        self.seconds = 0.0  # spent receiving and writing frames' bodies
        self.received: dict[str, int] = {}  # request id -> payload bytes written so far
        self._lock = threading.Lock()  # the counters: receivers add, the worker's loop takes

    def payload_bytes(self, layer: int, units: tuple[int, int], num_slots: int) -> int:
        """Bytes a frame of `num_slots` tokens of `layer` and units [units) carries; ValueError
        if this worker's model has no such layer or units (a peer of another layout)."""
        if not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.spec.num_layers})")
        if not 0 <= units[0] < units[1] <= self.spec.num_units:
            raise ValueError(f"units {units} outside [0, {self.spec.num_units})")
        shape = self.spec.payload_shape(layer, num_slots, units)
        return math.prod(shape) * self.spec.dtype.itemsize

    def write(
        self,
        request_id: str,
        layer: int,
        units: tuple[int, int],
        slots: torch.Tensor,
        payload: torch.Tensor,
        started: float,
    ) -> None:
        """Writes one frame: `slots` (n,) int64, `payload` its bytes as (payload_bytes,) uint8;
        `started` is when its body began to arrive (time.perf_counter). Drops it if its slots
        lie outside the request's pages (a request cancelled while its KV was on the way)."""
        if not self.allowed(request_id, layer, slots.cpu()):
            log.warning("dropped a KV frame of layer %d outside request %r's pages", layer,
                        request_id)  # fmt: skip
            return
        shape = self.spec.payload_shape(layer, len(slots), units)
        data = payload.view(self.spec.dtype).view(shape)
        pools = request_pools(self.pools, self.rank_of, request_id)
        if not write_layer(self.spec, pools, LayerKV(layer, units, slots, data)):
            raise ValueError(f"no rank holds layer {layer} units {units}")
        with self._lock:
            self.bytes_received += payload.numel()
            self.received[request_id] = self.received.get(request_id, 0) + payload.numel()
            self.seconds += time.perf_counter() - started

    def take(self, request_id: str) -> int:
        """Payload bytes written for the request (0 if none came); forgets it."""
        with self._lock:
            return self.received.pop(request_id, 0)
