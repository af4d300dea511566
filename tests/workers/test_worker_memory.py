"""What the CPU worker holds in memory: its KV pool resident only where written, no Triton loaded, the GGUF file
unmapped once its weights are in (Linux: read from /proc)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stride.workers.runner import cpu_has_bf16

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
        "import os\n"
        "print('triton' in sys.modules, 'torch._dynamo' in sys.modules, maps,\n"
        "      os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    # The runner bounded oneDNN's product cache before its first product (test below).
    assert out.stdout.split()[-4:] == ["False", "False", "0", "16"], out.stdout


_PRODUCT_CACHE_PROBE = """
import torch
from stride.workers import cpu_int4

def anon():
    return int(next(x for x in open("/proc/self/status") if x.startswith("RssAnon")).split()[1]) / 1024

cpu_int4.bound_product_cache()
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
shapes = [(960, 576), (3072, 576), (576, 1536)]  # the default model's projections (out, in)
plain = [(torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16) for n, k in shapes]
if cpu_int4.packing_available():  # as the worker holds them with native bf16
    weights = [(cpu_int4.packed_bf16(w), w.shape[1]) for w in plain]
    product = cpu_int4.linear_packed
else:
    weights = [(w, w.shape[1]) for w in plain]
    product = torch.nn.functional.linear
xs = {k: torch.randn(1400, k, generator=g).to(torch.bfloat16) for _, k in shapes}
product(xs[576][:3], weights[0][0])
cpu_int4.trim_heap()
base = anon()
for rows in range(200, 1400, 20):  # a prefill of each of 60 lengths
    for w, k in weights:
        product(xs[k][:rows], w)
cpu_int4.trim_heap()
print(round(anon() - base))
"""


@pytest.mark.skipif(not cpu_has_bf16(), reason="only bf16 products are kept, and only where bf16 is native")
@pytest.mark.parametrize("capacity", [None, "1024"])
def test_a_cpu_worker_keeps_a_bounded_number_of_bf16_products(capacity: str | None) -> None:
    # None: as the worker sets them (16 each); "1024" (the libraries' own default, set by the user, which the bound
    # leaves alone) is the control: 180 products of new shapes, each kept.
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    if capacity is not None:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = env["LRU_CACHE_CAPACITY"] = capacity
    out = subprocess.run([sys.executable, "-c", _PRODUCT_CACHE_PROBE], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    grew = int(out.stdout.split()[-1])
    if capacity is None:
        assert grew < 60, f"60 prompt lengths kept {grew} MB of products"  # 9 on an Intel Xeon with AMX
    else:
        assert grew > 110, grew  # 170 there


_TRIM_PROBE = """
import ctypes
import torch
from stride.workers.cpu_int4 import trim_heap

def rss():
    return int(next(x for x in open("/proc/self/status") if x.startswith("VmRSS")).split()[1]) / 1024

# Where glibc would have moved them after freeing large blocks: 4 MB blocks from the heap, and free() trimming
# nothing by itself.
libc = ctypes.CDLL("libc.so.6")
assert libc.mallopt(-3, 64 << 20) and libc.mallopt(-1, 1 << 30)  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
base = rss()
blocks, keep = [], []
for _ in range(32):  # 128 MB of activations, now from the heap, each followed by a small block that stays
    blocks.append(torch.ones(4 << 20, dtype=torch.uint8))
    keep.append(torch.ones(4096, dtype=torch.uint8))
