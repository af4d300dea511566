"""Model families. :func:`build_model` picks the family from :class:`ModelArgs`."""

from __future__ import annotations

from stride.model.args import ModelArgs, RopeScaling
from stride.workers.models import llama, mixtral
from stride.workers.models.llama import Transformer

_FAMILIES = {"llama": llama.build, "mixtral": mixtral.build}


def build_model(args: ModelArgs, tp_rank: int = 0, tp_size: int = 1) -> Transformer:
    """An unloaded model of shape ``args`` (build it under ``torch.device('meta')`` to skip allocation)."""
    return _FAMILIES[args.family](args, tp_rank, tp_size)


__all__ = ["ModelArgs", "RopeScaling", "Transformer", "build_model"]
