"""W4A16 policy: which kernel configuration a product of a given shape gets, and when the 4-bit kernels give way
to expanding W and calling cuBLAS. Plain arithmetic (no torch, no Triton), so the configuration layer can check a
``--quantize`` group against the kernels' rule without loading them.

The thresholds and defaults were measured on an H200 at Llama-3.1-8B and SmolLM2-135M shapes; the sweeps behind
each are in docs/perf-log.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from stride.kernels.sizes import cdiv, next_pow2


def is_group_size(group: int) -> bool:
    """Whether the W4A16 kernels take groups of this many inputs: a power of two of at least 8 (whole words; their
    tiles are powers of two)."""
    return group >= 8 and group & (group - 1) == 0


def piece(group_size: int) -> int:
    """Inputs the kernels take per scaling step: the group, or 32 of it for larger groups (the kernel's PIECE; the
    pieces of a group share its scale and min)."""
    return min(group_size, 32)



@dataclass(frozen=True)
class W4A16Config:
    """gemv: FMA dot products over block_m (1, 2 or 4) activation rows per program (decode); else tensor-core
    tiles of block_m rows.

    block_k: inputs per step, whole groups (the tiles take one dot per group, so a step unrolls groups).
    split_k > 1 splits K over programs; the last program of each output tile to finish sums the float32
    partials (an arrival counter per tile), so a call is always a single launch.
    scales_first (one-row GEMV): a step loads its groups' scales and mins before its words, not after. Only the
    order of the loads changes, and with it where ptxas places them: on an H200 scales first was 6% faster for
    Llama-3.1-8B's down (K split 4 ways) and 7% slower for gate_up (docs/perf-log.md).
    """

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    gemv: bool = False
    scales_first: bool = False



DEQUANT_MIN_ROWS = 17
"""Rows from which :func:`w4a16_matmul` expands W into a scratch matrix and calls cuBLAS. H200, Llama-3.1-8B
layer (docs/perf-log.md): at 16 rows the 4-bit tiles are faster (230 vs 273 us), from 32 the expansion (273 vs 317;
1,421 vs 7,543 us at 2,048 rows)."""

TILE_MIN_PROGRAMS = 128
"""Below :data:`DEQUANT_MIN_ROWS`, rows on the tile kernel (by default 9-16, past the GEMV) are still expanded
when it would run fewer programs than this: each program walks its K range one 32-input group at a time, so a grid
that does not fill the GPU is bound by that chain. H200 (docs/perf-log.md), 16 rows: SmolLM2-135M's projections
(5-24 programs) took 21-31 us on the tiles against 5.4-6.8 us expanded; Llama-3.1-8B's (256-448 programs) were
faster on the tiles."""



def default_config(m: int, n: int, k: int, group_size: int = 32) -> W4A16Config:
    """The GEMV up to 8 rows, 32 columns per program; tensor-core tiles above, in row blocks of 16, 64 or 128. From
    H200 sweeps at Llama-3.1-8B shapes (docs/perf-log.md).

    One row: with 512 or more column tiles (gate_up) the K loop steps 2,048 inputs at a time over 8 warps;
    with fewer (qkv, o, down) every program takes one or two long steps of up to 4,096 inputs over 8 warps,
    K split into pieces of at most 4,096 (fewer dependent round trips per program pays more than split-K's
    extra programs), a split K loading each step's scales first (:class:`W4A16Config`). Two rows: two per
    program in 2,048-input steps over 4 warps, K split below 512 column tiles in two, or in four where K is over
    8,192 (down: 18.1 against 19.2 us split in two over 8 warps); but with 128 or fewer column tiles and
    K in one step (o) a program per row was faster. Three to eight rows: four per program in 1,024-input steps
    over 4 warps, K split in two below 512 column tiles up to 4 rows (at 8 rows there are programs enough
    without). Except, at any row count up to 8, where fewer than 128 column tiles and K of at most 4,096
    (SmolLM2-135M's projections: 18-96 tiles) would leave most SMs idle: there a program per row, as at one
    row, and its single step loads its weights before the PDL wait (H200, the SmolLM2-shaped worker's decode
    step: 4 rows 1.04 -> 0.57 ms, 8 rows 1.10 -> 0.77)."""
    if m <= 8 or group_size < 16:  # a tile's dot needs 16 inputs per group
        block_n = 32
        col_tiles = cdiv(n, block_n)
        # (m > 8 reaches here only with groups too small for the tiles: one row per program, as before.)
        # One row per program where the column tiles alone, fewer than 128, would leave most SMs idle (SmolLM2's
        # projections), and at two rows also with 128 of them and K in one step (Llama-3.1-8B's o).
        few_tiles = k <= 4096 and (col_tiles < 128 or (m == 2 and col_tiles == 128))
        if m == 1 or few_tiles or m > 8:
            block_m = 1
            if col_tiles >= 512:
                split_k, step, warps = 1, 2048, 8
            else:
                split_k = cdiv(k, 4096)
                step, warps = 4096 if split_k == 1 else 2048, 8
        elif m == 2:
            block_m, step, warps = 2, 2048, 4
            split_k = 1 if col_tiles >= 512 else (4 if k > 8192 else 2)
        else:
            block_m, step, warps = 4, 1024, 4
            split_k = 1 if col_tiles >= 512 or m > 4 else 2
        groups = min(max(1, step // group_size), next_pow2(cdiv(k, split_k * group_size)))
        return W4A16Config(block_m=block_m, block_n=block_n, block_k=groups * group_size, split_k=split_k,
                           num_warps=warps, num_stages=3, gemv=True, scales_first=block_m == 1 and split_k > 1)
    # Tiles. The codes are expanded once per row block, so a taller block spreads that work over more rows. Up to 16
    # rows, one 16 x 128 block, K split up to 8 ways while there are at most 1,024 programs and each split keeps 512
    # inputs (H200 sweep at M=16). From 17 rows, blocks of 64, then 128 rows (H200 sweeps at M = 32, 64, 128: a
    # 64-row block takes about as long for 32 rows as for 64, and at M=64 it is 2.2-2.5x faster than four blocks of
    # 16). 64 columns over 8 warps where 128-column tiles would be fewer than 128 and K is short (qkv, o); else 128
    # (gate_up; down, whose long K then splits 8 ways). Fewer than 128 tiles: K split while each split keeps at
    # least 1,024 inputs, up to 8 ways. (From DEQUANT_MIN_ROWS rows w4a16_matmul expands W instead, unless the
    # 4-bit kernel is asked for: the autotuner, benchmarks, tests.)
    if m <= 16:
        tiles = cdiv(n, 128) * cdiv(m, 16)
        split_k = 1
        while split_k < 8 and tiles * split_k * 2 <= 1024 and k // (split_k * 2) >= 512:
            split_k *= 2
        return W4A16Config(block_m=16, block_n=128, block_k=piece(group_size), split_k=split_k, num_warps=4,
                           num_stages=3)
    block_m = 64 if m <= 64 else 128
    tiles = cdiv(n, 128) * cdiv(m, block_m)
    if block_m == 64 and tiles < 128 and k <= 8192:
        block_n, warps = 64, 8
        tiles *= 2
    else:
        block_n, warps = 128, 4 if block_m == 64 else 8
    split_k = 1
    while tiles < 128 and split_k < 8 and k // (split_k * 2) >= 1024:
        split_k *= 2
    return W4A16Config(block_m=block_m, block_n=block_n, block_k=piece(group_size), split_k=split_k, num_warps=warps,
                       num_stages=3)



def workspace_bytes(m: int, n: int, cfg: W4A16Config) -> int:
    """Float32 split-K partials."""
    return cfg.split_k * m * n * 4 if cfg.split_k > 1 else 0



def k_split(k: int, cfg: W4A16Config) -> tuple[int, int]:
    """(inputs per split, splits): whole steps per split, so the splits taken can be fewer than asked."""
    k_per_split = cdiv(cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    return k_per_split, cdiv(k, k_per_split)


def tile_programs(m: int, n: int, k: int, cfg: W4A16Config) -> int:
    return cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n) * k_split(k, cfg)[1]



def expands(m: int, n: int, k: int, cfg: W4A16Config) -> bool:
    """Whether :func:`~stride.kernels.w4a16.w4a16_matmul` expands W into a scratch matrix for cuBLAS rather than run the
    4-bit kernel with ``cfg``: from :data:`DEQUANT_MIN_ROWS` rows, or with tiles that would not fill the GPU."""
    return m >= DEQUANT_MIN_ROWS or (not cfg.gemv and tile_programs(m, n, k, cfg) < TILE_MIN_PROGRAMS)
