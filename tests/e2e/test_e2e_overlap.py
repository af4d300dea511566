"""Overlapped scheduling end to end: the default model served with it (the default) and without (``--no-overlap``)
answers the same greedy requests with the same tokens, under forced preemption (a pool too small for the
requests at once) and with stop strings, and a trace recorded with it replays.

The two launches batch differently (a step built ahead cannot preempt, so the two interleave the requests
differently), and float32 matmuls over different batches may flip a near-tie; so, as in ``test_e2e_api``, tokens
must agree up to a position where the top two log-probs were within ``NEAR_TIE`` of each other."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from e2e_helpers import StrideServer

from stride.client import Client

NEAR_TIE = 0.05
PROMPTS = ["The capital of France is", "Water is made of", "Once upon a time, there was a",
           "The three primary colours are", "def fibonacci(n):", "My favourite food is",
           "The sun rises in the", "A haiku about autumn:"]
PREAMBLE = "Here is a long story about many things, told slowly and in great detail. " * 3
"""Makes each prompt about 50 tokens (the first two blocks shared): eight of them with their outputs need far more
than the pool's 12 blocks."""


def _serve(*extra: str) -> tuple[list[dict[str, Any]], float, float]:
    """Every prompt at once, greedy, 44 tokens with two top log-probs; every other one with a stop string.
    Returns the choices in prompt order, the launch's preemption count and its steps launched early."""
    with StrideServer("--max-num-seqs", "8", "--num-blocks", "12", "--block-size", "16", "--max-model-len", "256",
                      *extra) as srv:
        def one(i: int) -> dict[str, Any]:
            body = {"model": srv.model, "prompt": PREAMBLE + PROMPTS[i], "max_tokens": 44, "temperature": 0,
                    "logprobs": 2, **({"stop": [".", "\n\n"]} if i % 2 else {})}
            status, _, data = srv.post("/v1/completions", body, timeout=300)
            assert status == 200, data
            choice: dict[str, Any] = json.loads(data)["choices"][0]
            return choice

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            choices = list(pool.map(one, range(len(PROMPTS))))
        time.sleep(1.2)  # the scheduler's counters reach the frontend every half second
        preemptions = srv.metric("stride:num_preemptions_total")
        early = srv.metric("stride:early_steps_total")
    assert srv.leftovers() == [], srv.tail()
    return choices, preemptions, early


def _agree(a: dict[str, Any], b: dict[str, Any]) -> None:
    ta, tb = a["logprobs"]["tokens"], b["logprobs"]["tokens"]
    for i, (x, y) in enumerate(zip(ta, tb, strict=False)):
        if x != y:
            tops = sorted(a["logprobs"]["top_logprobs"][i].values(), reverse=True)
            assert len(tops) == 2 and tops[0] - tops[1] < NEAR_TIE, f"token {i}: {x!r} vs {y!r} ({tops})"
            return
    assert len(ta) == len(tb) and a["text"] == b["text"] and a["finish_reason"] == b["finish_reason"]


