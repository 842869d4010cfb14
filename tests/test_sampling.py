"""The sampler works on the top-k candidates only: the same distribution as the rule over the
whole vocabulary (transformers' order: temperature, top-k with ties kept, top-p, min-p)."""

import pytest
import torch

from twice.core.sampling import Sampler, SamplingParams


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    x = logits / p.temperature
    if p.top_k:
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(x, -1)
    if p.top_p < 1:
        s, order = probs.sort(descending=True)
        drop = (s.cumsum(-1) - s) >= p.top_p
        probs = probs.masked_fill(drop.scatter(0, order, drop), 0.0)
    if p.min_p:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1),
    SamplingParams(temperature=1.5, top_k=6, seed=2),
    SamplingParams(temperature=1.0, top_p=0.5, seed=3),  # no top-k: the whole vocabulary
])
def test_sampled_frequencies_follow_the_whole_vocabulary_rule(params):
    torch.manual_seed(0)
    logits = torch.randn(500) * 2
    sampler = Sampler([params], [[]], 500, "cpu")
    draws = torch.stack([sampler(logits[None])[0] for _ in range(4000)])
    freq = torch.bincount(draws, minlength=500).float() / len(draws)
    expected = reference_probs(logits, params)
    assert set(draws.tolist()) <= set(expected.nonzero().squeeze(-1).tolist())  # never outside the support
    assert (freq - expected).abs().max() < 0.03


def test_ties_at_the_kth_value_are_all_kept():
    logits = torch.zeros(100)
    logits[:5] = 1.0  # five tokens tie for the top 3 places
    sampler = Sampler([SamplingParams(temperature=1.0, top_k=3, seed=4)], [[]], 100, "cpu")
    assert {int(sampler(logits[None])[0]) for _ in range(300)} == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-38, top_k=0, top_p=1.0, min_p=0.0, seed=1),  # logits / T alone: inf, then NaN
    SamplingParams(temperature=1e-38, top_k=40, top_p=0.95, min_p=0.05, seed=1),
    SamplingParams(temperature=1e-300, top_k=0, top_p=1.0, min_p=0.0, seed=1),  # 0 in float32: 0 / 0
    SamplingParams(temperature=5e-324, top_k=40, top_p=0.95, min_p=0.05, seed=1),
    SamplingParams(temperature=0.8, top_k=0, top_p=5e-324, min_p=0.0, seed=1),  # 0 in float32
    SamplingParams(temperature=0.8, top_k=40, top_p=1e-45, min_p=0.0, seed=1),
])
def test_extreme_but_valid_settings_are_greedy_not_garbage(params):
    """The limits of sampling: a temperature near 0 and a top-p near 0 keep only the most
    likely token, whatever the logits' scale."""
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)) * 30
    sampler = Sampler([params] * 3, [[]] * 3, 1000, "cpu")
    for _ in range(5):
        assert sampler(logits).tolist() == logits.argmax(-1).tolist()
    for row in range(3):
        probs = sampler.distribution(row, logits[row])
        assert torch.isfinite(probs).all() and probs[logits[row].argmax()] == 1.0
