"""Per-request sampling parameters, validated at construction (OpenAI / vLLM semantics)."""

from collections.abc import Mapping
from dataclasses import dataclass

from shared.errors import InvalidRequestError
from shared.sampling.structured import StructuredOutput

MAX_LOGPROBS = 20  # OpenAI's top_logprobs ceiling
MAX_LOGIT_BIAS = 300  # entries of logit_bias at most (OpenAI rejects more)
MAX_BIAS = 100.0  # |bias| at most (OpenAI's range)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. temperature == 0 means greedy."""

    max_tokens: int = 16  # new tokens at most
    min_tokens: int = 0  # stop tokens/strings are ignored until this many were generated
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0  # keep tokens with prob >= min_p * max prob
    presence_penalty: float = 0.0  # [-2, 2], OpenAI
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI
    repetition_penalty: float = 1.0  # > 0, HF/CTRL style, over prompt and output
    seed: int | None = None  # same seed -> same tokens, whatever else is in the batch
    stop: tuple[str, ...] = ()  # stop strings, left out of the output text
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens, besides EOS
    ignore_eos: bool = False  # keep going past EOS (benchmarks)
    logprobs: int | None = None  # None: none; n >= 0: chosen token's logprob + top-n
    # None: off; n >= 0 (vLLM's prompt_logprobs): each prompt token's logprob from the second
    # on, given the tokens before it, + top-n at its position (echo, scoring)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # prefix cache namespace (vLLM's cache_salt): requests share cached KV pages only with
    # requests of the same salt, so tenants never read each other's prompts' KV
    cache_salt: str = ""
    # the output must match this (JSON schema, regex, choice, grammar); the engine masks the
    # tokens that cannot follow (shared/engine/grammars.py)
    structured: StructuredOutput | None = None
    # (token id, bias in [-100, 100]) added to the logits before sampling, OpenAI semantics;
    # sorted by token id. The engine rejects ids outside its model's vocabulary.
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        # Accept lists from callers; keep tuples so the object stays hashable/frozen.
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop", str))
        object.__setattr__(
            self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids", int)
        )
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self._validate()

    def _validate(self) -> None:
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens",
            "must be an integer >= 1",
        )
        _check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be an integer in [0, max_tokens]",
        )
        _check(_num(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        _check(_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(
            isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "must be -1, 0 (off) or >= 1"
        )
        _check(_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_num(value) and -2 <= value <= 2, name, "must be in [-2, 2]")
        _check(
            _num(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be > 0",
        )
        _check(self.seed is None or _int64(self.seed), "seed", "must be a 64-bit integer")
        for name in ("max_tokens", "min_tokens", "top_k"):
            _check(_int64(getattr(self, name)), name, "must fit in 64 bits")
        _check(
            all(_int64(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be integers in [0, 2**63)",
        )
        _check(
            self.logprobs is None
            or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"must be an integer in [0, {MAX_LOGPROBS}]",
        )
        _check(
            self.prompt_logprobs is None
            or (_int64(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
            "prompt_logprobs",
            f"must be an integer in [0, {MAX_LOGPROBS}]",
        )
        _check(all(s for s in self.stop), "stop", "stop strings must not be empty")
        _check(isinstance(self.cache_salt, str), "cache_salt", "must be a string")
        _check(
            self.structured is None or isinstance(self.structured, StructuredOutput),
            "structured",
            "must be a StructuredOutput",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _int64(value) -> bool:
    """A (non-bool) integer the wire (msgpack) and torch carry: a signed 64-bit one."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63


def _num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _check(ok: bool, field_name: str, problem: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, problem)


def _bias_pairs(value) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, float bias) pairs, from a {id: bias} mapping or pairs."""
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [tuple(p) for p in items or ()]
    except TypeError:
        raise InvalidRequestError("logit_bias", "must map token ids to biases") from None
    _check(len(pairs) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} entries")
    for pair in pairs:
        _check(len(pair) == 2, "logit_bias", "entries must be (token id, bias) pairs")
        token, bias = pair
        _check(_int64(token) and token >= 0, "logit_bias", "token ids must be integers >= 0")
        _check(
            _num(bias) and -MAX_BIAS <= bias <= MAX_BIAS,
            "logit_bias",
            f"biases must be numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}]",
        )
    ids = [token for token, _ in pairs]
    _check(len(set(ids)) == len(ids), "logit_bias", "token ids must not repeat")
    return tuple(sorted((token, float(bias)) for token, bias in pairs))


def _as_tuple(value, field_name: str, kind: type) -> tuple:
    if isinstance(value, kind):
        value = (value,)
    value = tuple(value or ())
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise InvalidRequestError(field_name, f"must be a list of {kind.__name__}")
    return value


__all__ = ["MAX_BIAS", "MAX_LOGIT_BIAS", "MAX_LOGPROBS", "SamplingParams"]
