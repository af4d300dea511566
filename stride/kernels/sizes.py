"""Integer helpers for grids and block sizes, without torch or Triton (the policy modules use them too)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two of at least ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
