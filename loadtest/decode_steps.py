"""Decode steps of an LLMEngine in this process, for the benchmarks that time them: requests
whose prompts are all computed first, then the steps that decode them, one at a time."""

import statistics
import time

from shared.engine.engine import LLMEngine
from shared.sampling.params import SamplingParams


def prefill(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, tag: str) -> None:
    """Adds a greedy request of `new_tokens` tokens per prompt (ids `tag`-i) and steps until
    every prompt is computed: the steps after this one decode only."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()


def median_step_s(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    """The median seconds of a decode step of len(prompts) rows (`prefill` first), each step
    timed until it returns, that is once its sampled tokens are on the host."""
    prefill(engine, prompts, new_tokens, f"steps-{time.monotonic_ns()}")
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
