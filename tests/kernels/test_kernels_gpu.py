"""GPU-only kernel checks at model-sized shapes (Llama-3.1-8B heads and projections), compiled."""

import dataclasses

import pytest
import torch

from stride.kernels import paged_decode as pd
from stride.kernels import paged_extend as pe
from stride.kernels.autotune import compare, gate
from stride.kernels.autotune_specs import (
    PAGED_DECODE,
    W4A16,
    DecodeShape,
    GemmShape,
    broken_block_table_stride,
    broken_dropped_scale,
    broken_off_by_one_mask,
    make_paged_problem,
)
from stride.kernels.rmsnorm import rmsnorm, rmsnorm_reference
from stride.kernels.w4a16 import w4a16_matmul
from stride.kernels.w4a16_format import W4A16Weight, dequantize, quantize, random_weight
from stride.kernels.w4a16_policy import W4A16Config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def _problem(context_lens, query_lens, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return make_paged_problem(context_lens, query_lens, HEADS, KV_HEADS, HEAD_DIM, PAGE, dtype, gen, CUDA)


CONFIGS = [None, pd.DecodeConfig(64, 0), pd.DecodeConfig(32, 128), pd.DecodeConfig(64, 256, 8)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_decode_up_to_64_pages(dtype, tol, cfg):
    lens = [1, 15, 16, 17, 333, 1000, 1023, 64 * PAGE]
    p = _problem(lens, [1] * len(lens), dtype, seed=len(str(cfg)))
    out = pd.paged_decode(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["context_lens"],
                          p["scale"], config=cfg)
    ref = pd.paged_decode_reference(p["q"].double(), p["k_cache"].double(), p["v_cache"].double(),
                                    p["block_tables"], p["context_lens"], p["scale"])
    assert (out.double() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_extend_matches_reference_and_chunks_equal_one_shot(dtype, tol):
    total = 64 * PAGE - 5
    p = _problem([total, 300, 77], [total, 45, 1], dtype, seed=3)
    ref = pe.paged_extend_reference(p["q"].double(), p["k_cache"].double(), p["v_cache"].double(),
                                    p["block_tables"], p["cu_query_lens"], p["context_lens"], p["scale"])
    out = pe.paged_extend(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["cu_query_lens"],
                          p["context_lens"], p["scale"])
    assert (out.double() - ref).abs().max().item() <= tol
    one_shot = out[:total]
    pieces, done = [], 0
    for n in (1, 100, 255, 256, total - 612):
        done += n
        cu = torch.tensor([0, n], dtype=torch.int32, device=CUDA)
        ctx = torch.tensor([done], dtype=torch.int32, device=CUDA)
        pieces.append(pe.paged_extend(p["q"][done - n:done], p["k_cache"], p["v_cache"],
                                      p["block_tables"][:1], cu, ctx, p["scale"]))
    assert done == total
    chunk_err = (torch.cat(pieces).double() - one_shot.double()).abs().max().item()
    assert chunk_err <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("m", [1, 7, 16, 40, 100])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_w4a16_at_8b_shapes(m, n, k):
    w = random_weight(n, k, device=CUDA, seed=m)
    x = torch.randn(m, k, device=CUDA).bfloat16()
    ref = x.float() @ dequantize(w).t()
    for cfg in (None, W4A16Config(block_n=128, block_k=32, split_k=1), W4A16Config(block_n=64, block_k=64, split_k=4),
                W4A16Config(block_m=1, block_n=32, block_k=512, split_k=8, gemv=True),
                W4A16Config(block_m=4, block_n=64, gemv=True)):
        out = w4a16_matmul(x, w, cfg, dequant=None if cfg is None else False)  # None: expanded from 17 rows
        assert ((out.float() - ref).norm() / ref.norm()).item() <= 1e-2


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 40])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_w4a16_group_128_at_8b_shapes(m, n, k):
    # --quantize w4a16's layout through the launcher's defaults (GEMV, tiles, expansion), compiled.
    w = random_weight(n, k, group_size=128, device=CUDA, seed=m)
    x = torch.randn(m, k, device=CUDA).bfloat16()
    ref = x.float() @ dequantize(w).t()
    out = w4a16_matmul(x, w)
    assert ((out.float() - ref).norm() / ref.norm()).item() <= 1e-2
    # Negative control: the mins dropped.
    no_mins = W4A16Weight(w.qweight, w.scales, torch.zeros_like(w.mins), 128)
    assert ((w4a16_matmul(x, no_mins).float() - ref).norm() / ref.norm()).item() > 0.05


def test_quantize_on_the_gpu_equals_the_cpu():
    w = torch.randn(4096, 4096, device=CUDA, dtype=torch.bfloat16) * 0.02
    on_gpu, on_cpu = quantize(w, 128), quantize(w.cpu(), 128)
    for field in ("qweight", "scales", "mins"):
        assert torch.equal(getattr(on_gpu, field).cpu(), getattr(on_cpu, field)), field


def test_rmsnorm_at_model_width():
    x, r = torch.randn(2, 333, 4096, device=CUDA).bfloat16().unbind(0)
    w = torch.randn(4096, device=CUDA).bfloat16()
    out, h = rmsnorm(x, w, 1e-5, r)
    ref, ref_h = rmsnorm_reference(x, w, 1e-5, r)
    assert compare(out, ref).ok and torch.equal(h, ref_h)


def test_gate_rejects_broken_variants_when_compiled():
    shape = DecodeShape(8, HEADS, KV_HEADS, HEAD_DIM, PAGE, 700, torch.bfloat16)
    for cfg in (pd.DecodeConfig(64, 0), pd.DecodeConfig(64, 128)):
        assert gate(PAGED_DECODE, PAGED_DECODE.candidate(cfg), shape, CUDA).ok
        assert not gate(PAGED_DECODE, broken_off_by_one_mask(cfg), shape, CUDA).ok
        assert not gate(PAGED_DECODE, broken_block_table_stride(cfg), shape, CUDA).ok
    gshape = GemmShape(4, 4096, 4096)
    assert gate(W4A16, W4A16.candidate(W4A16Config(block_k=64, split_k=2)), gshape, CUDA).ok
    assert not gate(W4A16, broken_dropped_scale(W4A16Config(block_k=64, split_k=2)), gshape, CUDA).ok
    assert not gate(W4A16, broken_dropped_scale(), dataclasses.replace(gshape, m=1), CUDA).ok


def test_pdl_chain_in_a_graph_equals_eager():
    """A dependent chain of every PDL kernel (RMSNorm+residual; the W4A16 GEMV one row per program over several
    steps, which waits first, in one step, whose weights are loaded before the wait, and two rows per program
    with split-K; SiLU-mul, RoPE in place, split decode attention and its reduction), captured in a CUDA graph
    with programmatic dependent launch, replays to the eager chain's bits, twice, with new inputs between. Each
    kernel reads what the one before wrote, so a kernel that ran ahead of its wait would read stale or unwritten
    memory."""
    from stride.kernels.common import pdl_args, set_pdl
    from stride.kernels.rope import apply_rope_cos_sin
    from stride.kernels.silu_mul import silu_mul

    torch.manual_seed(0)
    batch, k, inter = 4, HEADS * HEAD_DIM, 2048
    p = _problem([900, 1, 333, 1200], [1] * batch, torch.bfloat16, seed=3)
    w_up = random_weight(2 * inter, k, device=CUDA, scale_dtype=torch.bfloat16, seed=1)
    w_down = random_weight(k, inter, device=CUDA, scale_dtype=torch.bfloat16, seed=2)
    w_sq = random_weight(k, k, device=CUDA, scale_dtype=torch.bfloat16, seed=4)
    norm_w = torch.rand(k, device=CUDA, dtype=torch.bfloat16) + 0.5
    cos, sin = torch.rand(2, batch, HEAD_DIM, device=CUDA, dtype=torch.bfloat16)
    gemv = W4A16Config(block_m=2, block_n=32, block_k=256, split_k=1, num_warps=4, gemv=True)
    gemv_split = dataclasses.replace(gemv, split_k=4)
    one_step = W4A16Config(block_m=1, block_n=32, block_k=inter, split_k=1, num_warps=8, gemv=True)
    decode = pd.DecodeConfig(64, 256)
    x = torch.randn(batch, k, device=CUDA, dtype=torch.bfloat16)
    res = torch.randn_like(x)
    seen: list[dict] = []

    def chain() -> torch.Tensor:
        h, r = x, res
        for _ in range(3):
            seen.append(pdl_args(h))
            normed, r = rmsnorm(h, norm_w, 1e-5, r)
            up = silu_mul(w4a16_matmul(normed, w_up, dataclasses.replace(gemv, block_m=1)))
            d = w4a16_matmul(up, w_down, one_step)
            q = w4a16_matmul(d, w_sq, gemv_split).view(batch, HEADS, HEAD_DIM)
            kk = q[:, :KV_HEADS].clone()
            apply_rope_cos_sin(q, kk, cos, sin)
            h = pd.paged_decode(q, p["k_cache"], p["v_cache"], p["block_tables"], p["context_lens"], 0.1, 1200,
                                config=decode).view(batch, k) + kk.mean()
        return h

    want = chain()
    assert seen[-1] == {}  # eager launches are plain
    graph = torch.cuda.CUDAGraph()
    was = set_pdl(True)
    try:
        with torch.cuda.graph(graph):
            out = chain()
    finally:
        set_pdl(was)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert seen[-1] == {"PDL": True, "launch_pdl": True}  # the capture used PDL
    for trial in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"replay {trial}"
        x.copy_(torch.randn_like(x))
        want = chain()
        assert not torch.equal(out, want)  # the inputs changed: the old output is not the new answer
