"""The paged KV cache tensors of one rank, and how many blocks fit in the memory left after the weights.

Layout (shared with the Triton kernels, ``stride/kernels/paged_common.py``): per layer, one K and one V
tensor of shape ``(num_blocks, block_size, num_kv_heads, head_dim)``, contiguous, head_dim innermost; an 8-bit V
(``--kv-dtype fp8``) is that shape viewed over storage ordered ``(num_blocks, num_kv_heads, head_dim, block_size)``,
keys innermost (:func:`v_keys_inner` says why), which every reader and writer takes by its strides.
Token ``j`` of a sequence lives at ``[block_table[j // block_size], j % block_size]``. Block ids are the
scheduler's physical block ids (``0 .. num_blocks - 1``); the worker never allocates or frees blocks,
it only writes where the step's block tables say.
"""

from __future__ import annotations

import numpy as np
import torch

from stride.config import KV_DTYPES
from stride.planner.geometry import ModelGeometry
from stride.planner.memory import decode_graph_reserve_bytes, num_kv_blocks
from stride.planner.parallel import Parallelism
from stride.workers.attention import FP8_KV
from stride.workers.models import ModelArgs


def resolve_kv_dtype(name: str, run_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype ``--kv-dtype name`` (:data:`stride.config.KV_DTYPES`) asks for, with ``run_dtype`` the
    model's."""
    if name == "auto":
        return run_dtype
    if name == "fp8":
        return FP8_KV
    raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {name!r}")


def v_keys_inner(dtype: torch.dtype, block_size: int) -> bool:
    """Whether a V cache of ``dtype`` and ``block_size`` is stored keys-inner (the one rule; the kernels and the
    reference backend read and write any cache by its strides). 8-bit ones are: P@V's inner axis is the keys, and the
    decode kernel moves a 16-bit V tile with head_dim contiguous into the MMA through ``ldmatrix.trans``, which has no
    8-bit form, so an 8-bit one went from shared memory a byte at a time (the kernel at 54% of its bytes' roofline on
    an H200, docs/perf-log.md); keys contiguous, a page of one head's values comes in 16-byte rows: an 8B step's decode
    kernel at 256 x 1.5k 12.0 -> 7.8 ms (2026-12-04). Powers of two only, so that a kernel's key tile holds whole pages
    or a page whole tiles."""
    return dtype == FP8_KV and block_size > 1 and block_size & (block_size - 1) == 0


class KVCache:
    """Every layer's K and V block pool on one device."""

    def __init__(
        self,
        args: ModelArgs,
        num_blocks: int,
        block_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
        tp_size: int = 1,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, max(1, args.num_kv_heads // tp_size), args.head_dim)
        # Zeros, not empty: a masked-out read of a never-written slot must not meet NaN (0 * NaN = NaN).
        self.k_caches = [_zeros(shape, device, dtype) for _ in range(args.num_layers)]
        if v_keys_inner(dtype, block_size):
            b, page, h, d = shape
            self.v_caches = [_zeros((b, h, d, page), device, dtype).permute(0, 3, 1, 2) for _ in range(args.num_layers)]
        else:
            self.v_caches = [_zeros(shape, device, dtype) for _ in range(args.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_caches + self.v_caches)


def _zeros(shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed pool tensor. In host memory through calloc (numpy's zeros), whose fresh pages are the kernel's
    zero pages until written, so a block costs resident memory only once a sequence has used it (``torch.zeros``
    writes every page at start: the default model's whole 0.35 GiB pool resident before the first request)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    elem = torch.empty(0, dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros((*shape[:-1], shape[-1] * elem), dtype=np.uint8))
    return raw.view(dtype)


def block_bytes(args: ModelArgs, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of one block across all layers, K and V, on one rank."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * args.num_layers * block_size * max(1, args.num_kv_heads // tp_size) * args.head_dim * elem


def geometry(args: ModelArgs, name: str = "model") -> ModelGeometry:
    """The planner's view of a model shape."""
    return ModelGeometry(
        name,
        args.num_layers,
        args.hidden_size,
        args.num_heads,
        args.num_kv_heads,
        args.head_dim,
        args.intermediate_size,
        args.vocab_size,
        args.tie_word_embeddings,
        args.num_experts,
        args.num_experts_per_tok if args.num_experts else 0,
        args.max_position_embeddings,
    )


def num_blocks_for_memory(
    args: ModelArgs,
    free_bytes: int,
    block_size: int,
    dtype: torch.dtype,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    tp_size: int = 1,
    graph_table_width: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> int:
    """Blocks that fit in ``free_bytes`` after the planner's activation reserve (the planner's own formula,
    so a deployment the planner approves gets the cache it planned), and after the decode graphs' reserve
    when ``graph_table_width`` (block-table columns) is given, i.e. with decode graphs on. ``dtype`` is the run
    dtype (activations), ``kv_dtype`` the cache's (default: the run dtype)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    geo = geometry(args)
    graphs = (decode_graph_reserve_bytes(geo, Parallelism(tp_size), max_num_seqs, graph_table_width, elem)
              if graph_table_width else 0)
    # The planner knows 16-bit and 8-bit KV; a float32 cache is two 16-bit ones.
    kv_elem = elem if kv_dtype is None else torch.empty(0, dtype=kv_dtype).element_size()
    blocks = num_kv_blocks(
        geo,
        free_bytes,
        block_size,
        "fp8" if kv_elem == 1 else "bf16",
        tp=tp_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        act_bytes=elem,
        extra_reserve=graphs,
    )
    return blocks if kv_elem == 1 else blocks * 2 // kv_elem


def free_device_bytes(device: torch.device, memory_utilization: float) -> int:
    """On CUDA: ``total × memory_utilization`` minus what this process's tensors and other processes hold. Blocks
    this process's caching allocator keeps after their tensors were freed (a load's temporaries, an earlier runner's
    cache in the same process) count as free: the allocator hands them out again, or returns them to the driver when
    an allocation would otherwise fail."""
    if device.type != "cuda":
        raise ValueError("free memory is measured on CUDA only; give num_blocks on CPU")
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    used = total - free - cached
    return max(0, int(total * memory_utilization) - used)
