"""W4A16 GEMM against dequantise-then-matmul, and GGUF Q4_0/Q4_1 repacking.

On a machine without CUDA these run under TRITON_INTERPRET=1 (set by importing ``kernels``).
"""

import dataclasses

import numpy as np
import pytest
import torch

from stride.kernels import w4a16 as w4
from stride.kernels import w4a16_policy as w4p
from stride.kernels.w4a16 import dequantize_into, w4a16_matmul
from stride.kernels.w4a16_format import (
    W4A16Weight,
    check_weight,
    dequantize,
    from_gguf_q4,
    narrow,
    pack_codes,
    quantize,
    random_weight,
    tiles_to_words,
    w4a16_reference,
    words_to_tiles,
)
from stride.kernels.w4a16_policy import DEQUANT_MIN_ROWS, TILE_MIN_PROGRAMS, W4A16Config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("m,n,k", [(1, 40, 256), (3, 123, 384), (16, 64, 32 * 13)])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("gemv", [False, True])
def test_w4a16_matches_dequantised_matmul(dtype, tol, m, n, k, split_k, gemv):
    if gemv and m > 3:
        pytest.skip("the GEMV path serves decode rows; one program per row is slow under the interpreter")
    gen = torch.Generator().manual_seed(m * n + k)
    w = random_weight(n, k, device=DEVICE, seed=m * n + k)
    x = torch.randn((m, k), generator=gen).to(dtype).to(DEVICE)
    cfg = W4A16Config(block_m=1 if gemv else 16, block_n=32, block_k=64, split_k=split_k, gemv=gemv)
    out = w4a16_matmul(x, w, cfg, dequant=False)  # the kernel itself (so small a tile grid would expand W)
    ref = w4a16_reference(x, w)
    assert out.dtype == dtype and out.shape == (m, n)
    assert _rel_err(out, ref) <= tol
    # Negative control: the same codes without their scales are a different matrix.
    unscaled = W4A16Weight(w.qweight, torch.ones_like(w.scales), w.mins, w.group_size)
    assert _rel_err(out, w4a16_reference(x, unscaled)) > 0.1


@pytest.mark.parametrize("block_k,split_k", [(512, 1), (128, 1), (128, 2), (256, 2)])
def test_one_row_gemv_paths(block_k, split_k):
    """One row per program loads each K step's weights ahead of its arithmetic: in one step (the whole K range of a
    program, block_k >= K), in a loop of steps, K split with a ragged last split; scales and mins before or after
    the words. Every path against the reference; the order of the loads changes no bit; group 128 (four 32-input
    pieces per scale) and a ragged last column tile. Negative control: mins read as scales."""
    n, k = 40, 384
    w = random_weight(n, k, group_size=128, device=DEVICE, seed=block_k + split_k)
    x = torch.randn((1, k), generator=torch.Generator().manual_seed(split_k)).to(torch.bfloat16).to(DEVICE)
    cfg = W4A16Config(block_m=1, block_n=32, block_k=block_k, split_k=split_k, gemv=True)
    out = w4a16_matmul(x, w, cfg)
    assert _rel_err(out, w4a16_reference(x, w)) <= 1e-2
    assert torch.equal(w4a16_matmul(x, w, dataclasses.replace(cfg, scales_first=True)), out)
    swapped = W4A16Weight(w.qweight, w.mins, w.scales, w.group_size)
    assert _rel_err(w4a16_matmul(x, swapped, dataclasses.replace(cfg, scales_first=True)), out) > 0.1


