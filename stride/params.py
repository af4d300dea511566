"""Per-request sampling parameters: validated once at the edge, then trusted by every process."""

from __future__ import annotations

from dataclasses import dataclass

SEED_MODULUS = 1 << 64
"""Seeds are 64-bit: the API takes any integer in [-2**63, 2**64) and keeps it modulo 2**64."""
MAX_STOP_TOKEN_IDS = 256
MAX_STOP_CHARS = 1024
"""Longest stop string; the stop matcher holds back that many characters of every stream that has one."""
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""The one error code for a prompt (with ``max_tokens``) that does not fit the context, wherever it is found."""


def context_overflow(num_prompt_tokens: int | None, max_tokens: int | None, max_model_len: int) -> str | None:
    """Why a request cannot fit a context of ``max_model_len`` tokens, or None when it fits. The prompt length is
    None where it is not known yet (a text prompt before tokenizing): then ``max_tokens`` alone is checked against
    the context less the one token a prompt has at least. ``max_tokens`` None means the rest of the context."""
    if num_prompt_tokens is None:
        if max_tokens is not None and max_tokens >= max_model_len:
            return (f"max_tokens is {max_tokens}; this model's context is {max_model_len} tokens, prompt included, "
                    f"so max_tokens must be below {max_model_len}")
        return None
    if max_tokens is None:
        if num_prompt_tokens >= max_model_len:
            return (f"the prompt has {num_prompt_tokens} tokens; this model's context is {max_model_len} tokens, "
                    "including at least one output token")
        return None
    if num_prompt_tokens + max_tokens > max_model_len:
        return (f"the prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: "
                f"{num_prompt_tokens + max_tokens} tokens do not fit this model's context of {max_model_len}")
    return None


MAX_LOGIT_BIAS = 1024
"""Most entries of one request's ``logit_bias``."""


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """What a sequence's output must match (structured outputs): ``kind`` one of :data:`CONSTRAINT_KINDS` and its
    ``spec``: a JSON schema as JSON text (``json_schema``), nothing (``json_object``: any JSON object), a regular
    expression, a JSON array of strings (``choice``: exactly one of them) or a Lark / GBNF grammar. Compiled by the
    tokenizer process (:mod:`stride.grammar.compile`), enforced by the scheduler's token masks."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {list(CONSTRAINT_KINDS)}, got {self.kind!r}")


@dataclass(frozen=True)
class LogitBias:
    """``bias`` added to ``token_id``'s logit before sampling (OpenAI's ``logit_bias``: -100 bans, 100 all but
    forces)."""

    token_id: int
    bias: float


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is sampled and when it stops. ``ValueError`` names the offending field."""

    max_tokens: int | None = 16
    """Most tokens to generate; None: the rest of the context (resolved where the prompt's length is known)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set of tokens whose probability reaches ``top_p``."""
    top_k: int = 0
    """Keep the ``top_k`` most likely tokens; 0 keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times the most likely one's."""
    seed: int | None = None
    """Per-request seed in [0, 2**64): the same seed and inputs give the same tokens."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token generated at least once (OpenAI semantics)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated (OpenAI semantics)."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens in the prompt or output (CTRL style)."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends where one appears; it is not emitted."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (besides the model's end-of-sequence token)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    logprobs: int | None = None
    """Return the sampled token's log-probability and this many top alternatives (0..20)."""
    logit_bias: tuple[LogitBias, ...] = ()
    """Added to the raw logits before penalties, temperature and the greedy choice (logprobs stay raw)."""

    def __post_init__(self) -> None:
        checks = [
            ("max_tokens", self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
             "an integer >= 1"),
            ("seed", self.seed is None or (_is_int(self.seed) and 0 <= self.seed < SEED_MODULUS),
             "an integer in [0, 2**64)"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", _is_int(self.top_k) and 0 <= self.top_k < (1 << 31), "an integer in [0, 2**31)"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "in (0, 10]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "in [0, 20]"),
            ("stop", len(self.stop) <= 16 and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS
                                                  for s in self.stop),
             f"at most 16 non-empty strings of at most {MAX_STOP_CHARS} characters"),
            ("stop_token_ids", len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
             and all(_is_int(t) and 0 <= t < (1 << 31) for t in self.stop_token_ids),
             f"at most {MAX_STOP_TOKEN_IDS} token ids"),
            ("logit_bias", len(self.logit_bias) <= MAX_LOGIT_BIAS
             and len({b.token_id for b in self.logit_bias}) == len(self.logit_bias)
             and all(_is_int(b.token_id) and 0 <= b.token_id < (1 << 31) and -100.0 <= b.bias <= 100.0
                     for b in self.logit_bias),
             f"at most {MAX_LOGIT_BIAS} distinct token ids, each biased by a number in [-100, 100]"),
        ]
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"{name} must be {what}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
