"""Who each child of `tison up` is to the nats-server it started: the gateway and the scheduler log
in as their role (nats_auth.PERMISSIONS), batch clients as the batch role (its password in a
file), every worker child as a user of its own whose rights name its worker id, so a worker's
credentials cannot publish another worker's heartbeats or hear its assignments. A worker gets a
fresh id at every start (to the registries a restarted worker is a new one); the server reloads
its users before the child starts, so the new id's subjects are open to it from its first
message."""

import os
import secrets
from pathlib import Path

from services.nats_client import NATS_PASSWORD_ENV, NATS_USER_ENV
from services.up.plan import ChildSpec
from shared import nats_auth
from shared.nats_server import NatsServer
from shared.subjects import role_ids


class NatsIdentities:
    def __init__(self, specs: list[ChildSpec]):
        # user name -> password: a role's name for the services, the child's for a worker
        self.passwords = {
            spec.name if _is_worker(spec) else spec.args[0]: secrets.token_hex(16) for spec in specs
        }
        self.passwords[nats_auth.BATCH] = secrets.token_hex(16)  # for `tison batch` clients
        self.worker_ids: dict[str, dict[str, str]] = {}  # worker child -> its role ids now
        self.server: NatsServer | None = None  # set once it runs; it then reloads on changes

    def users(self) -> list[nats_auth.User]:
        users = []
        for name, password in self.passwords.items():
            if name in nats_auth.PERMISSIONS:
                users.append(nats_auth.User(name, password, nats_auth.PERMISSIONS[name]))
            elif name in self.worker_ids:  # a worker not started yet has no user yet
                rights = nats_auth.worker_permissions(self.worker_ids[name])
                users.append(nats_auth.User(name, password, rights))
        return users

    def start(self, spec: ChildSpec) -> tuple[list[str], dict[str, str]]:
        """(the extra flags, the environment variables) of one start of `spec`."""
        if not _is_worker(spec):
            name = spec.args[0]
            return [], {NATS_USER_ENV: name, NATS_PASSWORD_ENV: self.passwords[name]}
        worker_id = f"{spec.name}-{secrets.token_hex(3)}"
        self.worker_ids[spec.name] = role_ids(spec.args[0], worker_id)
        if self.server is not None:
            self.server.set_users(self.users())
        env = {NATS_USER_ENV: spec.name, NATS_PASSWORD_ENV: self.passwords[spec.name]}
        return ["--worker-id", worker_id], env


def write_batch_password(identities: NatsIdentities, folder: Path) -> Path:
    """The batch clients' password, in a file only this user reads (for --nats-password-file)."""
    path = folder / "batch.password"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(identities.passwords[nats_auth.BATCH])
    return path


def _is_worker(spec: ChildSpec) -> bool:
    return spec.args[0] in ("prefill", "decode", "colocated")
