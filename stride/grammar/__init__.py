"""Structured outputs: a request's :class:`~stride.params.Constraint` compiled to an llguidance grammar
(:mod:`.compile`, in the tokenizer processes), and the scheduler's matchers that turn each constrained sequence's
state into the token bitmask its next sample is drawn under (:mod:`.matchers`).

Both modules import llguidance and then :func:`check_llguidance`: a missing or too old package is an
``ImportError`` there, which each process turns into "structured outputs off" (constrained requests get a 400
naming the reason; everything else is served)."""

from __future__ import annotations

import importlib.metadata

MIN_LLGUIDANCE = (1, 9)
"""The oldest llguidance the matchers are written against (1.6's ``LLTokenizer`` takes one EOS id, not a list)."""


def check_llguidance() -> None:
    """Raise ``ImportError`` naming the installed version when llguidance is older than :data:`MIN_LLGUIDANCE`
    (a package imported from a path without its metadata is taken as it is)."""
    try:
        version = importlib.metadata.version("llguidance")
    except importlib.metadata.PackageNotFoundError:
        return
    release = tuple(int(p) if p.isdigit() else 0 for p in version.split(".")[:2])
    if release < MIN_LLGUIDANCE:
        need = ".".join(map(str, MIN_LLGUIDANCE))
        raise ImportError(f"llguidance {version} is installed; structured outputs need llguidance >= {need}",
                          name="llguidance")
