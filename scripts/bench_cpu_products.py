#!/usr/bin/env python
"""Time candidate CPU product kernels on the default model's projections: what a decode step of M rows would spend
per layer on each. Not a test: it prints figures.

Each kind multiplies M rows by the four projections of SmolLM2-135M's layers (qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536), over 30 layers of distinct random weights (so that they come from memory, as in a step),
and prints the best of five passes in µs a layer. The weights lie on a Q4_1 grid (16 levels per 32 inputs), so the
4-bit grids take them as they take the model's. Kinds:

- ``grids``: the worker's 4-bit grids (``stride.workers.cpu_int4``; torch's ``_weight_int4pack_mm_for_cpu``);
- ``f32``: ``F.linear`` on float32 weights (MKL); ``onednn``: float32 through oneDNN with the weights prepacked;
- ``fbgemm8``: fbgemm's dynamic int8 linear (per-channel weights; one activation scale for the whole batch);
- ``fbgemm16``: fbgemm's fp16 GEMM (fp16 weights packed in blocks of 512 inputs, widened in registers; float32
  activations and sums: the head's path where bf16 is emulated);
- ``int_mm``: ``torch._int_mm`` (int8 x int8 to int32);
- ``cpp_bf16``: inductor's CPP GEMM template on frozen bf16 weights (``max_autotune``; a minute or two to build).

    .venv/bin/python scripts/bench_cpu_products.py --rows 4,8,16 --kinds grids,onednn,fbgemm8
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def on_grid(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random (n, k) weights on a Q4_1 grid per 32 inputs: step a power of two, minimum a multiple of it (exact in
    bf16), each group using its whole range."""
    d = 2.0 ** -torch.randint(6, 9, (n, k // 32, 1), generator=gen).float()
    lo = -torch.randint(0, 16, (n, k // 32, 1), generator=gen).float() * d
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    return (q * d + lo).reshape(n, k)


def best_us(step: Callable[[], object]) -> float:
    step()
    step()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    return best / LAYERS * 1e6


Pass = Callable[[torch.Tensor, torch.Tensor], Callable[[], object]]


def kernels(kind: str, weights: list[list[torch.Tensor]]) -> Pass:
    """For ``kind``: a function of the rows (576 and 1536 inputs wide) returning one pass over every layer."""
    if kind == "grids":
        from stride.workers import cpu_int4

        grids = [[cpu_int4.int4_grid(w.bfloat16(), 1 << 16) for w in layer] for layer in weights]
        assert all(g is not None for layer in grids for g in layer)

        def grid_pass(x: torch.Tensor, xd: torch.Tensor) -> Callable[[], object]:
            xb, xdb = x.bfloat16(), xd.bfloat16()
            return lambda: [g(xdb if i == 3 else xb) for layer in grids for i, g in enumerate(layer)]  # type: ignore[misc]
        return grid_pass
    if kind == "f32":
        return lambda x, xd: lambda: [F.linear(xd if i == 3 else x, w)
                                      for layer in weights for i, w in enumerate(layer)]
    if kind == "onednn":
        def onednn_pass(x: torch.Tensor, xd: torch.Tensor) -> Callable[[], object]:
            packed = [[torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0]) for w in layer] for layer in weights]
            return lambda: [torch.ops.mkldnn._linear_pointwise(xd if i == 3 else x, w, None, "none", [], "")
                            for layer in packed for i, w in enumerate(layer)]
        return onednn_pass
    if kind == "fbgemm8":
        import torch.ao.nn.quantized.dynamic as nnqd

        mods = []
        for layer in weights:
            row = []
            for w in layer:
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
                lin.weight.data = w
                lin.qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
                row.append(nnqd.Linear.from_float(lin))
            mods.append(row)
        return lambda x, xd: lambda: [m(xd if i == 3 else x) for layer in mods for i, m in enumerate(layer)]
    if kind == "fbgemm16":
        packed16 = [[torch.ops.quantized.linear_prepack_fp16(w, None) for w in layer] for layer in weights]
        return lambda x, xd: lambda: [torch.ops.quantized.linear_dynamic_fp16(xd if i == 3 else x, w)
                                      for layer in packed16 for i, w in enumerate(layer)]
    if kind == "int_mm":
        q = [[(w / (w.abs().amax(1, keepdim=True) / 127)).round().to(torch.int8).t().contiguous() for w in layer]
             for layer in weights]

        def int_mm_pass(x: torch.Tensor, xd: torch.Tensor) -> Callable[[], object]:
            xq, xdq = (t.clamp(-127, 127).round().to(torch.int8) for t in (x * 30, xd * 30))
            return lambda: [torch._int_mm(xdq if i == 3 else xq, w) for layer in q for i, w in enumerate(layer)]
        return int_mm_pass
    if kind == "cpp_bf16":
        import torch._inductor.config as ic

        ic.freezing = True
        ic.max_autotune = True
        ic.max_autotune_gemm_backends = "CPP,ATEN"
        model = torch.nn.ModuleList()
        for layer in weights:
            lins = torch.nn.ModuleList()
            for w in layer:
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(torch.bfloat16)
                lin.weight.data = w.bfloat16()
                lins.append(lin)
            model.append(lins)
        model.eval()

        def forward(x: torch.Tensor, xd: torch.Tensor) -> list[torch.Tensor]:
            return [lin(xd if i == 3 else x) for lins in model for i, lin in enumerate(lins)]
        compiled = torch.compile(forward, dynamic=False)

        def cpp_pass(x: torch.Tensor, xd: torch.Tensor) -> Callable[[], object]:
            xb, xdb = x.bfloat16(), xd.bfloat16()
            return lambda: compiled(xb, xdb)
        return cpp_pass
    raise SystemExit(f"unknown kind {kind!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,32")
    parser.add_argument("--kinds", default="grids,f32,onednn,fbgemm8")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    weights = [[on_grid(n, k, gen) for n, k in SHAPES] for _ in range(LAYERS)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    for kind in args.kinds.split(","):
        make = kernels(kind, weights)
        with torch.no_grad():
            for m in (int(r) for r in args.rows.split(",")):
                x, xd = torch.randn(m, 576, generator=gen), torch.randn(m, 1536, generator=gen)
                print(f"{kind:9s} {m:3d} rows {best_us(make(x, xd)):9.0f} µs a layer", flush=True)


if __name__ == "__main__":
    main()
