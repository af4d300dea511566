"""Model geometry: the shapes that decide weight bytes, KV bytes per token and how a model can be split.

Covers Llama-style decoders (GQA attention, SwiGLU MLP, RMSNorm) and Mixtral-style MoE (every layer's MLP
replaced by ``num_experts`` SwiGLU experts of which ``num_experts_per_tok`` run per token, plus a router).
Biases, shared experts and sliding windows are not modelled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from stride.model.gguf import read_gguf

Split = Literal["column", "row", "kv_column", "vocab", "replicated"]


@dataclass(frozen=True)
class Matrix:
    """One kind of weight matrix: ``rows`` outputs × ``cols`` inputs, ``count`` copies in the model."""

    name: str
    rows: int
    cols: int
    count: int
    split: Split
    """How tensor parallelism cuts it: column (rows split), row (cols split), kv_column (rows split by KV
    head, replicated when there are fewer KV heads than ranks), vocab (rows split), replicated."""
    per_layer: bool = True
    """A decoder-layer weight (split over pipeline stages) rather than embedding/output/final norm."""
    expert: bool = False
    """An expert weight (split over expert-parallel ranks; only ``num_experts_per_tok`` of them active)."""
    embedding: bool = False
    """Token embedding or output projection (kept in 16-bit by formats that say so)."""
    norm: bool = False

    @property
    def numel(self) -> int:
        return self.rows * self.cols * self.count


@dataclass(frozen=True)
class ModelGeometry:
    """The shape of a decoder-only transformer. ``num_experts == 0`` means a dense model."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    """SwiGLU inner width (of each expert, for MoE)."""
    vocab_size: int
    tie_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    max_context: int = 0
    """Longest context the model was trained for (0: unknown)."""

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "vocab_size"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{self.name}: {f} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: {self.num_heads} heads not a multiple of "
                             f"{self.num_kv_heads} KV heads")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"{self.name}: experts per token must be in 1..{self.num_experts}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def matrices(self) -> list[Matrix]:
        """Every weight of the model, grouped by kind."""
        h, n = self.hidden_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        out = [
            Matrix("q_proj", q, h, n, "column"),
            Matrix("k_proj", kv, h, n, "kv_column"),
            Matrix("v_proj", kv, h, n, "kv_column"),
            Matrix("o_proj", h, q, n, "row"),
            Matrix("norms", 1, h, 2 * n, "replicated", norm=True),
        ]
        if self.is_moe:
            e = self.num_experts
            out += [Matrix("router", e, h, n, "replicated"),
                    Matrix("expert_gate_up", 2 * self.intermediate_size, h, n * e, "column", expert=True),
                    Matrix("expert_down", h, self.intermediate_size, n * e, "row", expert=True)]
        else:
            out += [Matrix("gate_up", 2 * self.intermediate_size, h, n, "column"),
                    Matrix("down", h, self.intermediate_size, n, "row")]
        out += [Matrix("embed_tokens", self.vocab_size, h, 1, "vocab", per_layer=False, embedding=True),
                Matrix("final_norm", 1, h, 1, "replicated", per_layer=False, norm=True)]
        if not self.tie_embeddings:
            out.append(Matrix("lm_head", self.vocab_size, h, 1, "vocab", per_layer=False, embedding=True))
        return out

    @property
    def params_total(self) -> int:
        return sum(m.numel for m in self.matrices())

    @property
    def params_active(self) -> int:
        """Parameters one token passes through: all but the experts it is not routed to."""
        if not self.is_moe:
            return self.params_total
        expert = sum(m.numel for m in self.matrices() if m.expert)
        return self.params_total - expert + expert * self.num_experts_per_tok // self.num_experts

    def kv_bytes_per_token(self, kv_bytes: int = 2) -> int:
        """K and V of every layer for one token, whole model (all ranks together, no replication)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_bytes


# Published config.json values (Hugging Face repos named in each comment).
CATALOG: dict[str, ModelGeometry] = {g.name: g for g in (
    # meta-llama/Llama-3.1-8B
    ModelGeometry("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, max_context=131072),
    # meta-llama/Llama-3.1-70B
    ModelGeometry("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, max_context=131072),
    # meta-llama/Llama-3.1-405B
    ModelGeometry("llama-3.1-405b", 126, 16384, 128, 8, 128, 53248, 128256, max_context=131072),
    # mistralai/Mixtral-8x7B-v0.1
    ModelGeometry("mixtral-8x7b", 32, 4096, 32, 8, 128, 14336, 32000, num_experts=8, num_experts_per_tok=2,
                  max_context=32768),
    # mistralai/Mixtral-8x22B-v0.1 (vocabulary 32768 since the v3 tokenizer)
    ModelGeometry("mixtral-8x22b", 56, 6144, 48, 8, 128, 16384, 32768, num_experts=8, num_experts_per_tok=2,
                  max_context=65536),
    # HuggingFaceTB/SmolLM2-135M-Instruct
    ModelGeometry("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tie_embeddings=True, max_context=8192),
)}


def from_hf_config(config: dict[str, Any], name: str = "") -> ModelGeometry:
    """Geometry from a Hugging Face ``config.json`` (Llama, Mistral, Mixtral and alike)."""
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    return ModelGeometry(
        name=name or str(config.get("_name_or_path") or config.get("model_type") or "model"),
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        num_experts=experts,
        num_experts_per_tok=int(config.get("num_experts_per_tok") or 0) if experts else 0,
        max_context=int(config.get("max_position_embeddings") or 0),
    )


def from_gguf(path: str | Path) -> ModelGeometry:
    """Geometry from a GGUF file's metadata (``{arch}.block_count`` etc.); reads no tensor data."""
    reader = read_gguf(path)

    def value(key: str, default: Any = None) -> Any:
        return reader.fields.get(key, default)

    arch = value("general.architecture")
    if arch is None:
        raise ValueError(f"{path}: no general.architecture in GGUF metadata")
    heads = int(value(f"{arch}.attention.head_count"))
    hidden = int(value(f"{arch}.embedding_length"))
    vocab = value(f"{arch}.vocab_size") or len(value("tokenizer.ggml.tokens", []))
    experts = int(value(f"{arch}.expert_count", 0) or 0)
    tensor_names = {t.name for t in reader.tensors}
    return ModelGeometry(
        name=Path(path).stem,
        num_layers=int(value(f"{arch}.block_count")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(value(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(value(f"{arch}.attention.key_length", hidden // heads)),
        intermediate_size=int(value(f"{arch}.feed_forward_length")),
        vocab_size=int(vocab),
        tie_embeddings="output.weight" not in tensor_names,
        num_experts=experts,
        num_experts_per_tok=int(value(f"{arch}.expert_used_count", 0) or 0) if experts else 0,
        max_context=int(value(f"{arch}.context_length", 0) or 0),
    )


def load_geometry(model: str) -> ModelGeometry:
    """A catalog name, a GGUF file, a ``config.json`` or a checkpoint directory holding one."""
    key = model.lower()
    if key in CATALOG:
        return CATALOG[key]
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf" and path.is_file():
        return from_gguf(path)
    if path.is_file():
        with open(path) as f:
            name = path.parent.name if path.name == "config.json" else path.stem
            return from_hf_config(json.load(f), name=name)
    raise ValueError(f"unknown model {model!r}: not in the catalog ({', '.join(CATALOG)}) "
                     "and not a GGUF file, config.json or checkpoint directory")
