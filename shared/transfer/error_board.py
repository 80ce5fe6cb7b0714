"""Where the ranks of a prefill worker tell rank 0 that a request's KV did not all reach its
decode worker. Over TCP and dist the decode worker counts every rank's bytes and so learns of a
rank's failure itself; over shm and cuda_ipc a rank's stores are all there is, so a rank > 0
whose part failed posts why here, and rank 0 takes it when the request finishes (before it
reports the request done). The worker's ranks already share a TCPStore (shared/parallel/comm.py):
a post is a round trip on a failure only; a take, one a finished request."""

from torch.distributed import Store

PREFIX = "kv_error/"


class ErrorBoard:
    def __init__(self, store: Store):
        self.store = store

    def post(self, request_id: str, error: str) -> None:
        """A rank > 0: why request_id's KV failed on it (set before its stage passes on the
        hidden states of the request's last chunk, so before rank 0 can finish it)."""
        self.store.set(PREFIX + request_id, error)

    def take(self, request_id: str) -> str | None:
        """Rank 0: the error a rank posted for request_id, removed; None if none did."""
        key = PREFIX + request_id
        if not self.store.check([key]):
            return None
        error = self.store.get(key).decode()
        self.store.delete_key(key)
        return error
