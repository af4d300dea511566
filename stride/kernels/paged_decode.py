"""Paged decode attention: one query per sequence over its cached context, split over programs where the batch alone
would not fill the GPU, the splits' partials combined by a reduction kernel (layout and precision:
:mod:`stride.kernels.paged_common`); beside its reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from stride.kernels.common import dot, dot_args, pdl_args, pdl_wait
from stride.kernels.paged_common import (
    FP8_CACHE,
    LOG2E,
    check_cache,
    is_keys_inner,
    load_v,
    out_like,
    pv,
    pv_stacked,
    split_p,
    v_sub,
    widen_to_f16,
)
from stride.kernels.paged_extend import paged_extend_reference
from stride.kernels.sizes import next_pow2


@dataclass(frozen=True)
class DecodeConfig:
    """block_n: keys per inner step; partition: keys per program (a split); 0 = whole context, no split."""

    block_n: int = 64
    partition: int = 512
    num_warps: int = 4
    num_stages: int = 2


def default_decode_config(
    num_seqs: int, num_kv_heads: int, max_context_len: int, cache_dtype: torch.dtype = torch.bfloat16,
    v_keys_inner: bool = False,
) -> DecodeConfig:
    # 128 keys a step: alone on an H200 (perf-log, 2026-12-03) 0.97-0.81x the time of 64 at batch 256 x 1.5k, 64 x 2k
    # and 32 x 8k over bf16 caches, 0.72x over 8-bit ones with head_dim-contiguous V (with a third stage, which 16-bit
    # tiles do not need). Over a keys-inner 8-bit V (the worker's) two stages again: in an 8B step at 256 x 1.5k /
    # 64 x 1.5k 7.83 / 2.04 ms of decode kernel against 8.85-8.93 / 2.81 with three (perf-log, 2026-12-04). Split
    # until there are about four programs per multiprocessor of an H200 (132).
    partition = 0
    if num_seqs * num_kv_heads < 512:
        partition = max(256, next_pow2(max_context_len * num_seqs * num_kv_heads // 512))
        if partition >= max_context_len:
            partition = 0
    stages = 3 if cache_dtype == FP8_CACHE and not v_keys_inner else 2
    return DecodeConfig(block_n=128, partition=partition, num_warps=4, num_stages=stages)


# Per-step values are not specialised on (Triton would compile a variant per divisibility-by-16 of each int and per
# 16-byte alignment of each pointer): the block tables' row stride, the context lengths and the tables of a mixed
# step's decodes or chunks (rows of the step's tensors, offset by the decodes before them), the split count and
# partition. Every step of a shape then runs one compiled kernel, which the worker's warm-up compiles before
# serving; each is read a few times per program, so no load is wider for knowing them.
@triton.jit
def _same_halves(s, HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    """``s`` (2 * HALF, BLOCK_N) with each row and its copy HALF rows on set to the larger of the two. STACK_P's
    halves come from the same query rows, so they should hold the same scores, but a dot need not give two equal rows
    equal bits: the interpreter's float32 matmul (OpenBLAS) sums some rows of a tile in another order than others on
    an AVX2 CPU. Then P's high part (from one copy) and low part (from the other) straddle a rounding boundary of P,
    an error of one 16-bit ulp of P that showed as up to 7 ulps of the output (fp16, AVX2 CPU, 2026-12-07). Only
    there (DOT_UPCAST): on a GPU the tile is one MMA whose rows all go through the same instructions, and this
    reshuffle of the scores (likely through shared memory) has not been timed there."""
    pair = tl.max(tl.reshape(s, [2, HALF, BLOCK_N]), axis=0)
    return tl.reshape(tl.broadcast_to(pair[None, :, :], [2, HALF, BLOCK_N]), [2 * HALF, BLOCK_N])


@triton.jit(do_not_specialize=["num_splits", "partition", "stride_bt"],
            do_not_specialize_on_alignment=["bt_ptr", "ctx_ptr"])
def _decode_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr,
    qk_scale, num_splits, partition,
    stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_os, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, SPLIT_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, KV_F16: tl.constexpr = False, PDL: tl.constexpr = False,
    STACK_P: tl.constexpr = False, HALF: tl.constexpr = 16, V_SUB: tl.constexpr = 0,
):
    pdl_wait(PDL)  # first: every program waits, even one with nothing to do
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    start = split * partition
    if start >= ctx:
        return
    end = ctx
    if SPLIT:
        end = tl.minimum(start + partition, ctx)
    # With STACK_P the group's query rows come twice, the second copy (rows HALF..) carrying P's low part into the
    # same P@V dot as the first copy's high part (pv's split at the cost of one dot: the rows are there anyway, an MMA
    # has 16); the two halves of acc are summed at the end. HALF: BLOCK_G // 2 with STACK_P, else BLOCK_G.
    offs_r = tl.arange(0, BLOCK_G)
    offs_g = offs_r % HALF
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_F16:  # 8-bit caches widen to fp16 (one instruction on a GPU), so q joins them there (exact in range)
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for t0 in range(start, end, BLOCK_N):
        offs_n = t0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        page = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        slot = offs_n % PAGE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_rows = page * stride_kb + slot * stride_kt + kv_head * stride_kh
        k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
        if STACK_P and DOT_UPCAST:
            s = _same_halves(s, HALF, BLOCK_N)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = load_v(v_ptr, bt_row, page, slot, kv_mask, t0, end, kv_head, stride_vb, stride_vt, stride_vh, offs_d,
                   d_mask, PAGE, V_SUB, BLOCK_N, BLOCK_D).to(q.dtype)
        if STACK_P:
            acc = acc * alpha[:, None] + pv_stacked(p, v, offs_r >= HALF, DOT_PRECISION, DOT_UPCAST)
        else:
            acc = acc * alpha[:, None] + pv(p, v, SPLIT_P, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new
    if STACK_P:  # the halves' m and l are equal (same scores): keep one; their accumulators add
        acc = tl.sum(tl.reshape(acc, [2, HALF, BLOCK_D]), axis=0)
        m_i = tl.max(tl.reshape(m_i, [2, HALF]), axis=0)
        l_i = tl.max(tl.reshape(l_i, [2, HALF]), axis=0)
        offs_g = tl.arange(0, HALF)
        heads = kv_head * GROUP + offs_g
        g_mask = offs_g < GROUP
    if SPLIT:
        # Unnormalised partials, laid out (num_seqs, num_heads, num_splits[, head_dim]).
        row = (seq * (GROUP * tl.num_programs(1)) + heads).to(tl.int64) * num_splits + split
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_splits", "partition"], do_not_specialize_on_alignment=["ctx_ptr"])
def _decode_reduce_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, ctx_ptr,
    num_heads, num_splits, partition, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(ctx_ptr + seq)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    # Splits past the context were never written: mask them by the context, not by what memory holds.
    s_mask = (offs_s < num_splits) & (offs_s * partition < ctx)
    row = (seq * num_heads + head).to(tl.int64) * num_splits + offs_s
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(s_mask, tl.exp2(m - m_max), 0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def workspace_bytes(
    num_seqs: int, num_heads: int, head_dim: int, max_context_len: int, cfg: DecodeConfig
) -> int:
    """Float32 partials the split decode needs (0 when it does not split)."""
    if cfg.partition <= 0 or cfg.partition >= max_context_len:
        return 0
    return num_seqs * num_heads * triton.cdiv(max_context_len, cfg.partition) * (head_dim + 2) * 4


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    config: DecodeConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: (num_seqs, num_heads, head_dim); context_lens: int32 (num_seqs,), each >= 1. Returns like q (``out``
    when given: a tensor of q's shape and dtype, rows of a larger one allowed).

    max_context_len bounds the splits; pass it (host-known, or an upper bound for graph capture) to
    avoid a device sync.
    """
    assert q.dim() == 3, f"q must be (num_seqs, num_heads, head_dim), got {tuple(q.shape)}"
    check_cache(q, k_cache, v_cache, block_tables)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    assert block_tables.shape[0] >= num_seqs and context_lens.shape == (num_seqs,)
    assert context_lens.dtype == torch.int32
    out = out_like(q, out)
    if num_seqs == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max().item())
    assert max_context_len <= block_tables.shape[1] * page, "context longer than the block table"
    cfg = config or default_decode_config(num_seqs, num_kv_heads, max_context_len, k_cache.dtype,
                                          is_keys_inner(v_cache))
    group = num_heads // num_kv_heads
    split = 0 < cfg.partition < max_context_len
    assert not split or cfg.partition % cfg.block_n == 0, "a partition must be whole key tiles"
    num_splits = triton.cdiv(max_context_len, cfg.partition) if split else 1
    if split:
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_acc = part_m.new_empty((num_seqs, num_heads, num_splits, head_dim))
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out
    block_d = max(16, next_pow2(head_dim))
    block_g = max(16, next_pow2(group))
    # P's two parts in one dot where the group's rows fit twice in a 16-row MMA (up to 8 query heads a KV head).
    stack_p = split_p(q.dtype) and 2 * next_pow2(group) <= 16
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_acc, part_m, part_l, q, k_cache, v_cache, block_tables, context_lens,
        scale * LOG2E, num_splits, cfg.partition if split else max_context_len,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE=page, BLOCK_N=cfg.block_n, SPLIT=split, SPLIT_P=split_p(q.dtype), STACK_P=stack_p,
        HALF=block_g // 2 if stack_p else block_g, V_SUB=v_sub(v_cache, cfg.block_n),
        KV_F16=widen_to_f16(q, k_cache),
        **dot_args(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(q),
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_acc, part_m, part_l, context_lens, num_heads, num_splits, cfg.partition,
            out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_pow2(num_splits),
            num_warps=4, **pdl_args(q),
        )
    return out


def paged_decode_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Decode is extend with one query per sequence."""
    ones = torch.ones(q.shape[0], dtype=torch.int32, device=q.device)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32, device=q.device), ones.cumsum(0).to(torch.int32)])
    return paged_extend_reference(q, k_cache, v_cache, block_tables, cu, context_lens, scale)
