"""Llama (2, 3, 3.1 with llama3 RoPE scaling; SmolLM2 is one) over flattened tokens and the paged KV cache.

Parameters are named after the modules here, not after the checkpoint; :meth:`Transformer.target` maps HF
checkpoint names (``model.layers.3.self_attn.q_proj.weight``) onto them and their shards.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from stride.model.args import ModelArgs
from stride.model.tensor_names import LAYER, TOP, load_rules
from stride.workers.attention import AttentionContext
from stride.workers.models.layers import (
    ColumnParallelLinear,
    Embedding,
    GatedMLP,
    Loadable,
    RMSNorm,
    Rope,
    RowParallelLinear,
    VocabParallelHead,
    rope_cos_sin,
)

# HF checkpoint name (under model.layers.N.) → (our module path, shard within a merged weight): the one table.
_LAYER_RULES = load_rules(LAYER)
_TOP_RULES = {t.hf: t.module for t in TOP}


class Attention(nn.Module):
    """GQA self-attention: qkv column-parallel (each rank its heads), o row-parallel."""

    def __init__(self, args: ModelArgs, layer_id: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = args.num_heads // tp_size
        # Fewer KV heads than ranks: each rank holds (a replica of) the one its query heads use.
        self.num_kv_heads = max(1, args.num_kv_heads // tp_size)
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = ColumnParallelLinear(args.hidden_size, [q_size, kv_size, kv_size], tp_rank, tp_size,
                                             units=[args.head_dim] * 3)
        self.o_proj = RowParallelLinear(q_size, args.hidden_size, tp_rank, tp_size)
        self.rope = Rope()

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        num_tokens, heads, kv_heads, dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        k_cache, v_cache = ctx.k_caches[self.layer_id], ctx.v_caches[self.layer_id]
        v = qkv[:, (heads + kv_heads) * dim :].view(num_tokens, kv_heads, dim)
        # Write first, for every sequence of the step, then attend: shared prefix blocks are then complete.
        if self.rope.fused:  # one launch rotates and writes the cache (two index_puts fewer per layer)
            q = qkv[:, : heads * dim].view(num_tokens, heads, dim)
            k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(num_tokens, kv_heads, dim)
            self.rope.rotate_into_cache(q, k, v, cos, sin, k_cache, v_cache, ctx.meta.slot_mapping)
        else:  # q's and k's heads side by side in qkv: rotated as one tensor (half the small ops of two)
            qk = self.rope.rotate(qkv[:, : (heads + kv_heads) * dim].view(num_tokens, heads + kv_heads, dim), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            ctx.backend.write_kv(k, v, k_cache, v_cache, ctx.meta)
        out = ctx.backend.attend(q, k_cache, v_cache, ctx.meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, -1))


class Block(nn.Module):
    def __init__(
        self, args: ModelArgs, layer_id: int, mlp: nn.Module, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_id, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream kept apart: the layer's input is ``x + residual`` (``x`` alone in layer 0), and it
        returns ``(mlp_out, h)`` whose sum is its output. Each add is then fused into the following norm;
        the sums round exactly where ``h = x + attn(norm(x)); h + mlp(norm(h))`` rounds."""
        if residual is None:
            normed, residual = self.input_layernorm(x), x
        else:
            normed, residual = self.input_layernorm.add_forward(x, residual)
        attn = self.self_attn(normed, cos, sin, ctx)
        normed, residual = self.post_attention_layernorm.add_forward(attn, residual)
        return self.mlp(normed), residual


MlpFactory = Callable[[ModelArgs, int, int], nn.Module]
"""(args, tp_rank, tp_size) → the feed-forward module of one layer."""


def dense_mlp(args: ModelArgs, tp_rank: int, tp_size: int) -> nn.Module:
    return GatedMLP(args.hidden_size, args.intermediate_size, tp_rank, tp_size)


class Transformer(nn.Module):
    """Decoder over a step's flattened tokens; the feed-forward kind comes from ``mlp_factory``."""

    def __init__(
        self, args: ModelArgs, mlp_factory: MlpFactory = dense_mlp, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size, tp_rank, tp_size)
        self.layers = nn.ModuleList(
            Block(args, i, mlp_factory(args, tp_rank, tp_size), tp_rank, tp_size)
            for i in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = VocabParallelHead(args.hidden_size, args.vocab_size, tp_rank, tp_size)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Its values come in init_buffers: computed here, on the meta device the loader builds on, the division
        # would go through torch's reference decompositions, which import torch._dynamo and with it Triton
        # (66 MB resident in a CPU worker that never runs it).
        self.register_buffer("inv_freq", torch.empty(args.head_dim // 2), persistent=False)
        self.extra_rules: list[tuple[str, str, int]] = []
        """Family-specific checkpoint name rules (Mixtral's experts), same form as ``_LAYER_RULES``."""

    def init_buffers(self, device: torch.device) -> None:
        """Recompute non-checkpoint buffers (after the model was built on the meta device)."""
        self.inv_freq = self.args.inv_freq().to(device)

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """Final-norm hidden states (num_tokens, hidden) for the flattened tokens of one step."""
        x = self.embed_tokens(token_ids)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        if residual is None:
            return self.norm(x)
        return self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits (n, vocab) of the given hidden rows (with tensor parallelism, this rank's slice of the
        vocabulary, which :func:`stride.workers.parallel.apply_tensor_parallel` gathers)."""
        return self.lm_head(hidden).float()

    def target(self, name: str) -> tuple[Loadable, int] | None:
        """The module and shard an HF-named checkpoint tensor loads into; ``None`` for a tensor to skip (the stored
        copy of a tied head); ``KeyError`` for a name with no place here."""
        if name.endswith(".weight"):
            stem = name[: -len(".weight")]
            if stem in _TOP_RULES:
                if stem == "lm_head" and self.args.tie_word_embeddings:
                    return None  # some checkpoints store the tied copy too
                return self._loadable(_TOP_RULES[stem]), 0
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem)
            if m:
                layer, rest = m.group(1), m.group(2)
                for pattern, target, shard in _LAYER_RULES + self.extra_rules:
                    sub = re.fullmatch(pattern, rest)
                    if sub:
                        return self._loadable(f"layers.{layer}.{target.format(*sub.groups())}"), shard
        raise KeyError(f"checkpoint tensor {name!r} has no place in a {self.args.family} model")

    def _loadable(self, path: str) -> Loadable:
        module = self.get_submodule(path)
        assert isinstance(module, Loadable), f"{path} holds no checkpoint weights"
        return module


def build(args: ModelArgs, tp_rank: int = 0, tp_size: int = 1) -> Transformer:
    return Transformer(args, dense_mlp, tp_rank, tp_size)
