"""Tensors and shape of a GGUF file, under HF names: dequantised to float32 with the ``gguf`` package (llama.cpp's
Q/K row permutation undone, as transformers does when it loads a GGUF, so the two give the same model), or -- for
the Q4_0/Q4_1 projections the 4-bit path keeps -- repacked as :class:`kernels.w4a16_format.W4A16Weight`. Names
come from :mod:`stride.model.tensor_names`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from stride.model.args import ModelArgs
from stride.model.tensor_names import GGUF_EXPERTS_TO_HF, GGUF_LAYER_TO_HF, GGUF_TOP_TO_HF, PROJECTIONS

GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
"""GGUF tensor types we dequantise (the ones tested); others are refused with their name."""

W4A16_TYPES = ("Q4_0", "Q4_1")
"""GGUF types the W4A16 GEMM takes as they are (a per-32 scale, and a min or the implied -8 * scale)."""


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_args(reader: Any) -> ModelArgs:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "mixtral"):
        raise ValueError(f"unsupported GGUF architecture {arch!r} (llama and mixtral only)")
    if _field(reader, f"{arch}.rope.scaling.type", "none") not in ("none", "linear") or (
        _field(reader, f"{arch}.rope.scaling.factor", 1.0) != 1.0
    ):
        raise ValueError("GGUF rope scaling other than llama3 (rope_freqs) is not supported")
    names = {t.name: t for t in reader.tensors}
    embd = names["token_embd.weight"]
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    freqs = names.get("rope_freqs.weight")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelArgs(
        vocab_size=int(_field(reader, f"{arch}.vocab_size", int(embd.shape[1]))),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_freq_factors=tuple(float(x) for x in np.asarray(freqs.data)) if freqs is not None else (),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 8192)),
        tie_word_embeddings="output.weight" not in names,
        num_experts=int(_field(reader, f"{arch}.expert_count", 0)),
        num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count", 2)),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which reorders each head's q/k rows from rotate-half pairs ``(i, i + d/2)``
    to interleaved pairs ``(2i, 2i + 1)`` for its RoPE; ours (and HF's) rotates halves."""
    head_dim = weight.shape[0] // num_heads
    w = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def w4a16_projections(reader: Any, args: ModelArgs) -> dict[str, str]:
    """GGUF tensor name → our module path, for the projections whose every merged tensor is Q4_0/Q4_1."""
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    out: dict[str, str] = {}
    for layer in range(args.num_layers):
        for module, merged in PROJECTIONS.items():
            names = [f"blk.{layer}.{t.gguf}.weight" for t in merged]
            if all(types.get(n) in W4A16_TYPES for n in names):
                out.update((n, f"layers.{layer}.{module}") for n in names)
    return out


def _to_torch(data: np.ndarray) -> torch.Tensor:
    # F32 tensors come back as read-only views of the memory-mapped file; torch wants its own writable copy.
    if not (data.flags.writeable and data.flags.c_contiguous):
        data = np.array(data, dtype=np.float32, order="C")
    return torch.from_numpy(data)


def _unpermute_gguf(kind: str, rows: np.ndarray, args: ModelArgs) -> np.ndarray:
    if kind == "attn_q":
        return unpermute_qk(rows, args.num_heads)
    if kind == "attn_k":
        return unpermute_qk(rows, args.num_kv_heads)
    return rows


def _dequantized(t: Any) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)


def _packed_q4(t: Any, kind: str, args: ModelArgs, scale_dtype: torch.dtype) -> Any:
    """A Q4_0/Q4_1 projection as a W4A16Weight. The reader gives one row of blocks per output row (N, bytes),
    and a row's blocks are that row alone, so q/k are un-permuted on the raw rows before repacking: the same
    rows move as in the dequantised path, i.e. the same columns of qweight/scales/mins."""
    from kernels.w4a16_format import from_gguf_q4

    k, n = (int(x) for x in t.shape)  # GGUF lists dimensions innermost first
    rows = np.asarray(t.data).reshape(n, -1)
    rows = _unpermute_gguf(kind, rows, args)
    return from_gguf_q4(rows, t.tensor_type.name, (n, k), scale_dtype)


def gguf_tensors(
    reader: Any, args: ModelArgs, packed: set[str], scale_dtype: torch.dtype
) -> Iterator[tuple[str, Any]]:
    """``(HF name, tensor)``: dequantised float32 tensors, and W4A16Weight for the GGUF names in ``packed``."""
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # already in ModelArgs
        qtype = t.tensor_type.name
        if qtype not in GGUF_TYPES:
            raise ValueError(f"GGUF tensor {t.name} has type {qtype}; supported: {', '.join(GGUF_TYPES)}")
        parts = t.name.split(".")
        if parts[0] == "blk":
            layer, kind = parts[1], parts[2]
            prefix = f"model.layers.{layer}."
            if kind in GGUF_EXPERTS_TO_HF:  # (num_experts, out, in): one HF tensor per expert
                data = _dequantized(t)
                for e in range(data.shape[0]):
                    yield f"{prefix}{GGUF_EXPERTS_TO_HF[kind].format(e)}.weight", _to_torch(data[e])
                continue
            if kind not in GGUF_LAYER_TO_HF:
                raise KeyError(f"GGUF tensor {t.name} is not a Llama/Mixtral tensor")
            name = prefix + GGUF_LAYER_TO_HF[kind] + ".weight"
            if t.name in packed:
                yield name, _packed_q4(t, kind, args, scale_dtype)
                continue
            yield name, _to_torch(_unpermute_gguf(kind, _dequantized(t), args))
        elif parts[0] in GGUF_TOP_TO_HF:
            yield GGUF_TOP_TO_HF[parts[0]] + ".weight", _to_torch(_dequantized(t))
        else:
            raise KeyError(f"GGUF tensor {t.name} is not a Llama/Mixtral tensor")
