#!/usr/bin/env python
"""Logits of one checkpoint under several (attention backend, dtype) pairs, compared by cosine with a reference
pair. Tells a kernel error apart from the run dtype's own rounding: a backend in bf16 should sit as close to the
float32 reference as the torch backend in bf16 does. Prints figures; asserts nothing.

    python scripts/compare_backends.py --model /tmp/llama8b --device cuda \\
        --runs torch:float32,torch:bfloat16,triton:bfloat16,triton:float32
"""

from __future__ import annotations

import argparse
import gc

import numpy as np
import torch

from stride.config import WorkerConfig
from stride.workers.runner import ModelRunner, RunnerConfig

# Steps of (slot, new tokens): two prefills (one chunked), then decodes riding along, then decodes only.
SCHEDULE = [[(0, 500), (1, 300)], [(0, 1), (1, 200)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]]


def run_schedule(runner: ModelRunner, seed: int = 0) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    vocab = min(runner.args.vocab_size, 128000)
    tokens = [rng.integers(0, vocab, 1024) for _ in range(2)]
    per_seq = -(-1024 // runner.block_size)
    tables = rng.permutation(runner.num_blocks)[: 2 * per_seq].astype(np.int32).reshape(2, per_seq)
    lengths = [0, 0]
    out = []
    for step in SCHEDULE:
        ids, pos, q_lens = [], [], []
        for slot, n in step:
            lo = lengths[slot]
            ids.append(tokens[slot][lo : lo + n])
            pos.append(np.arange(lo, lo + n))
            lengths[slot] += n
            q_lens.append(n)
        slots = np.array([s for s, _ in step], np.int32)
        out.append(
            runner.forward(
                np.concatenate(ids).astype(np.int32),
                np.concatenate(pos).astype(np.int32),
                slots,
                np.array(q_lens, np.int32),
                np.array([lengths[s] for s in slots], np.int32),
                tables,
            ).double().cpu()
        )
    return out


def step_cosines(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    """Per step, the smallest logit cosine over its rows."""
    return [min(torch.nn.functional.cosine_similarity(g[r], w[r], dim=0).item() for r in range(len(w)))
            for g, w in zip(got, want, strict=True)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="")
    parser.add_argument("--runs", default="torch:float32,torch:bfloat16,triton:bfloat16,triton:float32")
    args = parser.parse_args()
    runs = [tuple(r.split(":")) for r in args.runs.split(",")]
    logits = {}
    for backend, dtype in runs:
        worker = WorkerConfig(model=args.model, device=args.device, dtype=dtype, attention_backend=backend)
        runner = ModelRunner(RunnerConfig(worker, num_blocks=256, block_size=16))
        logits[(backend, dtype)] = run_schedule(runner)
        del runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    ref_key = runs[0]
    ref = logits[ref_key]
    print(f"min over rows of the logit cosine with {ref_key[0]}:{ref_key[1]}, per step; max abs error")
    for key, got in logits.items():
        err = max((g - w).abs().max().item() for g, w in zip(got, ref, strict=True))
        print(f"  {key[0]:>7}:{key[1]:<9} " + " ".join(f"{c:.6f}" for c in step_cosines(got, ref)) + f"   {err:.3g}")
    if ("torch", "bfloat16") in logits and ("triton", "bfloat16") in logits:
        cos = step_cosines(logits[("triton", "bfloat16")], logits[("torch", "bfloat16")])
        print("  triton:bf16 vs torch:bf16 " + " ".join(f"{c:.6f}" for c in cos))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
