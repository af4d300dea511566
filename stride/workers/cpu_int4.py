"""The CPU's bf16 projections: small steps on packed low-bit copies; larger ones on the bf16 weights in oneDNN's
blocked layout where the CPU multiplies bf16 natively, in float32 where it emulates bf16.

A projection whose bf16 weight lies on a 4-bit grid (every group of 32 inputs ``scale * q + min``, q in 0..15: what a
GGUF Q4_1 tensor dequantises to) also keeps that grid packed for torch's CPU int4 kernel
(``_weight_int4pack_mm_for_cpu``, bf16 activations), and the output projection an int8 copy (:func:`attach_head`,
only where the head is not held in oneDNN's layout, below); steps of at most ``max_rows`` rows run on those. The
grid is recovered, not made: a weight off it (a 16-bit checkpoint, Q4_0 whose groups need not span 0..15) is left
alone, so the answers stay those of the weights as loaded.

How many rows take the packed copies depends on what the bf16 weights cost instead (perf-log, SmolLM2-135M's
projections, two threads):
- A CPU with AMX: :data:`MAX_ROWS` (4). The kernel reads a quarter of the bytes and takes 0.35-0.42x the time of
  bf16 ``F.linear`` at one row, 0.55-0.75x at 4; from ~8 rows on oneDNN's bf16 products on the AMX tiles (the weight
  in its layout, below) are faster, at 16 rows 0.6x the kernel's time.
- A CPU with AVX-512 BF16 but no AMX: :data:`NO_AMX_MAX_ROWS` (16). There oneDNN's bf16 products took 1.2x the
  kernel's time at 16 rows and 1.5x at 8 (the default model's projections streamed from memory, an Intel Xeon held
  below AMX), and the worker's compiled step with the grids took 0.58x the time at 8 rows, 0.83x at 16 (perf-log).
- A CPU without (AVX2 only, as most laptops): :data:`EMULATED_MAX_ROWS` (64). There bf16 ``F.linear`` is emulated,
  2.5x float32's time at 8 rows and 7.5x at 256, so the steps the packed copies do not take multiply in float32
  (:func:`upcast_large_steps`). Widening the default model's weights to float32 costs ~93 ms a step, so the int4
  kernel takes every step up to 64 rows: the model's step at 32 rows 139 ms that way, against 205 widened and 141
  with float32 weights; at 64 rows 269-290 against float32's 244. A projection with a grid multiplies its larger
  steps on the grid too, unpacked to float32 per step, and keeps no bf16 weight (:func:`drop_large_step_weights`).
The packed copies add about a quarter of the bf16 weights' memory where the bf16 weights stay (native bf16).

The steps the grids do not take (past the row limit above, prefill chunks among them) multiply in bf16. torch's
``F.linear`` hands oneDNN the weight as it is stored, row-major, and oneDNN reorders it into its own blocked layout on
every call: at 16 rows that reorder costs about as much as the product. With native bf16 the projections whose plain
weight nothing else reads hold it in that layout instead, laid out once at load (:func:`pack_large_steps`): the same
products to the bit, the default model's 120 projections at 16 rows 0.47-0.67x the time on a Zen 4 (8 rows
0.44-0.70x, 256 rows 0.84-0.95x; perf-log), in the same bytes.
"""

from __future__ import annotations

import functools
import logging
from typing import TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from stride import env

log = logging.getLogger(__name__)

GROUP = 32
"""Inputs per scale and minimum (GGUF's Q4 block)."""
MAX_ROWS = 4
"""Largest step (rows of the activation) that takes the packed copies on a CPU with AMX."""
NO_AMX_MAX_ROWS = 16
"""The same on a CPU with native bf16 products but no AMX (AVX-512 BF16 alone)."""
EMULATED_MAX_ROWS = 64
"""The same on a CPU that emulates bf16 products (:func:`upcast_large_steps`)."""
MAX_GRID_ERROR = 0.1
"""Largest distance, in grid steps, of a weight from its group's 4-bit grid for the grid to count as the weight's
own (bf16 rounding of a Q4_1 weight puts it within ~0.04 of a step; a weight off any 4-bit grid is up to 0.5)."""


