"""RMSNorm fused with the residual add (Llama's ``h = x + residual; out = norm(h) * weight``).

One program normalises ``ROWS`` rows; a row is loaded once, so the fused op moves exactly
x, residual and weight in and out, h out: 4 row-sized transfers instead of the 6 of add-then-norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from stride.kernels.common import check_float, check_last_contiguous, pdl_args, pdl_wait
from stride.kernels.sizes import next_pow2


@dataclass(frozen=True)
class RMSNormConfig:
    """Launch configuration; the block over the hidden dimension is always the next power of two."""

    rows_per_program: int = 1
    num_warps: int = 4


def default_config(hidden: int) -> RMSNormConfig:
    return RMSNormConfig(rows_per_program=1, num_warps=min(16, max(1, next_pow2(hidden) // 512)))


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, h_ptr,
    num_rows, hidden, eps,
    stride_x, stride_res, stride_out, stride_h,
    HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    offs = tl.arange(0, BLOCK)
    col_mask = offs < hidden
    w = tl.load(w_ptr + offs, mask=col_mask, other=0.0).to(tl.float32)  # a weight: before the PDL wait
    pdl_wait(PDL)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        if row < num_rows:
            row64 = row.to(tl.int64)
            x = tl.load(x_ptr + row64 * stride_x + offs, mask=col_mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + row64 * stride_res + offs, mask=col_mask, other=0.0)
                # Round the sum to the activation dtype, as an unfused add would, before normalising it.
                x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
                tl.store(h_ptr + row64 * stride_h + offs, x, mask=col_mask)
            xf = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
            normed = (xf * rstd).to(x.dtype).to(tl.float32)
            tl.store(out_ptr + row64 * stride_out + offs, (normed * w).to(x.dtype), mask=col_mask)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    config: RMSNormConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (or ``x``), returns ``(rmsnorm(h) * weight, h)``, both new tensors.

    x, residual: (num_tokens, hidden), same float dtype; weight: (hidden,), any float dtype.
    """
    assert x.dim() == 2, f"x must be (num_tokens, hidden), got {tuple(x.shape)}"
    num_rows, hidden = x.shape
    check_float("x", x)
    check_last_contiguous("x", x)
    assert weight.shape == (hidden,) and weight.is_contiguous(), f"weight must be ({hidden},)"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x"
        check_last_contiguous("residual", residual)
    cfg = config or default_config(hidden)
    out = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    res = residual if residual is not None else x
    grid = (triton.cdiv(num_rows, cfg.rows_per_program),)
    _rmsnorm_kernel[grid](
        x, res, weight, out, h, num_rows, hidden, eps,
        x.stride(0), res.stride(0), out.stride(0), h.stride(0),
        HAS_RESIDUAL=residual is not None, ROWS=cfg.rows_per_program, BLOCK=next_pow2(hidden),
        num_warps=cfg.num_warps, **pdl_args(x),
    )
    return out, h


def rmsnorm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch, rounding where HF LlamaRMSNorm and an unfused residual add round."""
    h = x + residual if residual is not None else x
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype), h
