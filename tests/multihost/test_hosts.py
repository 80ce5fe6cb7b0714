"""compose.yaml on test hosts (loadtest/multihost.py): NATS, the scheduler, a prefill worker, two
decode workers and the gateway, each in a network namespace of its own on one switch, started
from the file's commands with its NATS token, KV secret and API key; the official openai client
on this process's own address on the switch. Skips where the machine cannot make namespaces."""

import asyncio
import subprocess
import time
from pathlib import Path

import nats
import openai
import pytest

from loadtest import netns
from loadtest.multihost import Deployment
from shared.default_model import default_model_dir
from shared.engine.llm import LLM
from shared.sampling.params import SamplingParams

from waiting import until

WHY = netns.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"multi-host harness: {WHY}")
ENV = {"TISON_API_KEY": "mh-key", "TISON_NATS_TOKEN": "mh-token", "TISON_KV_SECRET": "mh-kv"}
MODEL = default_model_dir()  # compose.yaml's default model folder
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with netns.Network() as net:
        with Deployment(net, tmp_path_factory.mktemp("multihost"), ENV, {"decode": 2}) as d:
            d.up()
            yield d


@pytest.fixture
async def client(deployment):
    url, key = deployment.base_url + "/v1", ENV["TISON_API_KEY"]
    async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL)  # the workers' defaults: the dtype this CPU runs best


async def test_greedy_outputs_across_hosts_equal_one_host(deployment, client, llm):
    greedy = SamplingParams(temperature=0, max_tokens=24)
    for prompt in PROMPTS:
        [ref] = llm.generate([prompt], greedy)
        out = await client.completions.create(
            model=MODEL.name, prompt=prompt, max_tokens=24, temperature=0
        )
        assert (out.choices[0].text, out.usage.prompt_tokens) == (
            ref.text,
            len(ref.prompt_token_ids),
        )
    url = deployment.base_url + "/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):  # compose.yaml's API key is required
            await stranger.models.list()


async def test_nats_takes_only_token_holders_and_keeps_the_token_off_its_command_line(deployment):
    nats_proc = deployment.procs["nats"]
    cmdline = Path(f"/proc/{nats_proc.pid}/cmdline").read_bytes().decode()
    assert "nats-server" in cmdline and ENV["TISON_NATS_TOKEN"] not in cmdline
    url = f"nats://{deployment.hosts['nats'].address}:4222"
    with pytest.raises(Exception, match="(?i)authorization"):
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0)
    nc = await nats.connect(url, token=ENV["TISON_NATS_TOKEN"], allow_reconnect=False)
    await nc.close()


async def test_kv_bytes_cross_only_the_prefill_decode_links(deployment, client, llm):
    """A prompt's KV goes from the prefill host straight to a decode host: the NATS host's
    traffic does not grow with the prompt, the prefill host's does, by its KV bytes."""
    per_token = llm.engine.kv_spec.page_size_bytes // llm.engine.config.page_size
    hosts = deployment.hosts

    async def moved(prompt: list[int]) -> dict[str, int]:
        before = {name: sum(h.counters()) for name, h in hosts.items()}
        await client.completions.create(model=MODEL.name, prompt=prompt, max_tokens=1)
        return {name: sum(h.counters()) - before[name] for name, h in hosts.items()}

    short, long = [[7 + i % 50 for i in range(n)] for n in (8, 488)]
    await moved(short)  # connections made, first-use costs paid
    small, big = await moved(short), await moved(long)
    kv = (len(long) - len(short)) * per_token  # ~1.4 MB of the bundled model's KV
    grew = {name: big[name] - small[name] for name in hosts}
    decode = grew["decode-1"] + grew["decode-2"]
    assert kv <= grew["prefill"] < 1.15 * kv, (grew, kv)  # TCP/IP headers on top
    assert kv <= decode < 1.15 * kv, (grew, kv)
    # the NATS host carries the prompt's token ids (a few bytes each, a few hops), no KV
    assert grew["nats"] < 0.05 * kv, (grew, kv)


