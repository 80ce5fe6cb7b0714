"""A TP rank's slices from a weights peer, asked ahead of the loader: its weight_loaders narrow
one tensor at a time (a round trip each, ~70K of them for Kimi K2.5's experts), but the tensors
of a layer repeat in every layer, and an expert's in every expert, each narrowed alike on a
rank. So when the loader narrows a tensor, the rank asks at once for the same rows or columns
of the tensors after it that differ from it by their numbers only and have its shape
(`siblings`), and the answers wait for the loader (`Answers`), within a byte budget.

A guess that the loader does not take costs its bytes only: it is dropped once the loader has
passed its tensor (load_weights reads the tensors in the order of names())."""

import re
import socket
from collections import deque
from collections.abc import Callable, Iterator

from shared.peer import wire

AHEAD_BYTES = 256 << 20  # slices asked for and not yet taken, at most
AHEAD_ASKS = 128  # requests in flight, at most: their frames stay within the socket buffers
_NUMBER = re.compile(r"\d+")


def pattern(name: str) -> str:
    """The name with its numbers blanked: the same tensor of every layer and expert."""
    return _NUMBER.sub("#", name)


class Siblings:
    """For each tensor the rank loads, those after it of its pattern and shape, in order."""

    def __init__(self, names: list[str], shapes: dict[str, tuple], wanted: Callable[[str], bool]):
        self.order = {name: i for i, name in enumerate(n for n in names if wanted(n))}
        groups: dict[tuple, list[str]] = {}
        self._place: dict[str, tuple[list[str], int]] = {}  # name -> (its group, its index)
        for name in self.order:
            group = groups.setdefault((pattern(name), tuple(shapes[name])), [])
            self._place[name] = (group, len(group))
            group.append(name)

    def after(self, name: str, start: int = 0) -> Iterator[tuple[int, str]]:
        """(position, name) of the later tensors of its group, from position `start` on at
        the earliest, in order (lazily: a group of Kimi K2.5's expert tensors holds ~23K)."""
        group, index = self._place.get(name, ([], 0))
        return ((i, group[i]) for i in range(max(index + 1, start), len(group)))

    def group_of(self, name: str) -> int:
        """An id of the tensor's group (its pattern and shape)."""
        return id(self._place[name][0]) if name in self._place else 0


class Answers:
    """One connection's requests and answers, in order: `ask` sends a request and notes the
    keys of the frames it will be answered with; `take` reads answers until the key's, keeping
    the others for later. receive(sock) reads one frame (as PeerCheckpoint.receive does)."""

    def __init__(self, sock: socket.socket, receive: Callable):
        self.sock, self.receive = sock, receive
        self.pending: deque = deque()  # (key, bytes) of the frames asked for, in order
        self.pending_keys: set = set()  # their keys
        self.ready: dict = {}  # key -> (its answer, bytes), read ahead
        self.waiting_bytes = 0  # of the pending and ready frames that were guesses

    def asked(self, key) -> bool:
        return key in self.ready or key in self.pending_keys

    def ask(self, header: dict, keys: list, guess_bytes: int = 0) -> None:
        """Sends the request; guess_bytes: the size of its one frame when it is a guess."""
        wire.send_frame(self.sock, header)
        self.pending.extend((key, guess_bytes) for key in keys)
        self.pending_keys.update(keys)
        self.waiting_bytes += guess_bytes

    def room(self, nbytes: int) -> bool:
        """Whether a guess of nbytes may be asked for now."""
        return len(self.pending) < AHEAD_ASKS and self.waiting_bytes + nbytes <= AHEAD_BYTES

    def take(self, key, keep: Callable = lambda key: True):
        """The answer of `key`, read now or earlier; answers read meanwhile are kept if
        keep(key), else dropped."""
        while key not in self.ready:
            if not self.pending:
                raise KeyError(f"{key!r} was never asked for")
            got, nbytes = self.pending.popleft()
            self.pending_keys.discard(got)
            answer = self.receive(self.sock)
            if got == key or keep(got):
                self.ready[got] = (answer, nbytes)
            else:
                self.waiting_bytes -= nbytes
        answer, nbytes = self.ready.pop(key)
        self.waiting_bytes -= nbytes
        return answer

    def drop(self, keep: Callable) -> None:
        """Forgets the answers read ahead that not keep(key)."""
        for key in [k for k in self.ready if not keep(k)]:
            self.waiting_bytes -= self.ready.pop(key)[1]
