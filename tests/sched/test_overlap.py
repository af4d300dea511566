"""Overlapped scheduling: a step built while the one before is in flight gives every request the tokens the
synchronous loop gives it.

The worker here is a paged model in miniature: it writes each input token into the KV block its block table
names, reads a sequence's whole context back through the table, and samples a token that is a hash of that
context (EOS for some). So a wrong block table, a prefix hit on the wrong blocks, a placeholder filled with the
wrong token or a row run on a freed slot changes the outputs, and the two loops must agree token for token.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from stride.config import CacheConfig, SchedulerConfig
from stride.ipc.messages import StepDescriptor
from stride.params import SamplingParams
from stride.sched.plan import StepArrays, StepPlan
from stride.sched.replay import replay_records
from stride.sched.scheduler import Scheduler
from stride.sched.trace import TraceWriter, load_trace

EOS = 2
VOCAB = 500


class PagedModel:
    """Runs steps over a dict-of-blocks KV cache; one token per context, drawn from a hash of it."""

    def __init__(self, block_size: int, eos_every: int) -> None:
        self.block_size = block_size
        self.eos_every = eos_every
        self.kv: dict[int, dict[int, int]] = {}
        self.seen_placeholders = 0

    def run(self, desc: StepDescriptor, buf: StepArrays) -> None:
        bank = buf.bank(desc.bank)
        inputs = bank.step_inputs(desc.num_tokens, desc.ahead, buf.bank(1 - desc.bank))
        self.seen_placeholders += int(np.count_nonzero(bank.token_ids[:desc.num_tokens] < 0))
        ids = inputs.token_ids[:desc.num_tokens].tolist()
        assert min(ids, default=0) >= 0
        offset = 0
        bs = self.block_size
        for i in range(desc.num_seqs):
            slot, q, ctx = int(bank.seq_slots[i]), int(bank.query_lens[i]), int(bank.context_lens[i])
            row = bank.block_tables[slot]
            for j in range(q):
                pos = int(bank.positions[offset + j])
                self.kv.setdefault(int(row[pos // bs]), {})[pos % bs] = ids[offset + j]
            offset += q
            if not bank.sample_flags[i]:
                bank.sampled_ids[i] = -1
                continue
            context = [self.kv[int(row[p // bs])][p % bs] for p in range(ctx)]
            h = int.from_bytes(hashlib.blake2b(np.asarray(context, dtype=np.int64).tobytes(),
                                               digest_size=8).digest(), "little")
            bank.sampled_ids[i] = EOS if h % self.eos_every == 0 else 3 + h % (VOCAB - 3)


def requests(num: int, seed: int) -> list[tuple[str, str, list[int], SamplingParams]]:
    """Prompts of mixed lengths with shared prefixes (two tenants), mixed max_tokens, some with a stop token id."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, VOCAB, 24).tolist()
    out = []
    for i in range(num):
        own = rng.integers(3, VOCAB, int(rng.integers(1, 40))).tolist()
        prompt = (shared[:int(rng.integers(0, 25))] + own) if i % 3 else own
        stop_ids = (int(rng.integers(3, VOCAB)),) if i % 5 == 0 else ()
        params = SamplingParams(max_tokens=int(rng.integers(1, 30)), stop_token_ids=stop_ids)
        out.append((f"r{i}", f"t{i % 2}", prompt, params))
    return out


