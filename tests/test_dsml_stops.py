"""Streaming stop-sequence matching."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ds4mlx.dsml import StopMatcher


def feed_all(stops, pieces):
    m = StopMatcher(stops)
    out = ""
    for p in pieces:
        emit, stopped = m.feed(p)
        out += emit
        if stopped:
            return out, m.matched
    return out + m.flush(), None


def test_basic_trim_and_hold_back():
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("O") == ("", False)
    assert m.feed("Pxyz") == ("", True)
    assert m.matched == "STOP" and m.feed("more") == ("", True) and m.flush() == ""


def test_partial_released_when_disproven_and_flushed():
    m = StopMatcher(["</end>"])
    assert m.feed("a</e") == ("a", False)
    assert m.feed("x") == ("</ex", False)
    assert m.feed("b</en") == ("b", False)
    assert m.flush() == "</en"


def test_no_stops_and_empty_stops_pass_through():
    for stops in (None, [], [""]):
        m = StopMatcher(stops)
        assert m.feed("abc") == ("abc", False)
        assert m.flush() == ""


def test_first_completed_stop_wins():
    assert feed_all(["world", "lo w"], ["hello world"]) == ("hel", "lo w")
    assert feed_all(["ab", "b"], ["xab"]) == ("x", "ab")
    # "b" is complete before "abc" is, whichever way the text arrives.
    assert feed_all(["abc", "b"], ["abc"]) == ("a", "b")
    assert feed_all(["abc", "b"], list("abc")) == ("a", "b")


@settings(max_examples=200, deadline=None, database=None)
@given(
    text=st.text(alphabet="abc\n<>/", max_size=40),
    stops=st.lists(st.text(alphabet="abc\n<>/", min_size=1, max_size=4), max_size=3),
    data=st.data(),
)
def test_any_split_matches_whole(text, stops, data):
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    whole = feed_all(stops, [text])
    assert feed_all(stops, pieces) == whole
    out, matched = whole
    if matched is None:
        assert out == text
    else:
        assert text.startswith(out + matched)
        assert not any(s in out for s in stops)
