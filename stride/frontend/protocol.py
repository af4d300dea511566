"""Request parsing and validation: an OpenAI request body → a :class:`ParsedRequest`, or an
:class:`ApiError` 400 naming the field. Everything past this module trusts what it gets."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from stride.config import SchedulerConfig, StrideConfig
from stride.frontend import tools as tools_mod
from stride.frontend.errors import ApiError, from_value_error, invalid
from stride.ipc.messages import GenerateRequest
from stride.params import (
    CONTEXT_LENGTH_EXCEEDED,
    MAX_LOGIT_BIAS,
    SEED_MODULUS,
    Constraint,
    LogitBias,
    SamplingParams,
    context_overflow,
)

log = logging.getLogger(__name__)

MAX_N = 16
MAX_TOP_LOGPROBS = 20
DEFAULT_COMPLETION_MAX_TOKENS = 16
"""``/v1/completions`` without ``max_tokens`` generates this many, as OpenAI's legacy API and vLLM do; chat
requests without it get the rest of the context."""

_SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "ignore_eos", "stop_token_ids", "logit_bias"}
CONSTRAINT_FIELDS = {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar"}
"""Structured outputs: OpenAI's ``response_format``, vLLM's ``structured_outputs`` object and its older
``guided_*`` fields; at most one constraint per request, on either endpoint."""
_COMMON = _SAMPLING_FIELDS | CONSTRAINT_FIELDS | {"model", "max_tokens", "n", "stop", "stream", "stream_options",
                                                  "user", "service_class"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls"}
CLIENT_FIELDS = _SAMPLING_FIELDS | CONSTRAINT_FIELDS | {"max_tokens", "stop", "logprobs", "service_class"}
UNSUPPORTED_FIELDS = {"functions", "function_call"}
"""Fields that change what a client gets back, so ignoring them would answer a different question: refused with a
400 naming them, where every other unknown field is ignored."""
IGNORED_FIELDS_HEADER = "X-Stride-Ignored-Fields"
"""Names the request fields this server did not know and ignored (comma-separated), on any answer."""
_ROLES = ("system", "developer", "user", "assistant", "tool")
_warned: set[str] = set()


@dataclass(frozen=True)
class Limits:
    """What a request is checked against before anything is sent: the context, the vocabulary, the prompt's size,
    the service classes. Built once per frontend from the launch's configuration."""

    sched: SchedulerConfig
    vocab_size: int = 0
    """Token ids must be below it; 0: not known (ids are then only checked to be non-negative)."""
    max_prompt_chars: int = 0
    """Most characters of a prompt; 0: no bound."""

    @staticmethod
    def from_config(config: StrideConfig) -> Limits:
        return Limits(config.scheduler, config.facts.vocab_size,
                      config.server.prompt_char_limit(config.scheduler.max_model_len))

    @property
    def max_model_len(self) -> int:
        return self.sched.max_model_len

    def check_token_ids(self, ids: list[Any], name: str) -> None:
        bound = self.vocab_size or (1 << 31)
        if not all(_is_int(t) and 0 <= t < bound for t in ids):
            raise invalid(f"'{name}' must be token ids in [0, {bound})", name)

    def check_chars(self, num_chars: int) -> None:
        if self.max_prompt_chars and num_chars > self.max_prompt_chars:
            raise ApiError(400, f"the prompt has {num_chars} characters; this server takes at most "
                                f"{self.max_prompt_chars} (--max-prompt-chars)", param="prompt",
                           code="prompt_too_long")


def context_error(message: str, param: str = "max_tokens") -> ApiError:
    return ApiError(400, message, param=param, code=CONTEXT_LENGTH_EXCEEDED)


