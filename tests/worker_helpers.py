"""Shared by the worker tests: a :class:`ModelRunner` from the handful of settings a test varies; random checkpoints
of real shapes, and a GGUF written from one the way llama.cpp converts; a fixed schedule of mixed steps to replay on
any runner; the GPU/CPU-interpreter markers."""

from __future__ import annotations

import json
import runpy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from stride.config import WorkerConfig
from stride.model.tensor_names import GGUF_EXPERTS_TO_HF, GGUF_LAYER_TO_HF
from stride.workers.runner import ModelRunner, RunnerConfig

ROOT = Path(__file__).resolve().parents[1]
_RUNNER_FIELDS = {"block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len"}


def make_runner(model: str, *, progress: Any = None, memory_utilization: float | None = None,
                **settings: Any) -> ModelRunner:
    """``ModelRunner`` of ``model``: keywords naming :class:`RunnerConfig` fields go there, the rest to
    :class:`WorkerConfig` (``device``, ``dtype``, ``attention_backend``, ``cuda_graphs``, ``quantize``...)."""
    runner_kw = {k: settings.pop(k) for k in list(settings) if k in _RUNNER_FIELDS}
    if settings.get("device") == "cpu":
        settings.setdefault("dtype", "float32")  # the tests' references are float32 (the served CPU default may not be)
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


def write_gguf(hf: Path, out: Path, qtype: str = "F32", qtypes: dict[str, str] | None = None) -> Path:
    """Convert the tiny HF checkpoint to GGUF the way llama.cpp does (names, permuted q/k, quantised matrices,
    Mixtral's experts stacked per layer); ``qtypes`` gives some GGUF tensors another type than ``qtype``."""
    cfg = json.loads((hf / "config.json").read_text())
    weights = load_file(str(hf / "model.safetensors"))
    make = runpy.run_path(str(ROOT / "scripts" / "make_random_gguf.py"), run_name="make_gguf")
    w = make["llama_writer"](cfg, str(out))
    names = {v: k for k, v in GGUF_LAYER_TO_HF.items()}
    experts = cfg.get("num_local_experts", 0)
    if experts:  # llama.cpp writes Mixtral as a llama with experts, each layer's in one (experts, out, in) tensor
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        for layer in range(cfg["num_hidden_layers"]):
            for kind, hf in GGUF_EXPERTS_TO_HF.items():
                key = f"model.layers.{layer}.{hf}.weight"
                weights[f"blk.{layer}.{kind}.weight"] = torch.stack([weights.pop(key.format(e))
                                                                    for e in range(experts)])
    for name, t in weights.items():
        a = t.numpy()
        if name.startswith("blk."):
            gname = name
        elif name.startswith("model.layers."):
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
        kind = (qtypes or {}).get(gname, qtype)
        if a.ndim >= 2 and kind != "F32":
            q = gguf.GGMLQuantizationType[kind]
            w.add_tensor(gname, gguf.quants.quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
cpu_triton = pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton kernels on CPU tensors need the "
                                "interpreter, which conftest.py turns on only where CUDA is absent")


def make_checkpoint(
    preset: str, out: Path, dtype: torch.dtype, num_layers: int = 0, device: str = "cpu", **config: Any
) -> Path:
    """A random checkpoint of ``preset``'s shape; ``config`` overrides fields of its config.json."""
    make = runpy.run_path(str(ROOT / "scripts" / "make_random_checkpoint.py"), run_name="make_checkpoint")
    cfg = dict(make["PRESETS"][preset], **config)
    if num_layers:
        cfg["num_hidden_layers"] = num_layers
    return Path(make["write_checkpoint"](cfg, out, dtype, seed=5, device=device))


