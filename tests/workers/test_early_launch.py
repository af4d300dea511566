"""Rank 0's early launch (``ModelStepper.launch`` with the step in flight): a step built ahead gets its placeholder
tokens from that step's sampled tokens on the device, and is launched early only when nothing needs them on the host.
The forward is a fake that records its input tokens and makes row ``i`` of a step sample ``10 + token_i``; the
sampler is the real one (greedy)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from stride.ipc import messages as m
from stride.params import SamplingParams
from stride.workers.process import ModelStepper
from stride.workers.sampling import Sampler

VOCAB = 64


class _Runner:
    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def step(self, buf: Any, num_tokens: int, num_seqs: int, token_ids: Any = None) -> torch.Tensor:
        ids = buf.token_ids[:num_tokens] if token_ids is None else token_ids
        ids = [int(t) for t in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
        self.seen.append(ids)
        logits = torch.zeros(num_seqs, VOCAB)
        last = np.cumsum(buf.query_lens[:num_seqs]) - 1
        for row, pos in enumerate(last.tolist()):
            logits[row, (10 + ids[pos]) % VOCAB] = 5.0
        return logits


def _stepper() -> ModelStepper:
    stepper = ModelStepper.__new__(ModelStepper)  # the step handling alone
    stepper.runner = _Runner()  # type: ignore[assignment]
    stepper.sampler = Sampler(4, VOCAB)
    stepper.samples, stepper.device_type, stepper._history = True, "cpu", {}
    return stepper


def _bank(token_ids: list[int], query_lens: list[int], sample: list[int], slots: list[int] | None = None,
          ) -> SimpleNamespace:
    n = len(query_lens)
    return SimpleNamespace(token_ids=np.array(token_ids, np.int32), query_lens=np.array(query_lens, np.int32),
                           seq_slots=np.array(range(n) if slots is None else slots, np.int32),
                           sample_flags=np.array(sample, np.int8),
                           sampled_ids=np.full(n, -1, np.int32), logprobs=np.zeros(n, np.float32))


def test_a_step_launched_early_takes_the_tokens_the_step_in_flight_samples() -> None:
    stepper = _stepper()
    greedy = SamplingParams(temperature=0)
    # Step 1: four sequences; rows 0 and 2 sample (tokens 12 and 17), rows 1 and 3 are prefill chunks that do not.
    first = m.StepDescriptor(1, 4, 6, new_seqs=[m.NewSequence(s, f"r{s}", greedy, 4) for s in range(4)], bank=0)
    buf1 = _bank([1, 2, 3, 5, 7, 8], [2, 2, 1, 1], [1, 0, 1, 0])
    launched = stepper.launch(first, buf1)  # type: ignore[arg-type]
    # Step 2, built ahead: slot 0 decodes on step 1's row 0, slot 1 goes on with its prompt, slot 3 names step 1's
    # row 1 (which sampled nothing: token 0, as the host's filling gives), slot 2 decodes on step 1's row 2.
    ahead = m.StepDescriptor(2, 4, 5, bank=1, ahead=True)
    buf2 = _bank([-1, 9, 9, -2, -3], [1, 2, 1, 1], [1, 1, 0, 1], slots=[0, 1, 3, 2])
    assert stepper.can_launch_early(ahead, launched)
    stepper.launch(ahead, buf2, before=launched)  # type: ignore[arg-type]
    assert stepper.runner.seen[-1] == [12, 9, 9, 0, 17]  # type: ignore[attr-defined]
    assert buf1.sampled_ids.tolist() == [-1] * 4  # not yet reported
    assert stepper.finish(launched) == []
    assert buf1.sampled_ids.tolist() == [12, -1, 17, -1]


def test_only_a_step_built_ahead_of_the_one_in_flight_with_nothing_read_on_the_host_launches_early() -> None:
    stepper = _stepper()
    first = m.StepDescriptor(1, 1, 1, new_seqs=[m.NewSequence(0, "r0", SamplingParams(temperature=0), 1)], bank=0)
    launched = stepper.launch(first, _bank([3], [1], [1]))  # type: ignore[arg-type]
    ok = m.StepDescriptor(2, 1, 1, bank=1, ahead=True)
    assert stepper.can_launch_early(ok, launched)
    assert not stepper.can_launch_early(m.StepDescriptor(2, 1, 1, bank=1), launched)  # built after the update
    assert not stepper.can_launch_early(m.StepDescriptor(2, 1, 1, bank=0, ahead=True), launched)  # another bank
    assert not stepper.can_launch_early(m.StepDescriptor(2, 1, 1, bank=1, ahead=True, masked_rows=[0]), launched)
    stepper._history[1] = object()  # type: ignore[assignment]  # a penalised sequence reading its inputs
    assert not stepper.can_launch_early(ok, launched)