def ignored_header(fields: tuple[str, ...]) -> dict[str, str]:
    return {IGNORED_FIELDS_HEADER: ", ".join(fields)} if fields else {}


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
    ignored_fields: tuple[str, ...] = ()
    """Fields of the body this server does not know and ignored (named in a response header)."""
    constraint: Constraint | None = None
    """What every sequence's output must match (structured outputs)."""
    tools: list[dict[str, Any]] | None = None
    """Functions the model may call (rendered into the prompt; its output parsed into ``tool_calls``); None when
    the request has none or ``tool_choice`` is ``none``."""

    def sequences(self, req_id: str, tenant: str) -> list[GenerateRequest]:
        """The wire requests, one per sequence: ids ``<req_id>-i``, seeds ``seed + i`` when seeded."""
        out = []
        for i in range(self.n):
            params = self.params
            if params.seed is not None and i:
                params = dataclasses.replace(params, seed=(params.seed + i) % SEED_MODULUS)
            out.append(GenerateRequest(req_id=f"{req_id}-{i}", tenant=tenant, params=params,
                                       prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                                       messages=self.messages, service_class=self.service_class,
                                       constraint=self.constraint, tools=self.tools))
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
        if kind == "int" and isinstance(v, float) and math.isfinite(v) and abs(v) >= 2**63:
            # The JSON reader gives an integer literal past 64 bits as a float: say what was sent, not "float".
            raise invalid(f"'{name}' must be an integer that fits 64 bits, got {v:.6g}", name)
        want = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string",
                "dict": "an object", "list": "an array"}[kind]
        raise invalid(f"'{name}' must be {want}, got {type(v).__name__}", name)
    return v


_TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}
"""Chat only: refused on the other endpoints, where ignoring them would answer a different question."""


def _check_fields(body: Any, allowed: set[str], *, strict: bool = False) -> tuple[str, ...]:
    """The fields of ``body`` outside ``allowed``, which are ignored (each logged once per process); those in
    :data:`UNSUPPORTED_FIELDS`, or any with ``strict``, are refused."""
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    for name in unknown:
        if name in UNSUPPORTED_FIELDS or name in _TOOL_FIELDS:
            raise invalid(f"'{name}' is not supported", name)
        if strict:
            raise invalid(f"unrecognized parameter: {name}", name)
        if name not in _warned and len(_warned) < 1024:
            _warned.add(name)
            log.warning("ignoring unknown request field %r (logged once)", name)
    return tuple(unknown)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise invalid("'stop' must be a string or an array of strings", "stop")


