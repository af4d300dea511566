#!/usr/bin/env python
"""Decode throughput of the worker's forward pass (ModelRunner + greedy argmax) at several batch sizes.

Each batch of B sequences is prefilled with a short prompt, then timed over --steps decode steps; tokens/s
= B × steps / time. On CUDA it also measures copy bandwidth in the same run and prints the batch-1 figure as
a fraction of the roofline (weight bytes read per token over that bandwidth). Prints figures; asserts nothing.

    python scripts/bench_worker.py                       # SmolLM2 GGUF on CPU (STRIDE_CPU_COMPILE=0: eager steps)
    python scripts/bench_worker.py --model /tmp/llama8b --device cuda --dtype bfloat16 --backends torch,triton

With several --backends the same runner (weights and cache) is timed under each attention backend in turn,
the model layers switched to the fused kernels or back with it, so the weights are loaded once. ``--graphs``
times the triton backend again with its decode steps replayed from CUDA graphs captured without programmatic
dependent launch (``triton+graphs``, as STRIDE_PDL=0); ``--pdl`` once more with graphs captured with it
(``triton+graphs+pdl``, the worker's default).

``--tp N`` runs N ranks (one process each; gloo on the CPU, NCCL with one GPU per rank), the default backend, no
graphs: the same decode steps on every rank, rank 0 printing.

    python scripts/bench_worker.py --tp 3 --batches 1,16,64 --threads 1   # SmolLM2 on three CPU ranks
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from stride import env
from stride.config import WorkerConfig
from stride.kernels.common import set_pdl
from stride.workers.backends import get_backend
from stride.workers.cuda_graphs import DecodeGraphs
from stride.workers.models.layers import use_fused_kernels
from stride.workers.runner import ModelRunner, RunnerConfig


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - t)


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes of weights one decode token reads, packed 4-bit ones included (tied tensors once; MoE: the routed
    share of experts).

    An untied embedding table is left out: a token reads one row of it, not the table."""
    seen: dict[int, int] = {}
    expert = 0
    # 4-bit projections hold their packed weights as buffers (W4A16Linear); inv_freq is not a weight.
    tensors = list(runner.model.named_parameters()) + [
        (name, b) for name, b in runner.model.named_buffers() if not name.endswith("inv_freq")
    ]
    for name, p in tensors:
        if name.startswith("embed_tokens.") and not runner.args.tie_word_embeddings:
            continue
        seen[p.data_ptr()] = p.numel() * p.element_size()
        if ".experts." in name:
            expert += p.numel() * p.element_size()
    total = sum(seen.values())
    if runner.args.num_experts:
        total -= expert - expert * runner.args.num_experts_per_tok // runner.args.num_experts
    return total


