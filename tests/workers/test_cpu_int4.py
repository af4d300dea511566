"""The CPU's small-step weights: a bf16 weight on a 4-bit grid (what a GGUF Q4_1 dequantises to) keeps that grid packed
and small steps run on it, giving what the bf16 weight gives; a weight off any grid is left alone; the output
projection's int8 copy stays within half a step of its row's scale; the default model decodes greedily to the same
tokens with both or neither, but where its top two are near-tied."""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from worker_helpers import make_checkpoint, make_runner, write_gguf

from stride.model.files import default_model_path
from stride.workers import cpu_int4
from stride.workers.models.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelHead
from stride.workers.runner import ModelRunner

pytestmark = pytest.mark.skipif(not cpu_int4.available(), reason="this torch has no CPU int4 kernel")


def q4_1_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight as a GGUF Q4_1 tensor dequantises: per group of 32 inputs ``d * q + m``, q spanning 0..15."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15  # llama.cpp's Q4_1 maps a group's min to 0 and its max to 15
    d = torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3
    m = -d * (5 + 5 * torch.rand(n, k // 32, 1, generator=g))  # groups around zero, as trained weights are
    return (q * d + m).reshape(n, k).to(torch.bfloat16)


def test_a_4_bit_weight_keeps_its_grid_and_gives_what_the_bf16_weight_gives() -> None:
    w = q4_1_weight(96, 128)
    grid = cpu_int4.int4_grid(w)
    assert grid is not None and grid.nbytes < w.numel() * 2 // 3
    for rows in (1, 2, 4):
        x = torch.randn(rows, 128).to(torch.bfloat16)
        ref = F.linear(x.float(), w.float())
        got = grid(x).float()
        assert (got - ref).abs().max() <= 0.02 * ref.abs().max(), rows
    # Negative control: a weight that is not on a 4-bit grid has none, and a grid of another weight differs.
    assert cpu_int4.int4_grid(torch.randn(96, 128).to(torch.bfloat16)) is None
    other = cpu_int4.int4_grid(q4_1_weight(96, 128, seed=1))
    assert other is not None
    x = torch.randn(1, 128).to(torch.bfloat16)
    ref = F.linear(x.float(), w.float())
    assert (other(x).float() - ref).abs().max() > 0.1 * ref.abs().max()


class Spy(cpu_int4.SmallStepWeight):
    """A packed copy that records the rows of each step it is given."""

    def __init__(self, inner: cpu_int4.SmallStepWeight) -> None:
        self.inner, self.max_rows, self.calls = inner, inner.max_rows, list[int]()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return self.inner(x)


@pytest.mark.parametrize("max_rows", [cpu_int4.MAX_ROWS, cpu_int4.EMULATED_MAX_ROWS])
def test_a_layer_runs_small_steps_on_its_grid_and_larger_ones_on_bf16(max_rows: int) -> None:
    layer = ColumnParallelLinear(128, [96])
    layer.weight.data = q4_1_weight(96, 128)
    grid = cpu_int4.int4_grid(layer.weight.data, max_rows)
    assert grid is not None and grid.max_rows == max_rows
    layer.int4 = spy = Spy(grid)
    for rows in (1, max_rows, max_rows + 1, 2 * max_rows):
        layer(torch.randn(rows, 128).to(torch.bfloat16))
    assert spy.calls == [1, max_rows]


def test_upcast_layers_multiply_large_steps_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU that emulates bf16 products the steps the packed copies do not take multiply in float32 (the bf16
    weight widened per call) and come back in bf16; only bf16 projections and the head are switched."""
    from stride.workers.models import layers

    col, row, head = ColumnParallelLinear(64, [32]), RowParallelLinear(32, 64), VocabParallelHead(64, 96)
    for m in (col, row, head):
        m.weight.data = torch.randn(m.weight.shape).to(torch.bfloat16)
    fp32 = ColumnParallelLinear(64, [32])  # a float32 weight: nothing to widen
    gridded = ColumnParallelLinear(128, [96])
    gridded.weight.data = q4_1_weight(96, 128)
    gridded.int4 = cpu_int4.int4_grid(gridded.weight.data, cpu_int4.EMULATED_MAX_ROWS)
    model = torch.nn.ModuleList([col, row, head, fp32, gridded])
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    real = F.linear

    def spy(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        seen.append((x.dtype, w.dtype))
        return real(x, w)

    monkeypatch.setattr(layers.F, "linear", spy)
    x = torch.randn(8, 64).to(torch.bfloat16)
    col(x)
    assert seen == [(torch.bfloat16, torch.bfloat16)]  # negative control: as the weight is, before the switch
    bf16_col = col.weight.data.clone()
    assert cpu_int4.upcast_large_steps(model) == 4 and not fp32.upcast and gridded.upcast
    # Without a grid the weight is widened once (every step would widen it otherwise); with one it stays bf16, and
    # the head (which may be the embedding's) too.
    assert col.weight.dtype == row.weight.dtype == torch.float32 and torch.equal(col.weight.data, bf16_col.float())
    assert gridded.weight.dtype == head.weight.dtype == torch.bfloat16
    seen.clear()
    out = col(x)
    assert seen == [(torch.float32, torch.float32)] and out.dtype == torch.bfloat16
    assert torch.equal(out, real(x.float(), bf16_col.float()).to(torch.bfloat16))
    seen.clear()
    wide = torch.randn(cpu_int4.EMULATED_MAX_ROWS + 1, 128).to(torch.bfloat16)
    assert gridded(wide).dtype == torch.bfloat16 and seen == [(torch.float32, torch.float32)]
    seen.clear()
    row(torch.randn(8, 32).to(torch.bfloat16))
    head(x)
    assert seen == [(torch.float32, torch.float32)] * 2
    # A packed copy still takes the steps it covers.
    grid = cpu_int4.Int8Rows(head.weight.data, max_rows=8)
    head.int8 = small = Spy(grid)
    seen.clear()
    head(x)
    assert small.calls == [8] and seen == []


def test_the_grid_unpacks_to_the_weight_the_int4_kernel_multiplies_by(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout probe reads torch's packing on this CPU: the unpacked grid multiplied in float32 gives what the
    kernel gives (to its bf16 output's rounding), and the weight back to within half a grid step. Negative controls:
    the bytes read with another block size, or against another weight, do not agree."""
    block = cpu_int4.int4_block()
    assert block in (16, 32, 64, 128)
    w = q4_1_weight(192, 128)
    grid = cpu_int4.int4_grid(w, cpu_int4.EMULATED_MAX_ROWS)
    assert grid is not None
    x = torch.randn(4, 128).to(torch.bfloat16)
    kernel = grid(x).float()
    assert (x.float() @ grid.unpacked_t() - kernel).abs().max() <= 0.01 * kernel.abs().max()
    assert grid.agrees(w)
    assert not grid.agrees(q4_1_weight(192, 128, seed=1))
    monkeypatch.setattr(cpu_int4, "int4_block", lambda: 32 if block == 64 else 64)
    assert not grid.agrees(w)


def test_the_layout_probe_reads_the_avx2_packing_too() -> None:
    """Held to AVX2 (an AVX2-only laptop's paths) torch packs the grid in another block size; the probe finds it and
    the unpacked grid agrees with its weight there too."""
    code = "import torch\nfrom stride.workers import cpu_int4\n" + inspect.getsource(q4_1_weight) + (
        "w = q4_1_weight(192, 128)\ng = cpu_int4.int4_grid(w, 64)\n"
        "print(cpu_int4.int4_block(), g.agrees(w), g.agrees(q4_1_weight(192, 128, seed=1)))\n"
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    block, agrees, stranger = out.stdout.split()
    assert int(block) in (16, 32, 64, 128) and agrees == "True" and stranger == "False"


def test_an_emulated_bf16_layer_gives_up_its_weight_for_its_grid() -> None:
    """On a CPU that emulates bf16 a projection with a grid holds no bf16 weight: the steps the kernel takes still go
    there, larger ones multiply the unpacked grid in float32, within the grid's rounding of the bf16 weight's answer.
    A layer whose grid does not give its weight back keeps its weight (negative control)."""
    w = q4_1_weight(192, 128)
    layer, stranger = ColumnParallelLinear(128, [192]), ColumnParallelLinear(128, [192])
    layer.weight.data, stranger.weight.data = w, q4_1_weight(192, 128, seed=2)
    layer.int4 = grid = cpu_int4.int4_grid(w, cpu_int4.EMULATED_MAX_ROWS)
    stranger.int4 = cpu_int4.int4_grid(q4_1_weight(192, 128, seed=3), cpu_int4.EMULATED_MAX_ROWS)
    model = torch.nn.ModuleList([layer, stranger])
    assert cpu_int4.upcast_large_steps(model) == 2
    assert cpu_int4.drop_large_step_weights(model) == (1, w.numel() * 2)
    assert layer.weight.is_meta and layer.weight.shape == w.shape and not stranger.weight.is_meta
    assert grid is not None
    wide = torch.randn(cpu_int4.EMULATED_MAX_ROWS + 1, 128).to(torch.bfloat16)
    got = layer(wide)
    assert got.dtype == torch.bfloat16 and torch.equal(got, (wide.float() @ grid.unpacked_t()).to(torch.bfloat16))
    ref = F.linear(wide.float(), w.float())
    assert (got.float() - ref).abs().max() <= 0.02 * ref.abs().max()
    layer.int4 = spy = Spy(grid)
    layer(torch.randn(3, 128).to(torch.bfloat16))
    assert spy.calls == [3]


def test_the_grids_row_limit_follows_the_cpu_and_what_onednn_is_held_to(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """4 rows with AMX (oneDNN's bf16 products on the tiles beat the grid kernel from ~8 rows), 16 with AVX-512 BF16
    alone, 64 where bf16 is emulated; ``ONEDNN_MAX_CPU_ISA`` below AMX or below AVX-512 takes the CPU for one without;
    ``STRIDE_CPU_INT4_ROWS`` sets it."""
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "STRIDE_CPU_INT4_ROWS"):
        monkeypatch.delenv(name, raising=False)
    amx, bf16 = str(tmp_path / "amx"), str(tmp_path / "bf16")
    Path(amx).write_text("flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    Path(bf16).write_text("flags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert [cpu_int4.max_small_rows(True, f) for f in (amx, bf16)] == [cpu_int4.MAX_ROWS, cpu_int4.NO_AMX_MAX_ROWS]
    assert cpu_int4.max_small_rows(False, amx) == cpu_int4.EMULATED_MAX_ROWS
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert cpu_int4.max_small_rows(True, amx) == cpu_int4.MAX_ROWS
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert cpu_int4.cpu_flags(amx) == {"flags", ":", "fpu", "avx2", "avx512f", "avx512_bf16"}
    assert cpu_int4.max_small_rows(True, amx) == cpu_int4.NO_AMX_MAX_ROWS
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_int4.cpu_flags(amx) == {"flags", ":", "fpu", "avx2"}
    monkeypatch.setenv("STRIDE_CPU_INT4_ROWS", "8")
    assert cpu_int4.max_small_rows(True, amx) == cpu_int4.max_small_rows(False, amx) == 8
    monkeypatch.setenv("STRIDE_CPU_INT4_ROWS", "0")
    with pytest.raises(ValueError, match="at least 1"):
        cpu_int4.max_small_rows(True, amx)


def _greedy_against(plain: ModelRunner, other: ModelRunner) -> list[tuple[float, float, bool, float]]:
    """24 greedy steps from each of two prompts, both runners fed ``plain``'s choice. Per step: the gap between
    ``plain``'s top two log-probs, how far ``other`` moved that gap, whether ``other`` picked another token, and the
    step of the bf16 grid at the two logits' size (both heads round their logits to bf16)."""
    table = np.arange(16, dtype=np.int32)[None, :]
    out = []
    for prompt in ([1, 504, 3458, 314, 4649, 30], [1, 1976, 253, 1345, 1007, 282, 253]):
        ids = list(prompt)
        step = list(prompt)
        for _ in range(24):
            n = len(ids)
            args = (np.array(step), np.arange(n - len(step), n), [0], [len(step)], [n], table)
            logits = plain.forward(*args)[0]
            want = torch.log_softmax(logits.double(), -1)
            got = torch.log_softmax(other.forward(*args)[0].double(), -1)
            top2 = want.topk(2)
            gap = float(top2.values[0] - top2.values[1])
            moved = abs(gap - float(got[top2.indices[0]] - got[top2.indices[1]]))
            top = float(logits[top2.indices].abs().max())
            bf16_step = torch.finfo(torch.bfloat16).eps * 2.0 ** math.floor(math.log2(top))
            out.append((gap, moved, int(got.argmax()) != int(top2.indices[0]), bf16_step))
            nxt = int(top2.indices[0])
            ids.append(nxt)
            step = [nxt]
    return out


@pytest.fixture
def one_thread():
    """torch on one thread for the test, then back to what it was (the setting is the process's: left at 1, every later
    test in the run would be held to one thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_the_default_model_decodes_the_same_greedy_tokens_on_its_grids() -> None:
    """Every one of the default model's Q4_1 projections gets its grid; 48 greedy steps from two prompts pick the
    tokens the bf16 weights pick, but where those weights' top two are near-tied.

    Both paths compute the same products of the same weights and differ only in where they round, and this network
    carries a rounding's difference forward: so a near-tie is one within the int8 head's error (0.05) plus twice the
    larger of the bf16 grid's step at the two logits' size (0.125 between 16 and 32: two logits 0.19 apart rounded 0.25
    apart on one path and tied on the other on an Intel CPU with AMX, 2026-12-05) and how far one rounding moves the
    answers here: the bf16 path again with one weight one bf16 step off moved a top-two gap by up to 0.625 on that
    CPU, 0.25 with torch held to AVX2 (2026-12-06). Held to AVX2 the grids also take the prompt steps (up to 64 rows
    there), and the grids' path flipped at a gap of 0.375 beside four flips at gaps of one grid step or none, where the
    bound was 0.3 before it counted that move. At most four flips may come at gaps wider than a grid step. Negative
    control: two layers' down projections' grids swapped, which this bound catches."""

    def runner(grids: bool) -> ModelRunner:
        return make_runner(default_model_path(), device="cpu", dtype="bfloat16", block_size=16, num_blocks=16,
                           max_num_seqs=1, cpu_int4=grids, cpu_int8_head=grids, cpu_pack=False)

    plain, fast, nudged = runner(False), runner(True), runner(False)
    on_grid = [m for m in fast.model.modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.int4 is not None]
    assert len(on_grid) == 4 * fast.args.num_layers  # qkv, o, gate_up and down of every layer
    assert all(getattr(m, "int4", None) is None for m in plain.model.modules())
    assert fast.model.lm_head.int8 is not None and plain.model.lm_head.int8 is None
    nudged.model.layers[0].input_layernorm.weight.data[7:8].view(torch.int16).add_(1)
    one_rounding = max(moved for _, moved, _, _ in _greedy_against(plain, nudged))
    assert one_rounding > 0  # the nudge reaches the answers

    def near_ties_only(steps: list[tuple[float, float, bool, float]]) -> bool:
        flips = [(gap, bf16_step) for gap, _, flipped, bf16_step in steps if flipped]
        wider = [gap for gap, bf16_step in flips if gap > bf16_step]  # more than a tie on the bf16 grid
        return len(wider) <= 4 and all(gap < 0.05 + 2 * max(bf16_step, one_rounding) for gap, bf16_step in flips)

    steps = _greedy_against(plain, fast)
    assert len(steps) == 48 and near_ties_only(steps), (one_rounding, [s for s in steps if s[2]])
    a, b = fast.model.layers[3].mlp.down_proj, fast.model.layers[4].mlp.down_proj
    a.int4, b.int4 = b.int4, a.int4
    assert not near_ties_only(_greedy_against(plain, fast))


def test_the_int8_head_is_within_its_rows_half_step_and_only_for_small_steps() -> None:
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(320, 64, generator=g) * torch.rand(320, 1, generator=g)).to(torch.bfloat16)
    rows = cpu_int4.Int8Rows(w)
    step = w.float().abs().amax(1) / 127
    restored = rows.q.float() * rows.scales.float()[:, None]
    # Half a step, plus the bf16 rounding of the row's scale (2^-9 of it, times up to 127 steps).
    assert ((restored - w.float()).abs() <= (0.5 + 127 * 2**-8) * step[:, None]).all()
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    ref = F.linear(x.float(), w.float())
    assert (rows(x).float() - ref).abs().max() <= 0.02 * ref.abs().max()
    head = VocabParallelHead(64, 320)
    head.weight.data = w
    head.int8 = spy = Spy(rows)
    for n in (1, cpu_int4.MAX_ROWS, cpu_int4.MAX_ROWS + 1):
        head(torch.randn(n, 64).to(torch.bfloat16))
    assert spy.calls == [1, cpu_int4.MAX_ROWS]
    # Negative control: another weight's int8 copy is far off.
    other = cpu_int4.Int8Rows(torch.randn(320, 64, generator=g).to(torch.bfloat16))
    assert (other(x).float() - ref).abs().max() > 0.2 * ref.abs().max()


@pytest.mark.skipif(not cpu_int4.fp16_rows_available(), reason="no fbgemm fp16 product on this CPU")
def test_the_fp16_head_is_the_bf16_weight_itself_for_every_step() -> None:
    """The fp16 copy holds the bf16 weight's own values (every one in fp16's normal range is an fp16 value, and the
    small ones here too), so its product is the float32 product of the bf16 weight up to the order of the sums, and
    it takes steps of every size; chunked packing changes nothing. A weight past fp16's range gets no copy. Negative
    controls: the weight one bf16 step off in one column, and the int8 copy, are caught by the same bound."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(320, 64, generator=g) * torch.rand(320, 1, generator=g) * 4).to(torch.bfloat16)
    w[0, :8] = torch.tensor([2**-14, 2**-20, -(2**-24), 3e4, -6e4, 0.0, 1e-3, -1e-5]).to(torch.bfloat16)
    rows = cpu_int4.Fp16Rows(w, max_rows=1 << 30, chunk=96)  # four chunks, the last ragged
    assert len(rows.parts) == 4 and rows.nbytes == 2 * w.numel()
    x = torch.randn(70, 64, generator=g)
    ref = F.linear(x, w.float())
    bound = 1e-6 * (x.abs() @ w.float().abs().t())  # float32 sums in another order
    got = torch.ops.quantized.linear_dynamic_fp16(x, rows.parts[0])  # the first chunk alone
    assert ((got - ref[:, :96]).abs() <= bound[:, :96]).all()
    assert torch.equal(rows(x.bfloat16()), rows(x.bfloat16()))
    assert ((rows(x) - ref).abs() <= bound).all() and rows(x).dtype == torch.float32
    head = VocabParallelHead(64, 320)
    head.weight.data = w
    head.int8 = spy = Spy(rows)
    for n in (1, cpu_int4.EMULATED_MAX_ROWS + 1, 300):
        head(torch.randn(n, 64).to(torch.bfloat16))
    assert spy.calls == [1, cpu_int4.EMULATED_MAX_ROWS + 1, 300]
    model = torch.nn.Module()
    model.lm_head = VocabParallelHead(64, 320)
    model.lm_head.weight.data = w.clone()
    model.lm_head.weight.data[5, 3] = 7e4  # past fp16's largest value
    assert cpu_int4.attach_fp16_head(model) == 0 and model.lm_head.int8 is None
    model.lm_head.weight.data[5, 3] = 1.0
    assert cpu_int4.attach_fp16_head(model) == 2 * w.numel() and isinstance(model.lm_head.int8, cpu_int4.Fp16Rows)
    nudged = w.clone()
    nudged[:, 9].view(torch.int16).add_(1)
    assert not ((cpu_int4.Fp16Rows(nudged, 1 << 30)(x) - ref).abs() <= bound).all()
    assert not ((cpu_int4.Int8Rows(w)(x.bfloat16()).float() - ref).abs() <= bound).all()


def _tied_toy(q8: bool) -> torch.nn.Module:
    """A tied embedding and output projection (320 x 64), its weight in Q8_0's form (a GGUF Q8_0 tensor
    dequantised to bf16, as the loader makes it) or one value off that form."""
    import gguf

    from stride.workers.models.layers import Embedding

    g = np.random.default_rng(3)
    raw = gguf.quants.quantize(g.standard_normal((320, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)).to(torch.bfloat16)
    if not q8:
        w[7, :2] = torch.tensor([100.0, 0.0123])  # a step of ~100 / 127 cannot give 0.0123 back
    model = torch.nn.Module()
    model.embed_tokens = Embedding(320, 64)
    model.lm_head = VocabParallelHead(64, 320)
    model.embed_tokens.weight.data = w
    model.lm_head.weight = model.embed_tokens.weight
    return model


@pytest.mark.skipif(not cpu_int4.fp16_rows_available(), reason="no fbgemm fp16 GEMM in this torch")
def test_where_bf16_is_emulated_the_tied_weight_goes_once_rows_and_the_fp16_copy_read_it() -> None:
    """On a CPU that emulates bf16, the head holds an fp16 copy for every step; where it is tied to an embedding
    whose weight has Q8_0's form, lookups read the Q8_0 rows and the shared bf16 weight goes (a meta tensor): the
    same embeddings and logits as before, to the bit. Negative controls: a weight off Q8_0's form, and a CPU with
    native bf16 (no fp16 copy), keep it."""
    model = _tied_toy(q8=True)
    w = model.embed_tokens.weight.data.clone()
    ids = torch.tensor([0, 7, 319, 7, 100])
    x = torch.randn(9, 64).to(torch.bfloat16)
    want_rows, want_logits = F.embedding(ids, w), cpu_int4.Fp16Rows(w, 1 << 30)(x)
    cpu_int4.prepare(model, int4=False, int8_head=True, native_bf16=False)
    assert model.embed_tokens.weight.is_meta and model.lm_head.weight is model.embed_tokens.weight
    assert tuple(model.lm_head.weight.shape) == (320, 64)
    assert torch.equal(model.embed_tokens(ids), want_rows)
    assert torch.equal(model.lm_head(x), want_logits)
    assert model.lm_head(torch.randn(300, 64).to(torch.bfloat16)).isfinite().all()  # a large step, no weight
    off = _tied_toy(q8=False)
    cpu_int4.prepare(off, int4=False, int8_head=True, native_bf16=False)
    assert not off.embed_tokens.weight.is_meta and off.embed_tokens.rows is None
    assert isinstance(off.lm_head.int8, cpu_int4.Fp16Rows)
    native = _tied_toy(q8=True)
    cpu_int4.prepare(native, int4=False, int8_head=True, native_bf16=True)
    assert not native.embed_tokens.weight.is_meta and not isinstance(native.lm_head.int8, cpu_int4.Fp16Rows)


@pytest.mark.parametrize("native", [True, False])
def test_the_runner_fits_the_small_steps_to_the_cpu(native: bool, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 runner of a Q4_1 GGUF: on a CPU with native bf16 the packed copies take steps of up to MAX_ROWS rows
    (with AMX; NO_AMX_MAX_ROWS without) and larger ones multiply in bf16; on one that emulates bf16 they take up to
    EMULATED_MAX_ROWS and every projection multiplies the larger steps in float32, on its grid unpacked (no bf16
    weight held)."""
    from stride.workers import runner as runner_module

    hf = make_checkpoint("tiny-llama", tmp_path / "hf", torch.float32)
    gguf = write_gguf(hf, tmp_path / "m.gguf", "Q4_1")
    monkeypatch.setattr(runner_module, "cpu_has_bf16", lambda: native)
    r = make_runner(str(gguf), device="cpu", dtype="bfloat16", block_size=16, num_blocks=8, max_num_seqs=2,
                    cpu_pack=False)
    projections = [m for m in r.model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    want = cpu_int4.max_small_rows(native)
    assert projections and all(m.int4 is not None and m.int4.max_rows == want for m in projections)
    assert all(m.upcast is not native for m in projections)
    assert all(m.weight.is_meta is not native for m in projections)  # emulated: the grids take every step
    head = r.model.lm_head
    if native or not cpu_int4.fp16_rows_available():
        assert head.int8 is not None and head.int8.max_rows == want
    else:  # emulated: the head's fp16 copy takes every step
        assert isinstance(head.int8, cpu_int4.Fp16Rows) and head.int8.max_rows >= 1 << 30
    assert head.upcast is not native


needs_packing = pytest.mark.skipif(not cpu_int4.packing_available(), reason="no oneDNN bf16 product on this CPU")


@needs_packing
def test_a_packed_weight_gives_the_plain_weights_products_bit_for_bit() -> None:
    """oneDNN's blocked layout changes where the weight's values sit, not the products: every step size gives what
    ``F.linear`` gives on the plain weight, to the bit; small steps still go to the grid."""
    layer = ColumnParallelLinear(128, [96])
    layer.weight.data = q4_1_weight(96, 128)
    plain = layer.weight.data.clone()
    grid = cpu_int4.int4_grid(plain)
    assert grid is not None
    layer.int4 = spy = Spy(grid)
    holder = torch.nn.Sequential(layer)
    assert cpu_int4.pack_large_steps(holder, compiled=True) == (1, plain.numel() * 2)
    assert layer.weight.is_mkldnn and tuple(layer.weight.shape) == (96, 128)
    # Negative control: the weight with two of its rows swapped, packed, is caught at every step size.
    swapped = cpu_int4.packed_bf16(plain[[1, 0, *range(2, 96)]])
    g = torch.Generator().manual_seed(1)
    for rows in (5, 16, 37, 300):
        x = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
        want = F.linear(x, plain)
        assert torch.equal(layer(x), want), rows
        assert not torch.equal(cpu_int4.linear_packed(x, swapped), want)
    layer(torch.randn(3, 128).to(torch.bfloat16))
    assert spy.calls == [3]
    # A projection without a grid keeps its plain weight where a compiled step's small steps read it.
    bare = torch.nn.Sequential(ColumnParallelLinear(128, [96]))
    bare[0].weight.data = plain.clone()
    assert cpu_int4.pack_large_steps(bare, compiled=True) == (0, 0) and not bare[0].weight.is_mkldnn
    assert cpu_int4.pack_large_steps(bare, compiled=False)[0] == 1 and bare[0].weight.is_mkldnn
    # The layout cannot be read as values: nothing may take it for the plain weight.
    with pytest.raises((RuntimeError, NotImplementedError)):
        F.linear(x, layer.weight)


@needs_packing
@pytest.mark.parametrize("native, pack, int4, compiled, tied, packed", [
    (True, True, True, True, False, True),     # the grids' projections: no compiled step reads their weights
    (True, True, False, True, False, True),    # no grids, and the head packs: no small-step copies, no compiled step
    (True, True, False, False, False, True),   # no grids, no compiled step: nothing else reads them
    (True, False, True, True, False, False),   # STRIDE_CPU_PACK=0
    (False, True, True, True, False, False),   # bf16 emulated: larger steps widen to float32 instead
    (True, True, True, True, True, True),      # a tied head over a Q8_0 embedding (the default model's)
])
def test_the_runner_packs_the_weights_nothing_else_reads(native: bool, pack: bool, int4: bool, compiled: bool,
                                                         tied: bool, packed: bool, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """What the runner packs, and that its answers stay the plain weights' to the bit. The head: packed with the
    projections (its int8 copy dropped), a tied one only once the embedding reads its Q8_0 rows instead."""
    from stride.workers import runner as runner_module

    hf = make_checkpoint("tiny-llama", tmp_path / "hf", torch.float32, tie_word_embeddings=tied)
    gguf = write_gguf(hf, tmp_path / "m.gguf", "Q4_1", {"token_embd.weight": "Q8_0"})
    monkeypatch.setattr(runner_module, "cpu_has_bf16", lambda: native)
    # A compiled step's build is stood in for: only whether one exists decides what may be packed.
    monkeypatch.setattr(runner_module.ModelRunner, "_compiled_step",
                        lambda self, rows, native, embedding_rows, config: object() if compiled else None)

    def runner(pack: bool) -> runner_module.ModelRunner:
        # Without packing, no int8 head either: the logits of a 3-row step would come from it.
        return make_runner(str(gguf), device="cpu", dtype="bfloat16", block_size=16, num_blocks=8, max_num_seqs=4,
                           cpu_pack=pack, cpu_int4=int4, cpu_int8_head=pack)

    r = runner(pack)
    projections = [m for m in r.model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert projections and all(m.weight.is_mkldnn is packed for m in projections)
    head, embedding = r.model.lm_head, r.model.embed_tokens
    head_packed = native and pack  # the head never reaches a compiled step
    assert head.weight.is_mkldnn is head_packed and (head.int8 is None or not head_packed)
    assert (embedding.rows is not None) is (head_packed and tied)  # an untied head needs no rows
    assert embedding.weight.is_meta is (head_packed and tied)  # a tied head's plain copy went
    if not packed:
        return
    # The runner's answers are the plain weights' to the bit: a prefill of three prompts (27 rows).
    r.compiled = None
    plain = runner(False)
    plain.compiled = None
    tables = np.arange(6, dtype=np.int32).reshape(3, 2)
    lens = np.array([9, 12, 6])
    tokens = np.random.default_rng(0).integers(0, r.args.vocab_size, int(lens.sum()))
    positions = np.concatenate([np.arange(n) for n in lens])
    got = r.forward(tokens, positions, np.arange(3), lens, lens, tables)
    want = plain.forward(tokens, positions, np.arange(3), lens, lens, tables)
    assert torch.equal(got, want)
