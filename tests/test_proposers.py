"""Classic speculative decoding beside Medusa: plain decoding, a draft model, prompt lookup and
LayerSkip-style self-speculation, all verified by the shared engine.

Greedy output must equal Hugging Face ``generate`` token for token, at batch 1 and in left-padded
batches whose rows accept different lengths and stop at different times.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from medusa_infer.decoding import generate
from medusa_infer.model import MedusaModel
from medusa_infer.proposers import (
    AutoregressiveProposer,
    DraftProposer,
    LayerSkipProposer,
    LookupProposer,
    MedusaProposer,
    build_proposer,
)
from medusa_infer.proposers.base import StepContext
from medusa_infer.proposers.layerskip import default_num_layers, truncated_model
from medusa_infer.proposers.lookup import LookupGate, accepted_prefix, find_match, pad_drafts
from medusa_infer.tree_fit import CostProfile
from test_decoding import NO_EOS, left_pad, reference
from tiny import VOCAB, tiny_config, tiny_model

ARCHS = ("llama", "gpt2")
VIEW_ARCHS = ("llama", "qwen3", "gemma3_text", "gpt2")


def target_model(arch: str) -> MedusaModel:
    return MedusaModel.without_heads(tiny_model(arch, seed=0))


def random_heads(target: MedusaModel, num_heads: int = 3, seed: int = 0) -> MedusaModel:
    """Heads with random (not zero) residual blocks on the target's own base model."""
    model = MedusaModel.from_base(target.base_model, num_heads=num_heads)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


GRAFT_TREE = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]

METHODS = {
    "autoregressive": lambda target, arch: AutoregressiveProposer(target),
    "medusa+lookup": lambda target, arch: MedusaProposer(random_heads(target), GRAFT_TREE, lookup_tokens=4,
                                                         lookup_ngram=(3, 1)),
    "draft": lambda target, arch: DraftProposer(target, tiny_model(arch, seed=5), num_tokens=3),
    "self-draft": lambda target, arch: DraftProposer(target, target.base_model, num_tokens=3),
    "lookup": lambda target, arch: LookupProposer(target, num_tokens=5, max_ngram=3),
    "layerskip": lambda target, arch: LayerSkipProposer(target, num_layers=1, num_tokens=3),
}


def prompts_of(lengths, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_identical_to_generate_batch_1_and_4(arch, method):
    target = target_model(arch)
    prompts = prompts_of((2, 11, 5, 8))
    futures = [reference(target, p, 24) for p in prompts]
    eos = futures[0][5]  # row 0 stops early; the others carry on without it
    expected = [f[: f.index(eos) + 1] if eos in f else f for f in futures]
    ids, mask = left_pad(prompts)
    out = generate(target, ids, attention_mask=mask, max_new_tokens=24, eos_token_id=eos,
                   proposer=METHODS[method](target, arch))
    assert out.new_tokens == expected
    assert out.finish_reasons[0] == "eos"
    alone = generate(target, prompts[1][None], max_new_tokens=24, eos_token_id=NO_EOS,
                     proposer=METHODS[method](target, arch))
    assert alone.new_tokens[0] == futures[1]


@pytest.mark.parametrize("batch", [1, 3])
def test_an_imperfect_draft_proposes_its_own_greedy_chain_after_rejections(batch):
    """After a partial rejection the draft's cache kept the first rejected token as a valid slot, at the position
    of the token fed next: its later drafts were not its own (tau 1.2 to 1.9 against 1.4 to 2.2), the output still
    exact. Each chain is checked against a fresh run of the draft model over the row's history."""
    target = MedusaModel.without_heads(tiny_model("llama", seed=0))
    draft = tiny_model("llama", seed=5)
    proposer = DraftProposer(target, draft, num_tokens=4, schedule="constant")
    propose, checked = proposer.propose, []

    def checking(roots, context):
        # holes every row has are dropped: the cache holds no more slots than the longest history (it grew by the
        # drafted length every step)
        assert proposer.kv.num_slots <= max(len(s) for s in context.sequences)
        proposal = propose(roots, context)
        for row in range(roots.shape[0]):
            chain, history = proposal.tokens[row, 1:].tolist(), list(context.sequences[row])
            with torch.no_grad():
                for token in chain:
                    assert token == int(draft(torch.tensor([history])).logits[0, -1].argmax()), "not its own chain"
                    history.append(token)
            checked.append(len(chain))
        return proposal

    proposer.propose = checking
    prompts = prompts_of((8, 5, 11)[:batch], seed=1)
    ids, mask = left_pad(prompts)
    out = generate(target, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=NO_EOS, proposer=proposer)
    assert out.new_tokens == [reference(target, p, 30) for p in prompts]
    assert len(checked) > 5 and 0 < out.metrics.tau < 5  # (drafts partly rejected: the case checked)
    assert out.metrics.acceptance_by_depth[0] < 1.0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 4])
def test_the_target_as_its_own_draft_accepts_every_token(arch, batch):
    target = target_model(arch)
    k = 3
    prompts = prompts_of((4, 9, 6, 2)[:batch], seed=1)
    max_new = 4 * (k + 1) + 1  # the prefill token, then whole steps
    ids, mask = left_pad(prompts)
    for proposer in (DraftProposer(target, target.base_model, num_tokens=k, schedule="constant"),
                     LayerSkipProposer(target, num_layers=2, num_tokens=k, schedule="constant")):
        out = generate(target, ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=NO_EOS,
                       proposer=proposer)
        assert out.new_tokens == [reference(target, p, max_new) for p in prompts]
        assert out.metrics.tau == pytest.approx(k + 1)
        assert out.metrics.acceptance_by_depth == [1.0] * k


def test_lookup_accepts_drafts_on_a_repetitive_prompt():
    target = target_model("llama")
    prompt = torch.tensor([5, 6, 7, 8, 9, 10] * 4)
    out = generate(target, prompt[None], max_new_tokens=40, eos_token_id=NO_EOS,
                   proposer=LookupProposer(target, num_tokens=6))
    assert out.new_tokens[0] == reference(target, prompt, 40)
    assert out.metrics.tau > 1.5


def test_find_match_takes_the_longest_most_recent_match():
    history = [1, 2, 3, 9, 2, 3, 4, 5, 1, 2, 3]
    assert find_match(history, 3, 1, 4)[1] == [9, 2, 3, 4]  # "1 2 3" occurred once before
    assert find_match(history, 2, 1, 3)[1] == [4, 5, 1]  # "2 3": the most recent occurrence
    assert find_match([1, 2, 3, 4], 3, 1, 5)[1] == []
    # an occurrence overlapping the suffix: the repetition runs on (it stopped after one period)
    assert find_match([7, 7, 7], 2, 1, 5) == (2, [7] * 5)
    assert find_match([5, 6] * 3, 3, 1, 5) == (3, [5, 6, 5, 6, 5])
    assert find_match([1, 2, 3, 1, 2, 3, 1, 2], 2, 1, 4) == (2, [3, 1, 2, 3])
    assert find_match(history, 3, 1, 0)[1] == []


CPU_COST = CostProfile([1, 2, 4, 8, 16], [0.05, 0.085, 0.085, 0.0875, 0.1], "cpu float32", 256)
GPU_COST = CostProfile([1, 2, 4, 8, 16], [0.02, 0.0201, 0.0202, 0.0204, 0.0208], "cuda bfloat16", 256)


def test_lookup_gate_verifies_only_drafts_that_pay_for_themselves():
    gate = LookupGate(CPU_COST, probe_every=4)
    assert gate.length(1, 4) == 4  # optimistic at first: 1 + E(4) = 1.94 >= t(5)/t(1) = 1.72
    for _ in range(6):
        gate.record(1, 0, 4)  # 1-gram matches that are always wrong
        gate.record(3, 4, 4)  # 3-gram matches that are always right
    assert gate.rate(1) == pytest.approx(1 / 8) and gate.rate(3) == pytest.approx(25 / 26)
    assert gate.expected(1, 2) == pytest.approx(1 / 8 + 1 / 64)
    decisions = [gate.length(1, 4) for _ in range(8)]
    assert decisions == [0, 0, 0, 3] * 2  # refused, but probed every 4th time at its best length (t(4) = t(2))
    assert gate.length(3, 4) == 4
    gpu = LookupGate(GPU_COST)
    for _ in range(6):
        gpu.record(1, 0, 4)
    assert gpu.length(1, 4) >= 1  # where a draft costs (almost) nothing, even poor matches are verified
    assert gate.length(3, 0) == 0
    assert find_match([1, 2, 3, 9, 1, 2, 3], 3, 1, 2) == (3, [9, 1])
    assert accepted_prefix([4, 5, 6], [4, 5, 7, 8]) == 2 and accepted_prefix([4, 5], [4, 5, 6]) == 2
    assert accepted_prefix([4, 5], [4]) == 0  # only the bonus token: nothing of the draft accepted


