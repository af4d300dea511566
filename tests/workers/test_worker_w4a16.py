"""GGUF Q4_0/Q4_1 projections kept 4-bit (W4A16Linear over the W4A16 GEMM) give the model that the
dequantising loader gives. CPU: the kernels through Triton's interpreter, float32, the tiny Llama written to
GGUF as llama.cpp's converter writes it (q/k rows permuted)."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from worker_helpers import Steps, count_calls, cpu_triton, make_runner, write_gguf

from stride.config import WorkerConfig, quantize_group_size
from stride.kernels.w4a16_format import W4A16Weight, dequantize, quantize
from stride.workers import gguf_checkpoint
from stride.workers.loader import load_model, use_w4a16
from stride.workers.models import layers
from stride.workers.models.layers import W4A16Linear

ROOT = Path(__file__).resolve().parents[2]
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def gguf_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    make = runpy.run_path(str(ROOT / "scripts" / "make_random_checkpoint.py"), run_name="make_checkpoint")
    cfg = dict(make["PRESETS"]["tiny-llama"], rope_scaling=None)  # GGUF has no llama3 parameters
    out = tmp_path_factory.mktemp("w4a16")
    hf = make["write_checkpoint"](cfg, out / "hf", torch.float32, seed=5)
    paths = {q: write_gguf(hf, out / f"m-{q}.gguf", q) for q in ("Q4_0", "Q4_1", "F32")}
    return {**paths, "hf": hf}


def _dequantised(module: W4A16Linear) -> torch.Tensor:
    return dequantize(W4A16Weight(module.qweight, module.scales, module.mins, module.group_size))


def test_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STRIDE_W4A16", raising=False)
    assert use_w4a16("cuda", "triton", WorkerConfig().w4a16)
    assert not use_w4a16("cpu", "triton", WorkerConfig().w4a16) and not use_w4a16("cuda", "torch")
    monkeypatch.setenv("STRIDE_W4A16", "0")  # the variable supplies WorkerConfig.w4a16's default
    assert not use_w4a16("cuda", "triton", WorkerConfig().w4a16)
    monkeypatch.setenv("STRIDE_W4A16", "1")
    assert use_w4a16("cpu", "torch", WorkerConfig().w4a16)


def _merged_shards(k: int, sizes: list[int]) -> list[W4A16Weight]:
    """One quantised weight per shard of a merged column projection (as qkv's q, k, v), K inputs each."""
    return [quantize(torch.randn(size, k, generator=torch.Generator().manual_seed(size)), 32) for size in sizes]


def _column_rank(k: int, full: list[W4A16Weight], tp: int, rank: int) -> tuple[W4A16Linear, torch.Tensor]:
    """Rank ``rank``'s column-parallel W4A16Linear (not loaded yet) and the dense weight its shards should give."""
    sizes = [w.out_features for w in full]
    column = W4A16Linear(k, [s // tp for s in sizes], "column", torch.float16, 32, rank, tp)
    want = torch.cat([dequantize(w)[rank * s // tp : (rank + 1) * s // tp] for w, s in zip(full, sizes, strict=True)])
    return column, want


def test_sharded_loading_off_tile_boundaries() -> None:
    # Packed words sit in tiles of 32 columns; column shards of 40 and 24 (each rank's half) start and end inside
    # tiles, and a row split takes its slice of K from every tile.
    k, sizes, tp = 64, [80, 48], 2
    full = _merged_shards(k, sizes)
    for rank in range(tp):
        column, want = _column_rank(k, full, tp, rank)
        for shard, w in enumerate(full):
            column.load_full(w, shard)
        assert column.qweight.shape == (2, k // 8, 32)  # 64 columns: two whole tiles
        assert torch.equal(_dequantised(column), want)
        row = W4A16Linear(k // tp, [sizes[0]], "row", torch.float16, 32, rank, tp)
        row.load_full(full[0])
        assert torch.equal(_dequantised(row), dequantize(full[0])[:, rank * k // tp : (rank + 1) * k // tp])
        # Negative control: the same words one column off inside the second tile (columns 32-63) fail the check.
        column.qweight[1] = column.qweight[1].roll(1, dims=1)
        assert torch.equal(_dequantised(column)[:32], want[:32]) and not torch.equal(_dequantised(column), want)


def test_sharded_loading_of_whole_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    # Shards of whole 32-column tiles (every real model's) are copied tile by tile, never through the (K // 8, N)
    # matrix of words (tiles_to_words raises while they load), and give the same weights as the unsharded ones.
    from stride.kernels import w4a16_format

    k, tp = 64, 2
    full = _merged_shards(k, [128, 64])

    def untiled(*_: object) -> torch.Tensor:
        raise AssertionError("whole tiles went through the word matrix")

    for rank in range(tp):
        column, want = _column_rank(k, full, tp, rank)
        with monkeypatch.context() as patched:
            patched.setattr(w4a16_format, "tiles_to_words", untiled)
            for shard, w in enumerate(full):
                column.load_full(w, shard)
        assert torch.equal(_dequantised(column), want)
        # Negative control: rank 1's first tile taken from rank 0's half fails the check.
        if rank == 1:
            column.qweight[0] = full[0].qweight[0]
            assert not torch.equal(_dequantised(column), want)


def test_only_all_q4_projections_are_packed() -> None:
    # A merged projection is packed only when every tensor in it is Q4_0/Q4_1 (types may mix among those).
    types = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate": "Q4_0",
             "ffn_up": "Q4_0", "ffn_down": "F16", "attn_norm": "F32"}
    tensors = [SimpleNamespace(name=f"blk.0.{k}.weight", tensor_type=SimpleNamespace(name=t))
               for k, t in types.items()]
    got = gguf_checkpoint.w4a16_projections(SimpleNamespace(tensors=tensors), SimpleNamespace(num_layers=1))  # type: ignore[arg-type]
    assert got == {
        "blk.0.attn_output.weight": "layers.0.self_attn.o_proj",
        "blk.0.ffn_gate.weight": "layers.0.mlp.gate_up_proj",
        "blk.0.ffn_up.weight": "layers.0.mlp.gate_up_proj",
    }


def test_quantize_values() -> None:
    assert [quantize_group_size(v) for v in ("", "none", "w4a16", "W4A16-g64", "w4a16-g32")] == [0, 0, 128, 64, 32]
    for bad in ("w4", "w4a16-g", "w4a16-g12", "w4a16-g48", "w4a16-g4", "w4a16-g0", "int4", "w4a16-g-8"):
        with pytest.raises(ValueError, match="quantize must be"):
            quantize_group_size(bad)
        with pytest.raises(ValueError, match="quantize must be"):
            WorkerConfig(quantize=bad)
    assert WorkerConfig(quantize="w4a16").quantize == "w4a16"


@pytest.mark.parametrize("source", ["hf", "F32"])
def test_quantized_projections_hold_the_quantised_checkpoint(gguf_paths: dict[str, Path], source: str) -> None:
    # A 32-bit checkpoint (HF, or GGUF F32 with its q/k rows permuted) quantised at load: every projection is a
    # W4A16Linear holding exactly what stride.kernels.w4a16_format.quantize makes of the dense weight, one tensor at a
    # time (q, k and v quantised separately, then merged: their groups run along the input, so merging cannot mix them).
    path = str(gguf_paths[source])
    dense = load_model(path)
    packed = load_model(path, quantize_group=32)
    names = [f"layers.{i}.{p}" for i in range(dense.args.num_layers) for p in PROJECTIONS]
    assert sorted(names) == sorted(k for k, m in packed.named_modules() if isinstance(m, W4A16Linear))
    assert not any(k.startswith(tuple(names)) for k, _ in packed.named_parameters())
    for name in names:
        module = packed.get_submodule(name)
        assert module.group_size == 32
        weight = dense.get_submodule(name).weight
        shards = getattr(dense.get_submodule(name), "output_sizes", [weight.shape[0]])
        want = torch.cat([dequantize(quantize(w, 32, torch.float32)) for w in weight.split(shards)])
        assert torch.equal(_dequantised(module), want), name
        # Negative control: 4 bits are not the dense weight (and within about half a step of it).
        err = (_dequantised(module) - weight).abs()
        assert err.max() > 0 and err.max() <= 0.52 * module.scales.max()
    assert torch.equal(packed.lm_head.weight, dense.lm_head.weight)
    assert torch.equal(packed.embed_tokens.weight, dense.embed_tokens.weight)


def test_quantize_keeps_gguf_q4_and_refuses_ragged_groups(gguf_paths: dict[str, Path]) -> None:
    q4 = load_model(str(gguf_paths["Q4_1"]), w4a16=True)
    both = load_model(str(gguf_paths["Q4_1"]), quantize_group=128)  # Q4 blocks stay as they are: groups of 32
    for name, module in q4.named_modules():
        if isinstance(module, W4A16Linear):
            other = both.get_submodule(name)
            assert other.group_size == 32 and torch.equal(_dequantised(other), _dequantised(module))
    with pytest.raises(ValueError, match="128-groups"):  # hidden size 64: no whole groups of 128
        load_model(str(gguf_paths["hf"]), quantize_group=128)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_packed_projections_hold_the_gguf_weights(
    gguf_paths: dict[str, Path], qtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(gguf_paths[qtype])
    dense = load_model(path)
    packed = load_model(path, w4a16=True)
    n = dense.args.num_layers
    names = [f"layers.{i}.{p}" for i in range(n) for p in PROJECTIONS]
    assert sorted(names) == sorted(k for k, m in packed.named_modules() if isinstance(m, W4A16Linear))
    assert not any(k.startswith(tuple(names)) for k, _ in packed.named_parameters())  # no 16/32-bit copy
    for name in names:  # the very weights the dequantising loader makes (q/k un-permuted alike)
        assert torch.equal(_dequantised(packed.get_submodule(name)), dense.get_submodule(name).weight), name
    assert torch.equal(packed.lm_head.weight, dense.lm_head.weight)
    # A bfloat16 run keeps float16 scales, which hold GGUF's fp16 d (and m, or -8d) exactly.
    half = load_model(path, dtype=torch.bfloat16, w4a16=True)
    qkv = half.layers[1].self_attn.qkv_proj
    assert qkv.scales.dtype == torch.float16
    assert torch.equal(_dequantised(qkv), dense.layers[1].self_attn.qkv_proj.weight)
    # Negative control: without the un-permutation q and k rows are out of place (v and o are not).
    monkeypatch.setattr(gguf_checkpoint, "unpermute_qk", lambda w, num_heads: w)
    wrong = load_model(path, w4a16=True).layers[1].self_attn
    q_size = dense.args.num_heads * dense.args.head_dim
    want = dense.layers[1].self_attn.qkv_proj.weight
    assert not torch.equal(_dequantised(wrong.qkv_proj)[:q_size], want[:q_size])
    assert torch.equal(_dequantised(wrong.o_proj), dense.layers[1].self_attn.o_proj.weight)


@cpu_triton  # the GPU twin: test_w4a16_worker_on_cuda_matches_dense_bf16
@torch.inference_mode()
def test_w4a16_worker_equals_dequantised_worker(
    gguf_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(gguf_paths["Q4_1"])  # the default model's type
    kw = dict(device="cpu", num_blocks=40, block_size=4)
    monkeypatch.setenv("STRIDE_W4A16", "0")
    ref = make_runner(path, attention_backend="torch", **kw)  # type: ignore[arg-type]
    monkeypatch.setenv("STRIDE_W4A16", "1")  # forces the CUDA default on the CPU
    tri = make_runner(path, attention_backend="triton", **kw)  # type: ignore[arg-type]
    assert (ref.w4a16, tri.w4a16) == (False, True)
    w4a16 = layers._kernel("w4a16")
    fake = SimpleNamespace(**vars(w4a16))  # the module, with a w4a16_matmul that can be counted
    monkeypatch.setitem(layers._KERNELS, "w4a16", fake)
    calls = count_calls(monkeypatch, fake, "w4a16_matmul")
    steps = Steps(40, 4, ref.args.vocab_size)
    steps.schedule.append([(1, 1)])  # a lone decode: one activation row takes the GEMV path
    want = steps.run(ref)
    assert calls["n"] == 0
    got = steps.run(tri)
    assert calls["n"] == len(steps.schedule) * len(PROJECTIONS) * ref.args.num_layers
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        err = (g - w).abs().max().item()
        assert err <= 1e-5, f"step {i}: max logit error {err:.3g}"
    # Negative control: the packed q/k without the un-permutation (the dense reference was loaded with it).
    monkeypatch.setattr(gguf_checkpoint, "unpermute_qk", lambda w, num_heads: w)
    wrong = make_runner(path, attention_backend="triton", **kw)  # type: ignore[arg-type]
    bad = Steps(40, 4, ref.args.vocab_size)
    bad.schedule = bad.schedule[:1]
    errs = [(g - w).abs().max().item() for g, w in zip(bad.run(wrong), want, strict=False)]
    assert np.max(errs) > 1e-3


@cpu_triton
@torch.inference_mode()
def test_quantized_worker_equals_worker_on_quantised_weights(gguf_paths: dict[str, Path]) -> None:
    """``quantize="w4a16-g32"`` on the runner: the 4-bit worker computes the model whose projections are the
    dequantised 4-bit weights, through the W4A16 GEMM."""
    path = str(gguf_paths["hf"])
    kw = dict(device="cpu", num_blocks=40, block_size=4)
    dense = make_runner(path, attention_backend="torch", **kw)  # type: ignore[arg-type]
    want_dense = Steps(40, 4, dense.args.vocab_size).run(dense)
    tri = make_runner(path, attention_backend="triton", quantize="w4a16-g32", **kw)  # type: ignore[arg-type]
    assert tri.w4a16
    for name, module in tri.model.named_modules():  # the reference: dense, holding the same 4-bit values
        if isinstance(module, W4A16Linear):
            dense.model.get_submodule(name).weight.copy_(_dequantised(module))
    want = Steps(40, 4, dense.args.vocab_size).run(dense)
    got = Steps(40, 4, dense.args.vocab_size).run(tri)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g - w).abs().max().item() <= 1e-5, f"step {i}"
    # Negative control: the unquantised model's logits are measurably elsewhere.
    assert max((g - w).abs().max().item() for g, w in zip(got, want_dense, strict=True)) > 1e-3


@pytest.mark.gpu
@torch.inference_mode()
def test_w4a16_worker_on_cuda_matches_dense_bf16(
    gguf_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the GPU (bf16 activations, float16 scales, the kernels compiled): the 4-bit worker's logits agree
    with the dequantised bf16 worker's as closely as two bf16 runs can, and a wrong weight layout does not."""
    path = str(gguf_paths["Q4_1"])
    kw = dict(device="cuda", dtype="bfloat16", num_blocks=40, block_size=4)
    monkeypatch.setenv("STRIDE_W4A16", "0")
    ref = make_runner(path, attention_backend="triton", **kw)  # type: ignore[arg-type]
    monkeypatch.delenv("STRIDE_W4A16")  # the CUDA + triton default: on
    tri = make_runner(path, attention_backend="triton", **kw)  # type: ignore[arg-type]
    assert (ref.w4a16, tri.w4a16) == (False, True)
    want = Steps(40, 4, ref.args.vocab_size).run(ref)
    got = Steps(40, 4, ref.args.vocab_size).run(tri)

    def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))

    cos = [cosine(g, w) for g, w in zip(got, want, strict=True)]
    err = max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))
    print(f"w4a16 vs dense bf16: cosine {min(cos):.6f}, max logit error {err:.4g}")
    assert min(cos) >= 0.999, cos
    # Negative control: the nibble order of a GGUF block swapped in the repacking (code i + 16 read as code i),
    # the classic Q4 layout slip. (The q/k un-permutation control of the CPU test is too weak here: this
    # random model's attention hardly depends on q.k, so it moves the logits about as much as bf16 rounding.)
    w4a16_format = layers._kernel("w4a16_format")
    real = w4a16_format.from_gguf_q4

    def swapped(raw: np.ndarray, qtype: str, shape: tuple[int, int], scale_dtype: torch.dtype) -> object:
        blocks = np.array(raw, dtype=np.uint8).reshape(-1, 20 if qtype == "Q4_1" else 18)
        qs = blocks[:, -16:]
        blocks[:, -16:] = (qs << 4) | (qs >> 4)
        return real(blocks, qtype, shape, scale_dtype)

    monkeypatch.setattr(w4a16_format, "from_gguf_q4", swapped)
    wrong = make_runner(path, attention_backend="triton", **kw)  # type: ignore[arg-type]
    bad_out = Steps(40, 4, ref.args.vocab_size).run(wrong)
    bad_cos = min(cosine(g, w) for g, w in zip(bad_out, want, strict=True))
    bad_err = max((g - w).abs().max().item() for g, w in zip(bad_out, want, strict=True))
    print(f"negative control (nibbles swapped): cosine {bad_cos:.6f}, max logit error {bad_err:.4g}")
    assert bad_cos < 0.999 and bad_err > 2 * err


def test_reference_path_of_a_4bit_projection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the torch backend a 4-bit projection runs the reference (the weight dequantised to float32 per call),
    never the Triton GEMM; the runner switches it with the fused layers."""
    from stride.kernels.w4a16_format import random_weight

    w = random_weight(64, 96, scale_dtype=torch.float32, seed=7)
    linear = W4A16Linear(96, [64], "column", torch.float32)
    linear.load_full(w)
    layers.use_fused_kernels(linear, False)
    fake = SimpleNamespace(w4a16_matmul=lambda *a, **k: pytest.fail("the Triton GEMM ran"))
    monkeypatch.setitem(layers._KERNELS, "w4a16", fake)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(linear(x), x @ dequantize(w).t(), rtol=0, atol=1e-6)
    # Control: switched back to the kernels, the GEMM is what runs.
    layers.use_fused_kernels(linear, True)
    with pytest.raises(pytest.fail.Exception, match="the Triton GEMM ran"):
        linear(x)
