"""Start NATS, the scheduler, the gateway and workers as real subprocesses; tear all down.

    with Services(tmp_path, model_dir) as s:
        s.scheduler()
        s.worker("prefill", "fake-worker", "--role", "prefill")
        s.worker("decode", "fake-worker", "--role", "decode")
        s.gateway()
        s.wait_healthy()
        ... s.base_url ...

Every process runs `tison <subcommand>` through the same interpreter, logs to `<tmp>/<name>.log`
(shown by `logs()` when a test fails), and is terminated (then killed) on exit.
"""

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import nats
import openai
from nats_sync import subscribed

from shared import protocol, subjects
from shared.nats_server import NatsServer
from shared.proc import die_with_parent, stop_processes
from shared.protocol import HeartbeatMsg, SubmitMsg, SubmitReplyMsg
from shared.sampling.params import SamplingParams

from waiting import until, wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent
_LAUNCH = "import sys; from services.cli import main; sys.exit(main(sys.argv[1:]))"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Services:
    """A NATS server plus named service subprocesses sharing it."""

    def __init__(self, tmp_path: Path, model_dir: Path, heartbeat_s: float = 0.2):
        self.tmp_path = Path(tmp_path)
        self.model_dir = Path(model_dir)
        self.heartbeat_s = heartbeat_s  # for the fake workers started by fake_worker()
        self.nats = NatsServer(self.tmp_path / "nats")
        self.procs: dict[str, subprocess.Popen] = {}
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Services":
        self.nats.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def start(self, name: str, *args: str, launch: str = _LAUNCH) -> subprocess.Popen:
        """Run `tison *args --nats-url <server>` as process `name`, through `python -c launch`
        (tests/test_cli_torch_free.py launches with torch made unimportable)."""
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
        log = open(self.tmp_path / f"{name}.log", "ab")
        cmd = [sys.executable, "-c", launch, *args, "--nats-url", self.nats.url]
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,  # a killed test run leaves no services behind
        )
        log.close()
        self.procs[name] = proc
        return proc

    def scheduler(self, *args: str, launch: str = _LAUNCH) -> subprocess.Popen:
        return self.start("scheduler", "scheduler", *args, launch=launch)

    def fake_worker(self, name: str, role: str, *args: str) -> subprocess.Popen:
        beat = str(self.heartbeat_s)
        return self.start(
            name,
            "fake-worker",
            "--role",
            role,
            "--model",
            str(self.model_dir),
            "--heartbeat",
            beat,
            *args,
        )

    def gateway(self, *args: str, launch: str = _LAUNCH) -> subprocess.Popen:
        self.port = free_port()
        model = ("--model", str(self.model_dir), "--port", str(self.port))
        return self.start("gateway", "gateway", *model, *args, launch=launch)

    def health(self) -> int:
        """HTTP status of the gateway's /health (0 when it does not answer)."""
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                return resp.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until the gateway's /health answers 200 and the scheduler (if started) can route."""
        try:
            wait_until(self._healthy, timeout_s, "the gateway's /health to answer 200")
            if "scheduler" in self.procs:
                # A loop of its own, in a thread of its own: a test's loop may be running here.
                with ThreadPoolExecutor(1) as pool:
                    pool.submit(asyncio.run, self._wait_scheduler_routes(timeout_s)).result()
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.logs()}") from None

    def _healthy(self) -> bool:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.logs()}")
        return self.health() == 200

    async def _wait_scheduler_routes(self, timeout_s: float) -> None:
        # The gateway has heard the workers; the scheduler hears them on its own subscription.
        nc = await nats.connect(self.nats.url)
        try:
            what = "the scheduler to know a prefill and a decode worker"
            await until(lambda: scheduler_routes(nc), timeout_s, what)
        finally:
            await nc.close()

    def kill(self, name: str) -> None:
        """kill -9 one process."""
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop_all(self, timeout_s: float = 10.0) -> None:
        procs, self.procs = list(self.procs.values()), {}
        stop_processes(procs, timeout_s)
        self.nats.stop()

    def logs(self, tail_chars: int = 3000, without: str = "") -> str:
        """The tail of each process's log, less its lines that contain `without` if given."""
        parts = []
        for path in sorted(self.tmp_path.glob("*.log")):
            text = path.read_text(errors="replace")
            if without:
                text = "".join(line for line in text.splitlines(True) if without not in line)
            parts.append(f"--- {path.name}\n{text[-tail_chars:]}")
        return "\n".join(parts)


async def metric_samples(cluster, name: str, role: str | None = None) -> list[re.Match]:
    """A gauge's samples (labels, value) in the gateway's /metrics, of the workers of `role`."""
    async with aiohttp.ClientSession() as http:
        async with http.get(cluster.base_url + "/metrics") as resp:
            text = await resp.text()
    pattern = rf"^{name}(?:\{{(?P<labels>[^}}]*)\}})? (?P<value>\S+)$"
    return [
        m
        for m in re.finditer(pattern, text, re.M)
        if role is None or f'role="{role}"' in (m["labels"] or "")
    ]


async def metric(cluster, name: str, role: str | None = None) -> float:
    """Sum of a gauge over the workers (of `role`) in the gateway's /metrics."""
    return sum(float(m["value"]) for m in await metric_samples(cluster, name, role))


