"""Small helpers shared by the kernel launchers (no Triton code here)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


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
