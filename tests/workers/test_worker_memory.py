"""What the CPU worker holds in memory: its KV pool resident only where written, no Triton loaded, the GGUF file
unmapped once its weights are in (Linux: read from /proc)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")


_POOL_PROBE = """
from types import SimpleNamespace

import torch
from stride.workers.kv_cache import KVCache

def rss():
    return int(next(x for x in open("/proc/self/status") if x.startswith("VmRSS")).split()[1]) / 1024

before = rss()
cache = KVCache(SimpleNamespace(num_layers=4, num_kv_heads=4, head_dim=64), 2048, 16, "cpu", torch.bfloat16)
assert cache.nbytes == 128 << 20
grew = rss() - before
# Zeros (a sample: reading every page would map them too).
assert all(t.is_contiguous() and t.dtype == torch.bfloat16 and not t[::256].any() for t in cache.k_caches)
cache.k_caches[0].fill_(1.0)  # two layers' K: 32 MB written
cache.k_caches[1].fill_(1.0)
wrote = rss() - before - grew
# Negative control: torch.zeros writes every page of the same pool at once.
before = rss()
eager = [torch.zeros(2048, 16, 4, 64, dtype=torch.bfloat16) for _ in range(8)]
print(round(grew), round(wrote), round(rss() - before))
"""


def test_cpu_kv_pool_is_resident_only_where_written() -> None:
    # In a fresh process: in a long-lived one calloc may hand back freed heap that is resident already.
    out = subprocess.run([sys.executable, "-c", _POOL_PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    grew, wrote, eager = (int(v) for v in out.stdout.split()[-3:])
    assert grew < 16, f"a 128 MB pool made {grew} MB resident before any write"
    assert 28 < wrote < 48, wrote  # about the 32 MB written (plus what the first ops map: up to 16 MB)
    assert eager > 100, eager


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
