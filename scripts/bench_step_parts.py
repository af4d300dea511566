#!/usr/bin/env python
"""Where one decode step's time goes on the worker: the forward (graph replay or eager) and the sampler, each as
the span between CUDA events, and the rest of the host's wall time (the copy of the sampled ids to the host, the
launches not hidden behind the GPU); and how much of the step's wall time the GPU spends running kernels (the torch
profiler's kernel time over the same steps), which a CUDA-event span cannot tell apart from gaps inside it;
``--kernels N`` lists the N kernels that took most of it.

Runs the worker's own ModelRunner and Sampler (greedy, no penalties: the served default) on a decode batch at a
given context. Prints figures; asserts nothing.

    python3 scripts/bench_step_parts.py --model /dev/shm/llama8b --batches 1,64,256 --context 1024
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from stride.config import WorkerConfig
from stride.params import SamplingParams
from stride.workers.runner import ModelRunner, RunnerConfig
from stride.workers.sampling import Sampler


def measure(runner: ModelRunner, batch: int, context: int, steps: int) -> dict[str, Any]:
    bs = runner.block_size
    per_seq = -(-(context + steps + 12) // bs)  # the warm-up, timed and profiled steps
    rng = np.random.default_rng(0)
    # Blocks drawn at random from the whole cache, as a long-serving block manager hands them out.
    tables = rng.permutation(runner.num_blocks)[: batch * per_seq].astype(np.int32).reshape(batch, per_seq)
    slots = np.arange(batch, dtype=np.int32)
    per_step = max(1, 4096 // context)
    for lo in range(0, batch, per_step):  # prefill, chunked as the scheduler's budget would
        s = slots[lo : lo + per_step]
        runner.forward(rng.integers(0, runner.args.vocab_size, len(s) * context).astype(np.int32),
                       np.tile(np.arange(context, dtype=np.int32), len(s)), s, np.full(len(s), context, np.int32),
                       np.full(len(s), context, np.int32), tables)
    sampler = Sampler(batch, runner.args.vocab_size, device=str(runner.device))
    for i in range(batch):
        sampler.add_sequence(i, SamplingParams(temperature=0.0, ignore_eos=True), [])
    tokens = rng.integers(0, runner.args.vocab_size, batch).astype(np.int32)
    q_lens = np.ones(batch, np.int32)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    parts = {"forward": 0.0, "sample": 0.0, "rest": 0.0, "wall": 0.0}

    def step(i: int, timed: bool) -> np.ndarray:
        pos = np.full(batch, context + i, np.int32)
        t0 = time.perf_counter()
        ev[0].record()
        logits = runner.forward(tokens, pos, slots, q_lens, pos + 1, tables)
        ev[1].record()
        res = sampler.sample(logits, list(range(batch)), record=False)
        ev[2].record()
        host = res.token_ids.cpu().numpy()
        t1 = time.perf_counter()
        if timed:
            torch.cuda.synchronize()
            parts["forward"] += ev[0].elapsed_time(ev[1]) / 1e3
            parts["sample"] += ev[1].elapsed_time(ev[2]) / 1e3
            parts["wall"] += t1 - t0
        return host

    for i in range(3):  # warm: graphs captured, kernels compiled
        step(i, False)
    for i in range(steps):
        tokens = step(3 + i, True).astype(np.int32)
    parts["rest"] = parts["wall"] - parts["forward"] - parts["sample"]
    out = {k: 1e3 * v / steps for k, v in parts.items()}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i in range(8):
            tokens = step(3 + steps + i, False).astype(np.int32)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    out["gpu_busy"] = sum(e.device_time_total for e in kernels) / 1e6 / wall
    # Per step: (kernel, ms of device time, launches), most time first.
    out["kernels"] = sorted(((e.key, e.device_time_total / 8e3, e.count / 8) for e in kernels), key=lambda k: -k[1])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--num-blocks", type=int, default=0,
                   help="KV blocks of the cache (default: just enough; a served cache fills the device)")
    p.add_argument("--kernels", type=int, default=0, metavar="N", help="print the N kernels with most device time")
    p.add_argument("--kv-dtype", default="auto", help="the KV cache's dtype, as `stride serve --kv-dtype`")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    need = max(a.num_blocks, max(batches) * -(-(a.context + a.steps + 12) // 16))
    worker = WorkerConfig(model=a.model, device="cuda", dtype="bfloat16", cuda_graphs=not a.eager,
                          kv_dtype=a.kv_dtype)
    runner = ModelRunner(RunnerConfig(worker, num_blocks=need, max_num_seqs=max(batches),
                                      max_model_len=a.context + a.steps + 12, max_num_batched_tokens=4096))
    print(f"{'batch':>5} {'step ms':>8} {'forward':>8} {'sample':>8} {'rest':>8} {'GPU busy':>9}")
    for b in batches:
        r = measure(runner, b, a.context, a.steps)
        print(f"{b:>5} {r['wall']:>8.2f} {r['forward']:>8.2f} {r['sample']:>8.2f} {r['rest']:>8.2f} "
              f"{r['gpu_busy']:>9.0%}", flush=True)
        for name, ms, count in r["kernels"][: a.kernels]:
            print(f"{'':>6}{ms:>8.3f} ms {count:>6.0f}x  {name[:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
