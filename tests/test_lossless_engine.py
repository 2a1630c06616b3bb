"""Lossless sampling through the whole engine: the output has exactly the model's distribution.

A tiny model with an 8-token vocabulary; 20,000 rows of one prompt generated in one batch; the
empirical law of the first generated tokens is compared, by a chi-square test, with the exact law
computed by enumerating every continuation with plain forwards.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chi2

from medusa_infer.acceptance import warp_logits
from medusa_infer.decoding import generate
from medusa_infer.model import MedusaModel
from tiny import tiny_model

VOCAB = 8
SAMPLES = 20_000
PROMPT = torch.tensor([[3, 1, 4, 1, 5]])


@pytest.fixture(scope="module")
def model() -> MedusaModel:
    medusa = MedusaModel.from_base(tiny_model("llama", seed=3, vocab_size=VOCAB), num_heads=4)
    torch.manual_seed(4)
    for p in medusa.heads.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return medusa


def exact_law(model: MedusaModel, length: int, temperature: float, top_k: int, top_p: float) -> dict[tuple, float]:
    """P(first ``length`` tokens) by enumeration, with the sampler's own warping."""
    law = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, p in law.items():
            ids = torch.cat([PROMPT, torch.tensor([prefix], dtype=torch.long).reshape(1, -1)], dim=1)
            with torch.no_grad():
                logits = model.base_model(ids).logits[0, -1]
            probs = warp_logits(logits[None].float(), temperature, top_k, top_p)[0]
            for token in range(VOCAB):
                if probs[token] > 0:
                    nxt[prefix + (token,)] = p * float(probs[token])
        law = nxt
    return law


def chi_square_p(samples: torch.Tensor, law: dict[tuple, float]) -> float:
    """p-value of the samples ``[n, length]`` under ``law``; cells expecting < 5 are pooled."""
    counts: dict[tuple, int] = {}
    for row in samples.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert set(counts) <= set(law), "a sample the law gives probability 0"
    n = len(samples)
    observed, expected, pooled_o, pooled_e = [], [], 0, 0.0
    for cell, p in law.items():
        if n * p >= 5:
            observed.append(counts.get(cell, 0))
            expected.append(n * p)
        else:
            pooled_o += counts.get(cell, 0)
            pooled_e += n * p
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return float(chi2.sf(stat, len(observed) - 1))


def sample(model, acceptance: str, temperature: float, top_k: int, top_p: float, length: int, seed: int):
    out = generate(
        model, PROMPT.expand(SAMPLES, -1), max_new_tokens=length + 2, do_sample=True, acceptance=acceptance,
        temperature=temperature, top_k=top_k, top_p=top_p, tree="tree-8", seed=seed, eos_token_id=[],
    )
    assert out.metrics.tau > 1.2, "the heads must get tokens accepted for the test to mean anything"
    return torch.tensor([t[:length] for t in out.new_tokens])


@pytest.mark.parametrize(
    "temperature, top_k, top_p, length",
    [(1.0, 0, 1.0, 2), (0.7, 0, 1.0, 3), (1.0, 0, 0.8, 3), (1.0, 3, 1.0, 2)],
)
def test_lossless_output_has_the_model_distribution(model, temperature, top_k, top_p, length):
    law = exact_law(model, length, temperature, top_k, top_p)
    samples = sample(model, "lossless", temperature, top_k, top_p, length, seed=17)
    assert chi_square_p(samples, law) > 0.001


def test_the_chi_square_test_rejects_a_rule_that_is_not_lossless(model):
    """Typical acceptance trades exactness for speed; the same test must catch it."""
    law = exact_law(model, 3, 1.0, 0, 1.0)
    samples = sample(model, "typical", 1.0, 0, 1.0, 3, seed=17)
    assert chi_square_p(samples, law) < 0.001


def test_every_enumerated_law_sums_to_one(model):
    for length in (1, 2):
        assert sum(exact_law(model, length, 0.7, 0, 0.8).values()) == pytest.approx(1.0, abs=1e-5)
        assert all(len(c) == length for c in itertools.islice(exact_law(model, length, 1.0, 0, 1.0), 5))
