"""Workloads: the requests of a run, made up front and reproducible from a seed.

- random: prompts of random tokens, input and output lengths drawn from distributions;
- shared-prefix: a few long common system prompts, each request one of them plus its own tail
  (like coding-agent traces hitting a prefix cache);
- sharegpt: the first human turn of each conversation in a ShareGPT-format JSON file, the
  output length taken from the reply that followed it (vLLM's rules);
- mixed: several workloads interleaved at random;
- agent: multi-turn sessions as a coding agent sends them: a shared system prompt, then turns
  that each resend the whole history (the previous prompt, the output the server returned for
  it, a new user message). Only the user messages are made up front; a turn's prompt is built
  when the previous turn has completed (Conversation).
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.errors import InvalidRequestError
from shared.tokenizer.tokenizer import Tokenizer

DIST_KINDS = ("fixed", "uniform", "normal", "exp")


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. Chat: `prefix` is the system message, `text` the user message;
    completions: the prompt is prefix + text."""

    text: str
    max_tokens: int
    prompt_len: int  # tokens of prefix + text, as the tokenizer counts them (no template)
    prefix: str = ""
    # agent turns, set by Conversation: the whole prompt as token ids (completions) and as
    # (role, content) messages (chat); they replace prefix + text when given
    prompt_ids: tuple[int, ...] = ()
    messages: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class LengthDist:
    """Token lengths: "N" (fixed), "uniform:LO:HI", "normal:MEAN:STD" or "exp:MEAN"; ≥ 1."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "LengthDist":
        parts = text.split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", float(int(parts[0])))
            kind, nums = parts[0], [float(p) for p in parts[1:]]
        except ValueError:
            raise InvalidRequestError("length", f"{text!r} is not a length distribution") from None
        need = {"uniform": 2, "normal": 2, "exp": 1}.get(kind)
        if need != len(nums) or min(nums) < 0 or (kind == "uniform" and nums[0] > nums[1]):
            raise InvalidRequestError(
                "length", f"{text!r}: use N, uniform:LO:HI, normal:MEAN:STD or exp:MEAN"
            )
        return cls(kind, *nums)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            values = np.full(n, self.a)
        elif self.kind == "uniform":
            values = rng.uniform(self.a, self.b + 1, n)  # HI inclusive after flooring
        elif self.kind == "normal":
            values = rng.normal(self.a, self.b, n)
        else:
            values = rng.exponential(self.a, n)
        return [max(1, int(v)) for v in values]


class PromptMaker:
    """Text of about N tokens of the model's vocabulary, drawn at random (vLLM's method)."""

    def __init__(self, tokenizer: Tokenizer, rng: np.random.Generator):
        self.tokenizer, self.rng = tokenizer, rng
        special = tokenizer.special_token_ids | tokenizer.all_special_ids
        self._ids = np.array([i for i in range(tokenizer.vocab_size) if i not in special])

    def text(self, num_tokens: int) -> str:
        ids = self.rng.choice(self._ids, num_tokens)
        text = self.tokenizer.decode(ids.tolist())
        # Decoding then encoding may merge or split tokens: trim to the length asked for.
        return self.tokenizer.decode(self.encode(text)[:num_tokens])

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def random_requests(
    maker: PromptMaker, num: int, input_len: LengthDist, output_len: LengthDist
) -> list[RequestSpec]:
    ins, outs = input_len.sample(maker.rng, num), output_len.sample(maker.rng, num)
    specs = []
    for n_in, n_out in zip(ins, outs, strict=True):
        text = maker.text(n_in)
        specs.append(RequestSpec(text, n_out, maker.count(text)))
    return specs


def shared_prefix_requests(
    maker: PromptMaker,
    num: int,
    prefix_len: int,
    num_prefixes: int,
    input_len: LengthDist,
    output_len: LengthDist,
) -> list[RequestSpec]:
    """Each request: one of `num_prefixes` common prompts of `prefix_len` tokens + a tail."""
    prefixes = [maker.text(prefix_len) for _ in range(num_prefixes)]
    prefix_lens = [maker.count(p) for p in prefixes]
    which = maker.rng.integers(0, num_prefixes, num)
    tails = random_requests(maker, num, input_len, output_len)
    return [
        RequestSpec(t.text, t.max_tokens, t.prompt_len + prefix_lens[k], prefixes[k])
        for t, k in zip(tails, which.tolist(), strict=True)
    ]


def sharegpt_requests(
    maker: PromptMaker,
    path: Path,
    num: int,
    output_len: int | None = None,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
) -> list[RequestSpec]:
    """First human turn + length of the reply of each conversation, shuffled; skips prompts or
    replies under 4 tokens and those longer than the limits (as vLLM does)."""
    try:
        conversations = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequestError("dataset", f"{path}: {e}") from None
    order = maker.rng.permutation(len(conversations))
    specs: list[RequestSpec] = []
    for i in order.tolist():
        if len(specs) == num:
            break
        pair = _first_exchange(conversations[i])
        if pair is None:
            continue
        prompt_len = maker.count(pair[0])
        reply_len = output_len or maker.count(pair[1])
        if prompt_len < 4 or reply_len < 4:
            continue
        if prompt_len > max_prompt_len or prompt_len + reply_len > max_total_len:
            continue
        specs.append(RequestSpec(pair[0], reply_len, prompt_len))
    if not specs:
        raise InvalidRequestError("dataset", f"{path}: no usable conversation")
    return specs


def _first_exchange(entry) -> tuple[str, str] | None:
    """(human text, reply text) of a ShareGPT entry; None when it has no such pair."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    texts = [t.get("value", t.get("content")) if isinstance(t, dict) else None for t in turns]
    if not all(isinstance(t, str) for t in texts[:2]):
        return None
    return texts[0], texts[1]


