"""Loading: GGUF (llama.cpp's Q/K permutation undone, quantised types dequantised) gives the same model as
the HF checkpoint it was converted from; missing or unknown tensors are refused; progress is reported."""

from __future__ import annotations

import dataclasses
import json
import runpy
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from worker_helpers import write_gguf

from stride.workers import gguf_checkpoint
from stride.workers.loader import load_model, read_model_args

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    make = runpy.run_path(str(ROOT / "scripts" / "make_random_checkpoint.py"), run_name="make_checkpoint")
    cfg = dict(make["PRESETS"]["tiny-llama"], rope_scaling=None)  # GGUF has no llama3 parameters
    return make["write_checkpoint"](cfg, tmp_path_factory.mktemp("hf"), torch.float32, seed=5)


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    from stride.workers.attention import AttentionContext, AttentionMetadata, TorchPagedAttention
    from stride.workers.kv_cache import KVCache

    cache = KVCache(model.args, 8, 16, "cpu", torch.float32)  # type: ignore[arg-type]
    n = len(ids)
    meta = AttentionMetadata.build(
        torch.arange(n), np.array([n]), np.array([n]), torch.arange(8, dtype=torch.int32)[None], 16
    )
    with torch.inference_mode():
        hidden = model(
            torch.tensor(ids),
            torch.arange(n),
            AttentionContext(meta, TorchPagedAttention(), cache.k_caches, cache.v_caches),
        )
        return model.compute_logits(hidden)  # type: ignore[operator]


IDS = list(range(3, 90, 2))


