"""A small reader of GGUF files, without torch: the key/value header (:func:`read_gguf_metadata`: the launcher and
the tokenizers), and the tensor records with views of their bytes (:func:`read_gguf`: the loaders).
``gguf.GGUFReader`` gives the same tensors but builds a numpy view per element of every metadata array (a vocabulary
is ~100k strings): 5.6 s for the default model on a 2-core Zen 3 against 0.1 s here."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str | Path, prefix: str = "") -> dict[str, Any]:
    """The GGUF key/value header (keys starting with ``prefix``); tensors are not read."""
    with open(path, "rb") as f:
        return _read_header(f, path, prefix)[0]


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor record of a GGUF file, named as ``gguf.GGUFReader``'s are."""

    name: str
    tensor_type: Any
    """Its ``gguf.GGMLQuantizationType``."""
    shape: tuple[int, ...]
    """Dimensions as the file lists them: innermost first."""
    data: np.ndarray
    """A read-only view of the file: the values (outermost dimension first) for float and integer types, else the
    bytes, one row of blocks per row (``(..., bytes a row)``)."""


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, Any]
    """The key/value header, values as Python scalars, strings and lists."""
    tensors: list[GGUFTensor]


_TYPED = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


def read_gguf(path: str | Path) -> GGUFFile:
    """The header and every tensor record of a GGUF file, each tensor a view of the file mapped once (nothing is
    copied or read before it is used)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        fields, num_tensors = _read_header(f, path)
        records = []
        for _ in range(num_tensors):
            name = _read_string(f)
            (n_dims,) = struct.unpack("<I", f.read(4))
            dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
            kind, offset = struct.unpack("<IQ", f.read(12))
            records.append((name, dims, kind, offset))
        alignment = int(fields.get("general.alignment", 32))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment {alignment} is not a power of two")
        start = -(-f.tell() // alignment) * alignment
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensors, names = [], set()
    for name, dims, kind, offset in records:
        if name in names:
            raise ValueError(f"{path}: tensor {name} appears twice")
        names.add(name)
        qtype = GGMLQuantizationType(kind)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        outer = tuple(reversed(dims))
        count = int(np.prod(dims, dtype=np.int64))
        nbytes = count * block_bytes // block
        lo = start + offset
        if lo + nbytes > mapped.size:
            raise ValueError(f"{path}: tensor {name} ends past the end of the file")
        raw = mapped[lo : lo + nbytes]
        typed = _TYPED.get(qtype.name)
        if typed is not None:
            data = raw.view(typed).reshape(outer)
        else:
            data = raw.reshape(*outer[:-1], outer[-1] // block * block_bytes)
        tensors.append(GGUFTensor(name, qtype, dims, data))
    return GGUFFile(fields, tensors)


def _read_header(f: BinaryIO, path: str | Path, prefix: str = "") -> tuple[dict[str, Any], int]:
    """The key/value header (keys starting with ``prefix``) and the number of tensor records after it."""
    magic, version = f.read(4), struct.unpack("<I", f.read(4))[0]
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{path}: not a little-endian GGUF v2+ file")
    num_tensors, num_kv = struct.unpack("<QQ", f.read(16))
    meta = {}
    for _ in range(num_kv):
        key = _read_string(f)
        value = _read_value(f, struct.unpack("<I", f.read(4))[0])
        if key.startswith(prefix):
            meta[key] = value
    return meta, num_tensors


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
