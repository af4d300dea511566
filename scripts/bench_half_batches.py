#!/usr/bin/env python
"""Two half-batches on two CUDA streams against one full batch, for a large decode step.

At 256 sequences and 1k-token contexts an 8B decode step is K/V reads (attention, bound by bandwidth) followed by
projections that are near the matmul rate: one after the other, never beside each other. Split the batch in two
and give each half a stream, and one half's attention could run while the other half's projections do, at the cost
of reading every weight twice (a 128-row projection is still bound by its weight reads). This times that trade on
the shapes that matter: each layer's four projections (Llama-3.1-8B: hidden 4,096, 32 query and 8 KV heads of 128,
MLP 14,336) and the paged decode kernel over a bf16 cache, random weights, no norms or RoPE (the same in every
variant), each variant captured as one CUDA graph and timed as the median of ten replays, two rounds.

Variants: the full batch on one stream (and its attention alone, its projections alone); the halves on two streams
with no order between them (``independent``), or with each half's projections held until the other half's
attention has been issued (``staggered``: A's attention beside B's projections, then B's beside A's); one half alone.

    PYTHONPATH=. python3 scripts/bench_half_batches.py [--layers 32] [--batch 256] [--context 1024] [--carveout 16,32]

``--carveout N`` adds the staggered halves (and the projections alone) with cuBLASLt told to leave N of the GPU's
SMs to the other stream (torch's experimental SM carve-out, which sets cuBLASLt's SM count target), so that one
half's attention has SMs of its own beside the other half's projections.

Prints figures; asserts nothing. CUDA only (about 50 GB of GPU memory at the defaults).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stride.kernels.paged_decode import paged_decode

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 4096, 32, 8, 128, 14336
PAGE = 16


@dataclass
class Model:
    """Per-layer weights and paged K/V caches, the block tables and context lengths of ``batch`` sequences."""

    weights: list[dict[str, torch.Tensor]]
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    tables: torch.Tensor
    context_lens: torch.Tensor
    context: int

    @classmethod
    def random(cls, layers: int, batch: int, context: int) -> Model:
        def w(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.01

        weights = [dict(qkv=w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), o=w(HIDDEN, HEADS * HEAD_DIM),
                        gate_up=w(2 * MLP, HIDDEN), down=w(HIDDEN, MLP)) for _ in range(layers)]
        blocks = batch * -(-context // PAGE)

        def cache() -> torch.Tensor:
            return torch.randn(blocks, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

        tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, -1).contiguous()
        lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        return cls(weights, [cache() for _ in range(layers)], [cache() for _ in range(layers)], tables, lens, context)

    def qkv(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weights[layer]["qkv"].T

    def attend(self, layer: int, qkv: torch.Tensor, rows: slice, out: torch.Tensor) -> torch.Tensor:
        q = qkv[:, : HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)
        return paged_decode(q, self.k_caches[layer], self.v_caches[layer], self.tables[rows],
                            self.context_lens[rows], HEAD_DIM**-0.5, max_context_len=self.context, out=out)

    def rest(self, layer: int, att: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o_proj (plus the residual), the gated MLP."""
        w = self.weights[layer]
        h = att.view(att.shape[0], -1) @ w["o"].T + x
        gate_up = h @ w["gate_up"].T
        return (F.silu(gate_up[:, :MLP]) * gate_up[:, MLP:]) @ w["down"].T