def _logit_bias(bias: dict[str, Any], limits: Limits) -> tuple[LogitBias, ...]:
    """OpenAI's ``{"token id": bias}`` map: ids (as JSON keys, so strings) in the vocabulary, biases numbers."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise invalid(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", "logit_bias")
    out = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise invalid(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
        if not (_is_int(value) or isinstance(value, float)) or not -100 <= value <= 100:
            raise invalid(f"'logit_bias' values must be numbers in [-100, 100], got {value!r} for {key}",
                          "logit_bias")
        out.append(LogitBias(int(key), float(value)))
    limits.check_token_ids([b.token_id for b in out], "logit_bias")
    return tuple(out)


def sampling_params(body: dict[str, Any], limits: Limits, *, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    """Build :class:`SamplingParams` from the shared fields; range errors become 400s naming the field."""
    kwargs: dict[str, Any] = {"stop": _stop(body), "logprobs": logprobs, "max_tokens": max_tokens}
    for name, kind in (("temperature", "number"), ("top_p", "number"), ("top_k", "int"), ("min_p", "number"),
                       ("seed", "int"), ("presence_penalty", "number"), ("frequency_penalty", "number"),
                       ("repetition_penalty", "number"), ("ignore_eos", "bool")):
        v = _get(body, name, kind)
        if v is not None:
            kwargs[name] = float(v) if kind == "number" else v
    seed = kwargs.get("seed")
    if seed is not None:
        if not -(1 << 63) <= seed < SEED_MODULUS:
            raise invalid(f"'seed' must be a 64-bit integer, got {seed}", "seed")
        kwargs["seed"] = seed % SEED_MODULUS
    ids = _get(body, "stop_token_ids", "list")
    if ids is not None:
        limits.check_token_ids(ids, "stop_token_ids")
        kwargs["stop_token_ids"] = tuple(ids)
    bias = _get(body, "logit_bias", "dict")
    if bias:
        kwargs["logit_bias"] = _logit_bias(bias, limits)
    if kwargs.get("top_k") == -1:
        kwargs["top_k"] = 0  # vLLM's spelling of "no top-k"
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise from_value_error(e) from None


def _service_class(body: dict[str, Any], sched: SchedulerConfig) -> str | None:
    service_class = _get(body, "service_class", "str")
    if service_class is not None:
        try:
            sched.service_class(service_class)
        except ValueError as e:
            raise invalid(str(e), "service_class") from None
    return service_class


def _common(body: dict[str, Any], limits: Limits) -> dict[str, Any]:
    """Fields shared by both endpoints: n, stream, stream_options, service_class, and the refused ones."""
    n = _get(body, "n", "int")
    if n is not None and not 1 <= n <= MAX_N:
        raise invalid(f"'n' must be in [1, {MAX_N}], got {n}", "n")
    stream = bool(_get(body, "stream", "bool"))
    opts = _get(body, "stream_options", "dict")
    include_usage = False
    if opts is not None:
        if not stream:
            raise invalid("'stream_options' is only allowed with 'stream': true", "stream_options")
        include_usage = bool(_get(opts, "include_usage", "bool"))
        _get(opts, "continuous_usage_stats", "bool")
    _get(body, "user", "str")
    return {"n": n or 1, "stream": stream, "include_usage": include_usage,
            "service_class": _service_class(body, limits.sched)}


def _max_tokens(body: dict[str, Any], name: str, limits: Limits) -> int | None:
    v = _get(body, name, "int")
    if v is not None and v < 1:
        raise invalid(f"'{name}' must be at least 1, got {v}", name)
    why = context_overflow(None, v, limits.max_model_len)
    if why is not None:
        raise context_error(why.replace("max_tokens", name, 1), name)
    return v


def parse_prompt(prompt: Any, limits: Limits, max_tokens: int | None) -> tuple[str | None, list[int] | None]:
    """A completions ``prompt``: a string, a one-element array of strings, or token ids (flat or nested
    once). Returns ``(text, token_ids)`` with exactly one set. Token ids are checked against the vocabulary and,
    with ``max_tokens``, against the context; text against the prompt's character bound."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # batches of one are common in clients; larger batches are not supported
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("'prompt' must not be empty", "prompt")
        limits.check_chars(len(prompt))
        return prompt, None
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        limits.check_token_ids(prompt, "prompt")
        why = context_overflow(len(prompt), max_tokens, limits.max_model_len)
        if why is not None:
            raise context_error(why, "prompt")
        return None, list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid("batched prompts are not supported; send one prompt per request", "prompt")
    raise invalid("'prompt' must be a non-empty string or an array of non-negative token ids", "prompt")


def parse_messages(messages: Any, limits: Limits) -> list[dict[str, Any]]:
    """Chat messages, with content parts flattened to text; roles checked, contents bounded together."""
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
        extra = set(m) - {"role", "content", "name"} - ({"tool_calls"} if role == "assistant" else set()) - (
            {"tool_call_id"} if role == "tool" else set())
        if extra:
            raise invalid(f"{param}: unsupported field {sorted(extra)[0]!r}", param)
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise invalid(f"{param}.name must be a string", f"{param}.name")
        msg: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _history_calls(m["tool_calls"], f"{param}.tool_calls")
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise invalid(f"{param}.tool_call_id must be a string", f"{param}.tool_call_id")
            msg["tool_call_id"] = call_id
        out.append(msg)
    limits.check_chars(sum(len(m["content"]) for m in out))
    return out