def mixed(rng: np.random.Generator, *parts: list[RequestSpec]) -> list[RequestSpec]:
    """All requests of `parts`, in random order."""
    pool = [spec for part in parts for spec in part]
    return [pool[i] for i in rng.permutation(len(pool)).tolist()]


@dataclass(frozen=True)
class TurnSpec:
    """One user message of an agent session, made up front."""

    text: str
    token_ids: tuple[int, ...]  # its tokens (PromptMaker.encode of text)
    max_tokens: int


@dataclass(frozen=True)
class SessionSpec:
    """One agent session: its system prompt (shared with other sessions) and its user turns."""

    prefix: str
    prefix_ids: tuple[int, ...]
    turns: tuple[TurnSpec, ...]


@dataclass(frozen=True)
class AgentWorkload:
    """Sessions whose turns are sent one after another, each after the previous completed (and
    `think_time_s` more). `encode` turns a server's output text into the token ids appended to
    the next prompt."""

    sessions: tuple[SessionSpec, ...]
    encode: Callable[[str], list[int]]
    think_time_s: float = 0.0

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def agent_sessions(
    maker: PromptMaker,
    num_sessions: int,
    num_turns: int,
    prefix_len: int,
    num_prefixes: int,
    input_len: LengthDist,
    output_len: LengthDist,
    think_time_s: float = 0.0,
) -> AgentWorkload:
    """`num_sessions` sessions of `num_turns` turns; each session's system prompt is one of
    `num_prefixes` shared prompts of `prefix_len` tokens, each turn a user message of
    `input_len` tokens asking for `output_len` tokens."""
    prefixes = [maker.text(prefix_len) for _ in range(num_prefixes)]
    prefix_ids = [tuple(maker.encode(p)) for p in prefixes]
    which = maker.rng.integers(0, num_prefixes, num_sessions).tolist()
    sessions = []
    for k in which:
        users = random_requests(maker, num_turns, input_len, output_len)
        turns = tuple(TurnSpec(u.text, tuple(maker.encode(u.text)), u.max_tokens) for u in users)
        sessions.append(SessionSpec(prefixes[k], prefix_ids[k], turns))
    return AgentWorkload(tuple(sessions), maker.encode, think_time_s)


class Conversation:
    """One session's history, owned by the task that runs the session. Turn k + 1's prompt is
    turn k's prompt + the output text turn k got + the next user message: as token ids, the
    previous prompt's ids exactly, then the output's (re-encoded) ids, then the user message's
    ids, so a prefix cache keyed on token ids sees the previous prompt again; as chat messages,
    the previous messages + an assistant message + a user message (whether the rendered prompt
    extends the previous one is the chat template's business)."""

    def __init__(self, spec: SessionSpec, encode: Callable[[str], list[int]]):
        self.spec, self.encode = spec, encode
        self.num_done = 0  # turns whose output was recorded
        self._ids = list(spec.prefix_ids)
        self._messages = [("system", spec.prefix)] if spec.prefix else []

    @property
    def finished(self) -> bool:
        return self.num_done == len(self.spec.turns)

    def next_request(self) -> RequestSpec:
        """The request of turn `num_done`."""
        turn = self.spec.turns[self.num_done]
        ids = (*self._ids, *turn.token_ids)
        messages = (*self._messages, ("user", turn.text))
        return RequestSpec(turn.text, turn.max_tokens, len(ids), self.spec.prefix, ids, messages)

    def record_output(self, text: str) -> None:
        """Turn `num_done` completed with output `text`: the history grows by it."""
        turn = self.spec.turns[self.num_done]
        self._ids += [*turn.token_ids, *self.encode(text)]
        self._messages += [("user", turn.text), ("assistant", text)]
        self.num_done += 1