@pytest.fixture(scope="module")
def no_overlap() -> tuple[list[dict[str, Any]], float, float]:
    """The reference launch (``--no-overlap``, nothing launched early), served once for both tests below."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("STRIDE_EARLY_LAUNCH", "0")
        return _serve("--no-overlap")


@pytest.mark.slow
def test_greedy_outputs_equal_with_overlap_on_and_off_under_preemption_and_stop_strings(
        no_overlap: tuple[list[dict[str, Any]], float, float]) -> None:
    on, on_preempted, _ = _serve()
    off, off_preempted, _ = no_overlap
    assert on_preempted > 0 and off_preempted > 0  # the pool was too small for every request at once
    assert any(c["finish_reason"] == "stop" for c in on)  # a stop string cut some
    for a, b in zip(on, off, strict=True):
        _agree(a, b)
    # Negative control: the comparison fails on a real difference.
    changed = dict(on[0], logprobs=dict(on[0]["logprobs"], tokens=["<x>"] + on[0]["logprobs"]["tokens"][1:]))
    tops = sorted(on[0]["logprobs"]["top_logprobs"][0].values(), reverse=True)
    if tops[0] - tops[1] >= NEAR_TIE:
        with pytest.raises(AssertionError):
            _agree(changed, off[0])


@pytest.mark.slow
def test_greedy_outputs_equal_with_early_launch_under_preemption_and_stop_strings(
        monkeypatch: pytest.MonkeyPatch, no_overlap: tuple[list[dict[str, Any]], float, float]) -> None:
    """Early launch (on by default on a GPU only): rank 0 launches a step built ahead before it reports the step in
    flight, the placeholder tokens filled from that step's sampled tokens on the device, not the host's copy."""
    monkeypatch.setenv("STRIDE_EARLY_LAUNCH", "1")
    early, preempted, launched_early = _serve()
    off, _, not_early = no_overlap
    assert preempted > 0 and any(c["finish_reason"] == "stop" for c in early)
    assert launched_early > 0 and not_early == 0  # the path ran (and the counter counts only it)
    for a, b in zip(early, off, strict=True):
        _agree(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_early_launch_on_cuda_gives_the_tokens_of_one_step_at_a_time(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU early launch is the default: the tokens come back through pinned memory behind a CUDA event and the
    next step's are filled on the device, from decode graphs. Requests one at a time, so both launches run the same
    steps and bf16 greedy tokens must match exactly."""
    from worker_helpers import make_checkpoint

    path = make_checkpoint("smollm2-135m", tmp_path / "m", torch.bfloat16, num_layers=4)

    # The suite's per-step invariant walk makes the scheduler's cycle longer than this small model's step, so no step
    # would arrive while the one before is still on the device (seen: none launched early on an H100 with it on).
    monkeypatch.setenv("STRIDE_CHECK_INVARIANTS", "0")

    def serve(early: str) -> tuple[list[list[int]], float]:
        monkeypatch.setenv("STRIDE_EARLY_LAUNCH", early)
        # Eight sequences at most: four decode graphs to capture, not twenty (a start on an empty Triton cache).
        with StrideServer("--model", str(path), "--dtype", "bfloat16", "--max-model-len", "512",
                          "--max-num-seqs", "8") as srv:
            with Client(f"ipc://{srv.run_dir}/client.sock", timeout=120) as c:
                outs = [c.generate(p, max_tokens=40, temperature=0, ignore_eos=True).token_ids for p in PROMPTS]
            time.sleep(1.2)
            launched_early = srv.metric("stride:early_steps_total")
        assert srv.leftovers() == [], srv.tail()
        return outs, launched_early

    (on, early), (off, none) = serve("1"), serve("0")
    # A step arrives early only while the one before is still on the device: with a model this small, about every
    # other step (seen on an H100: 80 of 160); a quarter of the 320 is the floor.
    assert early >= len(PROMPTS) * 10 and none == 0
    assert on == off
    assert len({tuple(t) for t in on}) > 1  # control: the prompts led to different outputs


@pytest.mark.slow
def test_a_trace_recorded_by_an_overlapped_launch_replays(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    with StrideServer("--max-num-seqs", "4", "--num-blocks", "12", "--block-size", "16", "--max-model-len", "256",
                      "--trace", str(trace)) as srv:
        def one(i: int) -> None:
            body = {"model": srv.model, "prompt": PROMPTS[i], "max_tokens": 30, "temperature": 0,
                    **({"stop": ["."]} if i % 2 else {})}
            status, _, data = srv.post("/v1/completions", body, timeout=300)
            assert status == 200, data

        with ThreadPoolExecutor(6) as pool:
            list(pool.map(one, range(6)))
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(r.get("ahead") for r in records if r["kind"] == "schedule")
    out = subprocess.run([sys.executable, "-m", "stride", "replay", str(trace)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "replay OK" in out.stdout, out.stdout + out.stderr
