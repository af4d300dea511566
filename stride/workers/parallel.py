"""Tensor parallelism as a pass over a built model, and the collectives it needs: the one module that talks to
``torch.distributed``.

The model's modules are built per rank (``tp_rank``/``tp_size``: column-parallel q/k/v and gate/up, row-parallel
attention output and down, the vocabulary split by rows for the embedding and the output head) and load only their
slices. They compute partial results and know nothing of other ranks. :func:`apply_tensor_parallel` then adds what
makes the ranks one model, as forward hooks: a sum over ranks (all-reduce) after every row-parallel projection and
after the vocabulary-parallel embedding, and the logits' slices gathered once per pass after the output head. With
one rank it does nothing.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

COLLECTIVE_TIMEOUT_S = 60.0
"""A rank that waits this long in a collective gives up: a dead or hung peer fails the launch instead of leaving
ranks spinning in an all-reduce."""


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in its tensor-parallel group. ``size == 1`` is the single-rank case: every collective is the
    identity and no process group exists."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside a group of {self.size}")

    @staticmethod
    def init(rank: int, size: int, init_method: str, device_type: str = "cpu",
             timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TensorParallel:
        """Join the group of ``size`` ranks rendezvousing at ``init_method`` (``file://`` or ``tcp://`` of this
        launch): NCCL on CUDA (one GPU per rank), gloo on the CPU."""
        if size > 1:
            backend = "nccl" if device_type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        return TensorParallel(rank, size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (in place)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def agree_min(self, n: int, device: torch.device) -> int:
        """The smallest of every rank's ``n`` (the KV block count every rank can hold)."""
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def destroy(self) -> None:
        """Leave the group. A barrier first: a rank that tore its group down while a peer was still receiving the
        last collective's data made that peer's transport thread throw, and the process abort (seen with gloo on
        two CPU ranks, about one run in three)."""
        if self.size > 1 and dist.is_initialized():
            try:
                dist.barrier()
            except RuntimeError:  # a peer is gone already (a failed run): nothing left to wait for
                pass
            dist.destroy_process_group()


def exit_spawned_rank() -> None:
    """End a rank process started by ``torch.multiprocessing.spawn`` that finished its work: exit now, skipping the
    interpreter's teardown. There, now and then, a gloo transport thread still running when its object is destroyed
    aborts the process ("terminate called without an active exception"; about one CI run in four on 2 CPUs, after
    the group was left cleanly), and the spawner reports a rank that did its work as failed.

    Called where no process was spawned (a single rank run in the caller's own process: a test's tp=1 reference),
    it returns: exiting there would end the caller itself, with status 0."""
    if multiprocessing.parent_process() is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def vocab_rows(vocab_size: int, tp_size: int) -> int:
    """Rows of the vocabulary each rank holds: an equal share, the last rank's padded past the vocabulary."""
    return -(-vocab_size // tp_size)


def apply_tensor_parallel(model: nn.Module, tp: TensorParallel) -> nn.Module:
    """Make ``model``'s per-rank modules one model over ``tp`` (in place; returns it)."""
    if tp.size == 1:
        return model
    from stride.workers.models.layers import Embedding, RowParallelLinear, VocabParallelHead, W4A16Linear
    from stride.workers.models.mixtral import SparseMoE

    def reduce(_module: nn.Module, _inputs: object, out: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(out)

    # A mixture's experts are summed (weighted) into its output before anything reads it: one all-reduce of that
    # sum instead of one per expert that ran.
    in_moe = {id(m) for moe in model.modules() if isinstance(moe, SparseMoE) for m in moe.experts.modules()}
    for module in model.modules():
        if id(module) in in_moe:
            continue
        if isinstance(module, (RowParallelLinear, Embedding, SparseMoE)) or (
                isinstance(module, W4A16Linear) and module.split == "row"):
            module.register_forward_hook(reduce)
        elif isinstance(module, VocabParallelHead):
            vocab = module.vocab_size
            module.register_forward_hook(lambda _m, _i, out, n=vocab: tp.all_gather_last(out)[..., :n])
    return model
