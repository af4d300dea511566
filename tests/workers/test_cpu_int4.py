"""The CPU's small-step weights: a bf16 weight on a 4-bit grid (what a GGUF Q4_1 dequantises to) keeps that grid packed
and small steps run on it, giving what the bf16 weight gives; a weight off any grid is left alone; the output
projection's int8 copy stays within half a step of its row's scale; the default model decodes greedily to the same
tokens with both or neither, but where its top two are near-tied."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from worker_helpers import make_runner

from stride.model.files import default_model_path
from stride.workers import cpu_int4
from stride.workers.models.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelHead

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


def test_a_layer_runs_small_steps_on_its_grid_and_larger_ones_on_bf16() -> None:
    layer = ColumnParallelLinear(128, [96])
    layer.weight.data = q4_1_weight(96, 128)
    grid = cpu_int4.int4_grid(layer.weight.data)
    assert grid is not None
    calls: list[int] = []

    def spy(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return grid(x)

    layer.int4 = spy
    for rows in (1, cpu_int4.MAX_ROWS, cpu_int4.MAX_ROWS + 1, 64):
        layer(torch.randn(rows, 128).to(torch.bfloat16))
    assert calls == [1, cpu_int4.MAX_ROWS]


@pytest.mark.slow
def test_the_default_model_decodes_the_same_greedy_tokens_on_its_grids() -> None:
    """Every one of the default model's Q4_1 projections gets its grid; 48 greedy steps from two prompts pick the
    tokens the bf16 weights pick, but where those weights' top two log-probs are within 0.05 of each other."""
    torch.set_num_threads(1)
    plain = make_runner(default_model_path(), device="cpu", dtype="bfloat16", block_size=16, num_blocks=16,
                        max_num_seqs=1, cpu_int4=False, cpu_int8_head=False)
    fast = make_runner(default_model_path(), device="cpu", dtype="bfloat16", block_size=16, num_blocks=16,
                       max_num_seqs=1, cpu_int4=True, cpu_int8_head=True)
    on_grid = [m for m in fast.model.modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.int4 is not None]
    assert len(on_grid) == 4 * fast.args.num_layers  # qkv, o, gate_up and down of every layer
    assert all(getattr(m, "int4", None) is None for m in plain.model.modules())
    assert fast.model.lm_head.int8 is not None and plain.model.lm_head.int8 is None
    table = np.arange(16, dtype=np.int32)[None, :]
    flips = compared = 0
    for prompt in ([1, 504, 3458, 314, 4649, 30], [1, 1976, 253, 1345, 1007, 282, 253]):
        ids = list(prompt)
        step = list(prompt)
        for _ in range(24):
            n = len(ids)
            args = (np.array(step), np.arange(n - len(step), n), [0], [len(step)], [n], table)
            want = torch.log_softmax(plain.forward(*args)[0].double(), -1)
            got = torch.log_softmax(fast.forward(*args)[0].double(), -1)
            top2 = want.topk(2)
            compared += 1
            if int(got.argmax()) != int(top2.indices[0]):
                flips += 1
                assert float(top2.values[0] - top2.values[1]) < 0.05
            nxt = int(top2.indices[0])  # both follow the bf16 weights' choice
            ids.append(nxt)
            step = [nxt]
    assert compared == 48 and flips <= 4


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
    calls: list[int] = []

    def spy(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return rows(x)

    head.int8 = spy
    for n in (1, cpu_int4.MAX_ROWS, cpu_int4.MAX_ROWS + 1):
        head(torch.randn(n, 64).to(torch.bfloat16))
    assert calls == [1, cpu_int4.MAX_ROWS]
    # Negative control: another weight's int8 copy is far off.
    other = cpu_int4.Int8Rows(torch.randn(320, 64, generator=g).to(torch.bfloat16))
    assert (other(x).float() - ref).abs().max() > 0.2 * ref.abs().max()
