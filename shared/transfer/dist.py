"""KV transport over torch.distributed point-to-point: a prefill rank sends each layer's KV to
the decode worker's receiving process, on gloo between CPU workers and NCCL between GPU
workers (shared/parallel/group.py picks by the decode pools' device); the code is the same.

Each prefill rank meets the decode worker's DistKVServer in the TCPStore it hosts, proves it
holds the secret and keeps the 2-rank group they build: a pair (dist_pair.py). Frames, sender
to server, in order: an int64 header (kind, global layer, units first and end, slots, payload
bytes, request id bytes); a LAYER frame then sends the request id (uint8), the slots (int64)
and the payload (a spec's `read`, as uint8). A DONE frame is answered with one int64 once
everything before it on the pair is in the pool; CLOSE ends the pair."""

import asyncio
import logging
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as torch_dist

from shared.kv.spec import KVSpec
from shared.netaddr import WILDCARDS, dial_address
from shared.transfer import auth, dist_pair
from shared.transfer.base import KVSender, KVTarget, LayerKV
from shared.transfer.dist_pair import PAIRS, SENDER, SERVER, TAG, SenderPair, exchange
from shared.transfer.inbox import KVInbox
from shared.transfer.pools import MappedPool, RankOf

log = logging.getLogger(__name__)
NAME = "dist"
LAYER, DONE, CLOSE = 0, 1, 2  # frame kinds
HEADER = 7  # int64s: kind, layer, units first, units end, slots, payload bytes, request id bytes
MAX_PAIRS = 256  # pair threads at most (a pair id taken and never answered holds one a while)
MAX_REQUEST_ID = 1024  # bytes


class DistKVServer:
    """Decode side, with TcpKVServer's surface: serves each pair on a thread of its own and
    writes its frames into the worker's rank pools through one KVInbox. A frame that is not
    allowed is received and dropped; a malformed one ends its pair, never the worker."""

    def __init__(
        self, spec: KVSpec, pools: list[MappedPool], secret: bytes, allowed, rank_of: RankOf = None
    ):
        self.secret = secret
        self.inbox = KVInbox(spec, pools, allowed, rank_of)
        self.device = pools[0].data.device if pools else torch.device("cpu")
        self._store: torch_dist.TCPStore | None = None  # its server is what senders dial
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()  # the two below: pair threads add and remove, close reads
        self._threads: dict[int, threading.Thread] = {}  # pair id -> its thread
        self._groups: dict[int, object] = {}  # pair id -> its group, once built

    @property
    def bytes_received(self) -> int:
        return self.inbox.bytes_received

    @property
    def seconds(self) -> float:
        return self.inbox.seconds

    @property
    def received(self) -> dict[str, int]:
        return self.inbox.received

    def take_received(self, request_id: str) -> int:
        """Payload bytes written for the request (0 if none came this way); forgets it."""
        return self.inbox.take(request_id)

    async def start(self, host: str = "127.0.0.1", port: int = 0, toward: str = "") -> str:
        """Hosts the store; returns the address senders dial (as TcpKVServer.start)."""
        return await asyncio.to_thread(self._listen, host, port, toward)

    def _listen(self, host: str, port: int, toward: str) -> str:
        # bound here and handed over: the store would bind every interface itself
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family)
        bound = sock.getsockname()
        local = ("::1" if family == socket.AF_INET6 else "127.0.0.1") if host in WILDCARDS else host
        self._store = torch_dist.TCPStore(
            local, bound[1], is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=auth.TIMEOUT_S), master_listen_fd=sock.detach(),
        )  # fmt: skip
        self._watcher = threading.Thread(target=self._watch, name="dist-kv-watch", daemon=True)
        self._watcher.start()
        return dial_address(bound, toward)

    async def close(self) -> None:
        """Ends every pair and thread; returns within about a second."""
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
        with self._lock:
            groups, threads = list(self._groups.values()), list(self._threads.values())
        for group in groups:
            dist_pair.abort(group)
        self._store = None  # its server stops: a pair still meeting its sender gives up
        deadline = time.monotonic() + 2.0
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if alive := [t.name for t in threads if t.is_alive()]:
            log.warning("dist KV threads still running after close: %s", alive)

    def _watch(self) -> None:
        """Starts a thread for each pair id a sender takes."""
        seen = 0
        while not self._stop.wait(dist_pair.POLL_S):
            try:
                taken = self._store.add(PAIRS, 0)
            except Exception as e:  # the store failed under us: nothing more can meet
                log.warning("dist KV store failed: %s", e)
                return
            for pair_id in range(seen + 1, taken + 1):
                with self._lock:
                    if len(self._threads) >= MAX_PAIRS:
                        log.warning("dist KV pair %d ignored: %d pairs open", pair_id, MAX_PAIRS)
                        continue
                    name = f"dist-kv-pair-{pair_id}"
                    thread = threading.Thread(
                        target=self._serve, args=(pair_id,), name=name, daemon=True
                    )
                    self._threads[pair_id] = thread
                thread.start()
            seen = taken

    def _serve(self, pair_id: int) -> None:
        group = None
        try:
            store = torch_dist.PrefixStore(f"pair/{pair_id}", self._store.clone())
            if not dist_pair.challenge(store, self.secret, self.device, self._stop):
                if not self._stop.is_set():
                    log.warning("dist KV pair %d failed authentication (or no answer)", pair_id)
                return
            group = dist_pair.server_group(store, self.device)
            with self._lock:
                if self._stop.is_set():
                    return
                self._groups[pair_id] = group  # close() can end it from now on
            if not dist_pair.confirm(group, self.secret, self.device):
                log.warning("dist KV pair %d: its group's peer failed authentication", pair_id)
                return
            self._receive(group)
        except ValueError as e:  # a malformed frame
            log.warning("dist KV pair %d dropped: %s", pair_id, e)
        except Exception as e:  # the sender went away, or close() ended the pair
            if not self._stop.is_set():
                log.info("dist KV pair %d ended: %s", pair_id, e)
        finally:
            if group is not None:  # the sender learns at once
                dist_pair.abort(group)
            with self._lock:
                self._threads.pop(pair_id, None)
                self._groups.pop(pair_id, None)

    def _receive(self, group) -> None:
        """Writes the pair's frames until it closes."""
        header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
        while True:
            group.recv([header], SENDER, TAG).wait(dist_pair.IDLE)
            kind, layer, u0, u1, num_slots, num_bytes, id_bytes = header.tolist()
            if kind == CLOSE:
                return
            if kind == DONE:  # everything before it is written: this thread wrote it
                exchange(group, SENDER, [torch.ones(1, dtype=torch.int64, device=self.device)])
                continue
            if kind != LAYER or not 0 < id_bytes <= MAX_REQUEST_ID or num_slots <= 0:
                raise ValueError(f"bad frame header {header.tolist()}")
            if num_bytes != self.inbox.payload_bytes(layer, (u0, u1), num_slots):
                raise ValueError(f"{num_bytes} payload bytes for {num_slots} slots of {layer}")
            started = time.perf_counter()
            body = [
                torch.empty(id_bytes, dtype=torch.uint8, device=self.device),
                torch.empty(num_slots, dtype=torch.int64, device=self.device),
                torch.empty(num_bytes, dtype=torch.uint8, device=self.device),
            ]
            works = [group.recv([t], SENDER, TAG) for t in body]
            for work in works:
                work.wait()
            rid, slots, payload = body
            request_id = rid.cpu().numpy().tobytes().decode()
            self.inbox.write(request_id, layer, (u0, u1), slots, payload, started)


