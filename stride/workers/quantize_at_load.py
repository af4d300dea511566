"""Quantise-at-load (``--quantize w4a16[-g<N>]``): which dense projections become 4-bit, and the checkpoint's
tensors with theirs quantised on the device as they are read (:func:`stride.kernels.w4a16_format.quantize`)."""

from __future__ import annotations

from typing import Any

import torch

from stride.model.args import ModelArgs
from stride.model.tensor_names import PROJECTIONS
from stride.workers.checkpoint import CheckpointTensor
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


def quantizing(tensors: list[CheckpointTensor], names: set[str], group: int, device: torch.device,
               scale_dtype: torch.dtype) -> list[CheckpointTensor]:
    """The tensors, those in ``names`` quantised on ``device`` (in float32, whatever the run dtype) as each part is
    read: a rank quantises only its part, which gives the same codes as quantising the whole and slicing it, as
    groups run along the inputs and a row-parallel part is whole groups."""
    from stride.kernels.w4a16_format import quantize

    def quantized(part: Any) -> Any:
        if not isinstance(part, torch.Tensor):
            raise TypeError("expected a dense tensor to quantise")
        return quantize(part.to(device), group, scale_dtype)

    return [t.map(quantized) if t.name in names else t for t in tensors]
