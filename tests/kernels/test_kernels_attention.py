"""Paged decode and extend attention kernels against the PyTorch reference, over shuffled blocks.

On a machine without CUDA these run under TRITON_INTERPRET=1 (set by importing ``kernels``).
"""

import pytest
import torch

from stride.kernels import paged_common
from stride.kernels.autotune import compare
from stride.kernels.autotune_specs import make_paged_problem
from stride.kernels.common import interpreting
from stride.kernels.paged_decode import DecodeConfig, paged_decode, paged_decode_reference
from stride.kernels.paged_extend import ExtendConfig, paged_extend, paged_extend_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _problem(context_lens, query_lens, heads=6, kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32,
             seed=0):
    gen = torch.Generator().manual_seed(seed)
    return make_paged_problem(context_lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, gen,
                              DEVICE)


def _decode(p, cfg):
    return paged_decode(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["context_lens"], p["scale"],
                        config=cfg)


def _extend(p, cfg=None, max_query_len=None):
    return paged_extend(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["cu_query_lens"],
                        p["context_lens"], p["scale"], max_query_len=max_query_len, config=cfg)


def _max_err(out, ref):
    return (out.double() - ref.double()).abs().max().item()


DECODE_CONFIGS = [DecodeConfig(block_n=16, partition=0), DecodeConfig(block_n=32, partition=64),
                  DecodeConfig(block_n=16, partition=32), DecodeConfig(block_n=128, partition=0, num_stages=3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", DECODE_CONFIGS, ids=["nosplit", "split64", "split32", "long"])
def test_decode_matches_reference(dtype, cfg):
    # Ragged lengths: 1, one short of / one past a block, odd, and one long enough to split several times.
    p = _problem([1, 15, 17, 123, 5, 200], [1] * 6, dtype=dtype, seed=cfg.partition)
    ref = paged_decode_reference(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["context_lens"],
                                 p["scale"])
    assert _max_err(_decode(p, cfg), ref) <= TOL[dtype]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 4, 16, 8), (8, 1, 64, 16), (5, 5, 24, 4)])
def test_decode_head_layouts(heads, kv_heads, head_dim, block_size):
    # MHA, MQA, and a head_dim that is not a power of two.
    p = _problem([3, 37, 9], [1, 1, 1], heads, kv_heads, head_dim, block_size, seed=heads)
    ref = paged_decode_reference(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["context_lens"],
                                 p["scale"])
    assert _max_err(_decode(p, DecodeConfig(block_n=16, partition=16)), ref) <= 1e-5


def test_decode_reference_equals_dense_attention_and_catches_wrong_table():
    p = _problem([40, 7], [1, 1], seed=3)
    k_cache, v_cache, bt = p["k_cache"], p["v_cache"], p["block_tables"]
    ref = paged_decode_reference(p["q"], k_cache, v_cache, bt, p["context_lens"], p["scale"])
    for s, n in enumerate([40, 7]):
        blocks = bt[s, : -(-n // 16)].long()
        k = k_cache[blocks].reshape(-1, 2, 32)[:n].repeat_interleave(3, dim=1)
        v = v_cache[blocks].reshape(-1, 2, 32)[:n].repeat_interleave(3, dim=1)
        dense = torch.softmax(torch.einsum("hd,khd->hk", p["q"][s], k) * p["scale"], -1)
        torch.testing.assert_close(ref[s], torch.einsum("hk,khd->hd", dense, v), atol=1e-5, rtol=1e-5)
    out = _decode(p, None)
    assert compare(out, ref).ok
    # Negative control: pointing one entry at another sequence's block changes the result (a swap of two
    # full blocks would not: decode attention does not depend on key order).
    swapped = bt.clone()
    swapped[0, 0] = bt[1, 0]
    assert not compare(out, paged_decode_reference(p["q"], k_cache, v_cache, swapped, p["context_lens"],
                                                   p["scale"])).ok


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_matches_reference_variable_lengths(dtype):
    # Prefill from scratch (query_len == context_len), extends onto cached prefixes, and a decode row.
    context_lens, query_lens = [5, 40, 123, 1, 33], [5, 17, 50, 1, 1]
    p = _problem(context_lens, query_lens, dtype=dtype, seed=7)
    ref = paged_extend_reference(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["cu_query_lens"],
                                 p["context_lens"], p["scale"])
    out = _extend(p, ExtendConfig(block_m=16, block_n=32), max_query_len=50)
    assert _max_err(out, ref) <= TOL[dtype]


def _keys_inner(cache: torch.Tensor) -> torch.Tensor:
    """``cache``'s values stored keys-inner (the worker's 8-bit V layout, ``stride/workers/kv_cache.py``)."""
    out = paged_common.keys_inner_copy(cache)
    assert paged_common.is_keys_inner(out) and not paged_common.is_keys_inner(cache)
    torch.testing.assert_close(out.float(), cache.float(), rtol=0, atol=0, equal_nan=True)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v_layout,block_size", [("head_dim", 16), ("keys_inner", 16), ("keys_inner", 4),
                                                 ("keys_inner", 64)])
