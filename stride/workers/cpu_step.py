"""The CPU's decode step compiled ahead of time (AOTInductor): one call into generated C++ instead of ~2,000 small
aten ops and the Python around them.

On a CPU a small decode step of the default model is bound by its host work, not its weights: ~60 small ops a
layer (norms, RoPE, the attention's gathers and casts), each 3-10 us, plus the module calls around them, cost as
much as the 4-bit projections themselves (perf-log). Inductor fuses those into a few loops per layer. The whole
decode step of the real model up to its final norm (:class:`~stride.workers.models.llama.Transformer`, the
reference attention's decode-only path, the small-step 4-bit grids and Q8_0 embedding rows; the head runs after it,
eagerly) is exported with ``torch.export`` and compiled by AOTInductor
into a package; the worker loads it with torch's C++ package loader (no inductor in the serving process) and runs
the decode steps it covers through it, everything else eagerly as before.

- **Weights are inputs, not constants**: the package holds code only (~8 MB for the default model), the worker
  passes its own weight tensors in every call, so no second copy of the model exists. The KV caches are inputs too,
  written in place.
- **Dynamic shapes**: one package covers steps of ``min_rows..max_rows`` sequences (one side of the projections'
  small-step branch, :func:`stride.workers.models.layers.project`) and of 1..``max_blocks`` blocks of context, over
  a pool of any size.
- **Built once, off the serving path**: a child process (``python -m stride.workers.cpu_step``, one thread, lowest
  priority) loads the model as the worker does and compiles it (80-100 s for the default model on a 2-core machine);
  meanwhile the worker serves eagerly and switches over when the package is ready. Packages are cached under
  ``~/.cache/stride/cpu_step`` (:data:`stride.env.CPU_STEP_CACHE`), keyed by everything that shapes the step: the
  model file, the run settings, the step range, this CPU's flags, torch's version and the source of the modules the
  step is made of. A failed build is remembered there (``<key>.failed``, its log) and not retried until removed.
- **Eager's answers**: compiled with ``emulate_precision_casts`` (inductor rounds bf16 where eager rounds), so the
  K/V written and the logits differ from eager's only by the order of fused float32 sums: the default model's
  compiled step is as close to the float32 model as the eager bf16 step is (``scripts/compare_cpu_step.py``).

Needs a C++ compiler (the one inductor finds); without one, or with ``STRIDE_CPU_COMPILE=0``, the worker stays eager.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stride import env

log = logging.getLogger(__name__)

SOURCES = ("attention.py", "cpu_int4.py", "cpu_step.py", "models/layers.py", "models/llama.py")
"""The modules (under ``stride/workers``) a compiled step is made of: a change to any of them is a new package."""

@dataclass(frozen=True)
class StepRange:
    """The decode steps one package runs: ``min_rows..max_rows`` sequences, each of 1..``max_blocks`` blocks of
    ``block_size`` tokens of context."""

    min_rows: int
    max_rows: int
    max_blocks: int
    block_size: int

    def covers(self, rows: int, blocks: int) -> bool:
        return self.min_rows <= rows <= self.max_rows and blocks <= self.max_blocks


SLOTS = ("int4", "rows")
"""The packed copies the compiled step reads in place of a module's weight: a projection's 4-bit grid, the
embedding's Q8_0 rows (:mod:`stride.workers.cpu_int4`)."""


