"""Weights from disk onto the device: HF checkpoint directories (:mod:`stride.workers.hf_checkpoint`) and GGUF files
(:mod:`stride.workers.gguf_checkpoint`), with projections quantised as they load where asked
(:mod:`stride.workers.quantize_at_load`).

Both give the checkpoint's tensors as :class:`~stride.workers.checkpoint.CheckpointTensor` s, read by region from
their memory-mapped files. For each, the module it loads into (:meth:`Transformer.target`) names the region this
tensor-parallel rank holds; only that is read, cast to the run dtype, and stored. So a rank reads about 1/N of every
split weight (the norms and Mixtral's router are whole on every rank), and peak host memory is one tensor's part,
not the checkpoint. :class:`LoadReport` counts what was read.

With ``w4a16`` (:func:`use_w4a16`: by default on CUDA with the triton backend) a GGUF's Q4_0/Q4_1 projections
(q/k/v, o, gate/up, down) are not dequantised: their modules become :class:`W4A16Linear` before anything is
allocated and get the blocks repacked 4-bit (``stride/kernels/w4a16.py``); a merged projection only when every
checkpoint tensor in it is Q4. Embeddings, norms, the LM head and Mixtral's experts load as before.

With ``quantize`` (``stride serve --quantize w4a16[-g<N>]``) every other such projection of the checkpoint, 16/32-bit
or a GGUF type other than Q4, becomes a :class:`W4A16Linear` too and its tensors are quantised on the device as they
stream in (:func:`stride.kernels.w4a16_format.quantize`: round to nearest, per group of N inputs, 128 by default); GGUF
Q4 projections are kept as they are (groups of 32). So a 16-bit checkpoint runs on the 4-bit GEMM without a separate
conversion step, and the KV cache, sized after loading, gets the memory the weights no longer take.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path

import torch
from tqdm import tqdm

from stride import env
from stride.model.files import default_model_path, is_gguf
from stride.model.gguf import read_gguf
from stride.workers.checkpoint import Part
from stride.workers.gguf_checkpoint import gguf_args, gguf_tensors, w4a16_projections
from stride.workers.hf_checkpoint import safetensors_tensors
from stride.workers.models import ModelArgs, Transformer, build_model
from stride.workers.models.layers import W4A16Linear
from stride.workers.quantize_at_load import quantizable, quantizing

log = logging.getLogger(__name__)

ProgressCallback = Callable[[str, float], None]
"""``(message, fraction done in [0, 1])``: lets the worker process report loading to the launcher."""

@dataclass
class LoadReport:
    """What a load read from disk: elements of the checkpoint's (dense) tensors, of all it holds."""

    elements_read: int = 0
    elements_total: int = 0


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
        return gguf_args(read_gguf(path))
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
    report: LoadReport | None = None,
) -> Transformer:
    """Build the model of ``path`` (empty: :func:`default_model_path`) on ``device`` in ``dtype`` and load its
    weights. Raises if a checkpoint tensor has no place in the model or a parameter was never loaded.
    ``w4a16``: keep a GGUF's Q4_0/Q4_1 projections packed (module docstring); ignored for other checkpoints.
    ``quantize_group`` > 0: quantise every other projection to 4 bits in groups of that many inputs (implies
    ``w4a16``). ``report``: filled with what was read."""
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
        reader = read_gguf(path)
        args = gguf_args(reader)
        packed = w4a16_projections(reader, args) if w4a16 else {}
        tensors = gguf_tensors(reader, args, set(packed), scale_dtype)
    else:
        args = read_model_args(path)
        tensors = safetensors_tensors(Path(path))
    groups = dict.fromkeys(packed.values(), 32)  # module path → group size of its W4A16Linear
    quantized: set[str] = set()  # HF names of the tensors quantised as they load
    with torch.device("meta"):
        model = build_model(args, tp_rank, tp_size)
        if quantize_group:
            for proj, names in quantizable(model, args).items():
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
        tensors = quantizing(tensors, quantized, quantize_group, device, scale_dtype)
    _materialize(model, device, dtype)
    label = f"loading {os.path.basename(path.rstrip('/'))}"
    report = report if report is not None else LoadReport()
    with tqdm(total=len(tensors), desc=label, unit="tensor", disable=None) as bar:
        for done, tensor in enumerate(tensors, 1):
            report.elements_total += tensor.numel(None)
            target = model.target(tensor.name)
            if target is not None:
                module, shard = target
                region = module.region(shard, tensor.shape)
                module.load_part(_onto(tensor.read(region), device, dtype), shard)
                report.elements_read += tensor.numel(region)
            bar.update(1)
            if progress is not None:
                progress(label, done / len(tensors))
    if tp_size > 1:
        log.info("rank %d/%d read %.3g of the checkpoint's %.3g elements (%.0f%%)", tp_rank, tp_size,
                 report.elements_read, report.elements_total, 100 * report.elements_read / report.elements_total)
    # Packed projections keep NaN in their scale buffers until loaded, as dense parameters do.
    missing = [
        n for n, p in chain(model.named_parameters(), model.named_buffers())
        if p.is_floating_point() and bool(torch.isnan(p).any())
    ]
    if missing:
        raise ValueError(f"{path}: parameters not in the checkpoint: {missing[:8]}")
    model.eval()
    return model


def _onto(part: Part, device: torch.device, dtype: torch.dtype) -> Part:
    """A part read from disk on ``device``: dense ones in the run dtype, packed ones keeping their dtypes."""
    if isinstance(part, torch.Tensor):
        return part.to(device=device, dtype=dtype)
    return replace(part, **{f: getattr(part, f).to(device) for f in ("qweight", "scales", "mins")})


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




