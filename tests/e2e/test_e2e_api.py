"""End to end through the official ``openai`` client: a real launch (frontend, tokenizer pool, scheduler,
rank worker) serving the default model on the CPU.

Covers chat and completions, streamed and not, text and token-id prompts, ``n``, ``stop``, ``max_tokens``,
logprobs, usage with cached tokens, and finish reasons; greedy output through the API against an argmax
loop over :class:`ModelRunner` in this process; and a battery of malformed requests.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
import torch
from e2e_helpers import StrideServer
from worker_helpers import make_runner

from stride.model.files import default_model_path
from stride.tokenizer.detokenizer import token_bytes_table
from stride.tokenizer.loader import ModelTokenizer, load_tokenizer
from stride.tokenizer.template import ChatTemplate

MAX_MODEL_LEN = 1024
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
NEAR_TIE = 0.05
"""Largest top-2 log-prob margin of the reference at which the API may pick the other token."""


@pytest.fixture(scope="module")
def server() -> Iterator[StrideServer]:
    with StrideServer("--max-num-seqs", "8", "--num-blocks", "256", "--max-model-len", str(MAX_MODEL_LEN)) as srv:
        yield srv
    assert srv.leftovers() == [], srv.tail()


@pytest.fixture(scope="module")
def client(server: StrideServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return load_tokenizer(default_model_path())


# ------------------------------------------------------------------ the openai client


def test_chat_non_streaming_and_cached_usage(server: StrideServer, client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=server.model, messages=FRANCE, max_tokens=30, temperature=0)
    choice = first.choices[0]
    assert "Paris" in (choice.message.content or "") and choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    u = first.usage
    assert u is not None and u.prompt_tokens > 16 and 0 < u.completion_tokens < 30
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details is not None
    # The same prompt again finds its full blocks in the prefix cache (one tenant: no key file).
    again = client.chat.completions.create(model=server.model, messages=FRANCE, max_tokens=30, temperature=0)
    assert again.choices[0].message.content == choice.message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= 16 and cached % 16 == 0 and cached < u.prompt_tokens


def test_chat_streaming_matches_non_streaming(server: StrideServer, client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=server.model, messages=FRANCE, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model=server.model, messages=FRANCE, max_tokens=30,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert len({c.id for c in chunks}) == 1
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 3  # really streamed


def test_completions_text_and_token_id_prompts(server: StrideServer, client: openai.OpenAI,
                                               tok: ModelTokenizer) -> None:
    prompt = "The three primary colors are"
    by_text = client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0)
    ids = tok.encode(prompt)
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=8, temperature=0)
    assert by_text.choices[0].text and by_text.choices[0].text == by_ids.choices[0].text
    for r in (by_text, by_ids):
        assert r.choices[0].finish_reason == "length"
        assert r.usage is not None and r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
    # Control: a different prompt gives different text, so the equality above says something.
    other = client.completions.create(model=server.model, prompt=tok.encode("My favourite animal is"),
                                      max_tokens=8, temperature=0)
    assert other.choices[0].text != by_ids.choices[0].text


def test_n_2_max_tokens_and_length(server: StrideServer, client: openai.OpenAI) -> None:
    r = client.completions.create(model=server.model, prompt="Once upon a time", n=2, max_tokens=12,
                                  temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.choices[0].text != r.choices[1].text  # seeds 7 and 8: two samples, not one sent twice
    assert r.usage is not None and r.usage.completion_tokens == 24
    chat = client.chat.completions.create(model=server.model, messages=FRANCE, n=2, max_tokens=3, temperature=0)
    assert len(chat.choices) == 2 and all(c.finish_reason == "length" for c in chat.choices)
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same twice
    assert chat.usage is not None and chat.usage.completion_tokens == 6


def test_stop_strings(server: StrideServer, client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=server.model, messages=FRANCE, max_tokens=30, temperature=0)
    text = full.choices[0].message.content or ""
    assert " Paris" in text
    cut = client.chat.completions.create(model=server.model, messages=FRANCE, max_tokens=30, temperature=0,
                                         stop=[" Paris", "never appears"])
    assert cut.choices[0].message.content == text[:text.index(" Paris")]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=server.model, messages=FRANCE, max_tokens=30,
                                              temperature=0, stop=" Paris", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[:text.index(" Paris")]
    # Control: a stop string that never occurs changes nothing.
    same = client.chat.completions.create(model=server.model, messages=FRANCE, max_tokens=30, temperature=0,
                                          stop="Berlin")
    assert same.choices[0].message.content == text


def test_chat_top_logprobs(server: StrideServer, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=server.model, messages=FRANCE, max_tokens=6, temperature=0,
                                      logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert entries is not None and len(entries) == r.usage.completion_tokens == 6  # type: ignore[union-attr]
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert e.top_logprobs[0].token == e.token and math.isclose(tops[0], e.logprob, abs_tol=1e-5)  # greedy
        assert sum(math.exp(t) for t in tops) <= 1.0 + 1e-4


def test_completion_logprobs(server: StrideServer, client: openai.OpenAI) -> None:
    r = client.completions.create(model=server.model, prompt="Water is made of", max_tokens=5,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == 5 and "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert lp.top_logprobs is not None
    for tok_text, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and max(top.values()) == pytest.approx(value, abs=1e-5) and top[tok_text] == value


# ------------------------------------------------------------------ greedy equals the worker's greedy


def reference_greedy(runner: Any, prompt_ids: list[int], num_tokens: int,
                     eos_ids: tuple[int, ...]) -> tuple[list[int], list[float]]:
    """Argmax decoding over :meth:`ModelRunner.forward`, one sequence, one prefill then one token per step.
    Returns the ids (EOS excluded) and each step's top-2 log-prob margin."""
    block_table = np.arange(16, dtype=np.int32)[None, :]
    ids, margins = list(prompt_ids), []
    step_ids = list(prompt_ids)
    for _ in range(num_tokens):
        n = len(ids)
        logits = runner.forward(np.array(step_ids), np.arange(n - len(step_ids), n), [0], [len(step_ids)], [n],
                                block_table)[0]
        top2 = torch.log_softmax(logits.double(), -1).topk(2)
        margins.append(float(top2.values[0] - top2.values[1]))
        nxt = int(top2.indices[0])
        if nxt in eos_ids:
            break
        ids.append(nxt)
        step_ids = [nxt]
    return ids[len(prompt_ids):], margins


