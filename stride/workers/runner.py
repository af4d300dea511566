"""ModelRunner: the rank worker's model half. Loads the weights, owns the KV cache, runs one step.

A step is one forward over the flattened tokens of every scheduled sequence (prefill chunks and decodes
together) and returns the float32 logits of each sequence's last token; sampling is the caller's. The
inputs are the step arrays of :mod:`stride.ipc.layouts` (numpy views of shared memory): the runner only
reads them, and copies just the rows and columns of the block tables this step needs, on its own side.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from stride.config import CacheConfig, SchedulerConfig, WorkerConfig, max_blocks_per_seq, quantize_group_size
from stride.planner.memory import MAX_GRAPH_BATCH
from stride.workers import cpu_int4
from stride.workers.attention import AttentionContext, AttentionMetadata
from stride.workers.backends import get_backend
from stride.workers.cpu_int4 import cpu_flags
from stride.workers.cuda_graphs import MIN_CONTEXT, DecodeGraphs
from stride.workers.kv_cache import KVCache, free_device_bytes, num_blocks_for_memory, resolve_kv_dtype
from stride.workers.loader import ProgressCallback, load_model, use_w4a16
from stride.workers.models.layers import W4A16Linear, use_fused_kernels
from stride.workers.parallel import TensorParallel, apply_tensor_parallel

if TYPE_CHECKING:  # imported where it runs: only a CPU worker that compiles its step loads it
    from stride.workers.cpu_step import BackgroundStep

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_NATIVE_BF16 = frozenset({"avx512_bf16", "amx_bf16"})
"""The /proc/cpuinfo flags of a CPU that multiplies bf16 natively."""


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX)."""
    return bool(cpu_flags(cpuinfo) & _NATIVE_BF16)


def cpu_runs_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether bf16 is this CPU's default run dtype: native bf16, or AVX2, where the large steps multiply in float32
    (:func:`stride.workers.cpu_int4.upcast_large_steps`) on weights held at half float32's bytes or less (a 4-bit
    grid: :func:`stride.workers.cpu_int4.drop_large_step_weights`). Older or unknown CPUs keep float32."""
    return bool(cpu_flags(cpuinfo) & (_NATIVE_BF16 | {"avx2"}))


def resolve_device_dtype(device: str = "", dtype: str = "") -> tuple[torch.device, torch.dtype]:
    """Empty device: CUDA when present. Empty dtype: bfloat16 on CUDA and on a CPU with native bf16 or AVX2 (half
    the bytes read per step; the default model on a native-bf16 CPU: 1.4x at one client, 1.7x at 16, greedy output
    equal to float32's but where float32's top two are within 0.06 of each other; on an AVX2-only one, with its
    4-bit grids, 2.9x at batch 1: docs/perf-log.md), float32 on other CPUs."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype!r}")
    return dev, _DTYPES[dtype or ("bfloat16" if dev.type == "cuda" or cpu_runs_bf16() else "float32")]


def _tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))


