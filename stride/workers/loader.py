"""Weights from disk onto the device: HF checkpoint directories and GGUF files.

Both paths stream ``(hf_name, tensor)`` pairs into :meth:`Transformer.load_weight`, one tensor at a time, so
peak host memory is one tensor, not the checkpoint. GGUF tensors are dequantised to float32 with the
``gguf`` package and then cast to the run dtype; names are mapped to HF names and llama.cpp's Q/K row
permutation is undone, as transformers does when it loads a GGUF (so the two give the same model).

With ``w4a16`` (:func:`use_w4a16`: by default on CUDA with the triton backend) a GGUF's Q4_0/Q4_1 projections
(q/k/v, o, gate/up, down) are not dequantised: their modules become :class:`W4A16Linear` before anything is
allocated and get the blocks repacked 4-bit (``kernels/w4a16.py``); a merged projection only when every
checkpoint tensor in it is Q4. Embeddings, norms, the LM head and Mixtral's experts load as before.

With ``quantize`` (``stride serve --quantize w4a16[-g<N>]``) every other such projection of the checkpoint, 16/32-bit
or a GGUF type other than Q4, becomes a :class:`W4A16Linear` too and its tensors are quantised on the device as they
stream in (:func:`kernels.w4a16_format.quantize`: round to nearest, per group of N inputs, 128 by default); GGUF Q4
projections are kept as they are (groups of 32). So a 16-bit checkpoint runs on the 4-bit GEMM without a separate
conversion step, and the KV cache, sized after loading, gets the memory the weights no longer take.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from stride import env
from stride.model.files import default_model_path, is_gguf
from stride.workers.models import ModelArgs, Transformer, build_model
from stride.workers.models.layers import W4A16Linear

log = logging.getLogger(__name__)

ProgressCallback = Callable[[str, float], None]
"""``(message, fraction done in [0, 1])``: lets the worker process report loading to the launcher."""

GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
"""GGUF tensor types we dequantise (the ones tested); others are refused with their name."""

W4A16_TYPES = ("Q4_0", "Q4_1")
"""GGUF types the W4A16 GEMM takes as they are (a per-32 scale, and a min or the implied -8 * scale)."""

# Our projection (under "layers.N.") → the GGUF tensors (after "blk.N.") merged in it, in shard order.
_GGUF_PROJECTIONS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def use_w4a16(device_type: str, backend: str, setting: str = "") -> bool:
    """Whether the worker keeps GGUF Q4 projections 4-bit: ``setting`` (``WorkerConfig.w4a16``) when set, else
    only with the triton backend on CUDA (elsewhere the GEMM would run through Triton's interpreter, or not at
    all)."""
    if setting.strip():
        return setting.strip().lower() in ("1", "true", "yes", "on")
    return device_type == "cuda" and backend == "triton"


def read_model_args(path: str) -> ModelArgs:
    """Model shape of an HF checkpoint directory or a GGUF file, without loading weights."""
    if is_gguf(path):
        import gguf

        return _gguf_args(gguf.GGUFReader(path))
    return ModelArgs.from_hf_config(json.loads((Path(path) / "config.json").read_text()))


def load_model(
    path: str = "",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: ProgressCallback | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    w4a16: bool = False,
    quantize_group: int = 0,
) -> Transformer:
    """Build the model of ``path`` (empty: :func:`default_model_path`) on ``device`` in ``dtype`` and load its
    weights. Raises if a checkpoint tensor has no place in the model or a parameter was never loaded.
    ``w4a16``: keep a GGUF's Q4_0/Q4_1 projections packed (module docstring); ignored for other checkpoints.
    ``quantize_group`` > 0: quantise every other projection to 4 bits in groups of that many inputs (implies
    ``w4a16``)."""
    path = path or default_model_path()
    device = torch.device(device)
    w4a16 = w4a16 or quantize_group > 0
    packed: dict[str, str] = {}  # GGUF tensor → the W4A16Linear it loads into
    # float16 holds GGUF's fp16 scales exactly (bfloat16 would round them); float32 runs stay float32.
    scale_dtype = torch.float32 if dtype == torch.float32 else torch.float16
    if w4a16 and device.type != "cuda":
        # The 4-bit GEMM without CUDA runs in Triton's interpreter, which Triton reads as it is first imported:
        # before the model build, which can import it.
        env.TRITON_INTERPRET.set_default("1")
    if is_gguf(path):
        import gguf

        reader = gguf.GGUFReader(path)
        args = _gguf_args(reader)
        packed = _w4a16_projections(reader, args) if w4a16 else {}
        tensors, total = _gguf_tensors(reader, args, set(packed), scale_dtype), len(reader.tensors)
    else:
        args = read_model_args(path)
        tensors, total = _safetensors(Path(path))
    groups = dict.fromkeys(packed.values(), 32)  # module path → group size of its W4A16Linear
    quantized: set[str] = set()  # HF names of the tensors quantised as they load
    with torch.device("meta"):
        model = build_model(args, tp_rank, tp_size)
        if quantize_group:
            for proj, names in _quantizable(model, args).items():
                if proj not in groups:
                    groups[proj] = quantize_group
                    quantized.update(names)
        for module_path, group in sorted(groups.items()):
            dense = model.get_submodule(module_path)
            model.set_submodule(module_path, W4A16Linear.replacing(dense, scale_dtype, group))
    if packed:
        log.info("%d projections kept 4-bit (W4A16)", len(set(packed.values())))
    if quantized:
        log.info("%d projections quantised to 4 bits at load (W4A16, groups of %d)",
                 len(groups) - len(set(packed.values())), quantize_group)
        tensors = _quantizing(tensors, quantized, quantize_group, device, scale_dtype)
    _materialize(model, device, dtype)
    label = f"loading {os.path.basename(path.rstrip('/'))}"
    with tqdm(total=total, desc=label, unit="tensor", disable=None) as bar:
        for done, (name, tensor) in enumerate(tensors, 1):
            if isinstance(tensor, torch.Tensor):
                model.load_weight(name, tensor.to(device=device, dtype=dtype))
            else:  # a packed W4A16Weight: its dtypes stay
                parts = {f: getattr(tensor, f).to(device) for f in ("qweight", "scales", "mins")}
                model.load_weight(name, replace(tensor, **parts))
            bar.update(1)
            if progress is not None:
                progress(label, done / total)
    # Packed projections keep NaN in their scale buffers until loaded, as dense parameters do.
    missing = [
        n for n, p in chain(model.named_parameters(), model.named_buffers())
        if p.is_floating_point() and bool(torch.isnan(p).any())
    ]
    if missing:
        raise ValueError(f"{path}: parameters not in the checkpoint: {missing[:8]}")
    model.eval()
    return model


def _quantizable(model: Transformer, args: ModelArgs) -> dict[str, list[str]]:
    """Our dense projections (module path) → the HF tensor names merged in each, for :func:`quantize`. Models without
    a module (Mixtral's MLP is its experts, which stay dense) have no entry for it."""
    out: dict[str, list[str]] = {}
    for layer in range(args.num_layers):
        for module, kinds in _GGUF_PROJECTIONS.items():
            path = f"layers.{layer}.{module}"
            try:
                model.get_submodule(path)
            except AttributeError:
                continue
            out[path] = [f"model.layers.{layer}.{_GGUF_LAYER_NAMES[kind]}.weight" for kind in kinds]
    return out


def _quantizing(
    tensors: Iterator[tuple[str, Any]], names: set[str], group: int, device: torch.device, scale_dtype: torch.dtype
) -> Iterator[tuple[str, Any]]:
    """The stream with the tensors in ``names`` quantised on ``device`` (in float32, whatever the run dtype)."""
    from kernels.w4a16_format import quantize

    for name, tensor in tensors:
        if name in names:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name}: expected a dense tensor to quantise")
            yield name, quantize(tensor.to(device), group, scale_dtype)
        else:
            yield name, tensor


