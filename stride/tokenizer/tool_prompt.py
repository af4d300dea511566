"""Tools in the prompt for a chat template that does not render them itself.

A template that names ``tools`` gets them (and the history's ``tool_calls`` and ``tool`` messages) as they are.
For one that does not, such as the default model's, the conversation is rewritten into plain messages first: a
system message (the request's own, extended, or a new first one) lists the functions as JSON and asks for each
call as a Hermes-style ``<tool_call>`` block, which is what the frontend parses back
(:mod:`stride.frontend.tools`); earlier calls become that text in the assistant's message, and each tool result a
user message holding a ``<tool_response>`` block.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

TOOL_INSTRUCTIONS = (
    "You can call functions to help answer. These are the functions, as JSON:\n<tools>\n{tools}\n</tools>\n"
    "To call one, reply with a block like this, and nothing else, for each call:\n<tool_call>\n"
    '{{"name": "<the function\'s name>", "arguments": {{<its arguments as a JSON object>}}}}\n</tool_call>\n'
    "The result of a call comes back in a <tool_response> block.")


def renders_tools(template_source: str) -> bool:
    """Whether a chat template handles ``tools`` itself."""
    return "tools" in template_source


def _call_text(call: Mapping[str, Any]) -> str:
    fn = call.get("function", {})
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments", {})},
                                        ensure_ascii=False) + "\n</tool_call>"


def plain_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
                   ) -> list[dict[str, Any]]:
    """``messages`` with tools, calls and results as plain text for a template that renders only role and
    content."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"})
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            text = "\n".join([m.get("content") or "", *(_call_text(c) for c in m["tool_calls"])]).strip()
            out.append({"role": "assistant", "content": text})
        else:
            out.append({"role": m["role"], "content": m.get("content", "")})
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        note = TOOL_INSTRUCTIONS.format(tools=listing)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out
