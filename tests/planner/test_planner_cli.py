"""`stride plan`: JSON keys, exit status on refusal, human output in GiB/KiB, routing through stride.launch.cli."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from stride.planner import cli

KEYS = {"model", "params_total", "params_active", "kv_bytes_per_token", "weights_bytes_per_rank",
        "kv_cache_bytes_per_rank", "num_blocks", "block_size", "tokens_total", "concurrency", "refused",
        "reason"}


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    rc = cli.main(parser.parse_args(list(argv)))
    return rc, capsys.readouterr().out


def test_json_plan_that_fits(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(capsys, "--model", "llama-3.1-70b", "--gpu", "H100-SXM-80GB", "--tp", "4", "--json")
    data = json.loads(out)
    assert rc == 0 and KEYS <= data.keys()
    assert data["refused"] is False and data["reason"] == ""
    assert data["kv_bytes_per_token"] == 320 * 1024
    assert data["tokens_total"] == data["num_blocks"] * data["block_size"] > 0
    assert set(data["concurrency"]) == {"4096", "32768"}
    assert data["concurrency"]["4096"] > data["concurrency"]["32768"] > 0


def test_json_refusal_exits_nonzero(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(capsys, "--model", "llama-3.1-70b", "--gpu", "H100-SXM-80GB", "--json")
    data = json.loads(out)
    assert rc == 1 and data["refused"] is True
    assert "GiB per rank" in data["reason"] and "quantize" in data["reason"]


def test_human_output_units_and_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(capsys, "--model", "llama-3.1-8b", "--gpu", "H100-SXM-80GB")
    assert rc == 0 and "128.0 KiB" in out and "GiB" in out and "REFUSED" not in out
    rc, out = _run(capsys, "--model", "llama-3.1-8b", "--gpu", "H100-SXM-80GB", "--tp", "3")
    assert rc == 1 and "REFUSED" in out and "not divisible by tp=3" in out
    rc, out = _run(capsys, "--model", "mixtral-8x7b", "--gpu-mem-gib", "24", "--weights", "gguf-q4_0")
    assert rc == 1 and "raise tensor or pipeline parallelism" in out


def test_human_output_names_the_graph_and_scratch_reserves(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(capsys, "--model", "llama-3.1-8b", "--gpu", "H200-141GB", "--weights", "gguf-q4_1")
    assert rc == 0 and "expansion scratch" in out and "decode graphs       0.4 GiB" in out
    rc, out = _run(capsys, "--model", "llama-3.1-8b", "--gpu", "H200-141GB", "--enforce-eager")
    assert rc == 0 and "expansion scratch" not in out and "decode graphs       0.0 GiB (eager decode)" in out


def test_catalog_without_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(capsys)
    assert rc == 0
    for name in cli.CATALOG:
        assert name in out
    assert "12.88B" in out and "320.0 KiB" in out and "refused" in out


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, "--model", "no-such-model", "--gpu", "H100-SXM-80GB")[0] == 2
    assert _run(capsys, "--model", "llama-3.1-8b")[0] == 2  # no GPU given
    assert _run(capsys, "--model", "llama-3.1-8b", "--gpu", "TPU")[0] == 2


def test_routed_through_stride_cli() -> None:
    proc = subprocess.run([sys.executable, "-m", "stride", "plan", "--model", "smollm2-135m", "--gpu",
                           "L40S-48GB", "--weights", "gguf-q4_1", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["model"] == "smollm2-135m" and data["concurrency"]["32768"] is None  # beyond 8k context
