"""Tool calling at the frontend: the request's ``tools`` and ``tool_choice`` checked, the grammar that makes a
``required`` or named choice always produce a call, and the model's output turned into ``tool_calls``.

Calls are read in the two common formats: Hermes / Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks (what the tokenizer asks for when the model's own template does not render tools,
:mod:`stride.tokenizer.tool_prompt`), and Llama-3.1's bare JSON object ``{"name": ..., "parameters": {...}}``
(optionally after ``<|python_tag|>``) as the whole output. A stream holds back only text that may still become
a call, and sends each call as one ``delta.tool_calls`` entry when its block closes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from stride.frontend.errors import invalid
from stride.params import Constraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """JSON text of the arguments object (as OpenAI sends them)."""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def body(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def parse_tools(tools: Any) -> list[dict[str, Any]]:
    """``tools`` in the OpenAI shape, checked and normalised (``parameters`` defaults to an empty object schema)."""
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise invalid(f"'tools' must be a non-empty array of at most {MAX_TOOLS} tools", "tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise invalid(f"{param} must be {{\"type\": \"function\", \"function\": {{...}}}}", param)
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise invalid(f"{param}.function.name must be 1-64 letters, digits, '_', '.' or '-'",
                          f"{param}.function.name")
        if name in names:
            raise invalid(f"{param}: a second tool named {name!r}", f"{param}.function.name")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise invalid(f"{param}.function.parameters must be a JSON schema object", f"{param}.function.parameters")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise invalid(f"{param}.function.description must be a string", f"{param}.function.description")
        entry: dict[str, Any] = {"name": name, "parameters": params}
        if desc:
            entry["description"] = desc
        out.append({"type": "function", "function": entry})
    return out


def parse_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> str:
    """``none``, ``auto`` or ``required``, or the name of the one function to call."""
    if choice is None:
        return "auto" if tools else "none"
    if not tools:
        raise invalid("'tool_choice' needs 'tools'", "tool_choice")
    if choice in ("none", "auto", "required"):
        return str(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise invalid(f"tool_choice names a function not in 'tools': {name!r}", "tool_choice")
        return str(name)
    raise invalid("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                  "{\"name\": ...}}", "tool_choice")


def call_constraint(tools: list[dict[str, Any]], choice: str, parallel: bool) -> Constraint | None:
    """For ``required`` or a named function: a grammar of one (or, with parallel calls, several) Hermes blocks whose
    JSON is a call of an allowed function with arguments matching its schema. None for ``auto`` and ``none``."""
    if choice in ("auto", "none"):
        return None
    allowed = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice]
    variants = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                 "required": ["name", "arguments"], "additionalProperties": False} for f in allowed]
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    repeat = "+" if parallel and choice == "required" else ""
    lark = (f"start: call{repeat}\n"
            f"call: {json.dumps(OPEN + chr(10))} %json {json.dumps(schema)} {json.dumps(chr(10) + CLOSE)}")
    return Constraint("grammar", lark)


def _call_of(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_output(text: str) -> tuple[str | None, list[ToolCall]]:
    """The message content left and the calls found in a whole output. Blocks that do not parse stay content."""
    stripped = text.strip()
    if stripped.startswith(PYTHON_TAG):
        stripped = stripped[len(PYTHON_TAG):].strip()
    if stripped.startswith("{") and OPEN not in stripped:  # Llama-3.1: the output is the call
        try:
            call = _call_of(json.loads(stripped))
        except json.JSONDecodeError:
            call = None
        if call is not None:
            return None, [call]
    calls, content, pos = [], [], 0
    while True:
        start = text.find(OPEN, pos)
        end = text.find(CLOSE, start + len(OPEN)) if start >= 0 else -1
        if start < 0 or end < 0:
            content.append(text[pos:])
            break
        call = None
        try:
            call = _call_of(json.loads(text[start + len(OPEN):end]))
        except json.JSONDecodeError:
            pass
        content.append(text[pos:start] if call is not None else text[pos:end + len(CLOSE)])
        if call is not None:
            calls.append(call)
        pos = end + len(CLOSE)
    rest = "".join(content)
    return (rest if rest.strip() else None) if calls else rest, calls


class ToolCallStream:
    """Incremental :func:`parse_output` for one streamed choice: :meth:`feed` text, get back the content that is
    safe to send and the calls completed; :meth:`finish` at the end. Over any split of the text into pieces, the
    content and calls add up to what :func:`parse_output` gives for the whole, up to content that is only white
    space, which a stream sends and a whole answer drops (Hermes blocks; a Llama-3.1 bare
    JSON call is only recognised whole, so an output that opens with ``{`` is held until the end)."""

    def __init__(self) -> None:
        self._buf = ""
        self._bare: bool | None = None
        """Whether the output opened as a bare JSON call: decided on its first text that is not space."""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        if self._bare is None:
            head = self._buf.lstrip()
            if not head:
                return "", []
            self._bare = head.startswith("{") or head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head)
        if self._bare:
            return "", []
        out, calls = [], []
        while True:
            start = self._buf.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._buf, OPEN)
                out.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            end = self._buf.find(CLOSE, start + len(OPEN))
            if end < 0:
                out.append(self._buf[:start])
                self._buf = self._buf[start:]
                break
            out.append(self._buf[:start])
            block = self._buf[start: end + len(CLOSE)]
            _, found = parse_output(block)
            if found:
                calls += found
            else:
                out.append(block)
            self._buf = self._buf[end + len(CLOSE):]
        self.calls += calls
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        if self._bare:
            content, calls = parse_output(rest)
            self.calls += calls
            return content or "", calls
        return rest, []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag`` (it may still become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
