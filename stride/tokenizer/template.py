"""Chat templates: the model's own jinja2 template, rendered in a sandbox.

The template comes from the model's metadata (GGUF ``tokenizer.chat_template`` or ``tokenizer_config.json``)
and is untrusted text: it runs in jinja2's ``ImmutableSandboxedEnvironment``, which refuses attribute
access to internals and mutation of the arguments. The environment follows the conventions templates are
written against (HF transformers'): ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension,
``raise_exception(msg)``, ``strftime_now(fmt)``, and a ``tojson`` that keeps non-ASCII text as is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from stride.tokenizer.loader import ModelTokenizer


class TemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed to render; the message is
    safe to return to the client as a 400."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """One compiled chat template with the model's special tokens bound."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template does not compile: {e}") from e
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    @classmethod
    def for_model(cls, tokenizer: ModelTokenizer) -> ChatTemplate:
        if not tokenizer.chat_template:
            raise TemplateError("the model has no chat template")
        return cls(tokenizer.chat_template, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        """The prompt text for ``messages`` (OpenAI shape: ``{"role", "content"}``). Content given as a
        list of parts (``[{"type": "text", "text": ...}]``) is joined to a string first, since most
        templates concatenate ``message['content']``. Raises :class:`TemplateError`."""
        context = dict(extra)
        context.update(messages=[_flatten(m) for m in messages], add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token, eos_token=self.eos_token)
        if tools is not None:
            context["tools"] = list(tools)
        try:
            return self._template.render(**context)
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, IndexError, ValueError) as e:
            raise TemplateError(f"chat template failed: {e}") from e


def _flatten(message: Mapping[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
        return {**message, "content": "".join(parts)}
    return dict(message)
