"""The receiving side: PeerCheckpoint reads a model's tensors from a peer's WeightsServer, with
the names() / get() / get_many() of shared/checkpoint.py's Checkpoint, so load_weights (through
open_checkpoint) loads a rank from it as from a folder; fetch_files copies the peer's small
files (config, tokenizer, ...) into a local folder the engine reads as its model folder.

A rank that needs whole tensors is pipelined, never a round trip per tensor: at open it asks,
on a connection of its own, for every tensor the rank wants (`wanted`: a PP stage's layers),
in the order of names(), the order load_weights reads them in. A receiving thread reads the
stream into batches of about BATCH_BYTES, a decoding thread decodes each batch in one
decode_tensors call on all its threads (checking every tensor's CRC-32C), and get() takes them
as they come. At most `window_bytes` of decoded tensors wait to be taken: past that the threads
stop reading and TCP holds the peer back.

A TP rank (`sliced`) owns only part of most tensors, so it gets PeerSlices instead: its
weight_loaders narrow them as they narrow a folder's lazy TensorSlices, and each narrow asks
the peer for just those rows or columns (raw bytes on the wire: 1/tp of a sharded tensor
instead of all of it). The same rows or columns of the tensors of the same name in the next
layers and experts are asked for with it (ahead.py), so most narrows find their answer on the
way instead of waiting a round trip each."""

import contextlib
import math
import queue
import re
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from shared.codec import native
from shared.codec.format import DTYPES_BY_NAME
from shared.codec.tensor import decode_tensors
from shared.errors import ModelFolderError, WeightsPeerError
from shared.parallel.pipeline import PPStage
from shared.peer import wire
from shared.peer.ahead import Answers, Siblings, pattern
from shared.transfer import auth

BATCH_BYTES = 8 << 20
WINDOW_BYTES = 1 << 30
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0  # a peer silent this long in the middle of an answer is taken for stuck
# (stopped, or its host cut off without a reset); EngineConfig.weights_timeout_s sets it
_LAYER = re.compile(r"\.layers\.(\d+)\.")  # as load_weights finds a tensor's layer


def for_stage(stage: PPStage) -> Callable[[str], bool]:
    """Whether a stage wants a tensor: those of its layers, and every tensor of no layer
    (embedding, final norm, LM head: a few, fetched even where another stage holds them)."""

    def wanted(name: str) -> bool:
        layer = _LAYER.search(name)
        return layer is None or stage.owns(int(layer.group(1)))

    return wanted


def connect(endpoint: str, secret: bytes, read_timeout_s: float = READ_TIMEOUT_S) -> socket.socket:
    """An authenticated connection to a weights server; SecretRefusedError if it refuses
    the secret, OSError if it cannot be reached."""
    host, port = endpoint.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        auth.client_handshake(sock, secret, confirm=True)
        sock.settimeout(read_timeout_s)
    except BaseException:
        sock.close()
        raise
    return sock


def request(sock: socket.socket, header: dict) -> tuple[dict, bytearray]:
    wire.send_frame(sock, header)
    return wire.recv_frame(sock)


def fetch_files(
    endpoint: str, secret: bytes, out_dir: Path, read_timeout_s: float = READ_TIMEOUT_S
) -> list[str]:
    """Copies the peer's small files into out_dir (replacing older copies; each written to a
    temporary name first, so a folder never holds half a file). Returns their paths."""
    out_dir = Path(out_dir)
    with connect(endpoint, secret, read_timeout_s) as sock:
        index, _ = request(sock, {"op": "index"})
        paths = [str(rel) for rel, _ in index["files"]]
        for rel in paths:
            _, data = request(sock, {"op": "file", "path": rel})
            target = (out_dir / rel).resolve()
            if out_dir.resolve() not in target.parents:  # a peer may not write outside it
                raise ModelFolderError(str(out_dir), f"the peer sent a file outside it: {rel!r}")
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".part")
            tmp.write_bytes(data)
            tmp.replace(target)
    return paths


