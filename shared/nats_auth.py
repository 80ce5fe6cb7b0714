"""NATS users per service role and the subjects each may use: nats-server's authorization.

`tison up` gives every role its own user and password (services/up), so a process holding
one role's credentials can publish and subscribe only where that role does: a gateway cannot
publish worker heartbeats or token streams, a worker cannot submit requests or cancel them,
a prefill worker cannot read the gateways' tokens. Roles, not processes: a decode worker may
publish any decode worker's heartbeat. Every process replies to requests and receives
replies on `_INBOX.>` (NATS request/reply; inboxes are random 22-character names). Pure.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass

from shared import subjects

P = subjects.PREFIX
INBOX = "_INBOX.>"
GATEWAY, SCHEDULER, PREFILL, DECODE, COLOCATED = (
    "gateway",
    "scheduler",
    "prefill",
    "decode",
    "colocated",
)
ROLES = (GATEWAY, SCHEDULER, PREFILL, DECODE, COLOCATED)


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]

    def __or__(self, other: "Permissions") -> "Permissions":
        return Permissions(
            tuple(dict.fromkeys(self.publish + other.publish)),
            tuple(dict.fromkeys(self.subscribe + other.subscribe)),
        )


def _worker(role: str) -> Permissions:
    """A prefill or decode worker: its role's heartbeats, assignments, KV events and snapshot
    asks; cancels from the gateway."""
    publish = [f"{P}.{role}.heartbeat.*", f"{P}.{role}.kv_events.*", INBOX]
    subscribe = [f"{P}.{role}.assign.*", f"{P}.{role}.kv_snapshot.*", subjects.gateway_cancel()]
    if role == PREFILL:
        publish.append(f"{P}.decode.kv.*")  # KvReadyMsg to the decode worker
    else:
        publish.append(f"{P}.gateway.tokens.*")  # every token of a request
        subscribe += [f"{P}.decode.kv.*", subjects.all_gateway_heartbeats()]
    return Permissions(tuple(publish), (*subscribe, INBOX))


PERMISSIONS: dict[str, Permissions] = {
    GATEWAY: Permissions(
        publish=(
            subjects.scheduler_submit(),
            subjects.scheduler_ping(),
            subjects.gateway_cancel(),
            subjects.all_gateway_heartbeats(),
            INBOX,
        ),
        subscribe=(f"{P}.gateway.tokens.*", subjects.all_heartbeats(), INBOX),
    ),
    SCHEDULER: Permissions(
        # cancels too: one that overtook a request's placement, repeated once it is placed
        publish=(f"{P}.*.assign.*", f"{P}.*.kv_snapshot.*", subjects.gateway_cancel(), INBOX),
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
}


def authorization(passwords: Mapping[str, str]) -> str:
    """nats-server's configuration: one user per role of `passwords` (role -> password),
    allowed only its role's subjects."""
    users = []
    for role, password in passwords.items():
        rights = PERMISSIONS[role]
        users.append(
            {
                "user": role,
                "password": password,
                "permissions": {
                    "publish": {"allow": list(rights.publish)},
                    "subscribe": {"allow": list(rights.subscribe)},
                },
            }
        )
    return f"authorization {{ users: {json.dumps(users)} }}\n"
