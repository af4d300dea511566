"""``stride serve``: starts every process of a launch, waits for each to be ready, watches them, and shuts
the launch down in order on SIGTERM/SIGINT or when any process fails -- unlinking every shared-memory
segment and removing the runtime directory, also after a crash.

Start order: the step buffers (this process owns them), then the rank worker and the tokenizer pool
(they load in parallel; the worker reports how many KV blocks it sized on a GPU), then the scheduler
(which needs that number and the end-of-sequence ids), then the frontend. Children are plain
subprocesses (``python -m stride.launch.launcher --child ROLE INDEX``) that read their configuration as one line of
JSON on stdin: nothing is pickled.

No child outlives the launcher. Its end of each child's stdin stays open for the launch's life, and nothing more
is written to it: a child that reads end-of-file knows the launcher is gone, however it died (SIGKILL included),
removes the launch's shared-memory segments and runtime directory, and exits at once. A launch whose processes
were all killed together is cleaned up by the next launch under the same runtime root
(:func:`~stride.ipc.rundir.sweep_stale_launches`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

import orjson
import zmq

from stride import env
from stride.config import (
    KV_DTYPES,
    CacheConfig,
    IpcConfig,
    LaunchFacts,
    SchedulerConfig,
    ServerConfig,
    StrideConfig,
    WorkerConfig,
)
from stride.ipc import messages as m
from stride.ipc.layouts import MaskBuffer, StepBuffers, StepLayout
from stride.ipc.queues import PullQueue, PushQueue
from stride.ipc.rundir import make_ipc_config, remove_run_dir, sweep_stale_launches, write_owner
from stride.ipc.shm import remove_launch_segments
from stride.model.files import default_model_path, model_context_length

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0
GPU_BATCHED_TOKENS = 8192
"""A CUDA worker's default step budget. On an H200 serving an 8B bf16 model, 1,024 in / 1,024 out at 256
concurrent: 1.05x the output tok/s of 2,048 (fewer steps carry prefill chunks: 34 against 137) and TTFT p50 4.0
against 5.2 s, inter-token p99 347 against 302 ms (docs/perf-log.md, 2026-12-02)."""


class LaunchError(RuntimeError):
    """A process failed to start or died; the message says which and why."""


class Launch:
    """One running deployment: its processes, its sockets and its shared memory."""

    def __init__(self, config: StrideConfig, *, quiet: bool = False, stop: list[bool] | None = None) -> None:
        self.config = config
        # Set by the signal handler; checked while starting too, so Ctrl-C during a long load stops it.
        self.stop = stop if stop is not None else [False]
        self.quiet = quiet
        write_owner(config.ipc)
        sweep_stale_launches(os.path.dirname(config.ipc.run_dir), keep=config.ipc.run_dir)
        self.ctx = zmq.Context()
        self.control: PullQueue[m.Message] = PullQueue(self.ctx, config.ipc.control_address(), m.TO_LAUNCHER)
        self.buffers = StepBuffers.create(config.ipc, StepLayout.from_config(config.scheduler, config.cache))
        self.masks: MaskBuffer | None = None
        self.procs: dict[tuple[str, int], subprocess.Popen[bytes]] = {}
        self._lifelines: list[IO[bytes]] = []  # each child's stdin: closed only when the launch is over
        self.ready: dict[tuple[str, int], m.ProcessReady] = {}
        self.port = 0
        self._closed = False
        self._last_shown = -1.0  # the last loading progress shown
        self._heard: dict[tuple[str, int], float] = {}  # serving rank → when its last heartbeat came
        self._control_handlers: dict[type, Callable[[Any], None]] = {
            m.ProcessReady: self._on_ready, m.ProcessFailed: self._on_failed, m.Progress: self._on_progress,
            m.Heartbeat: self._on_heartbeat}

    # -------------------------------------------------------------- start

    def _spawn(self, role: str, index: int, config: StrideConfig) -> None:
        payload = orjson.dumps(config.to_dict())
        proc = subprocess.Popen([sys.executable, "-m", "stride.launch.launcher", "--child", role, str(index)],
                                stdin=subprocess.PIPE, start_new_session=False)
        assert proc.stdin is not None
        proc.stdin.write(payload + b"\n")
        proc.stdin.flush()
        self._lifelines.append(proc.stdin)
        self.procs[(role, index)] = proc

    def _await_ready(self, wanted: set[tuple[str, int]], what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while wanted - self.ready.keys():
            if self.stop[0]:
                raise LaunchError(f"stopped while waiting for {what}")
            if time.monotonic() > deadline:
                raise LaunchError(f"timed out waiting for {what}")
            self._check_alive()
            self._control_once(100)

    def _control_once(self, timeout_ms: int) -> None:
        """Handle the next control message, if one comes within ``timeout_ms``."""
        msg = self.control.get(timeout_ms=timeout_ms)
        if msg is not None:
            self._control_handlers[type(msg)](msg)

    def _on_ready(self, msg: m.ProcessReady) -> None:
        self.ready[(msg.role, msg.index)] = msg
        if msg.role == "worker":  # it beats from now on
            self._heard[(msg.role, msg.index)] = time.monotonic()

    def _on_heartbeat(self, msg: m.Heartbeat) -> None:
        self._heard[(msg.role, msg.index)] = time.monotonic()

    def _on_failed(self, msg: m.ProcessFailed) -> None:
        raise LaunchError(f"{msg.role} {msg.index} failed: {msg.error}")

    def _on_progress(self, msg: m.Progress) -> None:
        if not self.quiet and (msg.fraction - self._last_shown >= 0.1 or msg.fraction < self._last_shown):
            self._last_shown = msg.fraction  # (a smaller fraction: a new phase began)
            print(f"  {msg.role}: {msg.message} {msg.fraction:4.0%}", file=sys.stderr, flush=True)

    def start(self) -> None:
        cfg = self.config
        what = "simulated backend, cost model of" if cfg.worker.backend == "sim" else "model"
        self._say(f"stride: loading {what} {cfg.worker.model}")
        for i in range(cfg.server.tokenizer_workers):
            self._spawn("tokenizer", i, cfg)
        tokenizers = {("tokenizer", i) for i in range(cfg.server.tokenizer_workers)}
        if cfg.worker.backend == "sim":
            # Simulated tokens must be ids the tokenizer can decode: the worker waits for its vocabulary.
            self._await_ready(tokenizers, "the tokenizer pool")
            tok = self.ready[("tokenizer", 0)]
            cfg = dataclasses.replace(cfg, facts=LaunchFacts(vocab_size=tok.vocab_size,
                                                             eos_token_ids=tuple(tok.eos_token_ids)))
            self._spawn("worker", 0, cfg)
            self._await_ready({("worker", 0)}, "the simulated worker")
        else:
            ranks = {("worker", r) for r in range(cfg.worker.tensor_parallel_size)}
            for _, r in sorted(ranks):  # they load while the tokenizers do
                self._spawn("worker", r, cfg)
            self._await_ready(tokenizers | ranks, "the worker ranks and the tokenizer pool")
        # The ranks agreed on one block count already (the smallest); the minimum here says so again.
        num_blocks = min(msg.num_blocks for (role, _), msg in self.ready.items() if role == "worker")
        facts = LaunchFacts(vocab_size=self.ready[("worker", 0)].vocab_size,
                            eos_token_ids=tuple(self.ready[("tokenizer", 0)].eos_token_ids))
        self.config = cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, num_blocks=num_blocks),
                                                facts=facts)
        # The structured-output bitmask needs the vocabulary, which rank 0 just reported.
        self.masks = MaskBuffer.create(cfg.ipc, cfg.scheduler.max_num_seqs, facts.vocab_size)
        self._spawn("scheduler", 0, cfg)
        self._await_ready({("scheduler", 0)}, "the scheduler")
        self._spawn("frontend", 0, cfg)
        self._await_ready({("frontend", 0)}, "the frontend")
        frontend = self.ready[("frontend", 0)]
        self.port = frontend.port
        kv_tokens = num_blocks * cfg.cache.block_size
        self._say(f"stride: serving {frontend.model} on http://{cfg.server.host}:{self.port} "
                  f"({num_blocks} KV blocks = {kv_tokens} tokens); client library: {cfg.ipc.client_address()}")

    def _say(self, text: str) -> None:
        if not self.quiet:
            print(text, file=sys.stderr, flush=True)

    # -------------------------------------------------------------- watch

    def _check_alive(self) -> None:
        for (role, index), proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                raise LaunchError(f"{role} {index} exited with status {code}")
        now, limit = time.monotonic(), self.config.worker.hang_timeout_s
        for (role, index), heard in self._heard.items():
            if now - heard > limit:
                # A hung rank is killed (SIGKILL reaches a stopped process too): its peers' collectives then fail
                # at once instead of waiting out their timeout.
                self.procs[(role, index)].kill()
                raise LaunchError(f"{role} {index} sent no heartbeat for {now - heard:.1f} s: hung; killed it")

    def watch(self) -> int:
        """Until the stop flag is set (a signal) or a process fails. Returns the exit status."""
        while not self.stop[0]:
            try:
                self._check_alive()
                self._control_once(200)
            except LaunchError as e:
                log.error("%s; shutting down", e)
                self._fail_in_flight(str(e))
                return 1
        return 0

    def _fail_in_flight(self, reason: str) -> None:
        """Tell the frontend the model is gone, so clients get errors now rather than a hang."""
        if self.procs.get(("frontend", 0)) is None or self.procs[("frontend", 0)].poll() is not None:
            return
        push: PushQueue[m.Message] = PushQueue(self.ctx, self.config.ipc.frontend_address())
        push.put(m.RequestFailed("", 503, f"the server is shutting down: {reason}", "worker_dead"))
        push.close()
        time.sleep(0.5)  # let the frontend answer its clients before it is told to stop

    # -------------------------------------------------------------- stop

    def close(self) -> None:
        """Stop every process (frontend first, so no new work arrives) and remove every resource."""
        if self._closed:
            return
        self._closed = True
        order = ["frontend", "tokenizer", "scheduler", "worker"]
        addresses = {"frontend": lambda i: self.config.ipc.frontend_address(),
                     "tokenizer": self.config.ipc.tokenizer_address,
                     "scheduler": lambda i: self.config.ipc.scheduler_address(),
                     "worker": lambda i: (self.config.ipc.worker_address() if i == 0
                                          else self.config.ipc.worker_rank_address(i))}
        for role in order:
            for (r, index), proc in self.procs.items():
                if r == role and proc.poll() is None:
                    push: PushQueue[m.Message] = PushQueue(self.ctx, addresses[role](index))
                    push.put(m.Shutdown("launcher"))
                    push.close()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for lifeline in self._lifelines:
            with contextlib.suppress(OSError):
                lifeline.close()
        self.control.close()
        self.ctx.destroy(linger=0)
        self.buffers.close()
        if self.masks is not None:
            self.masks.close()
        left = remove_launch_segments(self.config.ipc.shm_prefix)
        if left:
            log.warning("removed shared-memory segments a process left behind: %s", left)
        remove_run_dir(self.config.ipc)


# ------------------------------------------------------------------ CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="", help="HF checkpoint directory or GGUF file (default: SmolLM2-135M)")
    p.add_argument("--backend", choices=("torch", "sim"), default=WorkerConfig.backend,
                   help="torch: run the model; sim: simulated step times from the planner's cost model")
    p.add_argument("--gpu", default=WorkerConfig.gpu, help="GPU of the simulated backend's cost model")
    p.add_argument("--tp", type=int, default=WorkerConfig.tensor_parallel_size,
                   help="tensor-parallel ranks: one worker process per GPU (gloo on the CPU); with the simulated "
                        "backend, the cost model's")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="default: STRIDE_DEVICE, else CUDA when present")
    p.add_argument("--dtype", default=WorkerConfig.dtype, choices=("", "float32", "bfloat16", "float16"),
                   help="weights and activations (default: bfloat16 on a GPU and on a CPU with native bf16, else "
                        "float32)")
    p.add_argument("--kv-dtype", default=WorkerConfig.kv_dtype, choices=KV_DTYPES,
                   help="KV cache dtype: auto (the run dtype) or fp8 (float8_e4m3fn: twice the blocks, half the "
                        "decode attention's reads, each key and value rounded to 3 mantissa bits)")
    p.add_argument("--threads", type=int, default=WorkerConfig.num_threads,
                   help="CPU threads of the worker's torch ops (default: one on a GPU, one per core on a CPU)")
    p.add_argument("--quantize", default=WorkerConfig.quantize, metavar="none|w4a16|w4a16-g<N>",
                   help="quantise the projections to 4 bits at load (groups of 128 inputs, or N) and run them on "
                        "the W4A16 GEMM (default: as stored; a GGUF's Q4 projections are 4-bit on the GPU anyway)")
    p.add_argument("--rank-hang-timeout", type=float, default=WorkerConfig.hang_timeout_s, metavar="SECONDS",
                   help="a worker rank silent this long is taken as hung: the launch fails its requests and ends")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly (no CUDA graphs for decode steps; on a CPU, no compiled decode step)")
    p.add_argument("--host", default=ServerConfig.host)
    p.add_argument("--port", type=int, default=ServerConfig.port, help="0 picks a free port")
    p.add_argument("--served-model-name", default=ServerConfig.model_name)
    p.add_argument("--tokenizer-workers", type=int, default=ServerConfig.tokenizer_workers)
    p.add_argument("--api-keys", default=ServerConfig.api_keys_file,
                   help="file of 'KEY TENANT' lines; requests then need a key")
    p.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes,
                   help="largest HTTP request body and client-library message; larger ones are refused unread")
    p.add_argument("--max-prompt-chars", type=int, default=ServerConfig.max_prompt_chars,
                   help="most characters of a prompt, refused before tokenizing "
                        "(default: 16 per token of the context)")
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help=f"token budget of one step, decodes first, then prefill chunks (default: "
                        f"{GPU_BATCHED_TOKENS} on a CUDA worker, {SchedulerConfig.max_num_batched_tokens} on a CPU "
                        "and the simulated backend)")
    p.add_argument("--max-waiting-requests", type=int, default=SchedulerConfig.max_waiting_requests,
                   help="waiting-queue bound; past it new requests get 429 with Retry-After")
    p.add_argument("--max-model-len", type=int, default=0, help="default: the model's context length")
    p.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    p.add_argument("--num-blocks", type=int, default=0,
                   help=f"KV blocks in the pool (default: {CacheConfig.num_blocks} on a CPU and with the simulated "
                        "backend; on CUDA all that the memory left after the weights holds, and a count given there "
                        "is refused at start if that memory does not hold it)")
    p.add_argument("--gpu-memory-utilization", type=float, default=WorkerConfig.gpu_memory_utilization,
                   help="share of each GPU's memory the worker may take for weights, activations and KV cache")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-overlap", action="store_true",
                   help="one step in flight at a time (default: the next step is built while one runs)")
    p.add_argument("--trace", default=SchedulerConfig.trace_path,
                   help="record the scheduler's decisions to this JSON-lines file")
    p.add_argument("--address-file", default="",
                   help="once serving, write the client-library address and HTTP URL here as JSON "
                        "(removed at shutdown); see stride.client.Client.from_address_file")


def config_from_args(args: argparse.Namespace) -> StrideConfig:
    model = args.model or default_model_path()
    tokenizer = ""
    if args.backend == "torch" and not os.path.exists(model):
        raise SystemExit(f"stride serve: model not found: {model}")
    if args.backend == "sim" and not os.path.exists(model):
        tokenizer = default_model_path()  # a catalog model (e.g. llama-3.1-70b) has no tokenizer files here
    if args.backend == "torch" and args.tp > 1:
        _check_tensor_parallel(model, args.tp)
    trained = model_context_length(model) if os.path.exists(model) else 0
    max_len = args.max_model_len or trained or 4096
    if trained and max_len > trained:
        raise SystemExit(f"stride serve: --max-model-len {max_len} exceeds the model's context ({trained})")
    return StrideConfig(
        ipc=make_ipc_config(),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks or CacheConfig.num_blocks,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_model_len=max_len,
                                  max_num_batched_tokens=args.max_num_batched_tokens
                                  or default_batched_tokens(args.backend, args.device or env.DEVICE.get()),
                                  max_waiting_requests=args.max_waiting_requests, trace_path=args.trace,
                                  overlap=not args.no_overlap),
        worker=WorkerConfig(model=model, tokenizer=tokenizer, backend=args.backend, dtype=args.dtype, gpu=args.gpu,
                            tensor_parallel_size=args.tp, num_threads=args.threads, kv_dtype=args.kv_dtype,
                            cuda_graphs=not args.enforce_eager, quantize=args.quantize,
                            cpu_compile=not args.enforce_eager and env.CPU_COMPILE.get_bool(),
                            hang_timeout_s=args.rank_hang_timeout, num_gpu_blocks=args.num_blocks,
                            gpu_memory_utilization=args.gpu_memory_utilization,
                            **({"device": args.device} if args.device else {})),
        server=ServerConfig(host=args.host, port=args.port, tokenizer_workers=args.tokenizer_workers,
                            api_keys_file=args.api_keys, model_name=args.served_model_name,
                            max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars),
    )


def default_batched_tokens(backend: str, device: str) -> int:
    """The step budget when ``--max-num-batched-tokens`` is not given: :data:`GPU_BATCHED_TOKENS` where the worker
    runs on CUDA, the scheduler config's default elsewhere (on a CPU a chunk of 8,192 prompt tokens would hold every
    stream's next token for seconds). ``device`` empty: CUDA when present, as the worker decides."""
    if backend != "torch" or device == "cpu":
        return SchedulerConfig.max_num_batched_tokens
    if device == "cuda" or _cuda_present():
        return GPU_BATCHED_TOKENS
    return SchedulerConfig.max_num_batched_tokens