def _history_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's earlier ``tool_calls``: each ``{id, type: function, function: {name, arguments}}``,
    the arguments JSON text of an object (kept as the object, which chat templates render)."""
    if not isinstance(calls, list):
        raise invalid(f"{param} must be an array", param)
    out = []
    for i, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
                fn.get("arguments", "{}"), str):
            raise invalid(f"{param}[{i}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                          f"\"arguments\"}}}}", f"{param}[{i}]")
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except json.JSONDecodeError:
            raise invalid(f"{param}[{i}].function.arguments is not valid JSON", f"{param}[{i}].function.arguments"
                          ) from None
        out.append({"id": str(c.get("id", "")), "type": "function", "function": {"name": fn["name"],
                                                                                  "arguments": args}})
    return out


def _completion_only(body: dict[str, Any], n: int) -> None:
    """``echo``, ``suffix`` and ``best_of``: accepted where they ask for what a plain completion is."""
    if _get(body, "echo", "bool"):
        raise invalid("'echo' is not supported", "echo")
    if _get(body, "suffix", "str"):
        raise invalid("'suffix' is not supported", "suffix")
    best_of = _get(body, "best_of", "int")
    if best_of is not None and best_of != n:
        raise invalid(f"'best_of' other than n is not supported (best_of {best_of}, n {n})", "best_of")


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema given as an object (or JSON text) → canonical JSON text: the same schema, the same cache key."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise invalid(f"'{param}' is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict | bool):
        raise invalid(f"'{param}' must be a JSON schema (an object)", param)
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def _response_format(fmt: dict[str, Any]) -> Constraint | None:
    kind = _get(fmt, "type", "str")
    if kind is None:
        raise invalid("response_format needs 'type'", "response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = _get(fmt, "json_schema", "dict")
        if spec is None:
            raise invalid("response_format of type 'json_schema' needs 'json_schema'", "response_format.json_schema")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise invalid("response_format.json_schema needs 'schema'", "response_format.json_schema.schema")
        return Constraint("json_schema", _schema_text(schema, "response_format.json_schema.schema"))
    raise invalid(f"response_format of type {kind!r} is not supported (text, json_object, json_schema)",
                  "response_format.type")


def _guided(source: dict[str, Any], prefix: str) -> list[Constraint]:
    """vLLM's constraint fields, ``guided_json`` etc. (``prefix`` "guided_") or inside ``structured_outputs``."""
    out = []
    json_spec = source.get(f"{prefix}json")
    if json_spec is not None:
        out.append(Constraint("json_schema", _schema_text(json_spec, f"{prefix}json")))
    regex = _get(source, f"{prefix}regex", "str")
    if regex is not None:
        out.append(Constraint("regex", regex))
    choice = _get(source, f"{prefix}choice", "list")
    if choice is not None:
        if not choice or not all(isinstance(c, str) and c for c in choice):
            raise invalid(f"'{prefix}choice' must be a non-empty array of non-empty strings", f"{prefix}choice")
        out.append(Constraint("choice", json.dumps(choice)))
    grammar = _get(source, f"{prefix}grammar", "str")
    if grammar is not None:
        out.append(Constraint("grammar", grammar))
    if prefix == "" and _get(source, "json_object", "bool"):
        out.append(Constraint("json_object"))
    return out


def constraint(body: dict[str, Any]) -> Constraint | None:
    """The request's structured-output constraint, or None; 400 for a malformed one or for more than one. Whether
    the schema, regex or grammar compiles is checked where it is compiled (the tokenizer process, also a 400)."""
    found = _guided(body, "guided_")
    fmt = _get(body, "response_format", "dict")
    if fmt is not None:
        c = _response_format(fmt)
        if c is not None:
            found.append(c)
    so = _get(body, "structured_outputs", "dict")
    if so is not None:
        found += _guided(so, "")
    if len(found) > 1:
        raise invalid("give at most one of response_format, structured_outputs and the guided_* fields (and one "
                      "constraint in each)", "response_format")
    return found[0] if found else None


def parse_completion(body: Any, limits: Limits) -> ParsedRequest:
    ignored = _check_fields(body, COMPLETION_FIELDS)
    try:
        return _parse_completion(body, limits, ignored)
    except ApiError as e:
        e.headers.update(ignored_header(ignored))  # a refusal names what was ignored too
        raise


