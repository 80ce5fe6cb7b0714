"""NATS users and the subjects each may use: nats-server's authorization.

`tison up` gives the gateway and the scheduler a user of their role, every worker process a user
of its own (services/up), and batch clients (`tison batch`) the batch role's, so a process
holding one's credentials can publish and subscribe only where it must: a gateway cannot publish
worker heartbeats or token streams, a worker cannot submit requests or cancel them, a prefill
worker cannot read the gateways' tokens, and a worker publishes only its own heartbeats and KV
events and hears only its own assignments (its subjects end in its worker id; workers share
only weights_ask, where a new worker asks which of them serves its model), and a batch
client reaches only JetStream's batch streams. Role users (PERMISSIONS) allow any id of their
role. Every process replies to requests and receives replies on `_INBOX.>` (NATS request/reply;
inboxes are random 22-character names). Pure.
"""

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shared import subjects

P = subjects.PREFIX
INBOX = "_INBOX.>"
GATEWAY, SCHEDULER, PREFILL, DECODE, COLOCATED, BATCH = (
    "gateway",
    "scheduler",
    "prefill",
    "decode",
    "colocated",
    "batch",
)
ROLES = (GATEWAY, SCHEDULER, PREFILL, DECODE, COLOCATED, BATCH)


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]

    def __or__(self, other: "Permissions") -> "Permissions":
        return Permissions(
            tuple(dict.fromkeys(self.publish + other.publish)),
            tuple(dict.fromkeys(self.subscribe + other.subscribe)),
        )


def _worker(role: str, worker_id: str = "*") -> Permissions:
    """A prefill or decode worker (`worker_id`, or any of the role: *): its heartbeats,
        assignments, KV events and snapshot asks; cancels from the gateway; asks for weights
    from a peer (it asks and answers them)."""
    own = f"{P}.{role}.%s.{worker_id}"
    # weights_ask both ways: a new worker asks who serves its model, a running one answers
    publish = [own % "heartbeat", own % "kv_events", subjects.weights_ask(), INBOX]
    subscribe = [
        own % "assign",
        own % "kv_snapshot",
        subjects.gateway_cancel(),
        subjects.weights_ask(),
    ]
    if role == PREFILL:
        publish.append(f"{P}.decode.kv.*")  # KvReadyMsg to any decode worker
    else:
        publish.append(f"{P}.gateway.tokens.*")  # every token of a request, to its gateway
        subscribe += [f"{P}.decode.kv.{worker_id}", subjects.all_gateway_heartbeats()]
    return Permissions(tuple(publish), (*subscribe, INBOX))


def worker_permissions(ids: Mapping[str, str]) -> Permissions:
    """A worker process serving these roles under these worker ids (role -> id; a colocated
    worker serves both, subjects.role_ids)."""
    rights = Permissions((), ())
    for role, worker_id in ids.items():
        rights |= _worker(role, worker_id)
    return rights


@dataclass(frozen=True)
class User:
    name: str
    password: str
    rights: Permissions


def role_users(passwords: Mapping[str, str]) -> list[User]:
    """One user per role of `passwords` (role -> password), allowed its role's subjects."""
    return [User(role, password, PERMISSIONS[role]) for role, password in passwords.items()]


# Batches over JetStream (services/batch): the gateways' batch API and runners, and batch
# clients (`tison batch`, BATCH). JetStream's API, acks, the status bucket and the file store,
# and the batch streams' subjects. The API subjects cover every stream: they are all Tison's.
JETSTREAM = Permissions(
    publish=(
        "$JS.API.>",
        "$JS.ACK.>",
        "$KV.TISON_BATCHES.>",
        "$O.TISON_FILES.>",
        f"{P}.batch.>",
        INBOX,
    ),
    subscribe=(INBOX,),
)

PERMISSIONS: dict[str, Permissions] = {
    GATEWAY: Permissions(
        publish=(
            subjects.scheduler_submit(),
            subjects.scheduler_ping(),
            subjects.gateway_cancel(),
            subjects.all_gateway_heartbeats(),
            INBOX,
        ),
        subscribe=(
            f"{P}.gateway.tokens.*",
            subjects.all_heartbeats(),
            subjects.all_scheduler_heartbeats(),
            INBOX,
        ),
    )
    | JETSTREAM,
    SCHEDULER: Permissions(
        # cancels too: one that overtook a request's placement, repeated once it is placed
        publish=(
            f"{P}.*.assign.*",
            f"{P}.*.kv_snapshot.*",
            subjects.gateway_cancel(),
            subjects.all_scheduler_heartbeats(),
            INBOX,
        ),
        subscribe=(
            subjects.scheduler_submit(),
            subjects.scheduler_ping(),
            subjects.all_heartbeats(),
            subjects.all_kv_events(),
            subjects.gateway_cancel(),
            INBOX,
        ),
    ),
    PREFILL: _worker(PREFILL),
    DECODE: _worker(DECODE),
    COLOCATED: _worker(PREFILL) | _worker(DECODE),  # both roles in one engine
    BATCH: JETSTREAM,
}


def authorization(users: Iterable[User]) -> str:
    """nats-server's configuration: these users, each allowed only its subjects."""
    entries = [
        {
            "user": user.name,
            "password": user.password,
            "permissions": {
                "publish": {"allow": list(user.rights.publish)},
                "subscribe": {"allow": list(user.rights.subscribe)},
            },
        }
        for user in users
    ]
    return f"authorization {{ users: {json.dumps(entries)} }}\n"
