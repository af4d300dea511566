"""Paged attention over block tables, with GQA: what the decode kernel (:mod:`stride.kernels.paged_decode`, split-K
and a reduction) and the extend kernel (:mod:`stride.kernels.paged_extend`) share: the cache layout, the precision
contract and the P@V step that keeps it, the launchers' checks.

Cache layout (per layer, shared with the worker):
    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim), head_dim contiguous; except that an 8-bit
    V cache is stored keys-inner (:func:`is_keys_inner`; the worker's rule and why: ``stride/workers/kv_cache.py``):
    the same logical shape over storage ordered (num_blocks, num_kv_heads, head_dim, block_size), a block's keys
    contiguous for each value element. The kernels take either by its strides.
    block_tables: int32 (num_seqs, max_blocks_per_seq); entry j is the physical block holding tokens
    [j*block_size, (j+1)*block_size) of that sequence; -1 marks unused entries (never read).
Decode: one query (num_heads, head_dim) per sequence attends to its first context_len cached tokens.
Extend: flattened queries (num_tokens, num_heads, head_dim), sequence s owning rows
cu_query_lens[s]:cu_query_lens[s+1]; context_lens[s] counts the KV after this step, the new tokens
included (their K/V are already in the cache), so query i of s sits at position
context_lens[s] - query_len + i and attends causally to keys 0..that position.
Scores use exp2 with log2(e) folded into the scale; partial maxima are kept in that base-2 domain.

Precision: for bf16/fp16 caches (and float8_e4m3fn ones, widened at load: :data:`FP8_CACHE`) both kernels compute
float32 maths on the cached values and round once, at the output, so they agree with the float32 reference (and the
worker's torch backend, which does the same) to that one rounding. Scores are float32 dots of the 16-bit q and k
(exact products, float32 sums). The probabilities P stay float32: a single 16-bit P in the P@V dot would round each
one by up to 2^-9 while the row sum l_i adds the unrounded ones, an error of a fraction of an output ulp that flips
the output's rounding on a good share of elements (and, through a deep network, the logits). So P is split into hi =
P.to(v.dtype) and lo = (P - hi).to(v.dtype), and the kernels accumulate dot(hi, v) + dot(lo, v) in float32: P to
about 2^-17 relative, still on the tensor cores. Cost: one more (rows x keys x head_dim) MMA beside the two of q.k
and P@V, i.e. 1.5x the attention MMA work. Decode is bound by reading K/V, which does not change, and on an H200 it
kept its bandwidth alone (docs/perf-log.md, second pass), but the extra MMA cost it 4-6% of its time (H200,
perf-log 2026-12-04), so it carries lo under hi in the same dot where a group's query rows fit twice in the 16-row
MMA they pad anyway (``paged_decode``'s STACK_P); the extend (prefill) kernel pays it: 25-33% longer than one P@V on
an H200 (docs/perf-log.md, fourth pass). Float32 caches need none of this (P is never rounded). ROUND_P_BEFORE_PV
switches the split off, for the tests' negative control and the benchmark's price of the split. """

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stride.kernels.common import check_float, dot

LOG2E = 1.4426950408889634

FP8_CACHE = torch.float8_e4m3fn
"""The 8-bit cache dtype (``--kv-dtype fp8``): the kernels widen each loaded key and value exactly (to fp16 beside a
16-bit q, :func:`widen_to_f16`; to float32 beside a float32 one) and attend as over a 16-bit cache; the error is all
in the writing, which rounds each value to 3 mantissa bits (``stride/kernels/rope.py``'s ``_fp8_rounded``, and the torch
backend's cast)."""

ROUND_P_BEFORE_PV = False
"""True rounds P to the cache dtype before one P@V dot (the old kernels): the tests' negative control, which
the bitwise checks against the float32 reference must catch, and what ``bench_kernels.py`` prices the split
against. Read at launch."""


@triton.jit
def _low_part(p, hi):
    """What P (float32) keeps past its high part ``hi`` (P in V's dtype), itself in that dtype."""
    return (p - hi.to(tl.float32)).to(hi.dtype)


