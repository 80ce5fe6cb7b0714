"""How every service connects to NATS: credentials, TLS, reconnecting forever.

Secrets never travel in argv, where `ps` shows them: a password or a token comes from the
environment or from a file named by a flag. `tison up` puts its own server's per-role users in
each child's environment (nats_auth.py); for an external server (several hosts) the flags say
what to present:

    --nats-user U --nats-password-file F    a user of the server's authorization
    --nats-token-file F                     its token
    --nats-tls-ca CA.pem                    TLS, trusting the servers this CA signed
    --nats-tls-cert C.pem --nats-tls-key K.pem    a client certificate (servers that verify)

each also read from $TISON_NATS_USER, $TISON_NATS_PASSWORD, $TISON_NATS_TOKEN, $TISON_NATS_TLS_CA,
$TISON_NATS_TLS_CERT, $TISON_NATS_TLS_KEY.
"""

import argparse
import asyncio
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import nats

from shared.errors import NatsOptionsError

NATS_TOKEN_ENV = "TISON_NATS_TOKEN"
# a user of an authenticated nats-server: tison up's gives each role its own (nats_auth.py)
NATS_USER_ENV, NATS_PASSWORD_ENV = "TISON_NATS_USER", "TISON_NATS_PASSWORD"
log = logging.getLogger(__name__)
ERROR_LOG_S = 10.0  # while NATS is unreachable, one line per this period, not per attempt
TLS_ENV = {"ca": "TISON_NATS_TLS_CA", "cert": "TISON_NATS_TLS_CERT", "key": "TISON_NATS_TLS_KEY"}


def _read_secret(path: str, flag: str) -> str:
    try:
        secret = Path(path).read_text().strip()
    except OSError as e:
        raise NatsOptionsError(flag, f"cannot read {path} ({e.strerror})") from None
    if not secret:
        raise NatsOptionsError(flag, f"{path} is empty")
    return secret


@dataclass(frozen=True)
class NatsClientOptions:
    """What a service presents to the NATS server; empty: an open server, no TLS."""

    user: str = ""
    password: str = field(default="", repr=False)
    token: str = field(default="", repr=False)
    tls_ca: str = ""  # PEM file of the CA that signed the servers' certificates
    tls_cert: str = ""  # PEM files of this client's certificate and key (mutual TLS)
    tls_key: str = ""

    def __post_init__(self):
        if bool(self.tls_cert) != bool(self.tls_key):
            raise NatsOptionsError("--nats-tls-cert/--nats-tls-key", "give both or neither")
        if self.password and not self.user:
            raise NatsOptionsError("--nats-user", "a password needs its user")
        for flag, path in (
            ("--nats-tls-ca", self.tls_ca),
            ("--nats-tls-cert", self.tls_cert),
            ("--nats-tls-key", self.tls_key),
        ):
            if path and not Path(path).is_file():
                raise NatsOptionsError(flag, f"no such file: {path}")
        self.ssl_context()  # unusable files fail here, at start, not at each reconnect

    @classmethod
    def from_env(cls) -> "NatsClientOptions":
        env = os.environ.get
        return cls(
            user=env(NATS_USER_ENV, ""),
            password=env(NATS_PASSWORD_ENV, ""),
            token=env(NATS_TOKEN_ENV, ""),
            tls_ca=env(TLS_ENV["ca"], ""),
            tls_cert=env(TLS_ENV["cert"], ""),
            tls_key=env(TLS_ENV["key"], ""),
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "NatsClientOptions":
        """The flags of add_flags, each over its environment variable."""
        base = cls.from_env()
        password, token = base.password, base.token
        if args.nats_password_file:
            password = _read_secret(args.nats_password_file, "--nats-password-file")
        if args.nats_token_file:
            token = _read_secret(args.nats_token_file, "--nats-token-file")
        return cls(
            user=args.nats_user or base.user,
            password=password,
            token=token,
            tls_ca=args.nats_tls_ca or base.tls_ca,
            tls_cert=args.nats_tls_cert or base.tls_cert,
            tls_key=args.nats_tls_key or base.tls_key,
        )

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)

    def ssl_context(self) -> ssl.SSLContext | None:
        """Verifies the server (against tls_ca, else the system's CAs); None without TLS."""
        if not self.tls:
            return None
        try:
            context = ssl.create_default_context(cafile=self.tls_ca or None)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key)
        except (ssl.SSLError, OSError) as e:
            raise NatsOptionsError("--nats-tls-*", f"unusable TLS files ({e})") from None
        return context

    def connect_kwargs(self) -> dict:
        kwargs = dict(
            user=self.user or None, password=self.password or None, token=self.token or None
        )
        if self.tls:
            kwargs["tls"] = self.ssl_context()
        return kwargs