def run(overlap: bool, reqs: list[tuple[str, str, list[int], SamplingParams]], *, num_blocks: int = 400,
        block_size: int = 4, budget: int = 64, max_num_seqs: int = 12, eos_every: int = 9,
        trace: TraceWriter | None = None,
        aborts: dict[int, list[str]] | None = None) -> tuple[dict[str, tuple[list[int], str]], Scheduler, dict]:
    """Every request to its end: {req_id: (output tokens, finish reason)}. Requests arrive a few per step; with
    ``overlap`` each step after the first is built while the one before is in flight, as the scheduler process
    does, and the model runs a step only once the next has been built (the latest it could)."""
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=256)
    cc = CacheConfig(block_size=block_size, num_blocks=num_blocks, check_invariants=True)
    buf = StepArrays(sc, cc)
    sched = Scheduler(sc, cc, buf, eos_token_ids=(EOS,), trace=trace)
    model = PagedModel(block_size, eos_every)
    outputs: dict[str, list[int]] = {r[0]: [] for r in reqs}
    reasons: dict[str, str] = {}
    pending = list(reqs)
    inflight: list[StepPlan] = []
    stats = {"ahead": 0, "steps": 0, "wasted": 0}
    now = 0.0
    while pending or sched.has_work() or inflight:
        for _ in range(3):
            if pending:
                rid, tenant, prompt, params = pending.pop(0)
                assert sched.add_request(rid, tenant, prompt, params, None, now) is None
        for rid in (aborts or {}).get(stats["steps"], []):
            if sched.abort(rid, now) is not None:
                reasons[rid] = "abort"
        if not inflight:
            plan = sched.schedule(now)
            if plan.num_seqs:
                inflight.append(plan)
        if overlap and len(inflight) == 1:
            ahead = sched.schedule_ahead(now)
            if ahead is not None:
                inflight.append(ahead)
                stats["ahead"] += 1
        if not inflight:
            continue
        plan = inflight[0]
        model.run(plan.descriptor(), buf)
        now += 1.0
        batch = sched.update(plan, buf.bank(plan.bank).sampled_ids, now)
        inflight.pop(0)
        stats["steps"] += 1
        stats["wasted"] += int(plan.sample_flags.sum()) - len(batch)
        for u in batch:
            assert u.req_id not in reasons, f"{u.req_id} got a token after it ended"
            outputs[u.req_id] += u.token_ids
            if u.finish_reason is not None:
                reasons[u.req_id] = u.finish_reason
    stats["placeholders"] = model.seen_placeholders
    sched.bm.assert_invariants()
    assert sched.bm.stats.num_live == 0 and not sched.requests
    return {rid: (outputs[rid], reasons[rid]) for rid in outputs}, sched, stats


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlap_gives_every_request_the_tokens_of_the_synchronous_loop(seed: int) -> None:
    reqs = requests(40, seed)
    sync, _, sync_stats = run(False, reqs)
    over, _, stats = run(True, reqs)
    assert over == sync
    assert sync_stats["ahead"] == 0 and stats["ahead"] > stats["steps"] // 2  # most steps were built ahead
    assert stats["placeholders"] > 0
    assert {r for _, r in sync.values()} >= {"stop", "length"}  # EOS, stop ids and max_tokens all ended some
    assert stats["steps"] <= sync_stats["steps"] + stats["wasted"]


def test_a_request_that_stops_in_flight_costs_one_slot_of_the_step_built_ahead() -> None:
    reqs = requests(30, 7)
    over, _, stats = run(True, reqs, eos_every=4)
    sync, _, _ = run(False, reqs, eos_every=4)
    assert over == sync
    assert stats["wasted"] > 0  # a row built ahead for a sequence that had just sampled EOS: dropped
    stops = sum(1 for _, r in over.values() if r == "stop")
    assert stats["wasted"] <= stops


def test_overlap_under_memory_pressure_preempts_only_in_steps_built_synchronously() -> None:
    reqs = requests(30, 3)
    sync, s_sched, _ = run(False, reqs, num_blocks=40)
    over, o_sched, stats = run(True, reqs, num_blocks=40)
    assert s_sched.counters.num_preemptions > 0 and o_sched.counters.num_preemptions > 0
    assert over == sync
    assert stats["ahead"] > 0


def test_a_wrong_placeholder_is_caught() -> None:
    """Negative control: the paged model notices when the token a step built ahead decodes on is not the one the
    step before sampled (here the worker fills the holes from the wrong bank)."""
    reqs = requests(20, 0)
    good, _, _ = run(True, reqs)
    original = StepArrays.step_inputs
    try:
        StepArrays.step_inputs = lambda self, n, ahead, prev: original(self, n, ahead, self)  # type: ignore
        bad, _, _ = run(True, reqs)
    finally:
        StepArrays.step_inputs = original  # type: ignore[method-assign]
    assert bad != good


