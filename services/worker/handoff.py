"""The prefill side's choice per request: the one-rank pusher (same layout; shm or TCP) when
both workers are single-rank, else the rank pusher (any shapes, shm, every rank writes)."""

from services.worker.kv_push import KVPusher
from shared.engine.kv_handoff import RANKS_ENDPOINT, RankKVPusher, parse_ranks
from shared.transfer.base import KVTarget


class Handoff:
    """Same interface as KVPusher: add, on_layer, finish, drop, bytes_sent, seconds, close."""

    def __init__(self, single: KVPusher | None, ranks: RankKVPusher, layout: str, transport: str):
        self.single = single  # None when this worker has several ranks
        self.ranks = ranks
        self.layout = layout  # the whole model's KV layout
        self.transport = transport
        self._by_request: dict[str, object] = {}  # request id -> the pusher serving it

    def add(self, target: KVTarget) -> None:
        """Registers a destination; raises ValueError when no pusher can reach it."""
        ep = target.endpoints
        pools = parse_ranks(ep.get(RANKS_ENDPOINT, "[]"))
        if self.single is not None and len(pools) <= 1:
            self.single.add(target)
            self._by_request[target.request_id] = self.single
            return
        if ep.get("layout") != self.layout:
            raise ValueError(f"KV layout {ep.get('layout')} != this worker's {self.layout}")
        if self.transport == "tcp" or not pools:
            raise ValueError("KV handoff across worker shapes goes over shm (same host)")
        self.ranks.add(target.request_id, target.page_ids, ep)
        self._by_request[target.request_id] = self.ranks

    def on_layer(self, layer: int, out) -> None:
        if self.single is not None:
            self.single.on_layer(layer, out)
        self.ranks.on_layer(layer, out)

    def finish(self, request_id: str) -> str | None:
        pusher = self._by_request.pop(request_id, None)
        return "no KV target" if pusher is None else pusher.finish(request_id)

    def drop(self, request_id: str) -> None:
        pusher = self._by_request.pop(request_id, None)
        if pusher is not None:
            pusher.drop(request_id)

    @property
    def bytes_sent(self) -> int:
        return self.ranks.bytes_sent + (self.single.bytes_sent if self.single else 0)

    @property
    def seconds(self) -> float:
        return self.ranks.seconds + (self.single.seconds if self.single else 0.0)

    def close(self) -> None:
        self.ranks.close()
        if self.single is not None:
            self.single.close()
