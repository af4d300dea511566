"""GPU catalog: memory as the driver reports it, plus the two rates the step cost model needs."""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model. Rates are the vendor's published peaks (dense, no sparsity)."""

    name: str
    memory_bytes: int
    """Total device memory as ``nvidia-smi`` reports it (less than the marketing figure)."""
    mem_bandwidth: float = 0.0
    """Memory bandwidth, bytes/s (0: unknown)."""
    bf16_flops: float = 0.0
    """Dense BF16 tensor-core rate, FLOP/s (0: unknown)."""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.mem_bandwidth < 0 or self.bf16_flops < 0:
            raise ValueError(f"bad GPU spec {self}")


GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("H100-SXM-80GB", 81559 * MiB, mem_bandwidth=3.35e12, bf16_flops=989e12),
    GpuSpec("H200-141GB", 143771 * MiB, mem_bandwidth=4.8e12, bf16_flops=989e12),
    GpuSpec("A100-SXM-80GB", 81920 * MiB, mem_bandwidth=2.039e12, bf16_flops=312e12),
    GpuSpec("L40S-48GB", 46068 * MiB, mem_bandwidth=0.864e12, bf16_flops=362e12),
)}


def get_gpu(name: str | None = None, mem_gib: float | None = None) -> GpuSpec:
    """A catalog GPU (case-insensitive), or an unnamed one with ``mem_gib`` GiB (which wins if both given)."""
    if mem_gib is not None:
        if mem_gib <= 0:
            raise ValueError(f"--gpu-mem-gib must be positive, got {mem_gib}")
        base = _lookup(name) if name else None
        label = f"{base.name} ({mem_gib:g} GiB)" if base else f"custom-{mem_gib:g}GiB"
        return GpuSpec(label, int(mem_gib * GiB), base.mem_bandwidth if base else 0.0,
                       base.bf16_flops if base else 0.0)
    if not name:
        raise ValueError("name a GPU (--gpu) or give its memory (--gpu-mem-gib)")
    return _lookup(name)


def _lookup(name: str) -> GpuSpec:
    for key, spec in GPUS.items():
        if key.lower() == name.lower():
            return spec
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} (or give --gpu-mem-gib)")
