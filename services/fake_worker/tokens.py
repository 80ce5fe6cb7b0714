"""What the fake worker "generates": a pure function of the prompt and the output index.

Tokens are drawn from the model's ordinary vocabulary (no special tokens, nothing that does not
decode to printable text on its own), and never EOS unless the worker was started with
`eos_after`. Tests import `fake_token` to know the exact output to expect.
"""

import bisect
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ModelFolderError
from shared.protocol import TokenLogprob
from shared.tokenizer.tokenizer import Tokenizer

_STRIDE = 2654435761  # Knuth's multiplicative constant: consecutive indices land far apart


@dataclass(frozen=True)
class FakeModelInfo:
    """The few facts about a model folder the fake worker needs."""

    name: str  # served model name (the folder name)
    eos_token_id: int
    max_model_len: int
    ordinary_ids: tuple[int, ...]  # ids it may emit: the vocabulary minus special tokens

    @classmethod
    def from_dir(cls, model_dir: Path) -> "FakeModelInfo":
        """Reads config.json, and the tokenizer to keep only ids that decode to clean text."""
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "config.json")
        eos = config.get("eos_token_id", 0)
        eos = int(eos[0] if isinstance(eos, list) else eos)
        ids = range(int(config.get("vocab_size", 0)))
        if (model_dir / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_dir(model_dir)
            special = tokenizer.special_token_ids | tokenizer.eos_token_ids | {eos}
            ids = [i for i in ids if i not in special and _clean(tokenizer.decode([i]))]
        ordinary = tuple(i for i in ids if i != eos)
        if not ordinary:
            raise ModelFolderError(str(model_dir / "config.json"), "no usable vocabulary")
        return cls(
            name=model_dir.name,
            eos_token_id=eos,
            max_model_len=int(config.get("max_position_embeddings", 2048)),
            ordinary_ids=ordinary,
        )


def _clean(text: str) -> bool:
    """Printable on its own: no partial UTF-8 sequence, no control characters but space."""
    return bool(text) and "\ufffd" not in text and all(c.isprintable() for c in text)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFolderError(str(path), f"unreadable ({e})") from None


def prompt_digest(prompt_token_ids: tuple[int, ...]) -> int:
    """A stable 64-bit digest of the prompt (Python's hash() is salted per process)."""
    data = b"".join(i.to_bytes(4, "little", signed=True) for i in prompt_token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def fake_token(info: FakeModelInfo, digest: int, index: int) -> int:
    """The ordinary token at output `index` for the prompt with `digest`."""
    return info.ordinary_ids[(digest + index * _STRIDE) % len(info.ordinary_ids)]


def next_token(
    info: FakeModelInfo, digest: int, index: int, sampling, eos_after: int | None
) -> int:
    """The token at output `index`: EOS from index `eos_after` on (if set, allowed), else fake."""
    if (
        eos_after is not None
        and not sampling.ignore_eos
        and index >= max(eos_after, sampling.min_tokens)
    ):
        return info.eos_token_id
    return fake_token(info, digest, index)


def fake_logprob(info: FakeModelInfo, token_id: int, index: int, top_n: int) -> TokenLogprob:
    """Plausible logprobs: the chosen token is the most likely, then the next ordinary ids."""
    chosen = -0.1 * (1 + index % 5)
    pos = bisect.bisect_left(info.ordinary_ids, token_id)  # ordinary_ids is sorted
    others = [info.ordinary_ids[(pos + k) % len(info.ordinary_ids)] for k in range(1, top_n)]
    top_ids = (token_id, *others)[:top_n]
    top_logprobs = tuple(chosen - k for k in range(len(top_ids)))
    return TokenLogprob(token_id, chosen, top_ids, top_logprobs)


def fake_prompt_logprobs(
    info: FakeModelInfo, prompt_token_ids, top_n: int | None
) -> tuple[TokenLogprob, ...]:
    """fake_logprob of every prompt token from the second on (none if top_n is None)."""
    if top_n is None:
        return ()
    return tuple(
        fake_logprob(info, token, i, top_n) for i, token in enumerate(prompt_token_ids[1:])
    )
