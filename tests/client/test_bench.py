"""`stride bench` against a tiny in-test aiohttp server that streams fake SSE chunks on 127.0.0.1."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from stride.client import bench


class FakeServer:
    """OpenAI-style streaming server in a background thread. Serves at most ``max_requests`` requests
    (503 after that) and shuts itself down after ``lifetime_s`` even if nobody stops it."""

    def __init__(self, usage: bool = True, fail_every: int = 0, max_requests: int = 64,
                 lifetime_s: float = 60.0, metrics: bool = False, silent_every: int = 0, empty_every: int = 0,
                 role_and_finish: bool = False) -> None:
        self.usage, self.fail_every, self.metrics = usage, fail_every, metrics
        # every k-th request: no chunk for its tokens (a server that sends none for a token without text) / a chunk
        # with empty text for each (as Stride sends one for a token that decodes to no text yet)
        self.silent_every, self.empty_every = silent_every, empty_every
        self.role_and_finish = role_and_finish  # chat's opening role chunk and a closing finish chunk, both empty
        self.max_requests, self.lifetime_s = max_requests, lifetime_s
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = self.max_in_flight = 0
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if len(self.bodies) > self.max_requests:
            return web.json_response({"error": "too many"}, status=503)
        if self.fail_every and len(self.bodies) % self.fail_every == 0:
            return web.json_response({"error": "boom"}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chat = "messages" in body
        k = len(self.bodies)
        silent = self.silent_every and k % self.silent_every == 0
        empty = self.empty_every and k % self.empty_every == 0
        if chat and self.role_and_finish:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            await resp.write(f"data: {json.dumps({'choices': [role]})}\n\n".encode())
        for i in range(0 if silent else body["max_tokens"]):
            await asyncio.sleep(0.002)
            text = "" if empty else f" t{i}"
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        if self.role_and_finish:
            await asyncio.sleep(0.05)  # a closing chunk taken for a token would add this gap to the ITL
            end = {"index": 0, "delta": {}, "finish_reason": "length"} if chat else {
                "index": 0, "text": "", "finish_reason": "length"}
            await resp.write(f"data: {json.dumps({'choices': [end]})}\n\n".encode())
        if self.usage and body.get("stream_options", {}).get("include_usage"):
            # a prompt's tokens: two a word (as a byte-level vocabulary might count them), and a chat template's 7
            text = body["prompt"] if "prompt" in body else body["messages"][0]["content"]
            usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"],
                                              "prompt_tokens": 2 * len(text.split()) + 7 * chat}}
            await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        self.in_flight -= 1
        return resp

    async def _metrics(self, request: web.Request) -> web.Response:
        """Stride's step-timeline counters, grown by each request: 10 steps of 4 ms round trip, 3 ms on rank 0,
        2 ms on the device, 1 ms of scheduler gap each; 6 of them graph replays of 1 ms device each, 5 launched early
        (and a counter of another name that must not count)."""
        n = 10 * len(self.bodies)
        lines = [f'stride:steps_total{{model_name="m"}} {n}', f"stride:step_device_seconds_total {0.002 * n}",
                 f"stride:step_worker_seconds_total {0.003 * n}", f"stride:step_round_trip_seconds_total {0.004 * n}",
                 f"stride:step_gap_seconds_total {0.001 * n}", "stride:steps_other_total 99",
                 f"stride:graph_steps_total {0.6 * n}", f"stride:graph_step_device_seconds_total {0.0006 * n}",
                 f"stride:early_steps_total {0.5 * n}"]
        return web.Response(text="\n".join(lines) + "\n")

    async def _main(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        if self.metrics:
            app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = runner.addresses[0][1]
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        try:
            await asyncio.wait_for(self._stop.wait(), self.lifetime_s)
        except TimeoutError:
            pass
        finally:
            await runner.cleanup()

    def __enter__(self) -> FakeServer:
        self._thread.start()
        assert self._ready.wait(10), "fake server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["--no-progress", *argv])


def test_completions_stream_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    with FakeServer() as server:
        rc = bench.main(_args("--base-url", server.url, "--num-requests", "8", "--max-concurrency", "2",
                              "--input-len", "20", "--output-len", "5", "--out-json", str(out_json),
                              "--out-png", str(out_png)))
    assert rc == 0
    out = capsys.readouterr().out
    assert "request throughput" in out and "20.0 words = 40.0 tokens a request (2.00 a word)" in out
    assert len(server.bodies) == 8 and server.max_in_flight <= 2
    for body in server.bodies:
        assert body["model"] == "fake-model" and body["stream"] is True and body["max_tokens"] == 5
        assert len(body["prompt"].split()) == 20 and "ignore_eos" not in body
    data = json.loads(out_json.read_text())
    s = data["summary"]
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (8, 0, 40)
    assert (s["total_input_words"], s["total_input_tokens"]) == (160, 320)
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        assert 0 < s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"]
    assert s["e2e_latency_ms"]["p50"] >= s["ttft_ms"]["p50"]
    assert sum(len(r["itl"]) for r in data["requests"]) == 8 * 4  # 5 chunks → 4 gaps each
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_concurrency_cap_sends_all_at_once() -> None:
    # negative control for the cap above: without it the server sees more than 2 in flight
    with FakeServer() as server:
        assert bench.main(_args("--base-url", server.url, "--num-requests", "8", "--output-len", "20")) == 0
    assert server.max_in_flight > 2


def test_input_unit_tokens_sizes_prompts_from_the_servers_count(capsys: pytest.CaptureFixture[str]) -> None:
    """``--input-unit tokens``: two probes measure the server's tokens a word (2) and its template's (7), and the
    prompts are sized so that the server counts ``--input-len`` tokens; a shared prefix is sized in tokens too. With
    words (the default) the same numbers count words (negative control). A server without usage: a clear error."""
    with FakeServer() as server:
        args = _args("--base-url", server.url, "--endpoint", "chat", "--num-requests", "4", "--output-len", "2",
                     "--input-unit", "tokens", "--input-len", "101", "--shared-prefix-len", "40")
        summary, results = asyncio.run(bench.run_benchmark(args))
    probes, load = server.bodies[:2], server.bodies[2:]
    assert [len(b["messages"][0]["content"].split()) for b in probes] == list(bench.CALIBRATION_WORDS)
    assert all(b["max_tokens"] == 1 for b in probes) and len(load) == 4
    assert (summary["tokens_per_word"], summary["template_tokens"]) == (2.0, 7.0)
    assert all(len(b["messages"][0]["content"].split()) == 20 + 47 for b in load)  # (101 - 7) / 2 own, 40 / 2 shared
    assert summary["total_input_tokens"] == 4 * 141  # 2 x 67 + 7: the 101 asked, plus the prefix's 40
    assert "sized from probes: 2.00 tokens a word, 7 of template" in bench.format_summary(summary)
    with FakeServer() as server:
        args = _args("--base-url", server.url, "--endpoint", "chat", "--num-requests", "2", "--output-len", "2",
                     "--input-len", "101")
        summary, _ = asyncio.run(bench.run_benchmark(args))
    assert [len(b["messages"][0]["content"].split()) for b in server.bodies] == [101, 101]
    assert "tokens_per_word" not in summary
    with FakeServer(usage=False) as server:
        rc = bench.main(_args("--base-url", server.url, "--num-requests", "2", "--input-unit", "tokens"))
    assert rc == 1 and "gave no usage.prompt_tokens" in capsys.readouterr().err
    assert len(server.bodies) == 1  # the first probe, and no load after it


def test_a_stream_of_tokens_without_chunks_completes_without_token_times(capsys: pytest.CaptureFixture[str]) -> None:
    """A request whose stream finished with the server counting its tokens but no chunk of output (a server that
    sends none for a token without text) completed: its tokens count in the throughput, and it gives no TTFT or
    TPOT. The same stream without usage is a failure (the control: nothing says it generated anything)."""
    with FakeServer(silent_every=3) as server:
        args = _args("--base-url", server.url, "--num-requests", "6", "--output-len", "4", "--max-concurrency", "1")
        summary, results = asyncio.run(bench.run_benchmark(args))
    assert (summary["completed"], summary["failed"], summary["textless"]) == (6, 0, 2)
    assert summary["total_output_tokens"] == 24
    assert [r.textless for r in results] == [False, False, True] * 2
    assert all(r.ttft > 0 for r in results if not r.textless)
    assert summary["ttft_ms"]["p50"] > 0 and summary["e2e_latency_ms"]["p50"] > 0
    assert "(2 of them streamed no output chunk" in bench.format_summary(summary)
    with FakeServer(silent_every=3, usage=False) as server:
        args = _args("--base-url", server.url, "--num-requests", "6", "--output-len", "4", "--max-concurrency", "1")
        summary, _ = asyncio.run(bench.run_benchmark(args))
    assert (summary["completed"], summary["failed"], summary["textless"]) == (4, 2, 0)
    assert summary["errors"] == ["no output in the stream"]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_chunks_without_text_are_token_arrivals_and_role_and_finish_chunks_are_not(endpoint: str) -> None:
    """Chunks with empty text (tokens that decode to nothing yet) time their tokens: every request of 5 tokens has
    a TTFT and 4 gaps, whether its chunks carry text or not; the chat stream's opening role chunk and a closing
    finish chunk (empty, 50 ms after the last token) are not taken for tokens (the control: either would add a gap,
    the closing one a gap of 50 ms)."""
    with FakeServer(empty_every=2, role_and_finish=True) as server:
        args = _args("--base-url", server.url, "--endpoint", endpoint, "--num-requests", "4", "--output-len", "5",
                     "--max-concurrency", "1")
        summary, results = asyncio.run(bench.run_benchmark(args))
    assert (summary["completed"], summary["failed"], summary["textless"]) == (4, 0, 0)
    assert all(r.ttft > 0 and len(r.itl) == 4 and max(r.itl) < 0.04 for r in results), results


def test_chat_poisson_and_counting_chunks_without_usage() -> None:
    with FakeServer(usage=False) as server:
        args = _args("--base-url", server.url, "--model", "m", "--endpoint", "chat", "--num-requests", "6",
                     "--request-rate", "500", "--output-len", "3", "--ignore-eos", "--range-ratio", "0.5")
        summary, results = asyncio.run(bench.run_benchmark(args))
    assert summary["completed"] == 6
    assert summary["total_output_tokens"] == sum(b["max_tokens"] for b in server.bodies)
    assert summary["total_input_tokens"] is None  # no usage: no token count, and the report says so
    assert "the server sent no token count" in bench.format_summary(summary)
    assert all(b["messages"][0]["role"] == "user" and b["ignore_eos"] is True for b in server.bodies)
    assert all(b["model"] == "m" for b in server.bodies)
    starts = [r.start for r in results]
    assert starts == sorted(starts) and starts[-1] > starts[0]  # arrivals spread out, in order


def test_failures_are_counted_not_hidden() -> None:
    with FakeServer(fail_every=2) as server:
        summary, _ = asyncio.run(bench.run_benchmark(_args("--base-url", server.url, "--num-requests", "6",
                                                           "--output-len", "2")))
    assert (summary["completed"], summary["failed"]) == (3, 3)
    assert any("HTTP 500" in e for e in summary["errors"])


def test_prompts_are_deterministic_and_sized() -> None:
    a = bench.make_prompts(20, 100, 50, 0.2, seed=7)
    assert a == bench.make_prompts(20, 100, 50, 0.2, seed=7) != bench.make_prompts(20, 100, 50, 0.2, seed=8)
    for prompt, words, max_tokens in a:
        assert len(prompt.split()) == words and 80 <= words <= 120 and 40 <= max_tokens <= 60


def test_missing_matplotlib_fails_before_the_load(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with FakeServer() as server:
        rc = bench.main(_args("--base-url", server.url, "--num-requests", "2", "--out-png", "x.png"))
    assert rc == 2 and "needs matplotlib" in capsys.readouterr().err and server.bodies == []


def test_script_wrapper_runs(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_serving.py"
    with FakeServer() as server:
        proc = subprocess.run([sys.executable, str(script), "--base-url", server.url, "--num-requests", "2",
                               "--output-len", "2", "--no-progress", "--out-json", str(tmp_path / "b.json")],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "b.json").read_text())["summary"]["completed"] == 2


def test_step_timeline_from_the_servers_counters() -> None:
    """Against a server with Stride's timeline counters the summary splits the step cycle (5 ms here) into its
    shares; against one without, there is no timeline (another engine), and the run is not affected."""
    with FakeServer(metrics=True) as server:
        summary, _ = asyncio.run(bench.run_benchmark(_args("--base-url", server.url, "--num-requests", "4",
                                                           "--output-len", "3")))
    t = summary["step_timeline"]
    assert t is not None and t["steps"] == 40
    assert t["mean_cycle_ms"] == pytest.approx(5.0)
    assert (t["device"], t["worker_host"], t["transport"], t["scheduler"]) == pytest.approx((0.4, 0.2, 0.2, 0.2))
    # 24 graph steps of 1 ms, 16 eager ones sharing the rest of the device's 80 ms: 3.5 ms each.
    assert (t["graph_steps"], t["graph_step_ms"], t["eager_step_ms"], t["early_steps"]) == pytest.approx(
        (24, 1.0, 3.5, 20))
    text = bench.format_summary(summary)
    assert "step timeline        40 steps, 5.00 ms per cycle: device 40%" in text
    assert ("24 steps on decode graphs or the compiled CPU step (1.00 ms of device each), 16 eager (3.50 ms); "
            "20 launched early") in text
    with FakeServer() as server:
        summary, _ = asyncio.run(bench.run_benchmark(_args("--base-url", server.url, "--num-requests", "2",
                                                           "--output-len", "3")))
    assert summary["step_timeline"] is None and summary["completed"] == 2


def test_shared_prefixes() -> None:
    """Request i starts with prefix i mod K (K distinct ones of N words), then words of its own."""
    prompts = bench.make_prompts(9, 20, 8, 0.0, seed=3, shared_prefix_len=30, num_prefixes=3)
    heads = [" ".join(p.split()[:30]) for p, _, _ in prompts]
    assert len(set(heads)) == 3 and all(heads[i] == heads[i % 3] for i in range(9))
    assert all(words == 50 == len(p.split()) for p, words, _ in prompts)
    tails = {" ".join(p.split()[30:]) for p, _, _ in prompts}
    assert len(tails) == 9  # control: the rest of each prompt is its own
    assert bench.make_prompts(4, 20, 8, 0.0, seed=3) == bench.make_prompts(4, 20, 8, 0.0, seed=3, num_prefixes=5)


def test_goodput_counts_requests_within_both_targets() -> None:
    with FakeServer() as server:  # ~2 ms between tokens
        loose, _ = asyncio.run(bench.run_benchmark(_args("--base-url", server.url, "--num-requests", "4",
                                                         "--output-len", "5", "--goodput-ttft-ms", "5000",
                                                         "--goodput-tpot-ms", "1000")))
        tight, _ = asyncio.run(bench.run_benchmark(_args("--base-url", server.url, "--num-requests", "4",
                                                         "--output-len", "5", "--goodput-tpot-ms", "0.01")))
    assert loose["goodput"]["good_requests"] == 4 and loose["goodput"]["request_goodput"] > 0
    assert tight["goodput"]["good_requests"] == 0 and tight["goodput"]["slo"] == {"ttft_ms": None, "tpot_ms": 0.01}
    assert "goodput" in bench.format_summary(loose)


def test_rate_sweep_runs_each_rate_and_tabulates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep.json"
    with FakeServer() as server:
        code = bench.main(_args("--base-url", server.url, "--num-requests", "3", "--output-len", "3",
                                "--sweep-rates", "50,inf", "--out-json", str(out)))
    assert code == 0
    rows = json.loads(out.read_text())["sweep"]
    assert [r["request_rate"] for r in rows] == [50.0, "inf"] and all(r["completed"] == 3 for r in rows)
    table = capsys.readouterr().out.splitlines()
    assert table[-3].split()[:2] == ["rate", "(req/s)"] and table[-2].split()[0] == "50.0"
    assert bench.main(_args("--sweep-rates", "2,-1")) == 2


def test_a_sweep_in_tokens_sizes_its_prompts_once(tmp_path: Path) -> None:
    """``--sweep-rates`` with ``--input-unit tokens``: the first rate's two probes size every rate's prompts (one
    pair of probes in all, each run's prompts as many tokens); a single run probes for itself (the control)."""
    out = tmp_path / "sweep.json"
    with FakeServer() as server:
        code = bench.main(_args("--base-url", server.url, "--endpoint", "chat", "--num-requests", "2",
                                "--output-len", "2", "--input-unit", "tokens", "--input-len", "101",
                                "--sweep-rates", "50,inf,20", "--out-json", str(out)))
    assert code == 0
    probes = [b for b in server.bodies if b["max_tokens"] == 1]
    assert len(probes) == 2 and len(server.bodies) == 2 + 3 * 2
    rows = json.loads(out.read_text())["sweep"]
    sizes = [(r["tokens_per_word"], r["template_tokens"], r["total_input_tokens"]) for r in rows]
    assert sizes == [(2.0, 7.0, 202)] * 3
    with FakeServer() as server:
        args = _args("--base-url", server.url, "--endpoint", "chat", "--num-requests", "2", "--output-len", "2",
                     "--input-unit", "tokens", "--input-len", "101")
        asyncio.run(bench.run_benchmark(args))
        asyncio.run(bench.run_benchmark(args))
    assert sum(b["max_tokens"] == 1 for b in server.bodies) == 4


def test_json_schema_option_sends_the_response_format(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    for spec, want in ((str(tmp_path / "s.json"), {"type": "json_schema", "json_schema": {"name": "bench",
                                                                                          "schema": schema}}),
                       ("object", {"type": "json_object"}), ("", None)):
        with FakeServer() as server:
            asyncio.run(bench.run_benchmark(_args("--base-url", server.url, "--num-requests", "2", "--output-len",
                                                  "2", "--json-schema", spec)))
        assert [b.get("response_format") for b in server.bodies] == [want, want]


def test_temperature_option_reaches_every_request() -> None:
    """Greedy by default; ``--temperature`` sets every request's (the probes' too); a negative one is refused."""
    for argv, want in (((), 0.0), (("--temperature", "0.8"), 0.8)):
        with FakeServer() as server:
            assert bench.main(_args("--base-url", server.url, "--num-requests", "2", "--output-len", "2",
                                    "--input-unit", "tokens", *argv)) == 0
        assert len(server.bodies) == 4 and all(b["temperature"] == want for b in server.bodies)
    assert bench.main(_args("--temperature", "-1")) == 2
    assert bench.main(_args("--temperature", "nan")) == 2
