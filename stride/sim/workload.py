"""Synthetic workloads for ``stride simulate``: Poisson arrivals, length distributions, a class mix and a
shared system prompt. Deterministic for a given seed."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from stride.params import SamplingParams


@dataclass(frozen=True)
class Workload:
    rate: float = 10.0
    """Mean arrivals per second (Poisson)."""
    num_requests: int = 500
    prompt_len: int = 512
    """Mean prompt length in tokens (lognormal with ``len_sigma``)."""
    output_len: int = 128
    """Mean output length (max_tokens; the simulated backend never stops early)."""
    len_sigma: float = 0.5
    """Sigma of the lognormal lengths; 0 makes every length the mean."""
    class_mix: dict[str, float] = field(default_factory=lambda: {"interactive": 0.3, "standard": 0.5,
                                                                 "background": 0.2})
    shared_prefix_fraction: float = 0.5
    """Share of requests that start with their tenant's system prompt."""
    prefix_len: int = 256
    num_tenants: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.num_requests <= 0 or self.prompt_len <= 0 or self.output_len <= 0:
            raise ValueError("rate, num_requests, prompt_len and output_len must be positive")
        if not 0.0 <= self.shared_prefix_fraction <= 1.0:
            raise ValueError("shared_prefix_fraction must be in [0, 1]")
        if not self.class_mix or min(self.class_mix.values()) < 0 or sum(self.class_mix.values()) <= 0:
            raise ValueError(f"bad class mix {self.class_mix}")


@dataclass(frozen=True)
class Arrival:
    time: float
    req_id: str
    tenant: str
    prompt_token_ids: list[int]
    params: SamplingParams
    service_class: str


def parse_class_mix(text: str) -> dict[str, float]:
    """``interactive=0.3,standard=0.5,background=0.2`` -> a dict (weights need not sum to 1)."""
    mix = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        if not weight:
            raise ValueError(f"class mix entry {part!r} is not NAME=WEIGHT")
        mix[name.strip()] = float(weight)
    return mix


def _lengths(rng: np.random.Generator, mean: int, sigma: float, n: int) -> np.ndarray:
    if sigma == 0:
        return np.full(n, mean, dtype=np.int64)
    # lognormal with the requested mean: mu = ln(mean) - sigma^2 / 2
    raw = rng.lognormal(np.log(mean) - sigma * sigma / 2, sigma, n)
    return np.maximum(1, np.rint(raw)).astype(np.int64)


def generate(w: Workload, *, vocab_size: int, max_model_len: int,
             avoid_ids: tuple[int, ...] = ()) -> list[Arrival]:
    """The workload's arrivals in time order. Prompt tokens avoid ``avoid_ids`` (EOS)."""
    rng = np.random.default_rng(w.seed)
    times = np.cumsum(rng.exponential(1.0 / w.rate, w.num_requests))
    prompt_lens = _lengths(rng, w.prompt_len, w.len_sigma, w.num_requests)
    output_lens = _lengths(rng, w.output_len, w.len_sigma, w.num_requests)
    names = sorted(w.class_mix)
    weights = np.array([w.class_mix[c] for c in names], dtype=np.float64)
    classes = rng.choice(len(names), size=w.num_requests, p=weights / weights.sum())
    tenants = rng.integers(0, w.num_tenants, w.num_requests)
    shared = rng.random(w.num_requests) < w.shared_prefix_fraction
    low = max(avoid_ids, default=-1) + 1  # token ids above every avoided id
    prefixes = [rng.integers(low, vocab_size, w.prefix_len).tolist() for _ in range(w.num_tenants)]
    out = []
    for i in range(w.num_requests):
        max_tokens = int(min(output_lens[i], max_model_len // 2))
        n = int(min(prompt_lens[i], max_model_len - max_tokens - 1))
        body = rng.integers(low, vocab_size, n).tolist()
        if shared[i]:
            body = (prefixes[tenants[i]] + body)[:max(n, 1)]
        out.append(Arrival(float(times[i]), f"req-{i}", f"tenant-{tenants[i]}", body,
                           SamplingParams(max_tokens=max_tokens, ignore_eos=False), names[classes[i]]))
    return out
