"""Content addresses of KV blocks: stable, chained and seeded with the tenant.

A full block's address is ``H(previous address || its token ids)``; the first block chains onto
``H(DOMAIN_TAG || 0x00 || tenant)``. So an address names a whole prefix path under one tenant, not 16 tokens
in isolation, and the same tokens under two tenants have unrelated addresses (the lookup simply misses).

``H`` is BLAKE2b with a 16-byte digest over a fixed byte encoding (token ids as little-endian int32), so an
address is identical across processes, runs and machines -- unlike Python's salted ``hash()``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

import numpy as np

DOMAIN_TAG = b"stride/kv-block/v1"
DIGEST_SIZE = 16

_BIG_ENDIAN = sys.byteorder == "big"
if array("i").itemsize != 4:  # pragma: no cover - every supported platform has a 4-byte C int
    raise ImportError("stride.sched.prefix_hash needs a 4-byte C int")


def tenant_seed(tenant: str) -> bytes:
    """The address every chain of ``tenant`` starts from."""
    return blake2b(DOMAIN_TAG + b"\x00" + tenant.encode("utf-8"), digest_size=DIGEST_SIZE).digest()


def as_token_array(token_ids: Sequence[int] | np.ndarray) -> array:
    """A private int32 copy of ``token_ids`` (``OverflowError`` for an id outside int32)."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {token_ids.shape}")
        as_i32 = token_ids.astype(np.int32)
        if not np.array_equal(as_i32, token_ids):
            raise OverflowError("token id outside int32")
        out = array("i")
        out.frombytes(as_i32.tobytes())  # native order, like array's own
        return out
    return array("i", token_ids)


def block_hash(prev_hash: bytes, tokens: array, start: int, end: int) -> bytes:
    """Address of the block holding ``tokens[start:end]`` whose predecessor's address is ``prev_hash``."""
    chunk = tokens[start:end]
    if _BIG_ENDIAN:  # pragma: no cover - the encoding is little-endian everywhere
        chunk.byteswap()
    return blake2b(prev_hash + chunk.tobytes(), digest_size=DIGEST_SIZE).digest()


def chain_hashes(seed: bytes, tokens: array, block_size: int, num_blocks: int) -> list[bytes]:
    """Addresses of the first ``num_blocks`` full blocks of ``tokens`` (a reference for checks and tests)."""
    out: list[bytes] = []
    h = seed
    for i in range(num_blocks):
        h = block_hash(h, tokens, i * block_size, (i + 1) * block_size)
        out.append(h)
    return out
