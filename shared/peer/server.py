"""WeightsServer: a worker serves its model folder, read-only, to peers holding its secret.

It serves only what its index lists, fixed when it starts: the folder's small files (config,
tokenizer, generation config, chat template: every file but the weights) by their relative
path, looked up in that list and never joined to the folder, and the checkpoint's tensors by
name. A compressed folder (`tison compress`) sends its stored planes as they are, so the wire
carries the compressed bytes and the receiver decodes them; a raw folder sends each tensor's
bytes (uncompressed), with its CRC-32C. A TP rank asks for slices (the rows or columns it
owns): those travel as raw bytes, read alone from a raw folder's memory map, cut from the
decoded tensor of a compressed one (kept for the other ranks' slices while a connection is
open). Blocking
sockets on threads of their own: reading and sending a tensor never holds up the worker's
event loop."""

import logging
import socket
import socketserver
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from shared.checkpoint import INDEX_FILE, Checkpoint
from shared.codec import CompressedCheckpoint, native
from shared.codec.container import MANIFEST, SHARD_SUFFIX
from shared.codec.format import EncodedTensor
from shared.codec.tensor import checksum
from shared.netaddr import dial_address
from shared.peer import wire
from shared.transfer import auth

log = logging.getLogger(__name__)
WEIGHT_SUFFIXES = (".safetensors", SHARD_SUFFIX, ".bin", ".pt", ".pth", ".gguf")
WEIGHT_FILES = (INDEX_FILE, MANIFEST, "pytorch_model.bin.index.json")
MAX_FILE_BYTES = 256 << 20  # a small file larger than this is not served (a stray blob)
DECODED_BYTES = 512 << 20  # decoded tensors kept for the next rank's slice of them


def small_files(folder: Path) -> dict[str, Path]:
    """Relative path -> file, for every file of the folder that is not weights (links to
    files are followed: a Hugging Face snapshot links its blobs)."""
    files = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        if path.name in WEIGHT_FILES or path.name.endswith(WEIGHT_SUFFIXES):
            continue
        if path.stat().st_size <= MAX_FILE_BYTES:
            files[rel.as_posix()] = path
    return files


