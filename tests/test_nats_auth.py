"""NATS users per role on a real nats-server: each role publishes and subscribes only where
it must, so credentials of one service cannot forge another's messages."""

import asyncio

import nats
import pytest

from shared import nats_auth, subjects
from shared.nats_server import NatsServer

PASSWORDS = {role: f"secret-{role}" for role in nats_auth.ROLES}


async def connect(url: str, role: str, errors: list[str] | None = None):
    async def on_error(e: Exception) -> None:
        if errors is not None:
            errors.append(str(e))

    return await nats.connect(
        url,
        user=role,
        password=PASSWORDS[role],
        error_cb=on_error,
        allow_reconnect=False,
        max_reconnect_attempts=0,
    )


async def _received(url: str, listener: str, subject: str, senders: list[tuple[str, str]]):
    """What `listener` gets on `subject` when each (role, payload) publishes there, and the
    errors the senders saw."""
    got: list[bytes] = []
    errors: list[str] = []
    sub = await connect(url, listener)

    async def keep(msg) -> None:
        got.append(msg.data)

    await sub.subscribe(subject, cb=keep)
    await sub.flush()
    for role, payload in senders:
        nc = await connect(url, role, errors)
        await nc.publish(subject, payload.encode())
        await nc.flush()
        await asyncio.sleep(0.05)  # the server's -ERR arrives after the flush
        await nc.close()
    await asyncio.sleep(0.1)
    await sub.close()
    return got, errors


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with NatsServer(tmp_path_factory.mktemp("nats"), users=PASSWORDS) as s:
        yield s


@pytest.mark.parametrize(
    "listener, subject, allowed, forger",
    [
        ("scheduler", subjects.heartbeat("decode", "d-1"), "decode", "gateway"),
        ("scheduler", subjects.heartbeat("decode", "d-1"), "decode", "prefill"),
        ("gateway", subjects.gateway_tokens("gw-1"), "decode", "prefill"),
        ("gateway", subjects.gateway_tokens("gw-1"), "colocated", "scheduler"),
        ("decode", subjects.gateway_cancel(), "gateway", "prefill"),
        ("decode", subjects.decode_kv("d-1"), "prefill", "gateway"),
        ("scheduler", subjects.scheduler_submit(), "gateway", "decode"),
        ("prefill", subjects.assign("prefill", "d-1"), "scheduler", "gateway"),
        ("decode", subjects.gateway_heartbeat("gw-1"), "gateway", "decode"),
    ],
)
async def test_only_the_role_that_owns_a_subject_publishes_there(
    server, listener, subject, allowed, forger
):
    got, errors = await _received(
        server.url, listener, subject, [(forger, "forged"), (allowed, "real")]
    )
    assert got == [b"real"]
    assert any("permissions violation" in e.lower() for e in errors), errors


async def test_roles_cannot_listen_where_they_have_no_business(server):
    errors: list[str] = []
    nc = await connect(server.url, "prefill", errors)
    await nc.subscribe(subjects.gateway_tokens("gw-1"))  # another gateway's tokens
    await nc.flush()
    await asyncio.sleep(0.05)
    await nc.close()
    assert any("permissions violation" in e.lower() for e in errors), errors


async def test_a_wrong_password_or_none_is_refused(server):
    with pytest.raises(Exception, match="(?i)authorization"):
        await nats.connect(
            server.url, user="gateway", password="guess", allow_reconnect=False,
            max_reconnect_attempts=0,
        )  # fmt: skip
    with pytest.raises(Exception, match="(?i)authorization"):
        await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0)


async def test_request_reply_works_for_every_role(server):
    """Replies travel on _INBOX: the gateway asks the scheduler, the scheduler a worker."""
    scheduler, gateway = (
        await connect(server.url, "scheduler"),
        await connect(server.url, "gateway"),
    )

    async def pong(msg) -> None:
        await scheduler.publish(msg.reply, b"pong")

    await scheduler.subscribe(subjects.scheduler_ping(), cb=pong)
    await scheduler.flush()
    assert (await gateway.request(subjects.scheduler_ping(), b"", timeout=2)).data == b"pong"
    decode = await connect(server.url, "decode")

    async def reserve(msg) -> None:
        await decode.publish(msg.reply, b"pages")

    await decode.subscribe(subjects.assign("decode", "d-1"), cb=reserve)
    await decode.flush()
    reply = await scheduler.request(subjects.assign("decode", "d-1"), b"", timeout=2)
    assert reply.data == b"pages"
    for nc in (scheduler, gateway, decode):
        await nc.close()


def test_the_config_names_every_role():
    text = nats_auth.authorization(PASSWORDS)
    assert all(f'"user": "{role}"' in text for role in nats_auth.ROLES)
    colocated = nats_auth.PERMISSIONS["colocated"]
    for role in ("prefill", "decode"):
        assert set(nats_auth.PERMISSIONS[role].publish) <= set(colocated.publish)
