#!/usr/bin/env python
"""A chaotic load against a running Stride server, then the checks that it came through whole. Not a test: it prints
what it saw and exits 1 on a fault.

The load: C clients, each sending requests drawn at random from the kinds users send (chat and completions, streamed
or not, n of 1-3, logprobs, stop strings, seeds, a shared system prompt for prefix hits, JSON schemas, tool calls,
prompts as token ids; with ``--keys`` several tenants), and hanging up on about a third of them at a random point
(before the first chunk, mid-stream, or a non-streamed request cancelled after a random delay). Every answer that
arrives is checked: a 200's body has the shape the request asked for (n choices, each with one finish reason, no
stop string in its text, usage that adds up, logprobs one per token, JSON that parses under its schema when the
grammar finished, tool calls whose arguments parse); any other status is a fault unless it is a 429 (the waiting
queue's bound).

Before the load and after it the same greedy probes run one at a time: their answers must agree, token for token, up
to a tie (the second run may take its prompt's first blocks from the load's, computed in other batches, so logits
may differ by rounding; ``--tie``). After the load the server
must come back to rest: nothing running or waiting, no live KV blocks, ``/health`` 200.

    .venv/bin/stride serve --num-blocks 96 --max-model-len 1024 &   # a small pool: preemption under load
    .venv/bin/python scripts/soak.py --url http://127.0.0.1:8000 --clients 24 --requests 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

SYSTEM = ("You are a careful assistant for a travel agency. Answer in plain words, keep to the facts you are given, "
          "and say so when you do not know. ") * 4
TOPICS = ["the sea", "a lighthouse keeper", "trains at night", "bread", "a lost key", "winter in a small town",
          "the moon landing", "bees", "a chess game", "rain on a tin roof", "an old map", "a red bicycle"]
STOPS = [".", "\n", " the", ",", "!", "and"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}]
PROBES = ["Write one sentence about the history of paper.", "List three colours of the sky at dusk.",
          "What is a prime number? Answer briefly."]
FINISH = {"stop", "length", "tool_calls"}


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    faults: list[str] = field(default_factory=list)

    def fault(self, what: str) -> None:
        self.faults.append(what)
        self.outcomes["fault"] += 1


def make_request(rng: random.Random, model: str) -> tuple[str, dict[str, Any], str]:
    """(path, body, kind) drawn at random."""
    topic = rng.choice(TOPICS)
    roll = rng.random()
    body: dict[str, Any] = {"model": model, "max_tokens": rng.choice([1, 2, 8, 24, 48, 96, 256])}
    if rng.random() < 0.5:
        body["temperature"] = rng.choice([0.0, 0.7, 1.0, 1.3])
    if rng.random() < 0.4:
        body["seed"] = rng.randrange(1 << 31)
    if rng.random() < 0.25:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.3:  # the other sampling fields, a few at a time
        extra = {"top_p": rng.choice([0.5, 0.9]), "top_k": rng.choice([-1, 1, 40]), "min_p": 0.05,
                 "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
                 "logit_bias": {str(rng.randrange(100, 2000)): rng.choice([-100, 5])},
                 "stop_token_ids": [rng.randrange(100, 2000)], "ignore_eos": True,
                 "service_class": rng.choice(["interactive", "background"])}
        body.update(dict(rng.sample(sorted(extra.items()), rng.randint(1, 3))))
    if roll < 0.12:  # completions, prompt as text or token ids
        prompt: Any = f"Once upon a time, {topic}"
        if rng.random() < 0.3:
            prompt = [rng.randrange(100, 20000) for _ in range(rng.randint(1, 64))]
        body.update(prompt=prompt, n=rng.choice([1, 1, 2]))
        if rng.random() < 0.2:
            body.update(best_of=body["n"])  # the one best_of accepted (echo and other best_of are 400s)
        if rng.random() < 0.4:
            body["logprobs"] = rng.choice([0, 1, 3])
        return "/v1/completions", body, "completions"
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Tell me about {topic}."}]
    if rng.random() < 0.4:
        messages.insert(0, {"role": "system", "content": SYSTEM})
    body.update(messages=messages)
    if roll < 0.22:
        body.update(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
                    max_tokens=rng.choice([16, 64, 128]))
        return "/v1/chat/completions", body, "schema"
    if roll < 0.30:
        body.update(tools=TOOLS, tool_choice=rng.choice(["required", "auto"]), max_tokens=96)
        return "/v1/chat/completions", body, "tools"
    body["n"] = rng.choice([1, 1, 1, 2, 3])
    if rng.random() < 0.3:
        body.update(logprobs=True, top_logprobs=rng.choice([0, 2, 5]))
    return "/v1/chat/completions", body, "chat"


def check_body(path: str, req: dict[str, Any], data: dict[str, Any], kind: str) -> str | None:
    """What is wrong with a non-streamed 200 answer, or None."""
    n = req.get("n", 1)
    choices = data.get("choices") or []
    if sorted(c.get("index") for c in choices) != list(range(n)):
        return f"{kind}: choice indices {[c.get('index') for c in choices]} for n={n}"
    usage = data.get("usage") or {}
    total = 0
    for c in choices:
        if c.get("finish_reason") not in FINISH:
            return f"{kind}: finish_reason {c.get('finish_reason')!r}"
        text = c.get("text") if path.endswith("/completions") and "message" not in c else (
            (c.get("message") or {}).get("content") or "")
        for s in req.get("stop") or []:
            if s in (text or ""):
                return f"{kind}: stop string {s!r} in the text {text!r}"
        lp = c.get("logprobs")
        if lp and kind == "chat":
            count = len(lp.get("content") or [])
            total += count
            if count > req["max_tokens"]:
                return f"{kind}: {count} tokens for max_tokens {req['max_tokens']}"
        if lp and kind == "completions":
            total += len(lp.get("tokens") or [])
        cut = bool(req.get("stop") or req.get("stop_token_ids"))  # a stop may end a JSON value or a tool call
        if kind == "schema" and c["finish_reason"] == "stop" and not cut:
            try:
                value = json.loads(text)
            except ValueError:
                return f"schema: a finished answer that is not JSON: {text!r}"
            keys: set[str] = set(value) if isinstance(value, dict) else set()
            if not (isinstance(value, dict) and {"name", "age"} <= keys <= {"name", "age", "tags"}):
                return f"schema: {value!r} outside the schema"
        if kind == "tools" and c["finish_reason"] == "tool_calls":
            for call in (c.get("message") or {}).get("tool_calls") or []:
                args = json.loads(call["function"]["arguments"])
                if call["function"]["name"] != "get_weather" or set(args) != {"city"}:
                    return f"tools: call {call!r}"
        called = (c.get("message") or {}).get("tool_calls")
        if kind == "tools" and req.get("tool_choice") == "required" and c["finish_reason"] != "length" and not (
                cut or called):
            return f"tools: required, finished {c['finish_reason']!r} without a call"
    if usage.get("completion_tokens", -1) < 0 or usage.get("prompt_tokens", 0) <= 0:
        return f"{kind}: usage {usage!r}"
    if total and usage["completion_tokens"] != total:
        return f"{kind}: usage says {usage['completion_tokens']} tokens, logprobs {total}"
    if usage["completion_tokens"] > n * req["max_tokens"]:
        return f"{kind}: {usage['completion_tokens']} tokens for n={n} x max_tokens {req['max_tokens']}"
    return None


class Whole:
    """A streamed answer put back together as the non-streamed body it stands for (each choice's text or message
    with its tool calls, logprobs, finish reason; the usage chunk), for :func:`check_body`."""

    def __init__(self) -> None:
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] = {}

    def add(self, event: dict[str, Any]) -> None:
        self.usage = event.get("usage") or self.usage
        for c in event.get("choices") or []:
            whole = self.choices.setdefault(c["index"], {"index": c["index"], "text": "", "content": "",
                                                         "calls": {}, "logprobs": None, "finish_reason": None})
            whole["finish_reason"] = c.get("finish_reason") or whole["finish_reason"]
            delta = c.get("delta") or {}
            whole["text"] += c.get("text") or ""
            whole["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                have = whole["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                fn = call.get("function") or {}
                have["name"] += fn.get("name") or ""
                have["arguments"] += fn.get("arguments") or ""
            lp = c.get("logprobs")
            if lp:
                into = whole["logprobs"] = whole["logprobs"] or {"content": [], "tokens": []}
                into["content"] += lp.get("content") or []
                into["tokens"] += lp.get("tokens") or []

    def body(self, path: str) -> dict[str, Any]:
        chat = path.endswith("/chat/completions")
        choices = []
        for c in self.choices.values():
            out: dict[str, Any] = {"index": c["index"], "finish_reason": c["finish_reason"], "logprobs": c["logprobs"]}
            if chat:
                calls = [{"function": fn} for _, fn in sorted(c["calls"].items())]
                out["message"] = {"content": c["content"], **({"tool_calls": calls} if calls else {})}
            else:
                out["text"] = c["text"]
            choices.append(out)
        return {"choices": choices, "usage": self.usage}


async def one(session: aiohttp.ClientSession, url: str, rng: random.Random, model: str, tally: Tally,
              keys: list[str]) -> None:
    path, body, kind = make_request(rng, model)
    auth = {"Authorization": f"Bearer {rng.choice(keys)}"} if keys else None
    stream = rng.random() < 0.5
    hang_up = rng.random() < 0.33
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    try:
        if hang_up and not stream:
            task = asyncio.create_task(session.post(url + path, json=body, headers=auth))
            await asyncio.sleep(rng.uniform(0.0, 1.5))
            if not task.done():
                task.cancel()
                tally.outcomes["cancelled"] += 1
                return
            resp = task.result()
            if resp.status not in (200, 429):
                tally.fault(f"{kind}: status {resp.status}: {(await resp.text())[:300]}")
            else:
                tally.outcomes[f"{resp.status} (finished before its cancel)"] += 1
            resp.release()
            return
        async with session.post(url + path, json=body, headers=auth) as resp:
            if resp.status == 429:
                tally.outcomes["429"] += 1
                return
            if resp.status != 200:
                tally.fault(f"{kind}: status {resp.status}: {(await resp.text())[:300]}")
                return
            if not stream:
                problem = check_body(path, body, await resp.json(), kind)
                if problem:
                    tally.fault(problem)
                else:
                    tally.outcomes[f"{kind} ok"] += 1
                return
            cut = rng.randint(0, 6) if hang_up else -1
            finished: Counter[int] = Counter()
            whole = Whole()
            done = False
            chunks = 0
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                chunks += 1
                event = json.loads(payload)
                if "error" in event:
                    tally.fault(f"{kind} stream: error event {event['error']}")
                    return
                whole.add(event)
                finished.update(c["index"] for c in event.get("choices") or [] if c.get("finish_reason"))
                if chunks == cut:
                    tally.outcomes["hung up mid-stream"] += 1
                    return
            n = body.get("n", 1)
            if not done or sorted(finished) != list(range(n)) or max(finished.values()) != 1:
                tally.fault(f"{kind} stream: done={done}, finish reasons per choice {dict(finished)} for n={n}")
                return
            # The answer put back together: finish reasons, stop strings, schema and tool calls, usage.
            problem = check_body(path, body, whole.body(path), kind)
            if problem:
                tally.fault(f"stream: {problem}")
                return
            tally.outcomes[f"{kind} stream ok"] += 1
    except (TimeoutError, aiohttp.ClientError) as e:
        tally.fault(f"{kind}: {type(e).__name__}: {e}")


async def one_library(lib: Any, rng: random.Random, tally: Tally) -> None:
    """One request through the client library (:class:`stride.client.AsyncClient`): generated whole or streamed,
    a third abandoned (the task cancelled after a random delay, or the stream closed after a few deltas)."""
    from stride.client import StrideError

    params: dict[str, Any] = {"max_tokens": rng.choice([1, 8, 32, 96]), "temperature": rng.choice([0.0, 1.0])}
    if rng.random() < 0.3:
        params["stop"] = rng.sample(STOPS, 1)
    messages = [{"role": "user", "content": f"Tell me about {rng.choice(TOPICS)}."}]
    hang_up = rng.random() < 0.33
    try:
        if rng.random() < 0.5:
            task = asyncio.create_task(lib.generate(messages=messages, **params))
            if hang_up:
                await asyncio.sleep(rng.uniform(0.0, 1.0))
                if not task.done():
                    task.cancel()
                    tally.outcomes["library cancelled"] += 1
                    return
            result = await task
            text, tokens, finish, count = result.text, result.token_ids, result.finish_reason, result.num_output_tokens
        else:
            text, tokens, finish, count = "", [], None, 0
            cut = rng.randint(1, 4) if hang_up else -1
            stream = lib.stream(messages=messages, **params)
            try:
                async for i, delta in _enumerate(stream):
                    text += delta.text
                    tokens += delta.token_ids
                    finish, count = delta.finish_reason or finish, delta.num_output_tokens
                    if i + 1 == cut:
                        tally.outcomes["library hung up mid-stream"] += 1
                        return
            finally:
                await stream.aclose()
        if finish not in ("stop", "length") or count != len(tokens) or count > params["max_tokens"]:
            tally.fault(f"library: finish {finish!r}, {count} tokens counted, {len(tokens)} sent, {params}")
        elif any(s in text for s in params.get("stop") or []):
            tally.fault(f"library: stop string in {text!r}")
        else:
            tally.outcomes["library ok"] += 1
    except StrideError as e:
        if getattr(e, "status", 0) == 429:
            tally.outcomes["library 429"] += 1
        else:
            tally.fault(f"library: {type(e).__name__}: {e}")


async def _enumerate(it: Any) -> Any:
    i = 0
    async for x in it:
        yield i, x
        i += 1


async def probes(session: aiohttp.ClientSession, url: str, model: str) -> list[list[dict[str, Any]]]:
    """Each probe's tokens with their top logprobs (greedy, one at a time)."""
    out = []
    for prompt in PROBES:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 32,
                "temperature": 0, "logprobs": True, "top_logprobs": 5}
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise SystemExit(f"probe failed: {resp.status} {data}")
            out.append(data["choices"][0]["logprobs"]["content"])
    return out


