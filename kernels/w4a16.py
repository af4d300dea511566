"""W4A16 GEMM: ``y = x @ W.T`` with 4-bit weights, per-group scales and mins, 16-bit activations.

Packed layout (:class:`W4A16Weight`) of a weight W of shape (N, K) (nn.Linear's (out, in)):
    qweight: int32 (K // 8, N). Word [kk, n] holds W's codes for k = 8*kk + j, j = 0..7, in bits
             4j..4j+3 (j = 0 in the low nibble). Codes are unsigned, 0..15.
    scales:  (K // group_size, N), float16/bfloat16/float32.
    mins:    (K // group_size, N), same dtype as scales.
    W[n, k] = code[k, n] * scales[k // group_size, n] + mins[k // group_size, n]
Packing along K keeps a load of one row of words coalesced along N, and one word per output
column per 8 inputs. GGUF Q4_1 maps directly (scale d, min m); Q4_0 is ``d * (q - 8)``, i.e. min = -8d.
group_size must be a multiple of 8 (GGUF uses 32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kernels._util import check_float, check_last_contiguous, dot, dot_args


@dataclass(frozen=True)
class W4A16Weight:
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    group_size: int

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * 8

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]


@dataclass(frozen=True)
class W4A16Config:
    """block_k covers 8 * (block_k // 8) inputs per step; split_k > 1 reduces through float32 atomics."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def default_config(m: int, n: int, k: int) -> W4A16Config:
    # Decode shapes have few output tiles: split K until an H200's 132 SMs have a few programs each.
    block_n = 64
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, 16)
    split_k = 1
    while tiles * split_k < 264 and k // (split_k * 2) >= 512:
        split_k *= 2
    return W4A16Config(block_m=16, block_n=block_n, block_k=256, split_k=split_k, num_warps=4, num_stages=3)


@triton.jit
def _w4a16_kernel(
    x_ptr, qw_ptr, sc_ptr, mn_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_qk, stride_sg, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    WORDS: tl.constexpr = BLOCK_K // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, WORDS)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        words = k0 // 8 + offs_w
        w_mask = (words[:, None] < k_hi // 8) & n_mask[None, :]
        packed = tl.load(qw_ptr + words[:, None].to(tl.int64) * stride_qk + offs_n[None, :],
                         mask=w_mask, other=0)
        # All 8 codes of a word share a group because GROUP is a multiple of 8.
        g = (words * 8) // GROUP
        sc = tl.load(sc_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=w_mask, other=0.0).to(tl.float32)
        mn = tl.load(mn_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=w_mask, other=0.0).to(tl.float32)
        # Nibble j of every word is a (WORDS, BLOCK_N) slab of inputs 8*kk + j: a dot per nibble, no reshape.
        for j in tl.static_range(8):
            codes = ((packed >> (4 * j)) & 0xF).to(tl.float32)
            ks = words * 8 + j
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :],
                        mask=m_mask[:, None] & (ks[None, :] < k_hi), other=0.0)
            w = (codes * sc + mn).to(x.dtype)
            acc += dot(x, w, DOT_PRECISION, DOT_UPCAST)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def check_weight(w: W4A16Weight) -> None:
    k, n = w.in_features, w.out_features
    assert w.qweight.dtype == torch.int32 and w.qweight.is_contiguous(), "qweight must be contiguous int32"
    assert w.group_size % 8 == 0 and k % w.group_size == 0, f"bad group_size {w.group_size} for K={k}"
    for name, t in (("scales", w.scales), ("mins", w.mins)):
        assert t.shape == (k // w.group_size, n), f"{name} must be (K/group, N), got {tuple(t.shape)}"
        check_float(name, t)
        assert t.is_contiguous(), f"{name} must be contiguous"
    assert w.mins.dtype == w.scales.dtype


def workspace_bytes(m: int, n: int, cfg: W4A16Config) -> int:
    return m * n * 4 if cfg.split_k > 1 else 0


def w4a16_matmul(x: torch.Tensor, w: W4A16Weight, config: W4A16Config | None = None) -> torch.Tensor:
    """x: (M, K) float16/bfloat16 (float32 allowed for tests); returns (M, N) in x's dtype."""
    check_weight(w)
    assert x.dim() == 2 and x.shape[1] == w.in_features, f"x {tuple(x.shape)} vs K={w.in_features}"
    check_float("x", x)
    check_last_contiguous("x", x)
    m, k = x.shape
    n = w.out_features
    cfg = config or default_config(m, n, k)
    assert cfg.block_k % 128 == 0, "block_k must be a multiple of 128 (each nibble dot needs K >= 16)"
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)
    if split_k > 1:
        out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), split_k, triton.cdiv(m, cfg.block_m))
    _w4a16_kernel[grid](
        x, w.qweight, w.scales, w.mins, out, m, n, k, k_per_split,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), out.stride(0),
        GROUP=w.group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        ATOMIC=split_k > 1, **dot_args(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out.to(x.dtype) if split_k > 1 else out


def dequantize(w: W4A16Weight) -> torch.Tensor:
    """(N, K) float32 weight."""
    shifts = torch.arange(0, 32, 4, device=w.qweight.device, dtype=torch.int32)
    codes = (w.qweight[:, None, :] >> shifts[None, :, None]) & 0xF  # (K//8, 8, N)
    codes = codes.reshape(w.in_features, w.out_features).float()
    sc = w.scales.float().repeat_interleave(w.group_size, dim=0)
    mn = w.mins.float().repeat_interleave(w.group_size, dim=0)
    return (codes * sc + mn).t().contiguous()


def w4a16_reference(x: torch.Tensor, w: W4A16Weight) -> torch.Tensor:
    """Dequantise to float32, matmul in float32, round once."""
    return (x.float() @ dequantize(w).t()).to(x.dtype)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes: (N, K) integers 0..15 -> qweight int32 (K // 8, N) in the layout above."""
    n, k = codes.shape
    assert k % 8 == 0
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    words = (codes.to(torch.int64).reshape(n, k // 8, 8) << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as signed int32
    return words.to(torch.int32).t().contiguous()


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
