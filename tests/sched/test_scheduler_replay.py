"""Trace and replay: a recorded run replays to identical decisions; a tampered trace diverges where it was
tampered; ``stride replay`` and ``stride simulate`` from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scheduler_helpers import EOS, make, params, prompt, step

from stride.launch import cli
from stride.sched.replay import replay_records
from stride.sched.trace import TraceWriter, load_trace


def _record(path: Path) -> None:
    trace = TraceWriter(path)
    sched, buf, backend = make(trace=trace, num_blocks=40, block_size=4, max_num_seqs=6,
                               max_num_batched_tokens=48, max_waiting_requests=12)
    now = 0.0
    for i in range(16):
        sched.add_request(f"r{i}", f"t{i % 2}", prompt(10 + 2 * i, seed=i % 3), params(max_tokens=12 + i % 5),
                          ("interactive", "standard", "background")[i % 3], now)
        for _ in range(2):
            _, _, now = step(sched, buf, backend, now)
        if i == 7:
            sched.abort("r3", now)
    while sched.has_work():
        _, _, now = step(sched, buf, backend, now)
    assert sched.metrics().num_preemptions > 0
    trace.close()


@pytest.fixture()
def trace_path(tmp_path: Path) -> Path:
    path = tmp_path / "run.jsonl"
    _record(path)
    return path


def _rewrite(path: Path, records: list[dict]) -> None:  # type: ignore[type-arg]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_recorded_run_replays_identically(trace_path: Path) -> None:
    records = load_trace(trace_path)
    result = replay_records(records)
    assert result.ok, result.divergence
    assert result.num_steps == sum(1 for r in records if r["kind"] == "schedule") > 20
    assert any(r["kind"] == "abort" for r in records)


def test_tampered_sampled_id_diverges_at_next_step(trace_path: Path) -> None:
    records = load_trace(trace_path)
    schedules = {r["step"]: r for r in records if r["kind"] == "schedule"}
    # Make one request sample EOS at step k; it then ends, so step k+1 (where it ran) must differ.
    for rec in records:
        if rec["kind"] != "update" or rec["step"] + 1 not in schedules:
            continue
        nxt = schedules[rec["step"] + 1]["decisions"]["req_ids"]
        rows = schedules[rec["step"]]["decisions"]["req_ids"]
        hits = [i for i, rid in enumerate(rows) if rid in nxt and rec["sampled"][i] >= 0]
        if rec["step"] >= 5 and hits:
            rec["sampled"][hits[0]] = EOS
            k = rec["step"]
            break
    result = replay_records(records)
    assert not result.ok and result.diverged_step == k + 1
    assert "req_ids" in (result.divergence or "")


def test_tampered_decision_is_reported_at_its_step(tmp_path: Path, trace_path: Path) -> None:
    records = load_trace(trace_path)
    target = [r for r in records if r["kind"] == "schedule"][12]
    target["decisions"]["query_lens"][0] += 1
    result = replay_records(records)
    assert result.diverged_step == target["step"] and "query_lens" in (result.divergence or "")
    bad = tmp_path / "bad.jsonl"
    _rewrite(bad, records)
    assert cli.main(["replay", str(bad)]) == 1
    assert cli.main(["replay", str(trace_path)]) == 0  # control: the untouched trace passes


def test_replay_cli_reports_divergence(tmp_path: Path, trace_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    records = [r for r in load_trace(trace_path) if r["kind"] != "abort"]  # a cancellation lost
    bad = tmp_path / "no-abort.jsonl"
    _rewrite(bad, records)
    assert cli.main(["replay", str(bad)]) == 1
    assert "DIVERGED" in capsys.readouterr().out
    (tmp_path / "junk.jsonl").write_text("{not json\n")
    assert cli.main(["replay", str(tmp_path / "junk.jsonl")]) == 2


def test_simulate_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--num-requests", "60", "--rate", "30", "--prompt-len", "300", "--output-len", "40",
            "--num-blocks", "400", "--max-num-seqs", "32", "--json"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_finished"] + report["num_rejected"] == 60
    assert set(report["classes"]) <= {"interactive", "standard", "background"} and report["classes"]
    for c in report["classes"].values():
        assert c["ttft_ms"]["p50"] > 0 and c["itl_ms"]["p99"] >= c["itl_ms"]["p50"] > 0
    assert 0 < report["prefix_hit_rate"] < 1 and report["goodput_rps"] > 0
    assert cli.main(["simulate", "--class-mix", "gold=1"]) == 2
