#!/usr/bin/env python
"""Stride against llama.cpp's ``llama-server`` on the same GGUF, same machine, same load: the CPU peer benchmark.

Builds ``llama-server`` once for this CPU from the llama.cpp source that the ``llama-cpp-python`` sdist vendors
(a pinned release from PyPI, the only registry a fresh machine reaches), with the flags ``../shared/FACTS.md`` found
best on these machines: native detection off (its AMX path crashes here), AMX off, and each of AVX-512, its VNNI and
BF16 parts and AVX-VNNI on where this CPU has it (an AVX2-only CPU gets an AVX2 build: an AVX-512 one dies there).
Then, one server at a time so they never share the cores, it starts each, runs the same ``stride bench`` load
(streaming chat, temperature 0, ``--output-len`` tokens, ``--ignore-eos``) at every ``--concurrency``, stops it,
and prints both with Stride's ratio per figure and the issue's targets (>= 0.5x llama.cpp's output tok/s at one
client, >= 1.5x at 16, TTFT p99 at 16 below llama.cpp's, Stride's worker below 1 GB). Each server's memory is its
largest process's RSS (Stride's worker), read from /proc after each load: after this short load the KV pool is not
yet whole, as it is after a long run (perf-log, 2026-12-07), so it says less than a long run does.

    .venv/bin/python scripts/bench_peer.py                     # the default model, 1 and 16 clients
    .venv/bin/python scripts/bench_peer.py --stride-args "--dtype bfloat16" --concurrency 1,4,16
    .venv/bin/python scripts/bench_peer.py --pairs 3             # three launches of each, in turn: medians

On a noisy machine one launch of each says little (this 2-core kind moved a 16-client ratio from 1.34x to 1.69x
between sessions with the same code): ``--pairs N`` launches each server N times in turn and reports medians, the
ratio as the median of the pairs' own ratios, and each pair's.

The build takes about 8 minutes on 2 cores and lands in ``--build-dir`` (kept for later runs).

``--isa avx2`` measures both as they run on an AVX2-only CPU (most laptops before 2022, a Zen 3), on a machine with
more: llama.cpp built for AVX2 alone, and Stride with torch and oneDNN held to AVX2 (``ATEN_CPU_CAPABILITY=avx2``,
``ONEDNN_MAX_CPU_ISA=AVX2``), which its worker's choices follow (``stride.workers.cpu_int4.cpu_flags``). The caches,
memory and clocks stay this machine's: a figure for the paths, not for such a CPU. ``--isa avx512`` holds oneDNN
below AMX (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``: a CPU with AVX-512 BF16 and no AMX, as the issue's first machine
and the Zen 4s were); llama.cpp's build has AMX off already.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stride.client import bench  # noqa: E402
from stride.model.files import default_model_path  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"
"""The ``llama-cpp-python`` release whose vendored llama.cpp is built."""

BASE_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
              "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF",
              "-DCMAKE_BUILD_TYPE=Release")
OPTIONAL_FLAGS = (("GGML_AVX512", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
                  ("GGML_AVX512_VNNI", {"avx512f", "avx512_vnni"}), ("GGML_AVX512_BF16", {"avx512f", "avx512_bf16"}),
                  ("GGML_AVX_VNNI", {"avx_vnni"}))
"""A ggml instruction set option, and the /proc/cpuinfo flags it needs."""


def cmake_flags(cpu_flags: set[str]) -> tuple[str, ...]:
    """The build's flags for a CPU with ``cpu_flags``: every optional instruction set it has, on; the rest off."""
    return BASE_FLAGS + tuple(f"-D{name}={'ON' if need <= cpu_flags else 'OFF'}" for name, need in OPTIONAL_FLAGS)


