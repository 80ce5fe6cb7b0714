"""`tison up`: starts everything, serves, restarts a killed child, stops cleanly on SIGTERM
leaving no process behind, and starts again on the same port."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from services.up.plan import RestartPolicy, UpConfig, plan
from shared.parallel.cores import available_cores, parse_cpulist
from shared.proc import die_with_parent

from services_harness import REPO_ROOT, free_port
from waiting import wait_until


def descendants(pid: int) -> set[int]:
    """All live processes below pid (children, grandchildren...)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Up:
    """`tison up` on model_dir in float32, or (None) on the bundled model in its own dtype."""

    def __init__(self, model_dir, port: int, *args: str):
        self.port = port
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
        model = [] if model_dir is None else ["--model", str(model_dir), "--dtype", "float32"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", *model, "--port", str(port), *args],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            preexec_fn=die_with_parent,  # a killed test run leaves no tison up behind
        )

    def wait_serving(self, timeout_s=120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if "Tison is serving" in line:
                return
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"tison up exited with {self.proc.returncode}")
        raise TimeoutError("tison up did not become ready")

    def complete(self, model_name: str) -> str:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0
        )
        out = client.completions.create(model=model_name, prompt="hello", max_tokens=4)
        assert out.usage.completion_tokens >= 1
        return out.choices[0].text

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def cmdline(pid: int) -> list[str]:
    return (Path("/proc") / str(pid) / "cmdline").read_bytes().decode().split("\0")


def cores_of_every_thread(pid: int) -> set[tuple[int, ...]]:
    """The CPU set of each thread of pid (torch's and OpenMP's included)."""
    found = set()
    for task in (Path("/proc") / str(pid) / "task").iterdir():
        status = (task / "status").read_text()
        found.add(parse_cpulist(re.search(r"Cpus_allowed_list:\s*(\S+)", status).group(1)))
    return found


def worker_pids(up: "Up") -> dict[str, int]:
    """role (prefill, decode, colocated) or rank1, rank2 ... -> pid."""
    found = {}
    for pid in descendants(up.proc.pid):
        args = cmdline(pid)
        for role in ("prefill", "decode", "colocated"):
            if role in args[2:4]:
                found[role] = pid
        if "shared.engine.rank_worker" in args:
            found[f"rank{args[args.index('--rank') + 1]}"] = pid
    return found


def test_up_serves_stops_cleanly_and_starts_again(tiny_llama):
    port = free_port()
    up = Up(tiny_llama, port)
    try:
        up.wait_serving()
        children = descendants(up.proc.pid)
        assert len(children) >= 5  # nats-server, scheduler, prefill, decode, gateway
        up.complete(tiny_llama.name)
        if len(available_cores()) == 2:  # the default plan here: a core each
            pids = worker_pids(up)
            first, second = available_cores()
            assert cores_of_every_thread(pids["prefill"]) == {(first,)}
            assert cores_of_every_thread(pids["decode"]) == {(second,)}
    finally:
        code = up.stop()
    assert code == 0
    what = "the processes tison up started to exit, none left behind"
    wait_until(lambda: not any(alive(pid) for pid in children), 30, what)

    again = Up(tiny_llama, port, "--colocated")
    try:
        again.wait_serving()
        again.complete(tiny_llama.name)
    finally:
        assert again.stop() == 0


def test_up_workers_and_their_ranks_run_on_the_planned_cores(tiny_llama):
    """--cores-*: each worker's threads stay on its cores; a 2-rank worker splits its cores."""
    first, second = available_cores()[:2]
    both = f"{first},{second}"
    up = Up(
        tiny_llama,
        free_port(),
        *("--prefill-tp", "2", "--cores-prefill", both, "--cores-decode", str(second)),
        "--allow-oversubscribe",
    )
    try:
        up.wait_serving()
        up.complete(tiny_llama.name)
        pids = worker_pids(up)
        assert cores_of_every_thread(pids["prefill"]) == {(first,)}  # rank 0
        assert cores_of_every_thread(pids["rank1"]) == {(second,)}
        assert cores_of_every_thread(pids["decode"]) == {(second,)}
    finally:
        assert up.stop() == 0


def test_up_serves_the_bundled_model():
    """The README's first command: `tison up` on its defaults (bf16, this run's CPU tier)."""
    up = Up(None, free_port())
    try:
        up.wait_serving()
        assert up.complete("tison-tiny-stdlib").strip()
    finally:
        assert up.stop() == 0


