"""Workers of different shapes through the real services: a prefill worker of (2, 1) hands its
KV to a decode worker of (1, 2) (re-sliced by head, routed by layer range, rank to rank over
shm, or each prefill rank to the decode worker's TCP server); completions equal the offline
(1, 1) engine token for token (float32, greedy)."""

import os

import openai
import pytest

from shared.engine.llm import LLM
from shared.sampling.params import SamplingParams

from services_harness import Services, wait_metric

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def model4(tiny_model_factory):
    return tiny_model_factory("llama", num_hidden_layers=4, intermediate_size=256)


@pytest.fixture(scope="module", params=["shm", "tcp"])
def cluster(tmp_path_factory, model4, request):
    s = Services(tmp_path_factory.mktemp("cluster-shapes"), model4)
    s.__enter__()
    common = ["--model", str(model4), "--dtype", "float32", "--heartbeat", "0.2"]
    common += ["--allow-oversubscribe", "--threads", "1"]
    os.environ["TISON_KV_SECRET"] = "test-secret"  # the workers inherit it; TCP is on
    try:
        s.scheduler()
        s.start("prefill", "prefill", *common, "--tp", "2", "--kv-transport", request.param)
        s.start("decode", "decode", *common, "--pp", "2")
        s.gateway()
        s.wait_healthy(120)
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
    async with openai.AsyncOpenAI(
        base_url=cluster.base_url + "/v1", api_key="x", max_retries=0
    ) as client:
        for prompt, ref in zip(PROMPTS, expected):
            out = await client.completions.create(
                model=model4.name, prompt=prompt, max_tokens=16, temperature=0
            )
            assert out.choices[0].text == ref.text, cluster.logs()
            assert out.usage.completion_tokens == len(ref.token_ids)
    if cluster.kv_transport == "tcp":  # the decode worker's TCP server took the pages
        what = "KV bytes received over TCP"
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
        async with openai.AsyncOpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0) as c:
            for prompt, ref in zip(PROMPTS, expected):
                out = await c.completions.create(
                    model=model4.name, prompt=prompt, max_tokens=16, temperature=0
                )
                assert out.choices[0].text == ref.text, s.logs()
    finally:
        s.stop_all()
