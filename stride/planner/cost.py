"""Step cost model for the simulated backend: how long one batched forward step takes on a GPU.

A step is a roofline: ``max(bytes moved / bandwidth, FLOPs / matmul rate) + overhead_s``, per TP rank
(every rank does its share at the same time, so one rank's time is the step's time).

Bytes, per rank:
- weights read once per step. For MoE, only the experts some token is routed to: with ``n`` tokens each
  picking ``k`` of ``E`` experts, the expected experts touched per layer is ``E·(1 − (1 − k/E)^n)`` —
  exactly the active parameters at one token, all experts for large batches.
- KV cache read: ``context_tokens`` × the rank's KV bytes per token.
- KV cache written: ``num_tokens`` × the rank's KV bytes per token.

FLOPs, per rank:
- ``2 · P · num_tokens`` for the rank's active matmul parameters ``P`` in the decoder layers,
- ``2 · vocab/tp · hidden · num_seqs`` for the output projection (only the sampled row of each sequence),
- attention ``4 · layers · heads/tp · head_dim`` per (query, key) pair. With ``q = num_tokens/num_seqs``
  new tokens and ``c = context_tokens/num_seqs`` keys per sequence (averages), causal attention has
  ``num_tokens · (c − q/2)`` pairs: exact for decodes (q = 1) and for a single prefill.

Not modelled: TP all-reduce traffic, activation reads/writes, kernel efficiency below peak (fold it into
the GPU's rates or ``overhead_s`` if calibrating against measurements).
"""

from __future__ import annotations

from dataclasses import dataclass

from stride.planner.formats import kv_dtype_bytes, weight_format
from stride.planner.geometry import ModelGeometry
from stride.planner.hardware import GpuSpec
from stride.planner.parallel import (
    Parallelism,
    check_parallelism,
    kv_bytes_per_token_per_rank,
    matrix_bytes,
    shard_shape,
)

DEFAULT_OVERHEAD_S = 1e-3
"""Fixed per-step cost: host-side scheduling, input preparation and kernel launches (CUDA-graphed decode
steps in mature runtimes spend well under a millisecond here; an eager Python step, more)."""


@dataclass(frozen=True)
class StepCost:
    """One step's roofline terms, per rank."""

    bytes_moved: float
    flops: float
    memory_s: float
    compute_s: float
    overhead_s: float

    @property
    def time_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.overhead_s

    @property
    def bound(self) -> str:
        """``memory`` or ``compute``: which term sets the step time."""
        return "memory" if self.memory_s >= self.compute_s else "compute"


class StepCostModel:
    """Step times of ``geometry`` on ``tp`` GPUs of kind ``gpu`` (one pipeline stage; ``ep`` as in the
    planner). Deterministic and pure: the same arguments give the same time."""

    def __init__(self, geometry: ModelGeometry, gpu: GpuSpec, tp: int = 1, weights: str = "bf16",
                 kv_dtype: str = "bf16", overhead_s: float = DEFAULT_OVERHEAD_S, ep: int = 1) -> None:
        if gpu.mem_bandwidth <= 0 or gpu.bf16_flops <= 0:
            raise ValueError(f"{gpu.name}: memory bandwidth and matmul rate are needed for a cost model")
        if overhead_s < 0:
            raise ValueError(f"overhead_s must be non-negative, got {overhead_s}")
        par = Parallelism(tp=tp, ep=ep)
        problems = check_parallelism(geometry, par)
        if problems:
            raise ValueError("; ".join(problems))
        self.geometry, self.gpu, self.par, self.overhead_s = geometry, gpu, par, overhead_s
        fmt = weight_format(weights)
        self._other_bytes = 0  # per rank: everything read in full each step
        self._expert_bytes = 0  # per rank: every local expert of every layer
        self._dense_params = 0  # per rank: decoder-layer matmul params, experts excluded
        self._expert_params = 0  # per rank: one expert's share of every layer
        for m in geometry.matrices():
            rows, cols = shard_shape(geometry, m, par)
            copies = m.count // par.ep if m.expert else m.count
            size = copies * matrix_bytes(m, fmt, rows, cols)
            if m.name == "embed_tokens" and not geometry.tie_embeddings:
                continue  # a gather reads one row per token, not the table
            if m.expert:
                self._expert_bytes += size
                self._expert_params += rows * cols * m.count // geometry.num_experts
                continue
            self._other_bytes += size
            if m.per_layer and not m.norm:
                self._dense_params += rows * cols * copies
        self._kv_per_token = kv_bytes_per_token_per_rank(geometry, par, kv_dtype_bytes(kv_dtype))
        self._head_params = geometry.vocab_size // tp * geometry.hidden_size

    def experts_touched(self, num_tokens: int) -> float:
        """Expected experts per layer that at least one of ``num_tokens`` tokens is routed to."""
        g = self.geometry
        if not g.is_moe:
            return 0.0
        return g.num_experts * (1.0 - (1.0 - g.num_experts_per_tok / g.num_experts) ** num_tokens)

    def step_cost(self, num_tokens: int, num_seqs: int, context_tokens: int) -> StepCost:
        """Cost of a step running ``num_tokens`` new tokens of ``num_seqs`` sequences that together attend
        to ``context_tokens`` keys (cached context plus this step's tokens). A step of no tokens costs the
        overhead alone."""
        if num_tokens < 0 or context_tokens < 0 or not min(1, num_tokens) <= num_seqs <= num_tokens:
            raise ValueError(f"need num_tokens >= num_seqs >= 1 (or both 0) and context_tokens >= 0, got "
                             f"{num_tokens}, {num_seqs}, {context_tokens}")
        if num_tokens == 0:  # an empty step still pays its fixed overhead
            return StepCost(0.0, 0.0, 0.0, 0.0, self.overhead_s)
        g = self.geometry
        context_tokens = max(context_tokens, num_tokens)  # a sequence attends at least to its new tokens
        weight_bytes = float(self._other_bytes)
        flops = 2.0 * self._dense_params * num_tokens
        if g.is_moe:
            weight_bytes += self._expert_bytes * self.experts_touched(num_tokens) / g.num_experts
            # each token runs k experts; with EP a rank runs the share routed to it, on average 1/ep
            flops += 2.0 * self._expert_params * g.num_experts_per_tok * num_tokens / self.par.ep
        flops += 2.0 * self._head_params * num_seqs
        pairs = num_tokens * (context_tokens / num_seqs - num_tokens / num_seqs / 2)
        flops += 4.0 * g.num_layers * (g.num_heads // self.par.tp) * g.head_dim * pairs
        kv_bytes = float(self._kv_per_token) * (context_tokens + num_tokens)
        bytes_moved = weight_bytes + kv_bytes
        return StepCost(bytes_moved=bytes_moved, flops=flops, memory_s=bytes_moved / self.gpu.mem_bandwidth,
                        compute_s=flops / self.gpu.bf16_flops, overhead_s=self.overhead_s)

    def step_time(self, num_tokens: int, num_seqs: int, context_tokens: int) -> float:
        """Seconds one step takes (see :meth:`step_cost` for the arguments)."""
        return self.step_cost(num_tokens, num_seqs, context_tokens).time_s
