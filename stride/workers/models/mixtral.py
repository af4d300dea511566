"""Mixtral: the Llama decoder with a top-k mixture of gated-MLP experts in place of the dense MLP.

Routing follows transformers exactly (softmax over all experts in float32, keep the top k, renormalise,
weight each expert's output in float32). With tensor parallelism every rank keeps every expert and splits
each expert's intermediate dimension like a dense MLP (w1/w3 column-parallel, w2 row-parallel), so expert memory
is divided by the ranks; expert parallelism would split the expert list instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stride.model.args import ModelArgs
from stride.model.tensor_names import MOE, load_rules
from stride.workers.checkpoint import Part
from stride.workers.models.layers import GatedMLP, Loadable
from stride.workers.models.llama import Transformer

# HF (Hub-format) Mixtral names → our modules (stride.model.tensor_names: w1 = gate, w3 = up, w2 = down).
MIXTRAL_RULES = load_rules(MOE)


class Router(Loadable):
    """Replicated on every rank: (num_experts, hidden) logits weight."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def load_part(self, part: Part, shard: int = 0) -> None:
        self.weight.data.copy_(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoE(nn.Module):
    def __init__(self, args: ModelArgs, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = Router(args.hidden_size, args.num_experts)
        self.experts = nn.ModuleList(
            GatedMLP(args.hidden_size, args.intermediate_size, tp_rank, tp_size)
            for _ in range(args.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        # Only experts some token picked run; each sees just its tokens.
        for e in torch.unique(expert_ids).tolist():
            token_idx, k_idx = torch.where(expert_ids == e)
            y = self.experts[e](x[token_idx]) * weights[token_idx, k_idx, None]
            out.index_add_(0, token_idx, y.to(x.dtype))
        return out


def build(args: ModelArgs, tp_rank: int = 0, tp_size: int = 1) -> Transformer:
    model = Transformer(args, lambda a, r, s: SparseMoE(a, r, s), tp_rank, tp_size)
    model.extra_rules = MIXTRAL_RULES
    return model
