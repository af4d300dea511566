"""The rank-worker process: runs the steps the scheduler sends and writes the sampled tokens back.

Rank 0 pulls :class:`StepDescriptor` at ``worker_address``, passes it on to the other tensor-parallel ranks (each
at its ``worker_rank_address``), reads the step's arrays from shared memory, runs the forward (or the simulated
backend), samples, writes ``sampled_ids`` / logprobs into the step-output arrays and answers :class:`StepDone`.
The other ranks read the same arrays and run the same forward, their shard of every layer, joined to rank 0's by
the collectives; they sample nothing and answer nothing. No rank makes decisions.

A sequence whose own state cannot be set up (its sampling parameters) fails alone: its row samples nothing and
``StepDone.failed`` names it. A fault in the step as a whole (the forward, the batched sampler) is a device or
model fault: the step's error ends the launch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from stride.config import HEARTBEAT_INTERVAL_S, StrideConfig, quantize_group_size
from stride.env import EARLY_LAUNCH
from stride.ipc import messages as m
from stride.ipc.layouts import MAX_TOP_LOGPROBS, MaskBuffer, StepBank, StepBuffers, StepLayout
from stride.ipc.queues import PullQueue, PushQueue

log = logging.getLogger(__name__)


@dataclass
class _History:
    """A penalised sequence's tokens, collected from the step inputs until it first samples."""

    params: Any
    prompt_len: int
    req_id: str
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)


@dataclass
class _Launched:
    """A step whose forward and sampling are queued on the device (:meth:`ModelStepper.launch`)."""

    desc: m.StepDescriptor
    buf: StepBank
    failed: dict[int, m.SequenceFailure] = field(default_factory=dict)
    rows: np.ndarray | None = None
    """The step's rows that sample (None: none do)."""
    outs: list[Any] = field(default_factory=list)
    """Sampled ids, their log-probs, top ids and top log-probs (or None), on the host once ``done`` has passed."""
    done: Any = None
    """CUDA event after the copies of ``outs``; None on the CPU (there the step ran as it was launched)."""
    tokens: Any = None
    """Device: the sampled ids, one per row of ``rows`` (the first of ``outs`` before its copy)."""
    rows_dev: Any = None
    """``rows`` on the device, where not every row samples (None: every row does)."""

    def ready(self) -> bool:
        return self.done is None or bool(self.done.query())

    def row_tokens(self, like: Any) -> Any:
        """Device (num_seqs,): each row's sampled token, 0 where it sampled nothing (as the host's filling of a
        step built ahead gives); ``like`` gives the dtype and device where no row sampled."""
        import torch

        if self.rows_dev is None and self.tokens is not None:
            return self.tokens
        out = torch.zeros(self.desc.num_seqs, dtype=like.dtype, device=like.device)
        return out if self.tokens is None else out.index_copy_(0, self.rows_dev, self.tokens.to(like.dtype))


def _needs_history(params: Any) -> bool:
    return bool(params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty)


TRIM_AFTER_TOKENS = 256
"""A CPU step of at least this many tokens gives the heap its activations left back to the system afterwards
(:func:`stride.workers.cpu_int4.trim_heap`). Once per large step, not per allocation: a fixed mmap threshold, which
maps and faults every large activation afresh, cost 42% of the throughput of a prefill-heavy load (perf-log)."""


IDLE_POLL_MS = 1000
"""How often an idle worker checks on the build of its compiled decode step."""