def test_up_restarts_a_killed_worker(tiny_llama):
    up = Up(tiny_llama, free_port())
    try:
        up.wait_serving()
        decode = next(
            pid
            for pid in descendants(up.proc.pid)
            if b"\x00decode\x00" in (Path("/proc") / str(pid) / "cmdline").read_bytes()
        )
        os.kill(decode, signal.SIGKILL)

        def serves() -> bool:
            try:
                up.complete(tiny_llama.name)
            except openai.APIStatusError as e:
                assert e.status_code == 503  # until the restarted worker reports in
                return False
            return True

        # Each check is a completion: a slower poll leaves the CPU to the restarting worker.
        wait_until(serves, 60, "a restarted decode worker to serve", interval=0.5)
        assert not alive(decode)
    finally:
        assert up.stop() == 0


def test_up_refuses_a_busy_port(tiny_llama):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        up = Up(tiny_llama, s.getsockname()[1])
        out, _ = up.proc.communicate(timeout=60)
    assert up.proc.returncode == 2


def test_plan_and_restart_policy(tiny_llama):
    eight = tuple(range(8))
    cfg = UpConfig(tiny_llama, prefill_workers=2, decode_workers=3, cores=eight)
    names = [c.name for c in plan(cfg)]
    assert names == [
        "scheduler",
        "prefill-0",
        "prefill-1",
        "decode-0",
        "decode-1",
        "decode-2",
        "gateway",
    ]
    assert plan(cfg)[0].args == ("scheduler", "--routing", "kv")
    assert plan(UpConfig(tiny_llama, routing="load"))[0].args == ("scheduler", "--routing", "load")
    assert [c.name for c in plan(UpConfig(tiny_llama, mode="colocated"))] == [
        "scheduler",
        "colocated-0",
        "gateway",
    ]
    ep = plan(UpConfig(tiny_llama, prefill_tp=2, decode_tp=2, ep=True, cores=eight))
    workers = [c.args for c in ep if c.name.startswith(("prefill", "decode"))]
    assert all("--ep" in args and args[args.index("--tp") + 1] == "2" for args in workers)
    dp = plan(UpConfig(tiny_llama, decode_dp=2, mode="disaggregated", cores=eight))
    workers = {c.name: c.args for c in dp if c.name.startswith(("prefill", "decode"))}
    assert "--dp" not in workers["prefill-0"]
    assert workers["decode-0"][workers["decode-0"].index("--dp") + 1] == "2"
    colocated = plan(UpConfig(tiny_llama, decode_dp=2, mode="colocated", cores=eight))[1].args
    assert colocated[0] == "colocated" and colocated[colocated.index("--dp") + 1] == "2"
    with pytest.raises(ValueError, match="decode-dp"):
        UpConfig(tiny_llama, decode_dp=0)
    off = plan(UpConfig(tiny_llama, prefix_caching=False, cores=eight))
    workers = [c.args for c in off if c.name.startswith(("prefill", "decode"))]
    assert workers and all("--no-prefix-caching" in args for args in workers)
    with pytest.raises(ValueError, match="decode-workers"):
        UpConfig(tiny_llama, decode_workers=0)
    shared = plan(UpConfig(tiny_llama, batch_max_share=0.3))[0].args
    assert shared == ("scheduler", "--routing", "kv", "--batch-max-share", "0.3")
    with pytest.raises(ValueError, match="batch-max-share"):
        UpConfig(tiny_llama, batch_max_share=0)
    policy = RestartPolicy(base_s=1, max_s=8, healthy_after_s=60)
    assert [policy.delay("d", 1) for _ in range(5)] == [1, 2, 4, 8, 8]
    assert policy.delay("d", 120) == 1  # ran long enough: a fresh failure