class FolderSource:
    """A folder's files and stored tensors, as the server sends them."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.files = small_files(self.folder)
        checkpoint = Checkpoint.open(self.folder)
        self.compressed = isinstance(checkpoint, CompressedCheckpoint)
        if self.compressed:  # planes unchecked here: the receiver's decoder checks the CRC
            checkpoint = CompressedCheckpoint(self.folder, verify=False)
        self.checkpoint = checkpoint
        self.names = checkpoint.names()
        self._known = set(self.names)
        self._meta = [list(checkpoint.meta(name)) for name in self.names]  # [dtype, shape]
        self._lock = threading.Lock()  # the checkpoints' lazily opened handles; _decoded
        self._decoded: OrderedDict[str, torch.Tensor] = OrderedDict()  # least recent first
        self._connections = 0  # authenticated and open; _decoded is let go at 0

    def opened(self) -> None:
        with self._lock:
            self._connections += 1

    def closed(self) -> None:
        """A connection ended; the last one lets the decoded tensors go."""
        with self._lock:
            self._connections -= 1
            if not self._connections:
                self._decoded.clear()

    def decoded_bytes(self) -> int:
        """Bytes of the decoded tensors kept, read under the lock: a connection's thread may
        be moving them (a reader iterating while one was popped saw a KeyError)."""
        with self._lock:
            return self._decoded_bytes()

    def _decoded_bytes(self) -> int:  # the lock held
        return sum(t.numel() * t.element_size() for t in self._decoded.values())

    def index(self) -> dict:
        sizes = [[rel, path.stat().st_size] for rel, path in self.files.items()]
        return {
            "files": sizes,
            "tensors": self.names,
            "meta": self._meta,
            "compressed": self.compressed,
        }

    def encoded(self, name: str) -> EncodedTensor:
        if name not in self._known:
            raise KeyError(f"no tensor {name!r}")
        with self._lock:
            if self.compressed:
                return self.checkpoint.get_encoded(name)
            tensor = self.checkpoint.get(name)
        return _raw(name, tensor)

    def slice(self, name: str, dim: int, start: int, length: int) -> EncodedTensor:
        """Rows or columns [start, start + length) of dimension `dim`, as raw bytes."""
        if name not in self._known:
            raise KeyError(f"no tensor {name!r}")
        with self._lock:
            if self.compressed:
                part = self._whole(name).narrow(dim, start, length)
            else:
                part = self.checkpoint.get_slice(name).narrow(dim, start, length)
        return _raw(name, part.contiguous())

    def _whole(self, name: str) -> torch.Tensor:
        """A compressed tensor decoded, from the recently decoded ones where it is there."""
        tensor = self._decoded.pop(name, None)
        if tensor is None:
            tensor = self.checkpoint.get(name)
        if tensor.numel() * tensor.element_size() <= DECODED_BYTES:
            self._decoded[name] = tensor
            while self._decoded_bytes() > DECODED_BYTES:
                self._decoded.popitem(last=False)
        return tensor


def _raw(name: str, tensor: torch.Tensor) -> EncodedTensor:
    """A tensor sent as its bytes, with their CRC-32C."""
    crc = checksum(tensor, native.load())
    return EncodedTensor(name, "", tensor.dtype, tuple(tensor.shape), crc, None, tensor)


class WeightsServer:
    """Serves `folder` on host:port (0: any free port) to clients answering the challenge."""

    def __init__(self, folder: str | Path, secret: bytes):
        if not secret:
            raise ValueError("a weights server needs a secret (TISON_KV_SECRET)")
        self.source = FolderSource(folder)
        self.secret = secret
        self.refused = 0  # connections whose secret was wrong
        self.bytes_sent = 0
        self._server: socketserver.ThreadingTCPServer | None = None

    def start(self, host: str = "127.0.0.1", port: int = 0, toward: str = "") -> str:
        """Listens; returns the address peers should dial (host:port; on a wildcard `host`, this
        host's address on its route toward `toward`, the NATS URL)."""
        server = socketserver.ThreadingTCPServer((host, port), self._handler(), False)
        server.daemon_threads = True
        server.allow_reuse_address = True
        server.server_bind()
        server.server_activate()
        self._server = server
        threading.Thread(target=server.serve_forever, name="weights-server", daemon=True).start()
        return dial_address(server.server_address, toward)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _handler(self):
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request)

        return Handler

    def _serve(self, sock: socket.socket) -> None:
        peer = sock.getpeername()
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not auth.server_handshake(sock, self.secret, confirm=True):
                self.refused += 1
                log.warning("weights peer %s failed authentication", peer)
                return
            self.source.opened()
            try:
                while True:
                    header, _ = wire.recv_frame(sock)
                    self._answer(sock, header)
            finally:
                self.source.closed()
        except (ConnectionError, TimeoutError, OSError):
            pass  # the peer went away
        except Exception as e:  # a bad request ends this connection, never the worker
            log.warning("weights peer %s: %s", peer, e)
            try:
                wire.send_frame(sock, {"error": str(e)})
            except OSError:
                pass

    def _answer(self, sock: socket.socket, header: dict) -> None:
        op = header.get("op")
        if op == "index":
            wire.send_frame(sock, self.source.index())
        elif op == "file":
            path = self.source.files.get(str(header.get("path")))
            if path is None:
                raise KeyError(f"no file {header.get('path')!r} in the served folder")
            data = path.read_bytes()
            wire.send_frame(sock, {"path": header["path"]}, [data])
            self.bytes_sent += len(data)
        elif op == "tensors":
            for name in header.get("names", []):
                self._send(sock, self.source.encoded(str(name)))
        elif op == "slice":
            where = [int(header[key]) for key in ("dim", "start", "length")]
            self._send(sock, self.source.slice(str(header.get("name")), *where))
        else:
            raise ValueError(f"unknown request {op!r}")

    def _send(self, sock: socket.socket, encoded: EncodedTensor) -> None:
        frame, parts = wire.tensor_frame(encoded)
        wire.send_frame(sock, frame, parts)
        self.bytes_sent += sum(memoryview(p).nbytes for p in parts)
