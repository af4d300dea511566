"""The rank worker's step handling: a penalised sequence's prompt and earlier output are collected from the
step inputs as they flow past (split at its prompt length), so they reach the sampler's penalties."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from stride.params import SamplingParams
from stride.workers.process import ModelStepper, _History, _needs_history


def test_penalties_need_history_and_plain_sampling_does_not() -> None:
    assert _needs_history(SamplingParams(repetition_penalty=1.2))
    assert _needs_history(SamplingParams(presence_penalty=0.5))
    assert _needs_history(SamplingParams(frequency_penalty=-0.5))
    assert not _needs_history(SamplingParams(temperature=0.7, top_p=0.9))


def test_collect_splits_each_sequence_at_its_prompt_length() -> None:
    stepper = ModelStepper.__new__(ModelStepper)  # only the history bookkeeping is exercised
    params = SamplingParams(repetition_penalty=1.3)
    # Slot 5 is penalised (prompt of 4 tokens, resumed after preemption: prompt + 2 outputs recomputed);
    # slot 2 is not, and its tokens must not be collected.
    stepper._history = {5: _History(params, 4, "r5")}
    buf = SimpleNamespace(
        seq_slots=np.array([2, 5], np.int32),
        query_lens=np.array([3, 6], np.int32),
        token_ids=np.array([70, 71, 72, 10, 11, 12, 13, 20, 21], np.int32),
        positions=np.array([7, 8, 9, 0, 1, 2, 3, 4, 5], np.int32),
    )
    stepper._collect(buf, 2)  # type: ignore[arg-type]
    hist = stepper._history[5]
    assert (hist.prompt_len, hist.prompt, hist.output) == (4, [10, 11, 12, 13], [20, 21])
    # A following decode step appends to the output side only.
    buf2 = SimpleNamespace(seq_slots=np.array([5], np.int32), query_lens=np.array([1], np.int32),
                           token_ids=np.array([22], np.int32), positions=np.array([6], np.int32))
    stepper._collect(buf2, 1)  # type: ignore[arg-type]
    assert (hist.prompt, hist.output) == ([10, 11, 12, 13], [20, 21, 22])


def test_cpu_default_dtype_is_bf16_with_native_bf16_or_avx2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from stride.workers import runner

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    (tmp_path / "bf16").write_text("flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n")
    (tmp_path / "amx").write_text("flags\t\t: fpu amx_tile amx_bf16\n")
    (tmp_path / "avx2").write_text("flags\t\t: fpu sse avx2 avx512f\n")
    (tmp_path / "old").write_text("flags\t\t: fpu sse sse4_2 avx\n")
    assert runner.cpu_has_bf16(str(tmp_path / "bf16")) and runner.cpu_has_bf16(str(tmp_path / "amx"))
    assert not runner.cpu_has_bf16(str(tmp_path / "avx2")) and not runner.cpu_has_bf16(str(tmp_path / "none"))
    runs = {name: runner.cpu_runs_bf16(str(tmp_path / name)) for name in ("bf16", "amx", "avx2", "old", "none")}
    assert runs == {"bf16": True, "amx": True, "avx2": True, "old": False, "none": False}
    # torch told to stay at AVX2 (ATEN_CPU_CAPABILITY): the worker takes the CPU for an AVX2-only one, and at
    # 'default' (no AVX2 kernels) for an older one.
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert not runner.cpu_has_bf16(str(tmp_path / "bf16")) and not runner.cpu_has_bf16(str(tmp_path / "amx"))
    assert runner.cpu_runs_bf16(str(tmp_path / "bf16"))
    assert runner.cpu_flags(str(tmp_path / "bf16")) == {"flags", ":", "fpu", "sse", "avx2"}
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert not runner.cpu_runs_bf16(str(tmp_path / "bf16"))
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    assert runner.cpu_has_bf16(str(tmp_path / "bf16"))
    for bf16, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(runner, "cpu_runs_bf16", lambda bf16=bf16: bf16)
        assert runner.resolve_device_dtype("cpu", "") == (torch.device("cpu"), want)
        assert runner.resolve_device_dtype("cpu", "float32")[1] == torch.float32  # asked for, always given


def test_the_simulated_backend_prices_the_launchs_kv_dtype_and_weights() -> None:
    """The sim's step time follows --kv-dtype and --quantize as the planner prices them: a decode step over long
    contexts reads half the K/V bytes at fp8, and 4-bit projections a quarter of the weights'."""
    from stride.config import IpcConfig, StrideConfig, WorkerConfig
    from stride.workers.process import SimStepper

    def step_ms(**worker: str) -> float:
        config = StrideConfig(ipc=IpcConfig(run_dir="/tmp", launch_id="sim"),
                              worker=WorkerConfig(model="llama-3.1-8b", backend="sim", **worker))
        return SimStepper(config).backend.step_time(256, 256, 256 * 4096) * 1e3

    plain, fp8, w4 = step_ms(), step_ms(kv_dtype="fp8"), step_ms(quantize="w4a16")
    assert fp8 < 0.75 * plain  # K/V (256 x 4k tokens, 128 KiB each) dominate this step
    assert w4 < plain and w4 - plain > fp8 - plain  # the weights are the smaller part here
    assert step_ms(kv_dtype="auto") == plain  # negative control: the default prices 16-bit K/V
