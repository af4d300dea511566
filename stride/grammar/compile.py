"""A :class:`~stride.params.Constraint` → the llguidance grammar that enforces it, checked, and cached by spec.

Runs where requests are tokenized, so a bad schema, regex or grammar is a 400 naming the problem before the
request reaches the scheduler, and the scheduler only ever builds matchers from grammars that compiled. The
grammar is llguidance's JSON form (the text the scheduler's matchers take). ``choice`` is a Lark alternation of
string literals; ``grammar`` takes Lark (llguidance's dialect, ``start`` rule) or GBNF (llama.cpp's, ``root ::=``).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from threading import Lock

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from stride.grammar import check_llguidance
from stride.params import Constraint

check_llguidance()

CACHE_SIZE = 512
"""Compiled grammars kept per process, least recently used out first."""

_JSON_OBJECT_SCHEMA = {"type": "object"}


class GrammarError(ValueError):
    """The constraint does not compile; the message names the problem (the API's 400)."""


def _lark_literal(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a Lark string literal (same escapes)


def _grammar(c: Constraint) -> str:
    matcher = llguidance.LLMatcher
    if c.kind in ("json_schema", "json_object"):
        schema = _JSON_OBJECT_SCHEMA if c.kind == "json_object" else _json(c.spec, "the JSON schema")
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be an object (or true)")
        try:  # compact JSON (one space after ':' and ','), unless the schema's own x-guidance says otherwise
            return matcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
    if c.kind == "regex":
        return matcher.grammar_from_regex(c.spec)
    if c.kind == "choice":
        choices = _json(c.spec, "the choices")
        if not (isinstance(choices, list) and choices and all(isinstance(x, str) and x for x in choices)):
            raise GrammarError("choice must be a non-empty array of non-empty strings")
        return matcher.grammar_from_lark("start: " + " | ".join(_lark_literal(x) for x in choices))
    lark = gbnf_to_lark(c.spec) if "::=" in c.spec else c.spec
    return matcher.grammar_from_lark(lark)


def _json(text: str, what: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"{what} is not valid JSON: {e}") from None


class GrammarCompiler:
    """Constraint → checked grammar text, each distinct constraint compiled once per process. Thread-safe."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self.size = size
        self._cache: OrderedDict[Constraint, str] = OrderedDict()
        self._lock = Lock()
        self.compiled = 0
        """Constraints compiled (not found in the cache), for tests and metrics."""

    def compile(self, c: Constraint) -> str:
        """The grammar for ``c``; :class:`GrammarError` (a ``ValueError``) naming what is wrong with it."""
        with self._lock:
            hit = self._cache.get(c)
            if hit is not None:
                self._cache.move_to_end(c)
                return hit
        try:
            grammar = _grammar(c)
        except GrammarError:
            raise
        except Exception as e:  # llguidance's own refusals of malformed input
            raise GrammarError(f"invalid {c.kind}: {e}") from None
        problem = llguidance.LLMatcher.validate_grammar(grammar)
        if problem:
            raise GrammarError(f"invalid {c.kind.replace('_', ' ')}: {problem.strip()}")
        with self._lock:
            self.compiled += 1
            self._cache[c] = grammar
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)
        return grammar
