"""One tensor of a checkpoint on disk, read by region: the unit the loader streams, so that a tensor-parallel rank
reads only its slice of each weight and no process ever holds the whole model.

A :data:`Region` is ``(dim, start, length)`` of the tensor as the checkpoint's dense (out, in) matrix (or vector),
or ``None`` for all of it. Each loadable module says which region it needs (``region(shard, shape)``); the
checkpoint formats (:mod:`stride.workers.hf_checkpoint`, :mod:`stride.workers.gguf_checkpoint`) read just that
from their memory-mapped files, dense or as packed 4-bit blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from stride.kernels.w4a16_format import W4A16Weight

Region = tuple[int, int, int] | None
"""``(dim, start, length)`` of a checkpoint tensor, or ``None``: the whole tensor."""

Part = Any
"""What a region reads as: a dense ``torch.Tensor``, or a packed ``W4A16Weight`` of those rows/columns."""


@dataclass(frozen=True)
class CheckpointTensor:
    """``name`` (HF) and ``shape`` (dense, (out, in) for a matrix) of one checkpoint tensor; ``read(region)`` reads
    that region of it from disk, and nothing else."""

    name: str
    shape: tuple[int, ...]
    read: Callable[[Region], Part]

    def numel(self, region: Region) -> int:
        """Elements of the dense tensor inside ``region``."""
        n = 1
        for d, size in enumerate(self.shape):
            n *= region[2] if region is not None and region[0] == d else size
        return n

    def map(self, fn: Callable[[Part], Part]) -> CheckpointTensor:
        """The same tensor with ``fn`` applied to every part read (quantising at load, say)."""
        read = self.read
        return CheckpointTensor(self.name, self.shape, lambda region: fn(read(region)))


def shape_of(part: Part) -> tuple[int, ...]:
    if isinstance(part, torch.Tensor):
        return tuple(part.shape)
    return (part.out_features, part.in_features)


def narrow(part: Part, region: Region) -> Part:
    """``region`` of a dense tensor or a packed weight already in memory."""
    if region is None:
        return part
    dim, start, length = region
    if isinstance(part, torch.Tensor):
        return part.narrow(dim, start, length)
    from stride.kernels import w4a16_format

    return w4a16_format.narrow(part, dim, start, length)


def packed(part: Part) -> W4A16Weight:
    """``part`` as the packed weight a 4-bit module loads (a clear error for a dense one)."""
    from stride.kernels.w4a16_format import W4A16Weight

    if not isinstance(part, W4A16Weight):
        raise TypeError(f"expected a packed W4A16 weight, got {type(part).__name__}")
    return part
