"""Quantise-at-load (``--quantize w4a16[-g<N>]``): which dense projections become 4-bit, and the tensor stream with
theirs quantised on the device as they arrive (:func:`kernels.w4a16_format.quantize`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from stride.model.args import ModelArgs
from stride.model.tensor_names import PROJECTIONS
from stride.workers.models import Transformer


def quantizable(model: Transformer, args: ModelArgs) -> dict[str, list[str]]:
    """Our dense projections (module path) → the HF tensor names merged in each, for :func:`quantize`. Models without
    a module (Mixtral's MLP is its experts, which stay dense) have no entry for it."""
    out: dict[str, list[str]] = {}
    for layer in range(args.num_layers):
        for module, merged in PROJECTIONS.items():
            path = f"layers.{layer}.{module}"
            try:
                model.get_submodule(path)
            except AttributeError:
                continue
            out[path] = [f"model.layers.{layer}.{t.hf}.weight" for t in merged]
    return out


def quantizing(
    tensors: Iterator[tuple[str, Any]], names: set[str], group: int, device: torch.device, scale_dtype: torch.dtype
) -> Iterator[tuple[str, Any]]:
    """The stream with the tensors in ``names`` quantised on ``device`` (in float32, whatever the run dtype)."""
    from kernels.w4a16_format import quantize

    for name, tensor in tensors:
        if name in names:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name}: expected a dense tensor to quantise")
            yield name, quantize(tensor.to(device), group, scale_dtype)
        else:
            yield name, tensor
