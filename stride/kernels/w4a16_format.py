"""The W4A16 weight format: 4-bit codes with per-group scales and mins, and the conversions into it (GGUF Q4,
round-to-nearest quantisation) and out of it (the float32 reference).

Packed layout (:class:`W4A16Weight`) of a weight W of shape (N, K) (nn.Linear's (out, in)):
    qweight: int32 (ceil(N / 32), K // 8, 32), column tiles of :data:`TILE_N` = 32. Word [t, kk, c] holds the
             codes of column n = 32*t + c for k = 8*kk + j, j = 0..7, in bits 4j..4j+3 (j = 0 in the low
             nibble). Codes are unsigned, 0..15; columns past N (the last tile's padding) hold zeros.
    scales:  (K // group_size, N), float16/bfloat16/float32.
    mins:    (K // group_size, N), same dtype as scales.
    W[n, k] = code[k, n] * scales[k // group_size, n] + mins[k // group_size, n]
Packing along K gives one word per output column per 8 inputs, and a row of a tile (32 columns' words for the
same 8 inputs) is one coalesced 128-byte load. A tile is contiguous: a program of the GEMV, which takes 32 columns
over a K range, reads one contiguous stretch of memory. (Rows of words across all of N, the layout before, left each
program 128-byte pieces N * 4 bytes apart: the GEMV was 4% slower for a Llama-3.1-8B layer on an H200, the short
projections 5-10%, docs/perf-log.md.) GGUF Q4_1 maps directly (scale d, min m); Q4_0 is ``d * (q - 8)``, i.e.
min = -8d. :func:`words_to_tiles` and :func:`tiles_to_words` convert between the tiles and the (K // 8, N) matrix
of words.
group_size is a power of two of at least 8 (whole words; the kernels' tiles are powers of two): GGUF's blocks
are 32 (:func:`from_gguf_q4`); a 16-bit checkpoint quantised at load (:func:`quantize`) takes 128 by default, the
GPTQ/AWQ size (0.53 bytes per weight with fp16 scales and mins, against 0.625 at 32).

The kernels are in :mod:`stride.kernels.w4a16`, their configurations in :mod:`stride.kernels.w4a16_policy`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stride.kernels.common import check_float
from stride.kernels.sizes import cdiv
from stride.kernels.w4a16_policy import is_group_size


@dataclass(frozen=True)
class W4A16Weight:
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    group_size: int

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * 8

    @property
    def out_features(self) -> int:
        return self.scales.shape[1]



TILE_N = 32
"""Columns per tile of the packed words (:class:`W4A16Weight`)."""


def words_to_tiles(words: torch.Tensor) -> torch.Tensor:
    """(K // 8, N) int32 words -> the tiled qweight (ceil(N / 32), K // 8, 32), the last tile padded with zeros."""
    kw, n = words.shape
    tiles = cdiv(n, TILE_N)
    if n % TILE_N:
        words = torch.cat([words, words.new_zeros(kw, tiles * TILE_N - n)], dim=1)
    return words.reshape(kw, tiles, TILE_N).permute(1, 0, 2).contiguous()


def tiles_to_words(qweight: torch.Tensor, n: int) -> torch.Tensor:
    """The tiled qweight -> its (K // 8, N) matrix of words (a copy), N the weight's columns."""
    tiles, kw, _ = qweight.shape
    return qweight.permute(1, 0, 2).reshape(kw, tiles * TILE_N)[:, :n].contiguous()



def narrow(w: W4A16Weight, dim: int, start: int, length: int) -> W4A16Weight:
    """Rows ``[start, start + length)`` of the dense (N, K) weight W (``dim`` 0: output columns of the packed form)
    or its columns (``dim`` 1: inputs, whole groups only), still packed. Column tiles are sliced as they are when the
    range starts on a tile; otherwise the words are re-tiled."""
    if dim == 1:
        g = w.group_size
        if start % g or length % g:
            raise ValueError(f"inputs [{start}, {start + length}) are not whole groups of {g}")
        return W4A16Weight(w.qweight[:, start // 8 : (start + length) // 8].contiguous(),
                           w.scales[start // g : (start + length) // g].contiguous(),
                           w.mins[start // g : (start + length) // g].contiguous(), g)
    assert dim == 0, dim
    scales, mins = (t[:, start : start + length].contiguous() for t in (w.scales, w.mins))
    if start % TILE_N == 0:
        qweight = w.qweight[start // TILE_N : cdiv(start + length, TILE_N)].clone()
        if length % TILE_N:  # columns of the last tile past the range are padding now: zeros, as the format says
            qweight[-1, :, length % TILE_N :] = 0
    else:
        qweight = words_to_tiles(tiles_to_words(w.qweight, w.out_features)[:, start : start + length])
    return W4A16Weight(qweight, scales, mins, w.group_size)


def check_weight(w: W4A16Weight) -> None:
    k, n = w.in_features, w.out_features
    assert w.qweight.dtype == torch.int32 and w.qweight.is_contiguous(), "qweight must be contiguous int32"
    assert w.qweight.dim() == 3 and w.qweight.shape[0] == cdiv(n, TILE_N) and w.qweight.shape[2] == TILE_N, (
        f"qweight must be (ceil(N / {TILE_N}), K // 8, {TILE_N}) for N={n}, got {tuple(w.qweight.shape)}")
    assert is_group_size(w.group_size) and k % w.group_size == 0, f"bad group_size {w.group_size} for K={k}"
    for name, t in (("scales", w.scales), ("mins", w.mins)):
        assert t.shape == (k // w.group_size, n), f"{name} must be (K/group, N), got {tuple(t.shape)}"
        check_float(name, t)
        assert t.is_contiguous(), f"{name} must be contiguous"
    assert w.mins.dtype == w.scales.dtype



def dequantize(w: W4A16Weight) -> torch.Tensor:
    """(N, K) float32 weight."""
    shifts = torch.arange(0, 32, 4, device=w.qweight.device, dtype=torch.int32)
    words = tiles_to_words(w.qweight, w.out_features)
    codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # (K//8, 8, N)
    codes = codes.reshape(w.in_features, w.out_features).float()
    sc = w.scales.float().repeat_interleave(w.group_size, dim=0)
    mn = w.mins.float().repeat_interleave(w.group_size, dim=0)
    return (codes * sc + mn).t().contiguous()


def w4a16_reference(x: torch.Tensor, w: W4A16Weight) -> torch.Tensor:
    """Dequantise to float32, matmul in float32, round once."""
    return (x.float() @ dequantize(w).t()).to(x.dtype)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes: (N, K) integers 0..15 -> qweight int32 (ceil(N / 32), K // 8, 32) in the layout above."""
    n, k = codes.shape
    assert k % 8 == 0
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    words = (codes.to(torch.int64).reshape(n, k // 8, 8) << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as signed int32
    return words_to_tiles(words.to(torch.int32).t())


_GGUF_BLOCK = 32
_GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


def from_gguf_q4(raw: np.ndarray | torch.Tensor, qtype: str, shape: tuple[int, int],
                 scale_dtype: torch.dtype = torch.float16) -> W4A16Weight:
    """Repack GGUF Q4_0/Q4_1 block data of a (N, K) weight without dequantising it.

    raw: the tensor's bytes (uint8, any shape holding N * K/32 blocks, rows of N in order), as gguf's
    reader gives them. A block is fp16 d [, fp16 m for Q4_1], then 16 bytes: byte i's low nibble is
    code i, its high nibble code i + 16. Q4_0: w = d * (code - 8); Q4_1: w = d * code + m.
    """
    assert qtype in _GGUF_BLOCK_BYTES, f"unsupported GGUF type {qtype}"
    n, k = shape
    assert k % _GGUF_BLOCK == 0, f"K={k} is not a multiple of {_GGUF_BLOCK}"
    data = raw.cpu().numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
    bpb = _GGUF_BLOCK_BYTES[qtype]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, k // _GGUF_BLOCK, bpb)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
    if qtype == "Q4_1":
        mins = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[:, :, 4:]
    else:
        mins = -8.0 * d.astype(np.float32)
        qs = blocks[:, :, 2:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, k)
    return W4A16Weight(
        qweight=pack_codes(torch.from_numpy(codes.astype(np.int64))),
        scales=torch.from_numpy(d.astype(np.float32)).t().contiguous().to(scale_dtype),
        mins=torch.from_numpy(mins).t().contiguous().to(scale_dtype),
        group_size=_GGUF_BLOCK,
    )


def quantize(weight: torch.Tensor, group_size: int = 128, scale_dtype: torch.dtype = torch.float16) -> W4A16Weight:
    """A dense (N, K) weight (nn.Linear's (out, in)) quantised to 4 bits: round to nearest, per group of
    ``group_size`` inputs of one output row, asymmetric (the group's minimum is its min, its range over 15 its
    scale, both rounded to ``scale_dtype`` first so the codes are chosen against the values stored). Every weight
    comes back within about half a scale of itself (the top code's clamp adds at most the scale dtype's rounding
    of the min and of 15 scales). A constant group gets scale 0 and its value as the min: exact.

    Runs where ``weight`` is (on the GPU an 8B layer's projections take milliseconds); the result is there too.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be (out, in), got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if not is_group_size(group_size):
        raise ValueError(f"group_size must be a power of two of at least 8, got {group_size}")
    if k % group_size:
        raise ValueError(f"in_features {k} is not a whole number of groups of {group_size}")
    w = weight.float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    mins = lo.to(scale_dtype)
    scales = ((hi - lo) / 15).to(scale_dtype)
    if not (torch.isfinite(mins).all() and torch.isfinite(scales).all()):
        raise ValueError(f"weight values out of {scale_dtype}'s range (or not finite): cannot quantise")
    s, m = scales.float()[..., None], mins.float()[..., None]
    codes = torch.where(s > 0, torch.round((w - m) / torch.where(s > 0, s, 1.0)), 0.0).clamp_(0, 15)
    return W4A16Weight(pack_codes(codes.reshape(n, k).to(torch.uint8)), scales.t().contiguous(),
                       mins.t().contiguous(), group_size)


def random_weight(
    n: int, k: int, group_size: int = 32, device: str | torch.device = "cpu",
    scale_dtype: torch.dtype = torch.float16, seed: int = 0,
) -> W4A16Weight:
    """Random codes, scales and mins with the magnitudes of a real checkpoint (|W| ~ 0.02), made on device."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, device=device)
    scales = torch.rand((k // group_size, n), generator=gen, device=device) * 0.004 + 0.001
    mins = -8 * scales + torch.randn((k // group_size, n), generator=gen, device=device) * 0.001
    return W4A16Weight(pack_codes(codes), scales.to(scale_dtype), mins.to(scale_dtype), group_size)