def _cuda_present() -> bool:
    """Whether the worker will find CUDA. Without NVIDIA's driver device there is none, and the launcher does not
    import torch just to hear that (a second or two of start-up on a CPU)."""
    if not os.path.exists("/dev/nvidiactl"):
        return False
    import torch

    return bool(torch.cuda.is_available())


def _check_tensor_parallel(model: str, tp: int) -> None:
    """Refuse, before anything loads, a split the model's shape does not allow (the planner's rules)."""
    from stride.planner.geometry import load_geometry
    from stride.planner.parallel import Parallelism, check_parallelism

    geometry = load_geometry(model)
    problems = check_parallelism(geometry, Parallelism(tp=tp))
    if problems:
        raise SystemExit(f"stride serve: --tp {tp} cannot split {model}: " + "; ".join(problems))


def write_address_file(path: str, launch: Launch) -> None:
    """Where a started launch can be reached, as JSON; written whole (rename) so a reader never sees half."""
    cfg = launch.config
    body = {"client_address": cfg.ipc.client_address(), "http_url": f"http://{cfg.server.host}:{launch.port}",
            "model": launch.ready[("frontend", 0)].model, "shm_prefix": cfg.ipc.shm_prefix,
            "pid": os.getpid()}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(orjson.dumps(body))
    os.replace(tmp, path)


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"stride serve: {e}", file=sys.stderr)
        return 2
    stop = [False]

    def on_signal(signum: int, frame: Any) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    launch = None
    wrote_address = False
    try:
        launch = Launch(config, stop=stop)
        launch.start()
        if args.address_file:
            write_address_file(args.address_file, launch)
            wrote_address = True
        return launch.watch()
    except LaunchError as e:
        print(f"stride serve: {e}", file=sys.stderr)
        return 1
    finally:
        if wrote_address:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(args.address_file)
        if launch is not None:
            launch.close()
        else:
            remove_launch_segments(config.ipc.shm_prefix)
            remove_run_dir(config.ipc)


