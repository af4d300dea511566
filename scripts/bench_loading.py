#!/usr/bin/env python
"""Memory of one tensor-parallel rank's load: what it read, its peak private host memory, its device memory.

Each rank loads in a fresh process of its own (``load_model(tp_rank=r, tp_size=N)``; no process group is needed
to load), so each figure is that rank's alone. Host memory is sampled every 10 ms from ``/proc/self/status``:
``RssAnon`` (private memory: the tensors read and their copies) and ``RssFile`` (pages of the memory-mapped
checkpoint this process has touched, which the page cache shares). Prints figures; asserts nothing.

    python scripts/bench_loading.py --model /dev/shm/llama8b --device cuda --dtype bfloat16 --tp 1,4
    python scripts/bench_loading.py --model /dev/shm/llama8b-q4_1.gguf --device cuda --w4a16 --tp 1,4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def one_rank(model: str, device: str, dtype: str, rank: int, tp: int, w4a16: bool) -> dict[str, float]:
    import torch

    from stride.workers.loader import LoadReport, load_model

    peaks = {"RssAnon": 0, "RssFile": 0}
    done = threading.Event()
    base = _status_kib("RssAnon")

    def sample() -> None:
        while not done.wait(0.01):
            for k in peaks:
                peaks[k] = max(peaks[k], _status_kib(k))

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    report = LoadReport()
    start = time.perf_counter()
    model_ = load_model(model, device, getattr(torch, dtype), tp_rank=rank, tp_size=tp, report=report,
                        w4a16=w4a16)
    seconds = time.perf_counter() - start
    done.set()
    t.join()
    params = sum(p.numel() * p.element_size() for p in [*model_.parameters(), *model_.buffers()])
    device_bytes = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return {"rank": rank, "tp": tp, "seconds": seconds, "read_fraction": report.elements_read / report.elements_total,
            "weights_gib": params / 2**30, "peak_anon_gib": (peaks["RssAnon"] - base) / 2**20,
            "peak_file_gib": peaks["RssFile"] / 2**20, "device_peak_gib": device_bytes / 2**30}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp", default="1,4", help="comma-separated tensor-parallel degrees")
    p.add_argument("--w4a16", action="store_true", help="keep a GGUF's Q4 projections packed")
    p.add_argument("--ranks", default="0", help="which ranks of each degree to load (comma-separated, or 'all')")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: "rank,tp" in this process
    a = p.parse_args()
    if a.one:
        rank, tp = (int(x) for x in a.one.split(","))
        print(json.dumps(one_rank(a.model, a.device, a.dtype, rank, tp, a.w4a16)))
        return 0
    print(f"{'tp':>3} {'rank':>4} {'read':>6} {'weights GiB':>11} {'host anon GiB':>13} {'host file GiB':>13} "
          f"{'device GiB':>10} {'s':>6}")
    for tp in (int(x) for x in a.tp.split(",")):
        ranks = range(tp) if a.ranks == "all" else [int(r) for r in a.ranks.split(",") if int(r) < tp]
        for rank in ranks:
            cmd = [sys.executable, __file__, "--model", a.model, "--device", a.device, "--dtype", a.dtype,
                   "--one", f"{rank},{tp}", *(["--w4a16"] if a.w4a16 else [])]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{tp:>3} {rank:>4} {r['read_fraction']:>6.1%} {r['weights_gib']:>11.2f} {r['peak_anon_gib']:>13.2f} "
                  f"{r['peak_file_gib']:>13.2f} {r['device_peak_gib']:>10.2f} {r['seconds']:>6.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