def test_cancelled_in_flight_frees_every_block_once_no_step_holds_it() -> None:
    reqs = [(f"r{i}", "t", list(range(3 + i, 40 + i)), SamplingParams(max_tokens=60)) for i in range(6)]
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256)
    cc = CacheConfig(block_size=4, num_blocks=200, check_invariants=True)
    buf = StepArrays(sc, cc)
    sched = Scheduler(sc, cc, buf, eos_token_ids=(EOS,))
    model = PagedModel(4, eos_every=10**9)
    for rid, tenant, prompt, params in reqs:
        sched.add_request(rid, tenant, prompt, params, None, 0.0)
    first = sched.schedule(0.0)
    model.run(first.descriptor(), buf)
    sched.update(first, buf.sampled_ids, 1.0)
    n_plan = sched.schedule(1.0)
    ahead = sched.schedule_ahead(1.0)
    assert ahead is not None and "r0" in ahead.req_ids
    final = sched.abort("r0", 1.5)
    assert final is not None and final.finish_reason == "abort"
    model.run(n_plan.descriptor(), buf)
    batch = sched.update(n_plan, buf.sampled_ids, 2.0)
    assert "r0" not in batch.req_ids  # no token for it after the abort
    nxt = sched.schedule_ahead(2.0)
    assert nxt is not None and "r0" not in nxt.req_ids  # no step built after the abort runs it
    assert "r0" in sched.requests  # the step built ahead still reads its blocks
    model.run(ahead.descriptor(), buf)
    sched.update(ahead, buf.bank(ahead.bank).sampled_ids, 3.0)
    assert "r0" not in sched.requests  # freed at the update of the last step that held it
    live = {b for s in range(sc.max_num_seqs) for b in sched.bm.block_table(s)}
    assert sched.bm.stats.num_live == len(live)
    sched.bm.assert_invariants()


def test_schedule_ahead_declines_without_changing_anything_when_decodes_do_not_fit() -> None:
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    cc = CacheConfig(block_size=4, num_blocks=9, check_invariants=True)
    buf = StepArrays(sc, cc)
    sched = Scheduler(sc, cc, buf, eos_token_ids=(EOS,))
    for i in range(2):  # 2 x 16 tokens = 8 of the 9 blocks; the next token of each needs a new block
        sched.add_request(f"r{i}", "t", list(range(10 + i * 16, 26 + i * 16)), SamplingParams(max_tokens=20),
                          None, 0.0)
    plan = sched.schedule(0.0)
    before = (sched.bm.num_available_blocks, buf.bank(1).token_ids.copy(), sched.slots.num_alloc.copy())
    assert sched.schedule_ahead(0.0) is None
    after = (sched.bm.num_available_blocks, buf.bank(1).token_ids.copy(), sched.slots.num_alloc.copy())
    assert before[0] == after[0] and (before[1] == after[1]).all() and (before[2] == after[2]).all()
    assert sched.inflight == [plan]