@pytest.mark.parametrize("gemv", [True, False])
def test_split_k_leaves_counters_zeroed(gemv):
    """Split K sums its partials through per-tile arrival counters, which the last split of each tile resets (a
    plain store): after calls of several sizes (the 4-bit kernel, ``dequant=False``) every counter is zero again
    and repeated calls give the same bits. Negative control: a counter left over from a missed reset is one that
    no split sees as last, so that tile is not summed and its counter stays nonzero, which the check would catch."""
    w = random_weight(80, 384, device=DEVICE, seed=7)
    x = torch.randn((3, 384), generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).to(DEVICE)
    cfg = W4A16Config(block_m=1 if gemv else 16, block_n=32, block_k=64, split_k=3, gemv=gemv)  # 3 x 128 inputs
    first = w4a16_matmul(x, w, cfg, dequant=False)
    assert _rel_err(first, w4a16_reference(x, w)) <= 1e-2
    for rows in (1, 2):  # fewer rows, then all of them again below
        assert torch.equal(w4a16_matmul(x[:rows], w, cfg, dequant=False), first[:rows])
    counters = w4._COUNTERS[x.device]
    assert not counters.any()
    counters[1] = 3  # tile 1: columns 32-63 of the first row block
    try:
        w4a16_matmul(x, w, cfg, dequant=False)
        assert counters[1].item() == 6 and not counters[:1].any() and not counters[2:].any()
    finally:
        counters.zero_()
    assert torch.equal(w4a16_matmul(x, w, cfg, dequant=False), first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_m", [2, 4])
@pytest.mark.parametrize("m,split_k", [(3, 1), (5, 3)])
def test_gemv_rows_per_program(dtype, block_m, m, split_k):
    """Several rows per GEMV program share each code: every row, including a last block's clamped rows (never
    stored), equals its own single-row result; a row swapped with another is caught."""
    n, k = 40, 32 * 7
    w = random_weight(n, k, device=DEVICE, seed=m)
    gen = torch.Generator().manual_seed(m + block_m)
    x = (torch.randn((m, k), generator=gen) * torch.logspace(-2, 2, m)[:, None]).to(dtype).to(DEVICE)
    cfg = W4A16Config(block_m=block_m, block_n=32, block_k=128, split_k=split_k, gemv=True)
    out = w4a16_matmul(x, w, cfg)
    one = torch.cat([w4a16_matmul(x[i:i + 1], w, dataclasses.replace(cfg, block_m=1)) for i in range(m)])
    assert out.shape == (m, n)
    assert torch.equal(out, one)
    ref = w4a16_reference(x, w)
    for i in range(m):  # per row: the rows' magnitudes span 1e-2 .. 1e2
        assert _rel_err(out[i], ref[i]) <= (1e-5 if dtype == torch.float32 else 8e-3)
    # Negative control: rows 0 and 1 exchanged are far from their results.
    assert _rel_err(out[1], ref[0]) > 0.1 and _rel_err(out[0], ref[1]) > 0.1


def test_gemv_rows_per_program_by_grid_size():
    """Up to 8 rows, a weight of fewer than 128 column tiles (SmolLM2-135M's projections) takes a program per row in
    one K step (under PDL its weights load before the wait); Llama-3.1-8B's keep four rows per program."""
    for m in (1, 2, 3, 4, 8):
        for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
            cfg = w4p.default_config(m, n, k, 32)
            assert cfg.gemv and cfg.block_m == 1 and cfg.block_k >= k and cfg.split_k == 1, (m, n, k, cfg)
    for m in (3, 4, 8):  # the control: 128 or more column tiles
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
            assert w4p.default_config(m, n, k, 128).block_m == 4, (m, n, k)
    assert w4p.default_config(4, 576, 8192, 32).block_m == 4  # K past one 4,096-input step


@pytest.mark.parametrize("m,block_m,split_k", [(20, 64, 1), (70, 64, 3), (70, 128, 2)])
def test_tall_tiles(m, block_m, split_k):
    """Row blocks of 64 and 128 (batched decode from 17 rows): a partial last row block, ragged columns and a
    ragged K split; every row against the reference, and a negative control with two rows exchanged."""
    n, k = 72, 32 * 13
    w = random_weight(n, k, device=DEVICE, seed=m + block_m)
    gen = torch.Generator().manual_seed(m)
    x = (torch.randn((m, k), generator=gen) * torch.logspace(-2, 2, m)[:, None]).to(torch.bfloat16).to(DEVICE)
    cfg = W4A16Config(block_m=block_m, block_n=64, block_k=32, split_k=split_k, num_warps=4)
    out = w4a16_matmul(x, w, cfg, dequant=False)
    ref = w4a16_reference(x, w)
    assert out.shape == (m, n)
    for i in range(m):
        assert _rel_err(out[i], ref[i]) <= 8e-3
    assert _rel_err(out[m - 1], ref[m - 2]) > 0.1 and _rel_err(out[m - 2], ref[m - 1]) > 0.1


def test_batched_rows_default_paths():
    """40 rows: by default W is expanded into the scratch matrix and multiplied there (weights rounded to bf16);
    with the 4-bit kernel forced, the launcher's default 64-row tiles (codes exact, so closer)."""
    n, k = 96, 32 * 9
    w = random_weight(n, k, device=DEVICE, seed=40)
    x = torch.randn((40, k), generator=torch.Generator().manual_seed(40)).to(torch.bfloat16).to(DEVICE)
    ref = w4a16_reference(x, w)
    assert 40 >= DEQUANT_MIN_ROWS
    expanded, tiles = w4a16_matmul(x, w), w4a16_matmul(x, w, dequant=False)
    assert torch.equal(expanded, x @ dequantize_into(w, torch.empty(k, n, dtype=torch.bfloat16, device=DEVICE)))
    assert _rel_err(expanded, ref) <= 8e-3 and _rel_err(tiles, ref) <= 8e-3


def test_small_tile_grid_expands(monkeypatch):
    """16 rows (past the GEMV, below DEQUANT_MIN_ROWS): a weight whose tile grid holds fewer than
    TILE_MIN_PROGRAMS programs is expanded; one whose grid fills the GPU runs on the 4-bit tiles, codes exact.
    Both agree with the reference."""
    expanded = []
    real = w4.dequantize_into
    monkeypatch.setattr(w4, "dequantize_into", lambda w, out: expanded.append(w) or real(w, out))
    x = torch.randn((16, 32), generator=torch.Generator().manual_seed(16)).to(torch.bfloat16).to(DEVICE)
    small, wide = random_weight(96, 32, device=DEVICE, seed=3), random_weight(16 * TILE_MIN_PROGRAMS, 32, device=DEVICE)
    narrow_tiles = W4A16Config(block_m=16, block_n=16, block_k=32)  # one program per 16 columns
    assert w4p.tile_programs(16, 96, 32, narrow_tiles) == 6
    assert w4p.tile_programs(16, 16 * TILE_MIN_PROGRAMS, 32, narrow_tiles) == TILE_MIN_PROGRAMS
    out_small = w4a16_matmul(x, small, narrow_tiles)
    assert expanded == [small]
    out_wide = w4a16_matmul(x, wide, narrow_tiles)
    assert expanded == [small]  # the tiles, not the expansion
    assert _rel_err(out_small, w4a16_reference(x, small)) <= 8e-3
    assert _rel_err(out_wide, w4a16_reference(x, wide)) <= 8e-3
    w4a16_matmul(x[:8], small)  # 8 rows: the GEMV, exact codes, whatever its grid
    assert expanded == [small]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_into_scratch(dtype):
    """The expansion kernel writes W transposed, each weight rounded once to the output dtype (float32: exact;
    16-bit: within one unit in the last place, as Triton's interpreter rounds toward zero, the GPU to nearest);
    the scratch grows for a larger weight and smaller ones use its start. Negative control: a weight whose
    scales are all one expands to something else."""
    small, large = random_weight(72, 96, device=DEVICE, seed=1), random_weight(200, 64 * 5, device=DEVICE, seed=2)
    for w in (small, large, small):
        out = dequantize_into(w, torch.empty(w.in_features, w.out_features, dtype=dtype, device=DEVICE))
        want = dequantize(w).t()
        if dtype == torch.float32:
            assert torch.equal(out, want)
        else:
            assert ((out.float() - want).abs() <= want.abs() * torch.finfo(dtype).eps + 2.0**-24).all()
        x = torch.randn(20, w.in_features).to(dtype).to(DEVICE)
        assert torch.equal(w4a16_matmul(x, w, dequant=True), x @ out)
    unscaled = W4A16Weight(small.qweight, torch.ones_like(small.scales), small.mins, small.group_size)
    other = dequantize_into(unscaled, torch.empty(96, 72, dtype=dtype, device=DEVICE))
    assert not torch.allclose(other, dequantize(small).t().to(dtype), atol=1e-2)


def test_gemv_rows_per_program_refused():
    w = random_weight(32, 64, device=DEVICE)
    with pytest.raises(AssertionError, match="1, 2 or 4 rows"):
        w4a16_matmul(torch.randn(3, 64).to(DEVICE), w, W4A16Config(block_m=3, block_n=32, block_k=64, gemv=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1e-20, 1e-6, 1.0, 3e4, 1e8])
@pytest.mark.parametrize("block_m", [1, 2])
def test_gemv_subnormal_codes_over_activation_range(magnitude, dtype, block_m):
    """The GEMV reads codes as subnormal floats and prescales x by up to 2^96: float32-exact products for
    2^-73 <= |x| < 2^31 (1e-22 .. 2e9); rows mixing tiny and huge activations too."""
    w = random_weight(48, 512, device=DEVICE, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn((2, 512), generator=gen) * magnitude).to(dtype).to(DEVICE)
    x[1, ::7] *= 1e-9  # a second row mixing scales
    x[1, 3::7] = 0.0
    cfg = W4A16Config(block_m=block_m, block_n=16, block_k=128, split_k=2, gemv=True)
    out = w4a16_matmul(x, w, cfg)
    assert torch.isfinite(out).all()
    # bf16 output: one rounding (the interpreter truncates: up to 2^-8 per element).
    assert _rel_err(out, w4a16_reference(x, w)) <= (1e-5 if dtype == torch.float32 else 8e-3)


def test_pack_codes_layout():
    codes = torch.randint(0, 16, (35, 16), generator=torch.Generator().manual_seed(1))
    packed = pack_codes(codes)
    # Two tiles of 32 columns (the second holds columns 32-34 and zeros), each (K // 8, 32) words.
    assert packed.shape == (2, 2, 32) and packed.dtype == torch.int32 and packed.is_contiguous()
    word = packed[1, 1, 2].item() & 0xFFFFFFFF  # column 34, inputs 8-15
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == codes[34, 8:16].tolist()
    word = packed[0, 0, 5].item() & 0xFFFFFFFF  # column 5, inputs 0-7
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == codes[5, 0:8].tolist()
    assert not packed[1, :, 3:].any()
    w = W4A16Weight(packed, torch.ones(1, 35, dtype=torch.float16), torch.zeros(1, 35, dtype=torch.float16), 16)
    torch.testing.assert_close(dequantize(w), codes.float())
    words = tiles_to_words(packed, 35)
    assert words.shape == (2, 35) and torch.equal(words_to_tiles(words), packed)
    assert (words[1, 34].item() & 0xFFFFFFFF) == (packed[1, 1, 2].item() & 0xFFFFFFFF)


def _gguf_blocks_by_spec(w: np.ndarray, qtype: str) -> np.ndarray:
    """Quantise like ggml's reference (round-to-nearest) and lay the bytes out per the GGUF block spec."""
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32).astype(np.float32)
    out = []
    for row in blocks.reshape(-1, 32):
        if qtype == "Q4_0":
            amax = row[np.argmax(np.abs(row))]
            d = np.float16(amax / -8)
            scaled = np.round(row / np.float32(d) + 8) if d else np.full(32, 8)
            codes = np.clip(scaled, 0, 15).astype(np.uint8)
            head = np.array([d], dtype=np.float16).view(np.uint8)
        else:
            lo, hi = row.min(), row.max()
            d = np.float16((hi - lo) / 15)
            scaled = np.round((row - lo) / np.float32(d)) if d else np.zeros(32)
            codes = np.clip(scaled, 0, 15).astype(np.uint8)
            head = np.array([d, np.float16(lo)], dtype=np.float16).view(np.uint8)
        qs = codes[:16] | (codes[16:] << 4)
        out.append(np.concatenate([head, qs]))
    return np.stack(out).reshape(n, -1)