def compare_probe(prompt: str, a: list[dict[str, Any]], b: list[dict[str, Any]], tie: float) -> tuple[str, bool]:
    """(what differs, whether it is a fault). The two runs' prompts may meet the model through different prefix
    blocks (the load's, computed in other batches), so their logits may differ by rounding: a greedy choice between
    two tokens within ``tie`` nats of each other may go either way. A larger gap, or logprobs of the shared tokens
    that moved more than ``tie``, is a fault (a block holding the wrong keys and values would do that)."""
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x["token"] != y["token"]), None)
    if at is None:
        moved = max((abs(x["logprob"] - y["logprob"]) for x, y in zip(a, b, strict=False)), default=0.0)
        return (f"probe {prompt!r}: same tokens, logprobs moved at most {moved:.3f}", moved > tie)
    x, y = a[at], b[at]
    # The other run's choice as each run saw it: near-tied if within ``tie`` of the top in both.
    gaps = [top["logprob"] - next((t["logprob"] for t in top_list if t["token"] == other), float("-inf"))
            for top, top_list, other in ((x, x["top_logprobs"], y["token"]), (y, y["top_logprobs"], x["token"]))]
    shared = max((abs(p["logprob"] - q["logprob"]) for p, q in zip(a[:at], b[:at], strict=True)), default=0.0)
    what = (f"probe {prompt!r}: token {at} {x['token']!r} -> {y['token']!r}, gaps {gaps[0]:.3f} / {gaps[1]:.3f} "
            f"nats, shared tokens' logprobs moved at most {shared:.3f}")
    return what, max(gaps) > tie or shared > tie


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("stride:") and "{" in line:
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0]] = float(value)
    return values