def build_llama_server(build_dir: Path, jobs: int) -> Path:
    """``llama-server`` built in ``build_dir`` for this CPU's instruction sets (nothing done if that build is there
    already: each set of flags has its own build folder, so a machine of another kind never reuses it)."""
    from stride.workers.cpu_int4 import cpu_flags

    flags = cmake_flags(cpu_flags())
    on = [f[len("-DGGML_"):-len("=ON")].lower() for f in flags[len(BASE_FLAGS):] if f.endswith("=ON")]
    build = build_dir / "-".join(["build", "avx2", *on])
    binary = build / "bin" / "llama-server"
    if binary.exists():
        return binary
    build_dir.mkdir(parents=True, exist_ok=True)
    source = build_dir / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        index = "https://pypi.org/pypi/llama-cpp-python/json"
        with urllib.request.urlopen(index) as resp:
            urls = json.load(resp)["releases"][LLAMA_CPP_PYTHON]
        # A mirror may answer with links relative to the index.
        sdist = urllib.parse.urljoin(index, next(u["url"] for u in urls if u["packagetype"] == "sdist"))
        archive = build_dir / "llama_cpp_python.tar.gz"
        print(f"downloading {sdist}", flush=True)
        urllib.request.urlretrieve(sdist, archive)
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(source, members=[m for m in members if m.name], filter="data")
        archive.unlink()
    print(f"building llama-server in {build_dir} (about 8 minutes on 2 cores)", flush=True)
    generator = ["-G", "Ninja"] if subprocess.run(["which", "ninja"], capture_output=True).returncode == 0 else []
    print(f"cmake flags: {' '.join(flags)}", flush=True)
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *generator, *flags],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
                   check=True)
    return binary


def wait_ready(base_url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout:.0f} s")