class Steps:
    """A fixed schedule of mixed steps over shuffled blocks, replayable on any runner.

    Three sequences: A (prefill 20), B (prefill 37 in two chunks), C (prefill 9, joins late); decodes of
    the running ones ride in the same steps as the chunks; the last steps are decode-only.
    """

    def __init__(self, num_blocks: int, block_size: int, vocab: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.tables = rng.permutation(num_blocks)[: 3 * 12].astype(np.int32).reshape(3, 12)
        self.block_size = block_size
        self.prompts = [rng.integers(0, vocab, n) for n in (20, 37, 9)]
        # Each step: (slot, number of new tokens) per sequence; a decode is 1 token.
        self.schedule = [
            [(0, 20), (1, 16)],
            [(0, 1), (1, 21)],
            [(0, 1), (1, 1), (2, 9)],
            [(0, 1), (1, 1), (2, 1)],
            [(2, 1), (0, 1), (1, 1)],
        ]
        self.extra = rng.integers(0, vocab, 64)

    def run(self, runner: ModelRunner, context_shift: int = 0) -> list[torch.Tensor]:
        """Logits of every step. ``context_shift`` (negative control) moves every decode that many positions
        back: it overwrites an earlier key and attends to only the keys before it (the prompt stays whole)."""
        lengths = [0, 0, 0]
        out = []
        self.graphed: list[bool] = []
        """Per step of the last run: whether the runner replayed a decode graph for it."""
        for step in self.schedule:
            ids, pos, slots, q_lens, ctx = [], [], [], [], []
            for slot, n in step:
                prompt = self.prompts[slot]
                lo = lengths[slot]
                k = lo - len(prompt)
                new = prompt[lo : lo + n] if k < 0 else self.extra[k : k + n]
                ids.append(new)
                start = lo - context_shift if n == 1 else lo
                pos.append(np.arange(start, start + n))
                lengths[slot] += n
                slots.append(slot)
                q_lens.append(n)
                ctx.append(start + n)
            out.append(
                runner.forward(
                    np.concatenate(ids).astype(np.int32),
                    np.concatenate(pos).astype(np.int32),
                    np.array(slots, np.int32),
                    np.array(q_lens, np.int32),
                    np.array(ctx, np.int32),
                    self.tables,
                )
            )
            self.graphed.append(runner.last_step_graphed)
        return out


def count_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> dict[str, int]:
    """Count calls of ``module.name`` (a function looked up through ``module`` at call time)."""
    calls = {"n": 0}
    real: Callable[..., Any] = getattr(module, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return calls


def tp_rank_main(rank: int, size: int, init_file: str, model: str, out_dir: str, corrupt: bool = False) -> None:
    """One rank of a tensor-parallel runner over ``model`` (gloo, file rendezvous) running the fixed :class:`Steps`
    schedule; rank 0 saves every step's logits and every layer's output, in call order, to ``out_dir/tp{size}.pt``.
    With ``corrupt``, rank 1 reverses its slice of layer 0's attention-output columns: a wrong shard, the negative
    control. (Top-level, so ``torch.multiprocessing.spawn`` can start it.)"""
    from stride.workers.parallel import TensorParallel, exit_spawned_rank

    torch.set_num_threads(1)
    tp = TensorParallel.init(rank, size, f"file://{init_file}")
    try:
        worker = WorkerConfig(model=model, device="cpu", dtype="float32", attention_backend="torch",
                              tensor_parallel_size=size)
        runner = ModelRunner(RunnerConfig(worker, num_blocks=40, block_size=4, tp_rank=rank), tp=tp)
        if corrupt and rank == 1:
            w = runner.model.layers[0].self_attn.o_proj.weight
            w.data.copy_(w.data.flip(1))
        layers: list[torch.Tensor] = []

        def record(_m: Any, _i: Any, out: tuple[torch.Tensor, torch.Tensor]) -> None:
            layers.append((out[0] + out[1]).detach().clone())  # a layer's output: its MLP's plus the residual

        for block in runner.model.layers:
            block.register_forward_hook(record)
        logits = Steps(40, 4, runner.args.vocab_size).run(runner)
        if rank == 0:
            torch.save({"logits": logits, "layers": layers}, f"{out_dir}/tp{size}.pt")
    finally:
        tp.destroy()
    exit_spawned_rank()


def exit_then_write(path: str) -> None:
    """``exit_spawned_rank``, then a file written: it exists only where the call returned. (Top-level, for spawn.)"""
    from stride.workers.parallel import exit_spawned_rank

    exit_spawned_rank()
    with open(path, "w") as fh:
        fh.write("went on")
