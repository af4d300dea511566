"""Shared by the worker tests: a :class:`ModelRunner` from the handful of settings a test varies, and a GGUF written
from an HF checkpoint the way llama.cpp converts one."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.torch import load_file

from stride.config import WorkerConfig
from stride.model.tensor_names import GGUF_LAYER_TO_HF
from stride.workers.runner import ModelRunner, RunnerConfig

ROOT = Path(__file__).resolve().parents[1]
_RUNNER_FIELDS = {"block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len"}


def make_runner(model: str, *, progress: Any = None, memory_utilization: float | None = None,
                **settings: Any) -> ModelRunner:
    """``ModelRunner`` of ``model``: keywords naming :class:`RunnerConfig` fields go there, the rest to
    :class:`WorkerConfig` (``device``, ``dtype``, ``attention_backend``, ``cuda_graphs``, ``quantize``...)."""
    runner_kw = {k: settings.pop(k) for k in list(settings) if k in _RUNNER_FIELDS}
    if memory_utilization is not None:
        settings["gpu_memory_utilization"] = memory_utilization
    return ModelRunner(RunnerConfig(WorkerConfig(model=str(model), **settings), **runner_kw), progress)


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (rotate-half rows → interleaved pairs), written out independently."""
    out = np.empty_like(w)
    head_dim = w.shape[0] // num_heads
    for h in range(num_heads):
        for i in range(head_dim // 2):
            out[h * head_dim + 2 * i] = w[h * head_dim + i]
            out[h * head_dim + 2 * i + 1] = w[h * head_dim + head_dim // 2 + i]
    return out


def write_gguf(hf: Path, out: Path, qtype: str = "F32") -> Path:
    """Convert the tiny HF checkpoint to GGUF the way llama.cpp does (names, permuted q/k, quantised 2-D)."""
    cfg = json.loads((hf / "config.json").read_text())
    weights = load_file(str(hf / "model.safetensors"))
    make = runpy.run_path(str(ROOT / "scripts" / "make_random_gguf.py"), run_name="make_gguf")
    w = make["llama_writer"](cfg, str(out))
    names = {v: k for k, v in GGUF_LAYER_TO_HF.items()}
    for name, t in weights.items():
        a = t.numpy()
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            kind = names[rest.removesuffix(".weight")]
            if kind == "attn_q":
                a = llama_cpp_permute(a, cfg["num_attention_heads"])
            elif kind == "attn_k":
                a = llama_cpp_permute(a, cfg["num_key_value_heads"])
            gname = f"blk.{layer}.{kind}.weight"
        else:
            gname = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        if a.ndim == 2 and qtype != "F32":
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gname, gguf.quants.quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