async def test_a_cut_decode_host_fails_its_streams_and_rejoins_when_healed(deployment, client):
    cut = deployment.hosts["decode-1"]
    cut_id = deployment.worker_id("decode-1")
    extra = {"ignore_eos": True}

    async def stream(i: int, started: asyncio.Event):
        """(time it ended, error text or None)."""
        tokens = 0
        out = await client.completions.create(
            model=MODEL.name, prompt=f"# task {i}\n", max_tokens=480, stream=True, extra_body=extra
        )
        try:
            async for _ in out:
                tokens += 1
                if tokens == 4:
                    started.set()
        except openai.APIError as e:
            return time.monotonic(), str(e)
        return time.monotonic(), None

    other = deployment.worker_id("decode-2")

    def both_busy() -> bool:  # as their next heartbeats tell
        used = deployment.metric("tison_kv_pages_used")
        return used[cut_id] > 0 and used[other] > 0

    # Six streams of ~2 s, cut once heartbeats show both hosts serving them; on a loaded
    # machine the heartbeats can come after the streams end: then six more.
    for _ in range(3):
        flags = [asyncio.Event() for _ in range(6)]
        streams = [asyncio.create_task(stream(i, f)) for i, f in enumerate(flags)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 60)
        await until(both_busy, 10, "streams on both decode hosts", 0.1)
        if not any(s.done() for s in streams):
            break
        await asyncio.gather(*streams)
    else:
        pytest.fail("three times the streams ended before both decode hosts were seen busy")
    cut.cut()
    cut_at = time.monotonic()
    try:
        ends = await asyncio.gather(*streams)
        errors = [(at - cut_at, err) for at, err in ends if err is not None]
        assert errors, [(at - cut_at, err) for at, err in ends]  # decode-1's streams
        for after, err in errors:
            assert after < 10 and cut_id in err and "unreachable" in err, (after, err)
        assert len(errors) < len(ends)  # decode-2's streams went on to their end
        for i in range(4):  # new requests go to the other decode host
            out = await client.completions.create(model=MODEL.name, prompt=f"{i}", max_tokens=8)
            assert out.choices[0].finish_reason in ("length", "stop")
    finally:
        cut.heal()
    healed_at = time.monotonic()
    # rejoined: heard again, then given a request of its own
    await until(lambda: cut_id in deployment.workers(), 15, "decode-1 heard again", 0.2)
    received = deployment.metric("tison_kv_transfer_bytes")[cut_id]

    async def serves() -> bool:
        await client.completions.create(model=MODEL.name, prompt="again", max_tokens=2)
        return deployment.metric("tison_kv_transfer_bytes")[cut_id] > received

    await until(serves, 15 - (time.monotonic() - healed_at), "decode-1 given a request")
    # no page stays reserved, on the prefill host or either decode host
    pages = deployment.metric
    await until(lambda: not any(pages("tison_kv_pages_used").values()), 15, "every page free")


async def test_a_killed_decode_worker_comes_back_by_its_restart_policy(deployment, client):
    """compose.yaml's `restart: unless-stopped`: decode-2 killed -9 is started again on its
    host, is heard under a new id, is routed to, and no page stays reserved."""
    old_id = deployment.worker_id("decode-2")
    deployment.procs["decode-2"].kill()
    killed_at = time.monotonic()
    await until(lambda: deployment.restarts["decode-2"] == 1, 10, "decode-2 started again")

    def new_id() -> str | None:
        try:
            found = deployment.worker_id("decode-2")
        except LookupError:
            return None
        return found if found != old_id else None

    back = await until(new_id, 60, "decode-2 heard again under its new pid", 0.2)
    await until(lambda: old_id not in deployment.workers(), 15, "the dead id forgotten", 0.2)
    for i in range(4):  # served meanwhile and after, whichever decode host a request gets
        out = await client.completions.create(model=MODEL.name, prompt=f"{i}", max_tokens=4)
        assert out.choices[0].finish_reason in ("length", "stop")

    async def serves() -> bool:
        await client.completions.create(model=MODEL.name, prompt="again", max_tokens=2)
        return deployment.metric("tison_kv_transfer_bytes").get(back, 0) > 0

    await until(serves, 30, "the restarted decode-2 given a request")
    pages = deployment.metric
    await until(lambda: not any(pages("tison_kv_pages_used").values()), 15, "every page free")
    print(f"decode-2 back and serving {time.monotonic() - killed_at:.1f} s after the kill")


def test_the_network_leaves_nothing_behind(tmp_path):
    """Namespaces, hosts files and links go on exit, after a failure too; those of a run that
    was killed go when the next run starts."""
    stale = f"{netns.PREFIX}{0x3FFFFF:x}x0-gone"  # pid 4194303: no such process
    subprocess.run(["ip", "netns", "add", stale], check=True)
    (netns.NETNS_ETC / stale).mkdir(parents=True, exist_ok=True)
    with pytest.raises(RuntimeError, match="boom"):
        with netns.Network() as net:
            assert stale not in namespaces()
            host = net.add_host("a")
            assert host.ns in namespaces() and (netns.NETNS_ETC / host.ns / "hosts").exists()
            raise RuntimeError("boom")
    assert not [ns for ns in namespaces() if ns.startswith(f"{netns.PREFIX}{net.tag}-")]
    assert not (netns.NETNS_ETC / host.ns).exists() and not (netns.NETNS_ETC / stale).exists()
    assert subprocess.run(["ip", "link", "show", f"t{net.tag}r"], capture_output=True).returncode


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
