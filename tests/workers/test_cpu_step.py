"""The compiled CPU decode step (stride.workers.cpu_step): built in a child process, cached, loaded, and run by the
runner for the decode steps it covers, with eager's answers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stride.workers import cpu_int4, cpu_step
from stride.workers.runner import ModelRunner
from tests.worker_helpers import make_checkpoint, make_runner, write_gguf

pytestmark = pytest.mark.skipif(not cpu_step.compiler_available(), reason="needs a C++ compiler")

BLOCK = 16


def wait_ready(runner: ModelRunner, timeout: float = 900.0) -> cpu_step.CompiledStep:
    """The runner's compiled step once its build is done (as the worker's polls would load it)."""
    package = runner.compiled.wait(timeout)
    assert not runner.compiled.building, "the compiled step took too long to build"
    assert package is not None, "the build ended without a package (see the .failed log in the cache)"
    return package


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("cpu_step")
    hf = make_checkpoint("tiny-llama", folder / "hf", torch.float32)
    return write_gguf(hf, folder / "m.gguf", "Q4_1")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cpu_step_cache")


def runner_of(gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, compile_steps: bool) -> ModelRunner:
    """Room for a step one row past the compiled range and four blocks a row: the range is 1..4 rows on a CPU with
    AMX, 1..16 with AVX-512 BF16 alone, 1..64 on an AVX2-only one (``cpu_int4.max_small_rows``)."""
    monkeypatch.setenv("STRIDE_CPU_STEP_CACHE", str(cache))
    rows = cpu_int4.EMULATED_MAX_ROWS + 1
    return make_runner(str(gguf), device="cpu", dtype="bfloat16", block_size=BLOCK, num_blocks=4 * rows,
                       max_num_seqs=rows, max_model_len=256, cpu_compile=compile_steps)


def decode(runner: ModelRunner, batch: int, steps: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefill ``batch`` random prompts of different lengths eagerly (one step), then ``steps`` greedy decode steps;
    returns each decode step's logits and the K caches after them."""
    rng = np.random.default_rng(seed)
    vocab = runner.args.vocab_size
    tables = rng.permutation(runner.num_blocks)[: batch * 4].astype(np.int32).reshape(batch, 4)
    lens = rng.integers(5, 30, batch)
    prompt = rng.integers(0, vocab, int(lens.sum()))
    positions = np.concatenate([np.arange(n) for n in lens])
    slots = np.arange(batch)
    logits = runner.forward(prompt, positions, slots, lens, lens, tables)
    out = []
    for _ in range(steps):
        tokens = logits.argmax(-1).numpy()
        lens = lens + 1
        logits = runner.forward(tokens, lens - 1, slots, np.ones(batch, np.int64), lens, tables)
        out.append(logits)
    return out, [k.clone() for k in runner.kv_cache.k_caches]


@pytest.mark.parametrize("emulated", [False, True])
def test_the_compiled_step_gives_eagers_answers_and_writes_the_same_cache(
        gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, emulated: bool) -> None:
    """As this CPU runs it, and as one that emulates bf16 (AVX2 only) would: there the projections hold no bf16
    weight (their grids take every step: ``cpu_int4.drop_large_step_weights``), so the package is built from a model
    whose weights are meta tensors, and the eager step past its range multiplies the grids unpacked."""
    from stride.workers import runner as runner_module

    if emulated:
        if not runner_module.cpu_has_bf16():
            pytest.skip("this CPU emulates bf16 itself: the case without the emulation ran this path")
        monkeypatch.setattr(runner_module, "cpu_has_bf16", lambda: False)
        cache = cache / "emulated"  # its own folder: the package built here is the only one in it
        cache.mkdir(exist_ok=True)
    eager = runner_of(gguf, cache, monkeypatch, compile_steps=False)
    assert eager.compiled is None
    compiled = runner_of(gguf, cache, monkeypatch, compile_steps=True)
    rows = compiled.compiled.step.max_rows  # the rows the packed small-step copies take on this CPU
    native = runner_module.cpu_has_bf16()
    assert rows == cpu_int4.max_small_rows(native)
    assert compiled.model.layers[0].mlp.down_proj.weight.is_meta is not native
    package = wait_ready(compiled)
    assert [package.path] == list(cache.glob("*.pt2"))
    for batch in sorted({1, min(3, rows), rows}):
        want, want_k = decode(eager, batch, 6, seed=batch)
        got, got_k = decode(compiled, batch, 6, seed=batch)
        for a, b in zip(want, got, strict=True):
            assert (a - b).abs().max() <= 0.02 * a.abs().max()
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        for a, b in zip(want_k, got_k, strict=True):  # K as eager writes it (to bf16 rounding of fused norms)
            assert (a.float() - b.float()).abs().max() <= 0.05 * a.float().abs().max()
        assert compiled.last_step_compiled and not eager.last_step_compiled
    assert compiled.compiled.find(1, 16) is package and compiled.compiled.find(rows, 1) is package
    assert compiled.compiled.find(rows + 1, 2) is None and compiled.compiled.find(1, 17) is None  # 256 tokens
    _, _ = decode(compiled, rows + 1, 1)  # a larger step: eager
    assert not compiled.last_step_compiled