def check_greedy_agrees(ref_ids: list[int], margins: list[float], got_ids: list[int]) -> None:
    """The API's tokens equal the reference's up to the end, or up to a position where the reference's top
    two were within :data:`NEAR_TIE` of each other; past a divergence nothing is compared."""
    for i, (want, got) in enumerate(zip(ref_ids, got_ids, strict=False)):
        if want != got:
            assert margins[i] < NEAR_TIE, f"token {i}: API {got}, reference {want} (margin {margins[i]:.3f})"
            return
    if len(got_ids) != len(ref_ids):  # one side ended (EOS) where the other did not: also a divergence
        i = min(len(got_ids), len(ref_ids))
        assert i < len(margins) and margins[i] < NEAR_TIE, f"lengths {len(got_ids)} vs reference {len(ref_ids)}"


def test_greedy_checker_fails_on_a_real_difference() -> None:
    """Negative control for :func:`check_greedy_agrees`."""
    check_greedy_agrees([5, 6, 7], [1.0, 0.01, 1.0], [5, 9, 1])  # near-tie at 1: allowed
    for got in ([5, 9, 7], [5, 6], [5, 6, 7, 8]):
        with pytest.raises(AssertionError):
            check_greedy_agrees([5, 6, 7], [1.0, 1.0, 1.0], got)


@pytest.mark.slow
def test_greedy_through_the_api_equals_the_workers_greedy(server: StrideServer, client: openai.OpenAI,
                                                          tok: ModelTokenizer) -> None:

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server shares these two cores (see e2e_helpers.StrideServer.start)
    try:
        runner = make_runner(default_model_path(), device="cpu", dtype="float32", block_size=16, num_blocks=16,
                             max_num_seqs=1)
        _compare_greedy(server, client, tok, runner)
    finally:
        torch.set_num_threads(threads)


