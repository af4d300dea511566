"""Paged attention over the KV cache: the per-step metadata, the backend seam, and the PyTorch reference.

A step's tokens are flattened: sequence ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i+1]``,
which sit at the *last* ``query_lens[i]`` positions of its ``context_lens[i]``-token context. Key ``j`` of a
sequence lives in physical block ``block_tables[i, j // block_size]`` at offset ``j % block_size`` of the
cache (layout in :mod:`stride.workers.kv_cache`). Each layer first writes all of the step's new K/V
(:meth:`AttentionBackend.write_kv`, or with fused layers the RoPE launch), then attends
(:meth:`AttentionBackend.attend`), so two sequences of one step that share prefix blocks both see them.

``torch`` (:class:`TorchPagedAttention`) is the reference that runs anywhere; the Triton kernels
(:mod:`stride.workers.attention_triton`) must agree with it. ``sdpa`` (:class:`SdpaPagedAttention`, the CPU's
default) is the same code with attention in the run dtype. :mod:`stride.workers.backends` picks one by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step, built once per forward and shared by every layer."""

    block_size: int
    slot_mapping: torch.Tensor
    """(num_tokens,) int64: flat cache slot (``block * block_size + offset``) each new token is written to."""
    positions: torch.Tensor
    """(num_tokens,) int64 position of each token in its sequence."""
    query_start_loc: torch.Tensor
    """(num_seqs + 1,) int32 on the device: prefix sums of query_lens."""
    context_lens: torch.Tensor
    """(num_seqs,) int32 on the device: KV length after this step."""
    block_tables: torch.Tensor
    """(num_seqs, max_blocks) int32 on the device; unused entries are 0 (a valid block, masked out)."""
    query_lens_cpu: np.ndarray
    context_lens_cpu: np.ndarray
    max_query_len: int
    max_context_len: int
    num_decodes: int = 0
    """In a step that also has longer queries: how many sequences at its head have a query of one token (the
    scheduler puts decodes first). A backend may attend to those apart, as a decode-only step (0: not split)."""
    extend_start_loc: torch.Tensor | None = None
    """With ``num_decodes``: ``query_start_loc`` of the sequences after them, from 0 (int32, on the device)."""
    memo: dict[str, Any] = field(default_factory=dict)
    """What a backend derives from this metadata once per step and every layer reuses (index tensors, masks)."""

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @staticmethod
    def build(
        positions: torch.Tensor,
        query_lens: np.ndarray,
        context_lens: np.ndarray,
        block_tables: torch.Tensor,
        block_size: int,
    ) -> AttentionMetadata:
        """From per-sequence lengths and the (num_seqs, >= max blocks) block tables, all already on the device
        except the two length arrays (host numpy, int)."""
        device = positions.device
        query_lens = np.asarray(query_lens, dtype=np.int64)
        context_lens = np.asarray(context_lens, dtype=np.int64)
        if np.any(query_lens < 1) or np.any(context_lens < query_lens):
            raise ValueError("each sequence needs 1 <= query_len <= context_len")
        if int(query_lens.sum()) != positions.numel():
            raise ValueError(f"query_lens sum to {int(query_lens.sum())}, got {positions.numel()} tokens")
        num_blocks_used = -(-context_lens // block_size)
        max_blocks = int(num_blocks_used.max())
        if block_tables.shape[1] < max_blocks:
            raise ValueError(f"block tables have {block_tables.shape[1]} columns, need {max_blocks}")
        tables = block_tables[:, :max_blocks]
        used = (
            torch.arange(max_blocks, device=device)[None, :]
            < torch.from_numpy(num_blocks_used).to(device)[:, None]
        )
        tables = torch.where(used, tables, 0).to(torch.int32)
        # Token t of sequence i is written at its position's (block, offset).
        seq_of_token = torch.from_numpy(np.repeat(np.arange(len(query_lens)), query_lens)).to(device)
        pos = positions.long()
        slot_mapping = tables[seq_of_token, pos // block_size].long() * block_size + pos % block_size
        starts = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=starts[1:])
        max_query_len = int(query_lens.max())
        num_decodes = int(np.argmax(query_lens != 1)) if max_query_len > 1 else 0
        return AttentionMetadata(
            block_size=block_size,
            slot_mapping=slot_mapping,
            positions=pos,
            query_start_loc=torch.from_numpy(starts).to(device),
            context_lens=torch.from_numpy(context_lens.astype(np.int32)).to(device),
            block_tables=tables,
            query_lens_cpu=query_lens,
            context_lens_cpu=context_lens,
            max_query_len=max_query_len,
            max_context_len=int(context_lens.max()),
            num_decodes=num_decodes,
            extend_start_loc=torch.from_numpy(starts[num_decodes:] - num_decodes).to(device) if num_decodes else None,
        )


    @staticmethod
    def decode_only(positions: torch.Tensor, blocks: torch.Tensor, block_size: int) -> AttentionMetadata:
        """A decode-only step from tensors alone, with no host reads (so ``torch.export`` can trace it: the compiled
        CPU step, :mod:`stride.workers.cpu_step`): sequence ``i``'s one token at ``positions[i]`` over the
        ``positions[i] + 1`` keys of its blocks ``blocks[i]`` (int64, every entry a valid block; those past the
        context are masked). The host-side fields are empty, so only the reference backend can run it: its
        decode plan is made here, over whole blocks."""
        rows = torch.arange(blocks.shape[0], device=blocks.device)
        keys = blocks.shape[1] * block_size
        mask = (torch.arange(keys, device=blocks.device)[None, :] <= positions[:, None])[:, None, :]
        meta = AttentionMetadata(
            block_size=block_size,
            slot_mapping=blocks[rows, positions // block_size] * block_size + positions % block_size,
            positions=positions,
            query_start_loc=torch.empty(0, dtype=torch.int32, device=blocks.device),
            context_lens=(positions + 1).to(torch.int32),
            block_tables=blocks,
            query_lens_cpu=np.empty(0, np.int64),
            context_lens_cpu=np.empty(0, np.int64),
            max_query_len=1,
            max_context_len=keys,
        )
        meta.memo["torch"] = _TorchPlan(True, None, blocks, keys, mask, [])
        return meta


class AttentionBackend(Protocol):
    """q: (num_tokens, num_heads, head_dim); k/v: (num_tokens, num_kv_heads, head_dim); caches:
    (num_blocks, block_size, num_kv_heads, head_dim). ``attend`` returns q's shape."""

    name: str
    fused_layers: bool
    """Whether the model layers should use the fused Triton RMSNorm/RoPE/SiLU-mul kernels with this backend."""

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None: ...

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


FP8_KV = torch.float8_e4m3fn
"""The 8-bit KV cache's dtype (``--kv-dtype fp8``): values rounded to nearest-even, 3 mantissa bits, saturated at
:data:`FP8_KV_MAX`, no scale (as the keys and values of the models served here stay far inside its range); read back
exactly into the run dtype. Half the bytes of a bf16 cache, so twice the blocks and half the decode attention's
reads."""

FP8_KV_MAX = 448.0


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``cache_dtype`` stores it: a cast, saturated at +-448 for :data:`FP8_KV` (which has no
    infinity) and NaN stored as 0, so that an 8-bit cache holds finite values only (its keys-inner V is read whole
    pages at a time: ``stride/kernels/paged_common.py``); the Triton backend's fused write does the same,
    ``stride/kernels/rope.py``."""
    if cache_dtype == FP8_KV:
        x = torch.nan_to_num(x, nan=0.0).clamp(-FP8_KV_MAX, FP8_KV_MAX)
    return x.to(cache_dtype)


class TorchPagedAttention:
    """Reference backend in plain PyTorch: decodes batched (gather their blocks, one SDPA call), prefill
    chunks one sequence at a time (causal by position over cached keys plus the chunk). Attention itself
    is float32 maths on the cached values, rounded once to the run dtype (:func:`_sdpa`)."""

    name = "torch"
    fused_layers = False
    exact = True
    """Attention's products in float32, rounded once at the output (:func:`_sdpa`)."""

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = to_cache(k, k_cache.dtype)
        if v_cache.is_contiguous():
            v_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = to_cache(v, v_cache.dtype)
        else:  # keys-inner (an 8-bit cache: stride/workers/kv_cache.py)
            slots, page = meta.slot_mapping, v_cache.shape[1]
            v_cache[slots // page, slots % page] = to_cache(v, v_cache.dtype)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        plan = meta.memo.get("torch")
        if plan is None:
            plan = meta.memo["torch"] = _TorchPlan.build(meta, q.device)
        if plan.decode_only:  # every token is its sequence's one query, in order: no gather or scatter of q
            return _sdpa(q[:, None], *_gather(k_cache, v_cache, plan.decode_blocks, plan.decode_len, plan.scratch),
                         plan.decode_mask, scale, self.exact)[:, 0]
        out = torch.empty_like(q)
        if plan.decode_tokens is not None:
            k, v = _gather(k_cache, v_cache, plan.decode_blocks, plan.decode_len, plan.scratch)
            out[plan.decode_tokens] = _sdpa(q[plan.decode_tokens][:, None], k, v, plan.decode_mask, scale,
                                           self.exact)[:, 0]
        for lo, hi, blocks, ctx, allowed in plan.chunks:
            k, v = _gather(k_cache, v_cache, blocks, ctx)
            out[lo:hi] = _sdpa(q[None, lo:hi], k, v, allowed, scale, self.exact)[0]
        return out


class SdpaPagedAttention(TorchPagedAttention):
    """The reference's code with attention in the run dtype: PyTorch's fused SDPA on the cached 16-bit keys and
    values as they are (float32 scores and softmax, the probabilities rounded to the run dtype before P@V, as fused
    GPU kernels do), with no float32 copies of K/V. The default on a CPU: the default model's decode attention 2x
    the reference's speed there (16 rows), its whole 16-row step 1.1x, and its greedy output as close to the float32
    model's as the reference's is (perf-log "twentieth session"). With a float32 run dtype it is the reference."""

    name = "sdpa"
    exact = False


@dataclass
class _TorchPlan:
    """The reference backend's per-step index tensors and masks, built at the first layer and reused by the rest."""

    decode_only: bool
    decode_tokens: torch.Tensor | None
    """Rows of q that are decodes (None: there are none)."""
    decode_blocks: torch.Tensor
    """(decodes, blocks) int64 block ids covering ``decode_len`` keys."""
    decode_len: int
    decode_mask: torch.Tensor
    """(decodes, 1, decode_len) bool: key j visible to decode i."""
    chunks: list[tuple[int, int, torch.Tensor, int, torch.Tensor]]
    """Per prefill chunk: its rows of q ``lo:hi``, (1, blocks) block ids, context length, (1, L, ctx) mask."""
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)
    """The decodes' gathered K and V, one buffer each for every layer of the step (a layer's attention is done with
    them before the next layer gathers): a fresh ~1 MB output a layer cost the CPU's 16-row step ~13 us a gather."""

    @staticmethod
    def build(meta: AttentionMetadata, device: torch.device) -> _TorchPlan:
        bs = meta.block_size
        starts = np.concatenate([[0], np.cumsum(meta.query_lens_cpu)])  # the host's, not a copy from the device
        decode = np.flatnonzero(meta.query_lens_cpu == 1)
        decode_only = len(decode) == meta.num_seqs
        tokens = None
        blocks = mask = torch.empty(0, dtype=torch.long, device=device)
        length = 0
        if len(decode):
            rows = torch.from_numpy(decode).to(device)
            if not decode_only:
                tokens = torch.from_numpy(starts[decode].astype(np.int64)).to(device)
            length = int(meta.context_lens_cpu[decode].max())
            tables = meta.block_tables if decode_only else meta.block_tables[rows]
            blocks = tables[:, : -(-length // bs)].long()
            lens = meta.context_lens if decode_only else meta.context_lens[rows]
            mask = (torch.arange(length, device=device)[None, :] < lens[:, None])[:, None, :]
        chunks = []
        for i in np.flatnonzero(meta.query_lens_cpu > 1):
            lo, hi = int(starts[i]), int(starts[i + 1])
            ctx = int(meta.context_lens_cpu[i])
            allowed = torch.arange(ctx, device=device)[None, :] <= meta.positions[lo:hi, None]
            chunks.append((lo, hi, meta.block_tables[i : i + 1, : -(-ctx // bs)].long(), ctx, allowed[None]))
        return _TorchPlan(decode_only, tokens, blocks, length, mask, chunks)


def _gather(
    k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, length: int,
    scratch: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, length, num_kv_heads, head_dim) keys and values of the (n, blocks) int64 block ids ``blocks``, written into
    ``scratch``'s buffers when given (made there at the first call; not while compiling, where outputs are fresh)."""
    # index_select on the caches' rows, not advanced indexing: 8-10x faster on the CPU (16 rows, 100 keys).
    n, ids = blocks.shape[0], blocks.reshape(-1)
    if torch.compiler.is_compiling():
        scratch = None

    def rows(cache: torch.Tensor, name: str) -> torch.Tensor:
        flat = cache.view(cache.shape[0], -1)
        if scratch is None:
            return flat.index_select(0, ids)
        buf = scratch.get(name)
        if buf is None or buf.dtype != flat.dtype or buf.shape[1] != flat.shape[1]:
            buf = scratch[name] = flat.new_empty(ids.shape[0], flat.shape[1])
        return torch.index_select(flat, 0, ids, out=buf)

    k = rows(k_cache, "k").view(n, -1, *k_cache.shape[2:])[:, :length]
    if v_cache.is_contiguous():
        v = rows(v_cache, "v").view(n, -1, *v_cache.shape[2:])[:, :length]
    else:  # keys-inner (an 8-bit cache): the blocks as they are stored, then in the keys' order
        v = v_cache.index_select(0, ids).reshape(n, -1, *v_cache.shape[2:])[:, :length]
    return k, v


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float, exact: bool = True
) -> torch.Tensor:
    """q (n, L, H, D), k/v (n, S, KVH, D), allowed (n, L, S) bool → (n, L, H, D) in q's dtype.

    ``exact``: computed in float32 from the (bf16/fp16) inputs and rounded once, at the output: a 16-bit SDPA rounds
    inside (the probabilities before P@V, each kernel at its own places), and the Triton backend must be able to agree
    with the reference to that one rounding (see ``stride/kernels/paged_decode.py``). Otherwise in q's dtype, as
    PyTorch's fused kernel does it (:class:`SdpaPagedAttention`).
    """
    compute = torch.promote_types(q.dtype, torch.float32) if exact else q.dtype
    n, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    # One query a sequence (decodes): the heads that share a KV head become that head's queries, so SDPA sees no
    # grouped query at all. The same sums as enable_gqa, which on the CPU leaves the fused kernel for one that copies
    # K/V to every head: the default model's decode attention 1.4x faster there (16 rows, 160 keys).
    grouped = length == 1 and heads != kv_heads
    out = F.scaled_dot_product_attention(
        (q.reshape(n, kv_heads, heads // kv_heads, head_dim) if grouped else q.transpose(1, 2)).to(compute),
        k.transpose(1, 2).to(compute),
        v.transpose(1, 2).to(compute),
        attn_mask=allowed[:, None],
        scale=scale,
        enable_gqa=not grouped,
    )
    return (out.reshape(n, 1, heads, head_dim) if grouped else out.transpose(1, 2)).to(q.dtype)


@dataclass
class AttentionContext:
    """What every attention layer of one forward reads: the step's metadata, the backend, the caches."""

    meta: AttentionMetadata
    backend: AttentionBackend
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
