"""Paged extend (prefill) attention: flattened queries of several sequences, each attending causally to its cached
context (layout and precision: :mod:`stride.kernels.paged_common`), beside its float32 reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from stride.kernels.common import dot, dot_args
from stride.kernels.paged_common import (
    LOG2E,
    check_cache,
    gather_kv,
    load_v,
    out_like,
    pv,
    split_p,
    v_sub,
    widen_to_f16,
)
from stride.kernels.sizes import next_pow2


@dataclass(frozen=True)
class ExtendConfig:
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


# Per-step values unspecialised, as in stride.kernels.paged_decode: a mixed step passes rows of its tensors past its
# decodes, so their alignment and the tables' stride change from step to step.
@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=["bt_ptr", "cu_ptr", "ctx_ptr"])
def _extend_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, ctx_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, KV_F16: tl.constexpr = False, V_SUB: tl.constexpr = 0,
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
    if KV_F16:  # 8-bit caches widen to fp16 (one instruction on a GPU), so q joins them there (exact in range)
        q = q.to(tl.float16)
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
        k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
        # Key 0 is visible to every row, so no row is all -inf after the first step.
        s = tl.where(n_mask[None, :] & (offs_n[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = load_v(v_ptr, bt_row, page, slot, kv_mask, t0, end, kv_head, stride_vb, stride_vt, stride_vh, offs_d,
                   d_mask, PAGE, V_SUB, BLOCK_N, BLOCK_D).to(q.dtype)
        acc = acc * alpha[:, None] + pv(p, v, SPLIT_P, DOT_PRECISION, DOT_UPCAST)
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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: (num_tokens, num_heads, head_dim); cu_query_lens: int32 (num_seqs+1,). Returns like q (``out`` when
    given: a tensor of q's shape and dtype, rows of a larger one allowed).

    context_lens: int32 (num_seqs,), each >= its query_len. Pass max_query_len (host-known) to skip a sync.
    """
    assert q.dim() == 3, f"q must be (num_tokens, num_heads, head_dim), got {tuple(q.shape)}"
    check_cache(q, k_cache, v_cache, block_tables)
    num_seqs = context_lens.shape[0]
    assert cu_query_lens.shape == (num_seqs + 1,) and cu_query_lens.dtype == torch.int32
    assert context_lens.dtype == torch.int32 and block_tables.shape[0] >= num_seqs
    num_tokens, num_heads, head_dim = q.shape
    out = out_like(q, out)
    if num_seqs == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_query_lens[1:] - cu_query_lens[:-1]).max().item())
    cfg = config or ExtendConfig()
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, cfg.block_m))
    _extend_kernel[grid](
        out, q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
        PAGE=k_cache.shape[1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT_P=split_p(q.dtype),
        KV_F16=widen_to_f16(q, k_cache), V_SUB=v_sub(v_cache, cfg.block_n), **dot_args(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


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
        k = gather_kv(k_cache, block_tables[s], ctx).to(compute).repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_tables[s], ctx).to(compute).repeat_interleave(group, dim=1)
        qs = q[lo:hi].to(compute)
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        pos = torch.arange(ctx - (hi - lo), ctx, device=q.device)
        visible = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