def test_lookup_gate_chooses_the_draft_length_that_pays_best():
    cost = CostProfile([1, 2, 4, 8, 16, 32], [1.0, 1.2, 1.3, 1.5, 1.8, 2.4], "cpu-like")
    sure, unsure = LookupGate(cost), LookupGate(cost)
    for _ in range(20):
        sure.record(2, 9, 10)  # one rejection in ten tokens: p = 0.9
        unsure.record(2, 1, 4)  # half the tokens rejected: p = 0.5
    assert sure.rate(2) == pytest.approx((180 + 1) / (200 + 2))
    chosen = sure.length(2, 16)
    speed = {n: (1 + sure.expected(2, n)) / cost.ratio(1 + n) for n in range(1, 17)}
    assert chosen == max(speed, key=speed.get) and chosen >= 8  # a long run of right matches: a long draft
    assert sure.length(2, 3) == 3  # never more than the match offers
    assert 1 <= unsure.length(2, 16) <= 3  # short drafts where half the tokens are rejected


def test_lookup_gate_charges_a_draft_for_every_row_of_the_batch():
    cost = CostProfile([1, 2, 4, 8, 16, 32, 64], [1.0, 1.1, 1.2, 1.4, 2.2, 4.0, 7.8], "cpu-like")
    gate = LookupGate(cost)
    for _ in range(6):
        gate.record(2, 1, 4)  # 2-gram matches: one token accepted a draft
    assert gate.rate(2) == pytest.approx(7 / 14)
    assert gate.length(2, 4) >= 1  # one row: t(5) / t(1) = 1.25 buys 1.94 tokens a step
    assert gate.length(2, 4, batch=16) == 0  # sixteen rows: t(80) / t(16) = 4.4


def test_lookup_gate_weighs_a_draft_against_the_heads_tokens():
    gate = LookupGate(GPU_COST)
    for _ in range(3):
        gate.record(1, 0, 4)  # p = 1 / 5
    assert gate.length(1, 4) >= 1  # alone, 1.2 tokens a step for 0.5% more time
    # beside heads worth 1.5 tokens a step, credited only where the draft's first token fails
    assert gate.length(1, 4, base=3, heads=1.5) == 0
    for _ in range(40):
        gate.record(2, 4, 4)  # p near 1: the draft wins beside the heads too
    assert gate.length(2, 4, base=3, heads=1.5) == 4


def test_lookup_gate_learns_each_rows_acceptance_rule_apart_in_one_batch():
    """A greedy row and a sampled row share a batch (one forward): the sampled row's rejected drafts taught the gate
    that drafts after a 2-gram match fail, and cut the greedy row's beside it; each row's matches are now counted
    under its acceptance rule (``row_kinds``), one key per rule."""
    from medusa_infer.decoding import SamplingConfig
    from medusa_infer.proposers.lookup import gated_matches, record_matches, row_kinds

    cost = CostProfile([1, 2, 4, 8, 16, 32, 64], [1.0, 1.1, 1.2, 1.4, 2.2, 4.0, 7.8], "cpu-like")
    history = [5, 6, 7, 8, 9, 10, 11, 5, 6]  # the last 2-gram matches earlier: a draft of 7, 8, 9, 10, 11, ...
    context = StepContext([history, history], 8,
                          samplings=[SamplingConfig(), SamplingConfig("lossless", 1.0)])
    kinds = row_kinds(context)
    assert kinds == ["greedy", "lossless"] and row_kinds(StepContext([history], 8)) is None
    gate = LookupGate(cost)
    for _ in range(20):
        matches = gated_matches(context.sequences, 3, 1, 4, gate, kinds=kinds)
        assert [key for key, _ in matches] == [("prompt", 2, "greedy"), ("prompt", 2, "lossless")]
        # the greedy row commits its whole draft (and a bonus token), the sampled row's first draft token is rejected
        record_matches(gate, matches, [matches[0][1] + [1], [3]])
    greedy, sampled = (len(draft) for _, draft in gated_matches(context.sequences, 3, 1, 4, gate, kinds=kinds))
    assert greedy == 4 and sampled == 0  # one key for both rows: p near 1/2, a 1-token draft for either


def test_gated_lookup_stays_exact_and_verifies_fewer_drafts():
    target = target_model("llama")
    prompt = torch.tensor([5, 6, 7, 8, 9, 10, 5, 11, 12, 5, 13, 14, 5, 15])  # 1-gram matches that lead nowhere
    cheap = LookupProposer(target, num_tokens=4, cost=GPU_COST)  # every match is worth verifying
    dear = LookupProposer(target, num_tokens=4, cost=CPU_COST)
    runs = [generate(target, prompt[None], max_new_tokens=30, eos_token_id=NO_EOS, proposer=p) for p in (cheap, dear)]
    assert runs[0].new_tokens == runs[1].new_tokens == [reference(target, prompt, 30)]
    assert sum(dear.gate.drafts.values()) < sum(cheap.gate.drafts.values())


def test_lookup_without_a_match_proposes_the_root_alone():
    target = target_model("llama")
    prompt = torch.arange(3, 13)  # no token repeats, and the output does not repeat early
    proposer = LookupProposer(target)
    proposal = proposer.propose(torch.tensor([50]), StepContext([prompt.tolist() + [50]], 8))
    assert proposal.tree.num_nodes == 1 and proposal.tokens.tolist() == [[50]]
    proposal = LookupProposer(target, num_tokens=8).propose(torch.tensor([5]), StepContext([prompt.tolist() + [5]], 8))
    assert proposal.tokens.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 5]]  # at most 8 tokens
    proposal = proposer.propose(torch.tensor([5]), StepContext([prompt.tolist() + [5]], 3))
    assert proposal.tokens.tolist() == [[5, 6, 7, 8]]  # at most max_depth
    rows = StepContext([[1, 2, 3, 4, 5, 1], [9, 8, 7, 9, 8]], 8)  # one chain for the batch; "9 8 7" repeats on
    assert proposer.propose(torch.tensor([1, 8]), rows).tokens.tolist() == [[1, 2, 3, 4, 5], [8, 7, 9, 8, 7]]
    rows = StepContext([[1, 2, 3, 1], [4, 5, 6]], 8)  # "1 2 3" repeats on; no match: padded with the root
    assert proposer.propose(torch.tensor([1, 6]), rows).tokens.tolist() == [[1, 2, 3, 1, 2], [6, 6, 6, 6, 6]]


def test_heuristic_schedule_grows_and_shrinks_k():
    target = target_model("llama")
    prompt = prompts_of((6,))[0][None]
    perfect = DraftProposer(target, target.base_model, num_tokens=2, max_tokens=8)
    generate(target, prompt, max_new_tokens=40, eos_token_id=NO_EOS, proposer=perfect)
    assert list(perfect.k_per_step)[:4] == [2, 4, 6, 8]
    poor = DraftProposer(target, tiny_model("llama", seed=5), num_tokens=4)
    generate(target, prompt, max_new_tokens=30, eos_token_id=NO_EOS, proposer=poor)
    assert poor.k_per_step[0] == 4 and poor.k_per_step[-1] < 4 and min(poor.k_per_step) == 1
    constant = DraftProposer(target, tiny_model("llama", seed=5), num_tokens=4, schedule="constant")
    generate(target, prompt, max_new_tokens=20, eos_token_id=NO_EOS, proposer=constant)
    assert list(constant.k_per_step)[:8] == [4] * 8


