#!/usr/bin/env python
"""Write a random-weight GGUF of a real model's shape, its linear weights quantised to Q4_0 or Q4_1.

For benchmarking the 4-bit (W4A16) worker where no real GGUF can be downloaded (the GPU machine). The shapes
come from ``make_random_checkpoint.py``'s presets; weights are normal (std 0.02) and quantised on ``--device``
the way llama.cpp's reference quantiser does (Q4_1: per 32 weights an fp16 scale (max - min) / 15 and the
fp16 min; Q4_0: the fp16 scale max-magnitude / -8, codes offset by 8). The token embedding and the output
matrix are F16, as real 4-bit GGUFs keep them at higher precision; norms are F32. No tokenizer is written:
the worker runs on token ids.

    python scripts/make_random_gguf.py --preset llama-3.1-8b --out /dev/shm/llama8b-q4_1.gguf --device cuda
"""

from __future__ import annotations

import argparse
import runpy
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

PRESETS: dict[str, dict[str, Any]] = runpy.run_path(
    str(Path(__file__).with_name("make_random_checkpoint.py")), run_name="make_checkpoint")["PRESETS"]


def quantise_q4(w: torch.Tensor, qtype: str) -> np.ndarray:
    """(rows, cols) → the GGUF block bytes, (rows, cols // 32 * bytes per block) uint8."""
    rows, cols = w.shape
    b = w.float().reshape(rows, cols // 32, 32)
    if qtype == "Q4_1":
        lo, hi = b.amin(-1), b.amax(-1)
        d = (hi - lo) / 15
        q = ((b - lo[..., None]) * torch.where(d > 0, 1 / d, 0)[..., None] + 0.5).floor().clamp(0, 15)
        head = [d, lo]
    else:
        # The value of largest magnitude maps to code 0 (-8 * d), as ggml's quantize_row_q4_0 does.
        big = b.gather(-1, b.abs().argmax(-1, keepdim=True))[..., 0]
        d = big / -8
        q = (b * torch.where(d != 0, 1 / d, 0)[..., None] + 8.5).floor().clamp(0, 15)
        head = [d]
    codes = q.to(torch.uint8)
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # byte i: weight i low, weight i + 16 high
    parts = [h.half().view(torch.uint8).reshape(rows, cols // 32, 2) for h in head] + [packed]
    return torch.cat(parts, dim=-1).reshape(rows, -1).cpu().numpy()


def llama_writer(cfg: dict[str, Any], out: str) -> Any:
    """A ``gguf.GGUFWriter`` for ``out`` holding the llama metadata of an HF config dict (no tensors yet)."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim", hidden // heads)
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    return w


def write_gguf(cfg: dict[str, Any], out: str, qtype: str, seed: int, device: str) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim", hidden // heads)
    w = llama_writer(cfg, out)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device) * 0.02

    w.add_tensor("token_embd.weight", normal(cfg["vocab_size"], hidden).half().cpu().numpy())
    if not cfg.get("tie_word_embeddings"):  # tied: the head reads token_embd, as in SmolLM2's GGUF
        w.add_tensor("output.weight", normal(cfg["vocab_size"], hidden).half().cpu().numpy())
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    linears = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
               "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
               "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}
    raw = gguf.GGMLQuantizationType[qtype]
    for layer in range(cfg["num_hidden_layers"]):
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{name}.weight", np.ones(hidden, np.float32))
        for name, shape in linears.items():
            w.add_tensor(f"blk.{layer}.{name}.weight", quantise_q4(normal(*shape), qtype), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--out", required=True, help="output .gguf file")
    parser.add_argument("--qtype", default="Q4_1", choices=["Q4_0", "Q4_1"])
    parser.add_argument("--num-layers", type=int, default=0, help="override the preset's layer count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where to draw and quantise (cpu, cuda)")
    args = parser.parse_args()
    cfg = dict(PRESETS[args.preset])
    if cfg.get("num_local_experts"):
        raise SystemExit("dense presets only")
    if args.num_layers:
        cfg["num_hidden_layers"] = args.num_layers
    write_gguf(cfg, args.out, args.qtype, args.seed, args.device)
    print(f"wrote {args.preset} ({args.qtype}) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