class DistSender(KVSender):
    """Prefill side: one pair per decode endpoint (KVPool.dist), kept, used from the step
    thread. A failure drops the pair and raises (KVHandoff fails that request only); the next
    request meets the server again."""

    def __init__(self, secret: bytes, timeout_s: float = 10.0):
        self.secret = secret
        self.timeout = timedelta(seconds=timeout_s)  # meeting, and each frame
        self._pairs: dict[str, SenderPair] = {}  # by endpoint

    def send_layer(self, target: KVTarget, kv: LayerKV) -> int:
        rid = target.request_id.encode()
        payload = kv.payload.contiguous().view(torch.uint8).reshape(-1)
        header = [LAYER, kv.layer, *kv.units, len(kv.slots), payload.numel(), len(rid)]
        rid_bytes = torch.frombuffer(bytearray(rid), dtype=torch.uint8)
        self._frame(target.pool.dist, header, [rid_bytes, kv.slots, payload])
        return payload.numel()

    def finish(self, target: KVTarget) -> None:
        ack = torch.zeros(1, dtype=torch.int64)
        ack = self._frame(target.pool.dist, [DONE, 0, 0, 0, 0, 0, 0], [], ack)
        if ack.item() != 1:
            self._drop(target.pool.dist)
            raise ConnectionError("KV peer did not acknowledge")

    def close(self) -> None:
        for endpoint in list(self._pairs):
            try:  # the server's thread ends at once rather than when the connection breaks
                self._frame(endpoint, [CLOSE, 0, 0, 0, 0, 0, 0], [])
            except Exception:
                pass  # gone already
            self._drop(endpoint)

    def _frame(self, endpoint: str, header: list[int], body: list, ack=None):
        """Sends a frame on the endpoint's pair (met first if need be); with `ack`, receives
        the answer into a copy of it on the pair's device, returned."""
        if endpoint not in self._pairs:
            self._pairs[endpoint] = dist_pair.meet(endpoint, self.secret, self.timeout)
        pair = self._pairs[endpoint]
        try:
            head = torch.tensor(header, dtype=torch.int64)
            sends = [t.to(pair.device).contiguous() for t in (head, *body)]
            ack = None if ack is None else ack.to(pair.device)
            exchange(pair.group, SERVER, sends, ack)
        except Exception:
            self._drop(endpoint)
            raise
        return ack

    def _drop(self, endpoint: str) -> None:
        pair = self._pairs.pop(endpoint, None)
        if pair is not None:
            dist_pair.abort(pair.group)
