"""NATS over TLS on a real nats-server with certificates made by `openssl` for the test: the
services' client options (services/nats_client.py) connect with the CA, refuse a server a
different CA signed, present a client certificate where the server verifies clients, and the
scheduler, a worker and the gateway started with the --nats-* flags serve a completion over a
TLS broker with per-role users (passwords from files)."""

import asyncio
import shutil
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import nats
import pytest
from tls_certs import make_pki

from services.nats_client import NatsClientOptions, connect_nats
from shared import nats_auth
from shared.errors import NatsOptionsError
from shared.nats_server import NatsServer, ServerTls

from services_harness import Services

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def server_tls(pki, verify_clients: bool = False) -> ServerTls:
    return ServerTls(
        pki / "server.pem", pki / "server.key", pki / "ca.pem" if verify_clients else None
    )


async def round_trip(nc) -> bytes:
    sub = await nc.subscribe("tison.v1.test")
    await nc.publish("tison.v1.test", b"over tls")
    msg = await sub.next_msg(timeout=5)
    await nc.close()
    return msg.data


async def refused(url: str, **kwargs) -> bool:
    try:
        nc = await nats.connect(
            url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3, **kwargs
        )
    except Exception:
        return True
    await nc.close()
    return False


async def test_a_client_with_the_ca_connects_and_others_are_refused(pki, tmp_path):
    with NatsServer(tmp_path / "nats", tls=server_tls(pki)) as server:
        nc = await connect_nats(server.url, "t", NatsClientOptions(tls_ca=str(pki / "ca.pem")))
        assert await round_trip(nc) == b"over tls"
        assert await refused(server.url)  # plain TCP
        other = NatsClientOptions(tls_ca=str(pki / "other-ca.pem")).ssl_context()
        assert await refused(server.url, tls=other)  # a server this CA did not sign


async def test_a_server_that_verifies_clients_wants_their_certificate(pki, tmp_path):
    with NatsServer(tmp_path / "nats", tls=server_tls(pki, verify_clients=True)) as server:
        anonymous = NatsClientOptions(tls_ca=str(pki / "ca.pem")).ssl_context()
        assert await refused(server.url, tls=anonymous)
        options = NatsClientOptions(
            tls_ca=str(pki / "ca.pem"),
            tls_cert=str(pki / "client.pem"),
            tls_key=str(pki / "client.key"),
        )
        assert await round_trip(await connect_nats(server.url, "t", options)) == b"over tls"


def test_unusable_options_name_their_flag(pki, tmp_path):
    with pytest.raises(NatsOptionsError, match="--nats-tls-cert/--nats-tls-key"):
        NatsClientOptions(tls_cert=str(pki / "client.pem"))
    with pytest.raises(NatsOptionsError, match="--nats-tls-ca: no such file"):
        NatsClientOptions(tls_ca=str(tmp_path / "missing.pem"))
    with pytest.raises(NatsOptionsError, match="--nats-tls-\\*: unusable"):
        NatsClientOptions(tls_ca=str(pki / "server.ext"))  # not a certificate
    with pytest.raises(NatsOptionsError, match="--nats-user"):
        NatsClientOptions(password="x")


def test_a_service_given_an_unusable_flag_stops_with_one_line(tmp_path):
    empty = tmp_path / "token"
    empty.write_text("\n")
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "scheduler", "--nats-token-file", str(empty)],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"tison: --nats-token-file: {empty} is empty"]


async def test_the_services_serve_over_tls_with_their_users(pki, tmp_path, tiny_llama):
    passwords = {role: f"pw-{role}" for role in nats_auth.ROLES}
    for role, password in passwords.items():
        (tmp_path / f"{role}.pw").write_text(password)
    s = Services(tmp_path, tiny_llama)
    s.nats = NatsServer(
        tmp_path / "nats", users=nats_auth.role_users(passwords), tls=server_tls(pki)
    )

    def flags(role: str) -> tuple[str, ...]:
        return (
            "--nats-tls-ca", str(pki / "ca.pem"),
            "--nats-user", role, "--nats-password-file", str(tmp_path / f"{role}.pw"),
        )  # fmt: skip

    with s:
        s.scheduler(*flags("scheduler"))
        s.fake_worker("worker", "both", *flags("colocated"))
        s.gateway(*flags("gateway"))
        deadline = time.monotonic() + 60
        while s.health() != 200:
            assert time.monotonic() < deadline, s.logs()
            await asyncio.sleep(0.2)
        body = {"model": tiny_llama.name, "prompt": "hello", "max_tokens": 4}
        async with aiohttp.ClientSession() as http:
            for _ in range(50):  # the scheduler learns of the worker by its first heartbeats
                async with http.post(s.base_url + "/v1/completions", json=body) as resp:
                    if resp.status == 200:
                        out = await resp.json()
                        break
                await asyncio.sleep(0.1)
            else:
                pytest.fail(f"no completion over TLS:\n{s.logs()}")
        assert out["usage"]["completion_tokens"] == 4
        # and the broker they share refuses the same users without TLS
        plain = dict(user="gateway", password=passwords["gateway"])
        assert await refused(s.nats.url, **plain)