del blocks
left = rss() - base
trim_heap()
print(round(left), round(rss() - base))
"""


def test_trim_heap_returns_freed_activations() -> None:
    out = subprocess.run([sys.executable, "-c", _TRIM_PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    left, after = (int(v) for v in out.stdout.split()[-2:])
    assert left >= 100, left  # the control: freed, yet resident until trimmed
    assert after <= 16, (left, after)


def test_cpu_worker_trims_the_heap_after_large_steps_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    import numpy as np
    import torch

    from stride.ipc import messages as m
    from stride.params import SamplingParams
    from stride.workers import cpu_int4, process
    from stride.workers.sampling import Sampler

    trims: list[int] = []
    monkeypatch.setattr(cpu_int4, "trim_heap", lambda: trims.append(1))

    class Runner:
        def step(self, buf: object, num_tokens: int, num_seqs: int, token_ids: object = None) -> torch.Tensor:
            return torch.zeros(num_seqs, 8)

    def run(device: str, num_tokens: int) -> None:
        stepper = process.ModelStepper.__new__(process.ModelStepper)  # the step handling alone, a fake forward
        stepper.runner, stepper.sampler = Runner(), Sampler(1, 8)  # type: ignore[assignment]
        stepper.samples, stepper._history, stepper.device_type = True, {}, device
        params = SamplingParams(temperature=0)
        desc = m.StepDescriptor(1, 1, num_tokens, new_seqs=[m.NewSequence(0, "r0", params, num_tokens)])
        buf = SimpleNamespace(seq_slots=np.zeros(1, np.int32), sample_flags=np.ones(1, np.int8),
                              sampled_ids=np.full(1, -1, np.int32))
        stepper.run(desc, buf)  # type: ignore[arg-type]

    run("cpu", process.TRIM_AFTER_TOKENS - 1)
    run("cuda", process.TRIM_AFTER_TOKENS)
    assert trims == []  # a small step, and a GPU's step: nothing to give back
    run("cpu", process.TRIM_AFTER_TOKENS)
    assert trims == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_free_device_bytes_counts_the_allocators_cached_blocks_as_free() -> None:
    """A tensor freed into the caching allocator leaves its memory this process's to reuse: the cache sizing must not
    count it as held (it did: after an 8B runner in one test process the next found 0.6 of 139 GiB free)."""
    import torch

    from stride.workers.kv_cache import free_device_bytes

    device = torch.device("cuda")
    torch.cuda.empty_cache()
    before = free_device_bytes(device, 0.9)
    x = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    held = free_device_bytes(device, 0.9)
    assert before - held >= (2 << 30) * 0.99  # a live tensor is held (the negative control)
    del x  # freed into the allocator's cache, not to the driver
    assert torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) >= 2 << 30
    assert abs(free_device_bytes(device, 0.9) - before) < 64 << 20
    torch.cuda.empty_cache()


def test_a_gpu_pool_takes_the_count_asked_for_only_where_memory_holds_it() -> None:
    """``--num-blocks`` on CUDA (``WorkerConfig.num_gpu_blocks``): the count as given where the memory left holds it,
    all that fits where none is given, and a refusal naming both counts where it does not fit."""
    from stride.workers.runner import gpu_pool_blocks

    assert gpu_pool_blocks(0, 5000, 40 << 30) == 5000
    assert gpu_pool_blocks(128, 5000, 40 << 30) == 128
    assert gpu_pool_blocks(5000, 5000, 40 << 30) == 5000
    with pytest.raises(MemoryError, match=r"5001 KV blocks.*40\.00 GiB.*holds 5000"):
        gpu_pool_blocks(5001, 5000, 40 << 30)
    with pytest.raises(MemoryError, match="no room for a KV block"):
        gpu_pool_blocks(0, 0, 1 << 20)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_a_cuda_worker_launched_with_a_block_count_holds_that_many(tmp_path: Path) -> None:
    """As ``stride serve --num-blocks N`` launches it on CUDA: a pool of N blocks (not the memory's), and a count the
    memory cannot hold refused before serving."""
    import torch
    from worker_helpers import make_checkpoint

    from stride.config import CacheConfig, SchedulerConfig, WorkerConfig
    from stride.workers.runner import ModelRunner, RunnerConfig

    path = make_checkpoint("tiny-llama", tmp_path / "ck", torch.bfloat16, device="cuda")

    def launch(blocks: int) -> ModelRunner:
        worker = WorkerConfig(model=str(path), device="cuda", dtype="bfloat16", num_gpu_blocks=blocks,
                              cuda_graphs=False)
        return ModelRunner(RunnerConfig.from_launch(worker, CacheConfig(), SchedulerConfig(max_model_len=512)))

    sized = launch(0)
    assert sized.num_blocks > 1000  # from memory (the control: far more than asked for below)
    fits = sized.num_blocks
    del sized
    assert launch(77).num_blocks == 77
    with pytest.raises(MemoryError, match=f"{fits * 4} KV blocks"):
        launch(fits * 4)
