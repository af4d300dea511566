"""Suite-wide settings: invariant checks on, GPU tests skipped without CUDA."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("STRIDE_CHECK_INVARIANTS", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
