#!/usr/bin/env python
"""Write an HF-format checkpoint with random weights: config.json, safetensors (sharded with an index past
--shard-gib), and a minimal byte-level tokenizer. For GPU tests and benchmarks where real weights cannot be
downloaded; the shapes are real, the text is noise.

    python scripts/make_random_checkpoint.py --preset llama-3.1-8b --out /tmp/llama8b
    python scripts/make_random_checkpoint.py --preset tiny-mixtral --out /tmp/tiny --dtype float32
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B's config.json shape.
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    # HuggingFaceTB/SmolLM2-135M(-Instruct), the default model's shape (its GGUF's metadata): tied embeddings.
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    # GQA, llama3 scaling that bites at short lengths (original context 64), untied embeddings.
    "tiny-llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=dict(_LLAMA3_ROPE, factor=4.0, original_max_position_embeddings=64),
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
    "tiny-mixtral": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        router_jitter_noise=0.0,
    ),
}
BOS, EOS = "<|begin|>", "<|end|>"


def tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF (Hub-format) tensor names and shapes of a Llama or Mixtral config."""
    h, inter, heads, kv = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
    )
    d = cfg.get("head_dim") or h // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (heads * d, h),
                p + "self_attn.k_proj.weight": (kv * d, h),
                p + "self_attn.v_proj.weight": (kv * d, h),
                p + "self_attn.o_proj.weight": (h, heads * d),
            }
        )
        if cfg.get("num_local_experts"):
            shapes[p + "block_sparse_moe.gate.weight"] = (cfg["num_local_experts"], h)
            for e in range(cfg["num_local_experts"]):
                q = f"{p}block_sparse_moe.experts.{e}."
                shapes.update(
                    {q + "w1.weight": (inter, h), q + "w3.weight": (inter, h), q + "w2.weight": (h, inter)}
                )
        else:
            shapes.update(
                {
                    p + "mlp.gate_proj.weight": (inter, h),
                    p + "mlp.up_proj.weight": (inter, h),
                    p + "mlp.down_proj.weight": (h, inter),
                }
            )
    shapes["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def write_checkpoint(
    cfg: dict[str, Any],
    out: Path,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    shard_bytes: int = 4 << 30,
    device: str = "cpu",
) -> Path:
    """Write config, weights (normal, std 0.02; norms near 1) and tokenizer files into ``out``.

    ``device`` draws the numbers there (``cuda`` makes an 8B-shaped checkpoint in seconds rather than
    minutes; the values then differ from a CPU draw with the same seed)."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape in tensor_shapes(cfg).items():
        if len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
        else:
            t = 0.02 * torch.randn(shape, generator=gen, device=device)
        t = t.to(dtype).cpu()
        if size and size + t.numel() * t.element_size() > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * t.element_size()
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
    vocab = cfg["vocab_size"]
    full = dict(
        cfg,
        torch_dtype=str(dtype).removeprefix("torch."),
        bos_token_id=min(256, vocab - 2),
        eos_token_id=min(257, vocab - 1),
    )
    (out / "config.json").write_text(json.dumps(full, indent=1))
    write_tokenizer(out, full["bos_token_id"], full["eos_token_id"])
    return out


def write_tokenizer(out: Path, bos_id: int, eos_id: int) -> None:
    """A byte-level BPE with no merges (one token per byte) plus BOS/EOS: enough to round-trip any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    if tok.token_to_id(BOS) != bos_id or tok.token_to_id(EOS) != eos_id:
        raise ValueError("vocab_size too small for the byte tokenizer (needs >= 258)")
    tok.save(str(out / "tokenizer.json"))
    template = (
        "{% for m in messages %}" + BOS + "{{ m['role'] }}\n{{ m['content'] }}" + EOS + "\n{% endfor %}"
        "{% if add_generation_prompt %}" + BOS + "assistant\n{% endif %}"
    )
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "add_bos_token": False,
                "chat_template": template,
            },
            indent=1,
        )
    )


def copy_tokenizer(source: str, out: Path, vocab_size: int) -> None:
    """``source``'s tokenizer, chat template and end ids into ``out`` (tokenizer.json, tokenizer_config.json, and
    config.json's bos/eos ids), replacing the byte-level tokenizer."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from stride.tokenizer.loader import load_tokenizer

    tok = load_tokenizer(source)
    if tok.tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"{source}'s tokenizer has {tok.tokenizer.get_vocab_size()} tokens; the preset {vocab_size}")
    tok.tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "add_bos_token": tok.add_bos_token}, indent=1))
    cfg = json.loads((out / "config.json").read_text())
    cfg["eos_token_id"] = list(tok.eos_token_ids) if len(tok.eos_token_ids) > 1 else tok.eos_token_ids[0]
    if tok.bos_token is not None:
        cfg["bos_token_id"] = tok.tokenizer.token_to_id(tok.bos_token)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=0, help="override the preset's layer count")
    parser.add_argument("--shard-gib", type=float, default=4.0, help="largest safetensors shard")
    parser.add_argument("--device", default="cpu", help="where to draw the random numbers (cpu, cuda)")
    parser.add_argument("--tokenizer-from", default="", metavar="PATH",
                        help="write this model's tokenizer (a GGUF file or an HF directory) instead of the byte-level "
                             "one: served benchmarks then stream real text (SmolLM2's fits the smollm2-135m preset)")
    args = parser.parse_args()
    cfg = dict(PRESETS[args.preset])
    if args.num_layers:
        cfg["num_hidden_layers"] = args.num_layers
    out = write_checkpoint(
        cfg, Path(args.out), getattr(torch, args.dtype), args.seed, int(args.shard_gib * 2**30), args.device
    )
    if args.tokenizer_from:
        copy_tokenizer(args.tokenizer_from, out, cfg["vocab_size"])
    print(f"wrote {args.preset} ({args.dtype}) to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
