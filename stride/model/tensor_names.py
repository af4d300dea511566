"""The one table of checkpoint tensor names. For each tensor a Llama or Mixtral checkpoint holds: its HF name, its
GGUF name, and the module of ours it loads into (with its shard, where several checkpoint tensors are merged into
one weight). The model's loading rules, the GGUF loader's renaming and the 4-bit paths' choice of projections are all
derived from it, so a name is written once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorName:
    """One checkpoint tensor (its ``.weight``). Layer tensors' names are under ``model.layers.N.`` (HF),
    ``blk.N.`` (GGUF) and ``layers.N.`` (ours); ``{0}`` stands for an expert's index."""

    hf: str
    gguf: str
    module: str
    shard: int = 0
    """Index of this tensor within the merged weight of ``module`` (q, k, v in qkv_proj; gate, up in gate_up)."""


TOP: tuple[TensorName, ...] = (
    TensorName("model.embed_tokens", "token_embd", "embed_tokens"),
    TensorName("model.norm", "output_norm", "norm"),
    TensorName("lm_head", "output", "lm_head"),
)
LAYER: tuple[TensorName, ...] = (
    TensorName("self_attn.q_proj", "attn_q", "self_attn.qkv_proj", 0),
    TensorName("self_attn.k_proj", "attn_k", "self_attn.qkv_proj", 1),
    TensorName("self_attn.v_proj", "attn_v", "self_attn.qkv_proj", 2),
    TensorName("self_attn.o_proj", "attn_output", "self_attn.o_proj"),
    TensorName("mlp.gate_proj", "ffn_gate", "mlp.gate_up_proj", 0),
    TensorName("mlp.up_proj", "ffn_up", "mlp.gate_up_proj", 1),
    TensorName("mlp.down_proj", "ffn_down", "mlp.down_proj"),
    TensorName("input_layernorm", "attn_norm", "input_layernorm"),
    TensorName("post_attention_layernorm", "ffn_norm", "post_attention_layernorm"),
)
MOE: tuple[TensorName, ...] = (
    TensorName("block_sparse_moe.gate", "ffn_gate_inp", "mlp.router"),
    # w1 = gate, w3 = up, w2 = down. GGUF stores all experts in one (experts, out, in) tensor.
    TensorName("block_sparse_moe.experts.{0}.w1", "ffn_gate_exps", "mlp.experts.{0}.gate_up_proj", 0),
    TensorName("block_sparse_moe.experts.{0}.w3", "ffn_up_exps", "mlp.experts.{0}.gate_up_proj", 1),
    TensorName("block_sparse_moe.experts.{0}.w2", "ffn_down_exps", "mlp.experts.{0}.down_proj"),
)

PROJECTIONS: dict[str, tuple[TensorName, ...]] = {
    module: tuple(sorted((t for t in LAYER if t.module == module), key=lambda t: t.shard))
    for module in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
}
"""A dense layer's projections (our module path under ``layers.N.``) and the tensors merged in each, in shard order:
the modules the 4-bit paths may replace."""


def load_rules(names: tuple[TensorName, ...]) -> list[tuple[str, str, int]]:
    """``(regex over the HF name under model.layers.N., our module path, shard)``; the regex's group is the expert."""
    return [(re.escape(t.hf).replace(re.escape("{0}"), r"(\d+)"), t.module, t.shard) for t in names]


GGUF_LAYER_TO_HF = {t.gguf: t.hf for t in (*LAYER, *MOE) if "{0}" not in t.hf}
"""GGUF layer tensor (under ``blk.N.``) -> HF name (under ``model.layers.N.``), for one tensor per name."""
GGUF_EXPERTS_TO_HF = {t.gguf: t.hf for t in MOE if "{0}" in t.hf}
"""GGUF experts tensor -> the HF name of each expert's slice (``{0}``: the expert)."""
GGUF_TOP_TO_HF = {t.gguf: t.hf for t in TOP}