def test_kernels_attend_over_fp8_caches(dtype, v_layout, block_size):
    """float8_e4m3fn caches (``--kv-dtype fp8``): decode (split and not) and extend widen each value exactly and
    agree with the reference over the same 8-bit caches, to the 16-bit caches' tolerance; with V head_dim-contiguous
    or keys-inner (the worker's layout for it), whose tiles hold several pages (blocks of 4 and 16) or part of one
    (64)."""
    lay = _keys_inner if v_layout == "keys_inner" else (lambda c: c)
    p = _problem([1, 15, 17, 123, 5, 200], [1, 1, 1, 40, 1, 3], dtype=dtype, seed=3, block_size=block_size)
    k8, v8 = p["k_cache"].to(paged_common.FP8_CACHE), lay(p["v_cache"].to(paged_common.FP8_CACHE))
    ref = paged_extend_reference(p["q"], k8, v8, p["block_tables"], p["cu_query_lens"], p["context_lens"], p["scale"])
    for ecfg in (ExtendConfig(block_m=16, block_n=32), ExtendConfig(block_m=16, block_n=16)):
        out = paged_extend(p["q"], k8, v8, p["block_tables"], p["cu_query_lens"], p["context_lens"], p["scale"],
                           max_query_len=40, config=ecfg)
        assert _max_err(out, ref) <= TOL[dtype]
    d = _problem([1, 15, 17, 123, 5, 200], [1] * 6, dtype=dtype, seed=4, block_size=block_size)
    k8, v8 = d["k_cache"].to(paged_common.FP8_CACHE), lay(d["v_cache"].to(paged_common.FP8_CACHE))
    ref = paged_decode_reference(d["q"], k8, v8, d["block_tables"], d["context_lens"], d["scale"])
    for cfg in DECODE_CONFIGS:
        out = paged_decode(d["q"], k8, v8, d["block_tables"], d["context_lens"], d["scale"], config=cfg)
        assert _max_err(out, ref) <= TOL[dtype]
    # Negative control: the 8-bit caches change the answer by more than the tolerance, so the check above would
    # see a kernel that read them as something else (or was handed the 16-bit caches).
    wide = paged_decode_reference(d["q"], d["k_cache"], d["v_cache"], d["block_tables"], d["context_lens"], d["scale"])
    assert _max_err(wide, ref) > 2 * TOL[dtype]  # 0.078 in bf16 on the H200's draws, more on the CPU's


def test_keys_inner_v_is_read_by_whole_pages():
    """A keys-inner V is read a page (or a key tile) at a time, the slots past the context in the last page included,
    which is why 8-bit writers store no NaN (``tests/workers/test_worker_kernel_wiring.py``): a finite value there adds
    an exact zero; a NaN, which only a cache written otherwise could hold, reaches the output. With head_dim
    contiguous the kernels read key by key, and the same NaN does nothing. (bf16 caches: the layout is the same for
    any dtype, and Triton's interpreter widens an 8-bit NaN to a number.)"""
    d = _problem([13, 40], [1, 1], dtype=torch.bfloat16, seed=6)
    k, v = d["k_cache"], d["v_cache"]
    block = int(d["block_tables"][0, 0])  # sequence 0's one block: slots 13..15 are past its context
    v[block, 14] = 448.0
    ref = paged_decode_reference(d["q"], k, v, d["block_tables"], d["context_lens"], d["scale"])
    cfg = DecodeConfig(block_n=32, partition=0)
    assert _max_err(paged_decode(d["q"], k, _keys_inner(v), d["block_tables"], d["context_lens"], d["scale"],
                                 config=cfg), ref) <= TOL[torch.bfloat16]
    v[block, 14] = float("nan")
    out = paged_decode(d["q"], k, _keys_inner(v), d["block_tables"], d["context_lens"], d["scale"], config=cfg)
    assert out[0].float().isnan().all() and not out[1].float().isnan().any()
    out = paged_decode(d["q"], k, v, d["block_tables"], d["context_lens"], d["scale"], config=cfg)
    assert _max_err(out, ref) <= TOL[torch.bfloat16]


def test_chunked_extend_equals_one_shot():
    total, chunks = 77, [10, 1, 30, 36]
    p = _problem([total], [total], seed=11)
    one_shot = _extend(p, ExtendConfig(block_m=16, block_n=16))
    pieces, done = [], 0
    for n in chunks:
        done += n
        cu = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
        ctx = torch.tensor([done], dtype=torch.int32, device=DEVICE)
        pieces.append(paged_extend(p["q"][done - n:done], p["k_cache"], p["v_cache"], p["block_tables"], cu,
                                   ctx, p["scale"], config=ExtendConfig(block_m=16, block_n=32)))
    assert _max_err(torch.cat(pieces), one_shot) <= 1e-5
    # Negative control: without the causal offset (every chunk as if it started at 0) the result differs.
    wrong = paged_extend(p["q"][10:11], p["k_cache"], p["v_cache"], p["block_tables"],
                         torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                         torch.tensor([1], dtype=torch.int32, device=DEVICE), p["scale"])
    assert _max_err(wrong, one_shot[10:11]) > 1e-3


