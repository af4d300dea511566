"""Autotuned launch configurations for the worker's kernel call sites.

``scripts/tune_kernels.py`` (or ``scripts/bench_kernels.py``) fills the :class:`stride.kernels.autotune.AutotuneCache`
file on a GPU, under that GPU's name, a kernel name and a shape bucket (``stride/kernels/autotune_specs.py``). A
worker on CUDA with the triton backend reads that file once (:func:`for_device`); each fused call site then
asks :class:`KernelConfigs` for the config of its shape. The first call in a bucket reads the cache's entry,
every later one is a dict lookup. ``None`` means "no tuned config": the launcher uses its heuristic.

On CPU (Triton's interpreter) nothing is loaded: launch configs there change nothing but speed. A missing or
unreadable file, or an entry that no longer fits its config class, is logged once and treated as absent.

Imported only on the Triton path (it imports the kernels); the torch backend never gets here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stride import env
from stride.kernels import autotune as at
from stride.kernels import autotune_specs as specs
from stride.kernels.sizes import next_pow2

log = logging.getLogger(__name__)


class KernelConfigs:
    """The cached choices of one GPU, memoised per shape bucket. ``cache=None``: always ``None``."""

    def __init__(self, cache: at.AutotuneCache | None, gpu: str) -> None:
        self.cache, self.gpu = cache, gpu
        self._memo: dict[tuple[Any, ...], Any] = {}

    def decode(
        self, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
        max_context_len: int, dtype: torch.dtype,
    ) -> Any | None:
        """:class:`stride.kernels.paged_decode.DecodeConfig` for a decode-only step, or None."""
        # The bucket rounds batch and context up to powers of two; so does this key.
        key = ("decode", next_pow2(num_seqs), next_pow2(max_context_len), num_heads, num_kv_heads, head_dim,
               block_size, dtype)
        return self._config(specs.PAGED_DECODE, key, lambda: specs.DecodeShape(
            key[1], num_heads, num_kv_heads, head_dim, block_size, key[2], dtype))

    def extend(
        self, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
        max_query_len: int, max_context_len: int, dtype: torch.dtype,
    ) -> Any | None:
        """:class:`stride.kernels.paged_extend.ExtendConfig` for a step with prefill chunks, or None."""
        key = ("extend", next_pow2(num_seqs), next_pow2(max_query_len), next_pow2(max_context_len), num_heads,
               num_kv_heads, head_dim, block_size, dtype)
        return self._config(specs.PAGED_EXTEND, key, lambda: specs.ExtendShape(
            key[1], num_heads, num_kv_heads, head_dim, block_size, key[2], key[3], dtype))

    def w4a16(self, m: int, n: int, k: int, group_size: int, dtype: torch.dtype) -> Any | None:
        """:class:`stride.kernels.w4a16.W4A16Config` for an (m, k) x (k, n) product, or None."""
        key = ("w4a16", next_pow2(m), n, k, group_size, dtype)
        return self._config(specs.W4A16, key, lambda: specs.GemmShape(key[1], n, k, group_size, dtype))

    def rmsnorm(self, num_rows: int, hidden: int, dtype: torch.dtype) -> Any | None:
        """:class:`stride.kernels.rmsnorm.RMSNormConfig` for (num_rows, hidden), or None."""
        key = ("rmsnorm", next_pow2(num_rows), hidden, dtype)
        return self._config(specs.RMSNORM, key, lambda: specs.NormShape(key[1], hidden, dtype))

    def silu_mul(self, num_rows: int, intermediate: int, dtype: torch.dtype) -> Any | None:
        """:class:`stride.kernels.silu_mul.SiluMulConfig` for (num_rows, 2 * intermediate) inputs, or None."""
        key = ("silu_mul", next_pow2(num_rows), intermediate, dtype)
        return self._config(specs.SILU_MUL, key, lambda: specs.SiluShape(key[1], intermediate, dtype))

    def _config(self, spec: at.KernelSpec, key: tuple[Any, ...], shape: Callable[[], Any]) -> Any | None:
        """The memoised entry for ``key`` (a hashable stand-in for the bucket); ``shape`` builds the spec's
        shape on the first lookup only."""
        if self.cache is None:
            return None
        if key not in self._memo:
            self._memo[key] = self._lookup(spec, shape())
        return self._memo[key]

    def _lookup(self, spec: at.KernelSpec, shape: Any) -> Any | None:
        assert self.cache is not None
        bucket = spec.bucket(shape)
        try:
            return self.cache.get(spec, self.gpu, bucket)
        except (KeyError, TypeError) as exc:  # an entry written for another version of the config class
            log.warning("autotune cache %s: entry %s unusable (%s); using the heuristic",
                        self.cache.path, at.AutotuneCache.key(self.gpu, spec.name, bucket), exc)
            return None


def device_gpu_name(device: torch.device) -> str | None:
    """The name the cache is keyed by (:func:`stride.kernels.autotune.gpu_name`), or None where nothing is tuned."""
    return at.gpu_name(device) if device.type == "cuda" else None


def default_cache_path(path: str = "") -> Path:
    """``path``, else ``STRIDE_AUTOTUNE_CACHE``, else ``~/.cache/stride/autotune.json``."""
    return Path(path or env.AUTOTUNE_CACHE.get() or Path.home() / ".cache" / "stride" / "autotune.json")


def load(device: torch.device, path: Path | str | None = None) -> KernelConfigs:
    """Read the cache file (``path``, else :func:`default_cache_path`) for ``device``."""
    gpu = device_gpu_name(device)
    if gpu is None:
        return KernelConfigs(None, "")
    where = Path(path) if path else default_cache_path()
    try:
        cache = at.AutotuneCache(where)
    except (OSError, ValueError, AttributeError, TypeError) as exc:  # unreadable, not JSON, not the layout
        log.warning("autotune cache %s unreadable (%s); using the kernels' heuristic configs", where, exc)
        return KernelConfigs(None, gpu)
    mine = sum(1 for key in cache.entries if key.startswith(f"{gpu}|"))
    if mine:
        log.info("autotune cache %s: %d tuned configs for %s", where, mine, gpu)
    else:
        log.info("autotune cache %s has no configs for %s; using the kernels' heuristic configs (fill it with "
                 "scripts/tune_kernels.py)", where, gpu)
    return KernelConfigs(cache, gpu)


_LOADED: dict[torch.device, KernelConfigs] = {}


def use_file(device: torch.device, path: str = "") -> KernelConfigs:
    """Load ``device``'s configs from ``path`` (``WorkerConfig.autotune_cache``; empty: the default file) for every
    later :func:`for_device` of this process. The runner calls it as it starts."""
    configs = _LOADED[device] = load(device, path)
    return configs


def for_device(device: torch.device) -> KernelConfigs:
    """The configs of ``device``: those :func:`use_file` loaded, else the default file's, read on first use and
    kept for the process (a worker restart re-reads the file)."""
    configs = _LOADED.get(device)
    if configs is None:
        configs = _LOADED[device] = load(device)
    return configs


def forget() -> None:
    """Drop what :func:`for_device` loaded (tests; a new file is read on next use)."""
    _LOADED.clear()
