"""Decode steps replayed from CUDA graphs: one graph per (batch bucket, context bucket).

A decode-only step of a small model is bound by launching its kernels (hundreds per step, each a few
microseconds of host work), not by the GPU. A graph records the whole forward, lm_head included, once;
each later step of the same shape copies its inputs into the graph's static buffers and replays it in
one launch. Only the Triton backend is captured: the torch reference reads lengths on the host.

Shapes are bucketed so a handful of graphs serve every step:
- batch: 1, 2, 4, 8, then multiples of 16 up to ``max_batch``. The rows past the step's sequences are
  padding: token 0 at position 0 with a context of one key, whose block table row names only
  ``pad_block``, a KV block the runner keeps out of the scheduler's ids. They write and read that block
  and nothing else, and their logits are dropped.
- context: the next power of two of the step's longest context (at least :data:`MIN_CONTEXT`, at most
  the block table's width). The decode kernel is launched for the bucket and skips the splits past each
  sequence's own length, so a graph serves every context up to its bucket.

The worker captures every batch bucket at the shortest context bucket before it reports ready
(:meth:`DecodeGraphs.capture_all`), then batch 1's graph in every longer context bucket through its warm-up steps
(:meth:`stride.workers.runner.ModelRunner.warm_up`, which compiles the split kernels, a reduction for each power of
two of the split count: 1.2-1.7 s each on an H200 with an empty Triton cache); the other graphs of longer contexts are
captured on their first step, with nothing left to compile.

What a graph holds fixed: the kernels' launch configs (looked up for the bucket at capture), the caches'
addresses, the weights' addresses. Steps that prefill, that are larger than ``max_batch``, or models
whose forward depends on values read on the host (the mixture-of-experts routing) run eagerly.

The inputs reach the device through pinned host buffers (two copies per step); a host buffer is written
again only after the copy out of it finished. The logits returned are a copy: the graph's own output is
overwritten by the next replay.

Memory: the graphs' buffers (one (max_batch, vocab) float32 logits buffer that every graph writes into, each
graph's small inputs, one pool of intermediates shared by all graphs) are reserved when the KV cache is sized
(:func:`stride.planner.memory.decode_graph_reserve_bytes`, the planner's formula). Should a capture still run
out of device memory, that bucket's steps run eagerly from then on (logged once); the step is not lost.

``capture=False`` runs the same static-buffer forward eagerly instead of replaying a graph (CPU tests:
the padding, bucketing and metadata are then checked through Triton's interpreter).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from stride.planner.memory import graph_batch_buckets as batch_buckets
from stride.workers.attention import AttentionBackend, AttentionContext, AttentionMetadata
from stride.workers.kv_cache import KVCache
from stride.workers.loader import ProgressCallback
from stride.workers.models.llama import Transformer

log = logging.getLogger(__name__)

MIN_CONTEXT = 256
"""Smallest context bucket, in tokens: shorter contexts cost the decode kernel nothing extra."""

PDL_MAX_BATCH = 8
"""Largest batch bucket captured with programmatic dependent launch, where PDL is allowed (``STRIDE_PDL``, on by
default). Up to 8 rows every projection is the W4A16 GEMV, so a step is one chain of Triton kernels that each
start while the one before finishes. H200 (docs/perf-log.md), batch-1 step, GPU time: SmolLM2-135M 0.88 -> 0.58 ms,
Llama-3.1-8B 4-bit 2.34 -> 2.22 ms; at 16 and 64 rows (cuBLAS GEMMs between the kernels) 1% slower, and the
SmolLM2 worker end to end 6-10% slower at 16, so larger buckets are captured plainly."""


@contextmanager
def pdl_for_batch(batch: int) -> Iterator[None]:
    """Within: PDL launches allowed only if they were and ``batch <= PDL_MAX_BATCH``; restored after."""
    from stride.kernels.common import pdl_allowed, set_pdl  # the triton backend's (only its steps are captured)

    allowed = pdl_allowed()
    set_pdl(allowed and batch <= PDL_MAX_BATCH)
    try:
        yield
    finally:
        set_pdl(allowed)


def context_bucket(max_context_len: int, block_size: int, table_width: int) -> int:
    """Block-table columns of the graph that serves a step whose longest context is ``max_context_len``."""
    tokens = max(MIN_CONTEXT, 1 << (max(1, max_context_len) - 1).bit_length())
    return min(table_width, -(-tokens // block_size))


@dataclass
class _Graph:
    batch: int
    columns: int
    ints: torch.Tensor
    """(3, batch) int64 on the device: token ids, positions, context lengths."""
    tables: torch.Tensor
    """(batch, columns) int32 on the device."""
    host_ints: torch.Tensor
    host_tables: torch.Tensor
    logits: torch.Tensor
    """(batch, vocab) float32: the first rows of one buffer every graph writes into (one step at a time)."""
    graph: torch.cuda.CUDAGraph | None = None
    copied: torch.cuda.Event | None = None
    replays: int = 0


class DecodeGraphs:
    """The captured decode graphs of one :class:`~stride.workers.runner.ModelRunner`. Not thread-safe."""

    def __init__(
        self,
        model: Transformer,
        kv_cache: KVCache,
        backend: AttentionBackend,
        block_size: int,
        pad_block: int,
        max_batch: int,
        capture: bool = True,
    ) -> None:
        if not 0 <= pad_block < kv_cache.k_caches[0].shape[0]:
            raise ValueError(f"pad block {pad_block} is not a block of the cache")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.block_size, self.pad_block = block_size, pad_block
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.device = kv_cache.k_caches[0].device
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._eager: set[tuple[int, int]] = set()
        """Buckets whose capture ran out of device memory: their steps run eagerly."""
        self._logits: torch.Tensor | None = None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def fits(self, num_seqs: int, max_context_len: int, table_width: int) -> bool:
        """Whether a decode step of this size has a graph (or can capture one)."""
        return 0 < num_seqs <= self.max_batch and max_context_len <= table_width * self.block_size

    def run(
        self,
        token_ids: np.ndarray | torch.Tensor,
        positions: np.ndarray,
        context_lens: np.ndarray,
        tables: torch.Tensor,
        table_width: int,
    ) -> torch.Tensor | None:
        """float32 logits (num_seqs, vocab) of a decode step, or None where this step's bucket could not be
        captured (out of device memory): the caller runs it eagerly. ``tables``: host (num_seqs, >= blocks
        needed) rows of the step's sequences (entries past a sequence's blocks are never read);
        ``table_width``: columns of the whole block-table array, the most a context bucket may take;
        ``token_ids`` on the host or the device (copied in after the host buffers, in stream order). The runner has
        checked every input; this only places them."""
        num_seqs = len(context_lens)
        batch = next(b for b in self.buckets if b >= num_seqs)
        columns = context_bucket(int(context_lens.max()), self.block_size, table_width)
        g = self._get(batch, columns)
        if g is None:
            return None
        if g.copied is not None:
            g.copied.synchronize()  # the last step's copies out of the host buffers are done
        ints = g.host_ints.numpy()
        ints[:, num_seqs:] = np.array([[0], [0], [1]])
        on_device = token_ids if isinstance(token_ids, torch.Tensor) and token_ids.device.type != "cpu" else None
        ints[0, :num_seqs] = 0 if on_device is not None else np.asarray(token_ids)
        ints[1, :num_seqs] = positions
        ints[2, :num_seqs] = context_lens
        host_tables = g.host_tables.numpy()
        used = min(columns, tables.shape[1])
        host_tables[:num_seqs, :used] = tables[:, :used].numpy()
        host_tables[num_seqs:] = self.pad_block
        g.ints.copy_(g.host_ints, non_blocking=True)
        g.tables.copy_(g.host_tables, non_blocking=True)
        if g.copied is not None:
            g.copied.record()
        if on_device is not None:
            g.ints[0, :num_seqs].copy_(on_device)
        if g.graph is not None:
            g.graph.replay()
        else:
            self._forward(g)
        g.replays += 1
        return g.logits[:num_seqs].clone()

    def capture_all(self, table_width: int, progress: ProgressCallback | None = None) -> None:
        """Capture now, before serving, the graph of every batch bucket at the shortest context bucket, largest
        batch first (smaller graphs then reuse the intermediates' pool). Serving then never stalls on these
        buckets' first use, which compiles kernels for the batch size besides capturing; longer contexts'
        graphs are still captured on first use. Nothing to do uncaptured (CPU)."""
        if not self.capture:
            return
        columns = context_bucket(1, self.block_size, table_width)
        start = time.perf_counter()
        for i, batch in enumerate(reversed(self.buckets)):
            self._get(batch, columns)
            if progress is not None:
                progress(f"captured decode graph {i + 1} of {len(self.buckets)}", (i + 1) / len(self.buckets))
        log.info("captured %d decode graphs (batch 1 to %d, context up to %d tokens) in %.1f s", self.num_graphs,
                 self.max_batch, columns * self.block_size, time.perf_counter() - start)

    def _get(self, batch: int, columns: int) -> _Graph | None:
        """The bucket's graph, captured now if it is new; None if its capture ran out of device memory."""
        key = (batch, columns)
        if key in self._eager:
            return None
        g = self._graphs.get(key)
        if g is None:
            try:
                g = self._build(batch, columns)
            except torch.OutOfMemoryError as exc:
                self._eager.add(key)
                log.warning("no memory to capture a decode graph (batch %d, context up to %d tokens): those steps "
                            "run eagerly from now on (%s)", batch, columns * self.block_size,
                            str(exc).splitlines()[0])
                return None
            self._graphs[key] = g
        return g

    def _build(self, batch: int, columns: int) -> _Graph:
        pinned = self.device.type == "cuda"
        host_ints = torch.zeros((3, batch), dtype=torch.int64, pin_memory=pinned)
        host_ints[2] = 1
        host_tables = torch.full((batch, columns), self.pad_block, dtype=torch.int32, pin_memory=pinned)
        if self._logits is None:  # (max_batch, vocab), not one per graph: 131 MB at 256 x 128k
            vocab = self.model.args.vocab_size
            self._logits = torch.empty((self.max_batch, vocab), dtype=torch.float32, device=self.device)
        g = _Graph(batch, columns, host_ints.to(self.device), host_tables.to(self.device), host_ints, host_tables,
                   self._logits[:batch])
        if not self.capture:
            return g
        start = time.perf_counter()
        # Eagerly first, with every row padding: compiles the kernels, loads their configs and allocates what
        # launchers keep per device (the W4A16 arrival counters; its scratch matrix, reserved at load) outside
        # the graph.
        self._forward(g)
        torch.cuda.synchronize(self.device)
        g.graph = torch.cuda.CUDAGraph()
        with pdl_for_batch(batch), torch.cuda.graph(g.graph, pool=self.pool):
            self._forward(g)
        g.copied = torch.cuda.Event()
        log.info("captured a decode graph in %.0f ms: batch %d, context up to %d tokens (%d graphs)",
                 1e3 * (time.perf_counter() - start), batch, columns * self.block_size, len(self._graphs) + 1)
        return g

    def _forward(self, g: _Graph) -> None:
        """The step on the static buffers; writes ``g.logits``. Only device work (it is what gets captured)."""
        bs = self.block_size
        token_ids, positions = g.ints[0], g.ints[1]
        block = g.tables.gather(1, (positions // bs)[:, None])[:, 0]
        meta = AttentionMetadata(
            block_size=bs,
            slot_mapping=block.long() * bs + positions % bs,
            positions=positions,
            query_start_loc=torch.arange(g.batch + 1, dtype=torch.int32, device=self.device),
            context_lens=g.ints[2].to(torch.int32),
            block_tables=g.tables,
            query_lens_cpu=np.ones(g.batch, dtype=np.int64),
            context_lens_cpu=np.full(g.batch, g.columns * bs, dtype=np.int64),
            max_query_len=1,
            max_context_len=g.columns * bs,
        )
        ctx = AttentionContext(meta, self.backend, self.kv_cache.k_caches, self.kv_cache.v_caches)
        hidden = self.model(token_ids, positions, ctx)
        g.logits.copy_(self.model.compute_logits(hidden))