class DepthSpy:
    """Wraps a proposer and records (proposed depth, allowed depth) at every step."""

    def __init__(self, inner) -> None:
        self.inner, self.depths = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, roots, context):
        proposal = self.inner.propose(roots, context)
        self.depths.append((proposal.tree.max_depth, context.max_depth))
        assert proposal.tokens.shape[1] == proposal.tree.num_nodes
        return proposal


@pytest.mark.parametrize("method", ["self-draft", "lookup", "layerskip"])
def test_proposals_respect_max_depth_near_the_end(method):
    target = target_model("llama")
    prompt = torch.tensor([5, 6, 7, 8] * 5)
    for max_new in (2, 5, 9):
        inner = METHODS[method](target, "llama")
        if hasattr(inner, "k"):
            inner.k = inner.max_tokens = 8
        spy = DepthSpy(inner)
        out = generate(target, prompt[None], max_new_tokens=max_new, eos_token_id=NO_EOS, proposer=spy)
        assert out.new_tokens[0] == reference(target, prompt, max_new)
        assert all(depth <= allowed for depth, allowed in spy.depths), spy.depths
    if method == "self-draft":
        assert spy.depths[0] == (7, 7)  # as deep as allowed: 9 tokens = the prefill's + 8 in one step


def test_drafts_stop_cleanly_at_the_context_limit():
    target = target_model("llama")
    limit = target.base_model.config.max_position_embeddings
    prompt = prompts_of((limit - 12,))[0]
    out = generate(target, prompt[None], max_new_tokens=50, eos_token_id=NO_EOS,
                   proposer=DraftProposer(target, target.base_model, num_tokens=5))
    assert out.finish_reasons == ["context"]
    assert out.new_tokens[0] == reference(target, prompt, 12)


def test_rows_can_join_a_draft_batch_between_steps():
    from medusa_infer.decoding import DecodeBatch, SamplingConfig, StopConfig

    target = target_model("llama")
    draft = tiny_model("llama", seed=0)  # same weights as the target, another object
    prompts = prompts_of((4, 9, 6), seed=2)
    futures = [reference(target, p, 20) for p in prompts]

    def batch(rows):
        ids, mask = left_pad([prompts[r] for r in rows])
        proposer = LayerSkipProposer(target, num_layers=1, num_tokens=3)
        return DecodeBatch(target, ids, mask, proposer, SamplingConfig(), StopConfig(20), None, None)

    with torch.no_grad():
        running = batch([0])
        running.prefill()
        running.step()
        late = batch([1, 2])
        late.prefill()
        assert running.merge(late) == [1, 2]
        while not running.done:
            running.step()
    assert list(running.generated.values()) == futures
    with pytest.raises(ValueError, match="different draft models"):
        DraftProposer(target, draft).merge(LayerSkipProposer(target, num_layers=1))


@pytest.mark.parametrize("order", ["long joins", "short joins"])
def test_a_prompt_past_the_draft_context_joins_a_draft_batch(order):
    """A prompt longer than the draft model's context skips the draft's prefill (its cache holds no
    layer); joining a running draft batch, or being joined, decodes every row exactly (the merge
    raised, and left the running batch broken)."""
    from medusa_infer.decoding import DecodeBatch, SamplingConfig, StopConfig

    target = target_model("llama")
    config = tiny_config("llama")
    config.max_position_embeddings, config.initializer_range = 16, 0.2
    torch.manual_seed(0)
    draft = MedusaModel(AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval(), None, None)
    short, long = prompts_of((5, 20), seed=4)
    first, second = (short, long) if order == "long joins" else (long, short)

    def batch(prompt):
        ids, mask = left_pad([prompt])
        return DecodeBatch(target, ids, mask, DraftProposer(target, draft, num_tokens=3), SamplingConfig(),
                           StopConfig(10), None, None)

    with torch.no_grad():
        running = batch(first)
        running.prefill()
        running.step()
        late = batch(second)
        late.prefill()
        assert running.merge(late) == [1]
        while not running.done:
            running.step()
    assert list(running.generated.values()) == [reference(target, first, 10), reference(target, second, 10)]


def test_a_refused_merge_leaves_the_running_batch_as_it_was():
    """Another draft model's batch cannot join: refused before the running batch changes, which goes
    on decoding exactly (its rows and target cache grew before the refusal)."""
    from medusa_infer.decoding import DecodeBatch, SamplingConfig, StopConfig

    target = target_model("llama")
    prompts = prompts_of((4, 7), seed=5)

    def batch(prompt, draft):
        ids, mask = left_pad([prompt])
        return DecodeBatch(target, ids, mask, DraftProposer(target, draft, num_tokens=3), SamplingConfig(),
                           StopConfig(12), None, None)

    with torch.no_grad():
        running = batch(prompts[0], tiny_model("llama", seed=0))
        running.prefill()
        running.step()
        late = batch(prompts[1], tiny_model("llama", seed=1))
        late.prefill()
        with pytest.raises(ValueError, match="different draft models"):
            running.merge(late)
        while not running.done:
            running.step()
    assert list(running.generated.values()) == [reference(target, prompts[0], 12)]


def test_a_draft_model_named_is_loaded_like_its_target(tmp_path):
    """A draft given by name is loaded in the target's dtype and on its device (it was float32 on the
    CPU whatever the target's: a bfloat16 GPU target drafted on the CPU)."""
    from medusa_infer.proposers.draft import as_draft_model
    from medusa_infer.serving.testing import word_tokenizer as chat_tokenizer

    tiny_model("llama", seed=0).save_pretrained(tmp_path / "draft")
    chat_tokenizer().save_pretrained(tmp_path / "draft")
    target = MedusaModel.without_heads(tiny_model("llama", seed=0).to(torch.bfloat16))
    proposer = DraftProposer(target, str(tmp_path / "draft"))
    assert (proposer.draft.dtype, proposer.draft.device) == (torch.bfloat16, target.device)
    assert as_draft_model(str(tmp_path / "draft")).dtype == torch.float32  # no target: as loaded


# -- the draft must share the target's vocabulary --------------------------------------------------

def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(words)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token=words[0])))


def test_a_draft_with_another_vocabulary_is_refused():
    target = target_model("llama")
    small = tiny_model("llama", seed=5, vocab_size=64)
    with pytest.raises(ValueError, match=r"predicts 64 tokens but target .* predicts 96, and without both "
                                         r"tokenizers .* give the draft's tokenizer"):
        DraftProposer(target, small)
    words = [f"w{i}" for i in range(80)]
    with pytest.raises(ValueError, match=r"predicts 64 tokens, fewer than the 80 of their tokenizer that target "):
        DraftProposer(MedusaModel(target.base_model, None, word_tokenizer(words)),
                      MedusaModel(small, None, word_tokenizer(words)))
    # a tokenizer of more entries than the target's rows (a pad token added without resizing): a draft of more
    # rows than the target's covers every token the target predicts (it was refused, naming its 128 rows "fewer")
    words = [f"w{i}" for i in range(VOCAB + 4)]
    DraftProposer(MedusaModel(target.base_model, None, word_tokenizer(words)),
                  MedusaModel(tiny_model("llama", seed=5, vocab_size=VOCAB + 32), None, word_tokenizer(words)))
    words = [f"w{i}" for i in range(VOCAB)]
    ours = MedusaModel(tiny_model("llama", seed=0), None, word_tokenizer(words))
    theirs = MedusaModel(tiny_model("llama", seed=5), None, word_tokenizer(words[::-1]))
    with pytest.raises(ValueError, match="different tokenizer from target"):
        DraftProposer(ours, theirs)
    DraftProposer(ours, MedusaModel(tiny_model("llama", seed=5), None, word_tokenizer(words)))  # same: fine


