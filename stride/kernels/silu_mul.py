"""SiLU-and-mul: ``silu(gate) * up`` over the fused gate|up projection output, in one pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from stride.kernels.common import check_float, check_last_contiguous, pdl_args, pdl_wait


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


@dataclass(frozen=True)
class SiluMulConfig:
    """block: columns of one row per program."""

    block: int = 1024
    num_warps: int = 4


def silu_mul(x: torch.Tensor, config: SiluMulConfig | None = None) -> torch.Tensor:
    """x: (num_tokens, 2 * intermediate) laid out [gate | up]; returns (num_tokens, intermediate)."""
    cfg = config or SiluMulConfig()
    assert cfg.block & (cfg.block - 1) == 0, f"block must be a power of two, got {cfg.block}"
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be (num_tokens, 2*inter), got {tuple(x.shape)}"
    check_float("x", x)
    check_last_contiguous("x", x)
    num_rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    grid = (num_rows, triton.cdiv(inter, cfg.block))
    _silu_mul_kernel[grid](x, out, inter, x.stride(0), out.stride(0), BLOCK=cfg.block, num_warps=cfg.num_warps,
                           **pdl_args(x))
    return out


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
