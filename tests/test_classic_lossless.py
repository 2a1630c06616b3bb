"""Lossless sampling with classic proposers through the whole engine.

The chi-square test of ``test_lossless_engine``: a tiny 8-token target, 20,000 rows of one prompt
in one batch, the law of the first generated tokens compared with the exact law by enumeration.
A draft model (a different random 8-token model) is verified with ``min(1, p/q)`` and the residual
``norm(max(0, p - q))``; prompt lookup with the tree rule for deterministic drafts. Two broken
variants (a draft that misreports q, a rule without the residual) must fail the same test.
"""

from __future__ import annotations

import pytest
import torch

from medusa_infer import acceptance, decoding
from medusa_infer.decoding import DecodeBatch, SamplingConfig, StopConfig, generate
from medusa_infer.model import MedusaModel
from medusa_infer.proposers import DraftProposer, LookupProposer, MedusaProposer
from test_lossless_engine import PROMPT, SAMPLES, VOCAB, chi_square_p, exact_law
from tiny import tiny_model


@pytest.fixture(scope="module")
def target() -> MedusaModel:
    return MedusaModel.without_heads(tiny_model("llama", seed=3, vocab_size=VOCAB))


@pytest.fixture(scope="module")
def draft():
    return tiny_model("llama", seed=17, vocab_size=VOCAB)


def sample(target, proposer, temperature: float, top_k: int, top_p: float, length: int, seed: int = 17):
    out = generate(
        target, PROMPT.expand(SAMPLES, -1), max_new_tokens=length + 2, do_sample=True, acceptance="lossless",
        temperature=temperature, top_k=top_k, top_p=top_p, proposer=proposer, seed=seed, eos_token_id=[],
    )
    assert out.metrics.acceptance_by_depth[0] > 0.15, "drafts must get accepted for the test to mean anything"
    return torch.tensor([t[:length] for t in out.new_tokens])


@pytest.mark.parametrize(
    "temperature, top_k, top_p, length",
    [(1.0, 0, 1.0, 3), (0.7, 0, 1.0, 3), (1.0, 0, 0.8, 3), (1.0, 3, 1.0, 2)],
)
def test_draft_model_sampling_has_the_target_distribution(target, draft, temperature, top_k, top_p, length):
    proposer = DraftProposer(target, draft, num_tokens=3, schedule="constant")
    proposals = []
    propose = proposer.propose
    proposer.propose = lambda roots, context: proposals.append(propose(roots, context)) or proposals[-1]
    samples = sample(target, proposer, temperature, top_k, top_p, length)
    assert any(p.draft_probs is not None for p in proposals), "the draft must have sampled"
    assert chi_square_p(samples, exact_law(target, length, temperature, top_k, top_p)) > 0.001


def test_the_heuristic_schedule_stays_lossless(target, draft):
    proposer = DraftProposer(target, draft, num_tokens=2)
    samples = sample(target, proposer, 1.0, 0, 1.0, 3, seed=5)
    assert chi_square_p(samples, exact_law(target, 3, 1.0, 0, 1.0)) > 0.001


def test_prompt_lookup_sampling_has_the_target_distribution(target):
    proposer = LookupProposer(target, num_tokens=3, max_ngram=2)
    samples = sample(target, proposer, 1.0, 0, 1.0, 3)
    assert chi_square_p(samples, exact_law(target, 3, 1.0, 0, 1.0)) > 0.001


def test_medusa_with_grafted_lookup_sampling_has_the_target_distribution(target):
    model = MedusaModel.from_base(target.base_model, num_heads=2)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    proposer = MedusaProposer(model, [(0,), (1,), (0, 0)], lookup_tokens=3, lookup_ngram=(2, 1))
    samples = sample(target, proposer, 1.0, 0, 1.0, 3)
    assert chi_square_p(samples, exact_law(target, 3, 1.0, 0, 1.0)) > 0.001


class MisreportingDraft(DraftProposer):
    """Samples its drafts from the draft model but claims they came from the uniform law."""

    def _choose(self, logits, samplings):
        token, probs = super()._choose(logits, samplings)
        return token, torch.full_like(probs, 1.0 / probs.shape[-1])


def test_the_test_rejects_a_draft_that_misreports_q(target, draft):
    proposer = MisreportingDraft(target, draft, num_tokens=3, schedule="constant")
    samples = sample(target, proposer, 1.0, 0, 1.0, 3)
    assert chi_square_p(samples, exact_law(target, 3, 1.0, 0, 1.0)) < 0.001


