"""Suite-wide settings: invariant checks on, Triton's interpreter without CUDA, GPU tests skipped without it."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

os.environ.setdefault("STRIDE_CHECK_INVARIANTS", "1")
# A CPU worker would otherwise build its compiled decode step (a minute of a core) in every test that makes one;
# tests/workers/test_cpu_step.py turns it on where it is the subject.
os.environ.setdefault("STRIDE_CPU_COMPILE", "0")



def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# Without CUDA the kernel tests run the very same Triton kernels on CPU tensors, in Triton's interpreter. Triton
# reads this when it is first imported, so it is set before any test module can import it.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_without_dropped_overflow_checks() -> None:
    """Triton's interpreter builds an overflow check for every integer +, - and * (both operands cast to int64, the
    operation again, two comparisons) and hands it to ``device_assert``, which drops it unless ``debug`` is set (a
    GPU compile drops it the same way). Half the interpreter's time in the 4-bit GEMV went there (cProfile); the
    check is turned off where its result is dropped anyway, so no kernel computes anything else."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is not None and not getattr(options, "debug", True) and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)  # type: ignore[union-attr]


def _interpreter_patches_the_language_once_a_launch() -> None:
    """Triton's interpreter swaps ``triton.language``'s builtins for its own at each launch (and puts them back
    after), but also at every call of a ``@triton.jit`` helper inside the kernel, walking the modules' members
    again (``inspect.getmembers``) to find nothing left to swap: 29% of the 4-bit GEMV's interpreted time. A
    helper's call inside a launch, when the builtins are already swapped, skips that walk; a launch still swaps
    and restores as before. Were anything left unswapped, the kernel would fail loudly (a builtin called outside
    the interpreter), not compute something else."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if original is None or scope is None or is_builtin is None:
        return

    def patch_lang(fn: Any) -> object:
        # Builtins are swapped per module attribute: skip only where each language module this function sees
        # (``tl``, or ``core`` for triton's own helpers) and the tensor class are swapped already.
        langs = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
        if langs and not is_builtin(tl.core.tensor.__add__) and not any(is_builtin(lang.arange) for lang in langs):
            return scope()
        return original(fn)

    interpreter._patch_lang = patch_lang


_interpreter_without_dropped_overflow_checks()
_interpreter_patches_the_language_once_a_launch()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Tell scripts/test.sh the session reached its end (it fails a run that stopped before, whatever the status)."""
    done = os.environ.get("STRIDE_PYTEST_DONE")
    if done:
        with open(done, "w") as fh:
            fh.write(f"{int(exitstatus)}\n")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