@triton.jit
def pv(p, v, SPLIT_P: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """P (float32) @ V, accumulated in float32; with SPLIT_P, P is carried as hi + lo in V's dtype."""
    hi = p.to(v.dtype)
    out = dot(hi, v, DOT_PRECISION, DOT_UPCAST)
    if SPLIT_P:
        out += dot(_low_part(p, hi), v, DOT_PRECISION, DOT_UPCAST)
    return out


@triton.jit
def pv_stacked(p, v, lo_rows, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """:func:`pv`'s split in one dot, for P whose rows come twice (the same scores): the rows where ``lo_rows`` is
    set carry P's low part, the others its high part; the caller adds the two halves of the result."""
    hi = p.to(v.dtype)
    return dot(tl.where(lo_rows[:, None], _low_part(p, hi), hi), v, DOT_PRECISION, DOT_UPCAST)


def is_keys_inner(cache: torch.Tensor) -> bool:
    """Whether ``cache`` (blocks, block_size, kv_heads, head_dim) is stored keys-inner: a block of one head packed as
    (head_dim, block_size)."""
    _, page, h, d = cache.shape
    return page > 1 and cache.stride(1) == 1 and cache.stride(3) == page and cache.stride(2) == d * page


def keys_inner_copy(cache: torch.Tensor) -> torch.Tensor:
    """``cache``'s values in a new tensor stored keys-inner (the worker's 8-bit V layout; for tests and benchmarks)."""
    return cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


@triton.jit
def load_v_keys_inner(v_ptr, bt_row, t0, end, kv_head, stride_vb, stride_vh, offs_d, d_mask,
                      PAGE: tl.constexpr, SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Keys ``t0 .. t0 + BLOCK_N`` of one KV head from a keys-inner V cache, as a (BLOCK_N, BLOCK_D) tile; ``t0`` a
    multiple of BLOCK_N. Read as BLOCK_N // SUB runs of SUB keys (SUB = min(PAGE, BLOCK_N), both powers of two), each
    within one page, so the loads go along the keys, up to 16 bytes at a time. A run is read whole where it starts
    before ``end``: the keys past ``end`` in it are other tokens' or never written, and the caller's P is 0 there, so
    they add exact zeros provided they are finite. A keys-inner cache must hold finite values only: the worker's (8-bit)
    ones do by construction (zeroed at start; its writers store NaN as 0 and saturate: ``stride/kernels/rope.py``,
    ``stride/workers/attention.py``); ``tests/kernels/test_kernels_attention.py`` shows a NaN there reaching the
    output."""
    starts = t0 + tl.arange(0, BLOCK_N // SUB) * SUB
    run = starts < end
    base = tl.load(bt_row + starts // PAGE, mask=run, other=0).to(tl.int64) * stride_vb + kv_head * stride_vh
    if SUB < PAGE:
        base += starts % PAGE
    offs_k = tl.arange(0, SUB)
    v = tl.load(v_ptr + base[:, None, None] + offs_k[None, :, None] + offs_d[None, None, :] * PAGE,
                mask=run[:, None, None] & d_mask[None, None, :], other=0.0)
    return tl.reshape(v, [BLOCK_N, BLOCK_D])


@triton.jit
def load_v(v_ptr, bt_row, page, slot, kv_mask, t0, end, kv_head, stride_vb, stride_vt, stride_vh, offs_d, d_mask,
           PAGE: tl.constexpr, V_SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Both kernels' V tile, keys ``t0 .. t0 + BLOCK_N`` of one KV head: from a keys-inner cache (``V_SUB`` > 0,
    :func:`v_sub`) in runs along its keys, :func:`load_v_keys_inner`; else key by key at the caller's ``page`` and
    ``slot`` (per key) under its ``kv_mask``."""
    if V_SUB:
        return load_v_keys_inner(v_ptr, bt_row, t0, end, kv_head, stride_vb, stride_vh, offs_d, d_mask,
                                 PAGE, V_SUB, BLOCK_N, BLOCK_D)
    else:
        rows = page * stride_vb + slot * stride_vt + kv_head * stride_vh
        return tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)


def v_sub(v_cache: torch.Tensor, block_n: int) -> int:
    """The SUB of :func:`load_v_keys_inner` for a keys-inner ``v_cache`` and a key tile of ``block_n``; 0 for a
    cache with head_dim contiguous."""
    return min(v_cache.shape[1], block_n) if is_keys_inner(v_cache) else 0


def widen_to_f16(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernels attend over an 8-bit cache in fp16: a 16-bit q with :data:`FP8_CACHE` caches. Every
    float8_e4m3fn value is an fp16 one, and the widening is one instruction on Hopper where widening to bf16 is
    emulated (the decode kernel ran at a third of the bandwidth it reads bf16 caches at); q (bf16) is exact in fp16
    between 2^-14 and 65504, and the maths stay float32 as over 16-bit caches."""
    return k_cache.dtype == FP8_CACHE and q.dtype != torch.float32


def split_p(dtype: torch.dtype) -> bool:
    return dtype != torch.float32 and not ROUND_P_BEFORE_PV


def check_cache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> None:
    check_float("q", q)
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches: (blocks, block, kv_heads, dim)"
    assert k_cache.dtype == v_cache.dtype, "k_cache and v_cache must share a dtype"
    assert k_cache.dtype in (q.dtype, FP8_CACHE), "the caches must be in q's dtype or float8_e4m3fn"
    assert k_cache.stride(3) == 1, "k_cache must be contiguous in head_dim"
    page = k_cache.shape[1]
    assert v_cache.stride(3) == 1 or (is_keys_inner(v_cache) and page & (page - 1) == 0), (
        "v_cache must be contiguous in head_dim, or keys-inner with a power-of-two block size")
    assert q.stride(-1) == 1, "q must be contiguous in head_dim"
    num_heads, num_kv_heads = q.shape[-2], k_cache.shape[2]
    assert q.shape[-1] == k_cache.shape[3], f"head_dim {q.shape[-1]} != cache head_dim {k_cache.shape[3]}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} kv heads"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.stride(1) == 1


def out_like(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The launchers' output: a new tensor like q, or the caller's (q's shape, dtype and device, head_dim
    contiguous: the kernels store through its first two strides)."""
    if out is None:
        return torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device, "out must be like q"
    assert out.stride(-1) == 1, "out must be contiguous in head_dim"
    return out


def gather_kv(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    page = cache.shape[1]
    blocks = block_row[: (length + page - 1) // page].long()
    return cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:length]