def _materialize(model: Transformer, device: torch.device, dtype: torch.dtype) -> None:
    """Replace the meta parameters by NaN-filled real ones (NaN marks "not loaded"), keeping ties; packed
    projections' buffers keep their dtypes (and their NaN scales)."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, W4A16Linear):
            for name, b in list(module._buffers.items()):
                assert b is not None
                fill = float("nan") if b.is_floating_point() else 0
                module._buffers[name] = torch.full(b.shape, fill, device=device, dtype=b.dtype)
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(
                    torch.full(p.shape, float("nan"), device=device, dtype=dtype), requires_grad=False
                )
            module._parameters[name] = made[id(p)]
    model.init_buffers(device)


def _safetensors(root: Path) -> tuple[Iterator[tuple[str, torch.Tensor]], int]:
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {root}")
    total = 0
    for f in files:
        with safe_open(str(root / f), framework="pt") as st:
            total += len(list(st.keys()))

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(str(root / f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)

    return stream(), total


# GGUF name (after "blk.N.") → HF name (after "model.layers.N.").
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "block_sparse_moe.gate",
}
_GGUF_EXPERT_NAMES = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _gguf_args(reader: Any) -> ModelArgs:
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


def _w4a16_projections(reader: Any, args: ModelArgs) -> dict[str, str]:
    """GGUF tensor name → our module path, for the projections whose every merged tensor is Q4_0/Q4_1."""
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    out: dict[str, str] = {}
    for layer in range(args.num_layers):
        for module, kinds in _GGUF_PROJECTIONS.items():
            names = [f"blk.{layer}.{kind}.weight" for kind in kinds]
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


def _gguf_tensors(
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
            if kind in _GGUF_EXPERT_NAMES:  # (num_experts, out, in): one HF tensor per expert
                data = _dequantized(t)
                for e in range(data.shape[0]):
                    name = f"{prefix}block_sparse_moe.experts.{e}.{_GGUF_EXPERT_NAMES[kind]}.weight"
                    yield name, _to_torch(data[e])
                continue
            if kind not in _GGUF_LAYER_NAMES:
                raise KeyError(f"GGUF tensor {t.name} is not a Llama/Mixtral tensor")
            name = prefix + _GGUF_LAYER_NAMES[kind] + ".weight"
            if t.name in packed:
                yield name, _packed_q4(t, kind, args, scale_dtype)
                continue
            yield name, _to_torch(_unpermute_gguf(kind, _dequantized(t), args))
        elif parts[0] in _GGUF_TOP_NAMES:
            yield _GGUF_TOP_NAMES[parts[0]] + ".weight", _to_torch(_dequantized(t))
        else:
            raise KeyError(f"GGUF tensor {t.name} is not a Llama/Mixtral tensor")
