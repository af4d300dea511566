#!/usr/bin/env python
"""How close the compiled CPU decode step's answers are to the float32 model's, beside the eager bf16 step's.

Runs the default model (or ``--model``) three ways on one sequence per prompt, following the float32 model's greedy
choices: float32, eager bf16 (the grids and int8 head, as served) and the compiled bf16 step
(:mod:`stride.workers.cpu_step`, built first if it is not cached). Prints, for eager and compiled: the tokens where
the greedy choice differs from float32's, with float32's top-two log-prob gap there, and the per-step largest
|log-prob difference| from float32 (mean and max). Prints figures; asserts nothing (the mechanism's tests are
``tests/workers/test_cpu_step.py``; the default model's build takes 80-100 s, too long for the suite).

    .venv/bin/python scripts/compare_cpu_step.py --steps 40
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from stride.config import WorkerConfig
from stride.model.files import default_model_path
from stride.workers.runner import ModelRunner, RunnerConfig

PROMPTS = ([1, 504, 3458, 314, 4649, 30], [1, 1976, 253, 1345, 1007, 282, 253], [1, 28, 5248, 1159, 253, 1789, 30])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="GGUF file (default: the default model)")
    parser.add_argument("--steps", type=int, default=40, help="greedy steps per prompt")
    args = parser.parse_args()
    model = args.model or default_model_path()

    def runner(dtype: str, compiled: bool) -> ModelRunner:
        worker = WorkerConfig(model=model, device="cpu", dtype=dtype, cpu_compile=compiled)
        return ModelRunner(RunnerConfig(worker, num_blocks=16, max_num_seqs=1, max_model_len=256))

    reference, eager, compiled = runner("float32", False), runner("bfloat16", False), runner("bfloat16", True)
    if compiled.compiled is None:
        raise SystemExit("no compiled step here (no C++ compiler, or no packed small-step weights)")
    started = time.monotonic()
    if compiled.compiled.wait() is None:
        raise SystemExit(f"the compiled step did not build: {compiled.compiled.path.with_suffix('.failed')}")
    print(f"compiled step ready after {time.monotonic() - started:.0f} s")
    table = np.arange(16, dtype=np.int32)[None, :]
    flips: dict[str, list[float]] = {"eager": [], "compiled": []}
    drift: dict[str, list[float]] = {"eager": [], "compiled": []}
    for prompt in PROMPTS:
        ids, step = list(prompt), list(prompt)
        for _ in range(args.steps):
            n = len(ids)
            inputs = (np.array(step), np.arange(n - len(step), n), [0], [len(step)], [n], table)
            want = torch.log_softmax(reference.forward(*inputs)[0].double(), -1)
            top2 = want.topk(2)
            for name, r in (("eager", eager), ("compiled", compiled)):
                got = torch.log_softmax(r.forward(*inputs)[0].double(), -1)
                drift[name].append(float((got - want).abs().max()))
                if int(got.argmax()) != int(top2.indices[0]):
                    flips[name].append(float(top2.values[0] - top2.values[1]))
            ids.append(int(top2.indices[0]))
            step = [ids[-1]]
    steps = len(PROMPTS) * args.steps
    for name in ("eager", "compiled"):
        print(f"{name:8s}: {len(flips[name])} of {steps} greedy tokens differ from float32's (its top-two gaps there: "
              f"{', '.join(f'{g:.3f}' for g in flips[name]) or '-'}); per-step max |log-prob - float32's| mean "
              f"{np.mean(drift[name]):.3f}, max {max(drift[name]):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