def test_a_draft_tokenizer_is_compared_once_until_it_grows(monkeypatch):
    """A proposer is built for every server batch and chat turn: each compared both vocabularies again (0.1 s
    with SmolLM2's, 0.8 s with Gemma-3's), though the tokenizers had not changed."""
    words = [f"w{i}" for i in range(VOCAB)]
    target = MedusaModel(tiny_model("llama", seed=0), None, word_tokenizer(words))
    draft = MedusaModel(tiny_model("llama", seed=5), None, word_tokenizer(words))
    reads = []
    for tokenizer in (target.tokenizer, draft.tokenizer):
        monkeypatch.setattr(tokenizer, "get_vocab", lambda t=tokenizer: reads.append(t) or type(t).get_vocab(t))
    for _ in range(3):
        DraftProposer(target, draft)
    assert len(reads) == 2
    draft.tokenizer.add_tokens(["extra"])  # (a tokenizer grown since: compared again, and refused)
    with pytest.raises(ValueError, match="different tokenizer from target"):
        DraftProposer(target, draft)
    assert len(reads) == 4


def test_max_tokens_below_the_first_draft_length_is_refused():
    """It was raised to num_tokens without a word (max_tokens=3, num_tokens=6 drafted 6)."""
    target = target_model("llama")
    with pytest.raises(ValueError, match=r"max_tokens=3 is less than num_tokens=6"):
        DraftProposer(target, target.base_model, num_tokens=6, max_tokens=3)
    assert DraftProposer(target, target.base_model, num_tokens=20).max_tokens == 20
    assert DraftProposer(target, target.base_model, num_tokens=2).max_tokens == 16


def test_a_draft_model_object_without_a_tokenizer_is_said_to_go_unchecked(caplog):
    """A draft of another tokenizer of the same size given as a model object went unchecked without a word
    (by name it is refused): exact, but every draft useless."""
    words = [f"w{i}" for i in range(VOCAB)]
    target = MedusaModel(tiny_model("llama", seed=0), None, word_tokenizer(words))
    bare = tiny_model("llama", seed=5)
    with caplog.at_level("WARNING", logger="medusa_infer.proposers.draft"):
        DraftProposer(target, bare)
        DraftProposer(target, bare)
    assert caplog.text.count("came without a tokenizer") == 1  # once per draft model
    caplog.clear()
    with caplog.at_level("WARNING", logger="medusa_infer.proposers.draft"):
        DraftProposer(target, bare, draft_tokenizer=word_tokenizer(words))
        DraftProposer(target, target)  # self-drafting: the target's own tokenizer
        DraftProposer(target, target.base_model)  # the target's own model too (it warned)
    assert "came without a tokenizer" not in caplog.text
    # the other way round: a target without a tokenizer (without_heads of a model object) said nothing
    caplog.clear()
    untold = MedusaModel(tiny_model("llama", seed=1), None, None)
    with caplog.at_level("WARNING", logger="medusa_infer.proposers.draft"):
        DraftProposer(untold, MedusaModel(bare, None, word_tokenizer(words)))
    assert "has no tokenizer: draft model" in caplog.text


@pytest.mark.parametrize("target_rows, draft_rows", [(VOCAB, VOCAB + 16), (VOCAB + 16, VOCAB)])
def test_a_draft_of_the_same_tokenizer_with_a_padded_lm_head_drafts_exactly(target_rows, draft_rows):
    """Qwen2.5-0.5B (151936 rows) drafting for Qwen2.5-7B (152064): one tokenizer, LM heads padded to other
    sizes. It was refused as another tokenizer; greedy drafts stay exact, sampled ones lossless in shape."""
    words = [f"w{i}" for i in range(VOCAB)]
    target = MedusaModel(tiny_model("llama", seed=0, vocab_size=target_rows), None, word_tokenizer(words))
    draft_base = tiny_model("llama", seed=1, vocab_size=draft_rows)
    with torch.no_grad():  # the target's weights, on the tokenizer's rows too
        for name, weight in draft_base.state_dict().items():
            weight[: min(VOCAB, len(weight))] = target.base_model.state_dict()[name][: min(VOCAB, len(weight))]
    draft = MedusaModel(draft_base, None, word_tokenizer(words))
    ids = torch.tensor([[5, 9, 12, 7], [0, 0, 3, 4]])
    mask = (ids > 0).long()
    plain = generate(target, ids, attention_mask=mask, max_new_tokens=16)
    proposer = DraftProposer(target, draft, num_tokens=3)
    spec = generate(target, ids, attention_mask=mask, max_new_tokens=16, proposer=proposer)
    assert spec.new_tokens == plain.new_tokens
    assert spec.metrics.accepted_by_depth[0] > 0  # the same weights on the real rows: drafts accepted
    sampled = generate(target, ids, attention_mask=mask, max_new_tokens=8, do_sample=True, temperature=0.8, seed=1,
                       proposer=DraftProposer(target, draft, num_tokens=3))
    assert all(len(tokens) == 8 for tokens in sampled.new_tokens)
    # a draft given without its tokenizer takes the one given beside it (the refusal says to)
    bare = MedusaModel(draft_base, None, None)
    with pytest.raises(ValueError, match="give the draft's tokenizer"):
        DraftProposer(target, bare)
    DraftProposer(target, bare, draft_tokenizer=draft.tokenizer)


# -- LayerSkip: a view of the first layers, sharing the weights --------------------------------------

def three_layer_model(arch: str, window: int | None = None):
    config = tiny_config(arch)
    config.num_hidden_layers = 3
    if window is not None:
        config.sliding_window = window
    if arch == "gemma3_text":
        config.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    elif getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"] * 3
    config.initializer_range = 0.2
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


@pytest.mark.parametrize("arch", VIEW_ARCHS)
def test_truncated_view_equals_a_shallower_model_and_copies_nothing(arch):
    model = three_layer_model(arch)
    ids = prompts_of((12,))[0][None]
    with torch.no_grad():
        full_before = model(ids).logits
        view = truncated_model(model, 2)
        shallow_config = tiny_config(arch)
        shallow_config.num_hidden_layers = 2
        if getattr(model.config, "layer_types", None) is not None:
            shallow_config.layer_types = model.config.layer_types[:2]
        shallow = AutoModelForCausalLM.from_config(shallow_config, attn_implementation="eager").eval()
        wanted = shallow.state_dict()  # every tensor of the shallow model, from the deep one
        shallow.load_state_dict({k: v for k, v in model.state_dict().items() if k in wanted})
        assert torch.allclose(view(ids).logits, shallow(ids).logits, atol=1e-5)
        assert torch.equal(model(ids).logits, full_before)  # the target is untouched
    ours = {p.data_ptr() for p in model.parameters()}
    assert {p.data_ptr() for p in view.parameters()} <= ours
    assert sum(p.numel() for p in view.parameters()) < sum(p.numel() for p in model.parameters())
    assert model.config.num_hidden_layers == 3
    if getattr(model.config, "layer_types", None) is not None:  # the view's config describes the view
        assert view.config.layer_types == model.config.layer_types[:2] and len(model.config.layer_types) == 3


@pytest.mark.parametrize("arch", ("qwen3", "gemma3_text"))
def test_layerskip_greedy_exact_on_more_architectures(arch):
    target = MedusaModel.without_heads(three_layer_model(arch))
    prompts = prompts_of((3, 10, 6))
    ids, mask = left_pad(prompts)
    proposer = LayerSkipProposer(target, num_tokens=3)
    assert proposer.num_layers == 1
    out = generate(target, ids, attention_mask=mask, max_new_tokens=20, eos_token_id=NO_EOS, proposer=proposer)
    assert out.new_tokens == [reference(target, p, 20) for p in prompts]


def test_layerskip_runs_the_text_layers_of_a_multimodal_gemma3():
    """Gemma-3 4B-27B load as Gemma3ForConditionalGeneration, whose config holds the text model's under
    text_config: layerskip failed with an AttributeError traceback (num_hidden_layers) where plain decoding ran,
    and a draft of such a model computed the prompts' keys and values again instead of taking the target's."""
    from transformers import Gemma3Config, SiglipVisionConfig

    text = tiny_config("gemma3_text")
    text.num_hidden_layers, text.layer_types = 3, ["sliding_attention", "full_attention", "sliding_attention"]
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=VOCAB - 6, boi_token_index=VOCAB - 5, eoi_token_index=VOCAB - 4)
    torch.manual_seed(0)
    target = MedusaModel.without_heads(AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval())
    assert not hasattr(target.base_model.config, "num_hidden_layers")  # (the case: a composite config)
    prompts = prompts_of((3, 9), seed=2)
    ids, mask = left_pad(prompts)
    plain = generate(target, ids, attention_mask=mask, max_new_tokens=10, eos_token_id=NO_EOS)
    for layers in (1, 2, 3):
        proposer = LayerSkipProposer(target, num_layers=layers, num_tokens=3)
        assert proposer.num_layers == layers and proposer.shared_layers == layers
        out = generate(target, ids, attention_mask=mask, max_new_tokens=10, eos_token_id=NO_EOS, proposer=proposer)
        assert out.new_tokens == plain.new_tokens
    assert target.base_model.config.get_text_config().num_hidden_layers == 3  # the target's config left alone
    with pytest.raises(ValueError, match="layerskip needs 1 <= layers <= 3"):
        LayerSkipProposer(target, num_layers=4)


