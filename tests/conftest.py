"""Suite-wide settings: invariant checks on, Triton's interpreter without CUDA, GPU tests skipped without it."""

from __future__ import annotations

import os

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
