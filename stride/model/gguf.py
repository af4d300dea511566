"""A small reader of a GGUF file's key/value header, without torch (``gguf.GGUFReader`` parses every tensor
record too and takes seconds on a small CPU). The launcher, the tokenizers and the loaders read metadata here."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str | Path, prefix: str = "") -> dict[str, Any]:
    """The GGUF key/value header (keys starting with ``prefix``); tensors are not read."""
    with open(path, "rb") as f:
        magic, version = f.read(4), struct.unpack("<I", f.read(4))[0]
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path}: not a little-endian GGUF v2+ file")
        _num_tensors, num_kv = struct.unpack("<QQ", f.read(16))
        meta = {}
        for _ in range(num_kv):
            key = _read_string(f)
            value = _read_value(f, struct.unpack("<I", f.read(4))[0])
            if key.startswith(prefix):
                meta[key] = value
        return meta


def _read_string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, kind: int) -> Any:
    if kind == _STRING:
        return _read_string(f)
    if kind == _ARRAY:
        elem_kind, count = struct.unpack("<IQ", f.read(12))
        if elem_kind in _SCALARS:
            fmt = _SCALARS[elem_kind]
            return list(struct.unpack(f"<{count}{fmt[1]}", f.read(struct.calcsize(fmt) * count)))
        return [_read_value(f, elem_kind) for _ in range(count)]
    if kind not in _SCALARS:
        raise ValueError(f"unknown GGUF value type {kind}")
    fmt = _SCALARS[kind]
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
