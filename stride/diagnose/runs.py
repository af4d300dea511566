"""Run a model one way (a :class:`~stride.diagnose.spec.RunSpec`) over a fixed schedule of steps and capture every
layer's hidden states.

The schedule (:class:`Schedule`): the prompts prefilled together in one step, then ``decode_steps`` steps of one
token per sequence, then the same prompts again as new sequences prefilled in chunks (so the chunked path, which
reads its own earlier KV from the cache, is compared too). After each layer the capture keeps the residual stream
after attention (``x + attn(norm(x))``) and after the MLP (the layer's output), in float32, and each sequence's
last-token logits. At every decision point (the prefill, each decode step) it keeps the greedy token and the top-two
log-prob margin.

Both runs of a comparison must see the same token ids: the reference runs first on its own greedy tokens, and the
other is fed those (``forced``), whatever it would choose; what it would have chosen is kept, for the flips.

Stride runs go through the worker's own :class:`~stride.workers.runner.ModelRunner`; with ``tp`` > 1 each rank is a
process of its own, joined as ``stride serve --tp N`` joins them (gloo on the CPU, NCCL on GPUs), rank 0 writing the
capture. HuggingFace runs load the same checkpoint (a GGUF through ``gguf_file=``) and run each sequence with its own
cache. A step replayed from a CUDA graph runs no Python hooks: its layers are not observed, only its logits.
"""

from __future__ import annotations

import inspect
import os
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stride.config import WorkerConfig
from stride.diagnose.spec import RunSpec
from stride.model.files import is_gguf

