"""End to end with an API-key file (two keys, two tenants): the prefix cache is shared within a tenant and
never across; and 32 concurrent streaming clients, some of which hang up mid-stream, leave no KV block live.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import pytest
from e2e_helpers import StrideServer, wait_for

KEYS = {"A": "key-alpha-1234", "B": "key-beta-5678"}
# About 150 tokens: nine full 16-token blocks and a partial one.
LONG_PROMPT = ("The committee met on Tuesday to review the budget for the coming year. " * 10).strip()
NUM_CLIENTS = 32
DISCONNECT_EVERY = 4
"""Every fourth client hangs up after a few chunks of a long generation."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StrideServer]:
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(f"# key tenant\n{KEYS['A']} tenant-a\n{KEYS['B']} tenant-b\n")
    with StrideServer("--api-keys", str(keys), "--max-num-seqs", "16", "--num-blocks", "256",
                      "--max-model-len", "2048") as srv:
        yield srv
    assert srv.leftovers() == [], srv.tail()


def _auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def _cached(server: StrideServer, who: str, prompt: str = LONG_PROMPT) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of a one-token completion under ``who``'s key."""
    code, _, data = server.post("/v1/completions", {"model": server.model, "prompt": prompt, "max_tokens": 1},
                                headers=_auth(who))
    assert code == 200, data
    usage = json.loads(data)["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def test_keys_are_required(server: StrideServer) -> None:
    body = {"model": server.model, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEYS["A"]}):
        code, _, data = server.post("/v1/completions", body, headers=headers)
        assert code == 401 and json.loads(data)["error"]["code"] == "invalid_api_key", (headers, data)
    code, _, _ = server.post("/v1/completions", body, headers=_auth("A"))
    assert code == 200


def test_prefix_cache_is_per_tenant(server: StrideServer) -> None:
    num_prompt, cached = _cached(server, "A")
    assert num_prompt > 8 * 16 and cached == 0  # first sight of this prompt
    _, cached_again = _cached(server, "A")
    assert cached_again >= 8 * 16 and cached_again % 16 == 0 and cached_again < num_prompt
    # Tenant B sends the very same bytes: a different chain seed, so nothing of A's is found.
    assert _cached(server, "B") == (num_prompt, 0)
    # Control: B's own second request hits B's blocks, so the zero above is isolation, not a cold cache.
    assert _cached(server, "B")[1] == cached_again
    # And A still hits its own blocks, with a streamed request reporting the same usage.
    code, _, data = server.post("/v1/completions", {"model": server.model, "prompt": LONG_PROMPT, "max_tokens": 2,
                                                    "stream": True, "stream_options": {"include_usage": True}},
                                headers=_auth("A"))
    assert code == 200
    events = [json.loads(line[6:]) for line in data.decode().splitlines()
              if line.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached_again


async def _client(session: aiohttp.ClientSession, url: str, model: str, i: int) -> tuple[str, int]:
    """One streaming request. Returns (how it ended, number of content chunks seen)."""
    hang_up = i % DISCONNECT_EVERY == 0
    body = {"model": model, "prompt": f"Client {i} says: tell me a story about the number {i}.",
            "max_tokens": 400 if hang_up else 16, "temperature": 0, "ignore_eos": True, "stream": True}
    async with session.post(url + "/v1/completions", json=body, headers=_auth("A")) as resp:
        assert resp.status == 200, await resp.text()
        chunks, finish = 0, None
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return f"done:{finish}", chunks
            event = json.loads(line[6:])
            assert "error" not in event, event
            chunks += 1
            finish = event["choices"][0]["finish_reason"] or finish
            if hang_up and chunks == 3:
                resp.close()  # drop the connection mid-stream
                return "hung up", chunks
    return "eof", chunks


async def _load(server: StrideServer) -> tuple[list[tuple[str, int]], float]:
    """Run every client at once; meanwhile sample the live-block gauge. Returns the outcomes and the
    largest live count seen."""
    peak = 0.0
    timeout = aiohttp.ClientTimeout(total=240)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = [asyncio.create_task(_client(session, server.url, server.model, i)) for i in range(NUM_CLIENTS)]
        while not all(t.done() for t in tasks):
            peak = max(peak, await asyncio.to_thread(server.metric, "stride:kv_blocks_live"))
            await asyncio.sleep(0.3)
        return [t.result() for t in tasks], peak


@pytest.mark.slow
def test_concurrent_streams_with_disconnects_leave_no_live_blocks(server: StrideServer) -> None:
    outcomes, peak = asyncio.run(_load(server))
    for i, (how, chunks) in enumerate(outcomes):
        if i % DISCONNECT_EVERY == 0:
            assert how == "hung up", (i, how)
        else:
            assert (how, chunks) == ("done:length", 16), (i, how, chunks)
    assert peak > 0  # control: the gauge does show blocks while sequences run
    # The hung-up requests asked for 400 tokens each; only their abort can free their blocks this soon.
    # The scheduler publishes its stats every half second: wait for a snapshot with nothing live.
    assert wait_for(lambda: (server.metric("stride:kv_blocks_live"), server.metric("stride:num_seqs_running"))
                    == (0, 0), 10), server.tail()
    assert server.metric("stride:num_requests_running") == 0
    assert server.metric("stride:kv_blocks_cached") > 0  # the finished prompts stay indexed
    code, _, data = server.post("/v1/completions", {"model": server.model, "prompt": "hi", "max_tokens": 2},
                                headers=_auth("B"))
    assert code == 200, data

