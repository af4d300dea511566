"""Incremental, UTF-8-safe detokenization.

Every token id maps to the exact bytes it stands for (byte-level BPE letters mapped back to bytes,
sentencepiece ``<0xAB>`` byte-fallback tokens to their byte, ``▁`` to a space). A request's detokenizer
appends those bytes and emits only the longest prefix that ends on a character boundary, holding at most the
3 bytes of an unfinished character. So a character split across tokens (emoji, CJK) never reaches the
client as a fragment or as U+FFFD; U+FFFD appears only for bytes that can never become valid UTF-8, or for
an unfinished character when the sequence ends.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer

from stride.tokenizer.loader import byte_to_unicode

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def token_bytes_table(tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> list[bytes]:
    """``table[id]``: the bytes token ``id`` contributes to the text. Special tokens give ``b""`` when
    skipped; added tokens give their text. Built once per process (about 50k entries)."""
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    kinds = _decoder_kinds(decoder)
    from_letter = {letter: byte for byte, letter in byte_to_unicode().items()}
    added = tokenizer.get_added_tokens_decoder()
    table = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        token = tokenizer.id_to_token(token_id)
        if token_id in added:
            special = added[token_id].special
            table.append(b"" if special and skip_special_tokens else added[token_id].content.encode())
        elif token is None:
            table.append(b"")
        elif "ByteLevel" in kinds:
            table.append(b"".join(bytes([from_letter[c]]) if c in from_letter else c.encode() for c in token))
        elif "ByteFallback" in kinds and (m := _BYTE_TOKEN.match(token)):
            table.append(bytes([int(m.group(1), 16)]))
        else:  # sentencepiece-style pieces: U+2581 is the space
            table.append(token.replace("\u2581", " ").encode())
    return table


def _decoder_kinds(decoder: dict) -> set[str]:
    kinds = {decoder.get("type", "")}
    for step in decoder.get("decoders", []) or []:
        kinds |= _decoder_kinds(step)
    return kinds


def complete_prefix_length(buf: bytes | bytearray) -> int:
    """Length of the longest prefix of ``buf`` that does not end inside an unfinished UTF-8 character."""
    n = len(buf)
    for back in range(1, min(4, n) + 1):
        b = buf[n - back]
        if b & 0xC0 == 0x80:  # continuation byte: keep looking for the lead
            continue
        # Length the lead byte announces; ASCII and impossible leads count as complete.
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return n - back if need > back else n
    return n  # four continuation bytes in a row can never complete: let them decode as U+FFFD


def token_bytes(table: Sequence[bytes], token_id: int) -> bytes:
    """The bytes ``token_id`` stands for: ``table[token_id]``, or none for an id past the table (a model whose
    vocabulary is padded past its tokenizer's, as HF ``decode`` skips it); a negative id is a ``ValueError``."""
    if token_id < 0:
        raise ValueError(f"negative token id {token_id}")
    return table[token_id] if token_id < len(table) else b""


class IncrementalDetokenizer:
    """Text deltas of one sequence's output tokens, in order. Not thread-safe; one per request."""

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        self._token_bytes = token_bytes
        self._pending = bytearray()

    def push(self, token_ids: Iterable[int]) -> str:
        """Text completed by ``token_ids`` (possibly empty: an unfinished character is held back). An id past the
        tokenizer's table stands for no text, a negative one is a ``ValueError`` (:func:`token_bytes`)."""
        table = self._token_bytes
        for token_id in token_ids:
            self._pending += token_bytes(table, token_id)
        cut = complete_prefix_length(self._pending)
        text = self._pending[:cut].decode("utf-8", errors="replace")
        del self._pending[:cut]
        return text

    def flush(self) -> str:
        """At the end of the sequence: whatever is held, an unfinished character as U+FFFD."""
        text = self._pending.decode("utf-8", errors="replace")
        self._pending.clear()
        return text

    @property
    def num_pending_bytes(self) -> int:
        return len(self._pending)