def add_flags(p: argparse.ArgumentParser) -> None:
    """The credential and TLS flags every service takes (beside its --nats-url)."""
    p.add_argument("--nats-user", default="", help=f"NATS user (or ${NATS_USER_ENV})")
    p.add_argument(
        "--nats-password-file",
        default="",
        help=f"file holding its password (or ${NATS_PASSWORD_ENV})",
    )
    p.add_argument(
        "--nats-token-file", default="", help=f"file holding a NATS token (or ${NATS_TOKEN_ENV})"
    )
    p.add_argument("--nats-tls-ca", default="", help="CA (PEM) of the NATS servers: TLS on")
    p.add_argument("--nats-tls-cert", default="", help="client certificate (PEM), mutual TLS")
    p.add_argument("--nats-tls-key", default="", help="its private key (PEM)")


class _ConnectionLog:
    """What a service logs of its NATS connection: one line when it is lost, one when it is
    back (with how long it took), and the errors in between at most once per ERROR_LOG_S, each
    as a line (nats-py's default logs a traceback per reconnect attempt, every second)."""

    def __init__(self, name: str):
        self.name = name
        self.lost_at = 0.0
        self._logged_at = -ERROR_LOG_S
        self.errors = 0

    async def error(self, e: Exception) -> None:
        self.errors += 1
        now = time.monotonic()
        if now - self._logged_at >= ERROR_LOG_S:
            self._logged_at = now
            log.warning("%s: NATS: %s (%d errors so far)", self.name, e or type(e).__name__,
                        self.errors)  # fmt: skip

    def lost(self) -> None:
        self.lost_at = time.monotonic()
        log.warning("%s: NATS connection lost; reconnecting", self.name)

    def back(self) -> None:
        log.warning("%s: NATS connection back after %.1f s", self.name,
                    time.monotonic() - self.lost_at)  # fmt: skip


Callback = Callable[[], Awaitable[None]]


async def beat_forever(nc: nats.NATS, subject: str, beat: bytes, interval_s: float) -> None:
    """Publishes `beat` every interval_s while connected (a liveness signal: the listeners
    count a publisher gone after a few missed intervals)."""
    while True:
        if nc.is_connected:
            await nc.publish(subject, beat)
        await asyncio.sleep(interval_s)


async def connect_nats(
    url: str,
    name: str,
    options: NatsClientOptions | None = None,
    on_lost: Callback | None = None,
    on_back: Callback | None = None,
):
    """A NATS connection that never stops reconnecting (nats-py's default gives up after 60
    tries, ~2 minutes): `tison up` restarts a dead nats-server on the same port, and every
    service finds it again however long it took. Options default to the environment's.
    on_lost and on_back run when the connection drops and when it is back (NATS does not keep
    what was published to a subscriber meanwhile)."""
    options = options if options is not None else NatsClientOptions.from_env()
    history = _ConnectionLog(name)

    async def lost() -> None:
        if nc.is_closed:  # closed by its owner (shutdown), not lost
            return
        history.lost()
        if on_lost is not None:
            await on_lost()

    async def back() -> None:
        history.back()
        if on_back is not None:
            await on_back()

    nc = nats.NATS()
    await nc.connect(
        url,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=1.0,
        error_cb=history.error,
        disconnected_cb=lost,
        reconnected_cb=back,
        **options.connect_kwargs(),
    )
    return nc