def weight_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the step reads from ``model``, in the order the package takes them: parameters and buffers
    (tied ones once), then the tensors of the packed copies (``<module>.<slot>.<field>``, :data:`SLOTS`). Not the
    weight of a module with such a copy (the steps compiled are the copy's, and the worker may hold that weight in
    oneDNN's layout, which the package cannot take: :func:`stride.workers.cpu_int4.pack_large_steps`), nor the
    output projection's: the package ends at the final norm and the head runs after it, eagerly."""
    skip = {f"{prefix}.weight" for prefix, module in model.named_modules()
            if any(vars(module).get(slot) is not None for slot in SLOTS)}
    skip.add("lm_head.weight")
    out: list[tuple[str, torch.Tensor]] = [(n, t) for n, t in model.named_parameters() if n not in skip]
    out += [(name, t) for name, t in model.named_buffers()]
    for prefix, module in model.named_modules():
        for slot in SLOTS:
            small = vars(module).get(slot)
            if small is None:
                continue
            for field_name, value in vars(small).items():
                if isinstance(value, torch.Tensor):
                    out.append((f"{prefix}.{slot}.{field_name}", value))
    return out


class DecodeStep(nn.Module):
    """The exported step: ``(tokens, positions, blocks, caches, weights) -> hidden``. ``blocks`` is each sequence's
    block table over its context (unused entries any valid block: masked); each token is its sequence's one query
    at ``positions`` (context ``positions + 1``). Writes the step's K/V into ``caches`` (the K caches, then the V
    caches, layer by layer) and returns the final-norm hidden states (the head runs after it, eagerly: its weight may
be in oneDNN's layout, which the package cannot take)."""

    def __init__(self, model: nn.Module, block_size: int, attention: str = "torch") -> None:
        super().__init__()
        self.model = model
        self.block_size = block_size
        self.attention = attention
        """The attention backend whose decode path the step is made of: ``torch`` or ``sdpa``, as the worker's."""
        self.names = [name for name, _ in weight_tensors(model)]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, blocks: torch.Tensor,
                caches: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor:
        from torch.func import functional_call

        from stride.workers.attention import AttentionContext, AttentionMetadata
        from stride.workers.backends import get_backend

        layers = len(caches) // 2
        meta = AttentionMetadata.decode_only(positions, blocks, self.block_size)
        ctx = AttentionContext(meta, get_backend(self.attention, "cpu"), list(caches[:layers]), list(caches[layers:]))
        dense = dict(zip(self.names, weights, strict=True))
        swapped = _swap_small_steps(self.model, dense)
        try:
            plain = {k: v for k, v in dense.items() if k not in swapped}
            hidden: torch.Tensor = functional_call(self.model, plain, (tokens, positions, ctx), tie_weights=True,
                                                   strict=False)
        finally:
            _restore_small_steps(self.model, swapped)
        return hidden


def _swap_small_steps(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Point the packed small-step copies' fields at ``tensors`` (their names from :func:`weight_tensors`);
    returns the originals by name, for :func:`_restore_small_steps`."""
    originals = {}
    for name, tensor in tensors.items():
        path, slot, field_name = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", "")
        if slot not in SLOTS:
            continue
        small = getattr(model.get_submodule(path), slot)
        originals[name] = getattr(small, field_name)
        setattr(small, field_name, tensor)
    return originals


def _restore_small_steps(model: nn.Module, originals: dict[str, torch.Tensor]) -> None:
    for name, tensor in originals.items():
        path, slot, field_name = name.rsplit(".", 2)
        setattr(getattr(model.get_submodule(path), slot), field_name, tensor)


def export(model: nn.Module, caches: Sequence[torch.Tensor], step: StepRange, attention: str = "torch") -> Any:
    """``torch.export`` of :class:`DecodeStep` over ``step``'s range, the pool size dynamic too."""
    from torch.export import Dim

    module = DecodeStep(model, step.block_size, attention)
    rows = 2 if step.min_rows <= 2 <= step.max_rows else step.min_rows
    nblocks = min(3, step.max_blocks)
    pool = caches[0].shape[0]
    tokens = torch.zeros(rows, dtype=torch.long)
    positions = torch.arange(rows, dtype=torch.long) + (nblocks - 1) * step.block_size
    blocks = (torch.arange(rows * nblocks, dtype=torch.long) % pool).view(rows, nblocks)
    batch = Dim("rows", min=step.min_rows, max=step.max_rows)
    width = Dim("blocks", min=1, max=step.max_blocks)
    pool_dim = Dim("pool", min=2)
    dynamic = {
        "tokens": {0: batch}, "positions": {0: batch}, "blocks": {0: batch, 1: width},
        "caches": [{0: pool_dim}] * len(caches), "weights": [None] * len(module.names),
    }
    weights = [t for _, t in weight_tensors(model)]
    with torch.inference_mode(False), torch.no_grad():
        return torch.export.export(module, (tokens, positions, blocks, list(caches), weights),
                                   dynamic_shapes=dynamic, strict=False)


def compile_package(exported: Any, path: Path, threads: int = 1) -> None:
    """AOTInductor: ``exported`` compiled into the package ``path`` (written whole or not at all), its generated loops
    run on ``threads`` threads (the worker's torch threads, from the build's settings)."""
    import torch._inductor

    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.pt2")
    # emulate_precision_casts: inductor rounds bf16 intermediates where eager rounds them, so the answers are eager's
    # to the order of fused reductions (without it they drift further, and the step was no faster: perf-log).
    torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp), inductor_configs={
        "emulate_precision_casts": True,
        # The generated loops on the worker's threads, as the library kernels they call (the int4 products, SDPA):
        # on an Intel Xeon, served, 1.13-1.17x at 16 clients with the grids taking 16-row steps, and 1 client no
        # slower (perf-log "twenty-third session"; a Zen 4's 1-row step alone was 1.15x faster on one thread:
        # perf-log "compiled ahead of time").
        "cpp.threads": threads,
    })
    os.replace(tmp, path)


