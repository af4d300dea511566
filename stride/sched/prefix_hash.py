"""Content addresses of KV blocks: stable, chained and seeded with the tenant.

A full block's address is ``H(previous address || its token ids)``; the first block chains onto
``H(DOMAIN_TAG || 0x00 || tenant)``. So an address names a whole prefix path under one tenant, not 16 tokens
in isolation, and the same tokens under two tenants have unrelated addresses (the lookup simply misses).

``H`` is BLAKE2b with a 16-byte digest over a fixed byte encoding (token ids as little-endian int32), so an
address is identical across processes, runs and machines -- unlike Python's salted ``hash()``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from hashlib import blake2b

import numpy as np

DOMAIN_TAG = b"stride/kv-block/v1"
DIGEST_SIZE = 16

TOKEN_DTYPE = np.dtype("<i4")
"""Token ids are stored and hashed as little-endian int32."""


def tenant_seed(tenant: str) -> bytes:
    """The address every chain of ``tenant`` starts from."""
    return blake2b(DOMAIN_TAG + b"\x00" + tenant.encode("utf-8"), digest_size=DIGEST_SIZE).digest()


def as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``token_ids`` as a 1-D little-endian int32 array (no copy when it already is one; may be read-only)."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {token_ids.shape}")
        if token_ids.dtype == TOKEN_DTYPE:
            return token_ids
        out = token_ids.astype(TOKEN_DTYPE)
        if not np.array_equal(out, token_ids):
            raise OverflowError("token id outside int32")
        return out
    try:  # struct packs a list about 2.5x faster than np.array converts one
        data = struct.pack(f"<{len(token_ids)}i", *token_ids)
    except struct.error as e:
        raise OverflowError(f"token id outside int32 ({e})") from None
    return np.frombuffer(data, dtype=TOKEN_DTYPE)


def block_hash(prev_hash: bytes, block_bytes: bytes) -> bytes:
    """Address of a block whose tokens encode to ``block_bytes`` and whose predecessor is ``prev_hash``."""
    return blake2b(prev_hash + block_bytes, digest_size=DIGEST_SIZE).digest()


def chain_hashes(seed: bytes, tokens: np.ndarray, block_size: int, num_blocks: int) -> list[bytes]:
    """Addresses of the first ``num_blocks`` full blocks of ``tokens`` (a reference for checks and tests)."""
    data = np.ascontiguousarray(tokens[:num_blocks * block_size], dtype=TOKEN_DTYPE).tobytes()
    step = block_size * TOKEN_DTYPE.itemsize
    out: list[bytes] = []
    h = seed
    for i in range(num_blocks):
        h = block_hash(h, data[i * step:(i + 1) * step])
        out.append(h)
    return out
