"""W4A16 GEMM kernels: ``y = x @ W.T`` with W in the 4-bit format of :mod:`stride.kernels.w4a16_format` and 16-bit
activations, a GEMV for decode rows and tensor-core tiles above, each with its launcher.

From :data:`DEQUANT_MIN_ROWS` rows (prefill chunks, large decode batches) :func:`w4a16_matmul` instead expands
W once into a per-device scratch matrix of x's dtype and multiplies that with cuBLAS: there the product is bound
by matrix throughput, which the 4-bit kernels (exact per-group scaling on CUDA cores) do not reach. It does the
same below that whenever the tensor-core tiles would not fill the GPU (:data:`TILE_MIN_PROGRAMS`): with the
default configs that is from 9 rows (up to 8 take the GEMV), with an explicit tile config at any row count. The weights
are then rounded to x's dtype (bfloat16: 8 significant bits), as a 16-bit checkpoint's are; below the threshold
the codes stay exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from stride.kernels.common import check_float, check_last_contiguous, dot, dot_args, pdl_args, pdl_release, pdl_wait
from stride.kernels.w4a16_format import TILE_N, W4A16Weight, check_weight
from stride.kernels.w4a16_policy import W4A16Config, default_config, expands, k_split, piece

_TILE = tl.constexpr(TILE_N)


# Powers of two for the GEMV (see the kernel): nibble p of a word, read in place as a float, is the subnormal
# code * 16^p * 2^-149 (p < 6: the bits stay below 2^24); x * 2^(96 - 4p) meets it at code * x * 2^-53.
_X_SCALE = tl.constexpr(tuple(2.0 ** (96 - 4 * p) for p in range(6)))
_X_EXP = tl.constexpr(tuple((96 - 4 * p) << 23 for p in range(6)))  # the same, added to a float32's exponent
_SUM_UNIT = tl.constexpr(2.0**-53)
_INV_SUM_UNIT = tl.constexpr(2.0**53)


@triton.jit
def _x_prescaled(x_row, k_in, k_at, g_ok, P: tl.constexpr):
    """x[k] * 2^(96 - 4P) as float32 for one row: bf16 widened and prescaled by one integer op from an unmasked
    load at the clamped index k_in (a masked load costs two more instructions per value); other dtypes
    loaded masked at k_at."""
    if x_row.dtype.element_ty == tl.bfloat16:
        xb = tl.load(x_row + k_in).to(tl.int16, bitcast=True).to(tl.int32)
        return ((xb << 16) + _X_EXP[P]).to(tl.float32, bitcast=True)
    return tl.load(x_row + k_at, mask=g_ok, other=0.0).to(tl.float32) * _X_SCALE[P]


@triton.jit
def _group_sums(x_row, gs_in, g_ok, GROUP: tl.constexpr):
    """sum_k x_k per group, in the GEMV's 2^-53 units, zero for groups past the end."""
    xg = tl.load(x_row + gs_in[:, None] * GROUP + tl.arange(0, GROUP)[None, :]).to(tl.float32)
    return tl.where(g_ok, tl.sum(xg, axis=1), 0.0) * _SUM_UNIT


