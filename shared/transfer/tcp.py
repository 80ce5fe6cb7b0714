"""Cross-host transport: the prefill worker streams KV straight to the decode worker over TCP.

Connection: the server sends a 32-byte nonce, the client answers HMAC-SHA256(secret, nonce);
a wrong answer closes the connection. Then frames, each `u32 header length | msgpack header |
payload`: header {"r": request id, "l": global layer, "u": [first, end) units, "s": int64 slot
bytes, "n": payload bytes, "done": bool}. A "done" frame carries no payload and is answered with
one byte once all of the request's earlier frames on that connection are in the pool. The
server writes each frame into every rank of its worker holding part of it (transfer/pools.py),
so prefill and decode workers of any shapes meet over it; it counts each request's bytes, so
the decode worker can tell that every prefill rank's KV arrived."""

import asyncio
import logging
import socket
import struct
import time
from collections.abc import Callable

import msgpack
import torch

from shared.kv.spec import KVSpec
from shared.netaddr import dial_address
from shared.transfer import auth
from shared.transfer.base import KVSender, KVTarget, LayerKV
from shared.transfer.pools import MappedPool, RankOf, request_pools, write_layer

log = logging.getLogger(__name__)
NAME = "tcp"
ACK = b"\x01"
_LEN = struct.Struct(">I")
MAX_HEADER = 1 << 24


class TcpKVServer:
    """Decode side: accepts authenticated peers and writes their frames into the pools of the
    worker's ranks. `allowed(request_id, layer, slots)` says whether the slots belong to pages
    reserved for it; a frame that is not allowed is read and dropped (a request cancelled while
    its KV was on the way), and the connection goes on. `rank_of`: a data-parallel worker's
    rank of a request, whose pool alone takes its frames (pools.py)."""

    def __init__(
        self,
        spec: KVSpec,
        pools: list[MappedPool],
        secret: bytes,
        allowed: Callable[[str, int, torch.Tensor], bool],
        rank_of: RankOf = None,
    ):
        self.spec = spec  # the whole model's
        self.pools, self.rank_of = pools, rank_of
        self.secret = secret
        self.allowed = allowed
        self.bytes_received = 0
        self.seconds = 0.0
        self.received: dict[str, int] = {}  # request id -> payload bytes written so far
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0, toward: str = "") -> str:
        """Listens; returns the address peers dial (netaddr.dial_address: on a wildcard `host`,
        this host's address on its route toward `toward`, the NATS URL)."""
        self._server = await asyncio.start_server(self._serve, host, port)
        return dial_address(self._server.sockets[0].getsockname(), toward)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            nonce = auth.new_nonce()
            writer.write(nonce)
            reply = await asyncio.wait_for(reader.readexactly(auth.NONCE_BYTES), auth.TIMEOUT_S)
            if not auth.accepts(self.secret, nonce, reply):
                log.warning("KV peer %s failed authentication", writer.get_extra_info("peername"))
                return
            while True:
                (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                if size > MAX_HEADER:
                    raise ValueError(f"header of {size} bytes")
                header = msgpack.unpackb(await reader.readexactly(size))
                if header.get("done"):
                    writer.write(ACK)
                    await writer.drain()
                    continue
                start = time.perf_counter()
                payload = await reader.readexactly(int(header["n"]))
                self._write(header, payload)
                self.seconds += time.perf_counter() - start
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass  # peer went away
        except asyncio.CancelledError:
            pass  # the worker is stopping (3.11's start_server logs a handler's cancellation)
        except Exception as e:  # a malformed frame ends this connection, never the worker
            log.warning("KV connection dropped: %s", e)
        finally:
            writer.close()

    def take_received(self, request_id: str) -> int:
        """Payload bytes written for the request (0 if none came over TCP); forgets it."""
        return self.received.pop(request_id, 0)

    def _write(self, header: dict, payload: bytes) -> None:
        rid = str(header["r"])
        slots = torch.frombuffer(bytearray(header["s"]), dtype=torch.int64)
        layer, units = int(header["l"]), tuple(header["u"])
        if not 0 <= layer < self.spec.num_layers or not self.allowed(rid, layer, slots):
            log.warning("dropped a KV frame of layer %d outside request %r's pages", layer, rid)
            return
        shape = self.spec.payload_shape(layer, len(slots), units)
        data = torch.frombuffer(bytearray(payload), dtype=self.spec.dtype).view(shape)
        pools = request_pools(self.pools, self.rank_of, rid)
        if not write_layer(self.spec, pools, LayerKV(layer, units, slots, data)):
            raise ValueError(f"no rank holds layer {layer} units {units}")
        self.bytes_received += len(payload)
        self.received[rid] = self.received.get(rid, 0) + len(payload)


class TcpSender(KVSender):
    """Prefill side: one blocking connection per decode endpoint, used from the step thread.
    The kernel's socket buffer lets layer i travel while layer i+1 computes."""

    def __init__(self, secret: bytes, timeout_s: float = 10.0):
        self.secret = secret
        self.timeout_s = timeout_s
        self._socks: dict[str, socket.socket] = {}

    def _sock(self, endpoint: str) -> socket.socket:
        if endpoint not in self._socks:
            host, port = endpoint.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            auth.client_handshake(sock, self.secret)
            self._socks[endpoint] = sock
        return self._socks[endpoint]

    def send_layer(self, target: KVTarget, kv: LayerKV) -> int:
        data = kv.payload.contiguous().view(torch.uint8).numpy()
        header = {
            "r": target.request_id,
            "l": kv.layer,
            "u": list(kv.units),
            "s": kv.slots.numpy().tobytes(),
            "n": data.nbytes,
        }
        self._send(target, header, data)
        return data.nbytes

    def finish(self, target: KVTarget) -> None:
        sock = self._send(target, {"r": target.request_id, "done": True}, None)
        try:
            if auth.recv_exactly(sock, 1) != ACK:
                raise ConnectionError("KV peer did not acknowledge")
        except OSError:
            self._drop(target.pool.tcp)
            raise

    def _send(self, target: KVTarget, header: dict, payload) -> socket.socket:
        endpoint = target.pool.tcp
        sock = self._sock(endpoint)
        try:
            head = msgpack.packb(header)
            sock.sendall(_LEN.pack(len(head)) + head)
            if payload is not None:
                sock.sendall(payload)
        except OSError:
            self._drop(endpoint)
            raise
        return sock

    def _drop(self, endpoint: str) -> None:
        sock = self._socks.pop(endpoint, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        for endpoint in list(self._socks):
            self._drop(endpoint)
