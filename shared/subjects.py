"""Every NATS subject Tison uses, built in one place: `tison.v1.<component>.<endpoint>[.<id>]`.

Services never type a subject inline; they call these functions.
"""

PREFIX = "tison.v1"
ROLES = ("prefill", "decode")
SCHEDULER_QUEUE_GROUP = "tison-scheduler"  # scheduler replicas share submits


def _check_token(value: str, what: str) -> str:
    # A subject token must not contain separators or wildcards, or routing silently breaks.
    if not value or any(c in value for c in ".*> \t\r\n"):
        raise ValueError(f"invalid {what} for a NATS subject: {value!r}")
    return value


def role_ids(process_role: str, worker_id: str) -> dict[str, str]:
    """The worker id under which a worker process of `process_role` (prefill, decode or
    colocated: both) serves each role, on the subjects below."""
    if process_role == "colocated":
        return {"prefill": f"{worker_id}-prefill", "decode": f"{worker_id}-decode"}
    return {_check_role(process_role): worker_id}


def _check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return role


def scheduler_submit() -> str:
    """Gateway → scheduler (queue group SCHEDULER_QUEUE_GROUP), two replies: QUEUED at once,
    then the outcome."""
    return f"{PREFIX}.scheduler.submit"


def scheduler_ping() -> str:
    """Gateway → scheduler request/reply (queue group SCHEDULER_QUEUE_GROUP), empty both ways:
    the gateway's /health asks whether a scheduler answers."""
    return f"{PREFIX}.scheduler.ping"


def scheduler_heartbeat(scheduler_id: str) -> str:
    """Scheduler → gateways: this scheduler still holds the requests it acknowledged."""
    return f"{PREFIX}.scheduler.alive.{_check_token(scheduler_id, 'scheduler_id')}"


def all_scheduler_heartbeats() -> str:
    return f"{PREFIX}.scheduler.alive.*"


def gateway_cancel() -> str:
    """Gateway → everyone: free all state of a request."""
    return f"{PREFIX}.gateway.cancel"


def gateway_heartbeat(gateway_id: str) -> str:
    """Gateway → decode workers: this gateway still streams its requests (else they cancel)."""
    return f"{PREFIX}.gateway.alive.{_check_token(gateway_id, 'gateway_id')}"


def all_gateway_heartbeats() -> str:
    return f"{PREFIX}.gateway.alive.*"


def gateway_tokens(gateway_id: str) -> str:
    """Prefill/decode → one gateway: the tokens of its requests."""
    return f"{PREFIX}.gateway.tokens.{_check_token(gateway_id, 'gateway id')}"


def heartbeat(role: str, worker_id: str) -> str:
    """Worker → scheduler and gateways: load and endpoints."""
    return f"{PREFIX}.{_check_role(role)}.heartbeat.{_check_token(worker_id, 'worker id')}"


def all_heartbeats() -> str:
    """Wildcard matching the heartbeats of every role and worker."""
    return f"{PREFIX}.*.heartbeat.*"


def assign(role: str, worker_id: str) -> str:
    """Scheduler → one worker: a request assignment (request/reply for decode)."""
    return f"{PREFIX}.{_check_role(role)}.assign.{_check_token(worker_id, 'worker id')}"


def decode_kv(worker_id: str) -> str:
    """Prefill → one decode worker: pages written (or failed) for a request."""
    return f"{PREFIX}.decode.kv.{_check_token(worker_id, 'worker id')}"


def kv_events(role: str, worker_id: str) -> str:
    """Worker → scheduler: how its prefix cache's page hashes changed (KVEventsMsg)."""
    return f"{PREFIX}.{_check_role(role)}.kv_events.{_check_token(worker_id, 'worker id')}"


def all_kv_events() -> str:
    """Wildcard matching the KV events of every role and worker."""
    return f"{PREFIX}.*.kv_events.*"


def kv_snapshot(role: str, worker_id: str) -> str:
    """Scheduler → one worker: send your whole set of page hashes (KVSnapshotAskMsg)."""
    return f"{PREFIX}.{_check_role(role)}.kv_snapshot.{_check_token(worker_id, 'worker id')}"


def weights_ask() -> str:
    """New worker → running workers, request/reply: a peer serving a model's weights
    (WeightsAskMsg, answered with WeightsOfferMsg)."""
    return f"{PREFIX}.weights.ask"


def batch_work(batch_id: str) -> str:
    """Batch client → batch runners (JetStream work stream): a batch's request lines."""
    return f"{PREFIX}.batch.work.{_check_token(batch_id, 'batch_id')}"


def all_batch_work() -> str:
    return f"{PREFIX}.batch.work.*"


def batch_result(batch_id: str, key: str) -> str:
    """Batch runner → results stream: how one line of a batch ended (one message at most)."""
    return f"{PREFIX}.batch.result.{_check_token(batch_id, 'batch_id')}.{_check_token(key, 'key')}"


def batch_results(batch_id: str) -> str:
    return f"{PREFIX}.batch.result.{_check_token(batch_id, 'batch_id')}.*"


def batch_failed(batch_id: str, key: str) -> str:
    """Results stream: marks a line whose result is a failure (so failures count alone)."""
    return f"{PREFIX}.batch.failed.{_check_token(batch_id, 'batch_id')}.{_check_token(key, 'key')}"


def batch_failures(batch_id: str) -> str:
    return f"{PREFIX}.batch.failed.{_check_token(batch_id, 'batch_id')}.*"


def all_batch_results() -> list[str]:
    return [f"{PREFIX}.batch.result.*.*", f"{PREFIX}.batch.failed.*.*"]
