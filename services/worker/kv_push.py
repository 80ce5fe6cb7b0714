"""Prefill side of the KV handoff: after each layer of a forward pass, the new KV of every
request bound for a decode worker is written into that worker's reserved pages."""

import time
from pathlib import Path

from shared.engine.scheduler import SchedulerOutput
from shared.kv.cache import KVCache
from shared.transfer import shm, tcp
from shared.transfer.base import KVSender, KVTarget, host_id, layout_id, slots


class KVPusher:
    """Owns the targets of in-flight prefills and the senders; counts bytes and seconds."""

    def __init__(self, kv: KVCache, secret: bytes | None, transport: str = "auto"):
        self.kv = kv
        self.layout = layout_id(kv)
        self.host = host_id()
        self.transport = transport  # auto | shm | tcp
        self.senders: dict[str, KVSender] = {
            shm.ENDPOINT: shm.ShmSender(kv.data.shape, kv.spec.dtype)
        }
        if secret:
            self.senders[tcp.ENDPOINT] = tcp.TcpSender(secret)
        self.targets: dict[str, KVTarget] = {}
        self.errors: dict[str, str] = {}  # request id -> why its transfer failed
        self.bytes_sent = 0
        self.seconds = 0.0
        self._step: dict[str, tuple] = {}  # this step's request id -> (target, src, dst slots)

    def add(self, target: KVTarget) -> None:
        """Registers a request's destination; raises ValueError if no transport can reach it."""
        if target.endpoints.get("layout") != self.layout:
            raise ValueError(
                f"KV layout {target.endpoints.get('layout')} != this worker's {self.layout}"
            )
        self._sender(target)
        self.targets[target.request_id] = target

    def _sender(self, target: KVTarget) -> KVSender:
        ep = target.endpoints
        same_host = (
            ep.get("host") == self.host and Path(ep.get(shm.ENDPOINT, "/nonexistent")).exists()
        )
        if same_host and self.transport in ("auto", "shm"):
            return self.senders[shm.ENDPOINT]
        if (
            tcp.ENDPOINT in ep
            and tcp.ENDPOINT in self.senders
            and self.transport in ("auto", "tcp")
        ):
            return self.senders[tcp.ENDPOINT]
        raise ValueError(
            f"no {self.transport} KV transport reaches {sorted(ep)} (is a KV secret set?)"
        )

    def on_layer(self, layer: int, out: SchedulerOutput) -> None:
        start = time.perf_counter()
        if layer == 0:  # the first layer of a step: work out its slots once
            self._step = self._slots(out)
        for request_id, (target, src, dst) in self._step.items():
            if request_id in self.errors:
                continue
            try:
                kv = self._flat_layer(layer)[:, src]  # (2, n, nkv, hd)
                self.bytes_sent += self._sender(target).send_layer(target, layer, kv, dst)
            except Exception as e:  # the decode worker went away: fail this request only
                self.errors[request_id] = f"KV transfer failed: {e}"
        self.seconds += time.perf_counter() - start

    def _flat_layer(self, layer: int):
        data = self.kv.data[layer]  # (2, P, S, nkv, hd)
        return data.view(2, -1, *data.shape[3:])  # (2, P*S, nkv, hd)

    def _slots(self, out: SchedulerOutput) -> dict:
        """Source and destination slots of this step's tokens of every pushed request."""
        page_size, step = self.kv.spec.page_size, {}
        for s in out.scheduled:
            target = self.targets.get(s.request.request_id)
            if target is not None:
                end = s.start + s.num_tokens
                src = slots(s.request.page_ids, s.start, end, page_size)
                dst = slots(target.page_ids, s.start, end, page_size)
                step[target.request_id] = (target, src, dst)
        return step

    def finish(self, request_id: str) -> str | None:
        """All KV of the request is in place: None, or why not. Forgets the request."""
        target = self.targets.pop(request_id, None)
        error = self.errors.pop(request_id, None)
        if target is None or error:
            return error or "no KV target"
        try:
            self._sender(target).finish(target)
        except Exception as e:
            return f"KV transfer failed: {e}"
        return None

    def drop(self, request_id: str) -> None:
        self.targets.pop(request_id, None)
        self.errors.pop(request_id, None)

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()
