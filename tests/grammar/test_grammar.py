"""Structured outputs without a server: constraints compile (or fail naming the problem, once per constraint), and
the matchers' bitmasks hold a random sampler to the grammar, which without them it does not keep to."""

from __future__ import annotations

import dataclasses
import json
import random

import jsonschema
import numpy as np
import pytest
import torch

from stride.grammar.compile import GrammarCompiler, GrammarError
from stride.grammar.matchers import GrammarMatchers, MatcherError, bitmask_words
from stride.model.files import default_model_path
from stride.params import Constraint
from stride.tokenizer.loader import ModelTokenizer, load_tokenizer
from stride.workers.sampling import apply_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"enum": ["small", "medium", "large"]},
        "dims": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
                  "required": ["id", "ok"], "additionalProperties": False},
    },
    "required": ["name", "size", "dims", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def matchers(tok: ModelTokenizer) -> GrammarMatchers:
    return GrammarMatchers(tok.tokenizer.to_str(), tok.tokenizer.get_vocab_size(), tok.eos_token_ids)


def allowed_ids(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def sample_under(matchers: GrammarMatchers, tok: ModelTokenizer, grammar: str, seed: int, masked: bool = True,
                 max_tokens: int = 120) -> str:
    """Draw tokens at random (uniformly among the allowed ones, or among all with ``masked=False``) until the
    grammar is complete or ``max_tokens``; the text."""
    rng = random.Random(seed)
    req = f"r{seed}-{masked}"
    matchers.add(req, grammar)
    bitmask = np.zeros((2, bitmask_words(matchers.vocab_size)), np.int32)
    out: list[int] = []
    eos = set(tok.eos_token_ids)
    try:
        for _ in range(max_tokens):
            matchers.fill([(req, 1)], bitmask)
            choices = allowed_ids(bitmask[1])
            # Bias towards short outputs: EOS whenever allowed, and the grammar's closing tokens often.
            if eos & set(choices.tolist()):
                break
            t = int(rng.choice(choices)) if masked else rng.randrange(matchers.vocab_size)
            out.append(t)
            try:
                if matchers.consume(req, t):
                    break
            except MatcherError:
                assert not masked
                break
    finally:
        matchers.drop(req)
    return tok.tokenizer.decode(out)


def test_constraints_compile_once_and_bad_ones_name_the_problem() -> None:
    c = GrammarCompiler(size=2)
    schema = Constraint("json_schema", json.dumps(SCHEMA))
    first = c.compile(schema)
    assert c.compile(Constraint("json_schema", json.dumps(SCHEMA))) == first and c.compiled == 1
    for bad, words in ((Constraint("json_schema", '{"type": "objekt"}'), "objekt"),
                       (Constraint("json_schema", "[1]"), "must be an object"),
                       (Constraint("json_schema", "{"), "not valid JSON"),
                       (Constraint("regex", "[a-"), "unclosed character class"),
                       (Constraint("choice", "[]"), "non-empty"),
                       (Constraint("grammar", "start: foo"), "unknown name"),
                       (Constraint("grammar", 'root ::= "a" | ('), "grammar")):
        with pytest.raises(GrammarError, match=words):
            c.compile(bad)
    assert c.compiled == 1  # refusals are not cached as grammars
    c.compile(Constraint("regex", "a+"))
    c.compile(Constraint("choice", '["x"]'))  # evicts the schema (size 2)
    c.compile(Constraint("json_schema", json.dumps(SCHEMA)))
    assert c.compiled == 4
    with pytest.raises(ValueError, match="constraint kind"):
        Constraint("xml")


def test_random_sampling_under_the_mask_keeps_to_the_schema(matchers: GrammarMatchers, tok: ModelTokenizer) -> None:
    grammar = GrammarCompiler().compile(Constraint("json_schema", json.dumps(SCHEMA)))
    for seed in range(10):
        text = sample_under(matchers, tok, grammar, seed, max_tokens=400)
        jsonschema.validate(json.loads(text), SCHEMA)
    built = matchers.built
    # Control: the same draws without the mask are not JSON at all.
    bad = 0
    for seed in range(5):
        try:
            json.loads(sample_under(matchers, tok, grammar, seed, masked=False, max_tokens=30))
        except json.JSONDecodeError:
            bad += 1
    assert bad == 5
    assert matchers.built == built == 1  # one grammar built, copied for every sequence


def test_regex_choice_and_grammar_complete_and_stop(matchers: GrammarMatchers, tok: ModelTokenizer) -> None:
    import re

    c = GrammarCompiler()
    for seed in range(5):
        assert re.fullmatch(r"[0-9]{4}-[0-9]{2}", sample_under(matchers, tok, c.compile(Constraint(
            "regex", "[0-9]{4}-[0-9]{2}")), seed))
        assert sample_under(matchers, tok, c.compile(Constraint("choice", '["red", "green", "blue"]')), seed) in (
            "red", "green", "blue")
        assert re.fullmatch(r"(ab)+!", sample_under(matchers, tok, c.compile(Constraint(
            "grammar", 'root ::= ("ab")+ "!"')), seed))
    # A complete choice says so on its last token, and the mask then allows only the end of the sequence.
    matchers.add("done", c.compile(Constraint("choice", '["yes"]')))
    ids = tok.tokenizer.encode("yes", add_special_tokens=False).ids
    assert [matchers.consume("done", t) for t in ids][-1] is True
    bitmask = np.zeros((1, bitmask_words(matchers.vocab_size)), np.int32)
    matchers.fill([("done", 0)], bitmask)
    assert set(allowed_ids(bitmask[0]).tolist()) <= set(tok.eos_token_ids)
    matchers.add("wrong", c.compile(Constraint("choice", '["yes"]')))
    with pytest.raises(MatcherError):
        matchers.consume("wrong", tok.tokenizer.encode("no", add_special_tokens=False).ids[0])
    for r in ("done", "wrong"):
        matchers.drop(r)
    assert len(matchers) == 0


def test_apply_bitmask_touches_only_masked_rows() -> None:
    x = torch.randn(3, 70)
    words = np.zeros((1, bitmask_words(70)), np.int32)
    words[0, 0] = 1 << 5
    words[0, 2] = 1 << 1  # token 65
    y = apply_bitmask(x, torch.tensor([1]), torch.from_numpy(words))
    assert torch.equal(y[0], x[0]) and torch.equal(y[2], x[2])  # unconstrained rows untouched
    assert torch.isfinite(y[1]).sum() == 2 and set(torch.isfinite(y[1]).nonzero().flatten().tolist()) == {5, 65}
    assert torch.equal(y[1, [5, 65]], x[1, [5, 65]])
    assert y[1].argmax() in (5, 65) and x.isfinite().all()  # the input is left as it was


def test_without_llguidance_a_constrained_request_is_refused_and_the_rest_served(monkeypatch) -> None:
    """A broken install (llguidance missing) loses structured outputs, not the tokenizer process or the scheduler's
    matchers: a constrained request gets a 400 naming the package, a plain one is tokenized. Control: with the
    package there, the same constraint compiles."""
    import sys

    from stride.config import IpcConfig, StrideConfig, WorkerConfig
    from stride.ipc import messages as m
    from stride.params import SamplingParams
    from stride.sched.process import _grammar_matchers
    from stride.tokenizer.process import TokenizerWorker

    tok = load_tokenizer(default_model_path())
    config = StrideConfig(ipc=IpcConfig(run_dir="/tmp", launch_id="nolg"))
    schema = Constraint("json_schema", json.dumps(SCHEMA))

    def request(constraint: Constraint | None) -> m.GenerateRequest:
        return m.GenerateRequest("r", "t", SamplingParams(max_tokens=4), prompt="Hello", constraint=constraint)

    served = dataclasses.replace(config, worker=WorkerConfig(model=default_model_path()),
                                 facts=dataclasses.replace(config.facts, vocab_size=49152))
    ok = TokenizerWorker(config, 0, tok).on_generate(request(schema))
    assert isinstance(ok, m.TokenizedRequest) and ok.grammar
    assert _grammar_matchers(served) is not None
    for name in [n for n in sys.modules if n == "llguidance" or n.startswith(("llguidance.", "stride.grammar."))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now raises ImportError
    worker = TokenizerWorker(config, 0, tok)
    refused = worker.on_generate(request(schema))
    assert isinstance(refused, m.RequestFailed) and refused.status == 400 and "llguidance" in refused.message
    assert isinstance(worker.on_generate(request(None)), m.TokenizedRequest)
    assert _grammar_matchers(served) is None


def test_too_old_llguidance_or_a_refused_tokenizer_turns_structured_outputs_off(monkeypatch) -> None:
    """llguidance 1.6 imports but its ``LLTokenizer`` takes one EOS id (the scheduler died on it once): a version
    under the minimum is refused by name in both processes, and a matcher build that raises still leaves the
    scheduler running with structured outputs off. Control: the installed version passes the check."""
    import importlib.metadata
    import sys

    from stride.config import IpcConfig, StrideConfig, WorkerConfig
    from stride.grammar import check_llguidance
    from stride.ipc import messages as m
    from stride.params import SamplingParams
    from stride.sched import process as sched_process
    from stride.tokenizer.process import TokenizerWorker

    check_llguidance()  # the version installed here is new enough
    tok = load_tokenizer(default_model_path())
    config = StrideConfig(ipc=IpcConfig(run_dir="/tmp", launch_id="oldlg"))
    served = dataclasses.replace(config, worker=WorkerConfig(model=default_model_path()),
                                 facts=dataclasses.replace(config.facts, vocab_size=49152))

    def broken(*args: object, **kwargs: object) -> None:
        raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")

    import stride.grammar.matchers

    monkeypatch.setattr(stride.grammar.matchers, "GrammarMatchers", broken)
    assert sched_process._grammar_matchers(served) is None
    monkeypatch.undo()

    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "1.6.1" if name == "llguidance" else real_version(name))
    for name in [n for n in sys.modules if n.startswith(("stride.grammar.",))]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r"llguidance 1\.6\.1 is installed.*>= 1\.9"):
        check_llguidance()
    refused = TokenizerWorker(config, 0, tok).on_generate(
        m.GenerateRequest("r", "t", SamplingParams(max_tokens=4), prompt="Hi",
                          constraint=Constraint("regex", "[ab]+")))
    assert isinstance(refused, m.RequestFailed) and refused.status == 400 and "1.6.1" in refused.message
    assert sched_process._grammar_matchers(served) is None
