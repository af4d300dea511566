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
"""

from __future__ import annotations

from stride.planner.formats import kv_dtype_bytes
from stride.planner.geometry import ModelGeometry
from stride.planner.parallel import Parallelism, kv_bytes_per_token_per_rank, kv_heads_per_rank


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


def num_kv_blocks(g: ModelGeometry, free_bytes: int, block_size: int = 16, kv_dtype: str = "bf16",
                  tp: int = 1, pp: int = 1, ep: int = 1, max_num_batched_tokens: int = 2048,
                  max_num_seqs: int = 256, act_bytes: int = 2) -> int:
    """KV blocks one rank can hold in ``free_bytes``: the memory left for activations and KV cache.

    The worker calls this after loading its weights, with ``free_bytes`` = the share of device memory it
    may use (``total × gpu_memory_utilization``) minus what is already allocated; the planner calls it
    with usable memory minus the weights it computed. The activation reserve for a step of
    ``max_num_batched_tokens`` is subtracted first. Every rank of a deployment must use the minimum over
    ranks, since a block spans all of them. Returns 0 when not even one block fits; callers refuse then.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    par = Parallelism(tp, pp, ep)
    reserve = activation_reserve_bytes(g, par, max_num_batched_tokens, max_num_seqs, act_bytes)
    block_bytes = block_size * kv_bytes_per_token_per_rank(g, par, kv_dtype_bytes(kv_dtype))
    return max(0, (free_bytes - reserve) // block_bytes)
