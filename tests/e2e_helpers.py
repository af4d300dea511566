"""End-to-end test support: a real ``stride serve`` launch in a subprocess, and what is left of it.

:class:`StrideServer` starts the launcher with ``--port 0``, reads the bound port, the runtime directory
and the launch id from its stderr, and stops it with SIGTERM. The process tree, the shared-memory
segments (``/dev/shm/stride-<launch>-*``) and the runtime directory are found through ``/proc`` and the
file system, so a test can check that nothing survives a shutdown.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from stride.ipc.codec import Decoder, encode
from stride.ipc.messages import TO_CLIENT, ClientOutput, Message

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
_SERVING = re.compile(r"serving (\S+) on http://([\d.]+):(\d+) .*client library: ipc://(\S+)/client\.sock")


def wait_for(pred: Callable[[], object], timeout_s: float = 10.0) -> bool:
    """Poll ``pred`` until it is true (returns True) or the timeout passes (returns False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return bool(pred())


class StrideServer:
    """``python -m stride serve --port 0 ARGS`` as a context manager; stderr is kept in :attr:`log`."""

    def __init__(self, *args: str) -> None:
        # float32 unless a test says otherwise: the tests' references are float32 (on a CPU with native bf16 the
        # served default is bf16).
        self.args = ["--port", "0", *(() if "--dtype" in args else ("--dtype", "float32")), *args]
        self.log: list[str] = []
        self.proc: subprocess.Popen[str] | None = None
        self.model = ""
        self.url = ""
        self.run_dir = ""
        self.launch_id = ""

    # -------------------------------------------------------------- life

    def start(self) -> StrideServer:
        # One intra-op thread: the server shares two cores with the test process (and, on a developer's
        # machine, with other jobs), and OpenMP's spinning threads collapse under oversubscription
        # (a batch-1 decode step measured 160 ms with one thread, 960 ms with two, on a loaded 2-core box).
        env = dict(os.environ, STRIDE_LOG_LEVEL="WARNING", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "stride", "serve", *self.args], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        ready = threading.Event()
        threading.Thread(target=self._read_stderr, args=(ready,), daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("stride serve did not come up:\n" + self.tail())
        return self

    def _read_stderr(self, ready: threading.Event) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:  # read to the end, so the pipe never fills and blocks the launcher
            self.log.append(line.rstrip("\n"))
            found = _SERVING.search(line)
            if found:
                self.model, host, port, self.run_dir = found[1], found[2], found[3], found[4]
                self.url = f"http://{host}:{port}"
                self.launch_id = Path(self.run_dir).name.split("-")[1]
                ready.set()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM and wait; a launcher that does not exit in time is killed with its children (and the
        test that relied on an orderly stop fails on :meth:`leftovers`). Returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in self.child_pids():
                _kill(pid)
            self.proc.kill()
            self.proc.wait()
            raise

    def __enter__(self) -> StrideServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log[-n:])

    # -------------------------------------------------------------- what runs, what is left

    def child_pids(self) -> dict[str, int]:
        """``{"worker 0": pid, "tokenizer 1": pid, ...}``: the launcher's live children, from /proc."""
        assert self.proc is not None
        out = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # exited while we looked
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            state = stat.rsplit(")", 1)[1].split()[0]
            if ppid == self.proc.pid and state != "Z" and b"--child" in cmd:
                i = cmd.index(b"--child")
                out[f"{cmd[i + 1].decode()} {cmd[i + 2].decode()}"] = int(entry.name)
        return out

    def shm_segments(self) -> list[str]:
        return sorted(p.name for p in Path("/dev/shm").glob(f"stride-{self.launch_id}-*"))

    def leftovers(self) -> list[str]:
        """Every process, segment or runtime directory of this launch still present."""
        assert self.launch_id, "the launch never reported its id"
        left = [f"process {name} (pid {pid})" for name, pid in self.child_pids().items()]
        left += [f"/dev/shm/{name}" for name in self.shm_segments()]
        if os.path.exists(self.run_dir):
            left.append(self.run_dir)
        return left

    # -------------------------------------------------------------- HTTP

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post(self, path: str, body: str | bytes | dict[str, Any], *, method: str = "POST",
             headers: dict[str, str] | None = None, timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        data = data.encode() if isinstance(data, str) else data
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def metric(self, name: str) -> float:
        """The sum of a Prometheus metric's samples on ``/metrics`` (0 when absent)."""
        status, text = self.get("/metrics")
        assert status == 200, text
        total = 0.0
        for line in text.decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


class Dealer:
    """A raw client-library socket (ZeroMQ DEALER), for frames the library itself would never send."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.decoder: Decoder[Message] = Decoder(TO_CLIENT)

    def send(self, msg: Message) -> None:
        self.sock.send(encode(msg))

    def send_raw(self, frame: bytes) -> None:
        self.sock.send(frame)

    def recv(self, timeout_ms: int = 10_000) -> ClientOutput:
        assert self.sock.poll(timeout_ms), "no answer from the frontend"
        msg = self.decoder.decode(self.sock.recv())
        assert isinstance(msg, ClientOutput)
        return msg

    def until_done(self, req_id: str) -> list[ClientOutput]:
        outs = []
        while True:
            out = self.recv()
            assert out.req_id == req_id
            outs.append(out)
            if out.finish_reason is not None or out.error is not None:
                return outs

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
