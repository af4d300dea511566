"""``stride diagnose``: clean pairs report no divergence; a fault planted in layer k is reported at layer k; the
JSON report keeps its documented keys; bad SPECs are refused with the setting named."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diagnose_helpers import (
    dropped_w4a16_scale,
    kv_written_one_slot_off,
    rope_with_wrong_base,
    swapped_attention_output_shards,
)
from worker_helpers import make_checkpoint

from stride.diagnose.compare import REPORT_VERSION, compare, diagnose, plot
from stride.diagnose.runs import Capture, Schedule, StepCapture
from stride.diagnose.spec import RunSpec, band, band_at, near_tie
from stride.model.files import default_model_path

LAYERS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("tiny-llama", tmp_path_factory.mktemp("diag"), torch.float32, num_layers=LAYERS))


def _schedule(vocab: int = 320) -> Schedule:
    rng = np.random.default_rng(3)
    return Schedule(tuple(tuple(int(x) for x in rng.integers(0, vocab, n)) for n in (11, 7)), decode_steps=3)


def _smollm2() -> str:
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.mark.slow
@pytest.mark.parametrize("a, b", [("tp=3", "tp=1"), ("tp=1", "hf")])
def test_clean_pairs_report_no_divergence(a: str, b: str) -> None:
    """Three ranks against one, and Stride against transformers, on SmolLM2 in float32."""
    if b == "hf":
        pytest.importorskip("transformers")
    model = _smollm2()
    from stride.tokenizer.loader import load_tokenizer

    tok = load_tokenizer(model)
    schedule = Schedule((tuple(tok.encode("The capital of France is")), tuple(tok.encode("def add(a, b):"))), 3)
    report = diagnose(RunSpec.parse(a), RunSpec.parse(b), model, schedule)
    assert report.first_divergent is None, report.text()
    assert not [f for f in report.flips if not f.near_tie], report.text()
    assert len(report.points) == 2 * 30 + 1 and report.unobserved == []
    # Not a vacuous pass: the two runs differ (rounding), just within the band.
    assert max(p.rel for p in report.points) > 0 and all(p.rel <= p.band for p in report.points)


FAULTS = {
    "attention output shards swapped": ("tp=2", "tp=1", swapped_attention_output_shards),
    "RoPE base wrong": ("tp=1", "tp=1", rope_with_wrong_base),
    "KV written to the wrong slot": ("tp=1", "tp=1", kv_written_one_slot_off),
    "W4A16 scale dropped": ("quantize=w4a16-g16", "quantize=w4a16-g16", dropped_w4a16_scale),
    "attention output shards swapped, 8-bit K/V": ("tp=2,kv=fp8", "tp=1,kv=fp8", swapped_attention_output_shards),
}


@pytest.mark.parametrize("layer", [1, 2])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_planted_fault_is_found_at_its_layer(tiny: str, fault: str, layer: int) -> None:
    a, b, plant = FAULTS[fault]
    prepare: Any = functools.partial(plant, tiny) if plant is swapped_attention_output_shards else plant
    report = diagnose(RunSpec.parse(a), RunSpec.parse(b), tiny, _schedule(), functools.partial(prepare, layer=layer))
    found = report.first_divergent
    assert found is not None, report.text()
    assert (found.layer, found.where) == (layer, "attention"), report.text()
    # Every point before it is within the band: the fault is where it was put, not inherited from earlier.
    assert all(p.rel <= p.band for p in report.points[: 2 * layer]), report.text()
    assert report.diverged


def test_the_same_pair_without_the_fault_is_clean(tiny: str) -> None:
    """Control for the planted faults: the pairs they use, unbroken, report nothing."""
    for a, b, _ in FAULTS.values():
        report = diagnose(RunSpec.parse(a), RunSpec.parse(b), tiny, _schedule())
        assert report.first_divergent is None and not report.flips, report.text()


def test_an_8bit_cache_against_a_float32_one_stays_in_its_band(tiny: str) -> None:
    """``kv=fp8`` against the run dtype's cache: off by the 8-bit rounding (well past float32's band, so the pair is
    not vacuously equal), inside the 8-bit band."""
    report = diagnose(RunSpec.parse("kv=fp8"), RunSpec(), tiny, _schedule())
    assert report.first_divergent is None, report.text()
    assert max(p.rel for p in report.points) > 100 * 2e-6, report.text()


def _capture(label: str, rel_noise: float, chosen: list[list[int]], margins: list[list[float]],
             jump_at: int | None = None) -> Capture:
    """A synthetic capture of 3 layers: the reference's states scaled by (1 + noise) per point."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64)
    cap = Capture(label, 3, chosen=chosen, margins=margins)
    if rel_noise:
        attn, mlp = base.clone(), base.clone()
        for layer in range(3):
            scale = rel_noise * (50 if jump_at is not None and layer >= jump_at else 1)
            attn[layer] *= 1 + scale
            mlp[layer] *= 1 + scale
    else:
        attn, mlp = base, base
    cap.steps.append(StepCapture("prefill", torch.ones(2, 4), attn, mlp))
    return cap