@triton.jit
def _scale_tiles(sc_ptr, mn_ptr, gs, offs_n, mask_g, stride_sg, R: tl.constexpr):
    """The scales and mins of groups ``gs`` (units of work, R to a scaling group) for the step's columns, as
    float32 (G, BLOCK_N) tiles."""
    sg = (gs // R)[:, None] * stride_sg + offs_n[None, :]  # R rows of the tile read one scale row (from L1)
    sc = tl.load(sc_ptr + sg, mask=mask_g, other=0.0).to(tl.float32)
    mn = tl.load(mn_ptr + sg, mask=mask_g, other=0.0).to(tl.float32)
    return sc, mn


@triton.jit
def _step_loads(qw_ptr, sc_ptr, mn_ptr, k0, k_hi, offs_g, offs_n, n_mask, stride_qt, stride_sg,
                GROUP: tl.constexpr, R: tl.constexpr, SCALES_FIRST: tl.constexpr):
    """The weights of one K step of the GEMV (see :func:`_gemv_step`): its GROUP // 8 (at most 4) word tiles, each
    (G, BLOCK_N), then the scales and mins of its groups as float32 (``SCALES_FIRST``: those before the words)."""
    gs = k0 // GROUP + offs_g
    mask_g = (gs < k_hi // GROUP)[:, None] & n_mask[None, :]
    W: tl.constexpr = GROUP // 8  # words per group
    if SCALES_FIRST:
        sc, mn = _scale_tiles(sc_ptr, mn_ptr, gs, offs_n, mask_g, stride_sg, R)
    p0 = _word_tile(qw_ptr, gs, 0, W, stride_qt, offs_n, mask_g)
    p1, p2, p3 = p0, p0, p0
    if W > 1:
        p1 = _word_tile(qw_ptr, gs, 1, W, stride_qt, offs_n, mask_g)
    if W > 2:
        p2 = _word_tile(qw_ptr, gs, 2, W, stride_qt, offs_n, mask_g)
    if W > 3:
        p3 = _word_tile(qw_ptr, gs, 3, W, stride_qt, offs_n, mask_g)
    if not SCALES_FIRST:
        sc, mn = _scale_tiles(sc_ptr, mn_ptr, gs, offs_n, mask_g, stride_sg, R)
    return p0, p1, p2, p3, sc, mn


@triton.jit
def _gemv_step(
    x_row0, x_row1, x_row2, x_row3, qw_ptr, sc_ptr, mn_ptr, k0, k_hi, offs_g, offs_n, n_mask,
    stride_qt, stride_sg, acc0, acc1, acc2, acc3, p0, p1, p2, p3, sc, mn,
    GROUP: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, LOADED: tl.constexpr, R: tl.constexpr,
):
    """One K step of the GEMV (see the kernel): G groups from input k0, added into the rows' accumulators.
    ``GROUP`` here is the kernel's unit of work (at most 32 inputs, so at most four words); ``R`` of them share one
    scale and min. ``LOADED``: the step's weights are p0..p3, sc and mn (:func:`_step_loads`, issued ahead by the
    caller); else they are loaded here, each word tile just before its use (p0..p3, sc, mn unused)."""
    gs = k0 // GROUP + offs_g
    g_ok = gs < k_hi // GROUP
    gs_in = tl.minimum(gs, k_hi // GROUP - 1)  # in-bounds rows for unmasked x loads; their codes are 0
    mask_g = g_ok[:, None] & n_mask[None, :]
    W: tl.constexpr = GROUP // 8  # words per group
    if not LOADED:
        sc, mn = _scale_tiles(sc_ptr, mn_ptr, gs, offs_n, mask_g, stride_sg, R)
    dot0 = tl.zeros_like(sc)
    dot1 = tl.zeros_like(sc)
    dot2 = tl.zeros_like(sc)
    dot3 = tl.zeros_like(sc)
    for q in tl.static_range(W):
        if not LOADED:
            packed = _word_tile(qw_ptr, gs, q, W, stride_qt, offs_n, mask_g)
        elif q == 0:
            packed = p0
        elif q == 1:
            packed = p1
        elif q == 2:
            packed = p2
        else:
            packed = p3
        high = packed >> 16
        for j in tl.static_range(8):
            # p = j - 4 * (j // 6): nibbles 0-5 in place, 6 and 7 as p = 2, 3 of the high half.
            if j < 6:
                code = (packed & (0xF << (4 * j))).to(tl.float32, bitcast=True)
            else:
                code = (high & (0xF << (4 * (j - 4)))).to(tl.float32, bitcast=True)
            k_in, k_at = gs_in * GROUP + 8 * q + j, gs * GROUP + 8 * q + j
            dot0 += code * _x_prescaled(x_row0, k_in, k_at, g_ok, j - 4 * (j // 6))[:, None]
            if BLOCK_M > 1:
                dot1 += code * _x_prescaled(x_row1, k_in, k_at, g_ok, j - 4 * (j // 6))[:, None]
            if BLOCK_M > 2:
                dot2 += code * _x_prescaled(x_row2, k_in, k_at, g_ok, j - 4 * (j // 6))[:, None]
            if BLOCK_M > 3:
                dot3 += code * _x_prescaled(x_row3, k_in, k_at, g_ok, j - 4 * (j // 6))[:, None]
    acc0 += sc * dot0 + mn * _group_sums(x_row0, gs_in, g_ok, GROUP)[:, None]
    if BLOCK_M > 1:
        acc1 += sc * dot1 + mn * _group_sums(x_row1, gs_in, g_ok, GROUP)[:, None]
    if BLOCK_M > 2:
        acc2 += sc * dot2 + mn * _group_sums(x_row2, gs_in, g_ok, GROUP)[:, None]
    if BLOCK_M > 3:
        acc3 += sc * dot3 + mn * _group_sums(x_row3, gs_in, g_ok, GROUP)[:, None]
    return acc0, acc1, acc2, acc3


@triton.jit
def _word_tile(qw_ptr, gs, q: tl.constexpr, W: tl.constexpr, stride_qt, offs_n, mask_g):
    """Word q of each group in ``gs``, for the step's columns: a (G, BLOCK_N) int32 tile."""
    return tl.load(_word_ptrs(qw_ptr, gs * W + q, offs_n, stride_qt), mask=mask_g, other=0)


@triton.jit
def _word_ptrs(qw_ptr, word_rows, offs_n, stride_qt):
    """Pointers to the words of rows ``word_rows`` (inputs 8 * row ...) and columns ``offs_n``, a (rows, columns)
    tile, in the tiled layout (:class:`W4A16Weight`; ``stride_qt``: words per column tile)."""
    tile = (offs_n // _TILE).to(tl.int64) * stride_qt
    return qw_ptr + (tile + offs_n % _TILE)[None, :] + word_rows[:, None] * _TILE


@triton.jit
def _w4a16_kernel(
    x_ptr, qw_ptr, sc_ptr, mn_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_qt, stride_sg, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GEMV: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    ONE_STEP: tl.constexpr = False, SCALES_FIRST: tl.constexpr = False, PDL: tl.constexpr = False,
):
    if GEMV:
        pid_m = tl.program_id(0)  # rows fastest: the rows of one weight tile are launched together
        pid_n = tl.program_id(1)
    else:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    # Both paths work groups of more than 32 inputs as R pieces of 32 that share the group's scale and min (sum_k
    # x_k code_k and sum_k x_k add over the pieces); :func:`piece` is PIECE.
    R: tl.constexpr = (GROUP + 31) // 32
    PIECE: tl.constexpr = GROUP // R
    if GEMV:
        # BLOCK_M (1-4) activation rows per program share each extracted code; a larger batch takes several
        # programs per weight tile, launched together (the row block is the fastest grid axis) so all but the
        # first read the tile from L2. Per row, group g and column n:
        #   sum_k x_k (code_k s + m) = s * sum_k x_k code_k + m * sum_k x_k,
        # scaled once per group. A step holds G whole groups, read as GROUP // 8 (G, BLOCK_N) word tiles (word
        # q of every group) of one layout, so their dot products add elementwise (no reshape). The rows are
        # separate 2-D accumulators (a row axis would give Triton a 3-D layout that converts every code).
        # A code is never shifted out or converted: nibble p < 6 of a word, ANDed in place and read as a
        # float32, is the subnormal code * 16^p * 2^-149 (exact), and the activation is prescaled by the power
        # of two 2^(96 - 4p), so one AND and one FMA add code * x * 2^-53 (nibbles 6, 7: the word >> 16).
        # bf16 activations are widened and prescaled in one integer op (bits << 16 plus 96 - 4p in the
        # exponent); a zero then becomes a tiny power of two whose products underflow to exactly zero.
        # Float32-exact for 2^-73 <= |x| < 2^31; needs denormals kept (Triton emits fma.rn.f32, not .ftz).
        # About 3 SASS instructions per weight on sm_90 for one row (5 for shift/extract/convert); each
        # further row adds an FMA per weight and its activation work.
        # Rows past M read row M - 1 (unmasked loads; their results are never stored).
        tl.static_assert(BLOCK_M <= 4, "the GEMV takes up to 4 rows per program")
        # In pieces the unrolled step is the same as for groups of 32, where one whole group of 128 per row of the
        # tile took 4-6x as long to compile for sm_90 (local, triton 3.6).
        G: tl.constexpr = BLOCK_K // PIECE
        x_row0 = x_ptr + tl.minimum(pid_m * BLOCK_M, M - 1).to(tl.int64) * stride_xm
        x_row1 = x_ptr + tl.minimum(pid_m * BLOCK_M + 1, M - 1).to(tl.int64) * stride_xm
        x_row2 = x_ptr + tl.minimum(pid_m * BLOCK_M + 2, M - 1).to(tl.int64) * stride_xm
        x_row3 = x_ptr + tl.minimum(pid_m * BLOCK_M + 3, M - 1).to(tl.int64) * stride_xm
        offs_g = tl.arange(0, G)
        acc0 = tl.zeros([G, BLOCK_N], tl.float32)
        acc1 = tl.zeros([G, BLOCK_N], tl.float32)
        acc2 = tl.zeros([G, BLOCK_N], tl.float32)
        acc3 = tl.zeros([G, BLOCK_N], tl.float32)
        # One row per program: each K step's weights are loaded as a whole (:func:`_step_loads`: words, and scales
        # and mins after them or, ``SCALES_FIRST``, before) ahead of its arithmetic. ptxas keeps that order of the
        # loads while it places them among the FMAs; loading each word tile just before its use (as several rows
        # still do) was slower on an H200 at every Llama-3.1-8B shape (docs/perf-log.md). A program of one K step
        # (``ONE_STEP``: o and qkv at 8B shapes, SmolLM2's projections) is one block: under PDL its weights are
        # loaded before the wait (no kernel of a forward writes weights), so they are in flight while the kernel
        # before finishes. Programs of several steps wait first (with their first step loaded before the wait, down
        # was 2 us slower in the worker); several rows too: staged steps, unrolled over every row, took minutes to
        # compile (4 rows, 1,024-input steps: 198 s against 5 s; 2 rows: 30 s against 3). Every path lets the
        # kernel after launch only once its K loop is done (``pdl_release``).
        if BLOCK_M == 1 and ONE_STEP:
            p0, p1, p2, p3, sc, mn = _step_loads(qw_ptr, sc_ptr, mn_ptr, k_lo, k_hi, offs_g, offs_n, n_mask,
                                                 stride_qt, stride_sg, PIECE, R, SCALES_FIRST)
            pdl_wait(PDL, False)
            acc0, acc1, acc2, acc3 = _gemv_step(
                x_row0, x_row1, x_row2, x_row3, qw_ptr, sc_ptr, mn_ptr, k_lo, k_hi, offs_g, offs_n, n_mask,
                stride_qt, stride_sg, acc0, acc1, acc2, acc3, p0, p1, p2, p3, sc, mn, PIECE, G, BLOCK_M, True, R)
        elif BLOCK_M == 1:
            pdl_wait(PDL, False)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                p0, p1, p2, p3, sc, mn = _step_loads(qw_ptr, sc_ptr, mn_ptr, k0, k_hi, offs_g, offs_n, n_mask,
                                                     stride_qt, stride_sg, PIECE, R, SCALES_FIRST)
                acc0, acc1, acc2, acc3 = _gemv_step(
                    x_row0, x_row1, x_row2, x_row3, qw_ptr, sc_ptr, mn_ptr, k0, k_hi, offs_g, offs_n, n_mask,
                    stride_qt, stride_sg, acc0, acc1, acc2, acc3, p0, p1, p2, p3, sc, mn, PIECE, G, BLOCK_M, True,
                    R)
        else:
            pdl_wait(PDL, False)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                acc0, acc1, acc2, acc3 = _gemv_step(
                    x_row0, x_row1, x_row2, x_row3, qw_ptr, sc_ptr, mn_ptr, k0, k_hi, offs_g, offs_n, n_mask,
                    stride_qt, stride_sg, acc0, acc1, acc2, acc3, acc0, acc0, acc0, acc0, acc0, acc0, PIECE, G,
                    BLOCK_M, False, R)
        rows = tl.arange(0, BLOCK_M)[:, None]
        acc = tl.where(rows == 0, tl.sum(acc0, axis=0)[None, :], 0.0)
        if BLOCK_M > 1:
            acc = tl.where(rows == 1, tl.sum(acc1, axis=0)[None, :], acc)
        if BLOCK_M > 2:
            acc = tl.where(rows == 2, tl.sum(acc2, axis=0)[None, :], acc)
        if BLOCK_M > 3:
            acc = tl.where(rows == 3, tl.sum(acc3, axis=0)[None, :], acc)
        acc = acc * _INV_SUM_UNIT
        pdl_release(PDL)  # (every path above has waited)
    else:
        # Tensor-core tiles, one dot per piece: row k of the piece's (PIECE, BLOCK_N) tile reads word k // 8
        # (eight rows share a word, from L1; expanding each word once in registers measured no faster) and
        # keeps nibble k % 8. Codes are exact in any float dtype, so the dot sums exact products; per piece
        # and column,
        #   sum_k x_k (code_k s + m) = s * dot + m * sum_k x_k
        # is applied in float32 (no dequantised weight is ever rounded). For 16-bit x a code is made by one OR:
        # bits 0x4300 | c are the bfloat16 128 + c, 0x6400 | c the float16 1024 + c; the offset's share,
        # OFFSET * s * sum_k x_k, comes off with the mins. One 128-deep tile of codes per group took twice the
        # registers and over three times the shared memory of the pipelined loop that pieces of 32 take (212
        # against 107 registers, 168 KB against 42 KB; sm_90, local compile), so one program per SM. A step of
        # BLOCK_K inputs unrolls BLOCK_K // PIECE pieces; pieces past the split's end load as zeros.
        pdl_wait(PDL, False)
        X_TY: tl.constexpr = x_ptr.dtype.element_ty
        MAGIC: tl.constexpr = 0x4300 if X_TY == tl.bfloat16 else 0x6400
        OFFSET: tl.constexpr = 0.0 if X_TY == tl.float32 else (128.0 if X_TY == tl.bfloat16 else 1024.0)
        offs_kg = tl.arange(0, PIECE)
        shifts = 4 * (offs_kg % 8)
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        g_end = k_hi // PIECE
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for g0 in range(k_lo // PIECE, g_end, BLOCK_K // PIECE):
            for i in tl.static_range(BLOCK_K // PIECE):
                g = g0 + i
                live = tl.full([BLOCK_N], g, tl.int32) < g_end  # (scalar & vector trips the interpreter)
                n_ok = n_mask & live
                packed = tl.load(_word_ptrs(qw_ptr, g * (PIECE // 8) + offs_kg // 8, offs_n, stride_qt),
                                 mask=n_ok[None, :], other=0)
                codes = (packed >> shifts[:, None]) & 0xF
                if X_TY == tl.float32:
                    w_codes = codes.to(tl.float32)
                else:
                    w_codes = (codes | MAGIC).to(tl.int16).to(X_TY, bitcast=True)
                m_ok = m_mask & (tl.full([BLOCK_M], g, tl.int32) < g_end)
                x = tl.load(x_rows + g * PIECE + offs_kg[None, :], mask=m_ok[:, None], other=0.0)
                sc = tl.load(sc_ptr + (g // R) * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
                mn = tl.load(mn_ptr + (g // R) * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
                d = dot(x, w_codes, DOT_PRECISION, DOT_UPCAST)
                x_sum = tl.sum(x.to(tl.float32), axis=1)
                acc += d * sc[None, :]  # two FMAs per element (a sum of the two products would take three)
                acc += x_sum[:, None] * (mn - OFFSET * sc)[None, :]
        pdl_release(PDL)
    mask = m_mask[:, None] & n_mask[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        rows = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + rows, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        tile = pid_m * tl.cdiv(N, BLOCK_N) + pid_n
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + s * M * N + rows, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            # Ready for the next call. A plain store: every split of this tile has counted, so nothing else in this
            # grid touches the counter, and the next grid on the stream sees it (after its PDL wait, if chained). An
            # atomic exchange (acq_rel) cost a fence and a round trip to L2 at the end of every output tile: on an
            # H200, Llama-3.1-8B's down at M=1 took 0.5 us longer that way (docs/perf-log.md).
            tl.store(count_ptr + tile, 0)


_OUTGROWN: list[torch.Tensor] = []
"""Per-device buffers replaced by larger ones. Kept alive: a CUDA graph captured earlier still uses them."""


def _kept_buffer(store: dict, key: object, numel: int, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """``store[key]``, replaced by ``make(numel)`` when missing or smaller than ``numel`` (the old one kept)."""
    buf = store.get(key)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = store[key] = make(numel)
    return buf


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters kept per device; each kernel resets the ones it used."""
    return _kept_buffer(_COUNTERS, device, n,
                        lambda n: torch.zeros(max(n, 4096), dtype=torch.int32, device=device))


@triton.jit
def _dequant_kernel(qw_ptr, sc_ptr, mn_ptr, out_ptr, KW, N, stride_qt, stride_sg, stride_ok,
                    GROUP: tl.constexpr, BLOCK_KW: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[k, n] = code[k, n] * scale + min, rounded once to out's dtype: W transposed, (K, N) (the rows of one
    word's eight inputs are written one after another, each coalesced along N)."""
    offs_kw = tl.program_id(0) * BLOCK_KW + tl.arange(0, BLOCK_KW)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_kw[:, None] < KW) & (offs_n[None, :] < N)
    words = tl.load(_word_ptrs(qw_ptr, offs_kw, offs_n, stride_qt), mask=mask, other=0)
    groups = (offs_kw * 8) // GROUP  # a group is whole words: a word's eight codes share one scale and min
    sc = tl.load(sc_ptr + groups[:, None] * stride_sg + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    mn = tl.load(mn_ptr + groups[:, None] * stride_sg + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    rows = offs_kw.to(tl.int64) * 8
    for j in tl.static_range(8):
        code = ((words >> (4 * j)) & 0xF).to(tl.float32)
        tl.store(out_ptr + (rows + j)[:, None] * stride_ok + offs_n[None, :],
                 (code * sc + mn).to(out_ptr.dtype.element_ty), mask=mask)


_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _scratch(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A per-device matrix buffer of ``dtype``, grown to the largest weight expanded so far (the worker's layers
    run one at a time on one stream)."""
    return _kept_buffer(_SCRATCH, (device, dtype), numel,
                        lambda n: torch.empty(n, dtype=dtype, device=device))


def reserve_scratch(device: torch.device, dtype: torch.dtype, numel: int) -> None:
    """Allocate the scratch matrix for the largest weight now (the worker does, after loading, so that the KV
    cache is sized from what is left)."""
    _scratch(device, dtype, numel)


def dequantize_into(w: W4A16Weight, out: torch.Tensor) -> torch.Tensor:
    """W transposed, (K, N), written into ``out`` (a float tensor of that shape, rows contiguous) in out's dtype."""
    check_weight(w)
    k, n = w.in_features, w.out_features
    assert out.shape == (k, n) and out.stride(1) == 1, f"out must be ({k}, {n}) with contiguous rows"
    check_float("out", out)
    block_kw, block_n = 8, 128
    grid = (triton.cdiv(k // 8, block_kw), triton.cdiv(n, block_n))
    _dequant_kernel[grid](w.qweight, w.scales, w.mins, out, k // 8, n, w.qweight.stride(0), w.scales.stride(0),
                          out.stride(0), GROUP=w.group_size, BLOCK_KW=block_kw, BLOCK_N=block_n, num_warps=4)
    return out



def w4a16_matmul(x: torch.Tensor, w: W4A16Weight, config: W4A16Config | None = None,
                 dequant: bool | None = None) -> torch.Tensor:
    """x: (M, K) float16/bfloat16 (float32 allowed for tests); returns (M, N) in x's dtype.

    ``dequant``: expand W into the scratch matrix and multiply with cuBLAS (weights rounded to x's dtype); None
    does so from :data:`DEQUANT_MIN_ROWS` rows whatever ``config`` says (it configures the 4-bit kernel), and
    for a tile config (the default from 9 rows) whose grid would hold fewer than :data:`TILE_MIN_PROGRAMS`
    programs.

    One launch for the 4-bit kernel (two: expansion and matmul). Calls that split K share per-device arrival
    counters, and the expansion a per-device scratch matrix: issue them on one stream (the worker's), and make
    the first call of a size before capturing a CUDA graph (it allocates those buffers).
    """
    check_weight(w)
    assert x.dim() == 2 and x.shape[1] == w.in_features, f"x {tuple(x.shape)} vs K={w.in_features}"
    check_float("x", x)
    check_last_contiguous("x", x)
    m, k = x.shape
    n = w.out_features
    cfg = config or default_config(m, n, k, w.group_size)
    if dequant is None:
        dequant = expands(m, n, k, cfg)
    if dequant:
        wt = dequantize_into(w, _scratch(x.device, x.dtype, k * n)[: k * n].view(k, n))
        return x @ wt
    assert cfg.gemv or w.group_size >= 16, "tensor-core tiles need groups of >= 16 inputs"
    assert not cfg.gemv or cfg.block_m in (1, 2, 4), f"a GEMV program takes 1, 2 or 4 rows, not {cfg.block_m}"
    # The GEMV's step is a power of two of whole groups (check_weight: a group is whole words); the tiles' whole
    # pieces (:func:`piece`).
    if cfg.gemv:
        assert cfg.block_k % w.group_size == 0, f"block_k {cfg.block_k} is not whole groups of {w.group_size}"
        groups = cfg.block_k // w.group_size
        assert groups & (groups - 1) == 0, (
            f"a GEMV step holds a power-of-two number of groups (block_k {cfg.block_k}, group {w.group_size})")
    else:
        assert cfg.block_k % piece(w.group_size) == 0, (
            f"block_k {cfg.block_k} is not whole pieces of {piece(w.group_size)} (group {w.group_size})")
    k_per_split, split_k = k_split(k, cfg)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    num_m, num_n = triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n)
    grid = (num_m, num_n, split_k) if cfg.gemv else (num_n, num_m, split_k)
    if split_k > 1:
        partials = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
        counters = _arrival_counters(x.device, num_m * num_n)
    else:
        partials = counters = out
    pdl = pdl_args(x)
    # ONE_STEP and SCALES_FIRST are read only by one-row GEMV programs: elsewhere they stay False, so no second
    # compile of the same code.
    one_row = cfg.gemv and cfg.block_m == 1
    one_step = one_row and k_per_split <= cfg.block_k
    _w4a16_kernel[grid](
        x, w.qweight, w.scales, w.mins, out, partials, counters, m, n, k, k_per_split,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), out.stride(0),
        GROUP=w.group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=split_k, GEMV=cfg.gemv, ONE_STEP=one_step, SCALES_FIRST=one_row and cfg.scales_first,
        **dot_args(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )
    return out

