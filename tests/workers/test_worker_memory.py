"""What the CPU worker holds in memory: its KV pool resident only where written, no Triton loaded, the GGUF file
unmapped once its weights are in (Linux: read from /proc)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stride.workers.kv_cache import KVCache

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")


def _rss_mb() -> float:
    line = next(x for x in open("/proc/self/status") if x.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def test_cpu_kv_pool_is_resident_only_where_written() -> None:
    args = SimpleNamespace(num_layers=4, num_kv_heads=4, head_dim=64)
    before = _rss_mb()
    cache = KVCache(args, num_blocks=2048, block_size=16, device="cpu", dtype=torch.bfloat16)  # type: ignore[arg-type]
    assert cache.nbytes == 128 << 20
    grew = _rss_mb() - before
    assert grew < 16, f"a 128 MB pool made {grew:.0f} MB resident before any write"
    # Zeros (a sample: reading every page would map them too).
    assert all(t.is_contiguous() and t.dtype == torch.bfloat16 and not t[::256].any() for t in cache.k_caches)
    cache.k_caches[0][:1024] = 1.0  # half of one layer's K: 8 MB written, about that much resident
    assert 6 < _rss_mb() - before - grew < 16
    # Negative control: torch.zeros writes every page of the same pool at once.
    before = _rss_mb()
    eager = [torch.zeros(2048, 16, 4, 64, dtype=torch.bfloat16) for _ in range(8)]
    assert _rss_mb() - before > 100 and not any(t.any() for t in eager)


def test_cpu_worker_loads_without_triton_and_unmaps_the_gguf() -> None:
    probe = (
        "import sys, torch\n"
        "from stride.config import WorkerConfig\n"
        "from stride.workers.runner import ModelRunner, RunnerConfig\n"
        "r = ModelRunner(RunnerConfig(WorkerConfig(model='', device='cpu', dtype='bfloat16'), num_blocks=16))\n"
        "maps = sum('.gguf' in line for line in open('/proc/self/maps'))\n"
        "print('triton' in sys.modules, 'torch._dynamo' in sys.modules, maps)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["False", "False", "0"], out.stdout
