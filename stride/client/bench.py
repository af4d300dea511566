"""``stride bench``: a load generator for any OpenAI-compatible endpoint.

Sends ``--num-requests`` streaming requests of random word prompts (``--input-len`` words, about as many tokens:
common English words are one token each in BPE vocabularies; the report gives the server's own count,
``usage.prompt_tokens``, where it sends one, and ``--input-unit tokens`` sizes the prompts in the server's tokens
from two probe requests) at a Poisson ``--request-rate`` and/or under a ``--max-concurrency`` cap, each asking
for ``--output-len`` tokens (``max_tokens``; ``--ignore-eos`` adds the vLLM/Stride extension so the length is
reached, for servers that accept it). It times every streamed
chunk and reports request throughput, output tokens/s, and TTFT, TPOT, ITL and end-to-end latency
(mean, p50, p90, p99, in ms), as text, as JSON (``--out-json``) and as a PNG plot (``--out-png``).

Output tokens are the server's ``usage.completion_tokens`` when it sends usage in the stream, else the
count of chunks that carried text. TPOT = (latency − TTFT) / (output tokens − 1); ITL = gaps between chunks.

Workloads as deployments see them: ``--range-ratio`` draws each prompt's and output's length around the means;
``--shared-prefix-len N --num-prefixes K`` starts every prompt with one of K shared prefixes of N words (system
prompts, few-shot examples: what a prefix cache is for), followed by its own ``--input-len`` words;
``--sweep-rates 1,2,4`` runs the whole load once per request rate and ends with a table. ``--goodput-ttft-ms``
and ``--goodput-tpot-ms`` set service-level targets: goodput is the rate of requests that completed within both.
Against a Stride server the summary adds the step timeline (where the server's busy time went, from
``/metrics``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import numpy as np

WORDS = ("the of and to in is was for on that with as by at from his her are this which be or an had not "
         "but were have their one all there been has its more when who will would can what out up into "
         "time only other new some could these two may first then do any like my now over such our man me "
         "even most made after also did many before must through back years where much your way well down "
         "should because each just those people how too little state good very make world still own see "
         "men work long get here between both life being under never day same another know while last "
         "might us great old year off come since against go came right used take three").split()


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from the benchmark start."""

    ok: bool = False
    textless: bool = False  # finished, its tokens counted by the server, no chunk of output seen: no token times
    error: str = ""
    prompt_words: int = 0
    prompt_tokens: int = 0  # the server's count (usage.prompt_tokens), 0 where it sent none
    output_tokens: int = 0
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    parser.add_argument("--model", default="", help="model name (default: the first of GET /v1/models)")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                        help="/v1/completions or /v1/chat/completions")
    parser.add_argument("--api-key", default="", help="sent as a Bearer token")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="mean requests/s of Poisson arrivals (default: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=0,
                        help="requests in flight at most (0: no cap)")
    parser.add_argument("--input-len", type=int, default=256,
                        help="prompt length in words (one token each in most BPE vocabularies; the report gives the "
                             "server's count), or in the server's tokens with --input-unit tokens")
    parser.add_argument("--input-unit", choices=("words", "tokens"), default="words",
                        help="what --input-len and --shared-prefix-len count; tokens: two probe requests first "
                             "measure the server's tokens a word (and its template's), and the prompts are sized "
                             "to them (the server must report usage.prompt_tokens)")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="draw lengths uniformly in [len·(1−r), len·(1+r)]")
    parser.add_argument("--shared-prefix-len", type=int, default=0,
                        help="words of a prefix shared by the prompts of a group (0: none)")
    parser.add_argument("--num-prefixes", type=int, default=1,
                        help="distinct shared prefixes; request i gets prefix i mod K")
    parser.add_argument("--sweep-rates", default="", metavar="R1,R2,...",
                        help="run the load once per request rate (requests/s) and print a table")
    parser.add_argument("--goodput-ttft-ms", type=float, default=math.inf,
                        help="TTFT target of a good request (ms)")
    parser.add_argument("--goodput-tpot-ms", type=float, default=math.inf,
                        help="TPOT target of a good request (ms)")
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/Stride extension)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of every request (default 0: greedy)")
    parser.add_argument("--json-schema", default="", metavar="PATH|object",
                        help="hold every output to the JSON schema in PATH (response_format json_schema), or to any "
                             "JSON object: structured outputs' cost against the same load without")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--out-json", default="", help="write the summary and per-request results here")
    parser.add_argument("--out-png", default="", help="write latency plots here (needs matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def make_prompts(num: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                 shared_prefix_len: int = 0, num_prefixes: int = 1) -> list[tuple[str, int, int]]:
    """``num`` (prompt, prompt words, max_tokens) triples, the same for the same seed. With a shared prefix,
    request ``i``'s prompt is prefix ``i mod num_prefixes`` then its own words."""
    rng = random.Random(seed)

    def draw(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    prefixes = [" ".join(rng.choice(WORDS) for _ in range(shared_prefix_len)) for _ in range(num_prefixes)]
    out = []
    for i in range(num):
        words = draw(input_len)
        own = " ".join(rng.choice(WORDS) for _ in range(words))
        prefix = prefixes[i % num_prefixes]
        out.append((f"{prefix} {own}" if prefix else own, words + shared_prefix_len, draw(output_len)))
    return out


def _request_body(args: argparse.Namespace, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True,
                            "temperature": args.temperature,
                            "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.json_schema:
        body["response_format"] = _response_format(args.json_schema)
    return body


def _response_format(spec: str) -> dict[str, Any]:
    """``--json-schema``: ``object`` for any JSON object, else a file holding a JSON schema."""
    if spec == "object":
        return {"type": "json_object"}
    with open(spec) as f:
        return {"type": "json_schema", "json_schema": {"name": "bench", "schema": json.load(f)}}


def _brings_output(chunk: dict[str, Any]) -> bool:
    """Whether a stream chunk carries generated output: text, or a delta with none that is neither the chat
    stream's opening role chunk nor a closing one (a server sends such a chunk for a token that decodes to no text
    yet: a special token, part of a character, or an id past a random checkpoint's byte tokenizer)."""
    choices = chunk.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    delta = choice.get("delta") or {}
    if choice.get("text") or delta.get("content") or delta.get("tool_calls"):
        return True
    return "role" not in delta and choice.get("finish_reason") is None


async def _one_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any], t0: float,
                       result: RequestResult) -> None:
    result.start = time.perf_counter() - t0
    chunks, usage_tokens, last, done = 0, 0, 0.0, False
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    result.prompt_tokens = int(chunk["usage"].get("prompt_tokens") or 0)
                if not _brings_output(chunk):
                    continue
                now = time.perf_counter() - t0
                if chunks == 0:
                    result.ttft = now - result.start
                else:
                    result.itl.append(now - last)
                last, chunks = now, chunks + 1
        result.latency = time.perf_counter() - t0 - result.start
        result.output_tokens = usage_tokens or chunks
        # A stream may finish with tokens counted but no chunk of output (a server that sends no chunk for a token
        # without text): the request completed, but the client saw no token arrive.
        result.textless = chunks == 0 and done and usage_tokens > 0
        result.ok = chunks > 0 or result.textless
        if not result.ok:
            result.error = "no output in the stream"
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"


async def _first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as resp:
        resp.raise_for_status()
        data = await resp.json()
    return str(data["data"][0]["id"])


async def run_benchmark(args: argparse.Namespace, calibration: tuple[float, float] | None = None,
                        ) -> tuple[dict[str, Any], list[RequestResult]]:
    """Run the load described by ``args``; returns the summary and every request's result. With ``--input-unit
    tokens``, ``calibration`` (tokens a word, template tokens) is an earlier run's against the same server, in place
    of this run's probes."""
    from tqdm import tqdm

    base_url = args.base_url.rstrip("/")
    url = f"{base_url}/v1/{'chat/completions' if args.endpoint == 'chat' else 'completions'}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    arrivals = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency > 0 else None
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    # A fresh connection per request: llama.cpp's server closes kept-alive connections that the pool would then
    # reuse, and 7-13 of 48 requests failed at 16 clients ("Can not write request body"), none with this.
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0, force_close=True)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        model = args.model or await _first_model(session, base_url)
        input_words, prefix_words = args.input_len, args.shared_prefix_len
        if args.input_unit != "tokens":
            calibration = None
        elif calibration is None:
            calibration = await calibrate(session, url, args, model)
        if calibration is not None:
            per_word, template = calibration
            input_words = max(1, round((args.input_len - template) / per_word))
            prefix_words = round(args.shared_prefix_len / per_word)
        prompts = make_prompts(args.num_requests, input_words, args.output_len, args.range_ratio, args.seed,
                               prefix_words, args.num_prefixes)
        results = [RequestResult(prompt_words=words) for _, words, _ in prompts]
        bar = tqdm(total=len(prompts), disable=args.no_progress, desc="requests", file=sys.stderr)

        async def send(i: int) -> None:
            body = _request_body(args, model, prompts[i][0], prompts[i][2])
            if limit is None:
                await _one_request(session, url, body, t0, results[i])
            else:
                async with limit:
                    await _one_request(session, url, body, t0, results[i])
            bar.update(1)

        before = await _timeline_counters(session, base_url)
        t0 = time.perf_counter()
        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(send(i)))
            if math.isfinite(args.request_rate) and i + 1 < len(prompts):
                await asyncio.sleep(arrivals.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        after = None
        if before is not None:
            await asyncio.sleep(TIMELINE_LAG_S)  # the scheduler's totals reach /metrics every half second
            after = await _timeline_counters(session, base_url)
    bar.close()
    summary = summarize(results, duration, model, args)
    summary["step_timeline"] = step_timeline(before, after) if before is not None and after is not None else None
    if calibration is not None:
        summary["tokens_per_word"], summary["template_tokens"] = calibration
    return summary, results


CALIBRATION_WORDS = (32, 160)
"""The two probe prompts' sizes in words for ``--input-unit tokens``."""


class CalibrationError(RuntimeError):
    """``--input-unit tokens`` could not size the prompts: the server's counts are missing or make no sense."""


async def calibrate(session: aiohttp.ClientSession, url: str, args: argparse.Namespace,
                    model: str) -> tuple[float, float]:
    """The server's tokens a word of the bench's prompts and the tokens its template adds to a prompt (chat), from
    two probe requests of :data:`CALIBRATION_WORDS` words (one token asked each) and their ``usage.prompt_tokens``."""
    counts = []
    for words in CALIBRATION_WORDS:
        prompt = make_prompts(1, words, 1, 0.0, args.seed + 7)[0][0]
        result = RequestResult()
        await _one_request(session, url, _request_body(args, model, prompt, 1), time.perf_counter(), result)
        if not result.prompt_tokens:
            raise CalibrationError(f"--input-unit tokens: the server gave no usage.prompt_tokens for a probe request "
                               f"({result.error or 'no usage in its stream'})")
        counts.append(result.prompt_tokens)
    (w1, w2), (t1, t2) = CALIBRATION_WORDS, counts
    per_word = (t2 - t1) / (w2 - w1)
    if per_word <= 0:
        raise CalibrationError(f"--input-unit tokens: probes of {w1} and {w2} words counted {t1} and {t2} tokens")
    return per_word, max(0.0, t1 - per_word * w1)


TIMELINE_COUNTERS = ("steps", "step_device_seconds", "step_worker_seconds", "step_round_trip_seconds",
                     "step_gap_seconds", "graph_steps", "graph_step_device_seconds", "early_steps")
"""Stride's step-timeline counters on ``/metrics`` (``stride:<name>_total``)."""
TIMELINE_LAG_S = 0.7


async def _timeline_counters(session: aiohttp.ClientSession, base_url: str) -> dict[str, float] | None:
    """Stride's step-timeline totals from ``/metrics``; None for a server that exports none (another engine)."""
    try:
        async with session.get(f"{base_url}/metrics") as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except aiohttp.ClientError:
        return None
    totals = dict.fromkeys(TIMELINE_COUNTERS, 0.0)
    found = False
    for line in text.splitlines():
        for name in TIMELINE_COUNTERS:
            if line.startswith(f"stride:{name}_total"):
                totals[name] += float(line.rsplit(" ", 1)[1])
                found = True
    return totals if found else None


def step_timeline(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """Where the run's busy time went, from the counters' growth: shares of the step cycle (round trip plus the
    scheduler's gap) spent on the device, on rank 0's host side, in transport, and in the scheduler."""
    d = {k: after[k] - before[k] for k in TIMELINE_COUNTERS}
    busy = d["step_round_trip_seconds"] + d["step_gap_seconds"]
    if d["steps"] <= 0 or busy <= 0:
        return None
    return {
        "steps": d["steps"], "mean_cycle_ms": 1000 * busy / d["steps"],
        "device": d["step_device_seconds"] / busy,
        "worker_host": (d["step_worker_seconds"] - d["step_device_seconds"]) / busy,
        "transport": (d["step_round_trip_seconds"] - d["step_worker_seconds"]) / busy,
        "scheduler": d["step_gap_seconds"] / busy,
        "graph_steps": d["graph_steps"],
        "early_steps": d["early_steps"],
        "graph_step_ms": 1000 * d["graph_step_device_seconds"] / d["graph_steps"] if d["graph_steps"] else 0.0,
        "eager_step_ms": (1000 * (d["step_device_seconds"] - d["graph_step_device_seconds"])
                          / (d["steps"] - d["graph_steps"]) if d["steps"] > d["graph_steps"] else 0.0),
    }


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    ms = np.asarray(values) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _tpots(ok: list[RequestResult]) -> list[float]:
    return [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]


def _timed(ok: list[RequestResult]) -> list[RequestResult]:
    """The completed requests whose tokens were seen arriving: those the token times are taken over."""
    return [r for r in ok if not r.textless]


def summarize(results: list[RequestResult], duration: float, model: str,
              args: argparse.Namespace) -> dict[str, Any]:
    """Throughput and latency percentiles (ms) over the requests that succeeded (token times over those that
    streamed text)."""
    ok = [r for r in results if r.ok]
    timed = _timed(ok)
    output_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in timed if r.ttft * 1000 <= args.goodput_ttft_ms and (
        r.output_tokens <= 1 or 1000 * (r.latency - r.ttft) / (r.output_tokens - 1) <= args.goodput_tpot_ms)]
    slo = {"ttft_ms": _finite_or_none(args.goodput_ttft_ms), "tpot_ms": _finite_or_none(args.goodput_tpot_ms)}
    return {
        "model": model, "base_url": args.base_url, "endpoint": args.endpoint,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency, "input_len": args.input_len, "output_len": args.output_len,
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "textless": len(ok) - len(timed),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_output_tokens": output_tokens, "total_input_words": sum(r.prompt_words for r in ok),
        "total_input_tokens": (sum(r.prompt_tokens for r in ok) if ok and all(r.prompt_tokens for r in ok)
                               else None),
        "ttft_ms": _stats([r.ttft for r in timed]), "tpot_ms": _stats(_tpots(timed)),
        "itl_ms": _stats([x for r in timed for x in r.itl]), "e2e_latency_ms": _stats([r.latency for r in ok]),
        "shared_prefix_len": args.shared_prefix_len, "num_prefixes": args.num_prefixes,
        "goodput": {"slo": slo, "good_requests": len(good),
                    "request_goodput": len(good) / duration if duration > 0 else 0.0},
    }


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


_METRICS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_latency_ms", "E2E"))


def format_summary(s: dict[str, Any]) -> str:
    textless = (f" ({s['textless']} of them streamed no output chunk: in the throughput and E2E, not the token "
                f"times)"
                if s.get("textless") else "")
    lines = [f"{s['completed']} requests completed{textless}, {s['failed']} failed, in {s['duration_s']:.2f} s",
             f"request throughput   {s['request_throughput']:.2f} req/s",
             f"output throughput    {s['output_throughput']:.1f} tok/s",
             *_input_line(s),
             f"{'(ms)':<20}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for key, label in _METRICS:
        st = s[key]
        lines.append(f"{label:<20}" + "".join(f"{st[q]:>10.1f}" for q in ("mean", "p50", "p90", "p99")))
    g = s.get("goodput")
    if g and (g["slo"]["ttft_ms"] is not None or g["slo"]["tpot_ms"] is not None):
        lines.append(f"goodput              {g['request_goodput']:.2f} req/s ({g['good_requests']} requests within "
                     f"TTFT {g['slo']['ttft_ms']} ms, TPOT {g['slo']['tpot_ms']} ms)")
    t = s.get("step_timeline")
    if t:
        lines.append(f"step timeline        {t['steps']:.0f} steps, {t['mean_cycle_ms']:.2f} ms per cycle: device "
                     f"{t['device']:.0%}, worker host {t['worker_host']:.0%}, transport {t['transport']:.0%}, "
                     f"scheduler {t['scheduler']:.0%}")
        lines.append(f"{'':<21}{t['graph_steps']:.0f} steps on decode graphs or the compiled CPU step "
                     f"({t['graph_step_ms']:.2f} ms of device each), {t['steps'] - t['graph_steps']:.0f} eager "
                     f"({t['eager_step_ms']:.2f} ms); {t['early_steps']:.0f} launched early")
    lines += [f"error: {e}" for e in s["errors"]]
    return "\n".join(lines)


def _input_line(s: dict[str, Any]) -> list[str]:
    """The prompts' mean size in words sent and, where the server counted them, in its tokens: a word is one
    token in most BPE vocabularies, but not in a byte-level one (a random checkpoint's makes it several)."""
    if not s["completed"]:
        return []
    words = s["total_input_words"] / s["completed"]
    if s.get("total_input_tokens") is None:
        return [f"prompt size          {words:.1f} words a request (the server sent no token count)"]
    tokens = s["total_input_tokens"] / s["completed"]
    line = f"prompt size          {words:.1f} words = {tokens:.1f} tokens a request ({tokens / words:.2f} a word)"
    if s.get("tokens_per_word") is not None:
        line += f"; sized from probes: {s['tokens_per_word']:.2f} tokens a word, {s['template_tokens']:.0f} of template"
    return [line]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--out-png needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    return plt


def write_plot(path: str, results: list[RequestResult], summary: dict[str, Any]) -> None:
    """Four panels: TTFT, TPOT, ITL histograms and latency against request start time."""
    plt = _pyplot()
    ok = [r for r in results if r.ok]
    timed = _timed(ok)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = (("TTFT (ms)", [r.ttft * 1e3 for r in timed]),
              ("TPOT (ms)", [x * 1e3 for x in _tpots(timed)]),
              ("ITL (ms)", [x * 1e3 for r in timed for x in r.itl]))
    for ax, (title, values) in zip(axes.flat, panels, strict=False):
        ax.hist(values, bins=40)
        ax.set_title(title)
    ax = axes.flat[3]
    ax.scatter([r.start for r in ok], [r.latency * 1e3 for r in ok], s=6)
    ax.set_title("end-to-end latency (ms) by start time (s)")
    fig.suptitle(f"{summary['model']}: {summary['request_throughput']:.2f} req/s, "
                 f"{summary['output_throughput']:.1f} tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_rates(text: str) -> list[float]:
    """``--sweep-rates`` as numbers (``inf`` allowed); ``ValueError`` for anything not positive."""
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--sweep-rates must be positive numbers, got {text!r}")
    return rates


def format_sweep(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'rate (req/s)':>12} {'req/s':>8} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
             f"{'TPOT p99':>9} {'goodput':>8} {'failed':>7}"]
    for s in rows:
        lines.append(f"{str(s['request_rate']):>12} {s['request_throughput']:>8.2f} {s['output_throughput']:>9.1f} "
                     f"{s['ttft_ms']['p50']:>9.1f} {s['ttft_ms']['p99']:>9.1f} {s['tpot_ms']['p50']:>9.1f} "
                     f"{s['tpot_ms']['p99']:>9.1f} {s['goodput']['request_goodput']:>8.2f} {s['failed']:>7}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.num_requests < 1 or args.input_len < 1 or args.output_len < 1 or not args.request_rate > 0:
        print("stride bench: --num-requests, --input-len, --output-len and --request-rate must be positive",
              file=sys.stderr)
        return 2
    if not 0 <= args.temperature < math.inf:
        print("stride bench: --temperature must be a number >= 0", file=sys.stderr)
        return 2
    if args.shared_prefix_len < 0 or args.num_prefixes < 1:
        print("stride bench: --shared-prefix-len must be >= 0 and --num-prefixes >= 1", file=sys.stderr)
        return 2
    if args.sweep_rates:
        try:
            rates = parse_rates(args.sweep_rates)
        except ValueError as e:
            print(f"stride bench: {e}", file=sys.stderr)
            return 2
        return _sweep(args, rates)
    if args.out_png:
        try:
            _pyplot()  # fail before the load runs, not after
        except RuntimeError as e:
            print(f"stride bench: {e}", file=sys.stderr)
            return 2
    try:
        summary, results = asyncio.run(run_benchmark(args))
    except aiohttp.ClientError as e:
        print(f"stride bench: cannot reach {args.base_url}: {e}", file=sys.stderr)
        return 1
    except CalibrationError as e:
        print(f"stride bench: {e}", file=sys.stderr)
        return 1
    print(format_summary(summary))
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump({"summary": summary, "requests": [asdict(r) for r in results]}, f, indent=1)
    if args.out_png:
        write_plot(args.out_png, results, summary)
    return 0 if summary["completed"] else 1


def _sweep(args: argparse.Namespace, rates: list[float]) -> int:
    """The load once per rate, a summary after each, then the table (and every summary in ``--out-json``). Prompts
    sized in tokens are sized once, by the first rate's probes."""
    rows: list[dict[str, Any]] = []
    calibration = None
    for rate in rates:
        run_args = argparse.Namespace(**{**vars(args), "request_rate": rate})
        try:
            summary, _ = asyncio.run(run_benchmark(run_args, calibration))
        except aiohttp.ClientError as e:
            print(f"stride bench: cannot reach {args.base_url}: {e}", file=sys.stderr)
            return 1
        except CalibrationError as e:
            print(f"stride bench: {e}", file=sys.stderr)
            return 1
        print(f"--- request rate {rate} req/s\n{format_summary(summary)}\n", flush=True)
        rows.append(summary)
        if "tokens_per_word" in summary:
            calibration = summary["tokens_per_word"], summary["template_tokens"]
    print(format_sweep(rows))
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump({"sweep": rows}, f, indent=1)
    return 0 if all(r["completed"] for r in rows) else 1
