"""Stop strings across chunk boundaries: exact emitted text, held-back text, flush."""

from __future__ import annotations

import random

from pdserve.gateway.choices import StopMatcher


def test_no_stops_passes_text_through() -> None:
    m = StopMatcher([])
    assert m.feed("hello") == ("hello", False)
    assert m.flush() == ""


def test_stop_inside_one_chunk() -> None:
    m = StopMatcher(["END"])
    assert m.feed("abcENDdef") == ("abc", True)
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_stop_across_chunks_is_held_then_cut() -> None:
    m = StopMatcher(["\n\n"])
    assert m.feed("one\n") == ("one", False)
    assert m.feed("\ntwo") == ("", True)


def test_false_start_is_released() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("xST") == ("x", False)
    assert m.feed("O") == ("", False)
    assert m.feed("RM") == ("STORM", False)


def test_held_text_flushed_when_finished_otherwise() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("abcSTO") == ("abc", False)
    assert m.flush() == "STO"
    assert m.flush() == ""


def test_earliest_of_several_stops_wins() -> None:
    m = StopMatcher(["world", "lo w"])
    assert m.feed("hel") == ("he", False)  # "l" may start "lo w"
    assert m.feed("lo world") == ("l", True)  # cut at "lo w", which starts first


def test_longest_partial_suffix_is_held() -> None:
    m = StopMatcher(["abab"])
    assert m.feed("xaba") == ("x", False)  # "aba" could still become "abab"
    assert m.feed("c") == ("abac", False)


def oracle(text: str, ends: list[int], stops: list[str]) -> tuple[str, bool]:
    """The first chunk end by which some stop is complete; cut at the earliest such stop."""
    for end in ends:
        hits = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


def test_random_chunkings_match_the_oracle() -> None:
    rng = random.Random(0)
    alphabet = "ab\n "
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in "12"]
        ends = sorted({*rng.sample(range(1, 31), 8), len(text)})
        ends = [e for e in ends if e <= len(text)]
        m = StopMatcher(stops)
        out, matched, pos = "", False, 0
        for end in ends:
            emitted, matched = m.feed(text[pos:end])
            out += emitted
            pos = end
            if matched:
                break
        if not matched:
            out += m.flush()
        assert (out, matched) == oracle(text, ends, stops), (text, stops, ends)
