"""Shared by the worker tests: a :class:`ModelRunner` from the handful of settings a test varies."""

from __future__ import annotations

from typing import Any

from stride.config import WorkerConfig
from stride.workers.runner import ModelRunner, RunnerConfig

_RUNNER_FIELDS = {"block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len"}


def make_runner(model: str, *, progress: Any = None, memory_utilization: float | None = None,
                **settings: Any) -> ModelRunner:
    """``ModelRunner`` of ``model``: keywords naming :class:`RunnerConfig` fields go there, the rest to
    :class:`WorkerConfig` (``device``, ``dtype``, ``attention_backend``, ``cuda_graphs``, ``quantize``...)."""
    runner_kw = {k: settings.pop(k) for k in list(settings) if k in _RUNNER_FIELDS}
    if memory_utilization is not None:
        settings["gpu_memory_utilization"] = memory_utilization
    return ModelRunner(RunnerConfig(WorkerConfig(model=str(model), **settings), **runner_kw), progress)
