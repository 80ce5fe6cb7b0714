"""Workers of different shapes through the real services: a prefill worker of (2, 1) hands its
KV to a decode worker of (1, 2) (re-sliced by head, routed by layer range, rank to rank over
shm, or each prefill rank to the decode worker's TCP or dist server); completions equal the
offline (1, 1) engine token for token (float32, greedy)."""

import os

import pytest

from shared.engine.llm import LLM
from shared.sampling.params import SamplingParams

from services_harness import (
    Services,
    assert_completions_equal,
    start_prefill_tp2_decode_pp2,
    wait_metric,
)

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def model4(tiny_model_factory):
    return tiny_model_factory("llama", num_hidden_layers=4, intermediate_size=256)


@pytest.fixture(scope="module", params=["shm", "tcp", "dist"])
def cluster(tmp_path_factory, model4, request):
    s = Services(tmp_path_factory.mktemp("cluster-shapes"), model4)
    s.__enter__()
    os.environ["TISON_KV_SECRET"] = "test-secret"  # the workers inherit it; TCP and dist are on
    try:
        start_prefill_tp2_decode_pp2(s, model4, request.param)
    except Exception:
        print(s.logs())
        s.stop_all()
        raise
    s.kv_transport = request.param
    yield s
    s.stop_all()
    del os.environ["TISON_KV_SECRET"]


async def test_prefill_tp2_to_decode_pp2_equals_offline(cluster, model4):
    with LLM(model4, dtype="float32") as llm:
        expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
    await assert_completions_equal(cluster, model4.name, PROMPTS, expected, 16)
    if cluster.kv_transport != "shm":  # the decode worker's TCP or dist server took the pages
        what = f"KV bytes received over {cluster.kv_transport}"
        await wait_metric(cluster, "tison_kv_transfer_bytes", lambda n: n > 0, what, "decode")


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
async def test_colocated_worker_of_each_shape_equals_offline(tmp_path_factory, model4, tp, pp):
    with LLM(model4, dtype="float32") as llm:
        expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
    s = Services(tmp_path_factory.mktemp(f"colocated-{tp}x{pp}"), model4)
    s.__enter__()
    try:
        s.scheduler()
        s.start(
            "colocated",
            "colocated",
            "--model",
            str(model4),
            "--dtype",
            "float32",
            "--heartbeat",
            "0.2",
            "--allow-oversubscribe",
            "--threads",
            "1",
            "--tp",
            str(tp),
            "--pp",
            str(pp),
        )
        s.gateway()
        s.wait_healthy(120)
        await assert_completions_equal(s, model4.name, PROMPTS, expected, 16)
    finally:
        s.stop_all()
