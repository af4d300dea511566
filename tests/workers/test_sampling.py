"""The sampler: exact filters, exact penalties, raw logprobs, seeds, and the sampled distribution itself."""

from __future__ import annotations

import math

import pytest
import torch

from stride.params import SamplingParams
from stride.workers.sampling import Sampler

VOCAB = 10
# Distinct, well-spread logits over a small vocabulary so every filter cuts somewhere visible.
LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0, -2.0])
NUM_DRAWS = 40_000


def chi_square_p(counts: list[int], probs: list[float]) -> float:
    """Pearson's chi-square goodness of fit; p-value from the regularised upper incomplete gamma."""
    total = sum(counts)
    cells = [(c, p * total) for c, p in zip(counts, probs, strict=True) if p > 0]
    stat = sum((c - e) ** 2 / e for c, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def reference_probs(logits: list[float], temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> list[float]:
    """The documented filter order, written independently: top-k, top-p of the renormalised rest, min-p."""
    z = [v / temperature for v in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = order[:top_k] if top_k else order
    weights = {i: math.exp(z[i]) for i in keep}
    total = sum(weights.values())
    if top_p < 1.0:
        kept, mass = [], 0.0
        for i in keep:
            if mass >= top_p:
                break
            kept.append(i)
            mass += weights[i] / total
        keep = kept
    p_max = max(weights[i] for i in keep)
    keep = [i for i in keep if weights[i] >= min_p * p_max]
    total = sum(weights[i] for i in keep)
    return [weights[i] / total if i in keep else 0.0 for i in range(len(z))]


def draw_counts(params: SamplingParams, logits: torch.Tensor = LOGITS, seed: int = 0) -> list[int]:
    sampler = Sampler(1, VOCAB, seed=seed)
    sampler.add_sequence(0, params, [])
    out = sampler.sample(logits.expand(NUM_DRAWS, -1), [0] * NUM_DRAWS).token_ids
    return torch.bincount(out, minlength=VOCAB).tolist()


FILTERS = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(top_k=4),
    dict(top_p=0.6),
    dict(min_p=0.2),
    dict(top_k=6, top_p=0.8, min_p=0.3, temperature=1.3),
]


@pytest.mark.parametrize("kwargs", FILTERS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_filters_match_exact_distribution(kwargs):
    counts = draw_counts(SamplingParams(**kwargs))
    expected = reference_probs(LOGITS.tolist(), **kwargs)
    outside = [i for i, (c, p) in enumerate(zip(counts, expected, strict=True)) if c and p == 0.0]
    assert outside == [], f"emitted tokens outside the kept set: {outside}"
    assert chi_square_p(counts, expected) > 1e-3
    # Negative control: the same draws are rejected against the unfiltered / wrongly tempered softmax.
    wrong = reference_probs(LOGITS.tolist(), temperature=kwargs.get("temperature", 1.0) * 1.5)
    assert chi_square_p(counts, wrong) < 1e-6


def test_filter_reference_is_not_trivial():
    # The cases above must actually cut: otherwise "never outside the set" would hold vacuously.
    assert sum(p == 0 for p in reference_probs(LOGITS.tolist(), top_k=4)) == 6
    assert sum(p == 0 for p in reference_probs(LOGITS.tolist(), top_p=0.6)) > 0
    assert sum(p == 0 for p in reference_probs(LOGITS.tolist(), min_p=0.2)) > 0


def test_filters_on_full_vocabulary_batch():
    vocab, rows = 49152, 8
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    sampler = Sampler(rows, vocab, seed=3)
    settings = [dict(top_k=5), dict(top_p=0.7), dict(min_p=0.02), dict(top_k=50, top_p=0.9)]
    allowed = []
    for row in range(rows):
        sampler.add_sequence(row, SamplingParams(**settings[row % len(settings)]), [])
        probs = reference_probs(logits[row].tolist(), **settings[row % len(settings)])
        allowed.append({i for i, p in enumerate(probs) if p > 0})
    assert all(1 < len(kept) < 1000 for kept in allowed)
    seen = [set() for _ in range(rows)]
    for _ in range(12):
        out = sampler.sample(logits, list(range(rows))).token_ids.tolist()
        for row, token in enumerate(out):
            assert token in allowed[row], (row, settings[row % len(settings)])
            seen[row].add(token)
    # Control: the draws do spread over the kept sets rather than sitting on the argmax.
    assert all(len(s) > 1 for s in seen)


def test_greedy_is_argmax_and_mixed_batch():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 300, generator=gen)
    sampler = Sampler(8, 300, seed=5)
    for slot in range(8):
        sampler.add_sequence(slot, SamplingParams(temperature=0.0 if slot % 2 == 0 else 5.0), [])
    draws = torch.stack([sampler.sample(logits, list(range(8))).token_ids for _ in range(20)])
    argmax = logits.argmax(dim=-1)
    assert torch.equal(draws[:, 0::2], argmax[0::2].expand(20, -1))
    # Control: the hot sampled rows do leave the argmax (so the check above can tell the two apart).
    assert (draws[:, 1::2] != argmax[1::2]).float().mean() > 0.5


def test_mixed_batch_sampled_rows_keep_their_distribution():
    sampler = Sampler(2, VOCAB, seed=11)
    sampler.add_sequence(0, SamplingParams(temperature=0.0), [])
    sampler.add_sequence(1, SamplingParams(top_k=5), [])
    slots = [0, 1] * (NUM_DRAWS // 2)
    out = sampler.sample(LOGITS.expand(len(slots), -1), slots).token_ids
    assert torch.all(out[0::2] == 0)
    counts = torch.bincount(out[1::2], minlength=VOCAB).tolist()
    assert chi_square_p(counts, reference_probs(LOGITS.tolist(), top_k=5)) > 1e-3


def run_seeded(seed: int | None, position: int, batch: int, default_seed: int, steps: int = 12) -> list[int]:
    gen = torch.Generator().manual_seed(7)
    sampler = Sampler(batch, 500, seed=default_seed)
    for slot in range(batch):
        sampler.add_sequence(slot, SamplingParams(seed=seed if slot == position else None), [])
    tokens = []
    for _ in range(steps):
        logits = torch.randn(batch, 500, generator=gen)
        logits[position] = torch.linspace(0, 1, 500)  # the seeded row sees the same logits every run
        tokens.append(int(sampler.sample(logits, list(range(batch))).token_ids[position]))
    return tokens


def test_same_seed_same_tokens_whatever_the_batch():
    first = run_seeded(1234, position=0, batch=1, default_seed=0)
    assert run_seeded(1234, position=3, batch=6, default_seed=99) == first
    # Controls: another seed, or no seed with another default generator, gives other tokens.
    assert run_seeded(4321, position=0, batch=1, default_seed=0) != first
    assert run_seeded(None, position=0, batch=1, default_seed=1) != run_seeded(None, 0, 1, default_seed=2)


def test_logprobs_are_raw_log_softmax():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=gen)
    sampler = Sampler(3, 50)
    sampler.add_sequence(0, SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5), [1, 2, 3])
    sampler.add_sequence(1, SamplingParams(logprobs=2, temperature=0.0, presence_penalty=1.0), [])
    sampler.add_sequence(2, SamplingParams(), [])
    sampler.record([0, 1, 1], [4, 5, 5])
    result = sampler.sample(logits, [0, 1, 2])
    reference = torch.log_softmax(logits, dim=-1)
    assert result.logprobs is not None and result.top_ids is not None and result.top_logprobs is not None
    torch.testing.assert_close(result.logprobs, reference.gather(1, result.token_ids[:, None]).squeeze(1))
    values, ids = reference.topk(5, dim=-1)
    assert torch.equal(result.top_ids, ids)
    torch.testing.assert_close(result.top_logprobs, values)
    assert sampler.num_logprobs(1) == 2 and sampler.num_logprobs(2) is None
    # Control: log-softmax of the penalised logits differs, so "raw" is a real choice being checked.
    processed = torch.log_softmax(sampler.penalized_logits(logits, [0, 1, 2]), dim=-1)
    assert not torch.allclose(processed[:2], reference[:2])


def test_no_logprobs_unless_asked():
    sampler = Sampler(1, VOCAB)
    sampler.add_sequence(0, SamplingParams(), [])
    result = sampler.sample(LOGITS[None], [0])
    assert result.logprobs is None and result.top_ids is None


def test_penalties_change_logits_exactly():
    vocab = 8
    logits = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.5, 3.0, -0.5, 0.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    prompt, output = [0, 1], [2, 2, 3, 1]
    sampler = Sampler(2, vocab)
    sampler.add_sequence(1, params, prompt)
    sampler.record([1] * len(output), output)
    got = sampler.penalized_logits(logits, [1])[0].tolist()
    expected = []
    for tok, value in enumerate(logits[0].tolist()):
        if tok in prompt or tok in output:
            value = value / 2.0 if value > 0 else value * 2.0
        count = output.count(tok)
        value -= 0.5 * (count > 0) + 0.25 * count
        expected.append(value)
    assert got == pytest.approx(expected, abs=1e-6)
    # Controls: presence/frequency must not count prompt tokens; an unpenalised slot is untouched.
    wrong = list(expected)
    wrong[0] -= 0.5
    assert got != pytest.approx(wrong, abs=1e-6)
    sampler.add_sequence(0, SamplingParams(), prompt)
    assert sampler.penalized_logits(logits, [0])[0].tolist() == logits[0].tolist()


def test_sample_records_outputs_and_slot_reuse_resets():
    logits = torch.zeros(1, 4)
    logits[0, 1] = 5.0
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    sampler = Sampler(1, 4)
    sampler.add_sequence(0, params, [])
    # Greedy picks 1 until three generations of it (penalty 2 each) push it below 0.
    tokens = [int(sampler.sample(logits, [0]).token_ids[0]) for _ in range(4)]
    assert tokens == [1, 1, 1, 0]
    sampler.remove(0)
    sampler.add_sequence(0, params, [])
    assert int(sampler.sample(logits, [0]).token_ids[0]) == 1
    # Resuming with already-generated tokens restores their counts.
    sampler.remove(0)
    sampler.add_sequence(0, params, [], output_token_ids=[1, 1, 1])
    assert int(sampler.sample(logits, [0]).token_ids[0]) == 0


def test_is_stop_marks_eos_and_stop_ids():
    sampler = Sampler(3, VOCAB, eos_token_ids=[2])
    sampler.add_sequence(0, SamplingParams(temperature=0.0), [])
    sampler.add_sequence(1, SamplingParams(temperature=0.0, ignore_eos=True), [])
    sampler.add_sequence(2, SamplingParams(temperature=0.0, stop_token_ids=(7, 8, 9)), [])
    logits = torch.zeros(3, VOCAB)
    logits[:, 2] = 1.0
    assert sampler.sample(logits, [0, 1, 2]).is_stop.tolist() == [True, False, True]
    logits = torch.zeros(3, VOCAB)
    logits[:, 8] = 1.0
    assert sampler.sample(logits, [0, 1, 2]).is_stop.tolist() == [False, False, True]


def test_misuse_is_refused():
    sampler = Sampler(2, VOCAB)
    sampler.add_sequence(0, SamplingParams(), [])
    with pytest.raises(ValueError):
        sampler.add_sequence(0, SamplingParams(), [])
    with pytest.raises(KeyError):
        sampler.sample(LOGITS.expand(2, -1), [0, 1])
    with pytest.raises(ValueError):
        sampler.sample(LOGITS.expand(3, -1), [0, 0])


def test_logit_bias_forces_bans_and_leaves_others_alone():
    """+100 makes a token all but certain, greedy or sampled; -100 bans the argmax; logprobs stay raw; a row
    without a bias in the same batch samples as it would alone; the bias goes before the penalties."""
    from stride.params import LogitBias

    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4))
    top = int(logits[1].argmax())
    sampler = Sampler(3, vocab, seed=1)
    sampler.add_sequence(0, SamplingParams(temperature=1.0, logit_bias=(LogitBias(7, 100.0),), logprobs=0), [])
    sampler.add_sequence(1, SamplingParams(temperature=0.0, logit_bias=(LogitBias(top, -100.0),)), [])
    sampler.add_sequence(2, SamplingParams(temperature=0.0), [])
    for _ in range(20):
        res = sampler.sample(logits, [0, 1, 2], record=False)
        assert res.token_ids.tolist()[0] == 7
        assert res.token_ids.tolist()[1] != top
        assert res.token_ids.tolist()[2] == int(logits[2].argmax())
    assert res.logprobs is not None
    assert float(res.logprobs[0]) == pytest.approx(float(torch.log_softmax(logits[0], -1)[7]), abs=1e-6)
    # Control: without the bias, slot 1's greedy choice is the argmax the bias banned.
    sampler.remove(1)
    sampler.add_sequence(1, SamplingParams(temperature=0.0), [])
    assert sampler.sample(logits[1:2], [1], record=False).token_ids.tolist() == [top]
    # Ids past the vocabulary are refused when the sequence joins.
    sampler.remove(2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sampler.add_sequence(2, SamplingParams(logit_bias=(LogitBias(vocab, 1.0),)), [])


def test_logit_bias_bounds():
    from stride.params import MAX_LOGIT_BIAS, LogitBias

    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=(LogitBias(1, 101.0),))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=(LogitBias(1, 1.0), LogitBias(1, 2.0)))  # one id twice
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=tuple(LogitBias(i, 1.0) for i in range(MAX_LOGIT_BIAS + 1)))
    assert SamplingParams(logit_bias=(LogitBias(3, -100.0),)).logit_bias[0].bias == -100.0
