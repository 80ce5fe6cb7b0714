"""StopStringMatcher: held-back tails, stops spanning deltas, overlapping and competing stop
strings, and independence from how the text is split into deltas."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.errors import InvalidRequestError
from shared.tokenizer import StopStringMatcher


def run(stops, deltas) -> tuple[list[str], bool]:
    """Feed every delta; return (emitted pieces, stopped), flushing if no stop was hit."""
    matcher = StopStringMatcher(stops)
    pieces, stopped = [], False
    for delta in deltas:
        piece, stopped = matcher.feed(delta)
        pieces.append(piece)
    if not stopped:
        pieces.append(matcher.flush())
    return pieces, stopped


def test_stop_inside_one_delta():
    assert run(["world"], ["Hello world, again"]) == (["Hello "], True)


def test_stop_spanning_many_deltas():
    pieces, stopped = run(["STOP"], ["abc", "S", "T", "O", "P", "never"])
    assert stopped and pieces == ["abc", "", "", "", "", ""]


def test_partial_stop_is_held_then_released():
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("xab") == ("x", False)
    assert matcher.feed("d") == ("abd", False)
    assert matcher.feed("ab") == ("", False)
    assert matcher.flush() == "ab"


def test_stop_at_the_very_start():
    assert run(["He"], ["Hello"]) == ([""], True)
    assert run(["He"], ["H", "ello"]) == (["", ""], True)


def test_earliest_stop_wins_among_several():
    assert run(["world", "lo"], ["hello world"]) == (["hel"], True)
    assert run(["lo", "world"], ["hello world"]) == (["hel"], True)


def test_overlapping_stops_first_completed_wins():
    # "bc" completes before "abcd" does: generation would have stopped there.
    assert run(["abcd", "bc"], ["abcd"]) == (["a"], True)
    assert run(["abcd", "bc"], ["a", "b", "c", "d"]) == (["", "", "a", ""], True)
    # Completed together: the one starting earlier wins.
    assert run(["bc", "abc"], ["xabc"]) == (["x"], True)


def test_self_overlapping_stop():
    assert run(["aab"], ["a", "a", "a", "b"]) == (["", "", "a", ""], True)
    assert run(["abab"], ["xaba", "bab"]) == (["x", ""], True)
    assert run(["abab"], ["abaa", "bab"]) == (["aba", ""], True)


def test_no_stops_passes_text_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.flush() == ""


def test_matched_stop_string_is_reported():
    matcher = StopStringMatcher(["world", "lo"])
    assert matcher.matched is None
    assert matcher.feed("hel") == ("he", False)
    assert matcher.matched is None
    assert matcher.feed("lo world") == ("l", True)
    assert matcher.matched == "lo"


def test_after_stop_nothing_more():
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("ax") == ("a", True)
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_unicode_stop():
    assert run(["東京"], ["I like 東", "京 a lot"]) == (["I like ", ""], True)
    assert run(["🙂"], ["ok 🙂"]) == (["ok "], True)


def test_empty_stop_string_is_rejected():
    with pytest.raises(InvalidRequestError) as info:
        StopStringMatcher(["ok", ""])
    assert info.value.field == "stop"


def reference(stops, text) -> tuple[str, bool]:
    """Stop where a stop string is first completed, reading the text one character at a time."""
    for end in range(1, len(text) + 1):
        for start in range(end):
            if text[start:end] in stops:
                return text[:start], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text("ab c", min_size=1, max_size=4), max_size=3),
    text=st.text("ab c", max_size=30),
    cuts=st.lists(st.integers(0, 30)),
)
def test_any_split_gives_the_reference_result(stops, text, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    pieces, stopped = run(stops, deltas)
    emitted, expected_stop = reference(stops, text)
    assert ("".join(pieces), stopped) == (emitted, expected_stop)
    # Nothing is emitted that a later delta could turn into (part of) a stop string.
    assert not any(stop in "".join(pieces) for stop in stops)
