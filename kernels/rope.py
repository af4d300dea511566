"""Rotary position embedding (HF Llama "rotate_half" layout), with llama3 frequency scaling.

One launch rotates q and k in place for every token: each program takes one token, reads its
position once and its cos/sin row once, and applies it to all query and key heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._util import check_float, next_pow2


@dataclass(frozen=True)
class Llama3RopeScaling:
    """HF ``rope_scaling`` with ``rope_type == "llama3"`` (Llama 3.1 and later)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None) -> torch.Tensor:
    """(head_dim // 2,) float64 inverse frequencies, llama3-scaled when ``scaling`` is given."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    old_ctx = scaling.original_max_position_embeddings
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    band = scaling.high_freq_factor - scaling.low_freq_factor
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / band
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin_cache(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: Llama3RopeScaling | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """(max_positions, head_dim) float32: cos in the first half of each row, sin in the second."""
    positions = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(positions, rope_inv_freq(head_dim, theta, scaling))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(torch.float32).to(device)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cs_ptr,
    num_q_heads, num_k_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + offs_d)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_d)[None, :]
    offs_h = tl.arange(0, BLOCK_H)
    for which in tl.static_range(2):
        if which == 0:
            base = q_ptr + tok * stride_qt
            num_heads = num_q_heads
            stride_h = stride_qh
        else:
            base = k_ptr + tok * stride_kt
            num_heads = num_k_heads
            stride_h = stride_kh
        for h0 in range(0, num_heads, BLOCK_H):
            heads = h0 + offs_h
            ptrs = base + heads[:, None] * stride_h + offs_d[None, :]
            mask = heads[:, None] < num_heads
            x1 = tl.load(ptrs, mask=mask, other=0.0)
            x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
            a = x1.to(tl.float32)
            b = x2.to(tl.float32)
            tl.store(ptrs, (a * cos - b * sin).to(x1.dtype), mask=mask)
            tl.store(ptrs + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate q (num_tokens, num_heads, head_dim) and k (num_tokens, num_kv_heads, head_dim) in place.

    positions: (num_tokens,) int32/int64, each < cos_sin.shape[0]; cos_sin from :func:`rope_cos_sin_cache`.
    """
    assert q.dim() == 3 and k.dim() == 3, "q and k must be (num_tokens, heads, head_dim)"
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim, f"k {tuple(k.shape)} does not match q"
    assert q.dtype == k.dtype, "q and k must share a dtype"
    check_float("q", q)
    assert q.stride(2) == 1 and k.stride(2) == 1, "q and k must be contiguous in head_dim"
    assert head_dim % 2 == 0 and next_pow2(head_dim // 2) == head_dim // 2, "head_dim/2 must be a power of 2"
    assert positions.shape == (num_tokens,) and positions.dtype in (torch.int32, torch.int64)
    assert cos_sin.dtype == torch.float32 and cos_sin.dim() == 2 and cos_sin.shape[1] == head_dim
    assert cos_sin.stride(1) == 1
    if num_tokens == 0:
        return
    block_h = min(16, next_pow2(max(num_q_heads, k.shape[1])))
    _rope_kernel[(num_tokens,)](
        q, k, positions, cos_sin, num_q_heads, k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        HALF=head_dim // 2, BLOCK_H=block_h, num_warps=4,
    )


def apply_rope_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place HF ``apply_rotary_pos_emb`` (cos/sin in float32, rounded once at the end)."""
    half = q.shape[-1] // 2
    cos = cos_sin[positions.long(), :half].repeat(1, 2)[:, None, :]
    sin = cos_sin[positions.long(), half:].repeat(1, 2)[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rot * sin).to(x.dtype)

    return rotate(q), rotate(k)