def _dequant_by_spec(raw: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    bpb = 18 if qtype == "Q4_0" else 20
    blocks = raw.reshape(n * k // 32, bpb)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, bpb - 16:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)
    if qtype == "Q4_0":
        vals = d * (codes - 8)
    else:
        vals = d * codes + blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return vals.reshape(n, k)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_from_gguf_q4_matches_block_spec(qtype):
    rng = np.random.default_rng(0)
    n, k = 7, 96
    raw = _gguf_blocks_by_spec(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)
    w = from_gguf_q4(raw, qtype, (n, k))
    np.testing.assert_array_equal(dequantize(w).numpy(), _dequant_by_spec(raw, qtype, n, k))
    # Negative control: reading Q4_1 bytes as Q4_0 (or the reverse) cannot work.
    other = "Q4_1" if qtype == "Q4_0" else "Q4_0"
    with pytest.raises(ValueError):
        from_gguf_q4(raw, other, (n, k))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_from_gguf_q4_matches_gguf_package_and_kernel(qtype):
    gguf = pytest.importorskip("gguf")
    gtype = getattr(gguf.GGMLQuantizationType, qtype)
    w_f32 = np.random.default_rng(1).standard_normal((48, 256)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(w_f32, gtype)
    w = from_gguf_q4(raw, qtype, (48, 256))
    np.testing.assert_array_equal(dequantize(w).numpy(), gguf.quants.dequantize(raw, gtype))
    w = W4A16Weight(w.qweight.to(DEVICE), w.scales.to(DEVICE), w.mins.to(DEVICE), w.group_size)
    x = torch.randn(3, 256).to(DEVICE)
    ref = x @ torch.from_numpy(gguf.quants.dequantize(raw, gtype)).to(DEVICE).t()
    assert _rel_err(w4a16_matmul(x, w, W4A16Config(block_n=32, block_k=128), dequant=False), ref) <= 1e-5


def test_w4a16_launcher_rejects_bad_inputs():
    w = random_weight(32, 64, device=DEVICE)
    with pytest.raises(AssertionError):
        w4a16_matmul(torch.randn(2, 63, device=DEVICE), w)
    with pytest.raises(AssertionError):
        w4a16_matmul(torch.randn(2, 64, device=DEVICE),
                     W4A16Weight(w.qweight, w.scales[:1], w.mins[:1], w.group_size))


@pytest.mark.parametrize("m,gemv,block_k,split_k",
                         [(1, True, 256, 1), (2, True, 128, 3), (5, False, 128, 2), (5, False, 32, 3)])
def test_group_128(m, gemv, block_k, split_k):
    # --quantize w4a16's groups, worked as four pieces of 32 inputs sharing a scale and min; in the tiles a step
    # of 32 and three splits cut groups in the middle (splits of 224 inputs).
    n, k = 72, 128 * 5
    gen = torch.Generator().manual_seed(128)
    w = random_weight(n, k, group_size=128, device=DEVICE, seed=3)
    x = torch.randn((m, k), generator=gen).to(DEVICE)
    cfg = W4A16Config(block_m=min(m, 2) if gemv else 16, block_n=32, block_k=block_k, split_k=split_k, gemv=gemv)
    ref = w4a16_reference(x, w)
    assert _rel_err(w4a16_matmul(x, w, cfg, dequant=False), ref) <= 1e-5  # (a small grid would expand W)
    assert _rel_err(w4a16_matmul(x, w), ref) <= 1e-5  # the launcher's default for group 128
    # Negative control: the scales read as if the groups were 32 inputs (the first quarter of the rows of a
    # 4x taller scale table holding each scale once) is a different matrix.
    as32 = W4A16Weight(w.qweight, w.scales.repeat_interleave(4, 0), w.mins.repeat_interleave(4, 0), 32)
    cfg32 = dataclasses.replace(cfg, block_k=max(block_k, 64))
    assert _rel_err(w4a16_matmul(x, as32, cfg32, dequant=False), ref) <= 1e-5
    shuffled = W4A16Weight(w.qweight, w.scales.repeat(4, 1), w.mins.repeat(4, 1), 32)
    assert _rel_err(w4a16_matmul(x, shuffled, cfg32, dequant=False), ref) > 0.05


def _scale_units(w: torch.Tensor, q: W4A16Weight) -> torch.Tensor:
    """|w - dequantised| per weight, in units of its group's scale (groups of one value: 0)."""
    scale = q.scales.float().t().repeat_interleave(q.group_size, dim=1)
    err = (w.float() - dequantize(q)).abs()
    return torch.where(scale > 0, err / torch.where(scale > 0, scale, 1.0), err)


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_quantize_rounds_to_nearest(group, scale_dtype, monkeypatch):
    gen = torch.Generator().manual_seed(group)
    w = torch.randn((48, 4 * group), generator=gen) * 0.02
    w[5, 7] = 0.4  # an outlier widens its group's range only
    q = quantize(w.to(torch.bfloat16), group, scale_dtype)
    assert (q.qweight.shape, q.scales.shape, q.group_size) == ((2, w.shape[1] // 8, 32), (4, 48), group)
    assert q.scales.dtype == q.mins.dtype == scale_dtype
    units = _scale_units(w.to(torch.bfloat16), q)
    # Half a step, plus the clamp at the top code after the scale and min were rounded to their dtype.
    assert units.max() <= 0.52, units.max()
    assert units.max() >= 0.45  # random weights reach the half-step bound: the measure is not vacuous
    # The outlier widens its own group only (a range of ~0.45 against ~0.08).
    assert q.scales[0, 5] > 4 * q.scales[1:, 5].float().max()
    # Negative control: truncating instead of rounding is off by up to a whole step.
    monkeypatch.setattr(torch, "round", torch.floor)
    assert _scale_units(w.to(torch.bfloat16), quantize(w.to(torch.bfloat16), group, scale_dtype)).max() > 0.9


def test_quantize_recovers_exact_codes():
    # A weight that is exactly codes * scale + min, every group using codes 0 and 15, quantises back to the same
    # codes, scales and mins.
    gen = torch.Generator().manual_seed(11)
    n, k, group = 24, 256, 128
    codes = torch.randint(0, 16, (n, k), generator=gen)
    codes[:, ::group] = 0
    codes[:, 1::group] = 15
    scales = (torch.rand((k // group, n), generator=gen) * 0.004 + 0.001).half()
    mins = (-8 * scales.float() + torch.randn((k // group, n), generator=gen) * 0.001).half()
    want = W4A16Weight(pack_codes(codes), scales, mins, group)
    q = quantize(dequantize(want), group, torch.float16)
    assert torch.equal(q.scales, scales) and torch.equal(q.mins, mins)
    assert torch.equal(q.qweight, want.qweight)
    assert torch.equal(dequantize(q), dequantize(want))


def test_quantize_edge_cases():
    w = torch.full((8, 64), 0.25)
    w[1] = 0.0
    q = quantize(w, 32)
    assert torch.equal(dequantize(q), w) and not q.scales.any()  # constant groups: exact, scale 0
    with pytest.raises(ValueError, match="groups of 128"):
        quantize(torch.zeros(8, 96), 128)
    for group in (12, 24, 4):  # 24 divides 96 and is whole words, but no power of two
        with pytest.raises(ValueError, match="power of two"):
            quantize(torch.zeros(8, 96), group)
    bad = torch.zeros(8, 64)
    bad[2, 3] = float("inf")
    with pytest.raises(ValueError, match="range"):
        quantize(bad, 32)
    with pytest.raises(ValueError, match="range"):
        quantize(torch.full((8, 64), 1e6), 32)  # beyond float16's mins
    assert torch.isfinite(quantize(torch.full((8, 64), 1e6), 32, torch.float32).mins).all()


@pytest.mark.parametrize("dim,start,length", [(0, 32, 64), (0, 0, 40), (0, 8, 50), (1, 64, 128), (1, 0, 32)])
def test_narrow_is_the_slice_of_the_dense_weight(dim, start, length):
    """A packed weight's rows (on a tile, ending inside one; off tiles) or inputs (whole groups), still packed:
    a valid weight, the slice of the dense one, its last tile's padding zero."""
    w = random_weight(123, 256, scale_dtype=torch.float32, seed=4)
    part = narrow(w, dim, start, length)
    check_weight(part)
    assert torch.equal(dequantize(part), dequantize(w).narrow(dim, start, length))
    pad = part.out_features % 32
    if pad:
        assert not part.qweight[-1, :, pad:].any()
    # Negative control: the same rows one tile on are another weight.
    if dim == 0 and start + length + 32 <= 123:
        assert not torch.equal(dequantize(narrow(w, 0, start + 32, length)), dequantize(part))
    with pytest.raises(ValueError, match="whole groups"):
        narrow(w, 1, 16, 32)