class ModelStepper:
    """A real model: :class:`ModelRunner` for the forward, :class:`Sampler` for the tokens."""

    def __init__(self, config: StrideConfig, progress: Any, rank: int = 0) -> None:
        import torch

        from stride.workers.parallel import TensorParallel
        from stride.workers.runner import ModelRunner, resolve_device_dtype
        from stride.workers.sampling import Sampler

        device, _ = resolve_device_dtype(config.worker.device, config.worker.dtype)
        threads = config.worker.num_threads or (1 if device.type == "cuda" else 0)
        if threads:
            torch.set_num_threads(threads)
        if device.type == "cuda":
            torch.cuda.set_device(rank)  # one GPU per rank
        self.tp = TensorParallel.init(rank, config.worker.tensor_parallel_size, config.ipc.tp_rendezvous(),
                                      device.type)
        self.runner = ModelRunner.from_config(config.worker, config.cache, config.scheduler, progress, self.tp)
        self.device_type = self.runner.device.type
        args = self.runner.args
        self.num_blocks = self.runner.num_blocks
        self.vocab_size = args.vocab_size
        self.samples = rank == 0
        """Only rank 0 samples: the logits are gathered on every rank, but one token stream is the answer."""
        self.sampler = Sampler(config.scheduler.max_num_seqs, args.vocab_size,
                               eos_token_ids=list(args.eos_token_ids),
                               device=str(self.runner.device), seed=config.worker.seed)
        # Penalised sequences see their prompt and earlier output only as the step inputs flow past;
        # they join the sampler when they first sample.
        self._history: dict[int, _History] = {}

    @property
    def building(self) -> bool:
        """Whether a compiled CPU decode step is being built beside the worker (:meth:`idle` then picks it up)."""
        return self.runner.compiled is not None and self.runner.compiled.building

    def idle(self) -> None:
        """Between steps, with nothing to run: load a compiled decode step whose build finished."""
        if self.runner.compiled is not None:
            self.runner.compiled.poll()

    @property
    def graphed(self) -> bool:
        """Whether the last step ran a captured decode step: a CUDA graph, or on a CPU the compiled step."""
        return self.runner.last_step_graphed or self.runner.last_step_compiled

    def run(self, desc: m.StepDescriptor, buf: StepBank,
            masks: Callable[[int], np.ndarray] | None = None) -> list[m.SequenceFailure]:
        """Run one step; returns the sequences that failed alone (their rows sample nothing). ``masks(step)``:
        waits until the scheduler wrote the step's bitmask rows (structured outputs) and returns the bitmask
        array; called, after the forward is launched, only for a step with ``masked_rows``."""
        return self.finish(self.launch(desc, buf, masks))

    def can_launch_early(self, desc: m.StepDescriptor, before: _Launched) -> bool:
        """Whether ``desc`` may be launched before ``before`` (the step in flight) is finished: it was built ahead
        of that step, so its placeholders name that step's rows; it has no masked rows (their masks need the step
        before reported first); no sequence collects its history from the step inputs (which would read the
        placeholders on the host)."""
        return (self.samples and desc.ahead and before.desc.bank == 1 - desc.bank and not desc.masked_rows
                and not self._history)

    def launch(self, desc: m.StepDescriptor, buf: StepBank, masks: Callable[[int], np.ndarray] | None = None,
               before: _Launched | None = None) -> _Launched:
        """Queue one step's forward and sampling on the device; :meth:`finish` writes its tokens. With ``before``
        (see :meth:`can_launch_early`) ``buf`` is the bank as the scheduler wrote it and each placeholder is filled
        on the device from ``before``'s sampled tokens; without, ``buf`` has its placeholders filled on the host."""
        import torch

        if not self.samples:
            self.runner.step(buf, desc.num_tokens, desc.num_seqs)
            return _Launched(desc, buf)
        for slot in desc.finished_slots:
            self._drop(slot)
        failed: dict[int, m.SequenceFailure] = {}
        for new in desc.new_seqs:
            if _needs_history(new.params):
                self._history[new.slot] = _History(new.params, new.prompt_len, new.req_id)
            else:
                self._join(new.slot, new.req_id, failed, new.params, ())
        n, t = desc.num_seqs, desc.num_tokens
        if self._history:
            self._collect(buf, n)
        token_ids = None
        if before is not None:
            ids = buf.token_ids[:t]
            if (ids < 0).any():
                dev = self.sampler.upload(ids.astype(np.int64))
                token_ids = torch.where(dev < 0, before.row_tokens(dev)[(-1 - dev).clamp(min=0)], dev)
        logits = self.runner.step(buf, t, n, token_ids)
        if self.device_type == "cpu" and t >= TRIM_AFTER_TOKENS:
            from stride.workers.cpu_int4 import trim_heap  # torch's side of the worker (the sim one imports none)

            trim_heap()
        flags = buf.sample_flags[:n].astype(bool)
        buf.sampled_ids[:n] = -1
        for slot in buf.seq_slots[:n][flags].tolist():
            if slot in self._history:
                hist = self._history.pop(slot)
                self._join(slot, hist.req_id, failed, hist.params, hist.prompt, hist.output)
        if failed:
            flags &= ~np.isin(buf.seq_slots[:n], list(failed))
        rows = np.flatnonzero(flags)
        if len(rows) == 0:
            return _Launched(desc, buf, failed)
        slots = buf.seq_slots[:n][rows].tolist()
        allowed = None
        if desc.masked_rows and masks is not None:
            allowed = self._allowed(desc, rows, masks(desc.step))
        # Every row samples in a decode step: no gather. Elsewhere the rows' index goes up through pinned memory (a
        # host index would wait for the forward).
        rows_dev = None if len(rows) == n else self.sampler.upload(rows)
        picked = logits if rows_dev is None else logits[rows_dev]
        res = self.sampler.sample(picked, slots, allowed=allowed)
        k = 0 if res.top_ids is None else min(res.top_ids.shape[1], MAX_TOP_LOGPROBS)
        outs = [res.token_ids, res.logprobs, None if res.top_ids is None else res.top_ids[:, :k],
                None if res.top_logprobs is None else res.top_logprobs[:, :k]]
        done = None
        if res.token_ids.is_cuda:  # copied out behind the step, into pinned memory: nothing waits here
            outs = [None if x is None else torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(
                x, non_blocking=True) for x in outs]
            done = torch.cuda.Event()
            done.record()
        return _Launched(desc, buf, failed, rows, outs, done, res.token_ids, rows_dev)

    def finish(self, step: _Launched) -> list[m.SequenceFailure]:
        """Wait for a launched step's tokens and write them (with their log-probs) into its bank."""
        if step.done is not None:
            step.done.synchronize()
        rows, buf = step.rows, step.buf
        if rows is not None and step.outs:
            token_ids, logprobs, top_ids, top_logprobs = step.outs
            buf.sampled_ids[rows] = token_ids.numpy()
            if logprobs is not None:
                buf.logprobs[rows] = logprobs.numpy()
            if top_ids is not None and top_logprobs is not None:
                k = top_ids.shape[1]
                buf.top_ids[rows, :k] = top_ids.numpy()
                buf.top_logprobs[rows, :k] = top_logprobs.numpy()
        return list(step.failed.values())

    def _allowed(self, desc: m.StepDescriptor, rows: np.ndarray, bitmask: np.ndarray) -> tuple[Any, Any]:
        """(positions among the sampled ``rows``, their bitmask rows on the device) of the masked rows that still
        sample (a row whose sequence failed alone does not)."""
        masked = np.asarray(desc.masked_rows, dtype=np.int64)
        pos = np.searchsorted(rows, masked)
        keep = (pos < len(rows)) & (rows[np.minimum(pos, len(rows) - 1)] == masked)
        return self.sampler.upload(pos[keep]), self.sampler.upload(bitmask[masked[keep]])

    def _join(self, slot: int, req_id: str, failed: dict[int, m.SequenceFailure], params: Any,
              prompt: Any, output: Any = ()) -> None:
        """Give a sequence its sampler state; a sequence whose state cannot be made fails alone."""
        try:
            self.sampler.add_sequence(slot, params, prompt, output)
        except Exception as e:
            log.exception("slot %d (%s): sampler state failed", slot, req_id)
            self._drop(slot)
            failed[slot] = m.SequenceFailure(req_id, f"{type(e).__name__}: {e}")

    def _drop(self, slot: int) -> None:
        self._history.pop(slot, None)
        if self.sampler.params(slot) is not None:
            self.sampler.remove(slot)

    def _collect(self, buf: StepBank, n: int) -> None:
        starts = np.concatenate([[0], np.cumsum(buf.query_lens[:n])])
        for i, slot in enumerate(buf.seq_slots[:n].tolist()):
            hist = self._history.get(slot)
            if hist is None:
                continue
            for tok, pos in zip(buf.token_ids[starts[i]:starts[i + 1]].tolist(),
                                buf.positions[starts[i]:starts[i + 1]].tolist(), strict=True):
                (hist.prompt if pos < hist.prompt_len else hist.output).append(tok)


