"""RMSNorm (+residual), SiLU-and-mul and RoPE kernels against their PyTorch references.

On a machine without CUDA these run under TRITON_INTERPRET=1 (set by importing ``kernels``).
"""

import pytest
import torch

from stride.kernels.autotune import compare
from stride.kernels.rmsnorm import RMSNormConfig, rmsnorm, rmsnorm_reference
from stride.kernels.rope import (
    Llama3RopeScaling,
    apply_rope,
    apply_rope_cos_sin,
    apply_rope_cos_sin_reference,
    apply_rope_reference,
    rope_cos_sin_cache,
    rope_inv_freq,
)
from stride.kernels.silu_mul import SiluMulConfig, silu_mul, silu_mul_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (atol, rtol): the interpreter rounds float->bfloat16 by truncation, so allow two bf16 ulps.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _rand(*shape, dtype, gen):
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


def _close(out, ref, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 5), (5, 123), (3, 576)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rmsnorm_matches_reference(dtype, rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows * hidden)
    x, w = _rand(rows, hidden, dtype=dtype, gen=gen), _rand(hidden, dtype=dtype, gen=gen)
    res = _rand(rows, hidden, dtype=dtype, gen=gen) if with_residual else None
    out, h = rmsnorm(x, w, 1e-5, res, RMSNormConfig(rows_per_program=2, num_warps=1))
    ref_out, ref_h = rmsnorm_reference(x, w, 1e-5, res)
    _close(out, ref_out, dtype)
    _close(h, ref_h, dtype)


def test_rmsnorm_check_can_fail():
    gen = torch.Generator().manual_seed(0)
    x, r, w = (_rand(5, 123, dtype=torch.float32, gen=gen) for _ in range(3))
    out, _ = rmsnorm(x, w[0], 1e-5, r)
    ref_without_residual, _ = rmsnorm_reference(x, w[0], 1e-5)
    assert not compare(out, ref_without_residual).ok
    assert compare(out, rmsnorm_reference(x, w[0], 1e-5, r)[0]).ok


def test_rmsnorm_launcher_rejects_bad_inputs():
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(AssertionError):
        rmsnorm(x, torch.randn(7, device=DEVICE), 1e-5)
    with pytest.raises(AssertionError):
        rmsnorm(x.t(), torch.randn(4, device=DEVICE), 1e-5)  # hidden not contiguous
    with pytest.raises(AssertionError):
        rmsnorm(x, torch.randn(8, device=DEVICE), 1e-5, residual=x.half())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 5), (5, 123), (2, 1536)])
def test_silu_mul_matches_reference(dtype, rows, inter):
    gen = torch.Generator().manual_seed(inter)
    x = _rand(rows, 2 * inter, dtype=dtype, gen=gen)
    out = silu_mul(x, SiluMulConfig(block=64, num_warps=2))
    _close(out, silu_mul_reference(x), dtype)
    # Negative control: swapping gate and up is a different function.
    swapped = silu_mul_reference(torch.cat([x[:, inter:], x[:, :inter]], dim=1))
    assert not torch.allclose(out.float(), swapped.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_dim", [(1, 1, 1, 2), (5, 9, 3, 64), (7, 20, 4, 16)])
def test_rope_matches_reference(dtype, num_tokens, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(num_tokens * heads)
    scaling = Llama3RopeScaling(original_max_position_embeddings=64)
    cos_sin = rope_cos_sin_cache(head_dim, 300, 500000.0, scaling, device=DEVICE)
    q, k = _rand(num_tokens, heads, head_dim, dtype=dtype, gen=gen), _rand(num_tokens, kv_heads, head_dim,
                                                                           dtype=dtype, gen=gen)
    positions = torch.randint(0, 300, (num_tokens,), generator=gen).to(DEVICE)
    ref_q, ref_k = apply_rope_reference(q, k, positions, cos_sin)
    q0 = q.clone()
    apply_rope(q, k, positions, cos_sin)
    _close(q, ref_q, dtype)
    _close(k, ref_k, dtype)
    if num_tokens > 1:
        assert not torch.allclose(q.float(), q0.float())


def test_rope_position_zero_is_identity_and_strided_q_works():
    cos_sin = rope_cos_sin_cache(32, 8, 10000.0, device=DEVICE)
    qkv = torch.randn(3, 6 + 2 + 2, 32, device=DEVICE)
    q, k = qkv[:, :6], qkv[:, 6:8]  # views into a fused qkv output, as the worker will pass
    before_q, before_k, before_v = q.clone(), k.clone(), qkv[:, 8:].clone()
    ref_q, ref_k = apply_rope_reference(q, k, torch.tensor([0, 3, 7], device=DEVICE), cos_sin)
    apply_rope(q, k, torch.tensor([0, 3, 7], device=DEVICE), cos_sin)
    torch.testing.assert_close(q, ref_q)
    torch.testing.assert_close(k, ref_k)
    torch.testing.assert_close(qkv[:, 8:], before_v)  # v untouched
    # Position 0 rotates by angle 0: the token's q and k come back as they went in.
    torch.testing.assert_close(q[0], before_q[0])
    torch.testing.assert_close(k[0], before_k[0])
    # Control: the tokens at positions 3 and 7 did rotate.
    assert not torch.allclose(q[1], before_q[1]) and not torch.allclose(k[2], before_k[2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_dim", [(1, 1, 1, 2), (5, 9, 3, 64), (7, 20, 4, 24)])
def test_rope_cos_sin_is_bit_exact(dtype, num_tokens, heads, kv_heads, head_dim):
    # The worker's variant: per-token cos/sin rows in the run dtype, rounded like eager PyTorch (head_dim 24:
    # a half that is not a power of two, masked).
    gen = torch.Generator().manual_seed(head_dim)
    inv_freq = rope_inv_freq(head_dim, 10000.0).float()
    freqs = torch.randint(0, 5000, (num_tokens,), generator=gen).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)
    q, k = _rand(num_tokens, heads, head_dim, dtype=dtype, gen=gen), _rand(num_tokens, kv_heads, head_dim,
                                                                           dtype=dtype, gen=gen)
    ref_q, ref_k = apply_rope_cos_sin_reference(q, k, cos, sin)
    apply_rope_cos_sin(q, k, cos, sin)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    with pytest.raises(AssertionError):
        apply_rope_cos_sin(q, k, cos.float() if dtype != torch.float32 else cos.half(), sin)  # dtype mismatch


def test_llama3_inv_freq_matches_transformers():
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=2, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})
    init = rope_utils.ROPE_INIT_FUNCTIONS["llama3"]
    hf_inv_freq, _ = init(cfg, "cpu")
    ours = rope_inv_freq(128, 500000.0, Llama3RopeScaling())
    torch.testing.assert_close(ours.float(), hf_inv_freq.float(), rtol=1e-6, atol=0)
    unscaled = rope_inv_freq(128, 500000.0)
    assert not torch.allclose(unscaled.float(), hf_inv_freq.float(), rtol=1e-3)
