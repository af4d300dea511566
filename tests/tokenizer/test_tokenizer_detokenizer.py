"""Incremental detokenization never emits a partial character, and adds up to the full decode."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from stride.model.files import default_model_path
from stride.tokenizer.detokenizer import IncrementalDetokenizer, complete_prefix_length, token_bytes_table
from stride.tokenizer.loader import load_tokenizer

SPLIT_CHARS = ["🤖 robots", "家族👨‍👩‍👧‍👦で", "漢字と仮名の混じった文", "café ñ ✓ €100", "🇫🇷🇯🇵 flags"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def table(tok):
    return token_bytes_table(tok.tokenizer)


def stream(table, ids):
    detok = IncrementalDetokenizer(table)
    deltas = [detok.push([i]) for i in ids]
    return deltas, detok.flush()


@pytest.mark.parametrize("text", SPLIT_CHARS)
def test_split_characters_are_held_until_complete(tok, table, text):
    ids = tok.encode(text)
    deltas, tail = stream(table, ids)
    assert "".join(deltas) == text and tail == ""
    assert not any("\ufffd" in d for d in deltas)
    # Every delta ends on a character boundary of the final text.
    cut = 0
    for d in deltas:
        cut += len(d)
        assert text[:cut].encode() == "".join(deltas)[:cut].encode()


@pytest.mark.parametrize("text", SPLIT_CHARS[:3])
def test_control_naive_per_token_decode_breaks_characters(tok, table, text):
    # Negative control: decoding token by token without holding bytes does produce U+FFFD here, so the
    # strings really split characters across tokens and the test above is not vacuous.
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    assert any(d == "" for d in stream(table, ids)[0])


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_incremental_equals_full_decode(tok, table, text):
    ids = tok.encode(text)
    deltas, tail = stream(table, ids)
    full = tok.decode(ids)
    assert "".join(deltas) + tail == full
    # The vocabulary lacks some bytes (control characters, the 0xF1 lead byte): the tokenizer drops them,
    # so such text cannot round-trip at all; what the model can say must still stream intact.
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_and_table(tok, table):
    assert len(table) == tok.vocab_size
    assert table[2] == b"" and token_bytes_table(tok.tokenizer, skip_special_tokens=False)[2] == b"<|im_end|>"
    assert table[tok.encode(" the")[0]] == b" the"


def test_invalid_bytes_are_not_held_forever():
    table = [b"a", b"\xff", b"\xe2", b"\x82", b"\xac", b"\x80"]
    detok = IncrementalDetokenizer(table)
    assert detok.push([0, 1]) == "a\ufffd"  # 0xFF can never start a character
    assert detok.push([2, 3]) == "" and detok.num_pending_bytes == 2
    assert detok.push([4]) == "€"
    assert detok.push([5]) == "\ufffd"  # a stray continuation byte
    assert detok.push([2]) == "" and detok.flush() == "\ufffd"  # unfinished at the end


def test_complete_prefix_length():
    euro = "€".encode()
    assert complete_prefix_length(b"") == 0
    assert complete_prefix_length(b"ab") == 2
    assert complete_prefix_length(b"a" + euro[:1]) == 1
    assert complete_prefix_length(b"a" + euro[:2]) == 1
    assert complete_prefix_length(b"a" + euro) == 4
    robot = "🤖".encode()
    assert [complete_prefix_length(robot[:k]) for k in range(5)] == [0, 0, 0, 0, 4]


def test_byte_fallback_tokenizer():
    # A sentencepiece-style vocabulary: '▁' for spaces, <0xNN> byte tokens for characters it lacks.
    vocab = {"<unk>": 0, "▁hi": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps)
    table = token_bytes_table(tokenizer)
    assert table[1] == b" hi" and table[2 + 0xE2] == b"\xe2"
    ids = [1, *(2 + b for b in "€".encode())]
    deltas, _ = stream(table, ids)
    assert deltas == [" hi", "", "", "€"]
    assert "".join(deltas) == tokenizer.decode(ids)
