"""A decode worker started with `--weights-from peer` and no model folder: it finds the prefill
worker serving the model (weights_ask on NATS), fetches the small files into its cache and
reads its weights from it over TCP, then serves requests with the outputs of the offline
engine loaded from disk. A worker whose secret differs is refused, and one whose model no
peer serves gives up naming the model and the flag: both exit with an error, not a hang."""

import pytest

from shared.engine.llm import LLM
from shared.sampling.params import SamplingParams

from services_harness import Services, assert_completions_equal

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys\n"]
COMMON = ["--dtype", "float32", "--heartbeat", "0.2"]


@pytest.fixture
def cluster(tmp_path, tiny_llama, monkeypatch):
    monkeypatch.setenv("TISON_KV_SECRET", "peer-e2e-secret")
    with Services(tmp_path, tiny_llama) as s:
        s.scheduler()
        s.start("prefill", "prefill", "--model", str(tiny_llama), *COMMON)
        yield s


def peer_decode(s: Services, name: str, model: str, *extra: str):
    absent = s.tmp_path / "no-store" / model  # no such folder: the weights come from a peer
    cache = ["--cache-dir", str(s.tmp_path / "cache")]
    return s.start(name, "decode", "--model", str(absent), *cache, *COMMON, *extra)


async def test_a_decode_worker_with_weights_from_a_peer_serves_the_same_tokens(cluster, tiny_llama):
    peer_decode(cluster, "decode", tiny_llama.name, "--weights-from", "peer")
    cluster.gateway()
    cluster.wait_healthy(120)
    with LLM(tiny_llama, dtype="float32") as llm:
        expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    await assert_completions_equal(cluster, tiny_llama.name, PROMPTS, expected, 24)
    log = (cluster.tmp_path / "decode.log").read_text()
    assert "model loaded from weights peer" in log, log
    cached = cluster.tmp_path / "cache" / "peer-models" / tiny_llama.name
    assert (cached / "config.json").is_file() and not list(cached.glob("*.safetensors"))


async def test_a_wrong_secret_or_an_unserved_model_ends_the_worker_with_a_clear_error(
    cluster, tiny_llama, monkeypatch
):
    monkeypatch.setenv("TISON_KV_SECRET", "not-the-secret")
    wrong = peer_decode(cluster, "wrong", tiny_llama.name, "--weights-from", "peer")
    monkeypatch.setenv("TISON_KV_SECRET", "peer-e2e-secret")
    unserved = peer_decode(cluster, "unserved", "other-model", "--weights-wait", "2")
    assert wrong.wait(120) == 2 and unserved.wait(120) == 2
    log = (cluster.tmp_path / "wrong.log").read_text()
    assert "refused the secret" in log and "TISON_KV_SECRET" in log, log
    log = (cluster.tmp_path / "unserved.log").read_text()
    assert "'other-model'" in log and "--weights-from auto" in log, log
    assert cluster.procs["prefill"].poll() is None  # the peer serves on
