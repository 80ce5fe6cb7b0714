"""The weights channel's frames, both ways: `u32 header length | msgpack header | payload`,
the payload `header["n"]` bytes (0 if absent). After the handshake (transfer/auth.py, with
confirm) the client sends requests, each answered in order:

    {"op": "index"}             -> {"files": [[path, bytes], ...], "tensors": [name, ...],
                                    "meta": [[dtype, shape] per tensor], "compressed": bool}
    {"op": "file", "path": p}   -> {"n": bytes} + the file (p one of the index's files)
    {"op": "tensors", "names": [...]} -> one tensor frame per name, in order
    {"op": "slice", "name", "dim", "start", "length"} -> one tensor frame, uncoded: the
                                    tensor narrowed (torch.narrow) to what a TP rank owns

A tensor frame: {"name", "dtype" (safetensors name), "shape", "crc" (CRC-32C of the tensor's
bytes), "n", "coded": null (the payload is the tensor's bytes) or {"k", "total_bits",
"first_symbol", "crc", "planes": [[dtype, numel] per plane of CodedPlanes.tensors()]} (the
payload is the planes, one after another)}. Any request may be answered {"error": text}
instead, after which the server closes the connection."""

import socket
import struct

import msgpack
import numpy as np
import torch

from shared.codec.format import DTYPE_NAMES, DTYPES_BY_NAME, CodedPlanes, EncodedTensor

_LEN = struct.Struct(">I")
MAX_HEADER = 1 << 24
PLANE_NAMES = ("stream", "raw", "lengths", "gaps", "block_first")


class PeerError(ConnectionError):
    """The peer answered a request with an error, or sent a malformed frame."""


def send_frame(sock: socket.socket, header: dict, parts=()) -> None:
    """Sends the header (with "n", the parts' total bytes) and the parts (buffers)."""
    views = [memoryview(p).cast("B") for p in parts]
    header = dict(header, n=sum(v.nbytes for v in views))
    head = msgpack.packb(header)
    sock.sendall(_LEN.pack(len(head)) + head)
    for view in views:
        sock.sendall(view)


def recv_frame(sock: socket.socket, buffer=bytearray) -> tuple[dict, bytearray | np.ndarray]:
    """(header, payload), the payload read into buffer(n). PeerError for an error frame or an
    oversized header."""
    (size,) = _LEN.unpack(recv_into(sock, bytearray(_LEN.size)))
    if size > MAX_HEADER:
        raise PeerError(f"a frame header of {size} bytes")
    header = msgpack.unpackb(recv_into(sock, bytearray(size)))
    if not isinstance(header, dict):
        raise PeerError("a frame header that is not a map")
    if "error" in header:
        raise PeerError(str(header["error"]))
    return header, recv_into(sock, buffer(int(header.get("n", 0))))


def unzeroed(n: int) -> np.ndarray:
    """A tensor frame's payload buffer: left uninitialized, the socket fills it. bytearray(n)
    zeroes its memory first, which for a fresh mapping faults every page in: ~1.1 s a GB on a
    2-core VM, longer than the transfer itself."""
    return np.empty(n, dtype=np.uint8)


def recv_into(sock: socket.socket, buf):
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the weights peer closed the connection")
        got += n
    return buf


def tensor_frame(encoded: EncodedTensor) -> tuple[dict, list]:
    """(header, payload parts) of one stored tensor: its planes, or its bytes."""
    header = {
        "name": encoded.name,
        "dtype": DTYPE_NAMES[encoded.dtype],
        "shape": list(encoded.shape),
        "crc": encoded.crc32c,
        "coded": None,
    }
    if encoded.planes is None:
        return header, [_bytes(encoded.data)]
    p = encoded.planes
    planes = [p.tensors()[name] for name in PLANE_NAMES]
    header["coded"] = {
        "k": p.k,
        "total_bits": p.total_bits,
        "first_symbol": p.first_symbol,
        "crc": p.crc32c,
        "planes": [[DTYPE_NAMES[t.dtype], t.numel()] for t in planes],
    }
    return header, [_bytes(t) for t in planes]


def encoded_from_frame(header: dict, payload, source: str) -> EncodedTensor:
    """The EncodedTensor a tensor frame carries (views of `payload`, no copy). ValueError for
    sizes that do not add up; the decoder checks the rest (its CRC-32C above all)."""
    dtype, shape = DTYPES_BY_NAME[header["dtype"]], tuple(int(d) for d in header["shape"])
    name, crc, coded = str(header["name"]), int(header["crc"]), header["coded"]
    if coded is None:
        data = _view(payload, 0, len(payload), dtype)
        numel = 1
        for d in shape:
            numel *= d
        if data.numel() != numel:
            raise ValueError(f"tensor {name!r}: {len(payload)} bytes for {dtype} {list(shape)}")
        return EncodedTensor(name, source, dtype, shape, crc, None, data.view(shape))
    planes, offset = {}, 0
    for plane, (dtype_name, numel) in zip(PLANE_NAMES, coded["planes"], strict=True):
        plane_dtype = DTYPES_BY_NAME[dtype_name]
        nbytes = int(numel) * plane_dtype.itemsize
        planes[plane] = _view(payload, offset, nbytes, plane_dtype)
        offset += nbytes
    if offset != len(payload):
        raise ValueError(f"tensor {name!r}: planes of {offset} bytes in {len(payload)}")
    p = CodedPlanes(
        **planes,
        k=int(coded["k"]),
        total_bits=int(coded["total_bits"]),
        first_symbol=int(coded["first_symbol"]),
        crc32c=int(coded["crc"]),
    )
    return EncodedTensor(name, source, dtype, shape, crc, p, None)


def _bytes(tensor: torch.Tensor):
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def _view(payload, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    if offset + nbytes > len(payload) or nbytes % dtype.itemsize:
        raise ValueError(f"a plane of {nbytes} bytes at {offset} in {len(payload)}")
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(payload, dtype=dtype, offset=offset, count=nbytes // dtype.itemsize)