Prepare = Callable[[Any, int], None]
"""``(model, tp_rank)``: applied to each rank's model after it loads, before the schedule runs (a planted fault,
when testing the tool; must be picklable for several ranks)."""

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Schedule:
    prompts: tuple[tuple[int, ...], ...]
    decode_steps: int = 4
    chunk: int = 0
    """Tokens per step of the chunked prefill; 0: a third of the shortest prompt (at least one)."""

    def __post_init__(self) -> None:
        if not self.prompts or any(len(p) == 0 for p in self.prompts):
            raise ValueError("every prompt needs at least one token")
        if self.decode_steps < 0 or self.chunk < 0:
            raise ValueError("decode_steps and chunk must be >= 0")

    @property
    def chunk_size(self) -> int:
        return self.chunk or max(1, min(len(p) for p in self.prompts) // 3)

    @property
    def max_len(self) -> int:
        return max(len(p) for p in self.prompts) + self.decode_steps + 1


@dataclass
class StepCapture:
    phase: str
    """``prefill``, ``decode N`` or ``chunk N``."""
    logits: torch.Tensor
    """(sequences, vocab) float32: each sequence's last token of the step."""
    attention: torch.Tensor | None = None
    """(layers, tokens, hidden) float32: the residual stream after each layer's attention; None if not observed."""
    mlp: torch.Tensor | None = None
    """(layers, tokens, hidden) float32: each layer's output."""


@dataclass
class Capture:
    label: str
    num_layers: int
    steps: list[StepCapture] = field(default_factory=list)
    chosen: list[list[int]] = field(default_factory=list)
    """Greedy token per sequence at each decision point (the prefill, then each decode step)."""
    margins: list[list[float]] = field(default_factory=list)
    """Top-two log-prob margin per sequence at each decision point."""

    def add(self, step: StepCapture, decides: bool) -> None:
        """Keep one step; at a decision point, also its greedy tokens and margins."""
        self.steps.append(step)
        if decides:
            self.decide(step.logits)

    def decide(self, logits: torch.Tensor) -> list[int]:
        top = torch.log_softmax(logits.float(), dim=-1).topk(2, dim=-1)
        self.chosen.append(top.indices[:, 0].tolist())
        self.margins.append((top.values[:, 0] - top.values[:, 1]).tolist())
        return self.chosen[-1]


@dataclass(frozen=True)
class _Step:
    phase: str
    slots: list[int]
    tokens: list[list[int]]
    starts: list[int]
    """Position of each sequence's first token this step."""
    decides: bool


def _steps(schedule: Schedule, fed: Callable[[int, int], int]) -> Any:
    """The schedule's steps in order; ``fed(d, i)`` is the token sequence ``i`` gets at decode step ``d`` (1-based),
    asked only once the step before it has run."""
    n = len(schedule.prompts)
    lens = [len(p) for p in schedule.prompts]
    yield _Step("prefill", list(range(n)), [list(p) for p in schedule.prompts], [0] * n, True)
    for d in range(1, schedule.decode_steps + 1):
        yield _Step(f"decode {d}", list(range(n)), [[fed(d, i)] for i in range(n)],
                    [lens[i] + d - 1 for i in range(n)], True)
    c = schedule.chunk_size
    for j in range(-(-max(lens) // c)):
        live = [i for i in range(n) if j * c < lens[i]]
        yield _Step(f"chunk {j + 1}", [n + i for i in live], [list(schedule.prompts[i][j * c : (j + 1) * c])
                                                                for i in live], [j * c] * len(live), False)


def _feeder(capture: Capture, forced: list[list[int]] | None) -> Callable[[int, int], int]:
    def fed(d: int, i: int) -> int:
        return forced[d - 1][i] if forced is not None else capture.chosen[d - 1][i]
    return fed


def _blocks_per_seq(schedule: Schedule) -> int:
    return -(-schedule.max_len // BLOCK_SIZE)


def run_stride(spec: RunSpec, model: str, schedule: Schedule, forced: list[list[int]] | None = None,
               prepare: Prepare | None = None, tp: Any = None) -> Capture:
    """One rank of a Stride run (``tp``: its group when ``spec.tp`` > 1, joined by the caller)."""
    from stride.workers.runner import ModelRunner, RunnerConfig

    rank = tp.rank if tp is not None else 0
    n = len(schedule.prompts)
    per_seq = _blocks_per_seq(schedule)
    worker = WorkerConfig(model=model, dtype=spec.dtype, tensor_parallel_size=spec.tp,
                          attention_backend=spec.backend, quantize=spec.quantize, kv_dtype=spec.kv,
                          cuda_graphs=spec.graphs)
    if spec.device:
        worker = replace(worker, device=spec.device)
    # One block past the sequences' own: a write one slot off (a fault under test) stays inside the cache.
    total = sum(len(p) for p in schedule.prompts)
    config = RunnerConfig(worker, block_size=BLOCK_SIZE, num_blocks=2 * n * per_seq + 1, max_num_seqs=2 * n,
                          max_model_len=per_seq * BLOCK_SIZE, max_num_batched_tokens=max(2048, total), tp_rank=rank)
    runner = ModelRunner(config, tp=tp)
    if prepare is not None:
        prepare(runner.model, rank)
    layers = runner.model.layers
    seen: dict[str, list[torch.Tensor | None]] = {"attention": [None] * len(layers), "mlp": [None] * len(layers)}

    def record(i: int) -> Any:
        def hook(_m: Any, _inputs: Any, out: tuple[torch.Tensor, torch.Tensor]) -> None:
            if out[0].is_cuda and torch.cuda.is_current_stream_capturing():
                return  # a decode graph being captured: its replays run no hooks, so nothing is seen of it
            mlp_out, residual = out
            seen["attention"][i] = residual.to("cpu", torch.float32, copy=True)
            seen["mlp"][i] = (mlp_out + residual).to("cpu", torch.float32, copy=True)
        return hook

    handles = [block.register_forward_hook(record(i)) for i, block in enumerate(layers)]
    # A decode step served from a CUDA graph is not observed: replays run no hooks, and what hooks saw while the
    # graph was built (its warm-up, on padded static buffers) is not this step.
    replayed = [False]
    if runner.graphs is not None:
        graph_run = runner.graphs.run

        def run_graph(*args: Any) -> Any:
            out = graph_run(*args)
            replayed[0] = out is not None
            return out

        runner.graphs.run = run_graph  # type: ignore[method-assign, assignment]
    tables = np.arange(2 * n * per_seq, dtype=np.int32).reshape(2 * n, per_seq)
    capture = Capture(spec.label(), len(layers))
    try:
        for step in _steps(schedule, _feeder(capture, forced)):
            for v in seen.values():
                v[:] = [None] * len(layers)
            replayed[0] = False
            q_lens = [len(t) for t in step.tokens]
            tokens = np.concatenate([np.asarray(t, np.int64) for t in step.tokens])
            positions = np.concatenate([np.arange(s, s + q, dtype=np.int64) for s, q in zip(step.starts, q_lens,
                                                                                             strict=True)])
            logits = runner.forward(tokens, positions, np.asarray(step.slots), np.asarray(q_lens),
                                    np.asarray([s + q for s, q in zip(step.starts, q_lens, strict=True)]), tables)
            observed = not replayed[0] and all(t is not None for v in seen.values() for t in v)
            capture.add(StepCapture(
                step.phase, logits.to("cpu", torch.float32, copy=True),
                torch.stack(seen["attention"]) if observed else None,  # type: ignore[arg-type]
                torch.stack(seen["mlp"]) if observed else None), step.decides)  # type: ignore[arg-type]
    finally:
        for h in handles:
            h.remove()
    return capture


def _rank_main(rank: int, spec: RunSpec, model: str, schedule: Schedule, forced: list[list[int]] | None,
               prepare: Prepare | None, init_file: str, out: str) -> None:
    """One rank process of a run over several ranks (``torch.multiprocessing.spawn`` starts it)."""
    from stride.workers.parallel import TensorParallel, exit_spawned_rank
    from stride.workers.runner import resolve_device_dtype

    device, _ = resolve_device_dtype(spec.device, spec.dtype)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.tp))
    tp = TensorParallel.init(rank, spec.tp, f"file://{init_file}", device.type)
    try:
        capture = run_stride(spec, model, schedule, forced, prepare, tp)
        if rank == 0:
            torch.save(capture, out)
    finally:
        tp.destroy()
    exit_spawned_rank()


def run_ranks(spec: RunSpec, model: str, schedule: Schedule, forced: list[list[int]] | None = None,
              prepare: Prepare | None = None) -> Capture:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="stride-diagnose-") as tmp:
        out = os.path.join(tmp, "capture.pt")
        mp.spawn(_rank_main, args=(spec, model, schedule, forced, prepare, os.path.join(tmp, "rendezvous"), out),
                 nprocs=spec.tp, join=True)
        capture: Capture = torch.load(out, weights_only=False)
    return capture


def run_hf(spec: RunSpec, model: str, schedule: Schedule, forced: list[list[int]] | None = None) -> Capture:
    """The same schedule through HuggingFace transformers (each sequence alone, with its own cache)."""
    try:
        import transformers
    except ImportError as e:
        raise RuntimeError("the hf reference needs transformers (pip install transformers accelerate gguf)") from e
    from stride.workers.runner import resolve_device_dtype

    device, dtype = resolve_device_dtype(spec.device, spec.dtype)
    path = Path(model)
    kwargs: dict[str, Any] = {"gguf_file": path.name} if is_gguf(model) else {}
    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent if is_gguf(model) else path), dtype=dtype, **kwargs)
    hf = hf.to(device).eval()
    layers = hf.model.layers
    seen: dict[str, list[torch.Tensor]] = {"attention": [], "mlp": []}

    def after_attention(_m: Any, args: tuple[torch.Tensor, ...]) -> None:
        seen["attention"].append(args[0][0].to("cpu", torch.float32, copy=True))

    def after_mlp(_m: Any, _args: Any, out: Any) -> None:
        hidden = out[0] if isinstance(out, tuple) else out
        seen["mlp"].append(hidden[0].to("cpu", torch.float32, copy=True))

    handles = [h for layer in layers for h in (
        layer.post_attention_layernorm.register_forward_pre_hook(after_attention),
        layer.register_forward_hook(after_mlp))]
    caches: dict[int, Any] = {}
    # transformers renamed past_key_values to cache (5.x, the old name deprecated)
    cache_arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    capture = Capture(spec.label(), len(layers))
    try:
        with torch.inference_mode():
            for step in _steps(schedule, _feeder(capture, forced)):
                parts: dict[str, list[list[torch.Tensor]]] = {"attention": [], "mlp": []}
                logits = []
                for slot, tokens, start in zip(step.slots, step.tokens, step.starts, strict=True):
                    for v in seen.values():
                        v.clear()
                    cache = caches.setdefault(slot, transformers.DynamicCache())
                    ids = torch.tensor([tokens], device=device)
                    pos = torch.arange(start, start + len(tokens), device=device)[None]
                    out = hf(input_ids=ids, position_ids=pos, use_cache=True, **{cache_arg: cache})
                    logits.append(out.logits[0, -1].to("cpu", torch.float32))
                    for k in parts:
                        parts[k].append(list(seen[k]))
                stacked = {k: torch.stack([torch.cat([seq[i] for seq in parts[k]]) for i in range(len(layers))])
                           for k in parts}
                capture.add(StepCapture(step.phase, torch.stack(logits), stacked["attention"], stacked["mlp"]),
                            step.decides)
    finally:
        for h in handles:
            h.remove()
    return capture


def run(spec: RunSpec, model: str, schedule: Schedule, forced: list[list[int]] | None = None,
        prepare: Prepare | None = None) -> Capture:
    """``spec``'s capture of ``schedule`` (fed ``forced`` tokens at the decode steps, if given)."""
    if spec.hf:
        if prepare is not None:
            raise ValueError("a prepare step applies to Stride's ranks, not to transformers")
        return run_hf(spec, model, schedule, forced)
    if spec.tp == 1:
        return run_stride(spec, model, schedule, forced, prepare)
    return run_ranks(spec, model, schedule, forced, prepare)


def wrap_forward(module: torch.nn.Module, wrapper: Callable[..., Any]) -> None:
    """Replace ``module``'s forward by ``wrapper(original_forward, *args)`` (for prepare steps)."""
    original = module.forward
    module.forward = types.MethodType(lambda _self, *args: wrapper(original, *args), module)  # type: ignore[method-assign]
