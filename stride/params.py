"""Per-request sampling parameters: validated once at the edge, then trusted by every process."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is sampled and when it stops. ``ValueError`` names the offending field."""

    max_tokens: int = 16
    """Most tokens to generate."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set of tokens whose probability reaches ``top_p``."""
    top_k: int = 0
    """Keep the ``top_k`` most likely tokens; 0 keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times the most likely one's."""
    seed: int | None = None
    """Per-request seed: the same seed and inputs give the same tokens."""
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

    def __post_init__(self) -> None:
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "in (0, 10]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "in [0, 20]"),
            ("stop", len(self.stop) <= 16 and all(isinstance(s, str) and s for s in self.stop),
             "at most 16 non-empty strings"),
        ]
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"{name} must be {what}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
