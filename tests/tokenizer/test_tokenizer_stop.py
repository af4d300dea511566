"""Stop strings: never emitted, generation ends there, and text is held only while it could start one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stride.model.files import default_model_path
from stride.tokenizer.detokenizer import token_bytes_table
from stride.tokenizer.loader import load_tokenizer
from stride.tokenizer.stop import OutputText, StopChecker


def run(stop, deltas):
    checker = StopChecker(stop)
    emitted, stopped_at = [], None
    for i, delta in enumerate(deltas):
        text, stopped = checker.push(delta)
        emitted.append(text)
        if stopped:
            stopped_at = i
            break
    if stopped_at is None:
        emitted.append(checker.flush())
    return emitted, stopped_at


def test_stop_split_across_deltas():
    emitted, stopped_at = run(["END"], ["Hello E", "N", "D world"])
    assert emitted == ["Hello ", "", ""] and stopped_at == 2


def test_held_text_is_released_when_it_cannot_be_a_stop():
    checker = StopChecker(["STOP"])
    assert checker.push("abc ST") == ("abc ", False)
    assert checker.push("x") == ("STx", False)
    assert checker.push("S") == ("", False)
    assert checker.flush() == "S"


def test_first_completed_stop_wins_and_nothing_after():
    checker = StopChecker(["world", "lo w"])
    assert checker.push("hello world, more") == ("hel", True)
    assert checker.stopped_by == "lo w"
    # "BAA" starts earlier but "A" completes first: generation would have ended at "BA".
    assert StopChecker(["BAA", "A"]).push("BAA") == ("B", True)
    assert checker.push("anything") == ("", True) and checker.flush() == ""


def test_no_stop_strings_passes_through():
    assert run([], ["a", "b", ""]) == (["a", "b", "", ""], None)


def test_control_without_holding_a_stop_would_leak():
    # Negative control: a naive per-delta search sees neither half of the stop string and emits it.
    deltas = ["Hello E", "N", "D world"]
    naive = "".join(d for d in deltas if "END" not in d)
    assert "END" in naive
    assert "END" not in "".join(run(["END"], deltas)[0])


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abcAB ", max_size=30),
       stops=st.lists(st.text(alphabet="abcAB ", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_matches_reference_for_any_split(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    emitted, stopped_at = run(stops, deltas)
    # Split-independent reference: the stop that completes first (then the longer one) ends the text.
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    expected = text[: min(hits)[1]] if hits else text
    assert "".join(emitted) == expected
    assert (stopped_at is not None) == bool(hits)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


def test_output_text_with_real_tokens(tok):
    table = token_bytes_table(tok.tokenizer)
    text = "The robot 🤖 said: done. Then more."
    ids = tok.encode(text)
    out = OutputText.create(table, stop=["🤖", "said"])
    deltas = []
    for i in ids:
        delta, stopped = out.push([i])
        deltas.append(delta)
        if stopped:
            break
    assert stopped and "".join(deltas) == "The robot "
    # Without stop strings the same tokens stream the whole text, ending at EOS.
    out = OutputText.create(table)
    streamed = "".join(out.push([i])[0] for i in [*ids, 2])
    assert streamed + out.finish()[0] == text


def test_finish_releases_held_text_and_can_still_stop(tok):
    table = token_bytes_table(tok.tokenizer)
    out = OutputText.create(table, stop=["Hello there"])
    assert out.push(tok.encode("Hello")) == ("", False)
    assert out.finish() == ("Hello", False)
    broken = OutputText.create([b"ab", b"\xe2\x82"], stop=["b\ufffd"])
    assert broken.push([0, 1]) == ("a", False)
    assert broken.finish() == ("", True)  # the unfinished character flushes as U+FFFD and completes the stop