async def wait_metric(cluster, name: str, ok, what: str, role: str | None = None) -> None:
    """Until ok(metric(cluster, name, role)) holds; a timeout says the value last read, each
    worker's part of it and, where the cluster keeps them, the services' logs."""
    last = None

    async def holds() -> bool:
        nonlocal last
        last = await metric(cluster, name, role)
        return ok(last)

    try:
        await until(holds, 30, what)
    except AssertionError as e:
        parts = [m.group(0) for m in await metric_samples(cluster, name, role)]
        # a Services' processes, less the gateway's access lines of these very polls
        logs = cluster.logs(without="aiohttp.access") if hasattr(cluster, "logs") else ""
        raise AssertionError(f"{e} ({name} last read {last}: {parts})\n{logs}") from None


async def wait_pages_free(cluster) -> None:
    await wait_metric(cluster, "tison_kv_pages_used", lambda used: used == 0, "KV pages all free")


async def scheduler_routes(nc) -> bool:
    """Whether the scheduler knows a live prefill and a live decode worker: only then does it
    answer a request no KV pool can hold with TOO_LONG (placing it nowhere)."""
    probe = SubmitMsg("probe", "probe", (1,), SamplingParams(max_tokens=2**40), time.time() + 30)
    try:
        reply = await nc.request(subjects.scheduler_submit(), protocol.encode(probe), timeout=5)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        return False  # not subscribed yet
    return protocol.decode(reply.data, SubmitReplyMsg).status == protocol.TOO_LONG


async def next_heartbeat(url: str, role: str) -> HeartbeatMsg:
    """The first heartbeat of a `role` worker that NATS takes in after this call. A new
    subscription gets only what the server takes in after it, so the beat counts all the work
    whose messages reached the server before (the worker published those before the beat)."""
    nc = await nats.connect(url)
    beats: list[HeartbeatMsg] = []

    async def keep(msg):
        beat = protocol.decode(msg.data, HeartbeatMsg)
        if beat.role == role:
            beats.append(beat)

    try:
        await nc.subscribe(subjects.all_heartbeats(), cb=keep)
        await until(lambda: beats, 30, f"a heartbeat of a {role} worker")
    finally:
        await nc.close()
    return beats[0]


async def nats_bytes_per_request(cluster, send) -> int:
    """Bytes published on NATS (heartbeats aside) for the requests `await send()` makes, each
    run to its end by the workers (length or stop: the gateway then publishes no cancel)."""
    nc = await nats.connect(cluster.nats.url)
    counted: list[int] = []
    marker, marked = nc.new_inbox(), asyncio.Event()

    async def count(msg):
        if msg.subject == marker:
            marked.set()
        elif ".heartbeat." not in msg.subject:
            counted.append(len(msg.data))

    await nc.subscribe(">", cb=count)
    await subscribed(nc)
    await send()
    # Every message of those requests reached the server before their answers did, so before
    # this marker; NATS delivers to a subscriber in the order the server took messages in.
    await nc.publish(marker, b"")
    await until(marked.is_set, 30, "the marker behind the requests' messages")
    await nc.close()
    return sum(counted)


async def stream_until_error(client, model: str, started: asyncio.Event, **kw):
    """Streams one completion; (time it ended, error text or None). Sets `started` on the
    first chunk."""
    stream = await client.completions.create(
        model=model, prompt="Once upon a time", stream=True, **kw
    )
    try:
        async for _ in stream:
            started.set()
    except openai.APIError as e:
        return time.monotonic(), str(e)
    return time.monotonic(), None


def start_prefill_tp2_decode_pp2(
    s: Services, model_dir: Path, kv_transport: str = "shm", scheduler_args=()
) -> None:
    """A scheduler, a prefill worker of shape (2, 1), a decode worker of (1, 2) and a gateway,
    float32 on one thread a rank, until healthy."""
    common = ["--model", str(model_dir), "--dtype", "float32", "--heartbeat", "0.2"]
    common += ["--allow-oversubscribe", "--threads", "1"]
    s.scheduler(*scheduler_args)
    s.start("prefill", "prefill", *common, "--tp", "2", "--kv-transport", kv_transport)
    s.start("decode", "decode", *common, "--pp", "2")
    s.gateway()
    s.wait_healthy(120)


async def assert_completions_equal(
    s: Services, model: str, prompts, expected, max_tokens: int
) -> None:
    """Greedy completions of max_tokens through the gateway equal the offline engine's
    outputs `expected`, text and token count."""
    async with openai.AsyncOpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0) as c:
        for prompt, ref in zip(prompts, expected):
            out = await c.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0
            )
            assert out.choices[0].text == ref.text, s.logs()
            assert out.usage.completion_tokens == len(ref.token_ids)


def start_workers(s: Services, model_dir, layout: str, *extra: str) -> None:
    common = ["--model", str(model_dir), "--dtype", "float32", "--heartbeat", "0.2", *extra]
    if layout == "colocated":
        s.start("colocated", "colocated", *common)
    else:
        s.start(
            "prefill", "prefill", *common, *(["--kv-transport", layout] if layout != "auto" else [])
        )
        s.start("decode", "decode", *common)


def cluster_for(tmp_path_factory, model_dir, layout: str, monkeypatch_env=None):
    s = Services(tmp_path_factory.mktemp(f"cluster-{layout}"), model_dir)
    s.__enter__()
    try:
        s.scheduler()
        start_workers(s, model_dir, layout)
        s.gateway()
        s.wait_healthy(90)
    except BaseException:
        s.stop_all()  # the caller gets no cluster to stop
        raise
    return s
