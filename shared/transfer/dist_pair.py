"""How the two ends of a dist KV pair (dist.py) meet, and the operations of its group.

A sender takes a pair id from the server's TCPStore (`add("pairs", 1)`) and both meet under the
prefix `pair/<id>`: the server writes its device kind and a nonce, the sender answers
HMAC-SHA256(secret, nonce) (auth.py), the server writes its verdict and, only if it accepted,
both build a 2-rank group (server rank 0, sender rank 1). The store is open to whoever reaches
its port, so someone else could take the sender's place in the group's own meeting: the server
then sends a second nonce over the group, which the peer it connected must answer too."""

import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as torch_dist

from shared.parallel.group import process_group
from shared.transfer import auth

PAIRS = "pairs"  # the store's counter of pair ids taken
SERVER, SENDER = 0, 1  # ranks in a pair's group
TAG, ABORT_TAG = 0, 1  # every exchange; an operation made to time out (abort)
POLL_S = 0.05  # the server looks for new pairs, and a pair for its sender's answer, this often
IDLE = timedelta(days=30)  # the server's end of a pair waits this long for its next frame


def challenge(store, secret: bytes, device: torch.device, stop: threading.Event) -> bool:
    """Server side, before any group: whether the sender proved it holds `secret`. False too
    when it has not answered within auth.TIMEOUT_S (a pair id taken by nobody who answers) or
    once `stop` is set."""
    nonce = auth.new_nonce()
    store.set("device", device.type)
    store.set("nonce", nonce)
    deadline = time.monotonic() + auth.TIMEOUT_S
    while not store.check(["answer"]):
        if stop.wait(POLL_S) or time.monotonic() > deadline:
            return False
    ok = auth.accepts(secret, nonce, store.get("answer"))
    store.set("verdict", auth.ACCEPTED if ok else auth.REFUSED)
    return ok


def server_group(store, device: torch.device):
    """The server's end of the group, once the sender is accepted."""
    # gloo waits this long for its peer while connecting and in any operation given no timeout
    # of its own (the idle wait is given IDLE); NCCL connects lazily and its watchdog ends the
    # process when an operation outlives the group's timeout, so there it covers the idle wait
    timeout = IDLE if device.type != "cpu" else timedelta(seconds=auth.TIMEOUT_S)
    return process_group(store, SERVER, 2, device, timeout)


def confirm(group, secret: bytes, device: torch.device) -> bool:
    """Server side, over the group: whether the peer it connected holds `secret` too."""
    nonce = auth.new_nonce()
    reply = torch.empty(auth.NONCE_BYTES, dtype=torch.uint8, device=device)
    exchange(group, SENDER, [bytes_tensor(nonce, device)], reply)
    return auth.accepts(secret, nonce, reply.cpu().numpy().tobytes())


@dataclass
class SenderPair:
    """A sender's end of a pair."""

    store: object  # its TCPStore client, kept while the group lives (NCCL meets through it)
    group: object  # its 2-rank process group
    device: torch.device  # where its tensors go: the server's kind of device


def meet(endpoint: str, secret: bytes, timeout: timedelta) -> SenderPair:
    """Sender side: a new pair with the server whose store is at `endpoint` (host:port).
    SecretRefusedError if it refused the secret; a torch.distributed error if it cannot be
    reached or does not answer within `timeout`."""
    host, port = endpoint.rsplit(":", 1)
    client = torch_dist.TCPStore(
        host, int(port), is_master=False, wait_for_workers=False, timeout=timeout
    )
    store = torch_dist.PrefixStore(f"pair/{client.add(PAIRS, 1)}", client)
    nonce = store.get("nonce")  # written after the device, once the server saw the pair
    device = device_for(store.get("device").decode())
    store.set("answer", auth.answer(secret, nonce))
    if store.get("verdict") != auth.ACCEPTED:
        raise auth.SecretRefusedError(
            f"the dist KV server at {endpoint} refused the secret (TISON_KV_SECRET)"
        )
    group = process_group(store, SENDER, 2, device, timeout)
    try:
        nonce = torch.empty(auth.NONCE_BYTES, dtype=torch.uint8, device=device)
        exchange(group, SERVER, [], nonce)
        reply = auth.answer(secret, nonce.cpu().numpy().tobytes())
        exchange(group, SERVER, [bytes_tensor(reply, device)])
    except Exception:
        abort(group)
        raise
    return SenderPair(client, group, device)


def device_for(kind: str) -> torch.device:
    """The device a sender's tensors go from, to reach a server receiving on `kind`."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    raise ValueError(f"the dist KV server receives on {kind}, which this process has not")


def bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def exchange(group, peer: int, sends: list[torch.Tensor], recv: torch.Tensor | None = None):
    """Sends `sends` to `peer` in order, then receives `recv` from it; returns once all are
    done (the group's timeout bounds each). Empty tensors are not sent."""
    works = [group.send([t], peer, TAG) for t in sends if t.numel()]
    if recv is not None:
        works.append(group.recv([recv], peer, TAG))
    for work in works:
        work.wait()


def abort(group) -> None:
    """Ends every operation pending on `group`, from any thread, and the group with them. NCCL
    aborts its communicator; gloo has no abort for a pending receive, but any operation of a
    pair that times out closes the pair under all of them, so one is made to time out."""
    if not isinstance(group, torch_dist.ProcessGroupGloo):
        group.abort()
        return
    peer = SENDER if group.rank() == SERVER else SERVER
    try:
        group.recv([torch.empty(1)], peer, ABORT_TAG).wait(timedelta(milliseconds=1))
    except RuntimeError:
        pass  # the timeout, as meant
