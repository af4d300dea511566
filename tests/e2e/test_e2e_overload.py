"""Overload on the real stack: past the waiting-queue bound, new requests get 429 with Retry-After and
lose nothing; the server keeps serving (simulated backend, so the test is quick and the load steady)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import urllib.error
import urllib.request

import pytest
from e2e_helpers import StrideServer

pytestmark = pytest.mark.slow


def _complete(url: str, max_tokens: int) -> tuple[int, dict, dict]:
    body = json.dumps({"prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_queue_full_gets_429_with_retry_after_and_the_rest_complete() -> None:
    # One running sequence, one waiting: of 8 simultaneous requests, at least 6 find the queue full.
    with StrideServer("--backend", "sim", "--max-num-seqs", "1", "--max-waiting-requests", "1",
                      "--tokenizer-workers", "1") as server:
        with cf.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: _complete(server.url, 400), range(8)))
        statuses = sorted(status for status, _, _ in results)
        assert statuses.count(200) >= 1, statuses
        refused = [(h, b) for status, h, b in results if status == 429]
        assert len(refused) >= 5, statuses  # control: without a bound all 8 would be 200
        for headers, body in refused:
            assert int(headers["Retry-After"]) >= 1
            assert body["error"]["type"] and body["error"]["message"]
        for status, _, body in results:
            if status == 200:
                assert body["choices"][0]["finish_reason"] == "length"
                assert body["usage"]["completion_tokens"] == 400
        # The server keeps serving once the load is gone.
        status, _, body = _complete(server.url, 5)
        assert status == 200 and body["usage"]["completion_tokens"] == 5
    assert server.leftovers() == []


def test_without_a_tight_bound_nothing_is_refused() -> None:
    """Negative control for the test above: the same burst against the default bound all completes."""
    with StrideServer("--backend", "sim", "--max-num-seqs", "1", "--tokenizer-workers", "1") as server:
        with cf.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: _complete(server.url, 20), range(8)))
        assert [status for status, _, _ in results] == [200] * 8