def _compare_greedy(server: StrideServer, client: openai.OpenAI, tok: ModelTokenizer, runner: Any) -> None:
    template = ChatTemplate.for_model(tok)
    table = token_bytes_table(tok.tokenizer)
    by_bytes: dict[bytes, list[int]] = {}
    for token_id, b in enumerate(table):
        by_bytes.setdefault(b, []).append(token_id)
    conversations = [FRANCE, [{"role": "user", "content": "Write a haiku about the sea."}]]
    for messages in conversations:
        prompt_ids = tok.encode(template.render(messages, add_generation_prompt=True), add_special_tokens=False)
        r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=32, temperature=0,
                                          logprobs=True, top_logprobs=1)
        assert r.usage is not None and r.usage.prompt_tokens == len(prompt_ids)  # the same prompt ids
        entries = list(r.choices[0].logprobs.content or [])  # type: ignore[union-attr]
        if r.choices[0].finish_reason == "stop":
            assert entries[-1].bytes == [], entries[-1]  # the end-of-sequence token: no text
            entries.pop()
        got_ids = []
        for e in entries:
            candidates = by_bytes[bytes(e.bytes or [])]
            assert len(candidates) == 1, (e.token, candidates)  # the bytes name exactly one token
            got_ids.append(candidates[0])
        ref_ids, margins = reference_greedy(runner, prompt_ids, 32, tok.eos_token_ids)
        check_greedy_agrees(ref_ids, margins, got_ids)
        assert r.choices[0].finish_reason == ("length" if len(ref_ids) == 32 else "stop")


# ------------------------------------------------------------------ malformed requests

C, CHAT = "/v1/completions", "/v1/chat/completions"


