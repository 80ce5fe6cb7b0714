"""The challenge both TCP channels of a worker open with (KV pages, weights from a peer): the
server sends a 32-byte nonce, the client answers HMAC-SHA256(secret, nonce); a wrong answer
closes the connection. The weights channel (`confirm`) then says whether it was accepted, so
its client can tell a refused secret from a peer that went away."""

import hashlib
import hmac
import os
import socket

NONCE_BYTES = 32
ACCEPTED, REFUSED = b"\x01", b"\x00"
TIMEOUT_S = 10.0  # a client that does not answer by then is dropped


class SecretRefusedError(ConnectionError):
    """The peer refused this process's secret (TISON_KV_SECRET differs, or is unset)."""


def answer(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def accepts(secret: bytes, nonce: bytes, reply: bytes) -> bool:
    return hmac.compare_digest(reply, answer(secret, nonce))


def server_handshake(sock: socket.socket, secret: bytes, confirm: bool = False) -> bool:
    """Blocking server side: whether the client proved it holds `secret`."""
    nonce = new_nonce()
    sock.settimeout(TIMEOUT_S)
    sock.sendall(nonce)
    ok = accepts(secret, nonce, recv_exactly(sock, NONCE_BYTES))
    if confirm:
        sock.sendall(ACCEPTED if ok else REFUSED)
    sock.settimeout(None)
    return ok


def client_handshake(sock: socket.socket, secret: bytes, confirm: bool = False) -> None:
    """Blocking client side; with `confirm`, SecretRefusedError unless the server accepted."""
    sock.sendall(answer(secret, recv_exactly(sock, NONCE_BYTES)))
    if confirm:
        try:
            verdict = recv_exactly(sock, 1)
        except ConnectionError:
            verdict = REFUSED  # closed without a verdict: an older peer's way of refusing
        if verdict != ACCEPTED:
            raise SecretRefusedError("the peer refused the secret (TISON_KV_SECRET)")


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return bytes(data)