def decode_rate(runner: ModelRunner, batch: int, prompt_len: int, steps: int, device_tokens: bool = False) -> float:
    """Tokens/s of ``steps`` decode steps. ``device_tokens``: each step's argmax goes into the next step on the
    device, with no host read between steps (as the worker runs a step built ahead, early launch); otherwise each
    step's tokens come back to the host first."""
    bs = runner.block_size
    blocks_per_seq = -(-(prompt_len + steps + 1) // bs)
    if batch * blocks_per_seq > runner.num_blocks:
        raise SystemExit(
            f"batch {batch} needs {batch * blocks_per_seq} blocks, cache has {runner.num_blocks}"
        )
    tables = np.arange(batch * blocks_per_seq, dtype=np.int32).reshape(batch, blocks_per_seq)
    slots = np.arange(batch, dtype=np.int32)
    rng = np.random.default_rng(0)
    # Prefill in chunks of at most 2048 tokens, as the scheduler's token budget would.
    per_step = max(1, 2048 // prompt_len)
    for lo in range(0, batch, per_step):
        s = slots[lo : lo + per_step]
        n = len(s)
        runner.forward(
            rng.integers(0, runner.args.vocab_size, n * prompt_len).astype(np.int32),
            np.tile(np.arange(prompt_len, dtype=np.int32), n),
            s,
            np.full(n, prompt_len, np.int32),
            np.full(n, prompt_len, np.int32),
            tables,
        )
    tokens: np.ndarray | torch.Tensor = rng.integers(0, runner.args.vocab_size, batch).astype(np.int32)
    q_lens = np.ones(batch, np.int32)
    sync(runner.device)
    start = time.perf_counter()
    for i in range(steps):
        pos = np.full(batch, prompt_len + i, np.int32)
        logits = runner.forward(tokens, pos, slots, q_lens, pos + 1, tables)
        tokens = logits.argmax(-1) if device_tokens else logits.argmax(-1).to(torch.int32).cpu().numpy()
    sync(runner.device)
    return batch * steps / (time.perf_counter() - start)


def _tp_rank(rank: int, args: argparse.Namespace, init_method: str) -> None:
    """One rank of ``--tp``: its shard, the same decode batches as every other rank; rank 0 prints."""
    from stride.workers.parallel import TensorParallel
    from stride.workers.runner import resolve_device_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    device, _ = resolve_device_dtype(args.device, args.dtype)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    tp = TensorParallel.init(rank, args.tp, init_method, device.type)
    try:
        batches = [int(b) for b in args.batches.split(",")]
        need = max(batches) * -(-(args.prompt_len + args.steps + 1) // 16)
        worker = WorkerConfig(model=args.model, device=args.device, dtype=args.dtype, quantize=args.quantize,
                              tensor_parallel_size=args.tp)
        runner = ModelRunner(RunnerConfig(worker, num_blocks=need, tp_rank=rank), tp=tp)
        for b in batches:
            rate = decode_rate(runner, b, args.prompt_len, args.steps)
            if rank == 0:
                print(f"[tp={args.tp} {runner.backend.name}] batch {b:4d}: {rate:9.1f} tok/s  "
                      f"({1000 * b / rate:.1f} ms/step)", flush=True)
    finally:
        tp.destroy()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="", help="HF checkpoint dir or GGUF (default: SmolLM2 GGUF)")
    parser.add_argument("--device", default="")
    parser.add_argument("--dtype", default="")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument(
        "--backends", default="", help="comma-separated attention backends to time (default: the runner's)"
    )
    parser.add_argument("--graphs", action="store_true",
                        help="also time the triton backend with decode steps replayed from CUDA graphs")
    parser.add_argument("--pdl", action="store_true",
                        help="with --graphs, also time graphs captured with programmatic dependent launch")
    parser.add_argument("--device-tokens", action="store_true",
                        help="also time each mode with the sampled tokens fed to the next step on the device (no "
                        "host read between steps: the served worker's early launch)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--quantize", default="", help="w4a16 or w4a16-g<N>: quantise the projections at load")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one process each")
    args = parser.parse_args()
    if args.tp > 1:
        import tempfile

        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_tp_rank, args=(args, f"file://{tmp}/rendezvous"), nprocs=args.tp, join=True)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    need = max(batches) * -(-(args.prompt_len + args.steps + 1) // 16)
    t = time.perf_counter()
    backends = [b for b in args.backends.split(",") if b]
    # With --graphs the runner starts on the triton backend, so that it builds its decode graphs; without
    # --backends it takes the configured one (STRIDE_ATTENTION_BACKEND, else the device's default).
    worker = WorkerConfig(model=args.model, device=args.device, dtype=args.dtype, cuda_graphs=args.graphs,
                          attention_backend="triton" if args.graphs else backends[0] if backends
                          else env.ATTENTION_BACKEND.get(), quantize=args.quantize)
    runner = ModelRunner(RunnerConfig(worker, num_blocks=need))
    if runner.compiled is not None and runner.compiled.building:  # the first start on this machine
        print("waiting for the compiled CPU decode step to build (STRIDE_CPU_COMPILE=0 times the eager step)",
              flush=True)
        runner.compiled.wait()
    graphs, runner.graphs = runner.graphs, None
    set_pdl(False)  # the runner allowed PDL (STRIDE_PDL's default); its graphs are captured on their first step
    ready = runner.compiled.ready if runner.compiled is not None else None
    print(
        f"model {args.model or 'default (SmolLM2-135M GGUF)'}: {runner.args.family}, "
        f"{runner.device}/{runner.dtype}, loaded in {time.perf_counter() - t:.1f} s, "
        f"threads {torch.get_num_threads()}, compiled CPU decode step "
        f"{f'for steps of up to {ready.step.max_rows} rows' if ready is not None else 'none'}"
    )
    all_rates: dict[str, dict[int, float]] = {}
    modes = backends or [runner.backend.name]
    if graphs is not None:
        modes = [m for m in modes if "+graphs" not in m] + ["triton+graphs"] + ["triton+graphs+pdl"] * args.pdl
    for name in modes:
        runner.backend = get_backend(name.split("+")[0], runner.device.type)
        if name == "triton+graphs+pdl" and graphs is not None:  # new graphs, captured with PDL allowed
            set_pdl(True)
            graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.backend, runner.block_size,
                                  graphs.pad_block, graphs.max_batch)
        runner.graphs = graphs if "+graphs" in name else None
        use_fused_kernels(runner.model, runner.backend.fused_layers)
        for on_device in (False, True)[: 1 + args.device_tokens]:
            label = name + "+device-tokens" * on_device
            rates = all_rates[label] = {}
            for b in batches:
                # Warm-up over the same context lengths as the timed run: Triton compiles a kernel again for a
                # length divisible by 16, and that must not land in the timing.
                decode_rate(runner, b, args.prompt_len, args.steps, on_device)
                rates[b] = decode_rate(runner, b, args.prompt_len, args.steps, on_device)
                print(f"[{label}] batch {b:4d}: {rates[b]:9.1f} tok/s  ({1000 * b / rates[b]:.2f} ms/step)")
    if runner.device.type == "cuda":
        bw = copy_bandwidth(runner.device)
        wb = weight_bytes(runner)
        roofline = bw / wb
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s, weights {wb / 1e9:.2f} GB/token -> roofline {roofline:.1f} tok/s")
        for name, rates in all_rates.items():
            if 1 in rates:
                print(f"[{name}] batch 1 = {rates[1] / roofline:.1%} of roofline")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