class SimStepper:
    """The simulated backend: modelled step time (planner cost model), deterministic tokens."""

    def __init__(self, config: StrideConfig) -> None:
        """Its tokens must be ids the tokenizer can decode: the launch's facts carry the tokenizer's vocabulary."""
        from stride.planner.cost import StepCostModel
        from stride.planner.geometry import load_geometry
        from stride.planner.hardware import get_gpu
        from stride.sim.backend import SimBackend

        worker = config.worker
        geometry = load_geometry(worker.model)
        # Priced as the launch asks: 8-bit K/V read at half the bytes, 4-bit projections (at the default group).
        cost = StepCostModel(geometry, get_gpu(worker.gpu), tp=worker.tensor_parallel_size,
                             weights="w4a16" if quantize_group_size(worker.quantize) else "bf16",
                             kv_dtype="fp8" if worker.kv_dtype == "fp8" else "bf16")
        self.vocab_size = config.facts.vocab_size or geometry.vocab_size
        self.num_blocks = config.cache.num_blocks
        self.backend = SimBackend(config.scheduler.max_num_seqs, self.vocab_size,
                                  eos_token_ids=list(config.facts.eos_token_ids), step_time=cost.step_time)

    graphed = False

    def launch(self, desc: m.StepDescriptor, buf: StepBank, masks: Callable[[int], np.ndarray] | None = None,
               before: _Launched | None = None) -> _Launched:
        """Runs the step at once (nothing is left in flight)."""
        assert before is None, "the simulated backend launches no step early"
        self.run(desc, buf, masks)
        return _Launched(desc, buf)

    def finish(self, step: _Launched) -> list[m.SequenceFailure]:
        return []

    def run(self, desc: m.StepDescriptor, buf: StepBank,
            masks: Callable[[int], np.ndarray] | None = None) -> list[m.SequenceFailure]:
        seconds = self.backend.run(desc, buf, buf.sampled_ids)
        if desc.masked_rows and masks is not None:  # a masked row takes its lowest allowed id instead
            bitmask = masks(desc.step)
            for row in desc.masked_rows:
                bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")[: self.vocab_size]
                if not bits[buf.sampled_ids[row]]:
                    buf.sampled_ids[row] = int(np.argmax(bits))
        time.sleep(seconds)  # the modelled step takes its time, so the stack sees realistic latencies
        return []


