"""IPC benchmark: round trip of a small control message between two processes, and publish -> receive of a
step descriptor for N sequences whose token ids and block tables sit in shared memory.

The step case is what the scheduler -> rank 0 hop costs per step: the scheduler writes the batch arrays
into the shared segments and pushes a StepDescriptor; rank 0 receives it, reads the arrays in place (a
checksum over the live rows, so the read is real) and answers StepDone. Publish -> receive is one way: rank 0
stamps the moment it has decoded the descriptor, and again after reading the arrays, into a shared cell
(perf_counter is CLOCK_MONOTONIC, one clock for every process on Linux). Figures: median and p99 in µs.

    .venv/bin/python scripts/bench_ipc.py [--iters 5000] [--seqs 256]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np
import zmq

from stride.config import CacheConfig, IpcConfig, SchedulerConfig
from stride.ipc import messages as m
from stride.ipc.layouts import StepBuffers, StepLayout
from stride.ipc.queues import PullQueue, PushQueue
from stride.ipc.rundir import make_ipc_config, remove_run_dir
from stride.ipc.shm import SharedArray, remove_launch_segments


def _echo(ipc_dict: dict, layout_dict: dict) -> None:
    ipc = IpcConfig(**ipc_dict)
    layout = StepLayout(**layout_dict)
    buf = StepBuffers.attach(ipc, layout)
    stamp = SharedArray.attach(ipc.shm_name("bench-stamp"), (2,), np.float64)
    ctx = zmq.Context()
    inbox: PullQueue[m.Message] = PullQueue(ctx, ipc.worker_address(), m.TO_WORKER)
    out: PushQueue[m.StepDone] = PushQueue(ctx, ipc.scheduler_address())
    while True:
        msg = inbox.get()
        if isinstance(msg, m.Shutdown):
            break
        assert isinstance(msg, m.StepDescriptor)
        received = time.perf_counter()
        n, t = msg.num_seqs, msg.num_tokens
        # Touch what a worker reads: the step's tokens and the block-table rows of its sequences.
        # the block-table columns the context needs, as the real worker gathers them
        num_cols = -(-int(buf.context_lens[:n].max(initial=0)) // 16)
        _ = int(buf.token_ids[:t].sum()) + int(buf.block_tables[buf.seq_slots[:n], :num_cols].sum())
        stamp.array[:] = (received, time.perf_counter())
        buf.sampled_ids[:n] = buf.token_ids[:n]
        out.put(m.StepDone(msg.step))
    buf.close()
    stamp.close()
    ctx.destroy(linger=0)


def _stats(samples_s: list[float]) -> str:
    us = np.array(samples_s) * 1e6
    return f"median {np.median(us):7.1f} µs   p99 {np.percentile(us, 99):7.1f} µs   (n={len(us)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--tokens-per-seq", type=int, default=1, help="1 = a decode step")
    args = ap.parse_args()

    ipc = make_ipc_config()
    sched = SchedulerConfig(max_num_seqs=max(args.seqs, 1), max_num_batched_tokens=max(2048, args.seqs * 4))
    layout = StepLayout.from_config(sched, CacheConfig())
    buf = StepBuffers.create(ipc, layout)
    stamp = SharedArray.create(ipc.shm_name("bench-stamp"), (2,), np.float64)
    ctx = zmq.Context()
    to_worker: PushQueue[m.Message] = PushQueue(ctx, ipc.worker_address())
    inbox: PullQueue[m.StepDone] = PullQueue(ctx, ipc.scheduler_address(), (m.StepDone,))
    child = mp.get_context("spawn").Process(target=_echo, args=(ipc.to_dict(), layout.__dict__))
    child.start()
    try:
        rng = np.random.default_rng(0)
        buf.block_tables[:] = rng.integers(0, 1024, buf.block_tables.shape, dtype=np.int32)
        # Warm-up until the child is up and connected.
        assert to_worker.put(m.StepDescriptor(0, 0, 0)) is None and inbox.get(timeout_ms=60_000) is not None

        control = []
        for i in range(args.iters):
            t0 = time.perf_counter()
            to_worker.put(m.StepDescriptor(i, 0, 0))
            inbox.get()
            control.append(time.perf_counter() - t0)

        n, t = args.seqs, args.seqs * args.tokens_per_seq
        step, one_way, with_read = [], [], []
        for i in range(args.iters):
            t0 = time.perf_counter()
            # The scheduler's side of a step: write the batch arrays, then send the descriptor.
            buf.token_ids[:t] = i
            buf.positions[:t] = i
            buf.seq_slots[:n] = np.arange(n, dtype=np.int32)
            buf.query_lens[:n] = args.tokens_per_seq
            buf.context_lens[:n] = 1000
            buf.sample_flags[:n] = 1
            t_pub = time.perf_counter()
            to_worker.put(m.StepDescriptor(i, n, t))
            inbox.get()
            step.append(time.perf_counter() - t0)
            one_way.append(float(stamp.array[0]) - t_pub)
            with_read.append(float(stamp.array[1]) - t0)
        print(f"control message round trip:            {_stats(control)}")
        print(f"step descriptor publish -> received (decoded), {n} seqs: {_stats(one_way)}")
        print(f"arrays written + published -> received and arrays read:  {_stats(with_read)}")
        print(f"step round trip (write arrays, send, worker reads, StepDone back): {_stats(step)}")
        to_worker.put(m.Shutdown())
        child.join(10)
    finally:
        if child.is_alive():
            child.kill()
        ctx.destroy(linger=0)
        buf.close()
        stamp.close()
        remove_launch_segments(ipc.shm_prefix)
        remove_run_dir(ipc)


if __name__ == "__main__":
    main()