class PeerCheckpoint:
    """Tensor name -> tensor over a peer's weights server (see the module docstring)."""

    def __init__(
        self,
        endpoint: str,
        secret: bytes,
        wanted: Callable[[str], bool] = lambda name: True,
        num_threads: int | None = None,
        window_bytes: int = WINDOW_BYTES,
        read_timeout_s: float = READ_TIMEOUT_S,
        sliced: bool = False,  # a TP rank: get_slice gives PeerSlices, nothing is streamed
    ):
        self.endpoint, self.read_timeout_s = endpoint, read_timeout_s
        self.source = f"weights peer {endpoint}"
        self.num_threads = num_threads
        self.bytes_received = 0
        self.narrows = self.round_trips = 0  # sliced: narrows, and those not asked ahead
        native.keep_freed_memory()  # payloads and decoded tensors reuse freed memory, unfaulted
        self._control = self._connect(secret)  # the index; slices; tensors asked out of order
        self._answers = Answers(self._control, self.receive)
        self._stream: _Stream | None = None
        self._siblings: Siblings | None = None  # sliced (PeerSlices): whose slices are guessed
        self._narrows: dict[str, set] = {}  # a pattern -> the (dim, start, length) narrowed
        self._cursor: dict[tuple, int] = {}  # (group, narrow) -> the next sibling to ask for
        try:
            index, _ = request(self._control, {"op": "index"})
            self._names = [str(n) for n in index["tensors"]]
            self._meta = dict(zip(self._names, index["meta"], strict=True))
            self._order = (
                {} if sliced else {n: i for i, n in enumerate(n for n in self._names if wanted(n))}
            )  # position in the stream of each tensor it carries
            if sliced:
                shapes = {name: shape for name, (_, shape) in self._meta.items()}
                self._siblings = Siblings(self._names, shapes, wanted)
            stream = None if sliced else self._connect(secret)
        except BaseException as e:
            self._control.close()
            if isinstance(e, (OSError, KeyError, TypeError, ValueError)):
                raise WeightsPeerError(f"{self.source}: no index of its weights ({e})") from e
            raise
        if stream is not None:
            self._stream = _Stream(self, stream, list(self._order), window_bytes)

    def _connect(self, secret: bytes) -> socket.socket:
        try:
            return connect(self.endpoint, secret, self.read_timeout_s)
        except auth.SecretRefusedError:
            raise WeightsPeerError(
                f"{self.source} refused the secret (TISON_KV_SECRET differs from its own)"
            ) from None
        except OSError as e:
            raise WeightsPeerError(f"{self.source}: cannot connect ({e})") from e

    def names(self) -> list[str]:
        return list(self._names)

    def file_of(self, name: str) -> str:
        """Where the tensor comes from, for errors."""
        return self.source

    def get(self, name: str) -> torch.Tensor:
        if self._stream is None or name not in self._order:
            return self.get_many([name])[0]
        tensor = self._stream.take(self._order[name])
        return tensor if tensor is not None else self.get_many([name])[0]

    def get_slice(self, name: str):
        """sliced: the tensor unread (a PeerSlice); else the tensor, as get() gives it."""
        if self._stream is not None:
            return self.get(name)
        if name not in self._meta:
            raise ModelFolderError(self.source, f"no tensor {name!r}")
        dtype_name, shape = self._meta[name]
        return PeerSlice(self, name, DTYPES_BY_NAME.get(str(dtype_name)), shape)

    def get_many(self, names: list[str]) -> list[torch.Tensor]:
        """The tensors, asked for in one request on the control connection (not the stream)."""
        keys = [("tensor", name) for name in names]
        self._answers.ask({"op": "tensors", "names": list(names)}, keys)
        return self.decode([self._answers.take(key) for key in keys])

    def narrowed(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows or columns [start, start + length) of dimension dim of a tensor; the same of
        its siblings are asked for ahead (ahead.py)."""
        dim %= len(self._meta[name][1])
        key = ("slice", name, dim, start, length)
        self.narrows += 1
        if not self._answers.asked(key):
            self.round_trips += 1
            self._answers.ask(_slice_ask(key), [key])
        narrows = self._narrows.setdefault(pattern(name), set())
        narrows.add((dim, start, length))
        for narrow in sorted(narrows):
            self._guess(name, narrow)
        order, at = self._siblings.order, self._siblings.order.get(name, 0)

        def keep(k) -> bool:  # whole tensors, and slices of tensors the loader has not passed
            return k[0] != "slice" or order.get(k[1], at) >= at

        self._answers.drop(keep)
        return self.decode([self._answers.take(key, keep)])[0]

    def _guess(self, name: str, narrow: tuple[int, int, int]) -> None:
        """Asks for `narrow` of the tensors after `name` in its group while there is room,
        from the first one not asked for yet (`_cursor`: asking is O(1) a narrow)."""
        dim, start, length = narrow
        cursor = (self._siblings.group_of(name), narrow)
        for position, sibling in self._siblings.after(name, self._cursor.get(cursor, 0)):
            key = ("slice", sibling, dim, start, length)
            if not self._answers.asked(key):
                dtype_name, shape = self._meta[sibling]
                dtype = DTYPES_BY_NAME.get(str(dtype_name))
                size = 1 if dtype is None else dtype.itemsize
                nbytes = math.prod(shape) // max(shape[dim], 1) * length * size
                if not self._answers.room(nbytes):
                    return
                self._answers.ask(_slice_ask(key), [key], nbytes)
            self._cursor[cursor] = position + 1

    def receive(self, sock: socket.socket):
        try:
            header, payload = wire.recv_frame(sock, wire.unzeroed)
            self.bytes_received += len(payload)
            return wire.encoded_from_frame(header, payload, self.source)
        except TimeoutError:
            raise WeightsPeerError(
                f"{self.source} sent nothing for {self.read_timeout_s:g} s in the middle of "
                "the weights (stopped, or its host cut off); the load is given up"
            ) from None
        except (ConnectionError, OSError, ValueError, KeyError, TypeError) as e:
            raise ModelFolderError(self.source, f"reading a tensor failed ({e})") from e

    def decode(self, encoded: list) -> list[torch.Tensor]:
        return decode_tensors(encoded, num_threads=self.num_threads, verify=True)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._control.close()


class PeerSlice:
    """A peer's tensor, unread, as shared/checkpoint.py's TensorSlice: `narrow` fetches only the
    rows or columns asked for, `read` the whole tensor."""

    def __init__(self, owner: PeerCheckpoint, name: str, dtype: torch.dtype | None, shape):
        self.owner, self.name = owner, name
        self.dtype = dtype  # None: a dtype torch lacks
        self.shape = tuple(int(d) for d in shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if not -len(self.shape) <= dim < len(self.shape):
            raise ValueError(f"tensor {self.name!r} has no dimension {dim} (shape {self.shape})")
        size = self.shape[dim]
        if start < 0 or length < 0 or start + length > size:
            raise ValueError(
                f"tensor {self.name!r}: rows {start}..{start + length} of dimension {dim}, "
                f"which has {size}"
            )
        return self.owner.narrowed(self.name, dim, start, length)

    def read(self) -> torch.Tensor:
        return self.owner.get_many([self.name])[0]


class _Stream:
    """The pipelined request of every wanted tensor: receiver thread -> decoder thread ->
    `ready` (position -> tensor), taken in order by get(). A tensor skipped by the reader
    (load_weights passes over tensors it does not load) is dropped when a later one is taken."""

    def __init__(self, owner: PeerCheckpoint, sock: socket.socket, names: list[str], window: int):
        self.owner, self.sock, self.names, self.window = owner, sock, names, window
        self.ready: dict[int, torch.Tensor] = {}
        self.ready_bytes = 0
        self.taken = 0  # positions before this one were taken or passed over
        self.done = 0  # positions decoded (or dropped) so far
        self.error: BaseException | None = None
        self.closed = False
        self.cond = threading.Condition()
        self.batches: queue.Queue = queue.Queue(maxsize=2)
        wire.send_frame(sock, {"op": "tensors", "names": names})
        self.threads = [
            threading.Thread(target=self._guard, args=(f,), daemon=True, name=f"peer-{f.__name__}")
            for f in (self._receive, self._decode)
        ]
        for t in self.threads:
            t.start()

    def take(self, position: int) -> torch.Tensor | None:
        """The tensor at `position`, waiting for it; None if it was dropped (taken late)."""
        with self.cond:
            for skipped in [p for p in self.ready if p < position]:
                self.ready_bytes -= _nbytes(self.ready.pop(skipped))
            self.taken = max(self.taken, position)
            self.cond.notify_all()
            while position not in self.ready and self.done <= position and self.error is None:
                self.cond.wait()
            if position in self.ready:
                tensor = self.ready.pop(position)
                self.ready_bytes -= _nbytes(tensor)
                self.taken = position + 1
                self.cond.notify_all()
                return tensor
            if self.error is not None:
                raise self.error
            return None

    def _guard(self, work) -> None:
        try:
            work()
        except BaseException as e:
            with self.cond:
                if not self.closed:
                    self.error = e
                self.cond.notify_all()
            with contextlib.suppress(queue.Full):
                self.batches.put_nowait(None)  # the decoder ends too

    def _receive(self) -> None:
        batch, size = [], 0
        for _ in self.names:
            encoded = self.owner.receive(self.sock)
            batch.append(encoded)
            size += _stored_bytes(encoded)
            if size >= BATCH_BYTES:
                self.batches.put(batch)
                batch, size = [], 0
        self.batches.put(batch)
        self.batches.put(None)

    def _decode(self) -> None:
        position = 0
        while (batch := self.batches.get()) is not None and not self.closed:
            with self.cond:  # hold back while the reader has enough waiting
                while self.ready_bytes > self.window and not self.closed:
                    self.cond.wait()
            tensors = self.owner.decode(batch)
            with self.cond:
                for tensor in tensors:
                    if position >= self.taken:
                        self.ready[position] = tensor
                        self.ready_bytes += _nbytes(tensor)
                    position += 1
                self.done = position
                self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.ready.clear()
            self.cond.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _slice_ask(key: tuple) -> dict:
    _, name, dim, start, length = key
    return {"op": "slice", "name": name, "dim": dim, "start": start, "length": length}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _stored_bytes(encoded) -> int:
    if encoded.planes is None:
        return _nbytes(encoded.data)
    return encoded.planes.nbytes()