def drafts_prefilled(target, prompts, proposer):
    """``proposer`` started on the left-padded ``prompts`` after the target's prefill, and the calls its draft's
    first layer took in ``start`` (the target's first layer is the draft's own)."""
    from medusa_infer.decoding import DecodeBatch, SamplingConfig, StopConfig

    ids, mask = left_pad(prompts)
    batch = DecodeBatch(target, ids, mask, proposer, SamplingConfig(), StopConfig(8), None, None)
    calls = []
    start = proposer.start
    layer = proposer.draft.base_model.base_model.get_submodule(
        "layers" if hasattr(proposer.draft.base_model.base_model, "layers") else "h")[0]

    def counted(*args):
        handle = layer.register_forward_hook(lambda *_: calls.append(1))
        try:
            start(*args)
        finally:
            handle.remove()

    proposer.start = counted
    with torch.no_grad():
        batch.prefill()
    return batch, len(calls)


@pytest.mark.parametrize("arch", VIEW_ARCHS + ("gemma3_text-window-4",))
def test_layerskip_takes_the_prompts_keys_and_values_from_the_target(arch):
    """The draft's first layers are the target's: their keys and values over the prompts are the target's, copied
    from its cache after its prefill rather than computed again (a third of the prefill's cost added to the first
    token's time, 42 ms of 21 prompt tokens on the default model to 387 ms of 500); the draft then decodes as one
    that ran its own prefill does, ragged rows and sliding windows included."""
    target = MedusaModel.without_heads(three_layer_model("gemma3_text", window=4) if arch.endswith("window-4")
                                       else three_layer_model(arch))
    prompts = prompts_of((3, 11, 7), seed=4)
    seeded, calls = drafts_prefilled(target, prompts, LayerSkipProposer(target, num_layers=2, num_tokens=3))
    assert calls == 0 and seeded.proposer.cached == [3, 11, 7]
    computing = LayerSkipProposer(target, num_layers=2, num_tokens=3)
    computing.shared_layers = 0  # as before: the draft's own prefill
    computed, calls = drafts_prefilled(target, prompts, computing)
    assert calls == 1 and computed.proposer.cached == [3, 11, 7]
    ours, theirs = seeded.proposer.kv, computed.proposer.kv
    assert len(ours.cache.layers) == len(theirs.cache.layers) == 2 and ours.layout == theirs.layout
    width = theirs.num_slots  # the target's cache is as wide as its prompts, the draft's as the longest
    assert torch.equal(ours.valid[:, -width:], theirs.valid) and not ours.valid[:, :-width].any()
    valid = theirs.valid
    assert torch.equal(ours.positions[:, -width:][valid], theirs.positions[valid])
    for mine, computed_layer in zip(ours.cache.layers, theirs.cache.layers):
        for name in ("keys", "values"):
            a, b = getattr(mine, name)[:, :, -width:], getattr(computed_layer, name)
            assert torch.allclose(a.transpose(1, 2)[valid], b.transpose(1, 2)[valid], atol=1e-5)
    with torch.no_grad():
        while not seeded.done:
            seeded.step()
    assert list(seeded.generated.values()) == [reference(target, p, 8) for p in prompts]


def test_only_a_draft_of_the_targets_own_layers_copies_them():
    from medusa_infer.proposers.draft import shared_layers

    target = MedusaModel.without_heads(three_layer_model("llama"))
    assert LayerSkipProposer(target, num_layers=2).shared_layers == 2
    assert DraftProposer(target, target.base_model).shared_layers == 3  # the target itself
    twin = MedusaModel.without_heads(three_layer_model("llama"))  # the same weights, other tensors
    assert DraftProposer(target, twin).shared_layers == 0
    view = truncated_model(twin.base_model, 2)  # another model's first layers
    assert shared_layers(target, MedusaModel(view, None, None)) == 0
    ids = prompts_of((6,))[0][None]
    out = generate(target, ids, max_new_tokens=10, eos_token_id=NO_EOS, proposer=DraftProposer(target, twin))
    assert out.new_tokens[0] == reference(target, ids[0], 10)