@dataclass
class _InFlight:
    """A launched step, as the loop reports it."""

    launched: _Launched
    taken: float
    timer: _StepTimer
    graphed: bool
    early: bool


SPIN_S = 50e-6
"""How long rank 0, with a step in flight, sleeps between looks at its inbox and at the step's device work."""


def _next_message(inbox: PullQueue[m.Message], step: _Launched) -> m.Message | None:
    """The next message (masks aside), or None once ``step``'s device work is done with none waiting."""
    while True:
        ready = step.ready()
        msg = inbox.get(0)
        if msg is not None and not isinstance(msg, m.MasksReady):
            return msg
        if ready:
            return None
        time.sleep(SPIN_S)


class _Stopped(Exception):
    """Shutdown arrived while a step waited for its masks."""


class _StepTimer:
    """The device's span of one step: CUDA events around it on a GPU (read after the step's own sync, so nothing
    waits for them), the wall time of it elsewhere (on the CPU the device is the host)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._wall = 0.0
        if cuda:
            import torch

            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def __enter__(self) -> _StepTimer:
        self._t0 = time.perf_counter()
        if self.cuda:
            self._start.record()
        return self

    def __exit__(self, *exc: object) -> None:
        self._wall = time.perf_counter() - self._t0
        if self.cuda:
            self._end.record()

    def seconds(self) -> float:
        if not self.cuda:
            return self._wall
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1000.0


def _heartbeat(ctx: zmq.Context[Any], address: str, rank: int, stop: threading.Event) -> None:
    """Tell the launcher every :data:`HEARTBEAT_INTERVAL_S` that this rank's interpreter runs (a daemon thread with
    its own socket). A rank stopped, or stuck in native code that holds the interpreter, falls silent; one waiting in
    a collective for such a peer keeps beating, and the launcher ends the launch on the silent one."""
    out: PushQueue[m.Message] = PushQueue(ctx, address)
    try:
        while not stop.wait(HEARTBEAT_INTERVAL_S):
            out.put_nowait(m.Heartbeat("worker", rank))
    except zmq.ZMQError:  # the process is ending: its context went first
        pass
    finally:
        out.close()


def run(config: StrideConfig, rank: int = 0) -> int:
    """Process entry point of tensor-parallel rank ``rank``."""
    ctx = zmq.Context()
    control: PushQueue[m.Message] = PushQueue(ctx, config.ipc.control_address())
    buf = None
    masks: MaskBuffer | None = None
    stepper: ModelStepper | SimStepper | None = None
    beating = threading.Event()
    try:
        def progress(message: str, fraction: float) -> None:
            control.put(m.Progress("worker", message, fraction))

        if config.worker.backend == "sim":
            stepper = SimStepper(config)
        else:
            stepper = ModelStepper(config, progress, rank)
        address = config.ipc.worker_address() if rank == 0 else config.ipc.worker_rank_address(rank)
        inbox: PullQueue[m.Message] = PullQueue(ctx, address, m.TO_WORKER)
        num_ranks = config.worker.tensor_parallel_size if config.worker.backend == "torch" else 1
        peers: list[PushQueue[m.Message]] = ([PushQueue(ctx, config.ipc.worker_rank_address(r))
                                               for r in range(1, num_ranks)] if rank == 0 else [])
        to_sched: PushQueue[m.Message] = PushQueue(ctx, config.ipc.scheduler_address())
        threading.Thread(target=_heartbeat, args=(ctx, config.ipc.control_address(), rank, beating),
                         name="heartbeat", daemon=True).start()
        control.put(m.ProcessReady("worker", rank, num_blocks=stepper.num_blocks, vocab_size=stepper.vocab_size))
        layout = StepLayout.from_config(config.scheduler, config.cache)
        timer = _StepTimer(isinstance(stepper, ModelStepper) and stepper.device_type == "cuda")

        def masks_of(step: int) -> np.ndarray:
            """Wait for the scheduler's word that step ``step``'s bitmask rows are written; the bitmask."""
            nonlocal masks
            if masks is None:  # the launcher made it once the vocabulary was known
                masks = MaskBuffer.attach(config.ipc, config.scheduler.max_num_seqs, stepper.vocab_size)
            while True:
                got = inbox.get()
                if isinstance(got, m.MasksReady) and got.step == step:
                    return masks.bitmask
                if isinstance(got, m.Shutdown):
                    raise _Stopped
                if got is not None:
                    log.warning("rank 0 waiting for the masks of step %d got %s", step, type(got).__name__)

        # With early launch a step is left in flight (``pending``) while the next one is awaited: one built ahead of
        # it is launched first, its placeholder tokens taken on the device, so the GPU goes on without waiting for
        # this loop; then the one in flight is finished and reported.
        early = (isinstance(stepper, ModelStepper) and stepper.samples and num_ranks == 1 and config.scheduler.overlap
                 and (EARLY_LAUNCH.get_bool() if EARLY_LAUNCH.get() else stepper.device_type == "cuda"))
        timers = (timer, _StepTimer(timer.cuda))  # one per bank: two steps may be in flight
        pending: _InFlight | None = None
        reported = 0.0

        def fail(step: int, e: Exception) -> None:
            log.exception("step %d failed", step)
            if rank == 0:  # the scheduler fails the requests and the launcher shuts down
                to_sched.put(m.StepDone(step, error=f"{type(e).__name__}: {e}"))

        def report(f: _InFlight) -> None:
            nonlocal reported
            try:
                failed = stepper.finish(f.launched)
            except Exception as e:
                fail(f.launched.desc.step, e)
                raise
            now = time.perf_counter()
            if rank == 0:  # the worker's share: from taking the step, or from reporting the one before if later
                to_sched.put(m.StepDone(f.launched.desc.step, failed=failed, worker_s=now - max(f.taken, reported),
                                        device_s=f.timer.seconds(), graphed=f.graphed, early=f.early))
            reported = now

        while True:
            if pending is not None:
                msg = _next_message(inbox, pending.launched)
            else:
                # While a compiled decode step is being built, an idle worker looks for it once a second.
                building = stepper.building if isinstance(stepper, ModelStepper) else False
                msg = inbox.get(IDLE_POLL_MS if building else None)
                if msg is None and isinstance(stepper, ModelStepper):
                    stepper.idle()
            if isinstance(msg, m.MasksReady):  # (masks are taken inside their step)
                continue
            before = None
            if pending is not None:
                if (isinstance(msg, m.StepDescriptor) and isinstance(stepper, ModelStepper)
                        and stepper.can_launch_early(msg, pending.launched)):
                    before = pending
                else:
                    report(pending)
                pending = None
            if msg is None:
                continue
            taken = time.perf_counter()
            for peer in peers:  # every rank runs the same step; the collectives keep them in lockstep
                peer.put(msg)
            if isinstance(msg, m.Shutdown):
                return 0
            assert isinstance(msg, m.StepDescriptor)
            if buf is None:  # the launcher makes the segments after this rank reported ready
                buf = StepBuffers.attach(config.ipc, layout)
            if before is not None:  # placeholders filled on the device
                step_buf = buf.bank(msg.bank)
            else:
                step_buf = buf.bank(msg.bank).step_inputs(msg.num_tokens, msg.ahead, buf.bank(1 - msg.bank))
            step_timer = timers[msg.bank]
            try:
                with step_timer:
                    launched = stepper.launch(msg, step_buf, masks_of, None if before is None else before.launched)
            except _Stopped:
                return 0
            except Exception as e:
                fail(msg.step, e)
                raise
            current = _InFlight(launched, taken, step_timer, stepper.graphed, before is not None)
            if before is not None:
                report(before)
            if early:
                pending = current
            else:
                report(current)
    except Exception as e:
        log.exception("worker rank %d failed", rank)
        control.put(m.ProcessFailed("worker", f"{type(e).__name__}: {e}", rank))
        return 1
    finally:
        beating.set()
        if isinstance(stepper, ModelStepper):
            stepper.runner.close()
        if buf is not None:
            buf.close()
        if masks is not None:
            masks.close()
        ctx.destroy(linger=200)