@dataclass(frozen=True)
class RunnerConfig:
    """What one :class:`ModelRunner` is built from: the worker's settings and the cache and batch limits it sizes
    its buffers for. The worker process derives it from the launch's configuration (:meth:`from_launch`)."""

    worker: WorkerConfig
    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int | None = None
    """KV blocks; None sizes the cache from the device memory measured free after loading (CUDA only, through
    the planner's formula)."""
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = SchedulerConfig.max_model_len
    tp_rank: int = 0
    """This runner's rank among ``worker.tensor_parallel_size``: it loads and holds only its shard."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or (self.num_blocks is not None and self.num_blocks <= 0):
            raise ValueError("block_size and num_blocks must be positive")
        if not 0 <= self.tp_rank < self.worker.tensor_parallel_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tensor_parallel_size {self.worker.tensor_parallel_size}")

    @staticmethod
    def from_launch(worker: WorkerConfig, cache: CacheConfig, sched: SchedulerConfig,
                    tp_rank: int = 0) -> RunnerConfig:
        """As the worker process runs: on CUDA the cache is sized from free memory (or has ``worker.num_gpu_blocks``
        where given, :func:`gpu_pool_blocks`), on CPU it has ``cache.num_blocks`` blocks."""
        device, _ = resolve_device_dtype(worker.device, worker.dtype)
        return RunnerConfig(worker, block_size=cache.block_size,
                            num_blocks=None if device.type == "cuda" else cache.num_blocks,
                            max_num_batched_tokens=sched.max_num_batched_tokens, max_num_seqs=sched.max_num_seqs,
                            max_model_len=sched.max_model_len, tp_rank=tp_rank)


def gpu_pool_blocks(requested: int, fits: int, free_bytes: int) -> int:
    """The blocks of a CUDA worker's pool: ``requested`` (``WorkerConfig.num_gpu_blocks``) where given and held by
    the memory left, else all that fit. ``MemoryError`` naming both counts where the request is more than fits, or
    where not one block fits."""
    if fits < 1:
        raise MemoryError(f"no room for a KV block: {free_bytes / 2**30:.2f} GiB free after the weights")
    if requested > fits:
        raise MemoryError(f"a pool of {requested} KV blocks was asked for; the memory left for it after the weights "
                          f"and activations ({free_bytes / 2**30:.2f} GiB of the share allowed) holds {fits}")
    return requested or fits


def refuse_weights_that_cannot_fit(model: str, dtype: torch.dtype, quantize_group: int, w4a16: bool, tp_size: int,
                                   free_bytes: int) -> None:
    """``MemoryError`` with the planner's figures when one rank's weights (the planner's count, in the format they
    will be held in) exceed ``free_bytes``: the deployment is refused before anything loads, not when a device
    allocation fails halfway through. A GGUF kept in its own 4-bit blocks is not checked: the planner's formats do
    not say which of its tensors stay 16-bit."""
    from stride.model.files import is_gguf
    from stride.planner.formats import weight_format
    from stride.planner.geometry import load_geometry
    from stride.planner.parallel import Parallelism, rank_weight_bytes

    if w4a16 and not quantize_group and is_gguf(model):
        return
    geometry = load_geometry(model)
    fmt = weight_format("w4a16", quantize_group) if quantize_group else weight_format(
        "fp16" if dtype == torch.float16 else "bf16")
    need = max(rank_weight_bytes(geometry, fmt, Parallelism(tp=tp_size)))
    held_as = fmt.name
    if dtype == torch.float32 and not quantize_group:
        need, held_as = need * 2, "float32"
    if need > free_bytes:
        raise MemoryError(
            f"{geometry.name or model}: the weights need {need / 2**30:.1f} GiB per rank ({held_as}, tp={tp_size}) "
            f"but {free_bytes / 2**30:.1f} GiB of the device is free for them; `stride plan` shows what fits "
            "(more ranks, or --quantize w4a16)")


class ModelRunner:
    """One rank's model and KV cache. Not thread-safe; one step at a time.

    ``WorkerConfig.cuda_graphs``: decode-only steps of up to :data:`MAX_GRAPH_BATCH` sequences replay CUDA graphs
    (:mod:`stride.workers.cuda_graphs`) with the Triton backend and a dense model (on CPU, the same padded
    static-buffer step, uncaptured); the cache then holds one block past ``num_blocks`` for the graphs'
    padding rows.
    """

    def __init__(self, config: RunnerConfig, progress: ProgressCallback | None = None,
                 tp: TensorParallel | None = None) -> None:
        """``tp``: this rank's group when ``worker.tensor_parallel_size`` > 1 (joined by the caller, one process per
        rank); its collectives are added to the model as a pass (:mod:`stride.workers.parallel`)."""
        self.config = config
        worker = config.worker
        tp_size = worker.tensor_parallel_size
        self.tp = tp or TensorParallel()
        if self.tp.size != tp_size or self.tp.rank != config.tp_rank:
            raise ValueError(f"runner of rank {config.tp_rank}/{tp_size} given the group of rank "
                             f"{self.tp.rank}/{self.tp.size}")
        block_size, num_blocks, max_num_seqs = config.block_size, config.num_blocks, config.max_num_seqs
        self.device, self.dtype = resolve_device_dtype(worker.device, worker.dtype)
        self.kv_dtype = resolve_kv_dtype(worker.kv_dtype, self.dtype)
        if self.device.type == "cpu":
            cpu_int4.bound_product_cache()  # before the first product: oneDNN reads it once
        # The backend first: without CUDA the triton one must load Triton (in interpreter mode) before the
        # model build does (torch imports Triton on its own then).
        self.backend = get_backend(worker.attention_backend, self.device.type)
        if self.backend.name == "triton":
            from stride.workers import kernel_configs  # Triton-side: loaded with the triton backend only

            kernel_configs.use_file(self.device, worker.autotune_cache)
        # GGUF Q4 projections stay 4-bit under the W4A16 GEMM with the triton backend on CUDA (WorkerConfig.w4a16);
        # ``quantize`` ("w4a16[-g<N>]") makes every projection 4-bit, quantised at load.
        group = quantize_group_size(worker.quantize)
        self.w4a16 = group > 0 or use_w4a16(self.device.type, self.backend.name, worker.w4a16)
        if self.device.type == "cuda":  # refuse what cannot fit before a byte of it loads
            refuse_weights_that_cannot_fit(worker.model, self.dtype, group, self.w4a16, tp_size,
                                           free_device_bytes(self.device, worker.gpu_memory_utilization))
        self.model = load_model(worker.model, self.device, self.dtype, progress, tp_rank=config.tp_rank,
                                tp_size=tp_size, w4a16=self.w4a16, quantize_group=group)
        # The GGUF reader's memory map sits in reference cycles: unmapped now, not at some later collection (on the
        # CPU the default model's file stayed 96 MB resident in the worker).
        gc.collect()
        apply_tensor_parallel(self.model, self.tp)
        self.args = self.model.args
        if self.w4a16:  # steps of many rows expand 4-bit weights into one scratch matrix: held before sizing
            from stride.kernels.w4a16 import reserve_scratch

            # K x N of each weight (its packed words pad N to whole tiles of 32 columns; the expansion does not).
            largest = max((m.in_features * sum(m.output_sizes) for m in self.model.modules()
                           if isinstance(m, W4A16Linear)), default=0)
            if largest:
                reserve_scratch(self.device, self.dtype, largest)
        graphs = self._graphs_wanted(worker.cuda_graphs)
        self.block_size = block_size
        if num_blocks is None:
            free = free_device_bytes(self.device, worker.gpu_memory_utilization)
            # With decode graphs their buffers are reserved too (the planner's formula): they are allocated at
            # capture, after the cache took its share (at start, and for longer contexts on first use).
            fits = num_blocks_for_memory(
                self.args, free, block_size, self.dtype, config.max_num_batched_tokens, max_num_seqs, tp_size,
                graph_table_width=self.table_width if graphs else 0, kv_dtype=self.kv_dtype,
            )
            # The decode graphs' padding block comes out of the measured memory too.
            fits = self.tp.agree_min(fits - int(graphs), self.device)  # every rank holds the same blocks
            num_blocks = gpu_pool_blocks(worker.num_gpu_blocks, fits, free)
        # With decode graphs the cache has one block more than the scheduler may name: the padding rows' own.
        self.kv_cache = KVCache(self.args, num_blocks + int(graphs), block_size, self.device, self.kv_dtype, tp_size)
        self.num_blocks = num_blocks
        self.last_step_graphed = False
        """Whether the last :meth:`forward` replayed a decode graph (the step timeline counts those apart)."""
        self.last_step_compiled = False
        """Whether the last :meth:`forward` ran the compiled CPU decode step (:mod:`stride.workers.cpu_step`)."""
        use_fused_kernels(self.model, self.backend.fused_layers)
        small_step_rows = 0  # steps of up to this many rows run on packed copies of some weights (0: none hold one)
        native = pack = False
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:  # small steps' own copies of weights
            native = cpu_has_bf16()
            pack = native and worker.cpu_pack and cpu_int4.packing_available()
            small_step_rows = cpu_int4.prepare(self.model, worker.cpu_int4, worker.cpu_int8_head, native, pack)
        self.compiled = self._compiled_step(small_step_rows, native, pack, config) if small_step_rows else None
        if pack:
            cpu_int4.pack_large_steps(self.model, compiled=self.compiled is not None)
        if graphs and self.device.type == "cuda" and worker.pdl:
            from stride.kernels.common import set_pdl  # loaded with the triton backend already

            set_pdl(True)
        self.graphs = (
            DecodeGraphs(self.model, self.kv_cache, self.backend, block_size, pad_block=num_blocks,
                         max_batch=min(max_num_seqs, MAX_GRAPH_BATCH), capture=self.device.type == "cuda")
            if graphs else None
        )
        log.info(
            "model %s on %s/%s: %d KV blocks of %d tokens in %s (%.2f GiB), attention %s",
            self.args.family,
            self.device,
            self.dtype,
            num_blocks,
            block_size,
            self.kv_dtype,
            self.kv_cache.nbytes / 2**30,
            self.backend.name,
        )

    @classmethod
    def from_config(cls, worker: WorkerConfig, cache: CacheConfig, sched: SchedulerConfig,
                    progress: ProgressCallback | None = None, tp: TensorParallel | None = None) -> ModelRunner:
        """As the worker process builds it (:meth:`RunnerConfig.from_launch`); on CUDA with the Triton kernels the
        decode graphs of the shortest context bucket are captured and one step of each kind is run
        (:meth:`warm_up`) now, not mid-serving."""
        runner = cls(RunnerConfig.from_launch(worker, cache, sched, tp.rank if tp else 0), progress, tp)
        if runner.graphs is not None:
            runner.graphs.capture_all(max_blocks_per_seq(sched, cache), progress)
        if runner.device.type == "cuda" and runner.backend.name == "triton":
            runner.warm_up(progress)
        return runner

    @property
    def table_width(self) -> int:
        """Columns of serving's block tables (:func:`stride.config.max_blocks_per_seq`): enough for max_model_len."""
        return -(-self.config.max_model_len // self.block_size)

    def warm_up(self, progress: ProgressCallback | None = None) -> None:
        """Run the kinds of step serving will meet (a whole prefill chunk; chunks beside few and beside many decodes;
        token counts that are and are not multiples of 16; decodes alone and beside a chunk in every context bucket,
        split into every power of two of programs they can be) once on made-up tokens, so that Triton compiles their
        kernels now and not under the first requests. A fresh H200 served an 8B's first 256 x 1k/1k run with its
        steps that carry prefill chunks at 348-384 ms against 199-228 once compiled (perf-log, 2026-12-03).

        Before serving no block holds anything the scheduler could name, so the steps write the cache's first blocks
        (sharing them where the cache is small); every block is written by its owner before it is read."""
        cfg = self.config
        bs = self.block_size
        budget = min(cfg.max_num_batched_tokens, cfg.max_model_len)
        many = min(cfg.max_num_seqs - 1, budget // 2, 255)
        # Past 256 keys a few decodes split their context over programs (stride.kernels.paged_decode's default), and
        # the reduction of the splits compiles once per power of two of their count. One odd context in each of the
        # graphs' context buckets past the shortest (2 * MIN_CONTEXT = 512 keys, then 1,024, ...) meets every count
        # a context up to max_model_len can have: 2, 4, 8, 16 splits up to 4k keys, in a decode alone (a graph,
        # with programmatic dependent launch where allowed) and beside a short chunk (eager, without).
        contexts, bucket = [], 2 * MIN_CONTEXT
        while bucket // 2 + 3 <= cfg.max_model_len:
            contexts.append(bucket // 2 + 3)
            bucket *= 2
        decode_ctx = min(cfg.max_model_len, 2 * MIN_CONTEXT + 3)  # the second of those where there is one
        few = min(3, many)
        # Each step: (the decodes' contexts, the chunk's (start, length) or None); nothing past max_model_len.
        steps: list[tuple[list[int], tuple[int, int] | None]] = [([], (0, budget))]
        for decodes in sorted({few, many}):
            length = budget - decodes - (budget - decodes) % 16 - 1  # odd: the other integer specialisation
            start = min(bs + 5, cfg.max_model_len - length)
            if decodes >= 1 and length >= 2 and start >= 0:
                steps.append(([decode_ctx] * decodes, (start, length)))
        steps.append(([decode_ctx], None))  # a decode alone: the graphs' longer context buckets, where captured
        short = min(17, budget - few)
        for keys in contexts:
            if keys == decode_ctx:
                continue  # met above
            steps.append(([keys], None))
            if few >= 1 and short >= 2 and short + bs + 5 <= cfg.max_model_len:
                steps.append(([keys] * few, (bs + 5, short)))
        # As wide as serving's block tables: a decode graph's context bucket is capped at the table's width, so a
        # narrower table would capture (and compile for) buckets serving never meets.
        width = self.table_width
        t0 = time.perf_counter()
        for i, (decodes_at, chunk) in enumerate(steps):
            start, length = chunk or (0, 0)
            ctx = np.array(decodes_at + ([start + length] if chunk else []), dtype=np.int64)
            q_lens = np.array([1] * len(decodes_at) + ([length] if chunk else []), dtype=np.int64)
            blocks_per_row = -(-ctx // bs)
            tables = np.zeros((len(ctx), width), dtype=np.int32)
            used = np.arange(int(blocks_per_row.sum())) % self.num_blocks
            tables[np.arange(tables.shape[1])[None, :] < blocks_per_row[:, None]] = used
            positions = np.concatenate([np.arange(c - q, c) for c, q in zip(ctx, q_lens, strict=True)])
            self.forward(positions % self.args.vocab_size, positions, np.arange(len(ctx)), q_lens, ctx, tables)
            if progress:
                progress(f"warmed step {i + 1} of {len(steps)}", (i + 1) / len(steps))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("ran %d warm-up steps (compiling their kernels) in %.1f s", len(steps), time.perf_counter() - t0)

    def _compiled_step(self, small_step_rows: int, native_bf16: bool, embedding_rows: bool,
                       config: RunnerConfig) -> BackgroundStep | None:
        """The compiled CPU decode step (:mod:`stride.workers.cpu_step`) for the steps the packed small-step weights
        take (1..``small_step_rows`` sequences), loaded or being built; None where it does not apply: a dense model on
        one CPU rank under the ``torch`` or ``sdpa`` attention, with packed copies and a cache in the run dtype (on this
        CPU the compiled step is 1.7x eager at one row, 1.2x at four, and slower than eager where the steps multiply in
        bf16: perf-log)."""
        worker = config.worker
        if not (worker.cpu_compile and self.device.type == "cpu" and self.backend.name in ("torch", "sdpa")
                and not self.args.num_experts and self.tp.size == 1 and self.kv_dtype == self.dtype):
            return None
        from stride.workers import cpu_step

        if not cpu_step.compiler_available():
            log.info("no C++ compiler found: decode steps run eagerly (STRIDE_CPU_COMPILE=0 silences this)")
            return None
        from stride.model.files import default_model_path

        settings = {"model": worker.model or default_model_path(), "dtype": str(self.dtype).removeprefix("torch."),
                    "cpu_int4": worker.cpu_int4, "cpu_int8_head": worker.cpu_int8_head, "native_bf16": native_bf16,
                    "attention": self.backend.name, "threads": torch.get_num_threads(),
                    "embedding_rows": embedding_rows}
        step = cpu_step.StepRange(1, small_step_rows, self.table_width, self.block_size)
        return cpu_step.BackgroundStep(settings, step, self.model, self.kv_cache.k_caches + self.kv_cache.v_caches)

    def _graphs_wanted(self, enabled: bool) -> bool:
        """Decode graphs need the Triton backend (the torch one reads lengths on the host) and a forward with
        no host reads (not mixture-of-experts routing). Without CUDA (Triton's interpreter, tests) the same
        static-buffer step runs uncaptured."""
        # Not yet with several ranks: capturing the collectives (NCCL) has not been run on more than one GPU.
        return enabled and self.backend.name == "triton" and not self.args.num_experts and self.tp.size == 1

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Any,
        positions: Any,
        seq_slots: Any,
        query_lens: Any,
        context_lens: Any,
        block_tables: Any,
    ) -> torch.Tensor:
        """Run one step; return float32 logits (num_seqs, vocab) of each sequence's last token this step.

        ``token_ids``/``positions``: (num_tokens,), sequences back to back; ``seq_slots``, ``query_lens``,
        ``context_lens`` (KV length after this step): (num_seqs,); ``block_tables``: the whole
        (max_num_seqs, max_blocks) array, rows indexed by slot. numpy arrays or CPU tensors, int32 or int64;
        ``token_ids`` may also be a tensor on the runner's device (a step launched before the host knows the tokens
        the step before sampled: nothing here reads their values).
        """
        q_lens = np.asarray(query_lens, dtype=np.int64)
        ctx_lens = np.asarray(context_lens, dtype=np.int64)
        slots = np.asarray(seq_slots, dtype=np.int64)
        if len(q_lens) == 0:
            return torch.empty(0, self.args.vocab_size, device=self.device)
        max_blocks = int(-(-ctx_lens.max() // self.block_size))
        # Only this step's rows and columns leave the shared array; the gather copies on our side. The checks are
        # numpy: the host side of a step stays on one thread (torch's CPU ops would fan small arrays out to its
        # thread pool).
        all_tables = block_tables.numpy() if isinstance(block_tables, torch.Tensor) else np.asarray(block_tables)
        width = all_tables.shape[1]
        if max_blocks > width:
            raise ValueError(f"a context of {int(ctx_lens.max())} tokens needs {max_blocks} blocks but the block "
                             f"table has {width} columns")
        rows = all_tables[slots, :max_blocks]
        in_context = np.arange(max_blocks)[None, :] < (-(-ctx_lens // self.block_size))[:, None]
        used = rows[in_context]
        if used.size and (used.min() < 0 or used.max() >= self.num_blocks):
            raise ValueError(f"block table names a block outside 0..{self.num_blocks - 1}")
        tables_host = torch.from_numpy(np.ascontiguousarray(rows))
        # The kernels place a sequence's tokens at the last query_len positions of its context; a position
        # past the context would also index past its block table (a device-side assert on CUDA).
        pos_host = np.asarray(positions, dtype=np.int64)
        offsets = np.arange(len(pos_host)) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
        if len(pos_host) != q_lens.sum() or np.any(pos_host != np.repeat(ctx_lens - q_lens, q_lens) + offsets):
            raise ValueError("each sequence's positions must be the last query_len of its context_len")
        decode_only = q_lens.max() == 1
        self.last_step_graphed = self.last_step_compiled = False
        if self.graphs is not None and decode_only and self.graphs.fits(len(q_lens), int(ctx_lens.max()), width):
            ids = token_ids if isinstance(token_ids, torch.Tensor) else np.asarray(token_ids)
            logits = self.graphs.run(ids, pos_host, ctx_lens, tables_host, width)
            if logits is not None:  # else no memory to capture its bucket: eagerly, below
                self.last_step_graphed = True
                return logits
        if self.compiled is not None:
            self.compiled.poll()
            step = self.compiled.find(len(q_lens), max_blocks) if decode_only else None
            if step is not None:  # its inputs on the host: one row of blocks per sequence, past its context block 0
                self.last_step_compiled = True
                return self.model.compute_logits(step(
                    _tensor(token_ids).to("cpu", torch.long), torch.from_numpy(pos_host),
                    torch.from_numpy(np.where(in_context, rows, 0).astype(np.int64))))
        tokens = _tensor(token_ids).to(self.device, torch.long, non_blocking=True)
        pos = _tensor(positions).to(self.device, torch.long, non_blocking=True)
        tables = tables_host.to(self.device, torch.int32, non_blocking=True)
        meta = AttentionMetadata.build(pos, q_lens, ctx_lens, tables, self.block_size)
        ctx = AttentionContext(meta, self.backend, self.kv_cache.k_caches, self.kv_cache.v_caches)
        hidden = self.model(tokens, pos, ctx)
        last = meta.query_start_loc[1:].long() - 1
        return self.model.compute_logits(hidden[last])

    def close(self) -> None:
        """Stop what runs beside the runner (a compiled step's build: the next start begins it again)."""
        if self.compiled is not None:
            self.compiled.close()

    def step(self, buffers: Any, num_tokens: int, num_seqs: int, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward` over a :class:`stride.ipc.layouts.StepBuffers` (views, no copies); ``token_ids`` (on the
        device) in place of the buffers' own."""
        return self.forward(
            buffers.token_ids[:num_tokens] if token_ids is None else token_ids,
            buffers.positions[:num_tokens],
            buffers.seq_slots[:num_seqs],
            buffers.query_lens[:num_seqs],
            buffers.context_lens[:num_seqs],
            buffers.block_tables,
        )
