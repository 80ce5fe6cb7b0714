"""NATS users on a real nats-server: each role publishes and subscribes only where it must,
and a worker's own user only on its own worker id's subjects, so credentials of one service
cannot forge another's messages; users change without a restart."""

import asyncio
import json

import nats
import pytest
from nats_sync import subscribed

from services.batch.store import Batches
from shared import nats_auth, subjects
from shared.nats_server import NatsServer
from shared.subjects import role_ids

PASSWORDS = {role: f"secret-{role}" for role in nats_auth.ROLES}
# worker processes' own users (as tison up makes them): user -> the ids it serves
WORKERS = {
    "decode-0": role_ids("decode", "d-1"),
    "decode-1": role_ids("decode", "d-2"),
    "prefill-0": role_ids("prefill", "p-1"),
    "colocated-0": role_ids("colocated", "c-1"),
}
PASSWORDS |= {name: f"secret-{name}" for name in WORKERS}


def users() -> list[nats_auth.User]:
    roles = nats_auth.role_users({r: PASSWORDS[r] for r in nats_auth.ROLES})
    own = [
        nats_auth.User(name, PASSWORDS[name], nats_auth.worker_permissions(ids))
        for name, ids in WORKERS.items()
    ]
    return roles + own


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
    await subscribed(sub)
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
    with NatsServer(tmp_path_factory.mktemp("nats"), users=users()) as s:
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
        ("gateway", subjects.scheduler_heartbeat("s-1"), "scheduler", "gateway"),
        ("scheduler", subjects.heartbeat("decode", "d-1"), "decode-0", "decode-1"),
        ("scheduler", subjects.kv_events("decode", "d-1"), "decode-0", "decode-1"),
        ("scheduler", subjects.heartbeat("prefill", "c-1-prefill"), "colocated-0", "prefill-0"),
        ("gateway", subjects.gateway_tokens("gw-1"), "decode-1", "prefill-0"),
        ("decode", subjects.decode_kv("d-1"), "prefill-0", "decode-1"),
        ("scheduler", subjects.scheduler_submit(), "gateway", "batch"),  # a batch client
        ("gateway", subjects.gateway_tokens("gw-1"), "decode", "batch"),
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


async def test_a_batch_client_and_the_gateway_use_the_batch_streams(server):
    """The batch role (tison batch) and the gateway (its batch API and runners) create and use
    JetStream's batch streams, bucket and file store; a worker cannot."""
    for role in ("batch", "gateway"):
        nc = await connect(server.url, role)
        batches = Batches(nc)
        await batches.ensure()
        line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}
        batch = await batches.submit(json.dumps(line).encode(), "/v1/completions")
        assert (await batches.refresh(batch.id))[1].total == 1
        await nc.close()
    nc = await connect(server.url, "decode")
    with pytest.raises(Exception, match="(?i)timeout|permission"):
        await Batches(nc).ensure()
    await nc.close()


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
    await subscribed(scheduler)
    assert (await gateway.request(subjects.scheduler_ping(), b"", timeout=2)).data == b"pong"
    decode = await connect(server.url, "decode")

    async def reserve(msg) -> None:
        await decode.publish(msg.reply, b"pages")

    await decode.subscribe(subjects.assign("decode", "d-1"), cb=reserve)
    await subscribed(decode)
    reply = await scheduler.request(subjects.assign("decode", "d-1"), b"", timeout=2)
    assert reply.data == b"pages"
    for nc in (scheduler, gateway, decode):
        await nc.close()


async def test_a_new_worker_asks_running_workers_for_weights(server):
    """weights_ask: a worker's own user asks, another worker's own user (any role) answers on
    the inbox; the gateway and batch clients may not ask (a worker's weights are the
    workers' business)."""
    peer, new = await connect(server.url, "colocated-0"), await connect(server.url, "decode-1")

    async def offer(msg) -> None:
        await peer.publish(msg.reply, b"host:port")

    await peer.subscribe(subjects.weights_ask(), cb=offer)
    await subscribed(peer)
    assert (await new.request(subjects.weights_ask(), b"model", timeout=2)).data == b"host:port"
    for nc in (peer, new):
        await nc.close()
    got, errors = await _received(
        server.url, "prefill-0", subjects.weights_ask(), [("gateway", "x"), ("decode-0", "y")]
    )
    assert got == [b"y"]
    assert any("permissions violation" in e.lower() for e in errors), errors


@pytest.mark.parametrize(
    "user, subject",
    [
        ("decode-1", subjects.assign("decode", "d-1")),  # another decode worker's
        ("decode-1", subjects.decode_kv("d-1")),
        ("prefill-0", subjects.assign("prefill", "c-1-prefill")),
        ("colocated-0", subjects.kv_snapshot("decode", "d-1")),
    ],
)
async def test_a_worker_hears_only_its_own_subjects(server, user, subject):
    errors: list[str] = []
    nc = await connect(server.url, user, errors)
    await nc.subscribe(subject)
    await nc.flush()
    await asyncio.sleep(0.05)
    await nc.close()
    assert any("permissions violation" in e.lower() for e in errors), errors


async def test_users_change_without_a_restart(tmp_path):
    """A worker restarted under a new id: the server reloads its user's rights (SIGHUP);
    the old id's subjects are closed to it, the new one's open, and a new user may log in."""
    with NatsServer(tmp_path / "nats", users=users()) as server:
        got, _ = await _received(
            server.url, "scheduler", subjects.heartbeat("decode", "d-9"), [("decode-0", "x")]
        )
        assert got == []
        WORKERS["decode-0"] = role_ids("decode", "d-9")
        WORKERS["decode-5"] = role_ids("decode", "d-5")
        PASSWORDS["decode-5"] = "secret-decode-5"
        try:
            server.set_users(users())
            for subject, want in ((subjects.heartbeat("decode", "d-9"), [b"x"]),
                                  (subjects.heartbeat("decode", "d-1"), [])):  # fmt: skip
                got, _ = await _received(server.url, "scheduler", subject, [("decode-0", "x")])
                assert got == want
            got, _ = await _received(
                server.url, "scheduler", subjects.heartbeat("decode", "d-5"), [("decode-5", "y")]
            )
            assert got == [b"y"]
        finally:
            WORKERS["decode-0"] = role_ids("decode", "d-1")
            del WORKERS["decode-5"], PASSWORDS["decode-5"]


def test_the_config_names_every_role():
    text = nats_auth.authorization(users())
    assert all(f'"user": "{role}"' in text for role in nats_auth.ROLES)
    colocated = nats_auth.PERMISSIONS["colocated"]
    for role in ("prefill", "decode"):
        assert set(nats_auth.PERMISSIONS[role].publish) <= set(colocated.publish)
