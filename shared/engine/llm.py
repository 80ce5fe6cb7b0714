"""The offline API: LLM(model_dir).generate(prompts, SamplingParams)."""

import itertools
from pathlib import Path

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.output import CompletionOutput, TextTracker
from shared.engine.request import FinishReason
from shared.sampling.params import SamplingParams
from shared.tokenizer.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    """A tokenizer and an engine over one model folder. Engine options: see EngineConfig
    (tp=T, pp=P run the model as T x P ranks; `close()` or a `with` block stops them)."""

    def __init__(self, model_dir: str | Path, dtype: str = "auto", **engine_options):
        self.tokenizer = Tokenizer.from_dir(model_dir)
        config = EngineConfig(model_dir=Path(model_dir), dtype=dtype, **engine_options)
        self.engine = LLMEngine(config, extra_eos_ids=self.tokenizer.eos_token_ids)
        self._ids = itertools.count()
        self._trackers: dict[str, tuple[CompletionOutput, TextTracker]] = {}

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Runs every prompt to completion (batched together); outputs in prompt order."""
        prompts = (
            [prompts] if isinstance(prompts, str) or _is_token_list(prompts) else list(prompts)
        )
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        encoded = [p if _is_token_list(p) else self.tokenizer.encode(p) for p in prompts]
        outputs = []
        try:
            for ids, p in zip(encoded, params_list):
                outputs.append(self.submit(ids, p))
            self.run(outputs)
        finally:
            for o in outputs:
                if o.finish_reason is None:
                    self.engine.abort(o.request_id)
        return outputs

    def chat(
        self, conversations: list[list[dict]], params: SamplingParams | None = None
    ) -> list[CompletionOutput]:
        return self.generate([self.tokenizer.encode_chat(c) for c in conversations], params)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> CompletionOutput:
        """Adds one request; `run` (or `step`) moves it on."""
        request_id = f"req-{next(self._ids)}"
        self.engine.add_request(request_id, prompt_token_ids, params)
        out = CompletionOutput(request_id, list(prompt_token_ids))
        out.logprobs = [] if params.logprobs is not None else None
        out.prompt_logprobs = [] if params.prompt_logprobs is not None else None
        self._trackers[request_id] = (
            out,
            TextTracker(self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens),
        )
        return out

    def step(self) -> None:
        for s in self.engine.step():
            out, tracker = self._trackers[s.request.request_id]
            out.token_ids += s.new_token_ids
            if out.logprobs is not None:
                out.logprobs += s.new_logprobs
            if out.prompt_logprobs is not None:
                out.prompt_logprobs += s.prompt_logprobs
            text, stopped = tracker.add(s.new_token_ids)
            if s.request.finished and not stopped:
                tail, stopped = tracker.flush()
                text += tail
            out.text += text
            if stopped:  # a stop string: the engine may not know yet
                self.engine.finish(out.request_id, FinishReason.STOP)
                out.finish_reason, out.stop_reason = (
                    FinishReason.STOP.value,
                    tracker.matcher.matched,
                )
            elif s.request.finished:
                out.finish_reason = s.request.finish_reason.value
                out.stop_reason = s.request.stop_reason
            if out.finish_reason is not None:
                del self._trackers[out.request_id]

    def run(self, outputs: list[CompletionOutput]) -> None:
        while any(o.finish_reason is None for o in outputs):
            self.step()

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_token_list(p) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) for t in p)
