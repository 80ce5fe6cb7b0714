"""Prompt logprobs over real NATS with real model workers, the test acting as the gateway (which
does not pass the field yet): the index-0 TokenItem carries the offline engine's prompt
logprobs, disaggregated (the prefill worker computes them, also when the decode worker's
prefix cache holds part of the prompt) and colocated (the worker's own engine does)."""

import asyncio
import time

import nats
import pytest

from shared import protocol, subjects
from shared.protocol import GatewayBeatMsg, SubmitMsg, SubmitReplyMsg, TokenItem, TokensMsg
from shared.sampling.params import SamplingParams

from engine_helpers import LOGPROB_TOL, make_prompts, new_engine, run_all
from services_harness import Services, next_heartbeat, scheduler_routes
from waiting import until

GATEWAY = "gw-prompt-logprobs"
PARAMS = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3, ignore_eos=True)
PROMPT = make_prompts([40], seed=7)[0]  # 2 full pages: a decode worker's cache can hold them


@pytest.fixture(scope="module")
def offline(tiny_llama):
    """The offline engine's request: output tokens and prompt logprobs."""
    engine = new_engine(tiny_llama)
    req = engine.add_request("ref", PROMPT, PARAMS)
    run_all(engine)
    engine.close()
    return req


def start(tmp_path, model_dir, layout: str) -> Services:
    s = Services(tmp_path, model_dir).__enter__()
    try:
        s.scheduler("--local-prefill-tokens", "0")  # disaggregated: the prefill worker computes
        common = ["--model", str(model_dir), "--dtype", "float32", "--heartbeat", "0.2"]
        if layout == "colocated":
            s.start("colocated", "colocated", *common)
        else:
            s.start("prefill", "prefill", *common)
            s.start("decode", "decode", *common)
    except BaseException:
        s.stop_all()
        raise
    return s


async def run_request(nc, request_id: str) -> list[TokenItem]:
    """Submits PROMPT as gateway GATEWAY; the request's items, in order, up to its finish."""
    items: list[TokenItem] = []
    done = asyncio.Event()

    async def on_tokens(msg):
        for item in protocol.decode(msg.data, TokensMsg).items:
            if item.request_id == request_id:
                items.append(item)
                if item.finish_reason is not None:
                    done.set()

    sub = await nc.subscribe(subjects.gateway_tokens(GATEWAY), cb=on_tokens)
    beat = GatewayBeatMsg(GATEWAY, 10.0)  # the decode worker keeps requests of a live gateway
    await nc.publish(subjects.gateway_heartbeat(GATEWAY), protocol.encode(beat))
    submit = SubmitMsg(request_id, GATEWAY, tuple(PROMPT), PARAMS, time.time() + 60)
    reply = await nc.request(subjects.scheduler_submit(), protocol.encode(submit), timeout=10)
    assert protocol.decode(reply.data, SubmitReplyMsg).status == protocol.ACCEPTED
    await asyncio.wait_for(done.wait(), 60)
    await sub.unsubscribe()
    return items


def assert_carries(items: list[TokenItem], ref) -> None:
    """The index-0 item holds the offline prompt logprobs, no other item any."""
    assert [t for item in items for t in item.token_ids] == ref.output_token_ids
    first, rest = items[0], items[1:]
    assert first.index == 0 and first.token_ids
    got = first.prompt_logprobs
    assert [v.token_id for v in got] == [v.token_id for v in ref.prompt_logprobs] == PROMPT[1:]
    for ours, theirs in zip(got, ref.prompt_logprobs):
        assert ours.logprob == pytest.approx(theirs.logprob, abs=LOGPROB_TOL)
        assert ours.top_logprobs == pytest.approx(theirs.top_logprobs, abs=LOGPROB_TOL)
        assert len(ours.top_ids) == 3
    assert all(item.prompt_logprobs == () for item in rest)


@pytest.mark.parametrize("layout", ["disaggregated", "colocated"])
async def test_the_first_item_carries_the_prompt_logprobs(tmp_path, tiny_llama, offline, layout):
    """Twice the same prompt: the second time the decode worker's reservation holds its cached
    pages (the prefill worker does not send them), and every prompt logprob comes all the same."""
    s = start(tmp_path, tiny_llama, layout)
    try:
        nc = await nats.connect(s.nats.url)
        try:
            await until(lambda: scheduler_routes(nc), 90, "the scheduler to route")
            for i in range(2):
                assert_carries(await run_request(nc, f"{layout}-{i}"), offline)
            beat = await next_heartbeat(s.nats.url, "decode")
            assert beat.prefix.hit_tokens >= 32  # the second reservation found the first's pages
        finally:
            await nc.close()
    except BaseException:
        print(s.logs())
        raise
    finally:
        s.stop_all()