def test_the_test_rejects_acceptance_without_the_residual(target, draft, monkeypatch):
    monkeypatch.setattr(acceptance, "_residual", lambda p, q: p)  # after a rejection, sample p itself
    proposer = DraftProposer(target, draft, num_tokens=3, schedule="constant")
    samples = sample(target, proposer, 1.0, 0, 1.0, 3)
    assert chi_square_p(samples, exact_law(target, 3, 1.0, 0, 1.0)) < 0.001


def run_batch(target, proposer, samplings, length: int, seed: int) -> list[list[int]]:
    """The first ``length`` tokens of each row of one batch of ``PROMPT``, row ``i`` choosing with
    ``samplings[i]``."""
    rows = len(samplings)
    batch = DecodeBatch(target, PROMPT.expand(rows, -1), torch.ones(rows, PROMPT.shape[1], dtype=torch.long),
                        proposer, samplings, StopConfig(length + 2, (), ()), None,
                        torch.Generator().manual_seed(seed))
    with torch.no_grad():
        batch.prefill()
        while not batch.done:
            batch.step()
    return [batch.generated[row][:length] for row in range(rows)]


@pytest.mark.parametrize("method", ["draft", "medusa"])
def test_rows_sampling_differently_in_one_batch_each_keep_their_law(target, draft, method):
    """A batch of three settings (a server's requests sharing a batch): each setting's rows have the exact
    law of plain sampling with that setting, and the greedy rows are greedy decoding's tokens."""
    hot, cool = SamplingConfig("lossless", 1.0, 0, 1.0), SamplingConfig("lossless", 0.7, 3, 0.9)
    greedy = SamplingConfig("greedy", 0.0)
    samplings = [hot, cool, greedy] * SAMPLES  # interleaved: the rows of a setting are not one slice
    if method == "draft":
        proposer = DraftProposer(target, draft, num_tokens=3, schedule="constant")
    else:
        model = MedusaModel.from_base(target.base_model, num_heads=2)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(1)
            for p in model.heads.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
        proposer = MedusaProposer(model, [(0,), (1,), (0, 0)])
    tokens = torch.tensor(run_batch(target, proposer, samplings, 3, seed=11))
    assert chi_square_p(tokens[0::3], exact_law(target, 3, 1.0, 0, 1.0)) > 0.001
    assert chi_square_p(tokens[1::3], exact_law(target, 3, 0.7, 3, 0.9)) > 0.001
    plain = generate(target, PROMPT, max_new_tokens=3, eos_token_id=[]).new_tokens[0]
    assert tokens[2::3].tolist() == [plain] * SAMPLES


def test_a_mixed_batch_with_a_rule_that_ignores_one_settings_rows_fails_the_law(target, draft):
    """The test above catches a batch that accepts every row with the first row's setting (a cooler setting
    with the whole vocabulary: a warped one's tokens outside its top-k fail it sooner)."""
    hot, cool = SamplingConfig("lossless", 1.0, 0, 1.0), SamplingConfig("lossless", 0.5, 0, 1.0)
    original = decoding.accept_rows

    def first_setting_only(samplings, logits, proposal, generator):
        return original([samplings[0]] * len(samplings), logits, proposal, generator)

    decoding.accept_rows = first_setting_only
    try:
        proposer = DraftProposer(target, draft, num_tokens=3, schedule="constant")
        tokens = torch.tensor(run_batch(target, proposer, [hot, cool] * (SAMPLES // 2), 3, seed=11))
    finally:
        decoding.accept_rows = original
    assert chi_square_p(tokens[1::2], exact_law(target, 3, 0.5, 0, 1.0)) < 1e-6


def test_a_seed_gives_the_same_sample_with_every_proposer_on_a_ragged_batch(target, draft):
    """Each proposer's sampled answers are the seed's (the same twice, another seed's differ), with rows of
    different lengths left-padded into one batch."""
    from medusa_infer.proposers import LayerSkipProposer

    ids = torch.tensor([[0, 0, 0, 1, 4], [5, 1, 4, 1, 5], [0, 0, 0, 0, 2]])
    mask = (torch.arange(5) >= torch.tensor([[3], [0], [4]])).long()
    makers = {"draft": lambda: DraftProposer(target, draft, num_tokens=3),
              "layerskip": lambda: LayerSkipProposer(target, 1, num_tokens=3),
              "lookup": lambda: LookupProposer(target, num_tokens=3, min_ngram=1)}
    for name, make in makers.items():
        def run(seed: int) -> list[list[int]]:
            return generate(target, ids, attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=1.0,
                            proposer=make(), seed=seed, eos_token_id=[]).new_tokens

        first = run(5)
        assert run(5) == first and run(6) != first, name
