"""The log-probabilities of one sampled token: one type from the sampler's results to the
OpenAI response. The engine builds it once per sampled token (LLMEngine._logprobs), keeps it on
the Request and hands it out in StepOutput; the wire carries it as is (shared/protocol.py); the
gateway and LLM read it. Pure: no torch."""

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one chosen token and the top alternatives at its position (the raw
    model distribution, before penalties and filters)."""

    token_id: int  # engine sets: the chosen token
    logprob: float  # engine sets: its log-probability
    top_ids: tuple[int, ...] = ()  # engine sets: the top-n token ids, most likely first
    top_logprobs: tuple[float, ...] = ()  # engine sets: their log-probabilities