def test_a_cached_package_loads_at_once_and_a_stale_key_builds_anew(
        gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = runner_of(gguf, cache, monkeypatch, compile_steps=True)
    wait_ready(first)
    again = runner_of(gguf, cache, monkeypatch, compile_steps=True)
    assert again.compiled.ready is not None and not again.compiled.building  # from the cache
    settings = {"model": str(gguf), "dtype": "bfloat16", "cpu_int4": True, "cpu_int8_head": True,
                "native_bf16": True}
    step = again.compiled.step
    key = cpu_step.package_key(settings, step)
    assert cpu_step.package_key(dict(settings, cpu_int4=False), step) != key
    assert cpu_step.package_key(settings, cpu_step.StepRange(1, 2, step.max_blocks, BLOCK)) != key


def test_the_comparison_sees_a_package_given_other_weights(gguf: Path, cache: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the package reads the weights it is given (none are baked in): with the final norm's
    weight doubled its logits double, and the comparison above would see it."""
    eager = runner_of(gguf, cache, monkeypatch, compile_steps=False)
    compiled = runner_of(gguf, cache, monkeypatch, compile_steps=True)
    package = wait_ready(compiled)
    names = [name for name, _ in cpu_step.weight_tensors(compiled.model)]
    caches = len(package._inputs) - len(names)
    index = caches + names.index("norm.weight")
    package._inputs[index] = package._inputs[index] * 2
    want, _ = decode(eager, 1, 2, seed=3)
    got, _ = decode(compiled, 1, 2, seed=3)
    assert compiled.last_step_compiled
    assert (want[0] - got[0]).abs().max() > 0.5 * want[0].abs().max()
    assert torch.allclose(got[0], 2 * want[0], rtol=0.05, atol=0.02 * want[0].abs().max().item())


def test_a_failed_build_leaves_the_worker_eager_and_is_not_retried(gguf: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRIDE_CPU_STEP_CACHE", str(tmp_path))
    model = make_runner(str(gguf), device="cpu", dtype="bfloat16", block_size=BLOCK, num_blocks=8).model
    settings = {"model": str(gguf), "dtype": "no-such-dtype", "cpu_int4": True, "cpu_int8_head": True,
                "native_bf16": True}
    step = cpu_step.StepRange(1, 4, 4, BLOCK)
    build = cpu_step.BackgroundStep(settings, step, model, [])
    assert build.building
    assert build.wait(120) is None and not build.building and build.find(1, 1) is None
    failed = list(tmp_path.glob("*.failed"))
    assert len(failed) == 1 and "no-such-dtype" in failed[0].read_text()
    again = cpu_step.BackgroundStep(settings, step, model, [])
    assert not again.building and again.ready is None


def test_no_compiled_step_where_it_does_not_apply(gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 (no packed small-step copies) and the compile switched off: no build is started."""
    monkeypatch.setenv("STRIDE_CPU_STEP_CACHE", str(cache))
    assert make_runner(str(gguf), device="cpu", dtype="float32", block_size=BLOCK, num_blocks=8,
                       cpu_compile=True).compiled is None
    assert runner_of(gguf, cache, monkeypatch, compile_steps=False).compiled is None