def _battery(model: str, vocab: int) -> list[tuple[str, str, str | None, int, str | None]]:
    """(method, path, body, status, param); param None: not checked."""
    def comp(**kw: object) -> str:
        return json.dumps({"model": model, "prompt": "hi", "max_tokens": 2, **kw})

    def chat(**kw: object) -> str:
        return json.dumps({"model": model, "messages": FRANCE, "max_tokens": 2, **kw})

    too_long_text = "hello " * (MAX_MODEL_LEN + 50)  # fits the body limit; only the tokenizer sees its length
    return [
        ("POST", C, "{", 400, None),
        ("POST", C, "[1, 2]", 400, None),
        ("POST", C, json.dumps({"model": model}), 400, "prompt"),
        ("POST", CHAT, json.dumps({"model": model}), 400, "messages"),
        ("POST", C, comp(prompt=5), 400, "prompt"),
        ("POST", C, comp(prompt=""), 400, "prompt"),
        ("POST", C, comp(prompt=[-1, 2]), 400, "prompt"),
        ("POST", C, comp(prompt=["a", "b"]), 400, "prompt"),
        ("POST", C, comp(prompt=[1] * MAX_MODEL_LEN), 400, "prompt"),
        ("POST", C, comp(prompt=too_long_text), 400, None),
        ("POST", C, comp(prompt=too_long_text, stream=True), 400, None),
        ("POST", CHAT, chat(messages=[{"role": "user", "content": too_long_text}]), 400, None),
        ("POST", C, comp(prompt=[1, vocab + 5]), 400, None),
        ("POST", C, comp(max_tokens=0), 400, "max_tokens"),
        ("POST", C, comp(max_tokens="10"), 400, "max_tokens"),
        ("POST", C, comp(temperature=-1), 400, "temperature"),
        ("POST", C, comp(top_p=1.5), 400, "top_p"),
        ("POST", C, comp(top_k=-2), 400, "top_k"),
        ("POST", C, comp(n=0), 400, "n"),
        ("POST", C, comp(stop=5), 400, "stop"),
        ("POST", C, comp(logprobs=50), 400, "logprobs"),
        ("POST", C, comp(suffix="x"), 400, "suffix"),
        ("POST", C, comp(prompt="hello " * 100, max_tokens=MAX_MODEL_LEN - 10), 400, None),
        ("POST", C, comp(stop_token_ids=[vocab]), 400, "stop_token_ids"),
        ("POST", C, comp(service_class="vip"), 400, "service_class"),
        ("POST", C, comp(stream_options={"include_usage": True}), 400, "stream_options"),
        ("POST", C, comp(model="gpt-4"), 404, "model"),
        ("POST", CHAT, chat(model="gpt-4", stream=True), 404, "model"),
        ("POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
        ("POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
        ("POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
        ("POST", CHAT, chat(tools=[]), 400, "tools"),
        ("GET", "/v1/nope", None, 404, None),
        ("GET", C, None, 405, None),
    ]


def test_battery_of_malformed_requests(server: StrideServer, tok: ModelTokenizer) -> None:
    battery = _battery(server.model, tok.vocab_size)
    assert len(battery) >= 25
    for method, path, body, status, param in battery:
        code, headers, data = server.post(path, body if body is not None else b"", method=method)
        assert code == status, (method, path, (body or "")[:80], data[:300])
        assert headers["Content-Type"].startswith("application/json"), (path, (body or "")[:80])
        err = json.loads(data)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        if param is not None:
            assert err["param"] == param, ((body or "")[:80], err)
    code, _, data = server.post(C, {"model": server.model, "prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert code == 200 and json.loads(data)["usage"]["completion_tokens"] == 2
    status, health = server.get("/health")
    assert status == 200 and json.loads(health)["status"] == "ok"


def test_too_long_prompt_names_the_context(server: StrideServer) -> None:
    """The tokenizer's refusal (a text prompt: its length is known only after tokenization)."""
    code, _, data = server.post(C, {"model": server.model, "prompt": "hello " * (MAX_MODEL_LEN + 50)})
    assert code == 400
    err = json.loads(data)["error"]
    assert err["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in err["message"]
    # Control: the same words, fewer of them, are served.
    code, _, data = server.post(C, {"model": server.model, "prompt": "hello " * 100, "max_tokens": 1})
    assert code == 200, data


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"stride:{name}_total"))


def test_step_timeline_on_metrics(server: StrideServer, client: openai.OpenAI) -> None:
    """Each answered step adds to the timeline counters, and the parts nest: the device's span within rank 0's
    time, rank 0's within the round trip."""
    import urllib.request

    def scrape() -> str:
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
            return r.read().decode()

    before = scrape()
    assert "stride:steps_total{" in before  # exported from the start (0 on a fresh server)
    assert "stride:graph_steps_total{" in before
    client.completions.create(model=server.model, prompt="Count: one, two,", max_tokens=12, temperature=0, extra_body={
        "ignore_eos": True})
    time.sleep(1.2)  # the scheduler's totals reach the frontend every half second
    after = scrape()
    grew = {n: _counter(after, n) - _counter(before, n) for n in (
        "steps", "step_device_seconds", "step_worker_seconds", "step_round_trip_seconds", "step_gap_seconds",
        "graph_steps")}
    assert grew["steps"] >= 12, grew  # a prefill step and at least eleven decodes
    assert 0 < grew["step_device_seconds"] <= grew["step_worker_seconds"] <= grew["step_round_trip_seconds"], grew
    # Overlapped scheduling: each next step was sent before the answer to the one in flight came, so the scheduler
    # never stood between two steps (a launch with --no-overlap has a gap: tests/sched/test_scheduler.py).
    assert grew["step_gap_seconds"] == 0, grew
    assert grew["graph_steps"] == 0, grew  # the CPU's torch backend captures no graphs


def test_logit_bias_through_the_openai_client(server: StrideServer, client: openai.OpenAI, tok: ModelTokenizer) -> None:
    """+100 on one token makes greedy text that token over and over; the same request without it does not."""
    target = tok.encode(" banana", add_special_tokens=False)[0]
    biased = client.completions.create(model=server.model, prompt="My favourite fruit is", max_tokens=4,
                                       temperature=0, logit_bias={str(target): 100})
    assert tok.encode(biased.choices[0].text, add_special_tokens=False) == [target] * 4
    plain = client.completions.create(model=server.model, prompt="My favourite fruit is", max_tokens=4,
                                      temperature=0)
    assert tok.encode(plain.choices[0].text, add_special_tokens=False) != [target] * 4
    bad = client.with_options(max_retries=0)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        bad.completions.create(model=server.model, prompt="x", max_tokens=2, logit_bias={"49152": 5})
