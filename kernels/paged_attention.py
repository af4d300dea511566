"""Paged attention over block tables, with GQA: a decode kernel (split-K + reduction) and an extend kernel.

Cache layout (per layer, shared with the worker):
    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim), head_dim contiguous.
    block_tables: int32 (num_seqs, max_blocks_per_seq); entry j is the physical block holding tokens
    [j*block_size, (j+1)*block_size) of that sequence; -1 marks unused entries (never read).
Decode: one query (num_heads, head_dim) per sequence attends to its first context_len cached tokens.
Extend: flattened queries (num_tokens, num_heads, head_dim), sequence s owning rows
cu_query_lens[s]:cu_query_lens[s+1]; context_lens[s] counts the KV after this step, the new tokens
included (their K/V are already in the cache), so query i of s sits at position
context_lens[s] - query_len + i and attends causally to keys 0..that position.
Scores use exp2 with log2(e) folded into the scale; partial maxima are kept in that base-2 domain.

Precision: for bf16/fp16 caches both kernels compute float32 maths on the cached values and round once, at
the output, so they agree with the float32 reference (and the worker's torch backend, which does the same)
to that one rounding. Scores are float32 dots of the 16-bit q and k (exact products, float32 sums). The
probabilities P stay float32: a single 16-bit P in the P@V dot would round each one by up to 2^-9 while the
row sum l_i adds the unrounded ones, an error of a fraction of an output ulp that flips the output's
rounding on a good share of elements (and, through a deep network, the logits). So P is split into
hi = P.to(v.dtype) and lo = (P - hi).to(v.dtype), and the kernels accumulate dot(hi, v) + dot(lo, v) in
float32: P to about 2^-17 relative, still on the tensor cores. Cost: one more (rows x keys x head_dim) MMA
beside the two of q.k and P@V, i.e. 1.5x the attention MMA work. Decode is bound by reading K/V, which
does not change, and on an H200 it kept its bandwidth (docs/perf.md, second pass); the extend (prefill)
kernel pays it: 25-33% longer than one P@V on an H200 (docs/perf.md, fourth pass). Float32 caches need none
of this (P is never rounded). ROUND_P_BEFORE_PV switches the split off, for the tests' negative control and
the benchmark's price of the split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.common import check_float, dot, dot_args, pdl_args, pdl_wait
from kernels.sizes import next_pow2

_LOG2E = 1.4426950408889634

ROUND_P_BEFORE_PV = False
"""True rounds P to the cache dtype before one P@V dot (the old kernels): the tests' negative control, which
the bitwise checks against the float32 reference must catch, and what ``bench_kernels.py`` prices the split
against. Read at launch."""


@triton.jit
def _pv(p, v, SPLIT_P: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """P (float32) @ V, accumulated in float32; with SPLIT_P, P is carried as hi + lo in V's dtype."""
    hi = p.to(v.dtype)
    out = dot(hi, v, DOT_PRECISION, DOT_UPCAST)
    if SPLIT_P:
        lo = (p - hi.to(tl.float32)).to(v.dtype)
        out += dot(lo, v, DOT_PRECISION, DOT_UPCAST)
    return out


def _split_p(dtype: torch.dtype) -> bool:
    return dtype != torch.float32 and not ROUND_P_BEFORE_PV


