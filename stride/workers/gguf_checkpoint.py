"""Tensors and shape of a GGUF file, under HF names, each read by region from the memory-mapped file (a rank's rows,
or its inputs as whole quantisation blocks): dequantised to float32 with the ``gguf`` package (llama.cpp's Q/K row
permutation undone, as transformers does when it loads a GGUF, so the two give the same model), or -- for the
Q4_0/Q4_1 projections the 4-bit path keeps -- repacked as :class:`stride.kernels.w4a16_format.W4A16Weight`. Names come
from :mod:`stride.model.tensor_names`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from stride.model.args import ModelArgs
from stride.model.gguf import GGUFFile
from stride.model.tensor_names import GGUF_EXPERTS_TO_HF, GGUF_LAYER_TO_HF, GGUF_TOP_TO_HF, PROJECTIONS
from stride.workers.checkpoint import CheckpointTensor, Region

GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
"""GGUF tensor types we dequantise (the ones tested); others are refused with their name."""

W4A16_TYPES = ("Q4_0", "Q4_1")
"""GGUF types the W4A16 GEMM takes as they are (a per-32 scale, and a min or the implied -8 * scale)."""


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def gguf_args(reader: GGUFFile) -> ModelArgs:
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


def w4a16_projections(reader: GGUFFile, args: ModelArgs) -> dict[str, str]:
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
    """Rows of whole heads (a rank's, or all of them) of q/k back in HF's order; other tensors as they are."""
    if kind in ("attn_q", "attn_k"):
        return unpermute_qk(rows, rows.shape[0] // args.head_dim)
    return rows


def _raw_region(raw: np.ndarray, qtype: str, region: Region) -> np.ndarray | None:
    """The stored bytes (or floats) of ``region`` of a 2-D tensor whose rows are ``raw``'s rows: rows as they are,
    inputs as whole quantisation blocks of every row; ``None`` if the inputs cut a block."""
    if region is None:
        return raw
    dim, start, length = region
    if dim == 0:
        return raw[start : start + length]
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    if start % block or length % block:
        return None
    per = nbytes // raw.itemsize  # entries of raw per block (bytes of quantised rows, floats of F32/F16 ones)
    return raw[:, start // block * per : (start + length) // block * per]


def _dense_reader(raw: np.ndarray, qtype: str, kind: str, args: ModelArgs) -> Any:
    import gguf

    def read(region: Region) -> torch.Tensor:
        part = _raw_region(raw, qtype, region)
        if part is None:  # inputs inside a block: the whole rows, then the slice (no model splits so)
            assert region is not None
            return read(None).narrow(region[0], region[1], region[2])
        if region is not None and region[0] == 1:
            part = np.ascontiguousarray(part)
        data = gguf.quants.dequantize(part, gguf.GGMLQuantizationType[qtype]).astype(np.float32, copy=False)
        return _to_torch(_unpermute_gguf(kind, data, args))
    return read


def _packed_reader(raw: np.ndarray, qtype: str, kind: str, args: ModelArgs, scale_dtype: torch.dtype) -> Any:
    """A Q4_0/Q4_1 projection read as a W4A16Weight. The reader gives one row of blocks per output row (N, bytes),
    and a row's blocks are that row alone, so q/k are un-permuted on the raw rows before repacking: the same rows
    move as in the dequantised path, i.e. the same columns of qweight/scales/mins."""
    from stride.kernels.w4a16_format import from_gguf_q4

    block_bytes = 18 if qtype == "Q4_0" else 20

    def read(region: Region) -> Any:
        part = _raw_region(raw, qtype, region)
        if part is None:
            raise ValueError(f"a 4-bit shard must be whole blocks of 32 inputs, not {region}")
        rows = _unpermute_gguf(kind, np.ascontiguousarray(part), args)
        return from_gguf_q4(rows, qtype, (rows.shape[0], rows.shape[1] // block_bytes * 32), scale_dtype)
    return read


def gguf_tensors(reader: GGUFFile, args: ModelArgs, packed: set[str],
                 scale_dtype: torch.dtype) -> list[CheckpointTensor]:
    """Every tensor under its HF name (Mixtral's experts one per expert), each read by region from the memory-mapped
    file: dequantised to float32, or as a W4A16Weight for the GGUF names in ``packed``."""
    out = []
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # already in ModelArgs
        qtype = t.tensor_type.name
        if qtype not in GGUF_TYPES:
            raise ValueError(f"GGUF tensor {t.name} has type {qtype}; supported: {', '.join(GGUF_TYPES)}")
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dimensions innermost first
        raw = np.asarray(t.data)
        parts = t.name.split(".")
        if parts[0] == "blk":
            layer, kind = parts[1], parts[2]
            prefix = f"model.layers.{layer}."
            if kind in GGUF_EXPERTS_TO_HF:  # (num_experts, out, in): one HF tensor per expert
                for e in range(shape[0]):
                    out.append(CheckpointTensor(f"{prefix}{GGUF_EXPERTS_TO_HF[kind].format(e)}.weight", shape[1:],
                                                _dense_reader(raw[e], qtype, kind, args)))
                continue
            if kind not in GGUF_LAYER_TO_HF:
                raise KeyError(f"GGUF tensor {t.name} is not a Llama/Mixtral tensor")
            name = prefix + GGUF_LAYER_TO_HF[kind] + ".weight"
            read = (_packed_reader(raw, qtype, kind, args, scale_dtype) if t.name in packed
                    else _dense_reader(raw, qtype, kind, args))
            out.append(CheckpointTensor(name, shape, read))
        elif parts[0] in GGUF_TOP_TO_HF:
            out.append(CheckpointTensor(GGUF_TOP_TO_HF[parts[0]] + ".weight", shape,
                                        _dense_reader(raw, qtype, parts[0], args)))
        else:
            raise KeyError(f"GGUF tensor {t.name} is not a Llama/Mixtral tensor")
    return out