def test_layerskip_refuses_a_model_whose_layers_take_per_layer_inputs():
    """Gemma-3n's per-layer inputs are sized for all its layers: a view of the first ones crashed at the first
    draft step, after the first token was sent."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "gemma3n_text", vocab_size=VOCAB, hidden_size=32, intermediate_size=[64] * 4, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        num_kv_shared_layers=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, laurel_rank=4, altup_num_inputs=2,
        activation_sparsity_pattern=[0.0] * 4)
    target = MedusaModel.without_heads(AutoModelForCausalLM.from_config(config).eval())
    with pytest.raises(ValueError, match="layerskip cannot run the first layers of Gemma3nForCausalLM alone"):
        LayerSkipProposer(target, num_layers=2)


def test_layerskip_layers_are_checked():
    target = target_model("llama")
    with pytest.raises(ValueError, match=r"1 <= layers <= 2"):
        LayerSkipProposer(target, num_layers=3)
    for bad in (1.5, True, "1", 0):  # (1.5 failed in transformers' config check, "1" with a TypeError)
        with pytest.raises(ValueError, match=r"layerskip layers must be an integer >= 1 and at most 2 "
                                             r"\(LlamaForCausalLM has 2 layers\), got"):
            LayerSkipProposer(target, num_layers=bad)
    assert LayerSkipProposer(target, num_layers=torch.tensor(1)).num_layers == 1
    assert type(truncated_model(target.base_model, torch.tensor(1)).config.num_hidden_layers) is int
    assert default_num_layers(30) == 10 and default_num_layers(2) == 1


def test_layerskip_drafts_do_not_repeat_the_targets_warnings(caplog):
    """Each build wrapped a new view of the target, whose generation config is the target's: the target's
    warnings about it came again for every server batch and chat turn."""
    base = tiny_model("llama")
    base.generation_config.repetition_penalty = 1.05
    with caplog.at_level(logging.WARNING, logger="medusa_infer.model"):
        target = MedusaModel.without_heads(base)
        for _ in range(3):
            LayerSkipProposer(target, num_layers=1)
    assert caplog.text.count("does not apply") == 1


def test_grafted_lookup_adds_a_chain_beside_the_heads_tree():
    model = random_heads(target_model("llama"))
    proposer = MedusaProposer(model, GRAFT_TREE, lookup_tokens=3, lookup_ngram=(3, 1))
    proposer.start(None, torch.randn(2, model.config.hidden_size))
    context = StepContext([[1, 2, 3, 4, 5, 1], [9, 8, 7]], 8)  # row 1 has no match
    proposal = proposer.propose(torch.tensor([1, 7]), context)
    tree = proposal.tree
    chain = [(2,), (2, 2), (2, 2, 2)]  # the extra rank: top_k of the heads' tree is 2
    assert list(tree.paths) == sorted(GRAFT_TREE + chain, key=lambda p: (len(p), p))
    nodes = [1 + tree.paths.index(p) for p in chain]
    assert proposal.tokens[:, nodes].tolist() == [[2, 3, 4], [7, 7, 7]]  # padded with its root
    heads_only = MedusaProposer(model, GRAFT_TREE)
    heads_only.start(None, proposer.hidden)
    plain = heads_only.propose(torch.tensor([1, 7]), context)
    same = [1 + tree.paths.index(p) for p in plain.tree.paths]
    assert torch.equal(proposal.tokens[:, [0] + same], plain.tokens)  # the heads' candidates unchanged
    no_match = proposer.propose(torch.tensor([50, 51]), StepContext([[3, 4, 50], [5, 6, 51]], 8))
    assert no_match.tree.num_nodes == 1 + len(GRAFT_TREE)
    with pytest.raises(ValueError, match=r"lookup_tokens must be an integer >= 0 \(0 turns the lookup branch off\)"):
        MedusaProposer(model, GRAFT_TREE, lookup_tokens=-1)


def test_a_tree_runs_only_the_heads_it_reaches():
    model = random_heads(target_model("llama"), num_heads=3)
    hidden, roots = torch.randn(2, model.config.hidden_size), torch.tensor([4, 7])
    shallow = [(0,), (1,), (0, 0)]
    proposer = MedusaProposer(model, shallow)
    proposer.start(None, hidden)
    proposal = proposer.propose(roots, StepContext([[1, 2], [3, 4]], 8))
    with torch.no_grad():
        every = model.head_logits(hidden, roots).topk(2, dim=-1).indices  # [3 heads, batch, 2]
    expected = torch.stack([roots, every[0, :, 0], every[0, :, 1], every[1, :, 0]], dim=1)
    assert torch.equal(proposal.tokens, expected)
    ran = []
    for k, head in enumerate(model.heads.heads):
        head.blocks[0].register_forward_hook(lambda module, args, out, k=k: ran.append(k))
    proposer.propose(roots, StepContext([[1, 2], [3, 4]], 8))
    assert ran == [0, 1]  # the third head does not run for a tree two levels deep


def test_grafted_lookup_wins_on_a_repetitive_prompt():
    target = target_model("llama")
    model = random_heads(target)
    prompt = torch.tensor([5, 6, 7, 8, 9, 10] * 4)
    runs = {n: generate(model, prompt[None], max_new_tokens=40, eos_token_id=NO_EOS, tree=GRAFT_TREE, adaptive=False,
                        lookup_tokens=n) for n in (0, 6)}
    assert runs[6].new_tokens[0] == runs[0].new_tokens[0] == reference(target, prompt, 40)
    assert runs[6].metrics.tau > runs[0].metrics.tau


def test_build_proposer_maps_every_method():
    target = target_model("llama")
    assert isinstance(build_proposer("autoregressive", target), AutoregressiveProposer)
    lookup = build_proposer("lookup", target, SimpleNamespace(draft_tokens=3, lookup_max_ngram=2))
    assert (lookup.num_tokens, lookup.max_ngram, lookup.min_ngram) == (3, 2, 1)
    with pytest.raises(ValueError, match="1 <= min_ngram <= max_ngram"):
        build_proposer("lookup", target, SimpleNamespace(lookup_max_ngram=2, lookup_min_ngram=3))
    skip = build_proposer("layerskip", target, SimpleNamespace(layerskip_layers=None, draft_schedule="constant"))
    assert skip.num_layers == 1 and skip.schedule == "constant" and skip.k == 4
    draft = build_proposer("draft", target, SimpleNamespace(draft_model=tiny_model("llama", seed=5), draft_tokens=2))
    assert isinstance(draft, DraftProposer) and draft.k == 2
    with pytest.raises(ValueError, match="needs a draft model"):
        build_proposer("draft", target)
    with pytest.raises(ValueError, match="unknown method 'beam'"):
        build_proposer("beam", target)


# -- the default model ---------------------------------------------------------------------------

@pytest.mark.slow
def test_layerskip_and_lookup_on_smollm2_are_exact():
    from medusa_infer.decoding import encode_chat

    target = MedusaModel.without_heads("smollm2-135m-instruct")
    tokenizer = target.tokenizer
    chats = [[{"role": "user", "content": "Repeat this sentence: the quick brown fox jumps over the lazy dog."}],
             [{"role": "user", "content": "What is the capital of France?"}]]
    batch = tokenizer(encode_chat(tokenizer, chats), return_tensors="pt", padding=True, padding_side="left",
                      add_special_tokens=False)
    with torch.no_grad():
        hf = target.base_model.generate(**batch, max_new_tokens=32, do_sample=False)
    taus = {}
    for method, layers in (("layerskip", None), ("layerskip", 25), ("lookup", None)):
        proposer = build_proposer(method, target, SimpleNamespace(layerskip_layers=layers))
        out = generate(target, messages=chats, max_new_tokens=32, proposer=proposer)
        assert torch.equal(out.sequences[:, : hf.shape[1]], hf), (method, layers)
        taus[method, layers] = out.metrics.tau
    assert taus["layerskip", 25] > 1.0 and taus["lookup", None] > 1.0, taus  # 10 layers: rarely right
    view = truncated_model(target.base_model, 10)
    assert len(view.model.layers) == 10 and len(target.base_model.model.layers) == 30


def test_heads_calibrated_on_another_device_say_so_once(caplog, monkeypatch):
    """A cost profile records where it was measured, and nothing compared it: heads calibrated on a GPU
    decoded on a CPU with the GPU's tree and costs, without a word."""
    import logging

    from medusa_infer import tree_fit

    monkeypatch.setattr(tree_fit, "_WARNED_ELSEWHERE", set())
    model = random_heads(target_model("llama"))
    model.config.head_accuracies = [[0.6, 0.7, 0.75, 0.8]] * 3
    model.config.tree = [[0], [1], [0, 0]]
    prompt = torch.arange(3, 9)[None]
    model.config.cost_profile = CPU_COST.to_dict()  # this machine's: nothing to say
    with caplog.at_level(logging.WARNING, logger="medusa_infer.tree_fit"):
        generate(model, prompt, max_new_tokens=4, eos_token_id=NO_EOS)
        assert "measured on" not in caplog.text
        model.config.cost_profile = {**CPU_COST.to_dict(), "device": "NVIDIA H200 bfloat16"}
        # a tree given, no fallback: the profile is not used, nothing to say
        generate(model, prompt, max_new_tokens=4, eos_token_id=NO_EOS, tree=[[0], [0, 0]], adaptive=False)
        assert "measured on" not in caplog.text
        for _ in range(2):
            generate(model, prompt, max_new_tokens=4, eos_token_id=NO_EOS)
            build_proposer("lookup", model)
    said = [r.getMessage() for r in caplog.records if "measured on" in r.getMessage()]
    assert len(said) == 1 and "measured on NVIDIA H200 bfloat16 and the model runs on cpu float32" in said[0]
    assert "medusa-bench --calibrate --calibrated-heads" in said[0]
    # each use of the profile says it where it is the only one: the fallback's controller (no stored tree),
    # and lookup's draft lengths
    model.config.tree = None
    for use in (lambda: generate(model, prompt, max_new_tokens=4, eos_token_id=NO_EOS, tree=[[0], [0, 0]]),
                lambda: build_proposer("lookup", model)):
        monkeypatch.setattr(tree_fit, "_WARNED_ELSEWHERE", set())
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="medusa_infer.tree_fit"):
            use()
        assert "measured on NVIDIA H200 bfloat16" in caplog.text


def test_counts_that_are_no_integers_are_refused_when_the_proposer_is_built():
    """`lookup_tokens=2.5` or `draft_tokens=2.5` passed every check and failed mid-decoding with a TypeError
    ("slice indices must be integers"), after tokens had been streamed; `lookup_tokens=None`, "not set" as
    elsewhere, failed comparing None with 0."""
    from medusa_infer.decoding import stream

    target = target_model("llama")
    model = random_heads(target)
    prompt = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match=r"lookup_tokens must be an integer >= 0 .*got 2.5"):
        stream(model, prompt, max_new_tokens=4, lookup_tokens=2.5, eos_token_id=NO_EOS)
    for method in ("lookup", "layerskip", "draft"):
        with pytest.raises(ValueError, match=r"num_tokens must be an integer >= 1, got 2.5"):
            build_proposer(method, target, SimpleNamespace(draft_tokens=2.5, draft_model=target))
    with pytest.raises(ValueError, match=r"max_ngram must be an integer >= 1, got '3'"):
        build_proposer("lookup", target, SimpleNamespace(lookup_max_ngram="3"))
    plain = generate(model, prompt, max_new_tokens=6, eos_token_id=NO_EOS)
    assert generate(model, prompt, max_new_tokens=6, lookup_tokens=None, eos_token_id=NO_EOS).new_tokens == \
        plain.new_tokens
    assert MedusaProposer(model, GRAFT_TREE, lookup_tokens=torch.tensor(2)).lookup_tokens == 2  # an integer tensor


