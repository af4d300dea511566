#!/usr/bin/env python
"""What each part of a decode step costs inside its CUDA graph: the step timed with parts taken out, against the
whole step, in alternating rounds on one runner.

A profiler's kernel times cannot say this at small batches: inside a graph with programmatic dependent launch a
kernel is launched while the one before still runs and waits on the device, so its measured time includes the
wait, and a latency-bound kernel's real cost is the time the step would take without it. Here each part is
replaced by nothing (its output is its input, or the cache is left unwritten), the graphs are captured again, and
the step is timed as ``bench_worker.py --graphs --device-tokens`` times it (each step's argmax fed to the next on
the device). The tokens are meaningless in a step with a part removed: this times, it does not answer.

Parts: ``attention`` (the paged decode kernel and its split reduction), ``rope`` (RoPE and the K/V cache write,
one launch), ``norms`` (every fused add+RMSNorm), ``silu`` (the gated MLP's SiLU-mul), ``head`` (the LM head's
product). A variant is parts joined by ``+``; ``none`` is the whole step.

    python3 scripts/bench_step_ablation.py --model /dev/shm/llama8b --batches 1,256 \
        --variants none,attention,rope+norms+silu,attention+rope+norms+silu,head

Prints figures; asserts nothing. CUDA only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_worker import copy_bandwidth, decode_rate, weight_bytes  # noqa: E402

from stride.config import WorkerConfig  # noqa: E402
from stride.kernels import silu_mul  # noqa: E402
from stride.kernels.common import set_pdl  # noqa: E402
from stride.workers import attention_triton  # noqa: E402
from stride.workers.cuda_graphs import PDL_MAX_BATCH, DecodeGraphs  # noqa: E402
from stride.workers.models import layers  # noqa: E402
from stride.workers.runner import ModelRunner, RunnerConfig  # noqa: E402


@contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _head_as_copy(self: Any, x: torch.Tensor) -> torch.Tensor:
    # The logits' shape with no product: one column broadcast (the float32 cast after it still runs).
    return x[:, :1].expand(x.shape[0], self.weight.shape[0])


PARTS: dict[str, Callable[[ExitStack], object]] = {
    "attention": lambda s: s.enter_context(_replaced(attention_triton.TritonPagedAttention, "attend",
                                                     lambda self, q, k_cache, v_cache, meta, scale: q)),
    "rope": lambda s: s.enter_context(_replaced(layers.Rope, "rotate_into_cache", lambda self, *args: None)),
    "norms": lambda s: (s.enter_context(_replaced(layers.RMSNorm, "forward", lambda self, x: x)),
                        s.enter_context(_replaced(layers.RMSNorm, "add_forward", lambda self, x, r: (x, r)))),
    "silu": lambda s: s.enter_context(_replaced(silu_mul, "silu_mul",
                                                lambda x, config=None: x[:, : x.shape[1] // 2])),
    "head": lambda s: s.enter_context(_replaced(layers.VocabParallelHead, "forward", _head_as_copy)),
}


def read_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Bytes/s of a read-only pass (a float32 sum over bf16), the rate a weight-streaming GEMV could reach."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    src.sum(dtype=torch.float32)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        src.sum(dtype=torch.float32)
    end.record()
    torch.cuda.synchronize(device)
    return nbytes * reps / (start.elapsed_time(end) / 1e3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batches", default="1")
    p.add_argument("--variants", default="none,attention,rope,norms,silu,head")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds over the variants")
    p.add_argument("--no-pdl", action="store_true", help="capture without programmatic dependent launch")
    a = p.parse_args()
    variants = a.variants.split(",")
    for v in variants:
        unknown = set(v.split("+")) - set(PARTS) - {"none"}
        if unknown:
            p.error(f"unknown part(s) {sorted(unknown)}; parts: {', '.join(PARTS)}")
    batches = [int(b) for b in a.batches.split(",")]
    worker = WorkerConfig(model=a.model, device="cuda", dtype="bfloat16", cuda_graphs=True,
                          attention_backend="triton")
    need = max(batches) * -(-(a.prompt_len + a.steps + 8) // 16)
    runner = ModelRunner(RunnerConfig(worker, num_blocks=need))
    served = runner.graphs
    assert served is not None, "no decode graphs (CUDA and the triton backend are needed)"
    copy, read = copy_bandwidth(runner.device), read_bandwidth(runner.device)
    step_floor = weight_bytes(runner) / copy
    print(f"{torch.cuda.get_device_name(runner.device)}: copy {copy / 1e12:.2f} TB/s, read-only {read / 1e12:.2f} "
          f"TB/s; batch-1 roofline (weights over copy) {1e3 * step_floor:.3f} ms", flush=True)
    for batch in batches:
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(a.rounds):
            for v in variants:
                with ExitStack() as stack:
                    for part in v.split("+"):
                        if part != "none":
                            PARTS[part](stack)
                    set_pdl(not a.no_pdl)
                    runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.backend, runner.block_size,
                                                 served.pad_block, served.max_batch)
                    decode_rate(runner, batch, a.prompt_len, 4, device_tokens=True)  # captures the bucket's graph
                    rate = decode_rate(runner, batch, a.prompt_len, a.steps, device_tokens=True)
                    runner.graphs = None
                    torch.cuda.empty_cache()
                times[v].append(1e3 * batch / rate)
        whole = min(times["none"]) if "none" in times else None
        pdl = not a.no_pdl and batch <= PDL_MAX_BATCH  # the graphs use PDL only up to that batch
        print(f"batch {batch}, {a.prompt_len}-token contexts, graphs{' with PDL' if pdl else ''}:")
        for v in variants:
            best = min(times[v])
            note = f", the part costs {whole - best:.3f} ms" if whole is not None and v != "none" else ""
            roof = f", {step_floor * 1e3 / best:.1%} of the batch-1 roofline" if batch == 1 else ""
            label = "the whole step" if v == "none" else f"without {v}"
            print(f"  {label:<40} {best:7.3f} ms/step (rounds: "
                  f"{', '.join(f'{t:.3f}' for t in times[v])}){note}{roof}", flush=True)
    runner.graphs = served
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
