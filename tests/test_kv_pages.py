"""The page rule (shared/kv/pages.py), and its three users agreeing on it: the router predicts
exactly what the engine's and the fake decode worker's reservations accept."""

import subprocess
import sys

import pytest

from services.fake_worker.batch import DecodeBatch
from services.fake_worker.tokens import FakeModelInfo
from services.scheduler.policy import Router
from shared.engine.request import Request
from shared.engine.scheduler import Scheduler
from shared.kv.allocator import PageAllocator
from shared.kv.pages import fits, pages_for, pages_to_admit, pages_to_grow, pages_to_reserve
from shared.protocol import DecodeAssignMsg, HeartbeatMsg, SubmitMsg
from shared.sampling.params import SamplingParams

PAGE = 4


def test_pages_for_rounds_up():
    assert [pages_for(n, PAGE) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


def test_admission_is_the_tokens_so_far_and_the_next_one():
    assert [pages_to_admit(n, PAGE) for n in (1, 3, 4, 7, 8)] == [1, 1, 2, 2, 3]
    assert fits(2, 7, PAGE) and not fits(2, 8, PAGE) and not fits(0, 1, PAGE)


def test_growth_is_what_the_held_pages_lack():
    assert pages_to_grow(2, 8, PAGE) == 0  # 8 tokens fit 2 pages
    assert pages_to_grow(2, 9, PAGE) == 1  # the 9th takes a page
    assert pages_to_grow(3, 5, PAGE) == 0  # more than enough is no negative growth


def test_the_module_is_pure():
    code = "import sys, shared.kv.pages, shared.kv.allocator; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def engine_accepts(free: int, prompt_len: int, max_tokens: int, chunk=None, groups=0) -> bool:
    allocator = PageAllocator(free)
    req = Request(
        request_id="r",
        prompt_token_ids=list(range(prompt_len)),
        params=SamplingParams(max_tokens=max_tokens),
        seed=0,
        stop_token_ids=frozenset(),
        max_total_tokens=10_000,
        arrival=0,
    )
    return Scheduler(allocator, PAGE, 64, 8, groups, chunk).reserve(req)


def fake_accepts(free: int, prompt_len: int, max_tokens: int) -> bool:
    info = FakeModelInfo("m", 2, 256, (5, 6, 7))
    batch = DecodeBatch(info, PageAllocator(free), PAGE)
    sampling = SamplingParams(max_tokens=max_tokens)
    return batch.reserve(DecodeAssignMsg("r", "gw", "p", (1,) * prompt_len, sampling)) is not None


def router_sends(free: int, prompt_len: int, max_tokens: int, chunk=0, groups=0) -> bool:
    router = Router()
    for role in ("decode", "prefill"):
        beat = HeartbeatMsg(
            role, role, "m", 256, 0.5, free_pages=free, total_pages=64, page_size=PAGE,
            chunk_tokens=chunk, chunk_groups=groups,
        )  # fmt: skip
        router.observe(beat, 0.0)
    sampling = SamplingParams(max_tokens=max_tokens)
    return router.choose(SubmitMsg("r", "gw", (1,) * prompt_len, sampling, 9.0), 0.0) is not None


@pytest.mark.parametrize("free", [1, 2, 3])
@pytest.mark.parametrize("prompt_len", [1, 3, 4, 7, 8, 11])
@pytest.mark.parametrize("max_tokens", [1, 200])
def test_router_engine_and_fake_worker_agree(free, prompt_len, max_tokens):
    expected = fits(free, prompt_len, PAGE)
    assert engine_accepts(free, prompt_len, max_tokens) == expected
    assert fake_accepts(free, prompt_len, max_tokens) == expected
    assert router_sends(free, prompt_len, max_tokens) == expected


@pytest.mark.parametrize("free", [2, 5, 6, 7, 8])
@pytest.mark.parametrize("prompt_len", [3, 7, 8, 11, 15])
def test_router_and_engine_agree_on_a_capped_decode_worker(free, prompt_len):
    """Chunked layers capped (chunks of 8 in 2 page groups): a reservation also takes each
    group's pages of the first decoded token's window (the prompt's last chunk and that token),
    and the router counts them as the decode engine does."""
    expected = fits(free, prompt_len, PAGE, chunk=8, groups=2)
    assert engine_accepts(free, prompt_len, 1, chunk=8, groups=2) == expected
    assert router_sends(free, prompt_len, 1, chunk=8, groups=2) == expected
    window = 2 * (pages_for(prompt_len + 1, PAGE) - prompt_len // 8 * 8 // PAGE)
    assert pages_to_reserve(prompt_len, PAGE, 8, 2) == pages_to_admit(prompt_len, PAGE) + window
