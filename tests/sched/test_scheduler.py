"""Scheduler core: admission, rejection, stop conditions, cancellation, chunked prefill (CPU)."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_helpers import EOS, check_buffers, make, params, prompt, step

from stride.sched.plan import Rejection


def test_unknown_class_is_a_clear_error() -> None:
    sched, _, _ = make()
    with pytest.raises(ValueError, match="unknown service_class 'gold'; known: interactive"):
        sched.add_request("a", "t", prompt(5), params(), "gold", 0.0)
    assert sched.add_request("b", "t", prompt(5), params(), None, 0.0) is None  # default class
    assert sched.requests["b"].service_class.name == "standard"


def test_bounded_queue_rejects_with_reasons() -> None:
    sched, _, _ = make(max_waiting_requests=2, max_waiting_tokens=100, max_model_len=64)
    assert sched.add_request("a", "t", prompt(10), params(), None, 0.0) is None
    assert sched.add_request("b", "t", prompt(10), params(), None, 0.0) is None
    full = sched.add_request("c", "t", prompt(10), params(), None, 0.0)
    assert isinstance(full, Rejection) and full.reason == "queue_full" and full.status == 429
    sched2, _, _ = make(max_waiting_tokens=100, max_model_len=128)
    assert sched2.add_request("a", "t", prompt(60), params(), None, 0.0) is None
    over = sched2.add_request("b", "t", prompt(60), params(), None, 0.0)
    assert over is not None and over.reason == "overloaded" and over.status == 503
    assert sched2.add_request("c", "t", prompt(40), params(), None, 0.0) is None  # control: fits exactly
    too_long = sched2.add_request("d", "t", prompt(128), params(), None, 0.0)
    assert too_long is not None and too_long.reason == "too_long" and too_long.status == 400
    # A prompt the block pool could never hold with its output is refused up front, not deadlocked on.
    sched3, _, _ = make(num_blocks=8, block_size=4)
    assert sched3.add_request("x", "t", prompt(30), params(max_tokens=3), None, 0.0).reason == "too_long"
    assert sched3.add_request("y", "t", prompt(29), params(max_tokens=3), None, 0.0) is None
    assert sched3.metrics().num_rejections == 1


def _drive(sched, buf, sampled_script):  # type: ignore[no-untyped-def]
    """Run steps feeding scripted tokens (one per sampling row, popped per request)."""
    outs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    now = 0.0
    while sched.has_work():
        plan = sched.schedule(now)
        check_buffers(sched, buf, plan)
        sampled = np.full(plan.num_seqs, -1, dtype=np.int32)
        for i, rid in enumerate(plan.req_ids):
            if plan.sample_flags[i]:
                sampled[i] = sampled_script[rid].pop(0)
        now += 0.01
        batch = sched.update(plan, sampled, now)
        # The columns and the per-request form agree (one token per row, the plan row it sampled in).
        assert [plan.req_ids[r] for r in batch.rows.tolist()] == batch.req_ids
        assert batch.token_ids.tolist() == [int(sampled[r]) for r in batch.rows.tolist()]
        assert batch.finished == {u.req_id: u.finish_reason for u in batch if u.finish_reason}
        for u in batch:
            outs.setdefault(u.req_id, []).extend(u.token_ids)
            if u.finish_reason:
                reasons[u.req_id] = u.finish_reason
    return outs, reasons


def test_stop_conditions() -> None:
    sched, buf, _ = make()
    sched.add_request("eos", "t", prompt(6), params(max_tokens=10), None, 0.0)
    sched.add_request("ignore", "t", prompt(6), params(max_tokens=4, ignore_eos=True), None, 0.0)
    sched.add_request("stopid", "t", prompt(6), params(max_tokens=10, stop_token_ids=(77,)), None, 0.0)
    sched.add_request("len", "t", prompt(6), params(max_tokens=3), None, 0.0)
    script = {"eos": [5, 6, EOS, 9], "ignore": [EOS, EOS, 5, 6], "stopid": [5, 77, 8], "len": [5, 6, 7, 8]}
    outs, reasons = _drive(sched, buf, script)
    assert reasons == {"eos": "stop", "ignore": "length", "stopid": "stop", "len": "length"}
    assert outs == {"eos": [5, 6, EOS], "ignore": [EOS, EOS, 5, 6], "stopid": [5, 77], "len": [5, 6, 7]}
    assert sched.bm.stats.num_live == 0 and not sched.requests


def test_max_model_len_ends_with_length() -> None:
    sched, buf, _ = make(max_model_len=12)
    sched.add_request("a", "t", prompt(8), params(max_tokens=100), None, 0.0)
    outs, reasons = _drive(sched, buf, {"a": list(range(10, 30))})
    assert reasons == {"a": "length"} and len(outs["a"]) == 4


def test_cancel_frees_within_one_step() -> None:
    sched, buf, backend = make()
    for rid in ("a", "b", "c"):
        sched.add_request(rid, "t", prompt(10, seed=ord(rid)), params(max_tokens=50), None, 0.0)
    _, _, now = step(sched, buf, backend, 0.0)
    slot_a, slot_b = sched.requests["a"].slot, sched.requests["b"].slot
    # Not in flight: freed at once.
    update = sched.abort("a", now)
    assert update is not None and update.finish_reason == "abort"
    assert not sched.bm.is_allocated(slot_a) and "a" not in sched.requests
    # In flight: the workers may be reading its row, so it is freed at that step's update.
    plan = sched.schedule(now)
    assert "b" in plan.req_ids and slot_a in plan.finished_slots
    sched.abort("b", now)
    assert sched.bm.is_allocated(slot_b)  # control: still held while in flight
    backend.run(plan.descriptor(), buf, buf.sampled_ids)
    updates = sched.update(plan, buf.sampled_ids, now + 0.01)
    assert [u.req_id for u in updates] == ["c"]  # no token for an aborted request
    assert not sched.bm.is_allocated(slot_b) and "b" not in sched.requests
    assert sched.bm.is_allocated(sched.requests["c"].slot)  # control: the other one keeps its blocks
    assert slot_b in sched.schedule(now + 0.01).finished_slots
    # Waiting requests are dropped from the queue and its counts.
    sched.add_request("w", "t", prompt(10), params(), None, now)
    assert sched.abort("w", now) is not None and len(sched.waiting) == 0 and sched.waiting.num_tokens == 0
    assert sched.abort("w", now) is None


def test_chunked_prefill_does_not_stall_decodes() -> None:
    sched, buf, backend = make(max_num_batched_tokens=512, num_blocks=2048)
    for i in range(8):
        sched.add_request(f"d{i}", "t", prompt(20, seed=i), params(max_tokens=400), "interactive", 0.0)
    now = 0.0
    for _ in range(3):
        _, _, now = step(sched, buf, backend, now)
    sched.add_request("long", "t", prompt(4000, seed=99), params(max_tokens=4), "standard", now)
    steps_with_long = 0
    while "long" not in sched.requests or sched.requests["long"].first_token_time is None:
        plan, updates, now = step(sched, buf, backend, now)
        rows = dict(zip(plan.req_ids, plan.query_lens.tolist(), strict=True))
        # The decodes lead the step (the Triton backend attends to that head apart from the chunks).
        q = plan.query_lens.tolist()
        assert q[:8] == [1] * 8 and all(n > 1 for n in q[8:]), q
        # Every decoding sequence gets exactly one token in every step of the long prefill.
        assert all(rows[f"d{i}"] == 1 for i in range(8)), rows
        assert {u.req_id for u in updates} >= {f"d{i}" for i in range(8)}
        if "long" in rows:
            steps_with_long += 1
            assert rows["long"] == min(512 - 8, 4000 - int(plan.start_positions[plan.req_ids.index("long")]))
    assert steps_with_long == 8  # 4,000 tokens in chunks of 504: the prompt really spans steps


def test_slack_not_class_decides_admission() -> None:
    # A background flood: a fresh interactive request is admitted ahead of all of them.
    sched, buf, backend = make(max_num_seqs=2)
    for i in range(20):
        sched.add_request(f"bg{i}", "t", prompt(8, seed=i), params(max_tokens=4), "background", 0.0)
    now = 0.0
    for _ in range(3):
        _, _, now = step(sched, buf, backend, now)
    sched.add_request("int", "t", prompt(8, seed=50), params(max_tokens=4), "interactive", now)
    admitted = []
    while "int" not in admitted:
        plan, _, now = step(sched, buf, backend, now)
        admitted += [n.req_id for n in plan.new_seqs]
    assert admitted[0] == "int" and len(sched.waiting) > 10  # first in, though the last to arrive
    # Control, the other direction: a background request that has waited almost its whole TTFT target
    # outranks an interactive one that just arrived.
    sched, buf, backend = make(max_num_seqs=1)
    sched.add_request("busy", "t", prompt(8), params(max_tokens=2), "standard", 0.0)
    plan, _, _ = step(sched, buf, backend, 0.0)
    sched.add_request("old-bg", "t", prompt(8, seed=1), params(max_tokens=2), "background", 0.0)
    sched.add_request("new-int", "t", prompt(8, seed=2), params(max_tokens=2), "interactive", 119.8)
    order = []
    now = 119.8
    while sched.has_work():
        plan, _, now = step(sched, buf, backend, now)
        order += [n.req_id for n in plan.new_seqs]
    assert order == ["old-bg", "new-int"]


def test_step_timeline_counts_busy_time_only() -> None:
    from stride.sched.stats import StepTimeline

    t = StepTimeline()
    t.sent(0.0)
    t.done(1.0, worker_s=0.8, device_s=0.6)
    t.sent(1.25)  # the scheduler's gap: 0.25 s
    t.done(2.0, worker_s=0.7, device_s=0.5, graphed=True)
    t.idle()  # nothing followed: the next 3 s are idle, nobody's overhead
    t.sent(5.0)
    t.done(5.5, worker_s=0.4, device_s=0.3, early=True)
    assert (t.steps, t.round_trip_s, t.gap_s, t.early_steps) == (3, 2.25, 0.25, 1)
    assert (round(t.worker_s, 9), round(t.device_s, 9)) == (1.9, 1.4)
    assert (t.graph_steps, t.graph_device_s) == (1, 0.5)
    # Control: without the idle mark the 3 s would count as the scheduler's.
    u = StepTimeline()
    u.sent(0.0)
    u.done(2.0, 0.0, 0.0)
    u.sent(5.0)
    assert u.gap_s == 3.0


def test_step_timeline_counts_two_steps_in_flight_once() -> None:
    from stride.sched.stats import StepTimeline

    t = StepTimeline()
    t.sent(0.0)
    t.sent(0.1)  # built ahead while the first runs
    t.done(1.0, worker_s=0.9, device_s=0.8)
    t.sent(1.05)  # the next ahead of the second: the stretch goes on, no gap
    t.done(2.0, worker_s=0.9, device_s=0.8)
    t.done(3.0, worker_s=0.9, device_s=0.8)
    assert (t.steps, t.round_trip_s, t.gap_s) == (3, 3.0, 0.0)
    t.sent(3.5)  # none in flight: a gap again
    t.done(4.0, worker_s=0.4, device_s=0.3)
    assert (t.round_trip_s, t.gap_s) == (3.5, 0.5)
