"""Building blocks shared by the model families: Megatron-ready linears, RMSNorm, RoPE, the gated MLP.

Every projection is built for one tensor-parallel rank and says how it splits: :class:`ColumnParallelLinear`
keeps a slice of the output features per rank (q/k/v, gate/up; no communication), :class:`RowParallelLinear` a
slice of the input features (o, down; :mod:`stride.workers.parallel` all-reduces its partial sums). Each leaf that
holds checkpoint weights is a :class:`Loadable`: ``region(shard, shape)`` names the part of a checkpoint tensor
this rank takes, which is all the loader reads from disk, and ``load_part`` stores that part. Merged projections
(qkv, gate_up) hold several checkpoint tensors side by side in one weight, which is one matmul instead of three on
the hot path.

RMSNorm, RoPE and the gated MLP have two paths: plain PyTorch (the default, and the reference) and the fused
Triton kernels of ``stride/kernels/`` (RMSNorm with the residual add in one pass, q and k rotated in place in one
launch that also writes k and v into the paged KV cache, SiLU-and-mul in one pass), which
:func:`use_fused_kernels` switches on per model when the worker runs the ``triton`` backend. Both round where
transformers rounds, so they agree to float rounding (RoPE and the cache bit for bit). On CUDA the fused calls
take their launch configs from the autotune cache (:mod:`stride.workers.kernel_configs`), or the launchers'
heuristics where it has none.

:class:`W4A16Linear` is the 4-bit variant of both linears: the loader swaps it in (before any weight is
allocated) for projections whose GGUF tensors are Q4_0/Q4_1, and it keeps them packed (``stride/kernels/w4a16.py``). Its
GEMM is a Triton kernel; under the torch backend it runs the reference instead (each call dequantises the weight to
float32), which is also what makes a 4-bit model usable on a CPU without Triton's interpreter.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from stride.workers.checkpoint import Part, Region, narrow, packed, shape_of
from stride.workers.cpu_int4 import Q8Rows, SmallStepWeight, linear_packed

if TYPE_CHECKING:  # stride.kernels import Triton; the CPU worker must not (see use_fused_kernels)
    from stride.workers.kernel_configs import KernelConfigs


def column_slices(output_sizes: Sequence[int], units: Sequence[int] | None, tp_rank: int,
                  tp_size: int) -> list[tuple[int, int]]:
    """``(first row, rows)`` this rank takes of each merged tensor. A tensor of ``unit``-row units (a head's rows)
    is split into equal shares of whole units; one with fewer units than ranks (KV heads) gives each rank one whole
    unit, rank ``r`` the one at ``r * units // tp_size``: replicated, as the planner assumes."""
    out = []
    for i, total in enumerate(output_sizes):
        unit = units[i] if units is not None else 1
        count = total // unit
        if total % unit:
            raise ValueError(f"output size {total} is not whole units of {unit}")
        if count >= tp_size:
            if count % tp_size:
                raise ValueError(f"{count} units of output {i} not divisible by tp_size {tp_size}")
            size = total // tp_size
            out.append((tp_rank * size, size))
        else:
            if tp_size % count:
                raise ValueError(f"tp_size {tp_size} is not a multiple of the {count} units of output {i}")
            out.append(((tp_rank * count // tp_size) * unit, unit))
    return out


def project(x: torch.Tensor, weight: torch.Tensor, small: SmallStepWeight | None, upcast: bool) -> torch.Tensor:
    """``x @ weight.T``: on ``small`` (a packed CPU copy) for a step it takes; else on that copy's values widened to
    float32 where the layer holds no weight of its own (a meta tensor, left by
    :func:`stride.workers.cpu_int4.drop_large_step_weights`); else in float32 with ``upcast``; else as the weight is
    (oneDNN's blocked layout on a CPU: :func:`stride.workers.cpu_int4.pack_large_steps`)."""
    if small is not None and x.dim() == 2 and x.shape[0] <= small.max_rows:
        return small(x)
    if weight.is_meta:  # not held: the packed copy takes every step (cpu_int4.drop_large_step_weights)
        assert small is not None, "a projection holds neither its weight nor a packed copy"
        return small.widened(x)
    if weight.is_mkldnn:
        return linear_packed(x, weight)
    if upcast:
        return F.linear(x.float(), weight.float()).to(x.dtype)
    return F.linear(x, weight)


class Loadable(nn.Module):
    """A module holding checkpoint weights: the region of each checkpoint tensor it takes, and where that goes."""

    def region(self, shard: int, shape: tuple[int, ...]) -> Region:
        """The part of checkpoint tensor number ``shard`` (of ``shape``, unsharded) this rank holds."""
        return None

    def load_part(self, part: Part, shard: int = 0) -> None:
        """Store the part :meth:`region` named."""
        raise NotImplementedError

    def load_full(self, full: Part, shard: int = 0) -> None:
        """Store this rank's part of an unsharded tensor already in memory."""
        self.load_part(narrow(full, self.region(shard, shape_of(full))), shard)


class ColumnParallelLinear(Loadable):
    """``y = x @ W.T`` with W's rows (output features) split across ranks.

    ``output_sizes`` lists the unsharded checkpoint tensors merged into this one (e.g. q, k, v); each is
    split across ranks on its own (:func:`column_slices`), so a rank holds its q heads, then its k heads, then its v
    heads; ``units`` gives each tensor's rows per head, so that heads stay whole.
    """

    def __init__(
        self, in_features: int, output_sizes: Sequence[int], tp_rank: int = 0, tp_size: int = 1,
        units: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.tp_rank, self.tp_size = in_features, tp_rank, tp_size
        self.slices = column_slices(output_sizes, units, tp_rank, tp_size)
        self.output_sizes = [size for _, size in self.slices]
        self.weight = nn.Parameter(torch.empty(sum(self.output_sizes), in_features), requires_grad=False)

    def region(self, shard: int, shape: tuple[int, ...]) -> Region:
        start, size = self.slices[shard]
        return (0, start, size)

    def load_part(self, part: Part, shard: int = 0) -> None:
        offset = sum(self.output_sizes[:shard])
        self.weight.data[offset : offset + self.output_sizes[shard]].copy_(part)

    int4: SmallStepWeight | None = None
    """On the CPU, the weight's 4-bit grid where it has one (:mod:`stride.workers.cpu_int4`), for small steps."""
    upcast: bool = False
    """On a CPU that emulates bf16 products, the steps ``int4`` does not take multiply in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.int4, self.upcast)


class RowParallelLinear(Loadable):
    """``y = x @ W.T`` with W's columns (input features) split across ranks; outputs are partial sums."""

    def __init__(self, in_features: int, out_features: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        if in_features % tp_size:
            raise ValueError(f"in_features {in_features} not divisible by tp_size {tp_size}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp_size), requires_grad=False)

    def region(self, shard: int, shape: tuple[int, ...]) -> Region:
        size = self.weight.shape[1]
        return (1, self.tp_rank * size, size)

    def load_part(self, part: Part, shard: int = 0) -> None:
        self.weight.data.copy_(part)

    int4: SmallStepWeight | None = None
    """As :attr:`ColumnParallelLinear.int4`."""
    upcast: bool = False
    """As :attr:`ColumnParallelLinear.upcast`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Partial sums with tp_size > 1: the tensor-parallel pass all-reduces them.
        return project(x, self.weight, self.int4, self.upcast)


class W4A16Linear(Loadable):
    """``y = x @ W.T`` with W held 4-bit packed (:class:`stride.kernels.w4a16_format.W4A16Weight`, as buffers
    ``qweight`` (ceil(N / 32), K // 8, 32), ``scales`` and ``mins`` (K // group, N)), run by the W4A16 Triton GEMM.

    Stands in for a :class:`ColumnParallelLinear` (``split="column"``: a rank keeps its columns of N, shard by
    shard, as there) or a :class:`RowParallelLinear` (``split="row"``: its slice of K, whole groups only).
    Its parts are packed ``W4A16Weight`` s (on the device), not dense tensors.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        split: str,
        scale_dtype: torch.dtype,
        group_size: int = 32,
        tp_rank: int = 0,
        tp_size: int = 1,
        slices: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        assert split in ("column", "row"), split
        self.split, self.group_size, self.tp_rank, self.tp_size = split, group_size, tp_rank, tp_size
        self.fused = True
        """The W4A16 GEMM (Triton); False: the reference, the weight dequantised per call (the torch backend)."""
        self.output_sizes = list(output_sizes)  # this rank's, as ColumnParallelLinear.output_sizes
        # (first row, rows) of each merged checkpoint tensor this rank takes (ColumnParallelLinear.slices)
        self.slices = list(slices) if slices is not None else [(tp_rank * n, n) for n in self.output_sizes]
        k, n = in_features, sum(self.output_sizes)
        if k % group_size or group_size % 8:
            raise ValueError(f"in_features {k} (this rank's) is not a whole number of {group_size}-groups")
        # NaN scales mark "not loaded" for the loader's check, as NaN weights do for the dense linears.
        tile = _kernel("w4a16_format").TILE_N
        self.register_buffer("qweight", torch.zeros(-(-n // tile), k // 8, tile, dtype=torch.int32))
        self.register_buffer("scales", torch.full((k // group_size, n), float("nan"), dtype=scale_dtype))
        self.register_buffer("mins", torch.full((k // group_size, n), float("nan"), dtype=scale_dtype))

    @classmethod
    def replacing(cls, linear: nn.Module, scale_dtype: torch.dtype, group_size: int = 32) -> W4A16Linear:
        """The 4-bit stand-in for ``linear`` (same shapes, same shards, same rank)."""
        if isinstance(linear, ColumnParallelLinear):
            return cls(linear.in_features, linear.output_sizes, "column", scale_dtype, group_size,
                       linear.tp_rank, linear.tp_size, linear.slices)
        if isinstance(linear, RowParallelLinear):
            n, k = linear.weight.shape
            return cls(k, [n], "row", scale_dtype, group_size, linear.tp_rank, linear.tp_size)
        raise TypeError(f"no W4A16 variant of {type(linear).__name__}")

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1]) * 8

    def region(self, shard: int, shape: tuple[int, ...]) -> Region:
        if self.split == "column":  # packed columns are W's rows
            start, size = self.slices[shard]
            return (0, start, size)
        k = self.in_features
        return (1, self.tp_rank * k, k)

    def load_part(self, part: Part, shard: int = 0) -> None:
        """Copy a packed part (the rows or inputs :meth:`region` named) into place."""
        w = packed(part)
        if w.group_size != self.group_size:
            raise ValueError(f"group size {w.group_size}, expected {self.group_size}")
        if self.split == "row":
            for dst, src in ((self.qweight, w.qweight), (self.scales, w.scales), (self.mins, w.mins)):
                dst.copy_(src)
            return
        w4a16 = _kernel("w4a16_format")
        offset, size = sum(self.output_sizes[:shard]), self.output_sizes[shard]
        for dst, src in ((self.scales, w.scales), (self.mins, w.mins)):
            dst[:, offset : offset + size].copy_(src)
        tile = w4a16.TILE_N
        if offset % tile == 0 and size % tile == 0:  # whole tiles (the usual case)
            self.qweight[offset // tile : (offset + size) // tile].copy_(w.qweight)
            return
        # Shards inside tiles: the words as a (K // 8, N) matrix, then tiled again.
        words = w4a16.tiles_to_words(self.qweight, sum(self.output_sizes))
        words[:, offset : offset + size].copy_(w4a16.tiles_to_words(w.qweight, size))
        self.qweight.copy_(w4a16.words_to_tiles(words))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _kernel("w4a16_format").W4A16Weight(self.qweight, self.scales, self.mins, self.group_size)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        if not self.fused:  # the reference: the weights expanded to float32 for this call, one rounding
            y = _kernel("w4a16_format").w4a16_reference(x2, weight)
            return y.view(*x.shape[:-1], y.shape[-1])
        config = _tuned(x.device).w4a16(x2.shape[0], weight.out_features, x2.shape[1], self.group_size, x.dtype)
        y = _kernel("w4a16").w4a16_matmul(x2, weight, config=config)
        # split="row" with tp_size > 1: partial sums, which the tensor-parallel pass all-reduces
        return y.view(*x.shape[:-1], y.shape[-1])


_KERNELS: dict[str, ModuleType] = {}


def _kernel(name: str) -> ModuleType:
    """``kernels.<name>``, imported on first use (only models switched to the fused path get here)."""
    if name not in _KERNELS:
        import importlib

        _KERNELS[name] = importlib.import_module(f"stride.kernels.{name}")
    return _KERNELS[name]


def _tuned(device: torch.device) -> KernelConfigs:
    """The autotuned launch configs for ``device`` (loaded once per process; none on CPU)."""
    from stride.workers.kernel_configs import for_device  # Triton-side, like _kernel

    return for_device(device)


class RMSNorm(Loadable):
    """Normalised in float32, scaled in the run dtype, exactly as transformers' Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.fused = False
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def load_part(self, part: Part, shard: int = 0) -> None:
        self.weight.data.copy_(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            config = _tuned(x.device).rmsnorm(x.shape[0], x.shape[1], x.dtype)
            return _kernel("rmsnorm").rmsnorm(x, self.weight, self.eps, config=config)[0]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = x + residual`` rounded to the run dtype; returns ``(norm(h), h)`` (one pass when fused)."""
        if self.fused:
            config = _tuned(x.device).rmsnorm(x.shape[0], x.shape[1], x.dtype)
            out, h = _kernel("rmsnorm").rmsnorm(x, self.weight, self.eps, residual, config=config)
            return out, h
        h = x + residual
        return self.forward(h), h


class _VocabRows(Loadable):
    """A (vocab, dim) matrix split by rows: rank r holds rows ``[r * rows, (r + 1) * rows)``, those past the
    vocabulary (the last rank's padding) zero."""

    weight: nn.Parameter
    tp_rank: int

    def region(self, shard: int, shape: tuple[int, ...]) -> Region:
        rows = self.weight.shape[0]
        start = min(self.tp_rank * rows, shape[0])
        return (0, start, min(rows, shape[0] - start))

    def load_part(self, part: Part, shard: int = 0) -> None:
        take = part.shape[0]
        self.weight.data[:take].copy_(part)
        self.weight.data[take:].zero_()


class Embedding(_VocabRows):
    """Token embeddings, vocabulary-parallel: rank r holds rows ``[r * rows, (r + 1) * rows)`` (``rows`` the
    vocabulary over the ranks, rounded up) and gives zeros for the other ids, so the ranks' outputs sum (the
    tensor-parallel pass's all-reduce) to the embedding."""

    def __init__(self, vocab_size: int, dim: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, tp_rank, tp_size
        rows = -(-vocab_size // tp_size)
        self.weight = nn.Parameter(torch.empty(rows, dim), requires_grad=False)

    rows: Q8Rows | None = None
    """On the CPU, the weight's Q8_0 form, which lookups read (:func:`stride.workers.cpu_int4.attach_rows`)."""

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids) if self.rows is not None else F.embedding(ids, self.weight)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(token_ids)
        local = token_ids - self.tp_rank * self.weight.shape[0]
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = self._lookup(local.masked_fill(outside, 0))
        return out.masked_fill_(outside[:, None], 0.0)


class VocabParallelHead(_VocabRows):
    """The output projection, split by vocabulary rows as :class:`Embedding` is (so a tied head shares its weight):
    each rank's logits are its slice; the tensor-parallel pass gathers them, once per pass."""

    def __init__(self, hidden_size: int, vocab_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.vocab_size, self.tp_rank = vocab_size, tp_rank
        self.weight = nn.Parameter(torch.empty(-(-vocab_size // tp_size), hidden_size), requires_grad=False)

    int8: SmallStepWeight | None = None
    """On the CPU, an int8 copy of the weight for small steps (:func:`stride.workers.cpu_int4.attach_head`), or where
    bf16 is emulated an fp16 one for every step (:func:`stride.workers.cpu_int4.attach_fp16_head`)."""
    upcast: bool = False
    """As :attr:`ColumnParallelLinear.upcast`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.int8, self.upcast)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (num_tokens, head_dim), computed in float32 then cast (as transformers does)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on (num_tokens, num_heads, head_dim) (the HF layout: halves, not interleaved)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Rope(nn.Module):
    """Rotates a layer's q and k with the step's ``cos``/``sin`` (from :func:`rope_cos_sin`, shared by every
    layer). Fused: one Triton launch rotates both in place (they are views of the qkv output, nobody else's),
    rounding exactly where :func:`apply_rope` rounds, so both paths give the same bits."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            _kernel("rope").apply_rope_cos_sin(q, k, cos, sin)
            return q, k
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Unfused path: ``x`` (num_tokens, heads, head_dim) rotated into a new tensor (q's and k's heads at once:
        the same bits as :meth:`forward` on each, elementwise)."""
        return apply_rope(x, cos, sin)

    def rotate_into_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> None:
        """Fused path only: rotate q and k in place and write the rotated k and v into the paged caches at
        ``slot_mapping``, all in one launch (the unfused path is :meth:`forward` and the backend's ``write_kv``,
        two index_puts: same bits)."""
        assert self.fused, "rotate_into_cache is the fused path"
        rope = _kernel("rope")
        rope.apply_rope_cos_sin(q, k, cos, sin, kv=rope.KVWrite(v, k_cache, v_cache, slot_mapping))


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``; gate/up merged and column-parallel, down row-parallel."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.fused = False
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2, tp_rank, tp_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp_rank, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused:
            config = _tuned(x.device).silu_mul(gate_up.shape[0], gate_up.shape[1] // 2, gate_up.dtype)
            return self.down_proj(_kernel("silu_mul").silu_mul(gate_up, config=config))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def use_fused_kernels(model: nn.Module, enabled: bool) -> None:
    """Switch every RMSNorm, RoPE, gated MLP and 4-bit projection of ``model`` to the Triton kernels (or back to
    their PyTorch references)."""
    for module in model.modules():
        if isinstance(module, RMSNorm | Rope | GatedMLP | W4A16Linear):
            module.fused = enabled