def test_build_proposer_reads_settings_given_as_a_mapping():
    """Settings were read as attributes only: a dict's were all dropped (draft_tokens 9 drafted 4, a
    draft_model given was "needed")."""
    target = target_model("llama")
    with pytest.raises(ValueError, match=r"unknown proposer settings \['draft_token'\]"):  # (dropped silently)
        build_proposer("lookup", target, {"draft_token": 2})
    lookup = build_proposer("lookup", target, {"draft_tokens": 9, "lookup_max_ngram": 5})
    assert (lookup.num_tokens, lookup.max_ngram) == (9, 5)
    assert build_proposer("draft", target, {"draft_model": target, "draft_tokens": 2}).k == 2
    grafted = build_proposer("medusa", random_heads(target), {"tree": "chain-1", "lookup_tokens": 3})
    assert grafted.lookup_tokens == 3


def test_a_shorter_draft_of_a_batch_is_padded_with_its_own_last_token():
    # L05: padding with the draft's first token instead of its last
    assert pad_drafts([[4, 5], [7, 8, 9, 10], []], [1, 2, 3], 4) == [[4, 5, 5, 5], [7, 8, 9, 10], [3, 3, 3, 3]]
    # (a prompt match always fills the limit, running on into itself: only gate-cut and datastore drafts are short)


def _one_step(proposer: DraftProposer, accepted_lengths: list[int]) -> int:
    """One drafting step of a 2-row batch; each row accepts ``accepted_lengths[row]`` drafts: the new k."""
    sequences = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
    proposer.start(StepContext([s[:-1] for s in sequences], 16), torch.zeros(2, 8))
    proposal = proposer.propose(torch.tensor([9, 14]), StepContext(sequences, 16))
    drafts = proposal.tokens[:, 1:].tolist()
    accepted = [d[:n] + [3] for d, n in zip(drafts, accepted_lengths)]
    proposer.observe(accepted, torch.zeros(2, 8), StepContext(sequences, 16))
    return proposer.k


def test_the_heuristic_grows_k_only_when_most_rows_accept_the_whole_draft():
    # D02: "most rows" must be a strict majority: one of two rows accepting the whole draft shrinks k
    target = target_model("llama")
    assert _one_step(DraftProposer(target, target.base_model, num_tokens=3), [3, 3]) == 5
    assert _one_step(DraftProposer(target, target.base_model, num_tokens=3), [3, 0]) == 2
    assert _one_step(DraftProposer(target, target.base_model, num_tokens=3), [2, 1]) == 2


def test_the_heuristic_never_drafts_more_than_max_tokens():
    # D03: k + 2 unclamped (the existing test only reads k_per_step[:4] == [2, 4, 6, 8])

    target = target_model("llama")
    perfect = DraftProposer(target, target.base_model, num_tokens=2, max_tokens=8)
    generate(target, torch.tensor([[5, 9, 14, 3, 22, 7]]), max_new_tokens=60, eos_token_id=NO_EOS, proposer=perfect)
    assert list(perfect.k_per_step)[:6] == [2, 4, 6, 8, 8, 8]
    assert max(perfect.k_per_step) == 8


def test_a_poor_draft_keeps_drafting_at_least_one_token():
    # D04: max(k - 1, 1) unclamped: k reached 0 and a plain step (no draft) replaced a 1-token draft

    target = target_model("llama")
    poor = DraftProposer(target, tiny_model("llama", seed=5), num_tokens=2)
    seen, observe = [], poor.observe

    def spy(accepted, hidden, context):
        observe(accepted, hidden, context)
        seen.append(poor.k)

    poor.observe = spy
    out = generate(target, torch.tensor([[5, 9, 14, 3, 22, 7]]), max_new_tokens=30, eos_token_id=NO_EOS, proposer=poor)
    assert out.new_tokens[0] and min(seen) == 1  # k shrank to 1 and no further


def test_a_step_cut_by_max_depth_does_not_change_k():
    # D05: the heuristic must only adapt k after a step that drafted k tokens (not one cut short near the end)
    target = target_model("llama")
    proposer = DraftProposer(target, target.base_model, num_tokens=3)
    sequences = [[5, 6, 7, 8, 9]]
    proposer.start(StepContext([sequences[0][:-1]], 16), torch.zeros(1, 8))
    proposal = proposer.propose(torch.tensor([9]), StepContext(sequences, 1))  # one token allowed
    assert proposal.tree.max_depth == 1
    proposer.observe([proposal.tokens[0, 1:].tolist() + [3]], torch.zeros(1, 8), StepContext(sequences, 1))
    assert proposer.k == 3


def test_a_draft_may_fill_its_context_to_the_last_position():
    # D06: _room off by one: one token fewer drafted than the draft's context holds
    target = target_model("llama")
    proposer = DraftProposer(target, target.base_model, num_tokens=4)
    limit = proposer.context_length
    history = [5 + i % 40 for i in range(limit - 2)]  # 2 positions left: the root's and one draft's
    proposer.start(StepContext([history[:-1]], 16), torch.zeros(1, 8))
    proposal = proposer.propose(torch.tensor([history[-1]]), StepContext([history], 16))
    assert proposal.tree.max_depth == 3  # fed: the root (limit - 2), drafts 1 and 2; draft 3 is not fed


def test_gated_matches_charge_the_draft_for_every_row():
    # L14: gated_matches passed batch=1 to the gate: a batch of 16 verified drafts that only pay for one row
    from medusa_infer.proposers.lookup import LookupGate, gated_matches
    from medusa_infer.tree_fit import CostProfile

    cost = CostProfile([1, 2, 4, 8, 16, 32, 64], [1.0, 1.1, 1.2, 1.4, 2.2, 4.0, 7.8], "cpu-like")
    gate = LookupGate(cost, probe_every=1000)
    for _ in range(6):
        gate.record(("prompt", 3), 1, 4)
    history = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert gated_matches([history], 3, 1, 4, gate)[0][1] != []  # one row: t(5) / t(1) = 1.25 buys ~1.9 tokens
    assert gated_matches([history] * 16, 3, 1, 4, gate) == [(("prompt", 3), [])] * 16  # t(80) / t(16) = 4.4


def test_lookup_drafts_are_priced_over_the_context_the_step_attends_over():
    """A profile with a long context's times prices a draft there (a CPU's attention over 2000 cached tokens makes
    every token of a forward dearer against one): a draft that pays after a short history does not after a long one."""
    from medusa_infer.proposers.lookup import LookupGate, gated_matches
    from medusa_infer.tree_fit import CostProfile

    cost = CostProfile([1, 2, 4, 8], [1.0, 1.1, 1.2, 1.4], "cpu-like", 8,
                       longer=CostProfile([1, 2, 4, 8], [1.1, 1.9, 2.6, 4.0], "cpu-like", 64))
    gate = LookupGate(cost, probe_every=1000)
    for _ in range(6):
        gate.record(("prompt", 3), 1, 4)
    short = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    long = list(range(10, 110)) + short  # 109 tokens, past the longer profile's 64
    assert gate.best(("prompt", 3), 4)[1] > 1 > gate.best(("prompt", 3), 4, context=len(long))[1]
    assert gated_matches([short], 3, 1, 4, gate)[0][1] != []
    assert gated_matches([long], 3, 1, 4, gate)[0][1] == []
    # a batch is priced over its longest row's history: shorter drafts than for two short rows
    assert gated_matches([short, short], 3, 1, 4, gate) == [(("prompt", 3), [4, 5])] * 2
    assert gated_matches([short, long], 3, 1, 4, gate) == gated_matches([long, long], 3, 1, 4, gate) == [
        (("prompt", 3), [4])] * 2


