"""Rotary position embedding (HF Llama "rotate_half" layout), with llama3 frequency scaling.

One launch rotates q and k in place for every token: each program takes one token, reads its
cos/sin row once (by position from a table, :func:`apply_rope`, or the token's own row, :func:`apply_rope_cos_sin`,
which the worker uses) and applies it to all query and key heads. The worker's variant can also write the
token's rotated key and its value into the paged KV cache in the same launch (:class:`KVWrite`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from stride.kernels.common import check_float, pdl_args, pdl_wait
from stride.kernels.paged_common import FP8_CACHE, is_keys_inner
from stride.kernels.sizes import next_pow2


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
def _rounded(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to nearest-even in ``dtype``, kept in float32.

    bfloat16 by bit arithmetic: a plain cast rounds to nearest-even on a GPU but truncates in Triton's
    interpreter, and the CPU tests check the rounding bit for bit.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _fp8_rounded(x):
    """float32 ``x`` on float8_e4m3fn's grid, kept in float32: nearest-even, saturated at +-448 (what the reference
    backend's cast gives). Rounded here, so that the cast that stores it is exact: Triton's interpreter rounds some
    values to the wrong neighbour, and the CPU tests check the cache bit for bit. NaN is stored as 0, as the reference
    backend stores it: an 8-bit cache holds finite values only, which its keys-inner V reads rely on
    (``paged_common.load_v_keys_inner``)."""
    x = tl.where(x == x, x, 0.0)
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.uint32, bitcast=True)
    # Normal range (|x| >= 2^-6): 3 mantissa bits kept, nearest-even, by bit arithmetic.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # Subnormals: multiples of 2^-9, where 1.5 * 2^14 + |x| rounds |x| to nearest-even (no fused adds in this
    # kernel); x's sign put back by bits, so that a tiny negative value is -0 as the cast makes it.
    sub = ((tl.abs(x) + 24576.0) - 24576.0).to(tl.uint32, bitcast=True) | (bits & 0x80000000)
    return tl.where((bits & 0x7FFFFFFF) >= 0x3C800000, normal, sub.to(tl.float32, bitcast=True))


@triton.jit
def _to_cache(x, x_dtype: tl.constexpr, cache_dtype: tl.constexpr):
    """float32 ``x`` (already on ``x_dtype``'s grid) as stored in a cache of ``cache_dtype``."""
    if cache_dtype == tl.float8e4nv:
        return _fp8_rounded(x).to(cache_dtype)
    else:
        return x.to(cache_dtype)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    num_q_heads, num_k_heads, half,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin, second_half,
    stride_vt, stride_vh, stride_cs, stride_ch, page, stride_cvb, stride_cvs, stride_cvh, stride_cvd,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BY_POSITION: tl.constexpr, ROUND_PRODUCTS: tl.constexpr,
    CACHE: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    if CACHE:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
    if BY_POSITION:
        row = tl.load(pos_ptr + tok).to(tl.int64)
    else:
        row = tok
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < half
    # cos/sin of each half come from their own columns (second_half = 0 when a row holds one half only).
    cos_row, sin_row = cos_ptr + row * stride_cos, sin_ptr + row * stride_sin
    cos1 = tl.load(cos_row + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + second_half + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + second_half + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
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
            mask = (heads[:, None] < num_heads) & d_mask[None, :]
            x1 = tl.load(ptrs, mask=mask, other=0.0)
            x2 = tl.load(ptrs + half, mask=mask, other=0.0)
            a = x1.to(tl.float32)
            b = x2.to(tl.float32)
            if ROUND_PRODUCTS:
                # Eager PyTorch's ``x * cos + rotate_half(x) * sin``: each product rounds to x's dtype, then
                # the sum does (``-(b * s)`` rounds like ``(-b) * s``, so the subtraction matches too).
                out1 = _rounded(_rounded(a * cos1, x1.dtype) - _rounded(b * sin1, x1.dtype), x1.dtype)
                out2 = _rounded(_rounded(b * cos2, x1.dtype) + _rounded(a * sin2, x1.dtype), x1.dtype)
            else:
                out1 = a * cos1 - b * sin1
                out2 = b * cos2 + a * sin2
            tl.store(ptrs, out1.to(x1.dtype), mask=mask)
            tl.store(ptrs + half, out2.to(x1.dtype), mask=mask)
            if CACHE and which == 1:  # the rotated key, and below the value, into the token's cache slot
                cptrs = kc_ptr + slot * stride_cs + heads[:, None] * stride_ch + offs_d[None, :]
                cache_dtype = kc_ptr.dtype.element_ty
                tl.store(cptrs, _to_cache(out1, x1.dtype, cache_dtype), mask=mask)
                tl.store(cptrs + half, _to_cache(out2, x1.dtype, cache_dtype), mask=mask)
    if CACHE:
        for h0 in range(0, num_k_heads, BLOCK_H):
            heads = h0 + offs_h
            mask = (heads[:, None] < num_k_heads) & d_mask[None, :]
            vptrs = v_ptr + tok * stride_vt + heads[:, None] * stride_vh + offs_d[None, :]
            # By the V cache's own strides: it may be keys-inner (stride/workers/kv_cache.py: v_keys_inner).
            cptrs = (vc_ptr + (slot // page) * stride_cvb + (slot % page) * stride_cvs + heads[:, None] * stride_cvh
                     + offs_d[None, :] * stride_cvd)
            cache_dtype = vc_ptr.dtype.element_ty
            v1 = tl.load(vptrs, mask=mask, other=0.0)
            v2 = tl.load(vptrs + half, mask=mask, other=0.0)
            tl.store(cptrs, _to_cache(v1.to(tl.float32), v1.dtype, cache_dtype), mask=mask)
            tl.store(cptrs + half * stride_cvd, _to_cache(v2.to(tl.float32), v1.dtype, cache_dtype), mask=mask)


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    assert q.dim() == 3 and k.dim() == 3, "q and k must be (num_tokens, heads, head_dim)"
    assert k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2], f"k {tuple(k.shape)} does not match q"
    assert q.dtype == k.dtype, "q and k must share a dtype"
    check_float("q", q)
    assert q.stride(2) == 1 and k.stride(2) == 1, "q and k must be contiguous in head_dim"
    assert q.shape[2] % 2 == 0, "head_dim must be even"


@dataclass(frozen=True)
class KVWrite:
    """Where :func:`apply_rope_cos_sin` also writes each token's rotated key and its value: ``v`` (num_tokens,
    num_kv_heads, head_dim), the paged caches (num_blocks, block_size, num_kv_heads, head_dim) of k's dtype, and
    ``slots`` (num_tokens,) int64, token t's row ``block * block_size + offset`` of the caches (the attention
    metadata's ``slot_mapping``). Caches of float8_e4m3fn (``--kv-dtype fp8``) get each value rounded to nearest-even
    from k's dtype and saturated at +-448, as the reference backend's ``write_kv`` stores them."""

    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor


def _check_kv_write(k: torch.Tensor, kv: KVWrite) -> None:
    assert kv.v.shape == k.shape and kv.v.dtype == k.dtype and kv.v.stride(2) == 1, "v must be laid out like k"
    for name, c in (("k_cache", kv.k_cache), ("v_cache", kv.v_cache)):
        assert c.dim() == 4 and c.shape[2:] == k.shape[1:], f"{name} must be (blocks, block_size, kv_heads, head_dim)"
        assert c.dtype in (k.dtype, FP8_CACHE), f"{name} must be in k's dtype or float8_e4m3fn"
    assert kv.k_cache.is_contiguous(), "k_cache must be contiguous"
    assert kv.v_cache.is_contiguous() or is_keys_inner(kv.v_cache), "v_cache must be contiguous or keys-inner"
    assert kv.v_cache.shape == kv.k_cache.shape, "k_cache and v_cache must have one shape"
    assert kv.slots.shape == (k.shape[0],) and kv.slots.dtype in (torch.int32, torch.int64), "one slot per token"


def _launch(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
    second_half: int, round_products: bool, kv: KVWrite | None = None,
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    block_h = min(16, next_pow2(max(num_q_heads, k.shape[1])))
    # The cache operands (v, the two caches, the slots) and their strides; q stands in for unused pointers.
    if kv is not None:
        cache_ptrs = (kv.v, kv.k_cache, kv.v_cache, kv.slots)
        cache_strides = (kv.v.stride(0), kv.v.stride(1), kv.k_cache.stride(1), kv.k_cache.stride(2),
                         kv.v_cache.shape[1], *kv.v_cache.stride())
    else:
        cache_ptrs, cache_strides = (q, q, q, q), (0, 0, 0, 0, 1, 0, 0, 0, 0)
    # No fused multiply-adds: a float32 run must round each product as the unfused PyTorch ops do.
    _rope_kernel[(num_tokens,)](
        q, k, positions if positions is not None else q, cos, sin, *cache_ptrs, num_q_heads, k.shape[1],
        head_dim // 2, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), second_half,
        *cache_strides, BLOCK_D=next_pow2(head_dim // 2), BLOCK_H=block_h, BY_POSITION=positions is not None,
        ROUND_PRODUCTS=round_products, CACHE=kv is not None, num_warps=4, enable_fp_fusion=False, **pdl_args(q),
    )


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate q (num_tokens, num_heads, head_dim) and k (num_tokens, num_kv_heads, head_dim) in place.

    positions: (num_tokens,) int32/int64, each < cos_sin.shape[0]; cos_sin from :func:`rope_cos_sin_cache`.
    Computes in float32 and rounds once, at the end.
    """
    _check_qk(q, k)
    half = q.shape[2] // 2
    assert positions.shape == (q.shape[0],) and positions.dtype in (torch.int32, torch.int64)
    assert cos_sin.dtype == torch.float32 and cos_sin.dim() == 2 and cos_sin.shape[1] == 2 * half
    assert cos_sin.stride(1) == 1
    _launch(q, k, positions, cos_sin, cos_sin[:, half:], 0, round_products=False)


def apply_rope_cos_sin(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv: KVWrite | None = None) -> None:
    """Rotate q and k in place, one launch, with per-token ``cos``/``sin`` rows (num_tokens, head_dim) in q's
    dtype, as transformers makes them (``cat(freqs, freqs)`` in float32, then cast).

    Rounds exactly where eager ``x * cos + rotate_half(x) * sin`` rounds (each product, then the sum), so it
    gives bit for bit what :func:`apply_rope_cos_sin_reference` gives, in every dtype.

    ``kv``: the same launch also writes the rotated keys and the values into the paged KV cache (the worker's
    decode then spends no separate launches on that; :class:`KVWrite`), as the reference attention backend's
    ``write_kv`` (``stride/workers/attention.py``) does.
    """
    _check_qk(q, k)
    if kv is not None:
        _check_kv_write(k, kv)
    num_tokens, _, head_dim = q.shape
    for name, t in (("cos", cos), ("sin", sin)):
        assert t.shape == (num_tokens, head_dim), f"{name} must be ({num_tokens}, {head_dim}), got {tuple(t.shape)}"
        assert t.dtype == q.dtype and t.stride(1) == 1, f"{name} must be contiguous rows in q's dtype"
    _launch(q, k, None, cos, sin, head_dim // 2, round_products=True, kv=kv)


def apply_rope_cos_sin_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place HF ``apply_rotary_pos_emb`` (rotate-half layout) in q's dtype."""
    half = q.shape[-1] // 2

    def rotate(x: torch.Tensor) -> torch.Tensor:
        return x * cos[:, None, :] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None, :]

    return rotate(q), rotate(k)


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
