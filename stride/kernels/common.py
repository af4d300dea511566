"""Small helpers shared by the kernel launchers, and the few Triton helpers every kernel uses."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(name: str, t: torch.Tensor) -> None:
    assert t.dtype in _FLOAT_DTYPES, f"{name} must be float32/float16/bfloat16, got {t.dtype}"


def check_last_contiguous(name: str, t: torch.Tensor) -> None:
    # Every kernel loads the innermost dimension as a contiguous vector.
    assert t.stride(-1) == 1, f"{name} must be contiguous in its last dimension, strides {t.stride()}"


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get exact ('ieee') dots; Triton's default for float32 would be tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def dot_args(dtype: torch.dtype) -> dict[str, object]:
    """Constexprs for :func:`dot`.

    The interpreter (Triton 3.9) multiplies bfloat16 dot operands as raw bits, so there both operands
    are upcast to float32; on a GPU the 16-bit operands go to the tensor cores.
    """
    upcast = interpreting() and dtype != torch.float32
    return {"DOT_PRECISION": "ieee" if upcast else dot_precision(dtype), "DOT_UPCAST": upcast}


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PRECISION)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


_PDL_CAPABLE: dict[int, bool] = {}
_PDL_ON = [False]


def set_pdl(enabled: bool) -> bool:
    """Allow or forbid (the default at import) PDL launches from now on; returns the previous setting. The
    worker turns it on unless ``STRIDE_PDL=0``; benchmarks time graphs both ways."""
    previous, _PDL_ON[0] = _PDL_ON[0], enabled
    return previous


def pdl_allowed() -> bool:
    """Whether PDL launches are allowed now (:func:`set_pdl`)."""
    return _PDL_ON[0]


def pdl_args(t: torch.Tensor) -> dict[str, object]:
    """Launch arguments for programmatic dependent launch (PDL). When allowed (:func:`set_pdl`), PDL is on while
    a CUDA graph is being captured on a Hopper-or-later GPU: within a replayed graph each kernel is launched while
    its predecessor is still finishing, and sits (after loading what no earlier kernel writes) in
    :func:`pdl_wait` until the predecessor completed. Outside capture, or elsewhere, nothing: plain stream order.

    Only inside graphs because there the kernel before is always one of the forward's own, which never
    writes weights: the GEMV loads its first weights before it waits (``stride/kernels/w4a16.py``).
    """
    if not _PDL_ON[0] or not t.is_cuda or interpreting() or not torch.cuda.is_current_stream_capturing():
        return {}
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in _PDL_CAPABLE:
        _PDL_CAPABLE[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return {"PDL": True, "launch_pdl": True} if _PDL_CAPABLE[index] else {}


@triton.jit
def pdl_wait(PDL: tl.constexpr, RELEASE: tl.constexpr = True):
    """With PDL: wait until the kernel before has completed and its writes are visible, then (``RELEASE``) let
    the kernel after launch. Every program of a PDL kernel must pass here before it reads or writes anything an
    earlier kernel touches, and before it exits (so a kernel's completion implies its predecessor's).

    A long kernel passes ``RELEASE=False`` and calls :func:`pdl_release` near its end instead: the kernel after
    is launched once every program has released (or exited), and its programs sit on the SMs, waiting, from then
    on; launched at the start of a 20 us GEMV they took its SMs' slots for all of it."""
    if PDL:
        gdc_wait()
        if RELEASE:
            gdc_launch_dependents()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """With PDL: let the kernel after launch (it still waits in :func:`pdl_wait` until this one completed)."""
    if PDL:
        gdc_launch_dependents()