@dataclass(frozen=True)
class DecodeConfig:
    """block_n: keys per inner step; partition: keys per program (a split); 0 = whole context, no split."""

    block_n: int = 64
    partition: int = 512
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class ExtendConfig:
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def default_decode_config(num_seqs: int, num_kv_heads: int, max_context_len: int) -> DecodeConfig:
    # Split until there are about four programs per multiprocessor of an H200 (132).
    partition = 0
    if num_seqs * num_kv_heads < 512:
        partition = max(256, next_pow2(max_context_len * num_seqs * num_kv_heads // 512))
        if partition >= max_context_len:
            partition = 0
    return DecodeConfig(block_n=64, partition=partition, num_warps=4, num_stages=2)


@triton.jit
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
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, PDL: tl.constexpr = False,
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
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
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
        k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = page * stride_vb + slot * stride_vt + kv_head * stride_vh
        v = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _pv(p, v, SPLIT_P, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new
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


@triton.jit
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


def _check_cache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> None:
    check_float("q", q)
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches: (blocks, block, kv_heads, dim)"
    assert k_cache.dtype == v_cache.dtype == q.dtype, "q, k_cache and v_cache must share a dtype"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "caches must be contiguous in head_dim"
    assert q.stride(-1) == 1, "q must be contiguous in head_dim"
    num_heads, num_kv_heads = q.shape[-2], k_cache.shape[2]
    assert q.shape[-1] == k_cache.shape[3], f"head_dim {q.shape[-1]} != cache head_dim {k_cache.shape[3]}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} kv heads"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.stride(1) == 1


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
) -> torch.Tensor:
    """q: (num_seqs, num_heads, head_dim); context_lens: int32 (num_seqs,), each >= 1. Returns like q.

    max_context_len bounds the splits; pass it (host-known, or an upper bound for graph capture) to
    avoid a device sync.
    """
    assert q.dim() == 3, f"q must be (num_seqs, num_heads, head_dim), got {tuple(q.shape)}"
    _check_cache(q, k_cache, v_cache, block_tables)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    assert block_tables.shape[0] >= num_seqs and context_lens.shape == (num_seqs,)
    assert context_lens.dtype == torch.int32
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max().item())
    assert max_context_len <= block_tables.shape[1] * page, "context longer than the block table"
    cfg = config or default_decode_config(num_seqs, num_kv_heads, max_context_len)
    group = num_heads // num_kv_heads
    split = 0 < cfg.partition < max_context_len
    num_splits = triton.cdiv(max_context_len, cfg.partition) if split else 1
    if split:
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_acc = part_m.new_empty((num_seqs, num_heads, num_splits, head_dim))
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out
    block_d = max(16, next_pow2(head_dim))
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_acc, part_m, part_l, q, k_cache, v_cache, block_tables, context_lens,
        scale * _LOG2E, num_splits, cfg.partition if split else max_context_len,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE=page, BLOCK_N=cfg.block_n, SPLIT=split, SPLIT_P=_split_p(q.dtype),
        **dot_args(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(q),
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_acc, part_m, part_l, context_lens, num_heads, num_splits, cfg.partition,
            out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_pow2(num_splits),
            num_warps=4, **pdl_args(q),
        )
    return out


@triton.jit
def _extend_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, ctx_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    ctx = tl.load(ctx_ptr + seq)
    kv_head = head // GROUP
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    pos = ctx - q_len + offs_m
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    # Keys past this block's last query position are masked for every row: stop before them.
    end = tl.minimum(ctx, ctx - q_len + (m_block + 1) * BLOCK_M)
    for t0 in range(0, end, BLOCK_N):
        offs_n = t0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        page = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        slot = offs_n % PAGE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_rows = page * stride_kb + slot * stride_kt + kv_head * stride_kh
        k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
        # Key 0 is visible to every row, so no row is all -inf after the first step.
        s = tl.where(n_mask[None, :] & (offs_n[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = page * stride_vb + slot * stride_vt + kv_head * stride_vh
        v = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _pv(p, v, SPLIT_P, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    config: ExtendConfig | None = None,
) -> torch.Tensor:
    """q: (num_tokens, num_heads, head_dim); cu_query_lens: int32 (num_seqs+1,).

    context_lens: int32 (num_seqs,), each >= its query_len. Pass max_query_len (host-known) to skip a sync.
    """
    assert q.dim() == 3, f"q must be (num_tokens, num_heads, head_dim), got {tuple(q.shape)}"
    _check_cache(q, k_cache, v_cache, block_tables)
    num_seqs = context_lens.shape[0]
    assert cu_query_lens.shape == (num_seqs + 1,) and cu_query_lens.dtype == torch.int32
    assert context_lens.dtype == torch.int32 and block_tables.shape[0] >= num_seqs
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_seqs == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_query_lens[1:] - cu_query_lens[:-1]).max().item())
    cfg = config or ExtendConfig()
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, cfg.block_m))
    _extend_kernel[grid](
        out, q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
        PAGE=k_cache.shape[1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT_P=_split_p(q.dtype),
        **dot_args(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _gather_kv(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    page = cache.shape[1]
    blocks = block_row[: (length + page - 1) // page].long()
    return cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:length]


def paged_extend_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor, context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Plain PyTorch in float32 (float64 for float64 inputs): gather each sequence's K/V, causal softmax,
    rounded once to q's dtype at the end (the kernels' contract, see the module docstring)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    cu = cu_query_lens.tolist()
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    for s, ctx in enumerate(context_lens.tolist()):
        lo, hi = cu[s], cu[s + 1]
        if hi == lo:
            continue
        k = _gather_kv(k_cache, block_tables[s], ctx).to(compute).repeat_interleave(group, dim=1)
        v = _gather_kv(v_cache, block_tables[s], ctx).to(compute).repeat_interleave(group, dim=1)
        qs = q[lo:hi].to(compute)
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        pos = torch.arange(ctx - (hi - lo), ctx, device=q.device)
        visible = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def paged_decode_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Decode is extend with one query per sequence."""
    ones = torch.ones(q.shape[0], dtype=torch.int32, device=q.device)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32, device=q.device), ones.cumsum(0).to(torch.int32)])
    return paged_extend_reference(q, k_cache, v_cache, block_tables, cu, context_lens, scale)
