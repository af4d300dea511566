"""The IPC substrate across real (spawned) processes: queues, shared arrays, the runtime directory."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
import time

import numpy as np
import pytest
import zmq

from stride.config import IpcConfig
from stride.ipc import messages as m
from stride.ipc.queues import PullQueue, PushQueue
from stride.ipc.rundir import make_ipc_config, remove_run_dir
from stride.ipc.shm import SharedArray, launch_segments, remove_launch_segments

SPAWN = mp.get_context("spawn")


@pytest.fixture
def ipc():
    cfg = make_ipc_config()
    yield cfg
    remove_launch_segments(cfg.shm_prefix)
    remove_run_dir(cfg)


# ------------------------------------------------------------------ child processes (module level for spawn)

def _producer(address: str, count: int, start: int) -> None:
    ctx = zmq.Context()
    q: PushQueue[m.StepDone] = PushQueue(ctx, address)
    for i in range(start, start + count):
        q.put(m.StepDone(i))
    q.close()


def _echo(in_address: str, out_address: str) -> None:
    ctx = zmq.Context()
    pull: PullQueue[m.Message] = PullQueue(ctx, in_address, m.TO_WORKER)
    push: PushQueue[m.StepDone] = PushQueue(ctx, out_address)
    while True:
        msg = pull.get()
        if isinstance(msg, m.Shutdown):
            break
        assert isinstance(msg, m.StepDescriptor)
        push.put(m.StepDone(msg.step))
    pull.close()
    push.close()


def _writer(ipc_dict: dict, shape: tuple[int, ...], ready: object, go: object) -> None:
    ipc = IpcConfig(**ipc_dict)
    arr = SharedArray.attach(ipc.shm_name("table"), shape, np.int32)
    arr.array[:] = 7
    ready.set()  # type: ignore[attr-defined]
    go.wait(10)  # type: ignore[attr-defined]
    arr.array[0, 0] = 42  # written after the reader attached: visible only if it is the same memory
    arr.close()


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)  # even when a test failed with sockets open, never hang in term()


# ------------------------------------------------------------------ tests

def test_queue_many_messages_from_several_processes(ipc: IpcConfig, ctx: zmq.Context) -> None:
    pull: PullQueue[m.StepDone] = PullQueue(ctx, ipc.scheduler_address(), (m.StepDone,))
    procs = [SPAWN.Process(target=_producer, args=(ipc.scheduler_address(), 5000, k * 5000)) for k in range(3)]
    for p in procs:
        p.start()
    got = []
    while len(got) < 15000:
        msg = pull.get(timeout_ms=20_000)
        assert msg is not None, f"timed out after {len(got)} messages"
        got.append(msg.step)
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    assert sorted(got) == list(range(15000))
    # per-producer order is preserved
    for k in range(3):
        mine = [s for s in got if k * 5000 <= s < (k + 1) * 5000]
        assert mine == sorted(mine)
    pull.close()


def test_round_trip_and_malformed_frame_survives(ipc: IpcConfig, ctx: zmq.Context) -> None:
    push: PushQueue[m.Message] = PushQueue(ctx, ipc.worker_address())
    pull: PullQueue[m.StepDone] = PullQueue(ctx, ipc.scheduler_address(), (m.StepDone,))
    child = SPAWN.Process(target=_echo, args=(ipc.worker_address(), ipc.scheduler_address()))
    child.start()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)  # a raw socket keeps zmq's infinite default linger: term() would wait on it
    raw.connect(ipc.worker_address())
    # Frames the echo child must drop without dying: garbage, and a message of another group.
    raw.send(b"\x00garbage")
    raw.send(b'{"t": "abort", "req_id": "x"}')
    for step in range(100):
        push.put(m.StepDescriptor(step, 1, 1))
        reply = pull.get(timeout_ms=20_000)
        assert reply == m.StepDone(step)
    push.put(m.Shutdown())
    child.join(10)
    assert child.exitcode == 0
    raw.close()
    push.close()
    pull.close()


def test_shutdown_with_messages_pending_does_not_hang(ipc: IpcConfig, ctx: zmq.Context) -> None:
    # Nobody ever binds this address: the sends queue up inside zmq.
    push: PushQueue[m.StepDone] = PushQueue(ctx, ipc.address("nobody"))
    for i in range(1000):
        push.put_nowait(m.StepDone(i))
    t0 = time.monotonic()
    push.close()
    ctx.term()  # would block forever with the default infinite linger
    assert time.monotonic() - t0 < 30


def test_pull_get_times_out(ipc: IpcConfig, ctx: zmq.Context) -> None:
    pull: PullQueue[m.StepDone] = PullQueue(ctx, ipc.scheduler_address(), (m.StepDone,))
    assert pull.get(timeout_ms=10) is None
    assert pull.drain() == []
    pull.close()


def test_shared_array_is_the_same_memory_across_processes(ipc: IpcConfig) -> None:
    shape = (4, 8)
    owner = SharedArray.create(ipc.shm_name("table"), shape, np.int32, fill=-1)
    ready, go = SPAWN.Event(), SPAWN.Event()
    child = SPAWN.Process(target=_writer, args=(ipc.to_dict(), shape, ready, go))
    child.start()
    assert ready.wait(30)
    assert (owner.array == 7).all()
    go.set()
    child.join(10)
    assert child.exitcode == 0
    assert owner.array[0, 0] == 42
    # The attacher's exit did not unlink the owner's segment.
    assert launch_segments(ipc.shm_prefix) == [ipc.shm_name("table")]
    owner.close()
    owner.close()  # twice is harmless
    assert launch_segments(ipc.shm_prefix) == []


def test_attach_checks_size(ipc: IpcConfig) -> None:
    with SharedArray.create(ipc.shm_name("small"), (4,), np.int32):
        with pytest.raises(ValueError, match="needs"):
            SharedArray.attach(ipc.shm_name("small"), (1000,), np.int32)


def test_remove_launch_segments_after_a_crash(ipc: IpcConfig) -> None:
    other = make_ipc_config()
    a = SharedArray.create(ipc.shm_name("a"), (16,), np.float32)
    b = SharedArray.create(ipc.shm_name("b"), (16,), np.float32)
    keep = SharedArray.create(other.shm_name("a"), (16,), np.float32)
    # The "crashed" owner never closes a or b; the launcher's cleanup removes exactly this launch's segments.
    removed = remove_launch_segments(ipc.shm_prefix)
    assert removed == sorted([ipc.shm_name("a"), ipc.shm_name("b")])
    assert launch_segments(ipc.shm_prefix) == []
    assert launch_segments(other.shm_prefix) == [other.shm_name("a")]
    keep.close()
    remove_run_dir(other)
    a.close()  # unlink of an already-removed segment is not an error
    b.close()
    with pytest.raises(ValueError):
        remove_launch_segments("stride-")


def test_step_buffers_create_attach_close(ipc: IpcConfig) -> None:
    from stride.config import CacheConfig, SchedulerConfig
    from stride.ipc.layouts import StepBuffers, StepLayout

    layout = StepLayout.from_config(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                                    max_model_len=256), CacheConfig(block_size=16))
    made = StepBuffers.create(ipc, layout)
    seen = StepBuffers.attach(ipc, layout)
    assert made.block_tables.shape == (8, 16) and (seen.block_tables == -1).all()
    made.token_ids[:3] = [5, 6, 7]
    assert list(seen.token_ids[:3]) == [5, 6, 7]
    seen.close()
    assert len(launch_segments(ipc.shm_prefix)) == len(layout.all_fields())
    made.close()
    assert launch_segments(ipc.shm_prefix) == []


def test_run_dir_is_private_and_removed() -> None:
    cfg = make_ipc_config()
    mode = stat.S_IMODE(os.stat(cfg.run_dir).st_mode)
    assert mode == 0o700
    assert cfg.address("scheduler").startswith(f"ipc://{cfg.run_dir}/")
    assert cfg.shm_name("x").startswith(f"stride-{cfg.launch_id}-")
    ctx = zmq.Context()
    pull: PullQueue[m.StepDone] = PullQueue(ctx, cfg.scheduler_address(), (m.StepDone,))
    assert os.path.exists(os.path.join(cfg.run_dir, "scheduler.sock"))
    pull.close()
    ctx.term()
    remove_run_dir(cfg)
    assert not os.path.exists(cfg.run_dir)
    # Two launches never share a directory or a segment prefix.
    a, b = make_ipc_config(), make_ipc_config()
    assert a.run_dir != b.run_dir and a.shm_prefix != b.shm_prefix
    remove_run_dir(a)
    remove_run_dir(b)


def test_run_dir_path_too_long_is_refused(tmp_path) -> None:
    deep = tmp_path / ("x" * 90)
    deep.mkdir()
    with pytest.raises(ValueError, match="too long"):
        make_ipc_config(str(deep))
