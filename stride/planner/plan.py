"""The per-rank capacity plan: weights, activation reserve, and the KV cache that survives them.

``plan(Deployment(...))`` always returns a :class:`Plan`; a deployment that cannot work comes back with
``refused=True`` and a ``reason`` that gives the numbers and the remedy. It never raises for a bad fit,
so callers (the CLI, the launcher) decide what to do with a refusal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from stride.config import SchedulerConfig
from stride.planner.formats import WEIGHT_FORMAT_NAMES, kv_dtype_bytes, weight_format
from stride.planner.geometry import ModelGeometry
from stride.planner.hardware import GiB, GpuSpec
from stride.planner.memory import (
    activation_reserve_bytes,
    decode_graph_reserve_bytes,
    expansion_scratch_bytes,
    num_kv_blocks,
)
from stride.planner.parallel import (
    Parallelism,
    check_parallelism,
    kv_bytes_per_token_per_rank,
    model_weight_bytes,
    rank_weight_bytes,
)

CONTEXTS: tuple[int, ...] = (4096, 32768)
"""Context lengths the plan reports concurrency for."""


@dataclass(frozen=True)
class Deployment:
    """One candidate deployment: a model on ``tp × pp`` GPUs of one kind, in given formats and limits."""

    model: ModelGeometry
    gpu: GpuSpec
    parallel: Parallelism = Parallelism()
    weights: str = "bf16"
    """Weight format name (see :data:`stride.planner.formats.WEIGHT_FORMAT_NAMES`)."""
    group_size: int = 128
    """Quantization group of ``w4a16``."""
    kv_dtype: str = "bf16"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    """Share of device memory for weights + activations + KV (the rest: CUDA context, workspaces, slack)."""
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_model_len: int = 0
    """At least one sequence this long must fit; 0 means min(scheduler default, the model's context)."""
    cuda_graphs: bool = True
    """Decode steps replay CUDA graphs (the worker's default; ``--enforce-eager`` turns them off): their
    memory is reserved beside the activations'."""

    def __post_init__(self) -> None:
        weight_format(self.weights, self.group_size)  # validates the name
        kv_dtype_bytes(self.kv_dtype)
        if self.block_size < 1 or self.max_model_len < 0:
            raise ValueError("block_size must be positive and max_model_len non-negative")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")

    @property
    def required_len(self) -> int:
        if self.max_model_len:
            return self.max_model_len
        default = SchedulerConfig.max_model_len
        return min(default, self.model.max_context) if self.model.max_context else default


@dataclass(frozen=True)
class Plan:
    """What fits on each rank. Byte figures are per rank unless named ``_total``."""

    model: str
    gpu: str
    tp: int
    pp: int
    ep: int
    weights: str
    kv_dtype: str
    params_total: int
    params_active: int
    kv_bytes_per_token: int
    """Whole model, all ranks together."""
    kv_bytes_per_token_per_rank: int
    weights_bytes_total: int
    weights_bytes_per_rank: int
    """The largest rank's weights (pipeline stages differ by the embedding and output projection)."""
    weights_bytes_by_rank: list[int]
    gpu_memory_bytes: int
    usable_bytes_per_rank: int
    activation_reserve_bytes: int
    """A step's activations; with 4-bit weights also the 16-bit scratch their largest projection expands into."""
    graph_reserve_bytes: int
    """The decode CUDA graphs' buffers (0 with graphs off, or for a mixture-of-experts model)."""
    kv_cache_bytes_per_rank: int
    num_blocks: int
    block_size: int
    tokens_total: int
    concurrency: dict[int, int | None]
    """Context length → sequences that fit at once (None: beyond the model's context)."""
    refused: bool
    reason: str
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["concurrency"] = {str(k): v for k, v in self.concurrency.items()}
        return out


def plan(d: Deployment, suggest: bool = True) -> Plan:
    """Plan ``d``; ``suggest`` adds to a refusal the smallest TP or format that would fit."""
    g, par = d.model, d.parallel
    fmt = weight_format(d.weights, d.group_size)
    kv_bytes = kv_dtype_bytes(d.kv_dtype)
    usable = int(d.gpu.memory_bytes * d.gpu_memory_utilization)
    problems = check_parallelism(g, par)
    base: dict[str, Any] = dict(
        model=g.name, gpu=d.gpu.name, tp=par.tp, pp=par.pp, ep=par.ep, weights=fmt.name, kv_dtype=d.kv_dtype,
        params_total=g.params_total, params_active=g.params_active,
        kv_bytes_per_token=g.kv_bytes_per_token(kv_bytes), weights_bytes_total=model_weight_bytes(g, fmt),
        gpu_memory_bytes=d.gpu.memory_bytes, usable_bytes_per_rank=usable, block_size=d.block_size,
        problems=problems)
    if problems:
        return Plan(**base, kv_bytes_per_token_per_rank=0, weights_bytes_per_rank=0, weights_bytes_by_rank=[],
                    activation_reserve_bytes=0, graph_reserve_bytes=0, kv_cache_bytes_per_rank=0, num_blocks=0,
                    tokens_total=0, concurrency={c: 0 for c in CONTEXTS}, refused=True,
                    reason="invalid split: " + "; ".join(problems))

    by_rank = rank_weight_bytes(g, fmt, par)
    weights = max(by_rank)
    blocks_per = lambda c: -(-c // d.block_size)
    act_reserve = activation_reserve_bytes(g, par, d.max_num_batched_tokens, d.max_num_seqs)
    graph_reserve = (decode_graph_reserve_bytes(g, par, d.max_num_seqs, blocks_per(d.required_len))
                     if d.cuda_graphs else 0)
    scratch = expansion_scratch_bytes(g, par) if fmt.bits == 4 else 0
    act_reserve += scratch  # a step's workspace too
    reserve = act_reserve + graph_reserve
    kv_per_token = kv_bytes_per_token_per_rank(g, par, kv_bytes)
    # a block spans every rank, so the rank with the least room sets the pool size
    num_blocks = min(num_kv_blocks(g, usable - w, d.block_size, d.kv_dtype, par.tp, par.pp, par.ep,
                                   d.max_num_batched_tokens, d.max_num_seqs, extra_reserve=graph_reserve + scratch)
                     for w in set(by_rank))
    tokens = num_blocks * d.block_size
    concurrency = {c: (None if g.max_context and c > g.max_context else num_blocks // blocks_per(c))
                   for c in CONTEXTS}
    reason = ""
    if weights > usable:
        reason = (f"weights need {_gib(weights)} per rank but {d.gpu.name} has {_gib(usable)} usable "
                  f"({d.gpu_memory_utilization:.0%} of {_gib(d.gpu.memory_bytes)})")
    elif weights + reserve >= usable or num_blocks == 0:
        reason = (f"weights ({_gib(weights)}) plus the activation reserve ({_gib(act_reserve)} for "
                  f"{d.max_num_batched_tokens} batched tokens)"
                  + (f" and the decode graphs' ({_gib(graph_reserve)})" if graph_reserve else "")
                  + f" leave no room for KV cache in {_gib(usable)}")
    elif num_blocks < blocks_per(d.required_len):
        reason = (f"KV cache of {_gib(usable - weights - reserve)} per rank holds {tokens} tokens, "
                  f"fewer than one {d.required_len}-token sequence")
    if reason and suggest:
        reason += " — " + _remedy(d, weights_fit=weights <= usable)
    return Plan(**base, kv_bytes_per_token_per_rank=kv_per_token, weights_bytes_per_rank=weights,
                weights_bytes_by_rank=by_rank, activation_reserve_bytes=act_reserve,
                graph_reserve_bytes=graph_reserve,
                kv_cache_bytes_per_rank=max(0, usable - weights - reserve), num_blocks=num_blocks,
                tokens_total=tokens, concurrency=concurrency, refused=bool(reason), reason=reason)


def _remedy(d: Deployment, weights_fit: bool) -> str:
    """Name the smallest change that fits: more TP, more PP, or a smaller weight format."""
    par = d.parallel
    options = []
    for tp in (2, 4, 8, 16, 32, 64):
        if tp > par.tp and _fits(d, Parallelism(tp, par.pp, _ep_for(d, tp))):
            options.append(f"--tp {tp}")
            break
    for pp in range(par.pp + 1, 17):
        if _fits(d, Parallelism(par.tp, pp, par.ep)):
            options.append(f"--pp {pp}")
            break
    text = "raise tensor or pipeline parallelism" + (f" ({' or '.join(options)} fits)" if options else "")
    smaller = [f for f in WEIGHT_FORMAT_NAMES
               if weight_format(f, d.group_size).bits_per_weight
               < weight_format(d.weights, d.group_size).bits_per_weight
               and _fits(dataclasses.replace(d, weights=f), par)]
    text += ", or quantize the weights"
    if smaller:
        text += f" (--weights {smaller[0]} fits at --tp {par.tp})"
    if weights_fit:
        # the weights fit: the cache or the reserve is what is short
        if d.kv_dtype != "fp8":
            text += ", or use --kv-dtype fp8"
        text += ", or lower --max-num-batched-tokens or --max-model-len"
        if d.cuda_graphs and not d.model.is_moe and _fits(dataclasses.replace(d, cuda_graphs=False), par):
            text += ", or --enforce-eager (no decode graphs: fits, slower decode)"
    return text


def _ep_for(d: Deployment, tp: int) -> int:
    return d.parallel.ep if tp % d.parallel.ep == 0 else 1


def _fits(d: Deployment, par: Parallelism) -> bool:
    return not plan(dataclasses.replace(d, parallel=par), suggest=False).refused


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"