def wait_compiled(log_path: Path, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """A Stride worker building its compiled CPU decode step (the first start on a machine) serves eagerly until it
    is ready: wait for it, so the figures are those of every later start."""
    if b"compiling the decode step" not in log_path.read_bytes():
        return
    print("waiting for Stride's compiled decode step to build (the first start on this machine)", flush=True)
    deadline = time.monotonic() + timeout
    while not re.search(rb"compiled decode step built|compiled decode step failed|could not load the compiled",
                        log_path.read_bytes()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the compiled decode step did not build (see {log_path})")
        time.sleep(1)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def largest_process(root: int) -> tuple[int, int] | None:
    """(RSS, peak RSS) in bytes of the process with the most resident memory among ``root`` and its descendants
    (Stride's worker; llama-server itself), or None where there is no /proc to read."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            # The state and parent follow the command's closing parenthesis (the command may hold spaces).
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    best: tuple[int, int] | None = None
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
            rss, peak = (int(status[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))
        except (OSError, KeyError, ValueError):
            continue
        if best is None or rss > best[0]:
            best = (rss, peak)
    return best


def run_load(base_url: str, args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    load = parser.parse_args(["--base-url", base_url, "--endpoint", "chat", "--input-len", str(args.input_len),
                              "--output-len", str(args.output_len), "--ignore-eos", "--no-progress",
                              "--max-concurrency", str(concurrency),
                              "--num-requests", str(max(args.min_requests, args.rounds * concurrency))])
    summary, _ = asyncio.run(bench.run_benchmark(load))
    print(bench.format_summary(summary), flush=True)
    return summary


def serve_and_measure(name: str, command: list[str], base_url: str, args: argparse.Namespace,
                      log_path: Path) -> dict[int, dict[str, Any]]:
    print(f"\n=== {name}: {shlex.join(command)}", flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(base_url, proc, args.ready_timeout)
        wait_compiled(log_path, proc, args.ready_timeout)
        out = {}
        for c in args.concurrency:
            print(f"--- {name}, {c} concurrent", flush=True)
            out[c] = run_load(base_url, args, c)
            memory = largest_process(proc.pid)
            if memory is not None:
                out[c]["rss_mb"], out[c]["peak_rss_mb"] = (b / 1e6 for b in memory)
                print(f"largest process after it: RSS {memory[0] / 1e6:.0f} MB (peak {memory[1] / 1e6:.0f})",
                      flush=True)
        return out
    finally:
        stop(proc)


def print_report(results: dict[str, list[dict[int, dict[str, Any]]]], concurrency: list[int]) -> None:
    """The table (each server's median over its launches; Stride's ratio the median of the pairs' ratios, each pair's
    listed where there are several) and the issue's targets, judged on those medians."""
    names = ("llama.cpp", "stride")
    figures: tuple[tuple[str, Callable[[dict[str, Any]], float]], ...] = (
        ("output tok/s", lambda s: s["output_throughput"]), ("ITL p50 ms", lambda s: s["itl_ms"]["p50"]),
        ("TTFT p99 ms", lambda s: s["ttft_ms"]["p99"]),
        ("largest process RSS MB", lambda s: s.get("rss_mb", math.nan)))
    pairs = min(len(results.get(k, [])) for k in names) if all(k in results for k in names) else 0

    def median(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    def ratio(c: int, get: Callable[[dict[str, Any]], float]) -> tuple[float, list[float]]:
        each = [get(results["stride"][i][c]) / get(results["llama.cpp"][i][c]) for i in range(pairs)]
        return median(each), each

    print("\n| clients | figure | llama.cpp | Stride | Stride / llama.cpp |\n| --- | --- | --- | --- | --- |")
    for c in concurrency:
        for label, get in figures:
            vals = [median([get(run[c]) for run in results.get(k, [])]) for k in names]
            r, each = ratio(c, get) if pairs else (float("nan"), [])
            by_pair = f" (pairs: {', '.join(f'{x:.2f}' for x in each)})" if pairs > 1 else ""
            print(f"| {c} | {label} | {vals[0]:.1f} | {vals[1]:.1f} | {r:.2f}{by_pair} |")
    last = max(concurrency)
    rss, peak = (median([run[last].get(k, math.nan) for run in results.get("stride", [])])
                 for k in ("rss_mb", "peak_rss_mb"))
    if not math.isnan(rss):
        print(f"target: Stride's worker below 1 GB: RSS {rss:.0f} MB after {last} clients, peak {peak:.0f} "
              f"({'met' if peak < 1000 else 'not met'}; its KV pool is whole only after a long run)")
    if not pairs:
        return
    for c, want in ((1, 0.5), (16, 1.5)):
        if c in concurrency:
            r, each = ratio(c, figures[0][1])
            verdict = "met" if r >= want else "not met"
            if pairs > 1:
                verdict += f"; {sum(x >= want for x in each)} of {pairs} pairs at or above it"
            print(f"target at {c} client(s): >= {want}x llama.cpp's tok/s: {r:.2f}x ({verdict})")
    if 16 in concurrency:
        a, b = (median([run[16]["ttft_ms"]["p99"] for run in results[k]]) for k in names[::-1])
        print(f"target: TTFT p99 at 16 below llama.cpp's: {a:.0f} ms vs {b:.0f} ms ({'met' if a < b else 'not met'})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="GGUF file (default: Stride's default model)")
    parser.add_argument("--build-dir", default=str(Path.home() / ".cache" / "stride" / "llama.cpp"))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server -t")
    parser.add_argument("--concurrency", default="1,16", help="client counts, comma separated")
    parser.add_argument("--input-len", type=int, default=32, help="prompt words")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="requests per client")
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--stride-args", default="", help="extra arguments to `stride serve`")
    parser.add_argument("--llama-args", default="", help="extra arguments to llama-server")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--only", choices=("both", "stride", "llama.cpp"), default="both")
    parser.add_argument("--pairs", type=int, default=1,
                        help="launches of each server, in turn; figures are medians, ratios the median pair's")
    parser.add_argument("--isa", choices=("native", "avx512", "avx2"), default="native",
                        help="avx2: both servers held to AVX2 (an AVX2-only CPU's paths, on this one); avx512: "
                             "oneDNN held below AMX")
    parser.add_argument("--out-json", default="")
    args = parser.parse_args()
    if args.isa == "avx2":  # before anything reads the CPU's flags; the servers inherit them
        os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    elif args.isa == "avx512":
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    model = args.model or default_model_path()
    base_url = f"http://127.0.0.1:{args.port}"
    build_dir = Path(args.build_dir)
    slots = max(args.concurrency)
    commands: dict[str, tuple[list[str], Path]] = {}
    if args.only in ("both", "llama.cpp"):
        binary = build_llama_server(build_dir, args.threads)
        ctx = slots * (args.input_len * 2 + args.output_len + 64)  # per-slot room: words, template, output
        commands["llama.cpp"] = ([str(binary), "-m", model, "-t", str(args.threads), "-np", str(slots), "-c", str(ctx),
                                  "--threads-http", str(slots + 4),  # its default pool drops connections past it
                                  "--port", str(args.port), *shlex.split(args.llama_args)],
                                 build_dir / "llama-server.log")
    if args.only in ("both", "stride"):
        build_dir.mkdir(parents=True, exist_ok=True)
        commands["stride"] = ([sys.executable, "-m", "stride", "serve", "--model", model, "--port", str(args.port),
                               *shlex.split(args.stride_args)], build_dir / "stride-serve.log")
    # One launch of each server per pair, in turn: on a noisy machine the ratio within a pair is the figure.
    results: dict[str, list[dict[int, dict[str, Any]]]] = {name: [] for name in commands}
    for pair in range(args.pairs):
        for name, (command, log_path) in commands.items():
            label = name if args.pairs == 1 else f"{name} (pair {pair + 1} of {args.pairs})"
            results[name].append(serve_and_measure(label, command, base_url, args, log_path))
    print_report(results, args.concurrency)
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
