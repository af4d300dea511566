"""What one rank must keep free besides weights, and how many KV blocks fit in the rest.

The activation reserve is the peak of one forward pass over a step of ``T = max_num_batched_tokens``
flattened tokens (prefill chunks and decodes together), per rank, in bytes of ``act_bytes`` each:

- residual stream and its normed copy, full width on every TP rank:  ``2·T·H``
- attention, per rank: q/k/v projections plus the attention output:  ``T·(2·Qr + 2·KVr)``
- MLP, per rank: gate and up outputs plus their SwiGLU product:       ``3·R·Ir``
  (dense: ``R = T``; MoE: ``R = T·min(k, E/ep)``, every routed copy landing on this rank, plus the
  router's ``T·E`` float32 logits)
- sampling: float32 logits of the sampled rows after the vocabulary gather, and the probabilities made
  from them: ``2·S·V·4`` bytes with ``S = min(T, max_num_seqs)``

with ``Qr = heads/tp·head_dim``, ``KVr`` the rank's KV heads × head_dim, ``Ir`` the rank's MLP width.
Layers run one after another, so the reserve is the residual plus the largest of the other three. The
attention kernel is paged/flash style (no ``T × context`` score matrix). CUDA context, cuBLAS and NCCL
workspaces and allocator slack are what ``gpu_memory_utilization`` leaves out, not part of this reserve.

With 4-bit weights a rank also keeps one 16-bit scratch matrix the size of its largest projection
(:func:`expansion_scratch_bytes`): steps of many rows expand a weight into it and multiply with cuBLAS.

The decode graphs' reserve (dense models with CUDA graphs on; they hold their memory for the life of the
worker, beside the eager steps' activations) is, per rank, with ``B = min(max_num_seqs, MAX_GRAPH_BATCH)``:

- intermediates: one pool shared by every graph, the activation reserve above for a step of ``B`` tokens
- logits: one ``B × V`` float32 buffer every graph writes into
- inputs: per graph, ``b`` token ids, positions and lengths (int64) and a ``b × c`` int32 block table, for
  each batch bucket ``b`` and context bucket ``c`` (powers of two up to the table width ``W``, which sum to
  less than ``2·W``): at most ``Σ_b b·(24 + 8·W)`` bytes
"""

from __future__ import annotations

from stride.planner.formats import kv_dtype_bytes
from stride.planner.geometry import ModelGeometry
from stride.planner.parallel import Parallelism, kv_bytes_per_token_per_rank, kv_heads_per_rank

MAX_GRAPH_BATCH = 256
"""Most sequences a decode step replayed from a CUDA graph holds; larger steps run eagerly."""


def graph_batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes the decode graphs are captured at: 1, 2, 4, 8, then every multiple of 16, below
    ``max_batch``; and ``max_batch`` itself."""
    return [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]


def activation_reserve_bytes(g: ModelGeometry, par: Parallelism, max_num_batched_tokens: int,
                             max_num_seqs: int = 256, act_bytes: int = 2) -> int:
    """Peak activation/workspace bytes of one step on one rank (formula in the module docstring)."""
    if max_num_batched_tokens < 1 or max_num_seqs < 1 or act_bytes < 1:
        raise ValueError("max_num_batched_tokens, max_num_seqs and act_bytes must be positive")
    t = max_num_batched_tokens
    q_r = g.num_heads // par.tp * g.head_dim
    kv_r = kv_heads_per_rank(g, par.tp) * g.head_dim
    residual = 2 * t * g.hidden_size * act_bytes
    attention = t * (2 * q_r + 2 * kv_r) * act_bytes
    if g.is_moe:
        local_experts = g.num_experts // par.ep
        rows = t * min(g.num_experts_per_tok, local_experts)
        mlp = 3 * rows * (g.intermediate_size // par.expert_tp) * act_bytes + t * g.num_experts * 4
    else:
        mlp = 3 * t * (g.intermediate_size // par.tp) * act_bytes
    sampling = 2 * min(t, max_num_seqs) * g.vocab_size * 4
    return residual + max(attention, mlp, sampling)


def decode_graph_reserve_bytes(g: ModelGeometry, par: Parallelism, max_num_seqs: int, table_width: int,
                               act_bytes: int = 2) -> int:
    """Bytes the decode CUDA graphs hold on one rank (formula in the module docstring); ``table_width``: block
    table columns (``ceil(max_model_len / block_size)``). Zero for mixture-of-experts models, which decode
    eagerly (their routing is read on the host)."""
    if g.is_moe:
        return 0
    if max_num_seqs < 1 or table_width < 1:
        raise ValueError("max_num_seqs and table_width must be positive")
    batch = min(max_num_seqs, MAX_GRAPH_BATCH)
    pool = activation_reserve_bytes(g, par, batch, batch, act_bytes)
    inputs = sum(b * (24 + 8 * table_width) for b in graph_batch_buckets(batch))
    return pool + batch * g.vocab_size * 4 + inputs


def expansion_scratch_bytes(g: ModelGeometry, par: Parallelism, act_bytes: int = 2) -> int:
    """4-bit weights (W4A16, GGUF Q4): the 16-bit scratch matrix a rank expands its largest projection into for
    steps of many rows (``stride/kernels/w4a16.py``): the largest of the merged q/k/v, o, merged gate/up and down
    projections, as sharded on the rank (dense MLPs; an MoE model's attention projections)."""
    q_r = g.num_heads // par.tp * g.head_dim
    kv_r = kv_heads_per_rank(g, par.tp) * g.head_dim
    sizes = [(q_r + 2 * kv_r) * g.hidden_size, q_r * g.hidden_size]
    if not g.is_moe:
        sizes += [2 * (g.intermediate_size // par.tp) * g.hidden_size]
    return max(sizes) * act_bytes


def num_kv_blocks(g: ModelGeometry, free_bytes: int, block_size: int = 16, kv_dtype: str = "bf16",
                  tp: int = 1, pp: int = 1, ep: int = 1, max_num_batched_tokens: int = 2048,
                  max_num_seqs: int = 256, act_bytes: int = 2, extra_reserve: int = 0) -> int:
    """KV blocks one rank can hold in ``free_bytes``: the memory left for activations and KV cache.

    The worker calls this after loading its weights, with ``free_bytes`` = the share of device memory it
    may use (``total × gpu_memory_utilization``) minus what is already allocated; the planner calls it
    with usable memory minus the weights it computed. The activation reserve for a step of
    ``max_num_batched_tokens`` is subtracted first, and ``extra_reserve``: what else the worker holds, the
    decode graphs' (:func:`decode_graph_reserve_bytes`) and 4-bit weights' scratch
    (:func:`expansion_scratch_bytes`). Every rank of a deployment must use the minimum over ranks, since a
    block spans all of them. Returns 0 when not even one block fits; callers refuse then.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    par = Parallelism(tp, pp, ep)
    reserve = activation_reserve_bytes(g, par, max_num_batched_tokens, max_num_seqs, act_bytes) + extra_reserve
    block_bytes = block_size * kv_bytes_per_token_per_rank(g, par, kv_dtype_bytes(kv_dtype))
    return max(0, (free_bytes - reserve) // block_bytes)