def max_small_rows(native_bf16: bool, cpuinfo: str = "/proc/cpuinfo") -> int:
    """The largest step the packed copies take on this CPU: ``STRIDE_CPU_INT4_ROWS`` where set, else
    :data:`MAX_ROWS` with AMX, :data:`NO_AMX_MAX_ROWS` with native bf16 alone, :data:`EMULATED_MAX_ROWS` without."""
    if env.CPU_INT4_ROWS.get().strip():
        rows = env.CPU_INT4_ROWS.get_int()
        if rows < 1:
            raise ValueError(f"{env.CPU_INT4_ROWS.name}={rows}: must be at least 1")
        return rows
    if not native_bf16:
        return EMULATED_MAX_ROWS
    return MAX_ROWS if "amx_bf16" in cpu_flags(cpuinfo) else NO_AMX_MAX_ROWS


def available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


class SmallStepWeight:
    """A packed copy of a projection's weight that steps of at most ``max_rows`` rows run on; called as
    ``F.linear(x, W)`` for 2-D bf16 ``x``."""

    max_rows: int = MAX_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, W)`` for a step of any size, multiplied in float32 on the copy's own values: for a layer
        that holds no other weight (:func:`drop_large_step_weights`)."""
        raise NotImplementedError


class Int4Weight(SmallStepWeight):
    """A (N, K) weight's 4-bit grid, packed for the CPU kernel."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, max_rows: int = MAX_ROWS) -> None:
        self.packed = packed
        self.scales_zeros = scales_zeros
        self.max_rows = max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() @ self.unpacked_t()).to(x.dtype)

    def unpacked_t(self) -> torch.Tensor:
        """The (K, N) float32 transpose of the weight the kernel multiplies by, ``(q - 8) * scale + zero`` in each
        group, unpacked from the packed bytes as this CPU's torch lays them out (:func:`int4_block`, which must
        not be None)."""
        block = int4_block()
        assert block is not None, "this torch packs the 4-bit grid in a layout not known here"
        n, k = self.packed.shape[0], self.packed.shape[1] * 2
        p = self.packed.view(n // block, k, block // 2)
        q = torch.cat([p & 15, p >> 4], -1).transpose(0, 1).reshape(k // GROUP, GROUP, n)
        scales, zeros = self.scales_zeros.float().unbind(-1)  # (K / GROUP, N) each
        return torch.addcmul((zeros - 8 * scales).unsqueeze(1), q, scales.unsqueeze(1)).view(k, n)

    def agrees(self, weight: torch.Tensor) -> bool:
        """Whether :meth:`unpacked_t` gives ``weight`` (N, K) to within half a grid step in every group (plus bf16's
        rounding): what a misread layout could not do."""
        n, k = weight.shape
        block = int4_block()
        if block is None or n % block or (n, k) != (self.packed.shape[0], self.packed.shape[1] * 2):
            return False
        wt = weight.float().t()
        diff = (self.unpacked_t() - wt).abs().view(k // GROUP, GROUP, n)
        tol = 0.5 * self.scales_zeros[..., 0].float().unsqueeze(1) + wt.abs().view_as(diff) * 2**-8
        return bool((diff <= tol).all())

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


@functools.cache
def int4_block() -> int | None:
    """How torch's CPU int4 packing (``_convert_weight_to_int4pack_for_cpu``) lays out a (N, K) grid on this CPU:
    the packed (N, K / 2) bytes read as (N / B, K, B / 2), each byte holding row ``n0 + i``'s value in its low
    nibble and row ``n0 + B / 2 + i``'s in its high one. Returns B, found by packing a known matrix (torch 2.13: 64
    with AVX-512, 32 held to AVX2), or None where no such B explains the bytes."""
    if not available():
        return None
    n, k = 256, 64
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    if packed.shape != (n, k // 2) or packed.dtype != torch.uint8:
        return None
    for block in (16, 32, 64, 128):
        got = packed.view(n // block, k, block // 2).to(torch.int32)
        want = q.view(n // block, block, k).transpose(1, 2)
        if torch.equal(got & 15, want[..., : block // 2]) and torch.equal(got >> 4, want[..., block // 2 :]):
            return block
    return None


def int4_grid(weight: torch.Tensor, max_rows: int = MAX_ROWS) -> Int4Weight | None:
    """``weight``'s 4-bit grid per group of :data:`GROUP` inputs, or None where it has none (or K is not whole
    groups). Per group: minimum ``lo``, step ``d = (max - lo) / 15``; the kernel's form is ``(q - 8) * d + zero``
    with ``zero = lo + 8 d``."""
    n, k = weight.shape
    if k % GROUP or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    w = weight.float().reshape(n, k // GROUP, GROUP)
    lo = w.amin(-1, keepdim=True)
    d = (w.amax(-1, keepdim=True) - lo) / 15
    step = torch.where(d > 0, d, torch.ones_like(d))
    q = ((w - lo) / step).round().clamp(0, 15)
    if float(((q * d + lo - w).abs() / step).amax()) > MAX_GRID_ERROR:
        return None
    packed = torch._convert_weight_to_int4pack_for_cpu(q.reshape(n, k).to(torch.int32), 1)
    scales = d.reshape(n, k // GROUP).t()
    zeros = (lo + 8 * d).reshape(n, k // GROUP).t()
    return Int4Weight(packed, torch.stack([scales, zeros], -1).to(torch.bfloat16).contiguous(), max_rows)


def attach(model: nn.Module, max_rows: int = MAX_ROWS) -> tuple[int, int]:
    """Give every dense projection of ``model`` whose weight has a 4-bit grid its packed copy (the layer then runs
    steps of up to ``max_rows`` rows on it). Returns (projections given one, bytes they hold)."""
    if not available():
        return 0, 0
    count = nbytes = 0
    for module in model.modules():
        # The dense projections (ColumnParallelLinear, RowParallelLinear) declare an ``int4`` slot; the layers
        # import this module, so it names them by that.
        weight = getattr(module, "weight", None)
        if "int4" in vars(type(module)) and isinstance(weight, torch.Tensor):
            grid = int4_grid(weight.data, max_rows)
            if grid is not None:
                setattr(module, "int4", grid)  # noqa: B010 (nn.Module's typing hides the slot)
                count += 1
                nbytes += grid.nbytes
    if count:
        trim_heap()
    return count, nbytes


class Int8Rows(SmallStepWeight):
    """A (N, K) weight as int8 with one scale per output row, for torch's CPU int8 kernel (``_weight_int8pack_mm``,
    bf16 activations)."""

    def __init__(self, weight: torch.Tensor, max_rows: int = MAX_ROWS) -> None:
        self.max_rows = max_rows
        w = weight.float()
        scales = w.abs().amax(1).clamp_min(1e-12) / 127
        self.q = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.scales = scales.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.q, self.scales)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes


FP16_MAX = 65504.0
"""The largest finite fp16 value: a weight past it has no fp16 copy."""


class Fp16Rows(SmallStepWeight):
    """A (N, K) bf16 weight as fp16 in fbgemm's packed layout, multiplied in float32 (fbgemm's fp16 GEMM widens the
    weights in registers), for a CPU that emulates bf16 products. Every bf16 value in fp16's normal range is an fp16
    value (fp16's 10 mantissa bits hold bf16's 7), so up to :data:`FP16_MAX` this is the weight itself, not a
    requantisation as :class:`Int8Rows` is; below 2^-14 (fp16's subnormals) a value keeps its bits down to 2^-24.
    Packed in chunks of rows, so that loading widens at most ``chunk`` rows to float32 at a time."""

    def __init__(self, weight: torch.Tensor, max_rows: int, chunk: int = 8192) -> None:
        self.max_rows = max_rows
        self.rows = weight.shape[0]
        self.cols = weight.shape[1]
        self.parts = [torch.ops.quantized.linear_prepack_fp16(weight[lo : lo + chunk].float(), None)
                      for lo in range(0, self.rows, chunk)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        outs = [torch.ops.quantized.linear_dynamic_fp16(x32, part) for part in self.parts]
        return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return 2 * self.rows * self.cols  # the packed matrices are opaque to torch; fbgemm holds them as fp16


@functools.cache
def fp16_rows_available() -> bool:
    """Whether this torch runs fbgemm's fp16 GEMM here and gives ``F.linear``'s answer on a small case (tried once)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        w = torch.linspace(-2, 2, 96 * 64).reshape(96, 64).bfloat16()
        x = torch.linspace(-1, 1, 3 * 64).reshape(3, 64)
        got = torch.ops.quantized.linear_dynamic_fp16(x, torch.ops.quantized.linear_prepack_fp16(w.float(), None))
        return bool(torch.allclose(got, F.linear(x, w.float()), rtol=1e-5, atol=1e-5))
    except (RuntimeError, AttributeError):
        return False


def attach_fp16_head(model: nn.Module) -> int:
    """On a CPU that emulates bf16 products: give the output projection (``lm_head``) its weight in fp16 for every
    step (:class:`Fp16Rows`); returns the bytes it holds (0: none given). On the AVX2 Zen 3 machine, two threads,
    the default model's head (49,152 x 576) took 2.7 / 4.0 / 11.2 / 33.8 ms at 1 / 4 / 16 / 64 rows against the int8
    copy's 3.8 / 6.0 / 23.8 / 86.0 (perf-log, twenty-fourth session)."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if head is None or not _cpu_bf16_matrix(weight) or not fp16_rows_available():
        return 0
    low, high = torch.aminmax(weight.data)  # no full-size copy at load, as abs() would make
    if max(-float(low), float(high)) > FP16_MAX:
        return 0
    rows = Fp16Rows(weight.data, max_rows=1 << 30)
    setattr(head, "int8", rows)  # noqa: B010 (nn.Module's typing hides the slot; the small-step copy, whatever kind)
    trim_heap()
    return rows.nbytes


def attach_head(model: nn.Module, max_rows: int = MAX_ROWS) -> int:
    """Give the output projection (``lm_head``) an int8 copy of its bf16 weight for steps of up to ``max_rows``
    rows; returns the bytes it holds (0: none given).

    Unlike the grids this *is* a requantisation: a GGUF's Q8_0 head has a scale per 32 inputs, the kernel one per row,
    so a weight moves by up to half a step of its row's scale (row max / 254). Worth it: the default model's head is
    its largest matrix (49,152 x 576, 57 MB in bf16), and on this CPU a one-row product over it takes 0.9 ms in int8
    against 4.5 in bf16 (two threads). The logit error it adds is measured against transformers in the perf-log. Where
the head is held in oneDNN's layout instead (:func:`pack_large_steps`) it is not made: there bf16 took 2.0-2.6 ms a
row against int8's 2.7 on the Zen 4 machine, exactly."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if head is None or not _cpu_bf16_matrix(weight) or not hasattr(torch, "_weight_int8pack_mm"):
        return 0
    rows = Int8Rows(weight.data, max_rows)
    setattr(head, "int8", rows)  # noqa: B010 (nn.Module's typing hides the slot)
    trim_heap()
    return rows.nbytes


class Q8Rows:
    """A (V, K) embedding's rows as a GGUF Q8_0 tensor holds them: int8 values and an fp16 scale per 32 inputs;
    a lookup gives the bf16 rows exactly (each value ``q * d`` is exact in float32, then rounded as the loader
    rounded it). A quarter of a bf16 copy's bytes less, and it lets the tied output projection hold the bf16 weight
    in oneDNN's layout (:func:`pack_large_steps`) without a second bf16 copy for the lookups."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        self.q = q
        self.scales = scales

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[0]
        q = self.q.index_select(0, ids).view(n, -1, GROUP).float()
        return (q * self.scales.index_select(0, ids).float()[:, :, None]).view(n, -1).to(torch.bfloat16)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes


def q8_rows(weight: torch.Tensor, chunk: int = 4096) -> Q8Rows | None:
    """``weight``'s Q8_0 form, recovered from its bf16 values (what a GGUF Q8_0 tensor dequantises to), or None
    where some group of :data:`GROUP` inputs has none. Per group the scale is an fp16 value ``d`` near the largest
    magnitude over 127, the values ``round(w / d)``; a scale counts only if every value it gives rounds back to the
    weight's bf16 value exactly (checked, not assumed), trying the fp16 neighbours of the nearest one."""
    n, k = weight.shape
    if k % GROUP or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    q_out = torch.empty(n, k, dtype=torch.int8)
    d_out = torch.empty(n, k // GROUP, dtype=torch.float16)
    for lo in range(0, n, chunk):
        w = weight[lo : lo + chunk].float().view(-1, k // GROUP, GROUP)
        nearest = (w.abs().amax(-1) / 127).to(torch.float16)
        found = torch.zeros(nearest.shape, dtype=torch.bool)
        for step in (0, 1, -1, 2, -2, 3, -3, 4, -4, 5, -5, 6, -6, 7, -7, 8, -8):
            d = (nearest.view(torch.int16) + step).view(torch.float16) if step else nearest
            df = d.float()[..., None]
            q = torch.where(df > 0, w / torch.where(df > 0, df, 1.0), 0.0).round().clamp(-127, 127)
            ok = ((q * df).to(torch.bfloat16).float() == w).all(-1) & (d >= 0) & ~found
            q_out[lo : lo + chunk].view(-1, k // GROUP, GROUP)[ok] = q[ok].to(torch.int8)
            d_out[lo : lo + chunk][ok] = d[ok]
            found |= ok
            if bool(found.all()):
                break
        if not bool(found.all()):
            return None
    return Q8Rows(q_out, d_out)


def upcast_large_steps(model: nn.Module) -> int:
    """On a CPU that emulates bf16 products: every bf16 dense projection and the output projection multiply in
    float32 the steps their packed copy does not take (``upcast``). A projection with a 4-bit grid keeps its weight
    bf16 and widens it per such step (only steps of more than :data:`EMULATED_MAX_ROWS` rows pay that); one without
    (a 16-bit checkpoint's, or with ``STRIDE_CPU_INT4=0``) would pay it every step, so its weight becomes float32 once,
    as the float32 run dtype held it. Call after :func:`attach` and :func:`attach_head`. Returns how many."""
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if "upcast" in vars(type(module)) and isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16:
            setattr(module, "upcast", True)  # noqa: B010 (nn.Module's typing hides the slot)
            if "int4" in vars(type(module)) and getattr(module, "int4") is None:  # noqa: B009 (typing hides the slot); the head may be tied: not it
                weight.data = weight.data.float()
            count += 1
    return count


def _not_held(weight: torch.Tensor) -> nn.Parameter:
    """A meta tensor of ``weight``'s shape and dtype, standing for a weight the module no longer holds (which
    :func:`stride.workers.models.layers.project` reads as "not held")."""
    return nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False)


def drop_large_step_weights(model: nn.Module) -> tuple[int, int]:
    """On a CPU that emulates bf16 products: each projection with a 4-bit grid takes its large steps on the grid too,
    unpacked to float32 per step (:meth:`Int4Weight.widened`), and gives up its bf16 weight (a meta tensor of its
    shape stays, which :func:`stride.workers.models.layers.project` reads as "not held"). The bf16 weight was read
    only there, widened per step the same way; without it the default model's worker holds 212 MB less. The large
    steps' weights become the grid's values (its scale and zero rounded to bf16, as the small steps' kernel uses
    them) in place of the GGUF's values rounded to bf16: both within a fraction of a grid step of the checkpoint's.
    A projection keeps its weight where the packing's layout is not known (:func:`int4_block`) or its unpacked grid
    does not give the weight back (:meth:`Int4Weight.agrees`). Call after :func:`upcast_large_steps`. Returns
    (weights dropped, bytes they held)."""
    if int4_block() is None:
        return 0, 0
    count = nbytes = 0
    for module in model.modules():
        grid, weight = vars(module).get("int4"), getattr(module, "weight", None)
        if not isinstance(grid, Int4Weight) or not _cpu_bf16_matrix(weight) or not grid.agrees(weight):
            continue
        module.weight = _not_held(weight)
        count += 1
        nbytes += weight.numel() * weight.element_size()
    if count:
        trim_heap()
    return count, nbytes


def prepare(model: nn.Module, int4: bool, int8_head: bool, native_bf16: bool, embedding_rows: bool = False) -> int:
    """A bf16 model's small-step copies as the CPU worker holds them (:func:`attach` with ``int4``,
    :func:`attach_head` with ``int8_head``; :func:`upcast_large_steps` without ``native_bf16``; the embedding's
    :class:`Q8Rows` with ``embedding_rows``, which :func:`pack_large_steps` then relies on). Where bf16 is emulated
    and the head holds its fp16 copy, a weight it shares with the embedding goes once the embedding reads its Q8Rows
    (:func:`drop_tied_weight`: the default model's 57 MB, for 28 MB of rows). Returns the rows of the largest step
    they take (0: none attached)."""
    if embedding_rows and _tied(model):  # only a tied head needs the embedding off its bf16 weight
        attach_rows(model)
    max_rows = max_small_rows(native_bf16)
    small_step_rows = 0
    if int4:
        count, nbytes = attach(model, max_rows)
        if count:
            small_step_rows = max_rows
            log.info("%d projections also hold their 4-bit grid (%.0f MB) for steps of up to %d rows", count,
                     nbytes / 1e6, max_rows)
    fp16_head = False
    if int8_head and not native_bf16 and (nbytes := attach_fp16_head(model)):
        small_step_rows = max_rows
        fp16_head = True
        log.info("the output projection also holds an fp16 copy (%.0f MB, fbgemm's layout) for every step",
                 nbytes / 1e6)
    elif int8_head and not (embedding_rows and head_packs(model)):  # a head packed later needs no int8 copy
        nbytes = attach_head(model, max_rows)
        if nbytes:
            small_step_rows = max_rows
            log.info("the output projection also holds an int8 copy (%.0f MB) for steps of up to %d rows",
                     nbytes / 1e6, max_rows)
    if not native_bf16:
        count = upcast_large_steps(model)
        log.info("this CPU emulates bf16 products: %d projections multiply in float32 the steps their packed copies "
                 "do not take", count)
        dropped, nbytes = drop_large_step_weights(model)
        if dropped:
            log.info("%d projections take those steps on their 4-bit grids unpacked, holding no bf16 weight (%.0f MB "
                     "less)", dropped, nbytes / 1e6)
    if fp16_head and _tied(model) and (rows := attach_rows(model)):
        nbytes = drop_tied_weight(model)
        log.info("the token embedding reads its Q8_0 rows (%.0f MB) and the output projection its fp16 copy: the tied "
                 "bf16 weight goes (%.0f MB less)", rows / 1e6, nbytes / 1e6)
    return small_step_rows


def drop_tied_weight(model: nn.Module) -> int:
    """Replace the weight the output projection and the token embedding share with a meta tensor of its shape, where
    neither reads it: the embedding's lookups read its :class:`Q8Rows`, the head's every step its fp16 copy
    (:class:`Fp16Rows`). Returns the bytes given up."""
    head, embedding = getattr(model, "lm_head"), getattr(model, "embed_tokens")  # noqa: B009 (typing: modules)
    w = head.weight
    assert vars(embedding).get("rows") is not None and isinstance(head.int8, Fp16Rows), "the weight is still read"
    head.weight = embedding.weight = _not_held(w)
    trim_heap()
    return w.numel() * w.element_size()


PACK_ROWS = 16
"""The step, in rows, oneDNN lays a packed weight out for (any step runs on it; 16 is what 16 clients decode)."""


@functools.cache
def packing_available() -> bool:
    """Whether this torch and CPU run :func:`linear_packed`, giving ``F.linear``'s answer (tried once, small)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    try:
        return bool(torch.equal(linear_packed(x, packed_bf16(w)), torch.nn.functional.linear(x, w)))
    except RuntimeError:  # oneDNN has no bf16 product for this CPU
        return False


def packed_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A (N, K) bf16 weight in oneDNN's blocked layout (an ``mkldnn`` tensor: its values cannot be read back
    as a strided tensor's), for :func:`linear_packed`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)


def linear_packed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, W)`` for bf16 ``x`` and ``weight`` from :func:`packed_bf16`: oneDNN's product without the
    per-call reorder of W, bit for bit the same as ``F.linear`` on the plain weight."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def attach_rows(model: nn.Module) -> int:
    """Give the token embedding its :class:`Q8Rows` where its bf16 weight has that form (the default model's Q8_0
    ``token_embd``); returns the bytes they hold (0: none)."""
    embedding = getattr(model, "embed_tokens", None)
    weight = getattr(embedding, "weight", None)
    if embedding is None or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return 0
    rows = q8_rows(weight.data)
    if rows is None:
        return 0
    setattr(embedding, "rows", rows)  # noqa: B010 (nn.Module's typing hides the slot)
    return rows.nbytes


def _cpu_bf16_matrix(weight: object) -> TypeGuard[torch.Tensor]:
    """Whether ``weight`` is a plain (not yet packed) 2-D bf16 tensor on the CPU: what the copies here are made of."""
    return (isinstance(weight, torch.Tensor) and not weight.is_mkldnn and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and weight.dim() == 2)


def _tied(model: nn.Module) -> bool:
    """Whether ``model``'s output projection shares the token embedding's weight."""
    head, embedding = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    weight = getattr(head, "weight", None)
    return weight is not None and getattr(embedding, "weight", None) is weight


def head_packs(model: nn.Module) -> bool:
    """Whether :func:`pack_large_steps` holds ``model``'s output projection in oneDNN's layout: a bf16 head on the
    CPU, untied, or tied to an embedding that reads its :class:`Q8Rows`."""
    if not _cpu_bf16_matrix(getattr(getattr(model, "lm_head", None), "weight", None)):
        return False
    return not _tied(model) or vars(model.embed_tokens).get("rows") is not None


def pack_large_steps(model: nn.Module, compiled: bool) -> tuple[int, int]:
    """Hold each bf16 dense projection's weight in oneDNN's blocked layout (:func:`packed_bf16`) in place of the
    plain one, where nothing reads the plain one: with a compiled decode step (``compiled``) only the projections
    with a 4-bit grid (the compiled step takes their small steps on the grid and never reads their weight), without
    one every projection. The output projection too (the compiled step ends before it), in place of its int8 copy
    (the same speed at 1-4 rows here, and exact); where it is tied to the embedding only once the embedding reads
    its :class:`Q8Rows` (:func:`attach_rows`), whose weight then goes (a meta tensor of its shape). Call after
    :func:`prepare`, on a CPU with native bf16. Returns (weights packed, bytes they hold)."""
    if not packing_available():
        return 0, 0
    count = nbytes = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if "int4" not in vars(type(module)) or not _cpu_bf16_matrix(weight):
            continue
        if compiled and getattr(module, "int4") is None:  # noqa: B009 (typing hides the slot)
            continue
        module.weight = nn.Parameter(packed_bf16(weight.data), requires_grad=False)
        count += 1
        nbytes += weight.numel() * weight.element_size()
    head = getattr(model, "lm_head", None)
    if head is not None and head_packs(model):
        tied, w = _tied(model), head.weight.data
        head.weight = nn.Parameter(packed_bf16(w), requires_grad=False)
        setattr(head, "int8", None)  # noqa: B010 (nn.Module's typing hides the slot)
        if tied:  # lookups read the embedding's rows
            embedding: nn.Module = getattr(model, "embed_tokens")  # noqa: B009 (typing: a module, not a tensor)
            embedding.weight = _not_held(w)
        count += 1
        nbytes += w.numel() * w.element_size()
    if count:
        trim_heap()
        log.info("%d projections hold their bf16 weights in oneDNN's layout (%.0f MB)", count, nbytes / 1e6)
    return count, nbytes


_ABOVE_AVX2 = ("avx512", "amx", "avx_vnni")
"""Prefixes of the /proc/cpuinfo flags an AVX2-only CPU (a Zen 3, most laptops before 2022) does not have."""


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """This CPU's feature flags as x86 Linux lists them (empty elsewhere: no way to tell here), less those that torch
    or oneDNN was told not to use, so that the worker takes the paths of such a CPU: with ``ATEN_CPU_CAPABILITY=avx2``
    every AVX-512, AMX and AVX-VNNI flag is dropped, with ``default`` AVX2 and FMA too; with ``ONEDNN_MAX_CPU_ISA``
    below AMX (``AVX512_CORE_BF16``) the AMX flags, below AVX-512 (``AVX2``) those of ``avx2`` too
    (``scripts/bench_peer.py --isa`` sets both variables)."""
    try:
        with open(cpuinfo) as f:
            flags = set(f.read().split())
    except OSError:
        return set()
    capability = env.ATEN_CPU_CAPABILITY.get().strip().lower()
    isa = env.ONEDNN_MAX_CPU_ISA.get().strip().upper()
    if capability in ("avx2", "default") or (isa and not isa.startswith(("AVX512", "AVX10", "ALL", "DEFAULT"))):
        flags = {f for f in flags if not f.startswith(_ABOVE_AVX2)}
    elif isa.startswith(("AVX512", "AVX10")) and "AMX" not in isa:
        flags = {f for f in flags if not f.startswith("amx")}
    if capability == "default":
        flags -= {"avx2", "fma"}
    return flags


def bound_product_cache() -> None:
    """Bound how many built bf16 products oneDNN and ideep keep (``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` and
    ``LRU_CACHE_CAPACITY``, :mod:`stride.env`: 16 each), unless the environment sets them. Each keeps a product per
    shape, its row count included, the last 1,024 by default; a prefill of a new length is a new shape for every
    projection shape and the head, ~1 MB each at prefill sizes, so a worker serving prompts of many lengths kept
    growing (the default model's by ~3 MB a length on an Intel Xeon with AMX, to GBs; perf-log). A decode step at
    one batch size needs five (four projection shapes and the head): 16 keep the current size's across a mixed step
    (whose row count is new every time, kept or not); a size that comes back after others is built again, ~0.5 ms a
    product. Only bf16 products are kept (torch sends float32 ones to MKL). Call before the process's first product:
    both read it once."""
    env.ONEDNN_PRIMITIVE_CACHE_CAPACITY.set_default(env.ONEDNN_PRIMITIVE_CACHE_CAPACITY.default)
    env.LRU_CACHE_CAPACITY.set_default(env.LRU_CACHE_CAPACITY.default)


def trim_heap() -> None:
    """Give freed heap back to the system (``malloc_trim``). glibc keeps it otherwise: after packing, the served
    worker held ~170 MB more than the grids' own 66 MB; and since glibc raises its mmap threshold as large blocks are
    freed, a prefill step's activations end up in the heap and stay resident after it (the worker calls this after
    each large CPU step: ``stride.workers.process.TRIM_AFTER_TOKENS``)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