def test_decode_equals_extend_with_one_query():
    p = _problem([9, 64, 65], [1, 1, 1], seed=5)
    dec = _decode(p, DecodeConfig(block_n=32, partition=32))
    ext = _extend(p, ExtendConfig(block_m=16, block_n=16))
    assert _max_err(dec, ext) <= 1e-5


def test_launchers_reject_bad_layouts():
    p = _problem([5], [1])
    with pytest.raises(AssertionError):  # int64 block table
        paged_decode(p["q"], p["k_cache"], p["v_cache"], p["block_tables"].long(), p["context_lens"], 1.0)
    with pytest.raises(AssertionError):  # heads not a multiple of kv heads
        paged_decode(p["q"][:, :5], p["k_cache"], p["v_cache"], p["block_tables"], p["context_lens"], 1.0)
    with pytest.raises(AssertionError):  # cache not contiguous in head_dim
        kt = p["k_cache"].transpose(2, 3)
        paged_decode(p["q"], kt, kt, p["block_tables"], p["context_lens"], 1.0)
    with pytest.raises(AssertionError):  # context longer than the table can hold
        paged_decode(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["context_lens"] * 100, 1.0)


# ---- 16-bit caches: float32 maths, one rounding at the output ----


def _round_once(x32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> dtype as the kernels' final cast rounds: to nearest on a GPU. Triton 3.9's interpreter
    truncates float32 -> bfloat16 (its cast passes no rounding mode; float16 goes through numpy, to nearest)."""
    if dtype == torch.bfloat16 and interpreting():
        return (x32.view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return x32.to(dtype)


def rounded_once(out: torch.Tensor, ref32: torch.Tensor, v_absmax: float) -> tuple[bool, str]:
    """Does ``out`` (16-bit) equal the float32 result ``ref32`` rounded once? At least 99% of the elements
    bitwise, and none further from ref32 than one ulp (at ref32's magnitude) plus 2^-16 * max|v| (the
    kernels carry P as hi + lo to ~2^-17, which shows on outputs that cancel to near zero)."""
    equal = (out == _round_once(ref32, out.dtype)).double().mean().item()
    mantissa = 7 if out.dtype == torch.bfloat16 else 10
    ulp = torch.ldexp(torch.ones_like(ref32), torch.frexp(ref32).exponent - 1 - mantissa)
    excess = ((out.float() - ref32).abs() - ulp).max().item() / (2**-16 * v_absmax)
    return equal >= 0.99 and excess <= 1.0, f"bitwise equal {equal:.4f}, excess {excess:.3g}"


_REF_ARGS = ("q", "k_cache", "v_cache", "block_tables", "cu_query_lens", "context_lens", "scale")


def _float32_copy(p):
    return {**p, **{name: p[name].float() for name in ("q", "k_cache", "v_cache")}}


ROUNDING_CASES = {
    # Several hundred keys, a few heads: P's rounding error is then a visible share of an output ulp. Decode with
    # up to 8 query heads a KV head carries P's two parts in one dot (the group's rows twice); with 16, in two dots.
    "decode": ([700, 333, 512], [1, 1, 1], lambda p: _decode(p, DecodeConfig(block_n=32, partition=0)), (8, 2)),
    "decode-split": ([700, 333, 512], [1, 1, 1], lambda p: _decode(p, DecodeConfig(block_n=32, partition=128)), (8, 2)),
    "decode-group8": ([700, 333], [1, 1], lambda p: _decode(p, DecodeConfig(block_n=32, partition=0)), (16, 2)),
    "decode-group16": ([700, 333], [1, 1], lambda p: _decode(p, DecodeConfig(block_n=32, partition=128)), (16, 1)),
    "extend": ([400, 130], [64, 130], lambda p: _extend(p, ExtendConfig(block_m=32, block_n=64)), (8, 2)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(ROUNDING_CASES))
def test_16bit_kernels_round_once(case, dtype, monkeypatch):
    context_lens, query_lens, run, (heads, kv_heads) = ROUNDING_CASES[case]
    p = _problem(context_lens, query_lens, heads=heads, kv_heads=kv_heads, head_dim=64, dtype=dtype, seed=1)
    ref32 = paged_extend_reference(**{k: v for k, v in _float32_copy(p).items() if k in _REF_ARGS})
    v_absmax = p["v_cache"].float().abs().max().item()
    ok, why = rounded_once(run(p), ref32, v_absmax)
    assert ok, why
    # The reference itself, given the 16-bit inputs, is that float32 result rounded (to nearest) once.
    ref16 = paged_extend_reference(**{k: v for k, v in p.items() if k in _REF_ARGS})
    assert torch.equal(ref16, ref32.to(dtype))
    # Negative control: the same kernel rounding P to the cache dtype before one P@V dot fails the check.
    monkeypatch.setattr(paged_common, "ROUND_P_BEFORE_PV", True)
    ok, why = rounded_once(run(p), ref32, v_absmax)
    assert not ok, why
