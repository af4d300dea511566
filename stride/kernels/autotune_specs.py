"""Per-kernel tuning specs for :mod:`stride.kernels.autotune`, and the broken variants its gate must reject."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from stride.kernels import paged_decode as pd
from stride.kernels import paged_extend as pe
from stride.kernels import rmsnorm as rn
from stride.kernels import silu_mul as sm
from stride.kernels import w4a16 as wq
from stride.kernels import w4a16_format as w4f
from stride.kernels import w4a16_policy as w4p
from stride.kernels.autotune import Candidate, KernelSpec, Problem
from stride.kernels.sizes import next_pow2

# ---- paged decode attention ----


def _seed(gen: torch.Generator) -> int:
    return int(torch.randint(0, 2**62, (1,), generator=gen))


def _randn(size: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: torch.device,
           ) -> torch.Tensor:
    # Large tensors are drawn on the device (a CPU draw of a GPU-sized cache takes seconds per problem).
    dev_gen = torch.Generator(device=device)
    dev_gen.manual_seed(_seed(gen))
    return torch.randn(size, generator=dev_gen, device=device, dtype=torch.float32).to(dtype)


@dataclass(frozen=True)
class DecodeShape:
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    context_len: int
    """Longest context in the batch; the gate mixes shorter, ragged ones in."""
    dtype: torch.dtype = torch.bfloat16


def make_paged_problem(
    context_lens: list[int], query_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device,
) -> Problem:
    """Random caches with each sequence's blocks scattered over a shuffled pool, -1 past each table's end."""
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks full of noise that nobody may read
    max_blocks = max(blocks_per_seq) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = perm[used:used + nb]
        used += nb
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "q": _randn((sum(query_lens), num_heads, head_dim), dtype, gen, device),
        "k_cache": _randn(cache_shape, dtype, gen, device),
        "v_cache": _randn(cache_shape, dtype, gen, device),
        "block_tables": block_tables.to(device),
        "context_lens": torch.tensor(context_lens, dtype=torch.int32, device=device),
        "cu_query_lens": cu.to(device),
        "max_query_len": max(query_lens),
        "max_context_len": max(context_lens),
        "scale": head_dim ** -0.5,
    }


def _decode_problem(shape: DecodeShape, gen: torch.Generator, device: torch.device) -> Problem:
    lens = torch.randint(1, shape.context_len + 1, (shape.num_seqs,), generator=gen).tolist()
    lens[0] = shape.context_len
    return make_paged_problem(lens, [1] * shape.num_seqs, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                              shape.block_size, shape.dtype, gen, device)


def _decode_gate_shapes(shape: DecodeShape) -> list[DecodeShape]:
    bs = shape.block_size
    edges = {1, 2, bs - 1, bs, bs + 1, 123, shape.context_len}
    return [dataclasses.replace(shape, num_seqs=max(3, min(shape.num_seqs, 8)), context_len=c)
            for c in sorted(e for e in edges if 1 <= e <= shape.context_len)] + [shape]


def _decode_run(cfg: pd.DecodeConfig, p: Problem) -> torch.Tensor:
    return pd.paged_decode(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["context_lens"],
                           p["scale"], max_context_len=p["max_context_len"], config=cfg)


def _decode_reference(p: Problem) -> torch.Tensor:
    return pd.paged_decode_reference(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["context_lens"],
                                     p["scale"])


def _decode_space(shape: DecodeShape) -> list[pd.DecodeConfig]:
    parts = [0] + [p for p in (128, 256, 512, 1024, 2048) if p < shape.context_len]
    return [pd.DecodeConfig(block_n=bn, partition=part, num_warps=w, num_stages=st)
            for bn in (32, 64) for part in parts for w in (2, 4) for st in (2, 3)]


PAGED_DECODE = KernelSpec(
    name="paged_decode", config_type=pd.DecodeConfig, space=_decode_space, gate_shapes=_decode_gate_shapes,
    make_problem=_decode_problem, run=_decode_run, reference=_decode_reference,
    cost=lambda cfg, s: float(pd.workspace_bytes(s.num_seqs, s.num_heads, s.head_dim, s.context_len, cfg)),
    bucket=lambda s: (f"b{next_pow2(s.num_seqs)}-ctx{next_pow2(s.context_len)}-h{s.num_heads}"
                      f"-kv{s.num_kv_heads}-d{s.head_dim}-p{s.block_size}-{str(s.dtype)[6:]}"),
)

# ---- paged extend (prefill) attention ----


@dataclass(frozen=True)
class ExtendShape:
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    query_len: int
    """Longest chunk of new tokens in the batch; the gate mixes shorter, ragged ones in."""
    context_len: int
    """Longest context (cached prefix + chunk), >= query_len: chunked prefill when larger."""
    dtype: torch.dtype = torch.bfloat16


def _extend_problem(shape: ExtendShape, gen: torch.Generator, device: torch.device) -> Problem:
    q_lens = torch.randint(1, shape.query_len + 1, (shape.num_seqs,), generator=gen).tolist()
    q_lens[0] = shape.query_len
    prefix = shape.context_len - shape.query_len
    ctx = [q + int(torch.randint(0, prefix + 1, (1,), generator=gen)) for q in q_lens]
    ctx[0] = shape.context_len
    return make_paged_problem(ctx, q_lens, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.block_size,
                              shape.dtype, gen, device)


def _extend_gate_shapes(shape: ExtendShape) -> list[ExtendShape]:
    bs = shape.block_size
    small = [(1, 1), (1, bs + 1), (bs - 1, bs - 1), (bs + 1, 3 * bs + 2), (37, 37), (37, 123)]
    return [dataclasses.replace(shape, num_seqs=3, query_len=q, context_len=c) for q, c in small] + [shape]


def _extend_run(cfg: pe.ExtendConfig, p: Problem) -> torch.Tensor:
    return pe.paged_extend(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["cu_query_lens"],
                           p["context_lens"], p["scale"], max_query_len=p["max_query_len"], config=cfg)


def _extend_reference(p: Problem) -> torch.Tensor:
    return pe.paged_extend_reference(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["cu_query_lens"],
                                     p["context_lens"], p["scale"])


PAGED_EXTEND = KernelSpec(
    name="paged_extend", config_type=pe.ExtendConfig,
    space=lambda s: [pe.ExtendConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
                     for bm in (16, 32, 64, 128) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)
                     if bm * bn <= 8192],
    gate_shapes=_extend_gate_shapes, make_problem=_extend_problem, run=_extend_run, reference=_extend_reference,
    # Shared-memory proxy: the K and V tiles of every pipeline stage, plus the query tile.
    cost=lambda cfg, s: float((2 * cfg.num_stages * cfg.block_n + cfg.block_m) * next_pow2(s.head_dim)
                              * s.dtype.itemsize),
    bucket=lambda s: (f"q{next_pow2(s.query_len)}-ctx{next_pow2(s.context_len)}-b{next_pow2(s.num_seqs)}"
                      f"-h{s.num_heads}-kv{s.num_kv_heads}-d{s.head_dim}-p{s.block_size}-{str(s.dtype)[6:]}"),
)

# ---- W4A16 GEMM ----


@dataclass(frozen=True)
class GemmShape:
    m: int
    n: int
    k: int
    group_size: int = 32
    dtype: torch.dtype = torch.bfloat16


def _gemm_problem(shape: GemmShape, gen: torch.Generator, device: torch.device) -> Problem:
    return {"x": _randn((shape.m, shape.k), shape.dtype, gen, device),
            "w": w4f.random_weight(shape.n, shape.k, shape.group_size, device=device, seed=_seed(gen))}


def _gemm_space(shape: GemmShape) -> list[w4p.W4A16Config]:
    """Tensor-core tiles from M=2 up; the GEMV (1, 2 or 4 rows per program, FMA dot products) up to M=8."""
    # Tiles: rows in blocks of 16 up to M=16, of 64 (and 128 above M=64) beyond, as in the launcher's default.
    # Tile steps are whole pieces (w4p.piece: the group, or 32 of it); the GEMV bounds below count pieces per step.
    tall = (64, 128) if shape.m > 64 else (64,)
    piece = w4p.piece(shape.group_size)
    tiles = [w4p.W4A16Config(block_m=16, block_n=bn, block_k=bk, split_k=sk, num_warps=4, num_stages=st)
             for bn in (64, 128) for bk in (piece, 2 * piece) for sk in (1, 2, 4, 8)
             for st in (3, 4) if shape.k // (sk * bk) >= 2] if 2 <= shape.m <= 16 else [
        w4p.W4A16Config(block_m=bm, block_n=bn, block_k=piece, split_k=sk, num_warps=w, num_stages=3)
        for bm in tall for bn in (64, 128) for sk in (1, 2, 4, 8) for w in (4, 8)
        if shape.k // (sk * piece) >= 2]
    tiles = tiles if shape.group_size >= 16 else []
    # GEMV steps up to 4,096 inputs, keeping each thread's share of a step's words at 16 or fewer per word tile,
    # and at 32 or fewer over the rows of a program (each row keeps two float32 accumulators per word). Several
    # rows per program with 32 columns only (the H200 sweep's choice at every shape). One row both orders of a
    # step's loads (scales_first).
    gemv = [w4p.W4A16Config(block_m=bm, block_n=bn, block_k=bk, split_k=sk, num_warps=w, num_stages=3, gemv=True,
                           scales_first=first)
            for bm in (1, 2, 4) for bn in (16, 32, 64) for bk in (256, 512, 1024, 2048, 4096) for sk in (1, 2, 4)
            for w in (4, 8) for first in ((False, True) if bm == 1 else (False,))
            if shape.k // (sk * bk) >= 1 and bk % shape.group_size == 0 and (bm == 1 or (bn == 32 and bm < 2 * shape.m))
            and bk // piece * bn <= 16 * 32 * w
            and bm * (bk // piece) * bn <= 32 * 32 * w] if shape.m <= 8 else []
    return gemv + tiles


def _gemm_gate_shapes(shape: GemmShape) -> list[GemmShape]:
    small = [dataclasses.replace(shape, m=m, n=n, k=k)
             for m, n, k in ((1, 40, 256), (5, 123, 384), (3, 77, shape.group_size * 13))]
    return small + [shape]


W4A16 = KernelSpec(
    name="w4a16", config_type=w4p.W4A16Config, space=_gemm_space, gate_shapes=_gemm_gate_shapes,
    make_problem=_gemm_problem, run=lambda cfg, p: wq.w4a16_matmul(p["x"], p["w"], cfg, dequant=False),
    reference=lambda p: w4f.w4a16_reference(p["x"], p["w"]),
    cost=lambda cfg, s: float(w4p.workspace_bytes(s.m, s.n, cfg)),
    bucket=lambda s: f"m{next_pow2(s.m)}-n{s.n}-k{s.k}-g{s.group_size}-{str(s.dtype)[6:]}",
)

# ---- RMSNorm ----


@dataclass(frozen=True)
class NormShape:
    num_rows: int
    hidden: int
    dtype: torch.dtype = torch.bfloat16


def _norm_problem(shape: NormShape, gen: torch.Generator, device: torch.device) -> Problem:
    def rand(*size: int) -> torch.Tensor:
        return _randn(size, shape.dtype, gen, device)

    return {"x": rand(shape.num_rows, shape.hidden), "residual": rand(shape.num_rows, shape.hidden),
            "weight": rand(shape.hidden), "eps": 1e-5}


RMSNORM = KernelSpec(
    name="rmsnorm", config_type=rn.RMSNormConfig,
    space=lambda s: [rn.RMSNormConfig(rows, w) for rows in (1, 2, 4) for w in (1, 2, 4, 8, 16)
                     if w * 32 <= max(32, next_pow2(s.hidden))],
    gate_shapes=lambda s: [dataclasses.replace(s, num_rows=r, hidden=h)
                           for r, h in ((1, 5), (5, 123), (7, s.hidden))] + [s],
    make_problem=_norm_problem,
    # Both outputs, (out, h), are checked.
    run=lambda cfg, p: rn.rmsnorm(p["x"], p["weight"], p["eps"], p["residual"], cfg),
    reference=lambda p: rn.rmsnorm_reference(p["x"], p["weight"], p["eps"], p["residual"]),
    # Register proxy: row elements each thread holds, times rows in flight.
    cost=lambda cfg, s: float(next_pow2(s.hidden) // (32 * cfg.num_warps) * cfg.rows_per_program),
    bucket=lambda s: f"rows{next_pow2(s.num_rows)}-h{s.hidden}-{str(s.dtype)[6:]}",
)

# ---- SiLU-and-mul ----


@dataclass(frozen=True)
class SiluShape:
    num_rows: int
    intermediate: int
    dtype: torch.dtype = torch.bfloat16


SILU_MUL = KernelSpec(
    name="silu_mul", config_type=sm.SiluMulConfig,
    space=lambda s: [sm.SiluMulConfig(block, w) for block in (256, 512, 1024, 2048, 4096) for w in (1, 2, 4, 8)
                     if 32 * w <= block <= max(256, next_pow2(s.intermediate))],
    gate_shapes=lambda s: [dataclasses.replace(s, num_rows=r, intermediate=i)
                           for r, i in ((1, 5), (3, 123), (5, s.intermediate + 1))] + [s],
    make_problem=lambda s, gen, device: {"x": _randn((s.num_rows, 2 * s.intermediate), s.dtype, gen, device)},
    run=lambda cfg, p: sm.silu_mul(p["x"], cfg),
    reference=lambda p: sm.silu_mul_reference(p["x"]),
    cost=lambda cfg, s: float(cfg.block // (32 * cfg.num_warps)),  # register proxy: elements per thread
    bucket=lambda s: f"rows{next_pow2(s.num_rows)}-i{s.intermediate}-{str(s.dtype)[6:]}",
)

# ---- negative controls: broken variants the gate must reject ----


def broken_off_by_one_mask(cfg: pd.DecodeConfig | None = None) -> Candidate:
    """Decode whose key mask stops one short (``<`` where ``<=`` was meant): the last key is dropped."""
    def run(p: Problem) -> torch.Tensor:
        short = p["context_lens"] - 1
        return pd.paged_decode(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], short, p["scale"],
                               max_context_len=p["max_context_len"], config=cfg)
    return Candidate("broken:off_by_one_mask", run, cfg)


def _table_stride_one_short(block_tables: torch.Tensor) -> torch.Tensor:
    """The block table read with a row stride one short (as if it were max_blocks - 1 wide). Unused (-1)
    entries are clamped to block 0 first so the broken variants stay memory-safe on a GPU."""
    bt = block_tables.clamp(min=0).contiguous()
    return bt.as_strided(bt.shape, (bt.shape[1] - 1, 1))


def broken_block_table_stride(cfg: pd.DecodeConfig | None = None) -> Candidate:
    """Decode reading the block table with a row stride one short (:func:`_table_stride_one_short`)."""
    def run(p: Problem) -> torch.Tensor:
        bad = _table_stride_one_short(p["block_tables"])
        return pd.paged_decode(p["q"], p["k_cache"], p["v_cache"], bad, p["context_lens"], p["scale"],
                               max_context_len=p["max_context_len"], config=cfg)
    return Candidate("broken:block_table_stride", run, cfg)


def broken_dropped_scale(cfg: w4p.W4A16Config | None = None) -> Candidate:
    """W4A16 that forgets the per-group scale (codes + mins only)."""
    def run(p: Problem) -> torch.Tensor:
        w = p["w"]
        return wq.w4a16_matmul(p["x"], w4f.W4A16Weight(w.qweight, torch.ones_like(w.scales), w.mins,
                                                      w.group_size), cfg, dequant=False)
    return Candidate("broken:dropped_scale", run, cfg)


def broken_extend_block_table_stride(cfg: pe.ExtendConfig | None = None) -> Candidate:
    """Extend reading the block table with a row stride one short (:func:`_table_stride_one_short`)."""
    def run(p: Problem) -> torch.Tensor:
        bad = _table_stride_one_short(p["block_tables"])
        return pe.paged_extend(p["q"], p["k_cache"], p["v_cache"], bad, p["cu_query_lens"], p["context_lens"],
                               p["scale"], max_query_len=p["max_query_len"], config=cfg)
    return Candidate("broken:extend_block_table_stride", run, cfg)


def broken_extend_causal_shift(cfg: pe.ExtendConfig | None = None) -> Candidate:
    """Extend that places each chunk one position early (contexts one short, the chunk's last key unseen by
    every query; a cached prefix of at least one token keeps it in bounds)."""
    def run(p: Problem) -> torch.Tensor:
        q_lens = p["cu_query_lens"][1:] - p["cu_query_lens"][:-1]
        short = torch.maximum(p["context_lens"] - 1, q_lens)
        return pe.paged_extend(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["cu_query_lens"], short,
                               p["scale"], max_query_len=p["max_query_len"], config=cfg)
    return Candidate("broken:extend_causal_shift", run, cfg)


def broken_silu_mul_swapped(cfg: sm.SiluMulConfig | None = None) -> Candidate:
    """SiLU-mul over [up | gate] instead of [gate | up]."""
    def run(p: Problem) -> torch.Tensor:
        x = p["x"]
        half = x.shape[1] // 2
        return sm.silu_mul(torch.cat([x[:, half:], x[:, :half]], dim=1).contiguous(), cfg)
    return Candidate("broken:silu_mul_swapped", run, cfg)