@dataclass
class Rows:
    """One batch's (or half-batch's) activations: its rows of the tables, its input, attention output and a fixed
    qkv for the attention-only variant."""

    rows: slice
    x: torch.Tensor
    att: torch.Tensor
    qkv: torch.Tensor

    @classmethod
    def make(cls, rows: slice) -> Rows:
        n = rows.stop - rows.start

        def r(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.1

        return cls(rows, r(n, HIDDEN), r(n, HEADS, HEAD_DIM), r(n, (HEADS + 2 * KV_HEADS) * HEAD_DIM))


def one_stream(m: Model, b: Rows, attention: bool = True, projections: bool = True) -> None:
    x = b.x
    for layer in range(len(m.weights)):
        qkv = m.qkv(layer, x) if projections else b.qkv
        att = m.attend(layer, qkv, b.rows, b.att) if attention else b.att
        x = m.rest(layer, att, x) if projections else x


def two_streams(m: Model, a: Rows, b: Rows, streams: tuple[torch.cuda.Stream, torch.cuda.Stream],
                staggered: bool) -> None:
    """Half A on the first stream, half B on the second; ``staggered``: A's projections of a layer wait until B's
    attention of it is issued, and B's until A's is (so each half's attention has the other's projections beside
    it)."""
    main = torch.cuda.current_stream()
    sa, sb = streams
    sa.wait_stream(main)
    sb.wait_stream(main)
    layers = len(m.weights)
    a_attends = [torch.cuda.Event() for _ in range(layers)]
    b_attends = [torch.cuda.Event() for _ in range(layers)]
    xa, xb = a.x, b.x
    with torch.cuda.stream(sa):
        qkv_a = m.qkv(0, xa)
    with torch.cuda.stream(sb):
        if staggered:
            sb.wait_stream(sa)
        qkv_b = m.qkv(0, xb)
    for layer in range(layers):
        with torch.cuda.stream(sa):
            a_attends[layer].record(sa)
            att_a = m.attend(layer, qkv_a, a.rows, a.att)
            if staggered:
                sa.wait_event(b_attends[layer])
            xa = m.rest(layer, att_a, xa)
            if layer + 1 < layers:
                qkv_a = m.qkv(layer + 1, xa)
        with torch.cuda.stream(sb):
            if staggered:
                sb.wait_event(a_attends[layer])
            b_attends[layer].record(sb)
            att_b = m.attend(layer, qkv_b, b.rows, b.att)
            xb = m.rest(layer, att_b, xb)
            if layer + 1 < layers:
                qkv_b = m.qkv(layer + 1, xb)
    main.wait_stream(sa)
    main.wait_stream(sb)


def carved(n: int, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` with cuBLASLt's products leaving ``n`` SMs free (set while it is captured, so the graph keeps it)."""

    def run() -> None:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(n)
        try:
            fn()
        finally:
            torch._C._set_sm_carveout_experimental(None)
            torch.backends.cuda.preferred_blas_library("default")

    return run


def graph_ms(fn: Callable[[], None], replays: int = 10) -> float:
    """Median ms of ``replays`` replays of ``fn`` captured as one CUDA graph (run twice first: Triton compiles)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[replays // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=256, help="sequences (even)")
    p.add_argument("--context", type=int, default=1024, help="tokens of K/V each sequence reads")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--carveout", default="", help="comma-separated SM counts cuBLASLt leaves free (variants added)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("CUDA only")
    torch.manual_seed(0)
    m = Model.random(args.layers, args.batch, args.context)
    weight_gb = sum(w.numel() for d in m.weights for w in d.values()) * 2 / 1e9
    kv_gb = args.batch * args.context * args.layers * 2 * KV_HEADS * HEAD_DIM * 2 / 1e9
    print(f"{torch.cuda.get_device_name()}: {args.layers} layers, weights {weight_gb:.1f} GB, K/V read a step "
          f"{kv_gb:.1f} GB ({args.batch} x {args.context})")
    half = args.batch // 2
    full, a, b = Rows.make(slice(0, args.batch)), Rows.make(slice(0, half)), Rows.make(slice(half, args.batch))
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    variants: dict[str, Callable[[], None]] = {
        "full batch, one stream": lambda: one_stream(m, full),
        "full batch, attention only": lambda: one_stream(m, full, projections=False),
        "full batch, projections only": lambda: one_stream(m, full, attention=False),
        "halves, two streams, independent": lambda: two_streams(m, a, b, streams, staggered=False),
        "halves, two streams, staggered": lambda: two_streams(m, a, b, streams, staggered=True),
        "one half alone": lambda: one_stream(m, a),
        "one half, projections only": lambda: one_stream(m, a, attention=False),
    }
    for n in (int(c) for c in args.carveout.split(",") if c):
        variants[f"projections only, cublaslt, {n} SMs left"] = carved(n, lambda: one_stream(m, full, attention=False))
        variants[f"halves, staggered, cublaslt, {n} SMs left"] = carved(
            n, lambda: two_streams(m, a, b, streams, staggered=True))
    if args.carveout:
        variants["halves, staggered, cublaslt, none left"] = carved(0, lambda: two_streams(m, a, b, streams, True))
    results: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            results[name].append(graph_ms(fn))
    for name, times in results.items():
        print(f"{name:36s} " + " / ".join(f"{t:.2f}" for t in times) + " ms a step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
