"""Planted faults for the diagnose tests: each a ``prepare(model, rank, layer)`` step that breaks exactly one layer
of a loaded model the way a real bug would. Top-level functions, so that ranks started by
``torch.multiprocessing.spawn`` can take them (with :func:`functools.partial` for the layer)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from stride.diagnose.runs import wrap_forward
from stride.model.files import is_gguf
from stride.workers.models.layers import rope_cos_sin


def _tensor(model_path: str, name: str) -> Any:
    from stride.workers.hf_checkpoint import safetensors_tensors

    assert not is_gguf(model_path), "the faults read HF checkpoints"
    return next(t for t in safetensors_tensors(Path(model_path)) if t.name == name)


def swapped_attention_output_shards(model_path: str, model: Any, rank: int, layer: int) -> None:
    """Layer ``layer``'s attention output projection holds the next rank's slice of its inputs, not its own: the
    shards in the wrong order."""
    o_proj = model.layers[layer].self_attn.o_proj
    size = o_proj.weight.shape[1]
    other = (rank + 1) % o_proj.tp_size
    part = _tensor(model_path, f"model.layers.{layer}.self_attn.o_proj.weight").read((1, other * size, size))
    o_proj.load_part(part.to(o_proj.weight.dtype))


def rope_with_wrong_base(model: Any, rank: int, layer: int) -> None:
    """Layer ``layer`` rotates q and k with four times the RoPE base (the other layers keep the right one)."""
    inv_freq = replace(model.args, rope_theta=model.args.rope_theta * 4).inv_freq()

    def forward(original: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: Any) -> torch.Tensor:
        cos, sin = rope_cos_sin(inv_freq.to(x.device), ctx.meta.positions, x.dtype)
        return original(x, cos, sin, ctx)

    wrap_forward(model.layers[layer].self_attn, forward)


def kv_written_one_slot_off(model: Any, rank: int, layer: int) -> None:
    """Layer ``layer`` writes each token's K and V one cache slot past its own (and reads the right slots)."""
    def forward(original: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: Any) -> torch.Tensor:
        meta = replace(ctx.meta, slot_mapping=ctx.meta.slot_mapping + 1)
        return original(x, cos, sin, replace(ctx, meta=meta))

    wrap_forward(model.layers[layer].self_attn, forward)


def dropped_w4a16_scale(model: Any, rank: int, layer: int) -> None:
    """Layer ``layer``'s 4-bit q/k/v projection lost the scales of its first group of inputs (zero: the group's
    weights collapse to their minimum)."""
    qkv = model.layers[layer].self_attn.qkv_proj
    assert hasattr(qkv, "scales"), "the projection is not 4-bit"
    qkv.scales[0].zero_()
