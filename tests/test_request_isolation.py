"""A fault in one request stays in that request, process by process: a sequence the worker cannot set up, an
output the tokenizer cannot turn into text, a request the scheduler cannot admit. Each fails alone (the rest of
the batch goes on), beside a control where nothing fails. And the sweep that removes what a killed launch left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from stride.config import CacheConfig, IpcConfig, SchedulerConfig, StrideConfig
from stride.ipc import messages as m
from stride.ipc.rundir import OWNER_FILE, sweep_stale_launches, write_owner
from stride.ipc.shm import SHM_DIR
from stride.params import SamplingParams
from stride.sched.plan import StepArrays
from stride.sched.process import SchedulerLoop
from stride.workers.process import ModelStepper
from stride.workers.sampling import Sampler

VOCAB = 64

# ------------------------------------------------------------------ scheduler


def _loop(tmp_path: Path) -> tuple[SchedulerLoop, StepArrays]:
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    cc = CacheConfig(block_size=4, num_blocks=32, check_invariants=True)
    config = StrideConfig(ipc=IpcConfig(run_dir=str(tmp_path), launch_id="t1"), cache=cc, scheduler=sc)
    buf = StepArrays(sc, cc)
    return SchedulerLoop(config, buf, [2]), buf  # type: ignore[arg-type]


def _tokenized(req_id: str, params: SamplingParams | None = None) -> m.TokenizedRequest:
    return m.TokenizedRequest(req_id, "t", [5, 6, 7, 8, 9], params or SamplingParams(max_tokens=4), 0)


@pytest.mark.parametrize("fail", [False, True])
def test_a_sequence_the_worker_failed_ends_alone(tmp_path: Path, fail: bool) -> None:
    loop, buf = _loop(tmp_path)
    for r in ("r0", "r1"):
        assert loop.on_request(_tokenized(r), 0.0) is None
    desc = loop.next_step(0.0)
    assert desc is not None and desc.num_seqs == 2
    buf.sampled_ids[:2] = [11, 12]
    failed = [m.SequenceFailure("r1", "ValueError: bad state")] if fail else []
    outs = loop.on_step_done(m.StepDone(desc.step, failed=failed), 1.0)[0]
    by_id = {o.req_id: o for o in outs}
    assert by_id["r0"].token_ids == [11] and by_id["r0"].finish_reason is None
    if fail:
        assert by_id["r1"].finish_reason == "error" and "bad state" in (by_id["r1"].error or "")
        assert by_id["r1"].token_ids == [] and "r1" not in loop.core.requests and "r1" not in loop.routes
    else:  # control: the same step without the failure runs both on
        assert by_id["r1"].token_ids == [12] and "r1" in loop.core.requests
    loop.core.bm.assert_invariants()
    desc = loop.next_step(2.0)
    assert desc is not None and desc.num_seqs == (1 if fail else 2)  # the rest of the batch goes on


def test_a_request_the_scheduler_cannot_admit_fails_alone(tmp_path: Path) -> None:
    loop, _ = _loop(tmp_path)
    original = loop.core.add_request

    def flaky(req_id: str, *args: Any) -> Any:
        if req_id == "bad":
            raise RuntimeError("admission bug")
        return original(req_id, *args)

    loop.core.add_request = flaky  # type: ignore[method-assign]
    failed = loop.on_request(_tokenized("bad"), 0.0)
    assert failed is not None and (failed.status, failed.code) == (500, "internal_error")
    assert loop.on_request(_tokenized("good"), 0.0) is None  # control: the next request is admitted
    assert set(loop.core.requests) == {"good"} and set(loop.routes) == {"good"}


# ------------------------------------------------------------------ worker


class _Runner:
    def step(self, buf: Any, num_tokens: int, num_seqs: int, token_ids: Any = None) -> torch.Tensor:
        logits = torch.full((num_seqs, VOCAB), -10.0)
        logits[:, 7] = 10.0
        return logits


def _stepper(fail_slot: int | None) -> ModelStepper:
    stepper = ModelStepper.__new__(ModelStepper)  # the step handling alone: a fake forward, a real sampler
    stepper.runner = _Runner()  # type: ignore[assignment]
    stepper.sampler = Sampler(4, VOCAB)
    stepper.samples = True  # rank 0
    stepper.device_type = "cpu"
    stepper._history = {}
    add = stepper.sampler.add_sequence

    def add_sequence(slot: int, *args: Any) -> None:
        add(slot, *args)  # state half made, then the fault: the worker must undo it
        if slot == fail_slot:
            raise OverflowError("cannot set up")

    stepper.sampler.add_sequence = add_sequence  # type: ignore[method-assign]
    return stepper


def _buf(num_seqs: int) -> SimpleNamespace:
    s = 4
    return SimpleNamespace(seq_slots=np.arange(s, dtype=np.int32), sample_flags=np.ones(s, np.int8),
                           query_lens=np.ones(s, np.int32), sampled_ids=np.full(s, -1, np.int32),
                           logprobs=np.zeros(s, np.float32), top_ids=np.zeros((s, 20), np.int32),
                           top_logprobs=np.zeros((s, 20), np.float32))


@pytest.mark.parametrize("penalised", [False, True])
def test_a_sequence_whose_sampler_state_fails_is_reported_alone(penalised: bool) -> None:
    params = SamplingParams(temperature=0, repetition_penalty=1.2 if penalised else 1.0)
    desc = m.StepDescriptor(1, 3, 3, new_seqs=[m.NewSequence(i, f"r{i}", params, 1) for i in range(3)])
    buf = _buf(3)
    buf.token_ids, buf.positions = np.zeros(3, np.int32), np.zeros(3, np.int32)
    stepper = _stepper(fail_slot=1)
    failed = stepper.run(desc, buf)  # type: ignore[arg-type]
    assert [(f.req_id, "cannot set up" in f.error) for f in failed] == [("r1", True)]
    assert buf.sampled_ids[:3].tolist() == [7, -1, 7]
    assert stepper.sampler.params(1) is None and stepper.sampler.params(0) is not None
    # Control: with no fault every row samples and nothing is reported.
    control = _stepper(fail_slot=None)
    buf = _buf(3)
    buf.token_ids, buf.positions = np.zeros(3, np.int32), np.zeros(3, np.int32)
    assert control.run(desc, buf) == []  # type: ignore[arg-type]
    assert buf.sampled_ids[:3].tolist() == [7, 7, 7]


# ------------------------------------------------------------------ tokenizer


@pytest.fixture(scope="module")
def tokenizer_worker() -> Any:
    from stride.model.files import default_model_path
    from stride.tokenizer.loader import load_tokenizer
    from stride.tokenizer.process import TokenizerWorker

    try:
        tok = load_tokenizer(default_model_path())
    except Exception as e:  # the default model's package is missing (the GPU machine)
        pytest.skip(f"default model not installed: {e}")
    config = StrideConfig(ipc=IpcConfig(run_dir="/tmp", launch_id="t2"))
    return TokenizerWorker(config, 0, tok)


def test_an_output_the_tokenizer_cannot_take_fails_alone(tokenizer_worker: Any) -> None:
    w = tokenizer_worker
    for r in ("a", "b", "c"):
        out = w.on_generate(m.GenerateRequest(r, "t", SamplingParams(max_tokens=8, logprobs=1), prompt="Hi"))
        assert isinstance(out, m.TokenizedRequest)
    hello = w.tok.encode("Hello", add_special_tokens=False)
    past = w.tok.vocab_size + 10  # a padded model's id past the tokenizer: no text, no failure
    deltas, aborts = w.on_outputs(m.StepOutputs([
        m.TokenOutput("a", hello, logprobs=[-0.5] * len(hello), top_logprobs=[[[hello[0], -0.5]]] * len(hello)),
        m.TokenOutput("b", [-3], logprobs=[-0.5], top_logprobs=[[[1, -0.5]]]),
        m.TokenOutput("c", [past], logprobs=[-0.5], top_logprobs=[[[past, -0.5]]]),
    ]))
    by_id = {d.req_id: d for d in deltas}
    assert isinstance(by_id["a"], m.TextDelta) and by_id["a"].text == "Hello"
    assert isinstance(by_id["b"], m.RequestFailed) and by_id["b"].status == 500
    assert [a.req_id for a in aborts] == ["b"] and "b" not in w.pending
    c = by_id["c"]
    assert isinstance(c, m.TextDelta) and c.text == "" and c.logprobs is not None
    assert c.logprobs[0]["token"] == "" and c.logprobs[0]["bytes"] == []
    assert set(w.pending) == {"a", "c"}  # the others go on


def test_a_tokenizer_fault_fails_its_request(tokenizer_worker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    w = tokenizer_worker

    class Flaky:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def encode(self, text: str, **kw: Any) -> list[int]:
            if "BOOM" in text:
                raise RuntimeError("tokenizer bug")
            return list(real.encode(text, **kw))

    real = w.tok
    monkeypatch.setattr(w, "tok", Flaky())
    out = w.on_generate(m.GenerateRequest("t1", "t", SamplingParams(), prompt="BOOM"))
    assert isinstance(out, m.RequestFailed) and (out.status, out.code) == (500, "internal_error")
    assert "t1" not in w.pending
    assert isinstance(w.on_generate(m.GenerateRequest("t2", "t", SamplingParams(), prompt="fine")),
                      m.TokenizedRequest)  # control: the next request is tokenized
    bad = m.GenerateRequest("t3", "t", SamplingParams(), messages=[{"role": "user", "content": object()}])
    out = w.on_generate(bad)  # a template that cannot render is the client's fault: 400
    assert isinstance(out, m.RequestFailed) and out.status == 400


# ------------------------------------------------------------------ what a killed launch leaves


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_next_launch_sweeps_what_a_killed_one_left(tmp_path: Path) -> None:
    root = tmp_path
    made = {}
    for name, owner in [("dead", _dead_pid()), ("live", os.getpid()), ("unowned", None)]:
        launch_id = f"{name[:2]}{os.getpid() % 10_000:04d}"
        run_dir = root / f"stride-{launch_id}-abc"
        run_dir.mkdir()
        (run_dir / "frontend.sock").write_text("")
        ipc = IpcConfig(run_dir=str(run_dir), launch_id=launch_id)
        if owner is not None:
            write_owner(ipc, owner)
        segment = Path(SHM_DIR, ipc.shm_name("token_ids"))
        segment.write_bytes(b"\0" * 64)
        made[name] = (run_dir, segment)
    try:
        removed = sweep_stale_launches(str(root))
        dead_dir, dead_seg = made["dead"]
        assert not dead_dir.exists() and not dead_seg.exists()
        assert str(dead_dir) in removed and f"/dev/shm/{dead_seg.name}" in removed
        for name in ("live", "unowned"):  # controls: a live launcher's, and one that names no launcher yet
            run_dir, segment = made[name]
            assert run_dir.exists() and segment.exists(), name
        assert (made["live"][0] / OWNER_FILE).read_text() == str(os.getpid())
    finally:
        for _, segment in made.values():
            segment.unlink(missing_ok=True)