async def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    tally = Tally()
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    keys = [k for k in args.keys.split(",") if k]
    auth = {"Authorization": f"Bearer {keys[0]}"} if keys else None
    async with aiohttp.ClientSession(timeout=timeout, headers=auth) as session:
        async with session.get(args.url + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        before = await probes(session, args.url, model) if args.probes else []
        start = time.perf_counter()
        left = args.requests

        lib = None
        if args.client_address:
            from stride.client import AsyncClient

            lib = AsyncClient(args.client_address, keys[0] if keys else "", timeout=args.timeout)

        async def client(k: int) -> None:
            nonlocal left
            crng = random.Random(rng.randrange(1 << 30) + k)
            while left > 0:
                left -= 1
                if lib is not None and crng.random() < 0.2:
                    await one_library(lib, crng, tally)
                else:
                    await one(session, args.url, crng, model, tally, keys)
        peak_live = 0.0

        async def watch() -> None:
            nonlocal peak_live
            while True:
                m = await metrics(session, args.url)
                peak_live = max(peak_live, m.get("stride:kv_blocks_live", 0.0))
                await asyncio.sleep(0.5)
        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(client(k) for k in range(args.clients)))
        watcher.cancel()
        if lib is not None:
            await lib.close()
        took = time.perf_counter() - start
        rest: dict[str, float] = {}
        deadline = time.perf_counter() + 15
        while time.perf_counter() < deadline:
            rest = await metrics(session, args.url)
            if (rest.get("stride:kv_blocks_live"), rest.get("stride:num_seqs_running"),
                    rest.get("stride:num_requests_waiting"), rest.get("stride:num_requests_running")) == (0, 0, 0, 0):
                break
            await asyncio.sleep(0.5)
        else:
            tally.fault(f"not at rest 15 s after the load: {rest}")
        async with session.get(args.url + "/health") as resp:
            if resp.status != 200:
                tally.fault(f"/health {resp.status}")
        after = await probes(session, args.url, model) if args.probes else []
        for prompt, a, b in zip(PROBES[:len(before)], before, after, strict=True):
            what, bad = compare_probe(prompt, a, b, args.tie)
            if bad:
                tally.fault(what)
            else:
                print(what)
    print(f"{args.requests} requests from {args.clients} clients in {took:.1f} s")
    for what, count in sorted(tally.outcomes.items()):
        print(f"  {what:40s} {count}")
    print(f"peak live blocks {peak_live:.0f}; "
          f"preemptions {rest.get('stride:num_preemptions_total', 0):.0f}; "
          f"at rest: live {rest.get('stride:kv_blocks_live')}, cached {rest.get('stride:kv_blocks_cached')}, "
          f"free {rest.get('stride:kv_blocks_free')}")
    for f in tally.faults[:20]:
        print("FAULT", f)
    return 1 if tally.faults else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600, help="seconds a request may take")
    parser.add_argument("--keys", default="", help="API keys, comma-separated: each request takes one at random "
                        "(tenants' prefix caches apart); the probes and the server's pages the first")
    parser.add_argument("--client-address", default="",
                        help="the server's client-library address (its start line prints it): a fifth of the requests "
                        "then go through stride.client's AsyncClient")
    parser.add_argument("--no-probes", dest="probes", action="store_false",
                        help="skip the greedy probes (the simulated backend's tokens are random)")
    parser.add_argument("--tie", type=float, default=0.3,
                        help="nats within which the probes' logprobs may differ between runs (rounding; default 0.3: "
                        "two bf16 steps of a logit near 20)")
    sys.exit(asyncio.run(run(parser.parse_args())))


if __name__ == "__main__":
    main()
