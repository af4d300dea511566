"""Attention backends by name: ``torch`` (the reference, anywhere), ``sdpa`` (the reference's code with attention in
the run dtype; the CPU's default) and ``triton`` (the kernels; CUDA, or Triton's interpreter on a CPU). The worker
asks for one with :func:`get_backend`; new backends join with :func:`register_backend`."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable

import torch

from stride import env
from stride.workers.attention import AttentionBackend, SdpaPagedAttention, TorchPagedAttention


def _triton_backend() -> AttentionBackend:
    # Imported on demand, so Triton loads only when asked for. Triton fixes interpreter-or-compiler for its own
    # library functions when it is first imported, so on a CPU the interpreter is switched on here, before that.
    if not torch.cuda.is_available():
        if "triton" not in sys.modules:
            env.TRITON_INTERPRET.set_default("1")
        if not env.TRITON_INTERPRET.get_bool():
            raise RuntimeError(
                "the triton backend without CUDA needs TRITON_INTERPRET=1 before Triton is first imported "
                "(something, e.g. torch building a model on the meta device, imported it without the flag)")
    from stride.workers.attention_triton import TritonPagedAttention

    return TritonPagedAttention()


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch": TorchPagedAttention, "sdpa": SdpaPagedAttention}
if importlib.util.find_spec("triton") is not None:
    _BACKENDS["triton"] = _triton_backend


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    """Make a backend selectable by name."""
    _BACKENDS[name] = factory


def get_backend(name: str = "", device_type: str = "cpu") -> AttentionBackend:
    """The backend ``name``; empty picks ``triton`` on CUDA when it is there and ``sdpa`` otherwise."""
    if not name:
        name = "triton" if device_type == "cuda" and "triton" in _BACKENDS else "sdpa"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; registered: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()
