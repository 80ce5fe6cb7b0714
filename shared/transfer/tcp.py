"""Cross-host transport: the prefill worker streams KV straight to the decode worker over TCP.

Connection: the server sends a 32-byte nonce, the client answers HMAC-SHA256(secret, nonce);
a wrong answer closes the connection. Then frames, each `u32 header length | msgpack header |
payload`: header {"r": request id, "l": layer, "s": int64 slot bytes, "n": payload bytes,
"done": bool}. A "done" frame carries no payload and is answered with one byte once all of the
request's earlier frames are in the pool."""

import asyncio
import hashlib
import hmac
import logging
import os
import socket
import struct
import time
from collections.abc import Callable

import msgpack
import torch

from shared.transfer.base import KVSender, KVTarget

log = logging.getLogger(__name__)
ENDPOINT = "tcp"  # endpoints["tcp"] = "host:port"
ACK = b"\x01"
_LEN = struct.Struct(">I")
MAX_HEADER = 1 << 24


def _answer(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()


class TcpKVServer:
    """Decode side: accepts authenticated peers and writes their frames into the pool.

    `allowed(request_id, slots)` says whether the slots belong to pages reserved for it."""

    def __init__(
        self, pool: torch.Tensor, secret: bytes, allowed: Callable[[str, torch.Tensor], bool]
    ):
        self.pool = pool.view(pool.shape[:2] + (-1,) + pool.shape[4:])  # (L, 2, P*S, nkv, hd)
        self.row_shape = self.pool.shape[3:]
        self.secret = secret
        self.allowed = allowed
        self.bytes_received = 0
        self.seconds = 0.0
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._server = await asyncio.start_server(self._serve, host, port)
        bound = self._server.sockets[0].getsockname()
        if bound[0] in ("0.0.0.0", "::"):  # listening everywhere: advertise a routable address
            return f"{socket.gethostbyname(socket.gethostname())}:{bound[1]}"
        return f"{bound[0]}:{bound[1]}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            nonce = os.urandom(32)
            writer.write(nonce)
            answer = await asyncio.wait_for(reader.readexactly(32), timeout=10)
            if not hmac.compare_digest(answer, _answer(self.secret, nonce)):
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
        except Exception as e:  # a malformed frame ends this connection, never the worker
            log.warning("KV connection dropped: %s", e)
        finally:
            writer.close()

    def _write(self, header: dict, payload: bytes) -> None:
        slots = torch.frombuffer(bytearray(header["s"]), dtype=torch.int64)
        layer = int(header["l"])
        if not 0 <= layer < self.pool.shape[0] or not self.allowed(str(header["r"]), slots):
            raise ValueError(f"frame for layer {layer} / slots outside request {header['r']!r}")
        kv = torch.frombuffer(bytearray(payload), dtype=self.pool.dtype)
        self.pool[layer, :, slots] = kv.view(2, len(slots), *self.row_shape)
        self.bytes_received += len(payload)


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
            nonce = _recv_exactly(sock, 32)
            sock.sendall(_answer(self.secret, nonce))
            self._socks[endpoint] = sock
        return self._socks[endpoint]

    def send_layer(
        self, target: KVTarget, layer: int, kv: torch.Tensor, dst_slots: torch.Tensor
    ) -> int:
        payload = kv.contiguous().view(torch.uint8).numpy()
        header = {
            "r": target.request_id,
            "l": layer,
            "s": dst_slots.numpy().tobytes(),
            "n": payload.nbytes,
        }
        self._send(target, header, payload)
        return payload.nbytes

    def finish(self, target: KVTarget) -> None:
        sock = self._send(target, {"r": target.request_id, "done": True}, None)
        try:
            if _recv_exactly(sock, 1) != ACK:
                raise ConnectionError("KV peer did not acknowledge")
        except OSError:
            self._drop(target.endpoints[ENDPOINT])
            raise

    def _send(self, target: KVTarget, header: dict, payload) -> socket.socket:
        endpoint = target.endpoints[ENDPOINT]
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


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("KV peer closed the connection")
        data += chunk
    return data
