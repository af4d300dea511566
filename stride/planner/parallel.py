"""Tensor / pipeline / expert parallelism: what must divide what, and which bytes each rank holds.

Layout (Megatron-style, as the workers shard): q, k, v and gate/up are column-parallel, o and down
row-parallel, the embedding and output projection vocabulary-parallel, norms and the router replicated.
KV heads are split over TP ranks; with fewer KV heads than ranks each rank holds one, replicated
``tp / num_kv_heads`` times. Pipeline stages take ``num_layers / pp`` layers each; the first also holds the
embedding, the last the final norm and output projection (and a copy of the embedding when tied).

Expert parallelism works inside the TP group, so the GPU count stays ``tp × pp``: the ``num_experts``
experts are dealt out to ``ep`` groups of ``tp / ep`` ranks, and each expert is tensor-split over its
group. ``ep == 1`` splits every expert over all TP ranks; ``ep == tp`` keeps each expert whole on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from stride.planner.formats import BF16, WeightFormat
from stride.planner.geometry import Matrix, ModelGeometry


@dataclass(frozen=True)
class Parallelism:
    """Degrees of tensor, pipeline and expert parallelism; ``num_gpus = tp × pp``."""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp

    @property
    def expert_tp(self) -> int:
        """Ranks one expert is tensor-split over."""
        return max(1, self.tp // self.ep)


def check_parallelism(g: ModelGeometry, par: Parallelism) -> list[str]:
    """Every divisibility rule the split breaks, each with its numbers and a remedy; empty when valid."""
    tp, pp, ep = par.tp, par.pp, par.ep
    problems = []
    if g.num_heads % tp:
        problems.append(f"{g.num_heads} attention heads are not divisible by tp={tp}; "
                        f"use a tp that divides {g.num_heads} ({_divisors(g.num_heads)})")
    kv = g.num_kv_heads
    if kv >= tp and kv % tp:
        problems.append(f"{kv} KV heads are not divisible by tp={tp}; use a tp that divides {kv}")
    if kv < tp and tp % kv:
        problems.append(f"tp={tp} is not a multiple of the {kv} KV heads, so they cannot be replicated "
                        f"evenly; use a tp that is a multiple of {kv}")
    mlp_split = par.expert_tp if g.is_moe else tp
    if g.intermediate_size % mlp_split:
        problems.append(f"intermediate size {g.intermediate_size} is not divisible by {mlp_split} "
                        "(the ranks each MLP is split over)")
    if g.vocab_size % tp:
        problems.append(f"vocabulary {g.vocab_size} is not divisible by tp={tp}; "
                        f"use a tp that divides {g.vocab_size}")
    if g.num_layers % pp:
        problems.append(f"{g.num_layers} layers are not divisible by pp={pp}; "
                        f"use a pp that divides {g.num_layers} ({_divisors(g.num_layers)})")
    if ep > 1 and not g.is_moe:
        problems.append(f"ep={ep} needs a mixture-of-experts model; {g.name} is dense (use --ep 1)")
    elif g.is_moe:
        if g.num_experts % ep:
            problems.append(f"{g.num_experts} experts are not divisible by ep={ep}; "
                            f"use an ep that divides {g.num_experts} ({_divisors(g.num_experts)})")
        if tp % ep:
            problems.append(f"ep={ep} must divide tp={tp} (expert parallelism works inside the TP group)")
    return problems


def _divisors(n: int, limit: int = 64) -> str:
    return ", ".join(str(d) for d in range(1, min(n, limit) + 1) if n % d == 0)


def kv_heads_per_rank(g: ModelGeometry, tp: int) -> int:
    """KV heads one TP rank stores: its share, or one replicated head when there are fewer than ranks."""
    return max(1, g.num_kv_heads // tp)


def kv_bytes_per_token_per_rank(g: ModelGeometry, par: Parallelism, kv_bytes: int) -> int:
    """K and V bytes one rank stores per token: its layers (``/pp``) and its KV heads."""
    return 2 * (g.num_layers // par.pp) * kv_heads_per_rank(g, par.tp) * g.head_dim * kv_bytes


def matrix_format(m: Matrix, fmt: WeightFormat) -> WeightFormat:
    """The format a weight is stored in: embeddings stay 16-bit unless the format quantizes them."""
    return BF16 if m.embedding and not fmt.quantize_embeddings else fmt


def shard_shape(g: ModelGeometry, m: Matrix, par: Parallelism) -> tuple[int, int]:
    """Rows × cols of one rank's piece of ``m``."""
    split = par.expert_tp if m.expert else par.tp
    if m.split == "column" or m.split == "vocab":
        return m.rows // split, m.cols
    if m.split == "row":
        return m.rows, m.cols // split
    if m.split == "kv_column":
        return kv_heads_per_rank(g, par.tp) * g.head_dim, m.cols
    return m.rows, m.cols


def matrix_bytes(m: Matrix, fmt: WeightFormat, rows: int, cols: int) -> int:
    """Bytes of a ``rows × cols`` piece of ``m`` stored in ``fmt`` (norms and 16-bit embeddings apart)."""
    if m.norm:
        return rows * cols * fmt.norm_bytes
    return matrix_format(m, fmt).matrix_bytes(rows, cols)


def stage_weight_bytes(g: ModelGeometry, fmt: WeightFormat, par: Parallelism, stage: int) -> int:
    """Weight bytes held by each TP rank of pipeline stage ``stage`` (all ranks of a stage hold the same)."""
    layers = g.num_layers // par.pp
    last = par.pp - 1
    total = 0
    for m in g.matrices():
        rows, cols = shard_shape(g, m, par)
        if m.per_layer:
            copies = m.count // g.num_layers * layers
            if m.expert:
                copies //= par.ep
        elif m.name == "embed_tokens":
            # a tied output projection needs the embedding on the last stage too
            copies = int(stage == 0 or (g.tie_embeddings and stage == last))
        else:
            copies = int(stage == last)
        total += copies * matrix_bytes(m, fmt, rows, cols)
    return total


def rank_weight_bytes(g: ModelGeometry, fmt: WeightFormat, par: Parallelism) -> list[int]:
    """Weight bytes of every rank, stage-major (``pp × tp`` entries). Assumes a valid split."""
    return [b for stage in range(par.pp) for b in [stage_weight_bytes(g, fmt, par, stage)] * par.tp]


def model_weight_bytes(g: ModelGeometry, fmt: WeightFormat) -> int:
    """Bytes of the whole model in ``fmt``, on one device."""
    return stage_weight_bytes(g, fmt, Parallelism(), 0)