def test_merged_lookup_proposers_keep_both_gates_counts():
    # L16: LookupProposer.merge dropped the joining batch's gate counts

    model = target_model("llama")
    a, b = LookupProposer(model, cost=CPU_COST), LookupProposer(model, cost=CPU_COST)
    a.gate.record(("prompt", 2), 1, 4)
    b.gate.record(("prompt", 2), 3, 4)
    a.merge(b)
    assert a.gate.drafts == {("prompt", 2): 2} and a.gate.accepted == {("prompt", 2): 4}


def test_a_draft_that_skips_one_of_the_targets_layers_shares_none():
    # D13: shared_layers with any() instead of all(): a draft of the target's layers 0 and 2 took the target's
    # keys and values of layers 0 and 1
    from torch import nn

    from medusa_infer.proposers.draft import shared_layers
    from medusa_infer.proposers.layerskip import truncated_model

    target = MedusaModel.without_heads(three_layer_model("llama"))
    view = truncated_model(target.base_model, 2)
    layers = target.base_model.model.layers
    view.model.layers = nn.ModuleList([layers[0], layers[2]])  # skips the target's layer 1
    assert shared_layers(target, MedusaModel(view, None, None)) == 0
    view.model.layers = nn.ModuleList([layers[0], layers[1]])
    assert shared_layers(target, MedusaModel(view, None, None)) == 2


def test_a_draft_vocabulary_narrower_than_the_targets_never_drafts_the_missing_ids():
    # D12: fit_vocabulary padded the missing rows with 0 instead of -inf
    from medusa_infer.proposers.draft import fit_vocabulary

    logits = torch.tensor([[-3.0, -1.0, -2.0]])
    wide = fit_vocabulary(logits, 5)
    assert torch.equal(wide[:, :3], logits) and torch.isneginf(wide[:, 3:]).all()
    assert int(wide.argmax()) == 1 and torch.equal(fit_vocabulary(wide, 2), logits[:, :2])


def test_a_draft_one_row_short_of_the_tokenizer_is_refused():
    # D15: the "fewer than the tokenizer's tokens" check off by one (the existing test's draft is 16 rows short)
    target = target_model("llama")
    words = [f"w{i}" for i in range(80)]
    ours = MedusaModel(target.base_model, None, word_tokenizer(words))
    with pytest.raises(ValueError, match=r"predicts 79 tokens, fewer than the 80 of their tokenizer"):
        DraftProposer(ours, MedusaModel(tiny_model("llama", seed=5, vocab_size=79), None, word_tokenizer(words)))
    DraftProposer(ours, MedusaModel(tiny_model("llama", seed=5, vocab_size=80), None, word_tokenizer(words)))


def test_a_tree_one_rank_past_the_heads_reduced_vocabulary_is_refused():
    # E07: the refusal off by one (the existing test's tree is 3 ranks past the 5 scored tokens)
    model = MedusaModel.from_base(tiny_model("llama"), num_heads=2, token_map=torch.arange(7, 12))
    prompt = torch.tensor([[3, 5, 7]])
    with pytest.raises(ValueError, match=r"the tree takes rank 5 of a head, but the heads score 5 tokens"):
        model.generate(prompt, max_new_tokens=4, eos_token_id=[], tree=[[0], [5]])


def test_build_proposer_keeps_falsy_settings_given():
    # I02: option() read `value or default`: draft_tokens=0 drafted 4 instead of being refused, and datastore=False
    # (the server's / CLI's "no datastore") still drafted from the model's datastore
    from types import SimpleNamespace

    from medusa_infer.datastore import Datastore
    from medusa_infer.proposers import build_proposer

    target = target_model("llama")
    with pytest.raises(ValueError, match=r"num_tokens must be an integer >= 1, got 0"):
        build_proposer("lookup", target, SimpleNamespace(draft_tokens=0))
    target.datastore = Datastore.from_sequences([[1, 2, 3, 4]])
    assert build_proposer("lookup", target, SimpleNamespace(datastore=False)).datastore is None
    assert build_proposer("lookup", target, SimpleNamespace()).datastore is target.datastore


def test_a_rows_padded_lookup_chain_is_not_counted_as_offered():
    """Rows of a batch share one chain length: a row with no match (or a shorter one) is padded, and the padding was
    counted as offered in acceptance_by_depth (a perfect chain beside a row with no match read 0.5 at every depth
    past the heads'); tau and the output were right."""
    from medusa_infer.serving.testing import word_tokenizer
    from tiny import scripted_model

    tokenizer = word_tokenizer()
    script = list(range(10, 40))
    model = scripted_model(tokenizer, script)
    matching = torch.tensor(script[:22] + script[:1])  # each draft is the script's next four tokens: all accepted
    unmatched = torch.tensor(script[14:15])  # never matches
    ids, mask = left_pad([matching, unmatched])
    plain = generate(model, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=NO_EOS)
    out = generate(model, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=NO_EOS,
                   proposer=LookupProposer(model, num_tokens=4, cost=None))
    assert out.new_tokens == plain.new_tokens and out.metrics.acceptance_by_depth == [1.0] * 4
    torch.manual_seed(0)
    heads = MedusaModel.from_base(model.base_model, num_heads=1, tokenizer=tokenizer)  # a head each row drafts with
    grafted = generate(heads, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=NO_EOS, lookup_tokens=4,
                       tree=[[0]])
    assert grafted.new_tokens == plain.new_tokens
    assert grafted.metrics.acceptance_by_depth[1:] == [1.0] * 3  # past the head's depth, the matching row's chain


def test_grafted_lookup_chain_respects_max_depth_and_its_ngram_bounds():
    # E15: the grafted chain's limit not clamped to max_depth (a chain past max_new_tokens / the context's end);
    # E11: lookup_ngram=(1, 3) (min above max) accepted, and lookup then silently never matched
    from medusa_infer.proposers import MedusaProposer

    model = random_heads(target_model("llama"))
    proposer = MedusaProposer(model, GRAFT_TREE, lookup_tokens=4, lookup_ngram=(3, 1))
    proposer.start(None, torch.randn(1, model.config.hidden_size))
    for allowed in (1, 2, 3):
        proposal = proposer.propose(torch.tensor([1]), StepContext([[1, 2, 3, 4, 5, 1]], allowed))
        assert proposal.tree.max_depth <= allowed and proposer.grafted == allowed
    with pytest.raises(ValueError, match="lookup_ngram must be"):
        MedusaProposer(model, GRAFT_TREE, lookup_tokens=4, lookup_ngram=(1, 3))


def test_layerskip_proposers_of_other_depths_are_not_merged():
    # D19: _same_model compared only the LM head: views of 1 and 2 layers of one target were "the same draft",
    # and their caches (1 and 2 layers) were joined
    from medusa_infer.proposers import LayerSkipProposer

    target = target_model("llama")
    with pytest.raises(ValueError, match="different draft models"):
        LayerSkipProposer(target, num_layers=1).merge(LayerSkipProposer(target, num_layers=2))
    LayerSkipProposer(target, num_layers=1).merge(LayerSkipProposer(target, num_layers=1))


def test_the_heads_share_of_a_grafted_step_leaves_the_bonus_token_out():
    # E02: _heads_accepted walked the step's bonus token too, counting one heads' node more where the bonus
    # token happened to equal a heads' candidate below the last accepted node
    from medusa_infer.proposers import MedusaProposer

    model = random_heads(target_model("llama"))
    proposer = MedusaProposer(model, GRAFT_TREE, lookup_tokens=3)
    proposer.start(None, torch.randn(1, model.config.hidden_size))
    proposal = proposer.propose(torch.tensor([1]), StepContext([[1, 2, 3, 4, 5, 1]], 8))
    assert proposer.grafted == 3
    paths = list(proposal.tree.paths)
    node = {p: 1 + paths.index(p) for p in paths}
    first, below = (int(proposal.tokens[0, node[p]]) for p in ((0,), (0, 0)))
    assert proposer._heads_accepted([[first, below]]) == [1]  # one heads' token accepted; `below` is the bonus
    assert proposer._heads_accepted([[first, below, 7]]) == [2]


def test_row_groups_lists_each_settings_rows_in_order_of_first_appearance():
    from medusa_infer.proposers.base import row_groups

    assert row_groups(["a", "b", "a", "c", "b"]) == [("a", [0, 2]), ("b", [1, 4]), ("c", [3])]
    assert row_groups([]) == []