# ------------------------------------------------------------------ child processes


def _exit_with_launcher(fd: int, ipc: IpcConfig, role: str, index: int) -> None:
    """A child's watch on its launcher (a daemon thread): ``fd`` is the launcher's pipe, which sends nothing after
    the configuration, so end-of-file means the launcher has gone. Then remove what the launch holds and exit at
    once, whatever the main thread is doing. (The raw descriptor, not ``sys.stdin``: a daemon thread blocked in a
    buffered reader holds its lock, and the interpreter aborts when it closes stdin at exit.)"""
    with contextlib.suppress(OSError):
        while os.read(fd, 4096):
            pass
    log.error("%s %d: the launcher is gone; removing the launch's files and exiting", role, index)
    with contextlib.suppress(Exception):
        remove_launch_segments(ipc.shm_prefix)
        remove_run_dir(ipc)
    logging.shutdown()
    os._exit(1)


def _read_line(fd: int) -> bytes:
    """One line from ``fd``, read unbuffered so nothing after it is taken from the pipe."""
    out = bytearray()
    while not out.endswith(b"\n"):
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        out += chunk
    return bytes(out)


def yield_cores(worker: WorkerConfig) -> int:
    """In a process beside a CPU worker (frontend, tokenizer, scheduler): lower this process's priority by
    ``STRIDE_CONTROL_NICE``, so that its bursts of work per token do not preempt the worker's threads (a preempted
    thread stalls the worker's whole thread team at its next barrier: a step of the default model took 2.5x as long
    with a busy loop beside it on a 2-core machine; docs/perf-log.md). Returns the increment applied."""
    on_cpu = worker.backend == "torch" and (worker.device == "cpu" or (not worker.device and not _cuda_present()))
    step = env.CONTROL_NICE.get_int() if on_cpu else 0
    if step > 0:
        try:
            os.nice(step)
        except OSError:  # not allowed here: run as we are
            return 0
    return max(step, 0)


def child_main(role: str, index: int) -> int:
    """Entry of a child process: configuration from the first line of stdin, then the role's own loop."""
    logging.basicConfig(level=env.LOG_LEVEL.get().upper(),
                        format=f"%(asctime)s {role}-{index} %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to turn into an orderly stop
    config = StrideConfig.from_dict(orjson.loads(_read_line(0)))
    threading.Thread(target=_exit_with_launcher, args=(0, config.ipc, role, index), daemon=True,
                     name="launcher-watch").start()
    if role == "worker":
        from stride.workers.process import run as run_worker
        return run_worker(config, index)
    yield_cores(config.worker)
    if role == "tokenizer":
        from stride.tokenizer.process import run as run_tokenizer
        return run_tokenizer(config, index)
    if role == "scheduler":
        from stride.sched.process import run as run_scheduler
        return run_scheduler(config)
    if role == "frontend":
        from stride.frontend.app import run as run_frontend
        return run_frontend(config)
    raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2], int(sys.argv[3])))
    sys.exit("usage: python -m stride.launch.launcher --child ROLE INDEX (use `stride serve` to launch)")
