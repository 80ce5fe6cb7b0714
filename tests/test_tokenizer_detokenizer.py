"""IncrementalDetokenizer on a byte-level BPE and a SentencePiece-style byte-fallback BPE:
deltas concatenate to the full decode for any split of any valid-UTF-8 token sequence, never
show U+FFFD for a character in flight, and each step decodes a bounded window."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tokenizer_folders import build_byte_fallback, build_byte_level, byte_token_ids

from shared.tokenizer import IncrementalDetokenizer, Tokenizer

FFFD = "\ufffd"
# Characters of every UTF-8 length: ASCII, accented (2 bytes), CJK (3), emoji (4), a ZWJ
# sequence and a variation selector, plus spaces and newlines for SentencePiece's "▁".
ALPHABET = "ab xyz\n.éüß—東京語✓🙂🚀👩\u200d\ufe0f"
HYPOTHESIS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


class WindowTokenizer(Tokenizer):
    """The real tokenizer, recording how many ids each decode call gets."""

    decode_sizes: list[int]

    def decode(self, ids, skip_special_tokens=True):
        self.decode_sizes.append(len(ids))
        return super().decode(ids, skip_special_tokens)


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def tok(request, tmp_path_factory) -> WindowTokenizer:
    build = build_byte_level if request.param == "byte_level" else build_byte_fallback
    tokenizer = WindowTokenizer.from_dir(build(tmp_path_factory.mktemp(request.param)))
    tokenizer.decode_sizes = []
    return tokenizer


def token_ids(tok, pieces: list[tuple[str, str]]) -> list[int]:
    """Ids of text pieces, each encoded normally, spelled byte by byte (multi-byte characters
    split over tokens), or a special token."""
    ids: list[int] = []
    for how, text in pieces:
        if how == "bytes":
            ids += byte_token_ids(tok, text.encode())
        elif how == "special":
            ids.append(tok.backend.token_to_id(text))
        else:
            ids += tok.encode(text, add_special_tokens=False)
    return ids


pieces_strategy = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["encode", "bytes"]), st.text(ALPHABET, max_size=12)),
        st.tuples(st.just("special"), st.sampled_from(["<s>", "</s>"])),
    ),
    max_size=6,
)


def stream(tok, prompt_ids, ids, splits, skip=True) -> tuple[list[str], str]:
    """Feed `ids` in chunks cut at `splits`; return (deltas, flush())."""
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    cuts = sorted({min(s, len(ids)) for s in splits} | {0, len(ids)})
    deltas = [detok.add(ids[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    return deltas, detok.flush()


@HYPOTHESIS
@given(pieces=pieces_strategy, splits=st.lists(st.integers(0, 80)), skip=st.booleans())
def test_deltas_concatenate_to_decode(tok, pieces, splits, skip):
    ids = token_ids(tok, pieces)
    expected = tok.decode(ids, skip)
    deltas, rest = stream(tok, [], ids, splits, skip)
    assert FFFD not in expected  # the pieces are valid text
    assert "".join(deltas) == expected
    assert rest == ""
    assert not any(FFFD in d for d in deltas)


@HYPOTHESIS
@given(prompt=pieces_strategy, pieces=pieces_strategy, splits=st.lists(st.integers(0, 80)))
def test_deltas_continue_the_prompt(tok, prompt, pieces, splits):
    prompt_ids, ids = token_ids(tok, prompt), token_ids(tok, pieces)
    prompt_text, full = tok.decode(prompt_ids), tok.decode(prompt_ids + ids)
    deltas, rest = stream(tok, prompt_ids, ids, splits)
    assert full.startswith(prompt_text)
    assert "".join(deltas) + rest == full[len(prompt_text) :]
    assert not any(FFFD in d for d in deltas)


def test_byte_level_output_is_independent_of_the_prompt(tmp_path):
    # (Not so with SentencePiece, which drops the first token's space only without a prompt.)
    tok = Tokenizer.from_dir(build_byte_level(tmp_path))
    rng = random.Random(0)
    prompt = tok.encode("Über 東京 🙂", add_special_tokens=False)
    for _ in range(50):
        text = "".join(rng.choice(ALPHABET) for _ in range(20))
        ids = token_ids(tok, [("bytes", text[:7]), ("encode", text[7:])])
        deltas, rest = stream(tok, prompt, ids, [rng.randrange(len(ids)) for _ in range(5)])
        assert "".join(deltas) + rest == tok.decode(ids) == text


def test_sentencepiece_leading_space(tmp_path):
    tok = Tokenizer.from_dir(build_byte_fallback(tmp_path))
    world = tok.encode(" the fox 東", add_special_tokens=False)
    assert tok.backend.id_to_token(world[0]).startswith("▁")  # a word's space is in its token
    with_prompt = IncrementalDetokenizer(tok, tok.encode("Once upon"))
    assert "".join(with_prompt.add([i]) for i in world) == " the fox 東"
    alone = IncrementalDetokenizer(tok, [])
    assert "".join(alone.add([i]) for i in world) == tok.decode(world) == "the fox 東"


def test_character_held_until_complete(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("x", add_special_tokens=False))
    pieces = byte_token_ids(tok, "🙂".encode())
    assert [detok.add([i]) for i in pieces] == ["", "", "", "🙂"]


def test_long_output_decodes_bounded_windows(tok):
    rng = random.Random(1)
    text = "".join(rng.choice(ALPHABET) for _ in range(1500))
    ids = token_ids(tok, [("encode", text[:700]), ("bytes", text[700:])])
    tok.decode_sizes = []
    detok = IncrementalDetokenizer(tok, ids[:30])
    out = "".join(detok.add([i]) for i in ids[30:]) + detok.flush()
    assert max(tok.decode_sizes) <= 12  # a few tokens of context + a character in flight
    assert out == tok.decode(ids)[len(tok.decode(ids[:30])) :]


def test_invalid_bytes_stay_bounded_and_are_emitted(tmp_path):
    tok = WindowTokenizer.from_dir(build_byte_level(tmp_path))
    tok.decode_sizes = []
    garbage = byte_token_ids(tok, b"\x80" * 200)  # lone continuation bytes: never valid
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add([i]) for i in garbage]
    assert max(tok.decode_sizes) <= 25  # context (<= 8) + pending (<= 17)
    assert "".join(deltas) + detok.flush() == tok.decode(garbage) == FFFD * 200
    assert sum(bool(d) for d in deltas) >= 10  # emitted along the way, not only at the end
    # A character after the garbage still comes out whole.
    tail = byte_token_ids(tok, "東🙂".encode())
    assert "".join(detok.add([i]) for i in tail).endswith("東🙂")


def test_special_tokens_kept_or_skipped(tmp_path):
    tok = Tokenizer.from_dir(build_byte_level(tmp_path))
    eos, user = tok.backend.token_to_id("</s>"), tok.backend.token_to_id("<|user|>")
    ids = [*tok.encode("hi", add_special_tokens=False), user, eos]
    for skip, expected in ((True, "hi"), (False, "hi<|user|></s>")):
        deltas, rest = stream(tok, [], ids, [1, 2, 3], skip=skip)
        assert "".join(deltas) + rest == expected == tok.decode(ids, skip)


def test_random_token_sequences(tok):
    rng = random.Random(2)
    byte_level = tok.backend.token_to_id("<0x41>") is None
    num_valid = 0
    for _ in range(1000):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 25))]
        full = tok.decode(ids)
        deltas, rest = stream(tok, [], ids, [rng.randrange(len(ids)) for _ in range(3)])
        if FFFD not in full:
            num_valid += 1
            assert "".join(deltas) == full and rest == ""
        elif byte_level:  # lossy UTF-8 decoding never revises text before the tail
            assert "".join(deltas) + rest == full
    assert num_valid >= 50
