"""The one dataclass that describes a model's shape, read from an HF ``config.json`` or GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style ("llama3") frequency scaling; ``factor == 1`` means none."""

    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArgs:
    """Shape of a Llama-family model (Llama 2/3/3.1, SmolLM2) or a Mixtral (``num_experts > 0``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    num_experts: int = 0
    """Experts per MoE layer; 0 means a dense MLP (Llama)."""
    num_experts_per_tok: int = 2
    rope_freq_factors: tuple[float, ...] = ()
    """Per-frequency divisors stored by llama.cpp (``rope_freqs``) instead of llama3 scaling parameters."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} not in 1..{self.num_experts}")

    @property
    def family(self) -> str:
        return "mixtral" if self.num_experts else "llama"

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
        """From a ``config.json`` dict (transformers 4.x ``rope_scaling`` or 5.x ``rope_parameters``)."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in ("LlamaForCausalLM", "MixtralForCausalLM"):
            raise ValueError(f"unsupported architecture {arch!r} (Llama and Mixtral only)")
        rope = dict(cfg.get("rope_scaling") or {})
        rope.update(cfg.get("rope_parameters") or {})
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ValueError(f"unsupported rope type {kind!r}")
        scaling = RopeScaling()
        if kind == "llama3":
            scaling = RopeScaling(
                float(rope["factor"]),
                float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]),
                int(rope["original_max_position_embeddings"]),
            )
        num_heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        return ModelArgs(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=int(cfg.get("num_local_experts", 0)) if arch == "MixtralForCausalLM" else 0,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        )

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies (float32, ``head_dim // 2``), with llama3 scaling when configured."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.rope_theta**exponents)
        if self.rope_freq_factors:
            return inv_freq / torch.tensor(self.rope_freq_factors, dtype=torch.float32)
        s = self.rope_scaling
        if s.factor == 1.0:
            return inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(mid, blended, scaled)

    def param_count(self) -> int:
        """Parameters in the checkpoint (embeddings counted once when tied)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h
        mlp = 3 * h * self.intermediate_size
        ffn = self.num_experts * mlp + self.num_experts * h if self.num_experts else mlp
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + ffn + 2 * h) + h + emb
