"""Beside a CPU worker, the launch's other processes give up priority (launcher.yield_cores); beside a GPU one, or
the simulated backend, they do not."""

from __future__ import annotations

import os

import pytest

from stride.config import WorkerConfig
from stride.launch import launcher


@pytest.mark.parametrize(("worker", "cuda", "want"), [
    (WorkerConfig(device="cpu"), True, 10),
    (WorkerConfig(device=""), False, 10),
    (WorkerConfig(device=""), True, 0),
    (WorkerConfig(device="cuda"), False, 0),
    (WorkerConfig(device="cpu", backend="sim"), False, 0),
])
def test_the_processes_beside_a_cpu_worker_lower_their_priority(worker: WorkerConfig, cuda: bool, want: int,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(launcher, "_cuda_present", lambda: cuda)
    monkeypatch.setattr(os, "nice", calls.append)
    monkeypatch.delenv("STRIDE_CONTROL_NICE", raising=False)
    assert launcher.yield_cores(worker) == want
    assert calls == ([want] if want else [])
    monkeypatch.setenv("STRIDE_CONTROL_NICE", "0")
    calls.clear()
    assert launcher.yield_cores(worker) == 0 and calls == []


def test_a_real_nice_is_applied_in_a_child() -> None:
    """The increment reaches the process (a forked child, so this test's own priority stays)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 0
        try:
            applied = launcher.yield_cores(WorkerConfig(device="cpu"))
            code = 0 if os.getpriority(os.PRIO_PROCESS, 0) == min(before + applied, 19) and applied else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