def _parse_completion(body: dict[str, Any], limits: Limits, ignored: tuple[str, ...]) -> ParsedRequest:
    if "prompt" not in body:
        raise invalid("missing required field 'prompt'", "prompt")
    common = _common(body, limits)
    _completion_only(body, common["n"])
    max_tokens = _max_tokens(body, "max_tokens", limits)
    if max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    text, token_ids = parse_prompt(body["prompt"], limits, max_tokens)
    logprobs = _get(body, "logprobs", "int")
    params = sampling_params(body, limits, max_tokens=max_tokens, logprobs=logprobs)
    return ParsedRequest(chat=False, params=params, prompt=text, prompt_token_ids=token_ids,
                         ignored_fields=ignored, constraint=constraint(body), **common)


def parse_chat(body: Any, limits: Limits) -> ParsedRequest:
    ignored = _check_fields(body, CHAT_FIELDS)
    try:
        return _parse_chat(body, limits, ignored)
    except ApiError as e:
        e.headers.update(ignored_header(ignored))
        raise


def _parse_chat(body: dict[str, Any], limits: Limits, ignored: tuple[str, ...]) -> ParsedRequest:
    if "messages" not in body:
        raise invalid("missing required field 'messages'", "messages")
    messages = parse_messages(body["messages"], limits)
    common = _common(body, limits)
    held_to = constraint(body)
    tools = tools_mod.parse_tools(body["tools"]) if body.get("tools") is not None else None
    choice = tools_mod.parse_tool_choice(body.get("tool_choice"), tools)
    parallel = _get(body, "parallel_tool_calls", "bool")
    if tools is not None and choice != "none":
        forced = tools_mod.call_constraint(tools, choice, parallel is not False)
        if forced is not None:
            if held_to is not None:
                raise invalid("tool_choice 'required' or a named function cannot be combined with response_format "
                              "or another constraint", "tool_choice")
            held_to = forced
    else:
        tools = None
    want = _get(body, "logprobs", "bool")
    top = _get(body, "top_logprobs", "int")
    if top is not None and not want:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
    # No max_tokens: the rest of the context, as vLLM does (None, resolved once the prompt is tokenized).
    max_tokens = _max_tokens(body, "max_completion_tokens", limits) or _max_tokens(body, "max_tokens", limits)
    params = sampling_params(body, limits, max_tokens=max_tokens, logprobs=(top or 0) if want else None)
    return ParsedRequest(chat=True, params=params, messages=messages, ignored_fields=ignored, constraint=held_to,
                         tools=tools, **common)


def parse_client(prompt: str | None, prompt_token_ids: list[int] | None,
                 messages: list[dict[str, Any]] | None, params: dict[str, Any], limits: Limits) -> ParsedRequest:
    """A :class:`~stride.ipc.messages.ClientGenerate`, validated like an HTTP body (one sequence), except that an
    unknown parameter is refused: it is most likely a misspelt keyword argument of :mod:`stride.client`, and a
    library call has no header in which to say what was ignored."""
    ignored = _check_fields(params, CLIENT_FIELDS, strict=True)
    if sum(x is not None for x in (prompt, prompt_token_ids, messages)) != 1:
        raise invalid("exactly one of prompt, prompt_token_ids and messages must be set", "prompt")
    service_class = _service_class(params, limits.sched)
    max_tokens = _max_tokens(params, "max_tokens", limits)
    if max_tokens is None and messages is None:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS  # as the two endpoints: a chat gets the rest of the context
    sp = sampling_params(params, limits, max_tokens=max_tokens, logprobs=_get(params, "logprobs", "int"))
    held_to = constraint(params)
    if messages is not None:
        return ParsedRequest(chat=True, params=sp, messages=parse_messages(messages, limits),
                             service_class=service_class, ignored_fields=ignored, constraint=held_to)
    text, ids = parse_prompt(prompt if prompt is not None else prompt_token_ids, limits, sp.max_tokens)
    return ParsedRequest(chat=False, params=sp, prompt=text, prompt_token_ids=ids,
                         service_class=service_class, ignored_fields=ignored, constraint=held_to)


__all__ = ["ApiError", "Limits", "ParsedRequest", "parse_chat", "parse_client", "parse_completion"]
