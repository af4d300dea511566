"""Request parsing and validation: an OpenAI request body → a :class:`ParsedRequest`, or an
:class:`ApiError` 400 naming the field. Everything past this module trusts what it gets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from stride.config import SchedulerConfig
from stride.frontend.errors import ApiError, from_value_error, invalid
from stride.ipc.messages import GenerateRequest
from stride.params import SamplingParams

MAX_N = 16
DEFAULT_CHAT_MAX_TOKENS = 1024
"""Chat requests without ``max_tokens`` get this many (or the context length, if shorter)."""

_SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "ignore_eos", "stop_token_ids"}
_COMMON = _SAMPLING_FIELDS | {"model", "max_tokens", "n", "stop", "stream", "stream_options", "user",
                              "service_class", "logit_bias"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
CLIENT_FIELDS = _SAMPLING_FIELDS | {"max_tokens", "stop", "logprobs", "service_class"}
_ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True)
class ParsedRequest:
    """One validated generation request (``n`` sequences of the same prompt)."""

    chat: bool
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    service_class: str | None = None

    def sequences(self, req_id: str, tenant: str) -> list[GenerateRequest]:
        """The wire requests, one per sequence: ids ``<req_id>-i``, seeds ``seed + i`` when seeded."""
        out = []
        for i in range(self.n):
            params = self.params
            if params.seed is not None and i:
                params = dataclasses.replace(params, seed=params.seed + i)
            out.append(GenerateRequest(req_id=f"{req_id}-{i}", tenant=tenant, params=params,
                                       prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                                       messages=self.messages, service_class=self.service_class))
        return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _get(body: dict[str, Any], name: str, kind: str) -> Any:
    """``body[name]`` if present and not null, checked against ``kind``; None otherwise."""
    v = body.get(name)
    if v is None:
        return None
    ok = {"int": _is_int(v), "number": (_is_int(v) or isinstance(v, float)), "bool": isinstance(v, bool),
          "str": isinstance(v, str), "dict": isinstance(v, dict), "list": isinstance(v, list)}[kind]
    if not ok:
        want = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string",
                "dict": "an object", "list": "an array"}[kind]
        raise invalid(f"'{name}' must be {want}, got {type(v).__name__}", name)
    return v


def _check_fields(body: Any, allowed: set[str]) -> None:
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(f"unrecognized request argument: {unknown[0]}", unknown[0])


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise invalid("'stop' must be a string or an array of strings", "stop")


def sampling_params(body: dict[str, Any], *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """Build :class:`SamplingParams` from the shared fields; range errors become 400s naming the field."""
    kwargs: dict[str, Any] = {"stop": _stop(body), "logprobs": logprobs}
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    for name, kind in (("temperature", "number"), ("top_p", "number"), ("top_k", "int"), ("min_p", "number"),
                       ("seed", "int"), ("presence_penalty", "number"), ("frequency_penalty", "number"),
                       ("repetition_penalty", "number"), ("ignore_eos", "bool")):
        v = _get(body, name, kind)
        if v is not None:
            kwargs[name] = float(v) if kind == "number" else v
    ids = _get(body, "stop_token_ids", "list")
    if ids is not None:
        if not all(_is_int(t) and t >= 0 for t in ids):
            raise invalid("'stop_token_ids' must be non-negative integers", "stop_token_ids")
        kwargs["stop_token_ids"] = tuple(ids)
    if kwargs.get("top_k") == -1:
        kwargs["top_k"] = 0  # vLLM's spelling of "no top-k"
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise from_value_error(e) from None


def _common(body: dict[str, Any], sched: SchedulerConfig) -> dict[str, Any]:
    """Fields shared by both endpoints: n, stream, stream_options, service_class, and the ignored ones."""
    n = _get(body, "n", "int")
    if n is not None and not 1 <= n <= MAX_N:
        raise invalid(f"'n' must be in [1, {MAX_N}], got {n}", "n")
    stream = bool(_get(body, "stream", "bool"))
    opts = _get(body, "stream_options", "dict")
    include_usage = False
    if opts is not None:
        if not stream:
            raise invalid("'stream_options' is only allowed with 'stream': true", "stream_options")
        _check_fields(opts, {"include_usage", "continuous_usage_stats"})
        include_usage = bool(_get(opts, "include_usage", "bool"))
    service_class = _get(body, "service_class", "str")
    if service_class is not None:
        try:
            sched.service_class(service_class)
        except ValueError as e:
            raise invalid(str(e), "service_class") from None
    _get(body, "user", "str")
    if body.get("logit_bias"):
        raise invalid("'logit_bias' is not supported", "logit_bias")
    return {"n": n or 1, "stream": stream, "include_usage": include_usage, "service_class": service_class}


def _max_tokens(body: dict[str, Any], name: str) -> int | None:
    v = _get(body, name, "int")
    if v is not None and v < 1:
        raise invalid(f"'{name}' must be at least 1, got {v}", name)
    return v


def parse_prompt(prompt: Any, max_model_len: int) -> tuple[str | None, list[int] | None]:
    """A completions ``prompt``: a string, a one-element array of strings, or token ids (flat or nested
    once). Returns ``(text, token_ids)`` with exactly one set."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # batches of one are common in clients; larger batches are not supported
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("'prompt' must not be empty", "prompt")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        if len(prompt) >= max_model_len:
            raise invalid(f"prompt has {len(prompt)} tokens; the context is {max_model_len}", "prompt")
        return None, list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise invalid("batched prompts are not supported; send one prompt per request", "prompt")
    raise invalid("'prompt' must be a non-empty string or an array of non-negative token ids", "prompt")


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages, with content parts flattened to text; roles checked."""
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{param} must be an object", param)
        role = m.get("role")
        if role not in _ROLES:
            raise invalid(f"{param}.role must be one of {', '.join(_ROLES)}, got {role!r}", f"{param}.role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise invalid(f"{param}.content: only text parts are supported", f"{param}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise invalid(f"{param}.content must be a string or an array of text parts", f"{param}.content")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise invalid(f"{param}: unsupported field {sorted(extra)[0]!r}", param)
        out.append({"role": role, "content": content})
    return out


def parse_completion(body: Any, sched: SchedulerConfig) -> ParsedRequest:
    _check_fields(body, COMPLETION_FIELDS)
    if "prompt" not in body:
        raise invalid("missing required field 'prompt'", "prompt")
    if body.get("echo"):
        raise invalid("'echo' is not supported", "echo")
    for name in ("best_of", "suffix"):
        if body.get(name) not in (None, 1):
            raise invalid(f"'{name}' is not supported", name)
    common = _common(body, sched)
    text, token_ids = parse_prompt(body["prompt"], sched.max_model_len)
    logprobs = _get(body, "logprobs", "int")
    params = sampling_params(body, max_tokens=_max_tokens(body, "max_tokens"), logprobs=logprobs)
    return ParsedRequest(chat=False, params=params, prompt=text, prompt_token_ids=token_ids, **common)


def parse_chat(body: Any, sched: SchedulerConfig) -> ParsedRequest:
    _check_fields(body, CHAT_FIELDS)
    if "messages" not in body:
        raise invalid("missing required field 'messages'", "messages")
    messages = parse_messages(body["messages"])
    common = _common(body, sched)
    want = _get(body, "logprobs", "bool")
    top = _get(body, "top_logprobs", "int")
    if top is not None and not want:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    max_tokens = _max_tokens(body, "max_completion_tokens") or _max_tokens(body, "max_tokens")
    if max_tokens is None:
        max_tokens = min(DEFAULT_CHAT_MAX_TOKENS, sched.max_model_len)
    params = sampling_params(body, max_tokens=max_tokens, logprobs=(top or 0) if want else None)
    return ParsedRequest(chat=True, params=params, messages=messages, **common)


def parse_client(prompt: str | None, prompt_token_ids: list[int] | None,
                 messages: list[dict[str, Any]] | None, params: dict[str, Any],
                 sched: SchedulerConfig) -> ParsedRequest:
    """A :class:`~stride.ipc.messages.ClientGenerate`, validated like an HTTP body (one sequence)."""
    _check_fields(params, CLIENT_FIELDS)
    if sum(x is not None for x in (prompt, prompt_token_ids, messages)) != 1:
        raise invalid("exactly one of prompt, prompt_token_ids and messages must be set", "prompt")
    service_class = _get(params, "service_class", "str")
    if service_class is not None:
        try:
            sched.service_class(service_class)
        except ValueError as e:
            raise invalid(str(e), "service_class") from None
    sp = sampling_params(params, max_tokens=_max_tokens(params, "max_tokens"),
                         logprobs=_get(params, "logprobs", "int"))
    if messages is not None:
        return ParsedRequest(chat=True, params=sp, messages=parse_messages(messages),
                             service_class=service_class)
    text, ids = parse_prompt(prompt if prompt is not None else prompt_token_ids, sched.max_model_len)
    return ParsedRequest(chat=False, params=sp, prompt=text, prompt_token_ids=ids,
                         service_class=service_class)


__all__ = ["ApiError", "ParsedRequest", "parse_chat", "parse_client", "parse_completion"]
