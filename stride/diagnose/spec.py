"""One side of a comparison (``--a``/``--b`` SPEC) and the error band expected of a pair.

A SPEC is ``hf`` (HuggingFace transformers, the reference) or comma-separated settings of a Stride run:
``tp=N``, ``backend=torch|sdpa|triton`` (attention and fused layers), ``dtype=float32|bfloat16|float16``,
``quantize=w4a16[-g<N>]``, ``kv=auto|fp8`` (the KV cache's dtype, as ``--kv-dtype``), ``graphs=on|off`` (decode
steps from CUDA graphs), ``device=cpu|cuda``. ``hf`` takes ``dtype`` and ``device`` too (``hf,dtype=bfloat16``).
Unset settings are float32, one rank, the device's default backend, K/V in the run dtype, no graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from stride.config import ATTENTION_BACKENDS, KV_DTYPES, quantize_group_size

DTYPE_BANDS = {"float32": 2e-6, "float16": 4e-3, "bfloat16": 1e-2}
"""Relative error (‖a − b‖ / ‖b‖ of a layer's hidden states) that rounding alone stays under at the first point,
per run dtype: float32 reorders reductions at about 1e-7 per op; bf16 keeps 8 bits of mantissa (4e-3 per
rounding). Error compounds with depth, so the band widens along the model (:func:`band_at`)."""
QUANTIZED_BAND = 0.1
"""Where one side's weights are quantised to 4 bits and the other's are not: each projection is off by the
quantisation error, about 0.1 relative."""
DEPTH_SCALE = 8
"""The band grows by its first value every this many points (four layers): rounding error adds up about linearly
with depth. Measured (docs/diagnose.md): a random Llama-3.1-8B in bf16 against transformers in bf16 grows smoothly
from 2.4e-3 (layer 0) to 5.0e-2 (layer 31's output); in float32, Triton kernels against PyTorch reach 1.05e-5."""
FP8_KV_BAND = 0.05
"""Where one side keeps K/V in 8 bits and the other does not: each cached value is off by up to 2^-4 of itself (3
mantissa bits), a few per cent of an attention output."""
FP8_KV_SHARED_BAND = 1e-2
"""Where both sides keep K/V in 8 bits: the same rounding, except where the two runs' float differences (reordered
sums, another rank split) carry a value across a rounding boundary, which moves it by up to 2^-4 of itself; rare,
and diluted over the keys an attention output reads."""
JUMP = 10.0
"""A point whose error grows this many times over the point before it, once it is past a third of the band, leaves
the smooth growth of rounding too."""


@dataclass(frozen=True)
class RunSpec:
    hf: bool = False
    tp: int = 1
    backend: str = ""
    dtype: str = "float32"
    quantize: str = ""
    kv: str = "auto"
    graphs: bool = False
    device: str = ""

    @staticmethod
    def parse(text: str) -> RunSpec:
        """``ValueError`` naming the setting for anything it does not know."""
        values: dict[str, object] = {}
        for item in (p.strip() for p in text.split(",")):
            if not item:
                continue
            if item == "hf":
                values["hf"] = True
                continue
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"{item!r}: expected hf or key=value")
            if key == "tp":
                if not value.isdigit() or int(value) < 1:
                    raise ValueError(f"tp must be a positive integer, got {value!r}")
                values["tp"] = int(value)
            elif key == "backend":
                if value not in ATTENTION_BACKENDS:
                    raise ValueError(f"backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {value!r}")
                values["backend"] = value
            elif key == "dtype":
                if value not in DTYPE_BANDS:
                    raise ValueError(f"dtype must be one of {', '.join(DTYPE_BANDS)}, got {value!r}")
                values["dtype"] = value
            elif key == "quantize":
                quantize_group_size(value)  # ValueError for a format it does not know
                values["quantize"] = "" if value == "none" else value
            elif key == "kv":
                if value not in KV_DTYPES:
                    raise ValueError(f"kv must be one of {', '.join(KV_DTYPES)}, got {value!r}")
                values["kv"] = value
            elif key == "graphs":
                if value not in ("on", "off"):
                    raise ValueError(f"graphs must be on or off, got {value!r}")
                values["graphs"] = value == "on"
            elif key == "device":
                if value not in ("cpu", "cuda"):
                    raise ValueError(f"device must be cpu or cuda, got {value!r}")
                values["device"] = value
            else:
                raise ValueError(f"unknown setting {key!r} (tp, backend, dtype, quantize, kv, graphs, device, or hf)")
        spec = RunSpec(**values)  # type: ignore[arg-type]
        if spec.hf and (spec.tp != 1 or spec.backend or spec.quantize or spec.kv != "auto" or spec.graphs):
            raise ValueError("hf takes only dtype and device")
        return spec

    def label(self) -> str:
        """The SPEC again, with the settings that differ from the defaults only."""
        default = RunSpec()
        parts = ["hf"] if self.hf else []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "hf" and value != getattr(default, f.name):
                parts.append(f"{f.name}={'on' if value is True else value}")
        return ",".join(parts) or "tp=1"


def band_at(first: float, point: int) -> float:
    """The band at the ``point``-th point (0: layer 0 after attention) of a pair whose band starts at ``first``."""
    return first * (1 + point / DEPTH_SCALE)


def band(a: RunSpec, b: RunSpec) -> float:
    """The largest relative error expected of ``a`` against ``b`` from precision alone, at the first point."""
    rel = max(DTYPE_BANDS[a.dtype], DTYPE_BANDS[b.dtype])
    if a.quantize != b.quantize:
        rel = max(rel, QUANTIZED_BAND)
    if a.kv != b.kv:
        rel = max(rel, FP8_KV_BAND)
    elif a.kv == "fp8":
        rel = max(rel, FP8_KV_SHARED_BAND)
    return rel


def near_tie(rel_band: float) -> float:
    """The reference's top-two log-prob margin under which a greedy flip is expected, not a fault."""
    return max(1e-3, 10 * rel_band)