def test_gguf_f32_equals_hf_checkpoint(hf_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(hf_dir, tmp_path / "m.gguf")
    from_gguf, from_hf = read_model_args(str(path)), read_model_args(str(hf_dir))
    # GGUF keeps eps as float32 and, here, no tokenizer ids; everything else must agree.
    assert from_gguf == dataclasses.replace(
        from_hf, rms_norm_eps=from_gguf.rms_norm_eps, bos_token_id=None, eos_token_ids=()
    )
    ref = _logits(load_model(str(hf_dir)), IDS)
    assert (_logits(load_model(str(path)), IDS) - ref).abs().max().item() <= 1e-5


def test_gguf_without_unpermute_differs(
    hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Negative control: skipping the un-permutation loads a different (wrong) model.
    path = write_gguf(hf_dir, tmp_path / "m.gguf")
    ref = _logits(load_model(str(hf_dir)), IDS)
    monkeypatch.setattr(gguf_checkpoint, "unpermute_qk", lambda w, n: w)
    assert (_logits(load_model(str(path)), IDS) - ref).abs().max().item() > 1e-3


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_quantised_types_dequantise(hf_dir: Path, tmp_path: Path, qtype: str) -> None:
    path = write_gguf(hf_dir, tmp_path / f"m-{qtype}.gguf", qtype)
    model = load_model(str(path))
    w = load_file(str(hf_dir / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    expected = gguf.quants.dequantize(
        gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype]), gguf.GGMLQuantizationType[qtype]
    )
    assert torch.equal(model.layers[1].mlp.down_proj.weight, torch.from_numpy(expected).float())
    err = (model.layers[1].mlp.down_proj.weight - w).abs().max().item()
    assert 0 < err < {"F16": 1e-4, "BF16": 1e-3, "Q8_0": 1e-3}.get(qtype, 2e-2)


def test_missing_and_unknown_tensors_are_refused(hf_dir: Path, tmp_path: Path) -> None:
    weights = load_file(str(hf_dir / "model.safetensors"))
    for f in ("config.json", "tokenizer.json"):
        (tmp_path / f).write_text((hf_dir / f).read_text())
    save_file(
        {k: v for k, v in weights.items() if "layers.2.mlp.up_proj" not in k},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(ValueError, match="not in the checkpoint"):
        load_model(str(tmp_path))
    save_file(
        {**weights, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(KeyError, match="no place"):
        load_model(str(tmp_path))


def test_progress_callback_and_tied_embeddings(hf_dir: Path, tmp_path: Path) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    weights = load_file(str(hf_dir / "model.safetensors"))
    save_file(
        {k: v for k, v in weights.items() if k != "lm_head.weight"}, str(tmp_path / "model.safetensors")
    )
    seen: list[float] = []
    model = load_model(str(tmp_path), progress=lambda msg, frac: seen.append(frac))
    assert seen == sorted(seen) and seen[-1] == 1.0 and len(seen) == len(weights) - 1
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, weights["model.embed_tokens.weight"])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_random_gguf_quantiser_matches_gguf(qtype: str) -> None:
    # scripts/make_random_gguf.py quantises in torch (on the GPU there); its blocks must be gguf-py's bytes.
    make = runpy.run_path(str(ROOT / "scripts" / "make_random_gguf.py"), run_name="make_gguf")
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(2)) * 0.02
    w[3, :32] = 0.0  # a constant block (zero scale)
    want = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
    got = make["quantise_q4"](w, qtype)
    assert got.dtype == np.uint8 and got.shape == want.shape
    assert np.array_equal(got, want)
    # Negative control: codes rounded down instead of to nearest are other bytes.
    assert not np.array_equal(make["quantise_q4"](w - 0.3 * w.abs().amax() / 15, qtype), want)


@pytest.mark.parametrize("tied", [True, False])
def test_random_gguf_of_a_tied_preset_has_no_output_matrix(tmp_path: Path, tied: bool) -> None:
    """scripts/make_random_gguf.py writes a tied preset (smollm2-135m's shape) the way SmolLM2's own GGUF is
    written: no output.weight, the head reads token_embd; an untied one has its own head."""
    make = runpy.run_path(str(ROOT / "scripts" / "make_random_gguf.py"), run_name="make_gguf")
    cfg = dict(make["PRESETS"]["smollm2-135m"], num_hidden_layers=1, vocab_size=64, tie_word_embeddings=tied)
    out = tmp_path / "m.gguf"
    make["write_gguf"](cfg, str(out), "Q4_1", 0, "cpu")
    names = {t.name for t in gguf.GGUFReader(str(out)).tensors}
    assert ("output.weight" in names) != tied and "token_embd.weight" in names
    model = load_model(str(out))
    assert model.args.tie_word_embeddings == tied
    shared = model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert shared == tied


def test_weights_that_cannot_fit_are_refused_before_loading() -> None:
    """The check the runner makes on a GPU before it loads anything: the planner's weight bytes per rank against
    the device's free memory (catalog shapes: nothing is read but the config)."""
    from stride.workers.runner import refuse_weights_that_cannot_fit

    free = 126 * 2**30  # an H200 at 0.9 of its memory, nothing held yet
    with pytest.raises(MemoryError, match=r"131\.4 GiB per rank \(bf16, tp=1\) but 126\.0 GiB"):
        refuse_weights_that_cannot_fit("llama-3.1-70b", torch.bfloat16, 0, False, 1, free)
    with pytest.raises(MemoryError):  # the GPU's 4-bit default keeps only a GGUF's Q4 blocks: a 16-bit checkpoint
        refuse_weights_that_cannot_fit("llama-3.1-70b", torch.bfloat16, 0, True, 1, free)  # stays 16-bit
    refuse_weights_that_cannot_fit("llama-3.1-70b", torch.bfloat16, 0, False, 2, free)  # half on each of two
    refuse_weights_that_cannot_fit("llama-3.1-70b", torch.bfloat16, 128, True, 1, free)  # 4-bit at load
    refuse_weights_that_cannot_fit("llama-3.1-8b", torch.bfloat16, 0, False, 1, free)
    with pytest.raises(MemoryError, match="float32"):  # float32 holds twice the bytes
        refuse_weights_that_cannot_fit("llama-3.1-8b", torch.float32, 0, False, 1, 20 * 2**30)


def test_a_random_checkpoint_can_carry_a_real_tokenizer(tmp_path: Path) -> None:
    """``make_random_checkpoint.py --tokenizer-from``: the SmolLM2 GGUF's tokenizer, template and end ids replace
    the byte-level tokenizer (control: without it the checkpoint has the 258-token one)."""
    from stride.model.files import default_model_path
    from stride.tokenizer.loader import load_tokenizer

    root = Path(__file__).resolve().parents[2]
    make = runpy.run_path(str(root / "scripts" / "make_random_checkpoint.py"), run_name="make_checkpoint")
    cfg = dict(make["PRESETS"]["smollm2-135m"], num_hidden_layers=1)
    plain = make["write_checkpoint"](cfg, tmp_path / "plain", torch.float32, seed=1)
    assert load_tokenizer(plain).tokenizer.get_vocab_size() == 258
    real = make["write_checkpoint"](cfg, tmp_path / "real", torch.float32, seed=1)
    make["copy_tokenizer"](default_model_path(), real, cfg["vocab_size"])
    want, got = load_tokenizer(default_model_path()), load_tokenizer(real)
    assert got.tokenizer.encode("Hello there!").ids == want.tokenizer.encode("Hello there!").ids
    assert got.eos_token_ids == want.eos_token_ids and got.chat_template == want.chat_template
    assert read_model_args(real).eos_token_ids == want.eos_token_ids
    with pytest.raises(ValueError, match="tokens; the preset"):
        make["copy_tokenizer"](default_model_path(), plain, 1000)