def test_up_on_a_folder_that_cannot_serve_stops_with_one_line(tmp_path, tiny_llama, capsys):
    """Not a child restarting on it for minutes: one error line, exit 2, before any child."""
    from services.cli import main

    assert main(["up", "--model", str(tmp_path / "nonexistent")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nonexistent/config.json" in err
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_llama, folder)
    (folder / "tokenizer.json").unlink()
    assert main(["up", "--model", str(folder)]) == 2
    assert "tokenizer.json: missing" in capsys.readouterr().err


def test_up_restarts_a_killed_nats_server_and_serves_again(tiny_llama):
    """kill -9 of the nats-server that `tison up` started: it comes back on the same port and
    every service reconnects (they retry forever), so completions work again unrestarted."""
    up = Up(tiny_llama, free_port())
    try:
        up.wait_serving()
        up.complete(tiny_llama.name)

        def nats_pids() -> set[int]:
            return {p for p in descendants(up.proc.pid) if "nats-server" in cmdline(p)[0]}

        (killed,) = nats_pids()
        os.kill(killed, signal.SIGKILL)

        def serves() -> bool:
            try:
                up.complete(tiny_llama.name)
            except openai.APIError:
                return False
            return True

        wait_until(serves, 90, "a completion after nats-server was killed", interval=0.5)
        assert nats_pids() and killed not in nats_pids()
    finally:
        assert up.stop() == 0


def test_up_s_nats_server_refuses_clients_without_credentials(tiny_llama, tmp_path):
    """Any local process could read every prompt and forge tokens, cancels and heartbeats on
    an open broker: the nats-server that `tison up` starts takes only its services, each with
    its role's user (password in its environment and a file only its owner reads), allowed
    its role's subjects (tests/test_nats_auth.py)."""
    import asyncio

    import nats

    up = Up(tiny_llama, free_port(), "--state-dir", str(tmp_path / "nats"))
    try:
        up.wait_serving()
        up.complete(tiny_llama.name)
        (ports,) = (tmp_path / "nats").glob("nats-server_*.ports")
        url = json.loads(ports.read_text())["nats"][0]
        assert (tmp_path / "nats" / "auth.conf").stat().st_mode & 0o077 == 0
        for proc in descendants(up.proc.pid):
            assert not any("password" in arg or "secret" in arg for arg in cmdline(proc)[1:])

        async def forge() -> None:
            nc = await nats.connect(url, max_reconnect_attempts=0, allow_reconnect=False)
            await nc.publish("tison.v1.gateway.cancel", b"forged")
            await nc.close()

        with pytest.raises(Exception, match="(?i)authorization"):
            asyncio.run(forge())
        up.complete(tiny_llama.name)  # the services authenticated
        # the decode worker's own user: its id's heartbeats, not another decode worker's
        pid = worker_pids(up)["decode"]
        env = dict(
            kv.split("=", 1)
            for kv in (Path("/proc") / str(pid) / "environ").read_bytes().decode().split("\0")
            if "=" in kv
        )
        args = cmdline(pid)
        own = args[args.index("--worker-id") + 1]

        async def heartbeats(worker_id: str) -> list[str]:
            errors = []

            async def on_error(e) -> None:
                errors.append(str(e))

            nc = await nats.connect(
                url, user=env["TISON_NATS_USER"], password=env["TISON_NATS_PASSWORD"],
                error_cb=on_error, allow_reconnect=False, max_reconnect_attempts=0,
            )  # fmt: skip
            await nc.publish(f"tison.v1.decode.heartbeat.{worker_id}", b"not a beat")
            await nc.flush()
            await asyncio.sleep(0.1)  # the server's -ERR comes after the flush
            await nc.close()
            return errors

        assert env["TISON_NATS_USER"] != "decode" and own.startswith(env["TISON_NATS_USER"])
        assert asyncio.run(heartbeats(own)) == []
        assert any("permissions violation" in e.lower() for e in asyncio.run(heartbeats("x")))
    finally:
        assert up.stop() == 0


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_up_s_nats_server_speaks_tls_only_when_given_a_certificate(tiny_llama, tmp_path):
    """For services on other hosts: with --nats-tls-cert/--nats-tls-key the nats-server that
    `tison up` starts refuses plain TCP, and its own services trust its CA and serve."""
    import asyncio

    import nats
    from tls_certs import make_pki

    pki = make_pki(tmp_path)
    up = Up(
        tiny_llama, free_port(), "--state-dir", str(tmp_path / "nats"),
        "--nats-tls-cert", str(pki / "server.pem"), "--nats-tls-key", str(pki / "server.key"),
        "--nats-tls-ca", str(pki / "ca.pem"),
    )  # fmt: skip
    try:
        up.wait_serving()
        up.complete(tiny_llama.name)
        (ports,) = (tmp_path / "nats").glob("nats-server_*.ports")
        url = json.loads(ports.read_text())["nats"][0]

        async def plain() -> None:
            nc = await nats.connect(
                url, max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=3
            )
            await nc.close()

        with pytest.raises(Exception):  # noqa: B017 - nats-py's error differs by version
            asyncio.run(plain())
    finally:
        assert up.stop() == 0


def test_a_child_failing_twice_alike_at_start_stops_the_supervisor(tmp_path):
    """A gateway whose model folder lacks a tokenizer fails at start with the same error each
    time: the second time the supervisor gives up, naming the child and the error, instead of
    restarting it for ever."""
    from services.up.plan import ChildSpec, RestartPolicy
    from services.up.supervisor import StartupFailure, Supervisor, child_env

    (tmp_path / "model").mkdir()
    spec = ChildSpec("gateway", ("gateway", "--model", str(tmp_path / "model"), "--port", "1"))
    supervisor = Supervisor([spec], "nats://127.0.0.1:1", child_env("x"), RestartPolicy(0.1))
    supervisor.start_all()
    try:

        def gives_up() -> str | None:
            try:
                supervisor.poll()
            except StartupFailure as e:
                return str(e)
            return None

        error = wait_until(gives_up, 60, "the supervisor to give up on the gateway", 0.1)
        assert error.startswith("gateway: ") and "tokenizer.json: missing" in error
    finally:
        supervisor.stop_all()
