"""Response bodies and stream chunks in the OpenAI shapes (chat and legacy completions)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stride.frontend.tools import parse_output


@dataclass
class Choice:
    """What one sequence has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


def finish_reason(raw: str | None) -> str | None:
    """The API knows ``stop`` and ``length``; EOS, stop strings and stop tokens are all ``stop``."""
    if raw is None:
        return None
    return "length" if raw == "length" else "stop"


def usage(choices: list[Choice]) -> dict[str, Any]:
    """Prompt counted once (all sequences share it), completions summed, cached tokens of sequence 0."""
    prompt = max((c.num_prompt_tokens for c in choices), default=0)
    completion = sum(max(c.num_output_tokens, len(c.token_ids)) for c in choices)
    cached = choices[0].num_cached_tokens if choices else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chat_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {"content": [{"token": e.get("token", ""), "logprob": e.get("logprob", 0.0),
                         "bytes": e.get("bytes"), "top_logprobs": e.get("top_logprobs") or []}
                        for e in entries]}


def completion_logprobs(entries: list[dict[str, Any]] | None, text_offset: int = 0) -> dict[str, Any] | None:
    """The legacy completions shape: parallel arrays, top alternatives as ``{token: logprob}`` maps."""
    if entries is None:
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for e in entries:
        tok = e.get("token", "")
        tokens.append(tok)
        token_logprobs.append(e.get("logprob", 0.0))
        tops.append({t.get("token", ""): t.get("logprob", 0.0) for t in e.get("top_logprobs") or []})
        offsets.append(text_offset)
        text_offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def completion_body(req_id: str, created: int, model: str, choices: list[Choice],
                    want_logprobs: bool) -> dict[str, Any]:
    return {"id": req_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c.index, "text": c.text,
                         "logprobs": completion_logprobs(c.logprobs) if want_logprobs else None,
                         "finish_reason": finish_reason(c.finish_reason)} for c in choices],
            "usage": usage(choices)}


def chat_body(req_id: str, created: int, model: str, choices: list[Choice],
              want_logprobs: bool, tools: bool = False) -> dict[str, Any]:
    """``tools``: the request offered tools, so each output is read for calls (``message.tool_calls``, finish reason
    ``tool_calls`` when it stopped on its own with calls)."""
    out = []
    for c in choices:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        reason = finish_reason(c.finish_reason)
        if tools:
            content, calls = parse_output(c.text)
            if calls:
                message = {"role": "assistant", "content": content,
                           "tool_calls": [call.body() for call in calls]}
                reason = "tool_calls" if reason == "stop" else reason
        out.append({"index": c.index, "message": message,
                    "logprobs": chat_logprobs(c.logprobs) if want_logprobs else None, "finish_reason": reason})
    return {"id": req_id, "object": "chat.completion", "created": created, "model": model, "choices": out,
            "usage": usage(choices)}


def chunk(chat: bool, req_id: str, created: int, model: str, index: int, *, text: str | None,
          role: bool = False, logprobs: list[dict[str, Any]] | None = None, text_offset: int = 0,
          finish: str | None = None, include_usage: bool = False,
          tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One stream chunk for one choice. ``usage`` is null on every chunk but the last when asked for.
    ``tool_calls``: calls completed in this chunk (chat), each with its ``index`` among the choice's calls; a
    ``finish`` of ``tool_calls`` is passed through."""
    if chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs),
                                  "finish_reason": "tool_calls" if finish == "tool_calls" else finish_reason(finish)}
        body: dict[str, Any] = {"id": req_id, "object": "chat.completion.chunk", "created": created,
                                "model": model, "choices": [choice]}
    else:
        choice = {"index": index, "text": text or "",
                  "logprobs": completion_logprobs(logprobs, text_offset),
                  "finish_reason": finish_reason(finish)}
        body = {"id": req_id, "object": "text_completion", "created": created, "model": model,
                "choices": [choice]}
    if include_usage:
        body["usage"] = None
    return body


def usage_chunk(chat: bool, req_id: str, created: int, model: str, choices: list[Choice]) -> dict[str, Any]:
    return {"id": req_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage(choices)}
