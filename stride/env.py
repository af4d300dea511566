"""The one registry of ``STRIDE_*`` environment variables.

Every environment variable Stride reads is declared here, with its type, default and meaning; code reads
them through these objects, never through ``os.environ`` directly, so ``stride --help-env`` can list them all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)

    def get_bool(self) -> bool:
        return self.get().strip().lower() in ("1", "true", "yes", "on")

    def is_set(self) -> bool:
        return self.name in os.environ

    def set_default(self, value: str) -> None:
        """Set the variable for this process and its children, unless the environment already sets it."""
        os.environ.setdefault(self.name, value)

    def get_int(self) -> int:
        raw = self.get()
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{self.name}={raw!r} is not an integer") from None


RUNTIME_ROOT = EnvVar(
    "STRIDE_RUNTIME_ROOT", "",
    "Folder under which each launch makes its private 0700 runtime directory (default: $XDG_RUNTIME_DIR "
    "or the system temp folder).")
CHECK_INVARIANTS = EnvVar(
    "STRIDE_CHECK_INVARIANTS", "0",
    "Run the block manager's invariant check after every scheduler step (on in tests).")
LOG_LEVEL = EnvVar("STRIDE_LOG_LEVEL", "INFO", "Log level of every Stride process.")
DEVICE = EnvVar("STRIDE_DEVICE", "", "Force the worker device (cpu, cuda); default: cuda when present.")
ATTENTION_BACKEND = EnvVar(
    "STRIDE_ATTENTION_BACKEND", "",
    "Worker attention/norm backend: 'torch' (reference), 'sdpa' (the reference with attention in the run dtype) or "
    "'triton'; default: triton on CUDA, sdpa on CPU.")
W4A16 = EnvVar(
    "STRIDE_W4A16", "",
    "Keep a GGUF's Q4_0/Q4_1 linear weights 4-bit and run them through the W4A16 Triton GEMM: '1' on, '0' off "
    "(dequantise to the run dtype); default: on with the triton backend on CUDA.")
CPU_INT4 = EnvVar(
    "STRIDE_CPU_INT4", "1",
    "'1' (default): on a CPU in bf16, projections whose weights lie on a 4-bit grid (a GGUF's Q4_1) keep it packed "
    "too, and small steps (up to 4 rows with native bf16, 64 where bf16 is emulated) run torch's CPU int4 kernel on "
    "it; '0': bf16 weights only.")
CPU_INT8_HEAD = EnvVar(
    "STRIDE_CPU_INT8_HEAD", "1",
    "'1' (default): on a CPU in bf16, the output projection also keeps an int8 copy (per-row scales), on which "
    "small steps (as STRIDE_CPU_INT4's) compute their logits, or where bf16 is emulated an fp16 copy (fbgemm's "
    "layout) on which every step does; '0': bf16 only.")
CPU_PACK = EnvVar(
    "STRIDE_CPU_PACK", "1",
    "'1' (default): on a CPU with native bf16, the bf16 projections' weights are held in oneDNN's blocked layout for "
    "the steps their 4-bit grids do not take, and the output projection's for every step in place of its int8 copy "
    "(the same products, 1.5-2x faster at 8-16 rows); '0': as loaded.")
CPU_COMPILE = EnvVar(
    "STRIDE_CPU_COMPILE", "1",
    "'1' (default): a CPU worker runs its decode steps (up to 64 sequences, dense models) through a compiled step "
    "(AOTInductor, built once in the background and cached; needs a C++ compiler); '0': every step eagerly.")
CPU_STEP_CACHE = EnvVar(
    "STRIDE_CPU_STEP_CACHE", "",
    "Folder of the compiled CPU decode steps (default: ~/.cache/stride/cpu_step).")
CONTROL_NICE = EnvVar(
    "STRIDE_CONTROL_NICE", "10",
    "When the worker runs on the CPU, the frontend, tokenizers and scheduler lower their priority by this much "
    "(nice), so their work per token does not preempt the worker's threads; '0' leaves them at the launcher's.")
AUTOTUNE_CACHE = EnvVar(
    "STRIDE_AUTOTUNE_CACHE", "",
    "JSON file of autotuned kernel configurations (default: ~/.cache/stride/autotune.json).")

PDL = EnvVar(
    "STRIDE_PDL", "1",
    "'1' (default): capture the worker's decode graphs of up to 8 sequences with programmatic dependent launch "
    "(Hopper and later): each Triton kernel is launched while the one before finishes. '0': plain stream order. "
    "H200, batch-1 step from graphs: 5% less GPU time for an 8B 4-bit model, a third less for SmolLM2-135M "
    "(docs/perf-log.md).")

EARLY_LAUNCH = EnvVar(
    "STRIDE_EARLY_LAUNCH", "",
    "'1': with overlapped scheduling, rank 0 launches a step built ahead as soon as it arrives, its placeholder "
    "tokens taken on the device from the step before, which it then finishes and reports (the GPU does not wait "
    "for the host between steps); '0': each step is launched after the one before is reported; default: on with "
    "one CUDA rank.")

TRITON_INTERPRET = EnvVar(
    "TRITON_INTERPRET", "0",
    "Triton's own switch, read by Triton when it is first imported: '1' runs kernels in its interpreter on CPU "
    "tensors. The worker sets it when it picks the triton backend without CUDA.")

ATEN_CPU_CAPABILITY = EnvVar(
    "ATEN_CPU_CAPABILITY", "",
    "PyTorch's own switch ('avx2', 'avx512', 'default'): the widest CPU kernels torch dispatches to. The worker's "
    "choices follow it: with 'avx2' it takes the CPU for one without AVX-512, AMX or AVX-VNNI (an AVX2-only laptop's "
    "paths, on a machine with more; set ONEDNN_MAX_CPU_ISA=AVX2 too, so that oneDNN's products follow: "
    "scripts/bench_peer.py --isa avx2 sets both).")

ONEDNN_MAX_CPU_ISA = EnvVar(
    "ONEDNN_MAX_CPU_ISA", "",
    "oneDNN's own switch ('AVX2', 'AVX512_CORE_BF16', 'AVX512_CORE_AMX', ...): the widest code its products use. The "
    "worker's choices follow it: below AMX it takes the CPU for one without AMX, below AVX-512 for an AVX2-only one "
    "(with ATEN_CPU_CAPABILITY=avx2 too: scripts/bench_peer.py --isa sets both).")
CPU_INT4_ROWS = EnvVar(
    "STRIDE_CPU_INT4_ROWS", "",
    "The largest step, in rows, that a CPU worker's 4-bit grids take (the rest multiply the bf16 weights). Empty: "
    "by the CPU, 4 with AMX, 16 with AVX-512 BF16 alone, 64 where bf16 is emulated (stride.workers.cpu_int4).")
ONEDNN_PRIMITIVE_CACHE_CAPACITY = EnvVar(
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16",
    "oneDNN's own switch, read at its first product: how many built products (one per shape, row count included) "
    "it keeps; its default is 1,024. A CPU worker sets 16 unless it is set, and LRU_CACHE_CAPACITY with it: at the "
    "defaults each prompt length served grew the default model's worker by ~3 MB of bf16 products kept (perf-log).")
LRU_CACHE_CAPACITY = EnvVar(
    "LRU_CACHE_CAPACITY", "16",
    "ideep's own switch (torch's layer over oneDNN), read at its first product: how many products' set-ups it keeps "
    "(default 1,024; 0 crashes it). A CPU worker sets 16 unless it is set, as ONEDNN_PRIMITIVE_CACHE_CAPACITY.")

REGISTRY: tuple[EnvVar, ...] = (
    RUNTIME_ROOT, CHECK_INVARIANTS, LOG_LEVEL, DEVICE, ATTENTION_BACKEND, W4A16, CPU_INT4, CPU_INT8_HEAD,
    CPU_PACK, CPU_COMPILE, CPU_STEP_CACHE, CONTROL_NICE, AUTOTUNE_CACHE, PDL, EARLY_LAUNCH, TRITON_INTERPRET,
    ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, CPU_INT4_ROWS, ONEDNN_PRIMITIVE_CACHE_CAPACITY, LRU_CACHE_CAPACITY,
)


def describe() -> str:
    width = max(len(v.name) for v in REGISTRY)
    return "\n".join(f"{v.name:<{width}}  {v.help} [default: {v.default!r}]" for v in REGISTRY)