def test_a_trace_recorded_with_overlap_replays(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    writer = TraceWriter(str(path))
    _, _, stats = run(True, requests(25, 5), num_blocks=60, trace=writer,
                      aborts={4: ["r2", "r9"], 9: ["r11"]})
    writer.close()
    assert stats["ahead"] > 0
    records = load_trace(str(path))
    assert any(r.get("ahead") for r in records)
    result = replay_records(records)
    assert result.ok, result.divergence
    # Negative control: the same trace with one sampled token changed diverges.
    i = next(i for i, r in enumerate(records) if r["kind"] == "update" and any(t >= 0 for t in r["sampled"])
             and i > len(records) // 3)
    j = next(k for k, t in enumerate(records[i]["sampled"]) if t >= 0)
    records[i]["sampled"][j] = EOS
    assert not replay_records(records).ok


def _loop_run(overlap: bool) -> tuple[dict[str, str], int]:
    """The scheduler process's loop (no sockets) over constrained and free requests, rank 0 played by a sampler that
    takes each masked row's lowest allowed token, from the masks as they were when their MasksReady came, and a
    fixed token elsewhere.
    Returns each request's text and the number of masked rows in steps built ahead."""
    from stride.config import IpcConfig, LaunchFacts, StrideConfig, WorkerConfig
    from stride.grammar.compile import GrammarCompiler
    from stride.grammar.matchers import GrammarMatchers, bitmask_words
    from stride.ipc import messages as m
    from stride.model.files import default_model_path
    from stride.params import Constraint
    from stride.sched.process import SchedulerLoop
    from stride.tokenizer.loader import load_tokenizer

    tok = load_tokenizer(default_model_path())
    vocab = tok.tokenizer.get_vocab_size()
    config = StrideConfig(ipc=IpcConfig(run_dir="/tmp", launch_id="ovg"),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=256, overlap=overlap),
                          cache=CacheConfig(block_size=16, num_blocks=64, check_invariants=True),
                          worker=WorkerConfig(model=default_model_path()),
                          facts=LaunchFacts(vocab_size=vocab, eos_token_ids=tuple(tok.eos_token_ids)))
    buf = StepArrays(config.scheduler, config.cache)
    bitmask = np.zeros((8, bitmask_words(vocab)), dtype=np.int32)
    loop = SchedulerLoop(config, buf, list(tok.eos_token_ids),  # type: ignore[arg-type]
                         grammar=GrammarMatchers(tok.tokenizer.to_str(), vocab, tok.eos_token_ids), bitmask=bitmask)
    grammar = GrammarCompiler().compile(Constraint("regex", "(yes|no|maybe)( (yes|no|maybe)){2,4}"))
    prompt = tok.encode("Answer:", add_special_tokens=False)
    for i in range(6):
        failed = loop.on_request(m.TokenizedRequest(f"r{i}", "t", prompt + [i + 5], SamplingParams(max_tokens=24), 0,
                                                    grammar=grammar if i % 2 == 0 else None), 0.0)
        assert failed is None
    texts: dict[str, list[int]] = {f"r{i}": [] for i in range(6)}
    ready: dict[int, np.ndarray] = {}  # step -> the bitmask as its MasksReady found it
    sent: list[m.StepDescriptor] = []
    ahead_masked = 0
    now = 0.0
    while loop.core.has_work() or loop.inflight:
        while (desc := loop.next_step(now)) is not None:
            sent.append(desc)
            ahead_masked += len(desc.masked_rows) if desc.ahead else 0
            got = loop.fill_masks()
            if got is not None:
                ready[got.step] = bitmask.copy()
        desc = sent.pop(0)
        bank = buf.bank(desc.bank)
        inputs = bank.step_inputs(desc.num_tokens, desc.ahead, buf.bank(1 - desc.bank))
        assert inputs.token_ids[:desc.num_tokens].min() >= 0
        bank.sampled_ids[:desc.num_seqs] = np.where(bank.sample_flags[:desc.num_seqs] == 1, 1000 + desc.step % 7, -1)
        if desc.masked_rows:
            masks = ready.pop(desc.step)  # the masks were there before it sampled
            for row in desc.masked_rows:
                bits = np.unpackbits(masks[row].view(np.uint8), bitorder="little")[:vocab]
                bank.sampled_ids[row] = int(np.argmax(bits))
        now += 1.0
        for outs in loop.on_step_done(m.StepDone(desc.step), now).values():
            for out in outs:
                assert out.finish_reason != "error", out.error
                texts[out.req_id] += out.token_ids
        got = loop.masks_after_update()
        if got is not None:
            ready[got.step] = bitmask.copy()
    eos = set(tok.eos_token_ids)
    return {rid: tok.tokenizer.decode([t for t in ids if t not in eos]) for rid, ids in texts.items()}, ahead_masked


def test_constrained_rows_of_steps_built_ahead_get_their_masks_after_the_step_before() -> None:
    import re

    over, ahead_masked = _loop_run(True)
    sync, none_ahead = _loop_run(False)
    assert ahead_masked > 0 and none_ahead == 0
    assert over == sync
    for i in (0, 2, 4):
        assert re.fullmatch(r"(yes|no|maybe)( (yes|no|maybe)){2,4}", over[f"r{i}"]), over[f"r{i}"]


def test_masks_written_before_the_step_before_is_applied_are_caught(monkeypatch) -> None:
    """Negative control: filling a step built ahead at once, from matchers that have not seen the step before's
    tokens, draws tokens the grammar refuses."""
    from stride.sched.process import SchedulerLoop

    monkeypatch.setattr(SchedulerLoop, "fill_masks", lambda self: self._fill(self.inflight[-1].step))
    with pytest.raises(AssertionError):
        _loop_run(True)