class CompiledStep:
    """A loaded package: runs the decode steps of its :class:`StepRange` on the model's own weights and caches."""

    def __init__(self, path: Path, step: StepRange, model: nn.Module, caches: Sequence[torch.Tensor]) -> None:
        self.step = step
        self.path = path
        meta = json.loads(path.with_suffix(".json").read_text())
        weights = weight_tensors(model)
        names = [name for name, _ in weights]
        if meta.get("weights") != names or meta.get("step") != asdict(step):
            raise ValueError(f"{path}: built for other weights or steps than these")
        # torch's C++ loader, not torch._inductor.aoti_load_package: the serving process never imports inductor.
        self._loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        self._inputs = list(caches) + [t for _, t in weights]

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states (rows, hidden) for the head; ``tokens``, ``positions`` (rows,) and ``blocks``
        (rows, blocks) int64."""
        out: torch.Tensor = self._loader.run([tokens, positions, blocks, *self._inputs])[0]
        return out


def compiler_available() -> bool:
    """Whether inductor would find a C++ compiler (its own lookup: ``$CXX``, then ``c++``/``g++``/``clang++``)."""
    cxx = os.environ.get("CXX")
    return any(shutil.which(c) for c in ([cxx] if cxx else []) + ["c++", "g++", "clang++"])


def cache_dir() -> Path:
    return Path(env.CPU_STEP_CACHE.get() or Path.home() / ".cache" / "stride" / "cpu_step")


def package_key(settings: dict[str, Any], step: StepRange) -> str:
    """What names a package: everything that shapes the compiled step (see the module's docstring)."""
    from stride.workers.cpu_int4 import cpu_flags

    model = Path(settings["model"])
    files = sorted(p for p in model.rglob("*") if p.is_file()) if model.is_dir() else [model]
    root = Path(__file__).parent
    h = hashlib.sha256()
    parts = {
        "settings": settings, "step": asdict(step), "torch": torch.__version__, "python": platform.python_version(),
        "model": [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files],
        "cpu": sorted(cpu_flags()),
    }
    h.update(json.dumps(parts, sort_keys=True).encode())
    for source in SOURCES:
        h.update((root / source).read_bytes())
    return h.hexdigest()[:20]


class BackgroundStep:
    """The worker's compiled decode step: loaded from the cache, or built by a child process while the worker serves
    eagerly (:meth:`poll`, called before each step, loads it when the child is done).

    ``settings``: what the child loads the model with (``model`` a file or folder, ``dtype``, ``cpu_int4``,
    ``cpu_int8_head`` as in :class:`~stride.config.WorkerConfig`, ``native_bf16`` as
    :func:`stride.workers.runner.cpu_has_bf16` says, ``attention`` the worker's backend, ``threads`` its torch
    threads, which the generated loops use too), and part of the package's key."""

    def __init__(self, settings: dict[str, Any], step: StepRange, model: nn.Module,
                 caches: Sequence[torch.Tensor]) -> None:
        self.step, self.model, self.caches = step, model, list(caches)
        self.ready: CompiledStep | None = None
        self.path = cache_dir() / f"{package_key(settings, step)}.pt2"
        self._build: subprocess.Popen[bytes] | None = None
        self._started = 0.0
        failed = self.path.with_suffix(".failed")
        if self.path.exists():
            self._load()
        elif failed.exists():
            log.warning("the compiled decode step failed to build before (%s): decode steps stay eager; remove "
                        "that file to try again", failed)
        else:
            self._start(settings)

    @property
    def building(self) -> bool:
        return self._build is not None

    def _start(self, settings: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        spec = json.dumps({"settings": settings, "step": asdict(self.step), "out": str(self.path)})
        log.info("compiling the decode step (steps of %d..%d sequences) in the background, about two minutes of "
                 "one core: decode steps run eagerly until it is ready", self.step.min_rows, self.step.max_rows)
        with open(self.path.with_suffix(".log"), "wb") as out:  # the child holds its own descriptor
            self._build = subprocess.Popen([sys.executable, "-m", "stride.workers.cpu_step", spec], stdout=out,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._started = time.monotonic()

    def poll(self) -> None:
        """Load the package if its build just finished (one ``waitpid`` otherwise)."""
        if self._build is None or self._build.poll() is None:
            return
        code, self._build = self._build.returncode, None
        if code == 0 and self.path.exists():
            log.info("compiled decode step built in %.0f s", time.monotonic() - self._started)
            self._load()
            return
        failed = self.path.with_suffix(".failed")
        os.replace(self.path.with_suffix(".log"), failed)
        log.warning("building the compiled decode step failed (exit %s; its log: %s): decode steps stay eager",
                    code, failed)

    def _load(self) -> None:
        try:
            self.ready = CompiledStep(self.path, self.step, self.model, self.caches)
        except Exception as exc:  # a package that does not load: eager, said once
            log.warning("could not load the compiled decode step %s (%s): decode steps stay eager", self.path, exc)

    def wait(self, timeout: float | None = None) -> CompiledStep | None:
        """Block until a build under way ends (or ``timeout`` seconds pass), loading its package; the compiled step,
        None if there is none (the build failed, timed out, or there was nothing to load). For scripts and tests: the
        worker never waits, it polls."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.building and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.5)
            self.poll()
        return self.ready

    def find(self, rows: int, blocks: int) -> CompiledStep | None:
        """The compiled step if it is ready and covers a decode step of ``rows`` sequences over ``blocks`` blocks."""
        ready = self.ready
        return ready if ready is not None and ready.step.covers(rows, blocks) else None

    def close(self) -> None:
        """Stop a build still running (the worker is stopping; the next start begins it again)."""
        if self._build is not None and self._build.poll() is None:
            self._build.kill()
            self._build.wait()
        self._build = None


def _build(spec: dict[str, Any]) -> None:
    """The child's work: load the model as the worker does, export and compile its step range into the cache."""
    from stride.workers import cpu_int4
    from stride.workers.kv_cache import KVCache
    from stride.workers.loader import load_model

    torch.set_num_threads(1)
    try:
        os.nice(19)
    except OSError:
        pass
    settings, step, out = spec["settings"], StepRange(**spec["step"]), Path(spec["out"])
    dtype = getattr(torch, settings["dtype"])
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"no dtype {settings['dtype']!r}")
    started = time.monotonic()
    model = load_model(settings["model"], "cpu", dtype)
    if dtype == torch.bfloat16:
        cpu_int4.prepare(model, settings["cpu_int4"], settings["cpu_int8_head"], settings["native_bf16"],
                         settings.get("embedding_rows", False))
    cache = KVCache(model.args, 2, step.block_size, "cpu", dtype)  # type: ignore[arg-type]
    print(f"loaded in {time.monotonic() - started:.1f} s", flush=True)
    exported = export(model, cache.k_caches + cache.v_caches, step, settings.get("attention", "torch"))
    print(f"exported in {time.monotonic() - started:.1f} s", flush=True)
    out.with_suffix(".json").write_text(json.dumps({"weights": DecodeStep(model, step.block_size).names,
                                                    "step": asdict(step)}))
    compile_package(exported, out, int(settings.get("threads", 1)))
    print(f"compiled in {time.monotonic() - started:.1f} s: {out}", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    _build(json.loads(sys.argv[1]))