def test_the_verdict_rules() -> None:
    """Band, jump and flip rules on synthetic captures, each with the case just on the other side (the band starts
    at 1e-5 and widens by that every 8 points)."""
    ref = _capture("b", 0.0, [[1, 2]], [[0.5, 1e-4]])
    inside = compare(_capture("a", 2e-6, [[1, 2]], [[0, 0]]), ref, 1e-5, 1e-3)
    assert inside.first_divergent is None and not inside.diverged
    past = compare(_capture("a", 2e-5, [[1, 2]], [[0, 0]]), ref, 1e-5, 1e-3)
    assert past.first_divergent is not None and past.first_divergent.name == "layer 0 attention"
    # A jump of 50x at layer 2 (point 4, band 1.5e-5), still under the band: below a third of the band it is rounding
    # noise (5e-8 to 2.5e-6); past it (1.4e-7 to 7e-6), a divergence by growth.
    jumped = compare(_capture("a", 5e-8, [[1, 2]], [[0, 0]], jump_at=2), ref, 1e-5, 1e-3)
    assert jumped.first_divergent is None, jumped.text()
    jumped = compare(_capture("a", 1.4e-7, [[1, 2]], [[0, 0]], jump_at=2), ref, 1e-5, 1e-3)
    assert jumped.first_divergent is not None and jumped.first_divergent.name == "layer 2 attention", jumped.text()
    assert "grew" in jumped.reason
    # Flips: sequence 1's reference margin 1e-4 is a near tie, sequence 0's 0.5 is not.
    flips = compare(_capture("a", 0.0, [[7, 9]], [[0, 0]]), ref, 1e-5, 1e-3).flips
    assert [(f.sequence, f.near_tie) for f in flips] == [(0, False), (1, True)]
    # NaN states diverge (a NaN comparison is False both ways).
    nan = _capture("a", 0.0, [[1, 2]], [[0, 0]])
    assert nan.steps[0].attention is not None
    nan.steps[0].attention[1, 0, 0] = math.nan
    assert compare(nan, ref, 1e-5, 1e-3).first_divergent.name == "layer 1 attention"  # type: ignore[union-attr]


def test_specs_and_bands() -> None:
    assert RunSpec.parse("tp=3,backend=triton,dtype=bfloat16") == RunSpec(tp=3, backend="triton", dtype="bfloat16")
    assert RunSpec.parse("hf").hf and RunSpec.parse("hf,dtype=bfloat16").dtype == "bfloat16"
    assert RunSpec.parse("graphs=on,quantize=w4a16").label() == "quantize=w4a16,graphs=on"
    for bad, word in (("tp=0", "tp"), ("color=red", "unknown setting"), ("hf,tp=2", "hf takes only"),
                      ("quantize=w3", "quantize"), ("graphs=yes", "graphs"), ("dtype=int8", "dtype"),
                      ("kv=int4", "kv must be"), ("hf,kv=fp8", "hf takes only")):
        with pytest.raises(ValueError, match=word):
            RunSpec.parse(bad)
    f32, bf16 = RunSpec(), RunSpec(dtype="bfloat16")
    assert band(f32, f32) == 2e-6 and band(bf16, f32) == 1e-2
    q4 = RunSpec(quantize="w4a16")
    assert band(q4, f32) == 0.1 and band(q4, q4) == 2e-6
    fp8 = RunSpec.parse("kv=fp8")
    assert fp8 == RunSpec(kv="fp8") and fp8.label() == "kv=fp8" and RunSpec.parse("kv=auto") == f32
    assert band(fp8, f32) == 0.05 and band(fp8, fp8) == 1e-2 and band(fp8, RunSpec(kv="fp8", dtype="bfloat16")) == 1e-2
    assert band_at(1e-2, 0) == 1e-2 and band_at(1e-2, 8) == 2e-2
    assert near_tie(2e-6) == 1e-3 and near_tie(1e-2) == 0.1


def test_json_report_and_plot(tiny: str, tmp_path: Path) -> None:
    """The command's JSON has the documented keys (docs/diagnose.md); exit 0 for a clean pair; the plot is a PNG."""
    png = tmp_path / "rel.png"
    out = subprocess.run([sys.executable, "-m", "stride", "diagnose", "--model", tiny, "--a", "tp=1,backend=torch",
                          "--b", "tp=1", "--prompt-ids", "1,2,3,4,5,6", "--decode-steps", "2", "--json",
                          *(["--plot", str(png)] if _has_matplotlib() else [])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert set(report) == {"version", "a", "b", "band", "points", "first_divergent", "flips", "unobserved_steps",
                           "diverged"}
    assert report["version"] == REPORT_VERSION and report["first_divergent"] is None and not report["diverged"]
    assert set(report["band"]) == {"rel", "depth_scale", "near_tie", "jump"}
    assert [p["name"] for p in report["points"]][:3] == ["layer 0 attention", "layer 0 mlp", "layer 1 attention"]
    assert set(report["points"][0]) == {"name", "layer", "where", "tokens", "max_abs", "rel", "min_cos", "growth",
                                        "band"}
    assert report["points"][-1]["name"] == "logits" and len(report["points"]) == 2 * LAYERS + 1
    if _has_matplotlib():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "stride", "diagnose", "--model", tiny, "--a", "tp=x", "--b", "tp=1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "tp must be a positive integer" in bad.stderr


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_plot_marks_the_divergent_point(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    ref = _capture("b", 0.0, [[1, 2]], [[0.5, 0.5]])
    report = compare(_capture("a", 1e-3, [[1, 2]], [[0, 0]]), ref, 1e-5, 1e-3)
    plot(report, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
