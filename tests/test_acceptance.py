"""Tests for medusa_infer.acceptance: greedy, typical and lossless tree acceptance."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from medusa_infer import acceptance
from medusa_infer.acceptance import (
    accept_chain_lossless,
    accept_draft_lossless,
    accept_greedy,
    accept_lossless,
    accept_typical,
    greedy_tokens,
    warp_logits,
)
from medusa_infer.trees import build_tree_buffers, root_only_tree

# node:   0     1     2     3       4       5       6
# path:  root  (0,)  (1,)  (0, 0)  (0, 1)  (1, 0)  (0, 0, 0)
EXAMPLE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
VOCAB = 8


@pytest.fixture
def example():
    return build_tree_buffers(EXAMPLE, num_heads=3, top_k=2)


def _logits_with_argmax(argmax: list[list[int]], vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """Noisy logits ``[batch, n, vocab]`` whose argmax at each node is ``argmax[b][i]``."""
    noise = torch.rand(len(argmax), len(argmax[0]), vocab, generator=torch.Generator().manual_seed(seed))
    return noise + 5.0 * torch.nn.functional.one_hot(torch.tensor(argmax), vocab)


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of ``counts`` to ``probs``; cells expecting < 5 are pooled.

    Cells with zero probability must be empty (anything else is an outright failure).
    """
    counts = np.asarray(counts, dtype=float).ravel()
    probs = np.asarray(probs, dtype=float).ravel()
    impossible = probs <= 0
    assert counts[impossible].sum() == 0, "a zero-probability outcome was sampled"
    counts, probs = counts[~impossible], probs[~impossible]
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    pooled = np.append(expected[~small], expected[small].sum())
    keep = pooled > 0
    return float(stats.chisquare(observed[keep], pooled[keep]).pvalue)


# --------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------

def test_greedy_hand_built(example):
    argmax = [
        [3, 0, 6, 0, 0, 1, 0],  # node 2 (token 3) then node 5 (token 6): leaf at depth 2
        [4, 7, 0, 2, 0, 0, 0],  # nodes 1 and 2 both match; 1 -> 3 -> 6 reaches depth 3
        [5, 0, 0, 0, 0, 0, 0],  # nothing matches
        [4, 1, 3, 0, 0, 0, 0],  # nodes 4 and 5 tie at depth 2: the first leaf, (0, 1), wins
    ]
    tokens = torch.tensor([
        [0, 5, 3, 0, 0, 6, 0],
        [0, 4, 4, 7, 1, 1, 2],
        [0, 1, 2, 3, 4, 6, 7],
        [0, 4, 4, 5, 1, 3, 5],
    ])
    result = accept_greedy(_logits_with_argmax(argmax), tokens, example)
    assert result.accept_length.tolist() == [2, 3, 0, 2]
    assert result.path_nodes.tolist() == [
        [0, 2, 5, -1],
        [0, 1, 3, 6],
        [0, -1, -1, -1],
        [0, 1, 4, -1],
    ]
    assert result.next_token.tolist() == [1, 0, 5, 0]


def _reference_greedy(logits: torch.Tensor, tokens: torch.Tensor, paths) -> list[tuple[int, int]]:
    """Per row: (accept length, next token) by walking nodes one at a time."""
    node_of = {(): 0, **{path: i + 1 for i, path in enumerate(paths)}}
    results = []
    for row_logits, row_tokens in zip(logits, tokens):
        prediction = row_logits.argmax(-1).tolist()
        ok = {(): True}
        for path in paths:
            parent = path[:-1]
            ok[path] = ok[parent] and row_tokens[node_of[path]].item() == prediction[node_of[parent]]
        deepest = min((p for p in ok if ok[p]), key=lambda p: (-len(p), p))
        results.append((len(deepest), prediction[node_of[deepest]]))
    return results


def test_greedy_matches_reference_and_rows_are_independent():
    paths = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0)]
    buffers = build_tree_buffers(paths, num_heads=4, top_k=3)
    gen = torch.Generator().manual_seed(1)
    batch, vocab = 64, 5
    logits = torch.randn(batch, buffers.num_nodes, vocab, generator=gen)
    prediction = logits.argmax(-1)
    # make acceptance likely: each node carries its parent's argmax with probability 0.7
    hit = torch.rand(batch, buffers.num_nodes, generator=gen) < 0.7
    tokens = torch.where(hit, prediction[:, buffers.parents.clamp(min=0)],
                         torch.randint(vocab, (batch, buffers.num_nodes), generator=gen))
    result = accept_greedy(logits, tokens, buffers)
    assert list(zip(result.accept_length.tolist(), result.next_token.tolist())) == \
        _reference_greedy(logits, tokens, paths)
    assert result.accept_length.max() == 4  # the test reaches the deepest leaf
    for row in (0, 17, 63):
        alone = accept_greedy(logits[row:row + 1], tokens[row:row + 1], buffers)
        assert torch.equal(alone.path_nodes[0], result.path_nodes[row])
        assert alone.next_token.item() == result.next_token[row].item()


def test_greedy_tokens_is_argmax_ties_included():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (5, 7, 300), generator=gen).float()  # many ties for the maximum
    logits[2, 3] = -math.inf
    logits[4, 1] = 0.0
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    wide = torch.randn(3, 49152, generator=gen)
    assert torch.equal(greedy_tokens(wide), wide.argmax(-1))


def test_input_checks(example):
    logits = torch.zeros(1, 7, VOCAB)
    tokens = torch.zeros(1, 7, dtype=torch.long)
    with pytest.raises(ValueError, match=r"tree has 7 \(root included\)"):
        accept_greedy(logits[:, :6], tokens[:, :6], example)
    with pytest.raises(ValueError, match=r"tokens must be \[batch, nodes\] = \(1, 7\)"):
        accept_greedy(logits, tokens[:, :6], example)
    with pytest.raises(ValueError, match=r"torch.long"):
        accept_greedy(logits, tokens.int(), example)
    with pytest.raises(ValueError, match=r"logits must be \[batch, nodes, vocab\]"):
        accept_greedy(logits[0], tokens, example)
    with pytest.raises(ValueError, match=r"call buffers.to\(logits.device\)"):
        accept_greedy(logits, tokens, example.to("meta"))


# --------------------------------------------------------------------------------------------
# Typical acceptance
# --------------------------------------------------------------------------------------------

CHAIN_1 = [(0,)]


def _typical_single(root_probs: list[float], token: int, **kwargs):
    """Typical acceptance of one candidate ``token`` under a root distribution ``root_probs``."""
    buffers = build_tree_buffers(CHAIN_1, num_heads=1, top_k=1)
    probs = torch.tensor(root_probs)
    logits = torch.stack([probs.log(), torch.zeros_like(probs)])[None]
    tokens = torch.tensor([[0, token]])
    return accept_typical(logits, tokens, buffers, temperature=1.0, **kwargs).accept_length.item()


def test_typical_epsilon_caps_threshold_for_peaked_distribution():
    peaked = [0.97, 0.01, 0.01, 0.01]  # entropy 0.17: delta * exp(-H) = 0.25 > epsilon = 0.09
    assert _typical_single(peaked, 0) == 1
    assert _typical_single(peaked, 1) == 0
    assert _typical_single(peaked, 1, epsilon=0.005) == 1


def test_typical_entropy_lowers_threshold_for_flat_distribution():
    flat = [0.05] * 20  # entropy ln 20: delta * exp(-H) = 0.3 / 20 = 0.015 < epsilon
    assert _typical_single(flat, 7) == 1
    assert _typical_single(flat, 7, delta=1.2) == 0  # threshold min(0.09, 0.06) = 0.06 > 0.05


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_typical_matches_formula_on_random_distributions(temperature):
    gen = torch.Generator().manual_seed(2)
    batch, vocab = 2000, 12
    buffers = build_tree_buffers(CHAIN_1, num_heads=1, top_k=1)
    logits = 2.0 * torch.randn(batch, 2, vocab, generator=gen)
    tokens = torch.randint(vocab, (batch, 2), generator=gen)
    result = accept_typical(logits, tokens, buffers, temperature=temperature, generator=gen)
    p = torch.softmax(logits[:, 0].double() / temperature, -1)
    entropy = -(p * p.log()).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, 0.09), 0.3 * torch.exp(-entropy))
    p_token = p.gather(1, tokens[:, 1:]).squeeze(1)
    clear = (p_token - threshold).abs() > 1e-5
    expected = (p_token > threshold).long()
    assert torch.equal(result.accept_length[clear], expected[clear])
    assert 0 < expected.sum() < batch  # both outcomes occur


def test_typical_judges_each_node_by_its_own_parents_distribution_down_a_chain():
    """The formula at every depth: a node's token against its parent's p and threshold (a rule that took the
    root's threshold at every depth passed the one-node check above)."""
    gen = torch.Generator().manual_seed(3)
    batch, vocab, depth = 3000, 6, 3
    buffers = build_tree_buffers([(0,), (0, 0), (0, 0, 0)], num_heads=depth, top_k=1)
    logits = 1.5 * torch.randn(batch, depth + 1, vocab, generator=gen)
    tokens = torch.randint(vocab, (batch, depth + 1), generator=gen)
    result = accept_typical(logits, tokens, buffers, temperature=1.0, generator=gen)
    p = torch.softmax(logits[:, :depth].double(), -1)  # each node's parent law: nodes 0..depth-1
    entropy = -(p * p.log()).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, 0.09), 0.3 * torch.exp(-entropy))
    p_token = p.gather(2, tokens[:, 1:, None]).squeeze(2)  # [batch, depth]
    expected = (p_token > threshold).long().cumprod(1).sum(1)
    clear = ((p_token - threshold).abs() > 1e-5).all(1)
    assert torch.equal(result.accept_length[clear], expected[clear])
    assert set(expected[clear].tolist()) == {0, 1, 2, 3}  # every length occurs


def test_typical_prefers_more_likely_path_among_equally_long():
    buffers = build_tree_buffers([(0,), (1,)], num_heads=1, top_k=2)
    root = torch.tensor([0.1, 0.4, 0.5, 1e-9]).log()
    at_node_2 = torch.tensor([0.0, 0.0, 0.0, 50.0])
    logits = torch.stack([root, torch.zeros(4), at_node_2])[None]
    tokens = torch.tensor([[0, 1, 2]])  # both children pass; node 2 (p = 0.5) is more likely
    result = accept_typical(logits, tokens, buffers, temperature=1.0)
    assert result.accept_length.tolist() == [1]
    assert result.path_nodes.tolist() == [[0, 2]]
    assert result.next_token.tolist() == [3]


def test_typical_next_token_follows_last_node_distribution():
    buffers = build_tree_buffers(CHAIN_1, num_heads=1, top_k=1)
    batch = 20_000
    root = torch.tensor([1.0, 0.5, 0.0, -0.5, 3.0])
    logits = torch.stack([root, torch.zeros(5)])[None].expand(batch, -1, -1)
    tokens = torch.tensor([[0, 2]]).expand(batch, -1)  # p(2) = 0.02 < 0.09: rejected
    result = accept_typical(logits, tokens, buffers, temperature=0.8,
                            generator=torch.Generator().manual_seed(3))
    assert result.accept_length.sum() == 0
    counts = torch.bincount(result.next_token, minlength=5).numpy()
    assert _chi2_pvalue(counts, torch.softmax(root / 0.8, -1).numpy()) > 1e-3


def test_typical_temperature_zero_is_greedy(example):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(16, 7, VOCAB, generator=gen)
    tokens = torch.randint(VOCAB, (16, 7), generator=gen)
    typical = accept_typical(logits, tokens, example, temperature=0.0)
    greedy = accept_greedy(logits, tokens, example)
    assert torch.equal(typical.path_nodes, greedy.path_nodes)
    assert torch.equal(typical.next_token, greedy.next_token)


@pytest.mark.parametrize("temperature", [1e-38, 1e-300])  # overflows float32; is 0 in float32
def test_a_tiny_temperature_is_near_greedy_not_nan(example, temperature):
    gen = torch.Generator().manual_seed(5)
    logits = 10 * torch.randn(16, 7, VOCAB, generator=gen)
    tokens = torch.where(torch.rand(16, 7, generator=gen) < 0.5, logits.argmax(-1).roll(1, 1),
                         torch.randint(VOCAB, (16, 7), generator=gen))
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float()
    assert torch.equal(warp_logits(logits, temperature), one_hot)
    typical = accept_typical(logits, tokens, example, temperature=temperature)
    greedy = accept_greedy(logits, tokens, example)
    assert torch.equal(typical.path_nodes, greedy.path_nodes)
    assert torch.equal(typical.next_token, greedy.next_token)


def test_a_top_p_below_float32s_smallest_keeps_the_best_token():
    logits = 10 * torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(6))
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float()
    assert torch.equal(warp_logits(logits, 1.0, top_p=1e-46), one_hot)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, r"temperature must be a finite number >= 0.*-0.5"),
    ({"temperature": 1.0, "epsilon": 0.0}, r"epsilon .* got 0.0"),
    ({"temperature": 1.0, "epsilon": 1.5}, r"epsilon .* got 1.5"),
    ({"temperature": 1.0, "delta": 0.0}, r"delta .* got 0.0"),
    # a bool was taken as 1, a string or None failed on a comparison naming neither
    ({"temperature": True}, r"temperature must be a number, got True"),
    ({"temperature": None}, r"temperature must be a number, got None"),
    ({"temperature": "1"}, r"temperature must be a number, got '1'"),
    ({"temperature": 1.0, "epsilon": True}, r"epsilon \(posterior threshold\) must be a number, got True"),
    ({"temperature": 1.0, "epsilon": "x"}, r"epsilon \(posterior threshold\) must be a number, got 'x'"),
    ({"temperature": 1.0, "delta": None}, r"delta \(posterior alpha\) must be a number, got None"),
])
def test_typical_argument_errors(example, kwargs, message):
    with pytest.raises(ValueError, match=message):
        accept_typical(torch.zeros(1, 7, VOCAB), torch.zeros(1, 7, dtype=torch.long), example, **kwargs)


# --------------------------------------------------------------------------------------------
# warp_logits
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.6, 10, 0.9), (1.0, 100, 0.5),
])
def test_warp_logits_matches_transformers(temperature, top_k, top_p):
    logits = torch.randn(32, 50, generator=torch.Generator().manual_seed(5))
    scores = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = scores.softmax(-1)
    probs = warp_logits(logits, temperature, top_k, top_p)
    assert torch.equal(probs > 0, expected > 0)
    torch.testing.assert_close(probs, expected)


@pytest.mark.parametrize("top_k, top_p", [(0, 0.6), (0, 0.75), (3, 0.6), (0, 0.3), (0, 0.9), (50, 0.5)])
def test_warp_logits_breaks_top_p_ties_as_transformers(top_k, top_p):
    """Tokens tied in probability at the nucleus's edge (duplicated or untrained vocabulary rows, bfloat16
    logits): the ones transformers keeps, in a small vocabulary and in SmolLM2's; the first ones were kept,
    another distribution than its generate's."""
    small = torch.tensor([[2.0, 1.0, 1.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5, 0.5]])
    large = (torch.randn(4, 49152, generator=torch.Generator().manual_seed(1)) * 3).bfloat16().float()  # ties
    for logits in (small, large):
        scores = TopKLogitsWarper(top_k)(None, logits) if 0 < top_k < logits.shape[-1] else logits
        expected = TopPLogitsWarper(top_p)(None, scores).softmax(-1)
        probs = warp_logits(logits, 1.0, top_k, top_p)
        assert torch.equal(probs > 0, expected > 0), (probs, expected)
        torch.testing.assert_close(probs, expected)


def test_numpy_integer_top_k_is_taken_as_sampling_config_takes_it():
    from medusa_infer.decoding import SamplingConfig
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.0]])
    assert torch.equal(warp_logits(logits, 1.0, np.int64(2)), warp_logits(logits, 1.0, 2))
    assert SamplingConfig(acceptance="lossless", top_k=np.int64(2)).top_k == 2


def test_warp_logits_temperature_zero_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 3.0, 0.0]])
    assert warp_logits(logits, 0.0, top_k=2, top_p=0.5).tolist() == [[0, 1, 0], [1, 0, 0]]


@pytest.mark.parametrize("temperature, top_k, top_p, message", [
    (-1.0, 0, 1.0, r"temperature .* got -1.0"),
    (math.inf, 0, 1.0, r"temperature .* got inf"),
    (1.0, -1, 1.0, r"top_k must be an integer >= 0.* got -1"),
    (1.0, 2.5, 1.0, r"top_k .* got 2.5"),
    (1.0, True, 1.0, r"top_k .* got True"),
    (1.0, 0, 0.0, r"top_p must lie in \(0, 1\].* got 0.0"),
    (1.0, 0, 1.2, r"top_p .* got 1.2"),
])
def test_sampling_argument_errors(example, temperature, top_k, top_p, message):
    with pytest.raises(ValueError, match=message):
        warp_logits(torch.zeros(3), temperature, top_k, top_p)
    with pytest.raises(ValueError, match=message):
        accept_lossless(torch.zeros(1, 7, VOCAB), torch.zeros(1, 7, dtype=torch.long), example,
                        temperature, top_k, top_p)


# --------------------------------------------------------------------------------------------
# Lossless tree acceptance
# --------------------------------------------------------------------------------------------

LOSSLESS_VOCAB = 6
LOSSLESS_PATHS = [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (0, 0, 0), (0, 1, 0)]
# Which target rank each node's token has at its parent's context, like good heads would propose,
# with twists: (1,) and (0, 1) repeat their first sibling's token, (3,) is the least likely token.
LOSSLESS_RANKS = [0, 0, 1, 5, 0, 0, 2, 0, 1, 0, 0]
SAMPLES = 25_000


def _target_tables(seed: int, depth: int) -> list[torch.Tensor]:
    """Target model as lookup tables: ``tables[d]`` has shape ``[vocab] * d + [vocab]``."""
    gen = torch.Generator().manual_seed(seed)
    return [1.5 * torch.randn([LOSSLESS_VOCAB] * (d + 1), generator=gen) for d in range(depth + 1)]


def _tree_inputs(tables: list[torch.Tensor], paths=LOSSLESS_PATHS, ranks=LOSSLESS_RANKS):
    """Buffers, node logits ``[n, vocab]`` and node tokens ``[n]`` of the lossless test tree."""
    buffers = build_tree_buffers(paths, num_heads=3, top_k=4)
    contexts = [()]  # tokens after the root on the way to each node
    for node, rank in enumerate(ranks, start=1):
        parent_context = contexts[buffers.parents[node].item()]
        ranking = tables[len(parent_context)][parent_context].argsort(descending=True)
        contexts.append(parent_context + (ranking[rank].item(),))
    node_logits = torch.stack([tables[len(context)][context] for context in contexts])
    node_tokens = torch.tensor([0] + [context[-1] for context in contexts[1:]])
    return buffers, node_logits, node_tokens


def _first_two_tokens(accept_lengths, path_tokens, next_token, second_probs, gen):
    """First two emitted tokens of each row; a row that emitted one draws the second from
    ``second_probs(first_token) -> [batch, vocab]``, as the next decoding step would."""
    first = torch.where(accept_lengths >= 1, path_tokens[:, 0], next_token)
    fallback = torch.multinomial(second_probs(first), 1, generator=gen).squeeze(1)
    second = torch.where(accept_lengths >= 2, path_tokens[:, 1],
                         torch.where(accept_lengths == 1, next_token, fallback))
    return first, second


def _lossless_pvalue(temperature: float, top_k: int, top_p: float, seed: int, rule=accept_lossless,
                     paths=LOSSLESS_PATHS, ranks=LOSSLESS_RANKS) -> float:
    """Sample one tree step SAMPLES times with ``rule``; chi-square p-value of the first two
    emitted tokens against the exact law of plain sampling."""
    tables = _target_tables(seed, depth=3)
    buffers, node_logits, node_tokens = _tree_inputs(tables, paths, ranks)
    logits = node_logits.expand(SAMPLES, -1, -1)
    tokens = node_tokens.expand(SAMPLES, -1)
    gen = torch.Generator().manual_seed(seed)
    result = rule(logits, tokens, buffers, temperature, top_k, top_p, generator=gen)

    def warp(x):
        return warp_logits(x, temperature, top_k, top_p)

    path_tokens = tokens.gather(1, result.path_nodes[:, 1:3].clamp(min=0))
    first, second = _first_two_tokens(result.accept_length, path_tokens, result.next_token,
                                      lambda t: warp(tables[1][t]), gen)
    counts = torch.bincount(first * LOSSLESS_VOCAB + second, minlength=LOSSLESS_VOCAB ** 2)
    exact = warp(tables[0])[:, None] * warp(tables[1])  # [first, second]
    return _chi2_pvalue(counts.numpy(), exact.numpy())


SAMPLING_SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 0, 0.8), (1.0, 3, 1.0), (0.8, 4, 0.9)]


@pytest.mark.parametrize("temperature, top_k, top_p", SAMPLING_SETTINGS)
def test_lossless_preserves_target_distribution(temperature, top_k, top_p):
    assert _lossless_pvalue(temperature, top_k, top_p, seed=11) > 1e-3


def _sequential_rule_law(target: torch.Tensor, tokens: list[int], buffers) -> np.ndarray:
    """Exact law ``[n, vocab]`` of (last accepted node, next token) under the rule as specified:
    children tried in order, each accepted with probability p(x) of the current residual p; on
    rejection x's mass is removed and p renormalised; next token drawn from the final p."""
    children = [[c for c in row if c >= 0] for row in buffers.children.tolist()]
    law = np.zeros(tuple(target.shape))

    def visit(node: int, reach: float) -> None:
        p = target[node].double().numpy().copy()
        for child in children[node]:
            accept = p[tokens[child]]
            visit(child, reach * accept)
            reach *= 1.0 - accept
            p[tokens[child]] = 0.0
            if p.sum() > 0:
                p /= p.sum()
        law[node] += reach * p

    visit(0, 1.0)
    return law


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.8, 4, 0.9)])
def test_lossless_step_law_matches_sequential_rejection_sampling(temperature, top_k, top_p):
    """The closed form has the law of the sequential sibling-by-sibling rule, node for node."""
    tables = _target_tables(11, depth=3)
    buffers, node_logits, node_tokens = _tree_inputs(tables)
    result = accept_lossless(node_logits.expand(SAMPLES, -1, -1), node_tokens.expand(SAMPLES, -1),
                             buffers, temperature, top_k, top_p, generator=torch.Generator().manual_seed(15))
    last_node = result.path_nodes.gather(1, result.accept_length[:, None]).squeeze(1)
    counts = torch.bincount(last_node * LOSSLESS_VOCAB + result.next_token,
                            minlength=buffers.num_nodes * LOSSLESS_VOCAB)
    target = warp_logits(node_logits, temperature, top_k, top_p)
    law = _sequential_rule_law(target, node_tokens.tolist(), buffers)
    assert law.sum() == pytest.approx(1.0)
    assert _chi2_pvalue(counts.numpy(), law) > 1e-3


def test_lossless_accepts_deep_paths_in_the_test_tree():
    """The statistical test must exercise acceptance, not only the bonus token."""
    tables = _target_tables(11, depth=3)
    buffers, node_logits, node_tokens = _tree_inputs(tables)
    result = accept_lossless(node_logits.expand(4000, -1, -1), node_tokens.expand(4000, -1),
                             buffers, 1.0, generator=torch.Generator().manual_seed(0))
    lengths = torch.bincount(result.accept_length, minlength=4)
    assert (lengths > 100).all()
    visited = set(result.path_nodes[result.path_nodes >= 0].tolist())
    # node 4 = (3,) is reached only after (0,), its duplicate (1,) and (2,) all fail
    assert {1, 3, 4, 5, 7, 10} <= visited
    # (1,) and (0, 1) repeat an earlier sibling's token, and their children that sibling's children's:
    # the descent goes into both, and takes the first of each pair of equal children
    assert not visited & {2, 6, 8, 11}


# A grafted lookup chain (1,) (1, 0) (1, 0, 0) whose first token is the heads' (0,): the chain's
# continuation (1, 0) is another token than the heads' (0, 0)
GRAFT_PATHS = [(0,), (1,), (0, 0), (1, 0), (1, 0, 0)]
GRAFT_RANKS = [0, 0, 1, 0, 0]


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.8, 4, 0.9)])
def test_lossless_descends_into_a_duplicate_siblings_subtree_and_stays_lossless(temperature, top_k, top_p):
    """Siblings carrying the same token share the target's p after them: a draw matching a child of
    either is accepted (the chain under the second was never checked, its drafts wasted), and the
    emitted tokens keep plain sampling's law."""
    tables = _target_tables(11, depth=3)
    buffers, node_logits, node_tokens = _tree_inputs(tables, GRAFT_PATHS, GRAFT_RANKS)
    assert node_tokens[1] == node_tokens[2] and node_tokens[3] != node_tokens[4]
    result = accept_lossless(node_logits.expand(4000, -1, -1), node_tokens.expand(4000, -1), buffers,
                             temperature, top_k, top_p, generator=torch.Generator().manual_seed(0))
    visited = torch.bincount(result.path_nodes[result.path_nodes >= 0], minlength=buffers.num_nodes)
    assert (visited[[3, 4, 5]] > 100).all()  # the heads' child, the chain's child and grandchild
    parents = buffers.parents[result.path_nodes[:, 1:].clamp(min=0)]
    assert ((result.path_nodes[:, 1:] < 0) | (parents == result.path_nodes[:, :-1])).all()  # real tree paths
    assert _lossless_pvalue(temperature, top_k, top_p, seed=11, paths=GRAFT_PATHS, ranks=GRAFT_RANKS) > 1e-3


def _bonus_redrawn_from_target(logits, tokens, buffers, temperature, top_k, top_p, generator):
    """Wrong rule: after the tree walk, draw the bonus token from p instead of the residual."""
    result = accept_lossless(logits, tokens, buffers, temperature, top_k, top_p, generator=generator)
    last_node = result.path_nodes.gather(1, result.accept_length[:, None]).squeeze(1)
    probs = warp_logits(logits, temperature, top_k, top_p)[torch.arange(len(last_node)), last_node]
    next_token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return acceptance.Acceptance(result.accept_length, result.path_nodes, next_token)


def _sample_then_longest_match(logits, tokens, buffers, temperature, top_k, top_p, generator):
    """Wrong rule: draw at every node, then keep the longest path of children matching their
    parent's draw. Among duplicate siblings it peeks at which subtree goes deeper."""
    probs = warp_logits(logits, temperature, top_k, top_p)
    draws = torch.multinomial(probs.flatten(0, 1), 1, generator=generator).view(tokens.shape)
    return accept_greedy(torch.nn.functional.one_hot(draws, probs.shape[-1]).float(), tokens, buffers)


@pytest.mark.parametrize("wrong_rule", [_bonus_redrawn_from_target, _sample_then_longest_match])
def test_lossless_test_detects_wrong_rules(wrong_rule):
    assert _lossless_pvalue(1.0, 0, 1.0, seed=11, rule=wrong_rule) < 1e-3


def test_lossless_temperature_zero_is_greedy(example):
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(16, 7, VOCAB, generator=gen)
    tokens = torch.randint(VOCAB, (16, 7), generator=gen)
    lossless = accept_lossless(logits, tokens, example, temperature=0.0)
    greedy = accept_greedy(logits, tokens, example)
    assert torch.equal(lossless.path_nodes, greedy.path_nodes)
    assert torch.equal(lossless.next_token, greedy.next_token)


def test_lossless_is_deterministic_and_paths_are_consistent(example):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(256, 7, 3, generator=gen)
    tokens = torch.randint(3, (256, 7), generator=gen)
    first = accept_lossless(logits, tokens, example, 1.0, generator=torch.Generator().manual_seed(8))
    again = accept_lossless(logits, tokens, example, 1.0, generator=torch.Generator().manual_seed(8))
    assert torch.equal(first.path_nodes, again.path_nodes)
    assert torch.equal(first.next_token, again.next_token)
    for nodes, length in zip(first.path_nodes.tolist(), first.accept_length.tolist()):
        assert nodes[0] == 0 and all(n == -1 for n in nodes[length + 1:])
        for depth in range(1, length + 1):
            assert example.parents[nodes[depth]].item() == nodes[depth - 1]


# --------------------------------------------------------------------------------------------
# Lossless chain acceptance with a stochastic draft
# --------------------------------------------------------------------------------------------

def _draft_pvalue(seed: int) -> float:
    """Chain of k = 2 drafted tokens; chi-square p-value of the first two emitted tokens."""
    gen = torch.Generator().manual_seed(seed)
    v = LOSSLESS_VOCAB
    target = [torch.softmax(1.5 * torch.randn([v] * (d + 1), generator=gen), -1) for d in range(3)]
    draft = [torch.softmax(1.5 * torch.randn([v] * (d + 1), generator=gen), -1) for d in range(2)]
    d1 = torch.multinomial(draft[0].expand(SAMPLES, -1), 1, generator=gen).squeeze(1)
    d2 = torch.multinomial(draft[1][d1], 1, generator=gen).squeeze(1)
    target_probs = torch.stack([target[0].expand(SAMPLES, -1), target[1][d1], target[2][d1, d2]], 1)
    draft_probs = torch.stack([draft[0].expand(SAMPLES, -1), draft[1][d1]], 1)
    drafted = torch.stack([d1, d2], 1)
    accept_length, next_token = accept_draft_lossless(target_probs, draft_probs, drafted, generator=gen)
    first, second = _first_two_tokens(accept_length, drafted, next_token, lambda t: target[1][t], gen)
    counts = torch.bincount(first * v + second, minlength=v * v)
    exact = target[0][:, None] * target[1]
    return _chi2_pvalue(counts.numpy(), exact.numpy())


def test_draft_lossless_preserves_target_distribution():
    assert _draft_pvalue(seed=21) > 1e-3


@pytest.mark.parametrize("wrong", ["double_acceptance", "residual_not_removed"])
def test_draft_test_detects_wrong_rules(monkeypatch, wrong):
    if wrong == "double_acceptance":
        monkeypatch.setattr(acceptance, "_acceptance_probability",
                            lambda p_x, q_x: torch.clamp(2 * p_x / q_x, max=1.0))
    else:
        monkeypatch.setattr(acceptance, "_residual", lambda p, q: p)
    assert _draft_pvalue(seed=21) < 1e-3


def test_draft_equal_to_target_is_always_accepted():
    gen = torch.Generator().manual_seed(9)
    probs = torch.softmax(torch.randn(100, 4, 7, generator=gen), -1)
    drafted = torch.multinomial(probs[:, :3].reshape(-1, 7), 1, generator=gen).view(100, 3)
    accept_length, next_token = accept_draft_lossless(probs, probs[:, :3], drafted, generator=gen)
    assert accept_length.tolist() == [3] * 100
    assert next_token.shape == (100,)


def test_draft_with_no_tokens_samples_the_target():
    probs = torch.tensor([[[0.0, 1.0, 0.0]]]).expand(50, -1, -1)
    accept_length, next_token = accept_draft_lossless(probs, torch.zeros(50, 0, 3),
                                                      torch.zeros(50, 0, dtype=torch.long))
    assert accept_length.tolist() == [0] * 50 and next_token.tolist() == [1] * 50


def test_draft_shape_errors():
    with pytest.raises(ValueError, match=r"draft_tokens must be a \[batch, k\] torch.long tensor"):
        accept_draft_lossless(torch.zeros(2, 3, 5), torch.zeros(2, 2, 5), torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"draft_probs must be \[batch, k, vocab\] with batch, k = 2, 2"):
        accept_draft_lossless(torch.zeros(2, 3, 5), torch.zeros(2, 1, 5), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"target_probs must be \[batch, k \+ 1, vocab\] = \(2, 3, 5\)"):
        accept_draft_lossless(torch.zeros(2, 2, 5), torch.zeros(2, 2, 5), torch.zeros(2, 2, dtype=torch.long))


def _chain_inputs(seed: int, batch: int = 200, n: int = 4, vocab: int = 5):
    """Chain proposals whose drafts often match the target's argmax."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, n, vocab, generator=gen)
    draft_probs = torch.softmax(torch.randn(batch, n - 1, vocab, generator=gen), -1)
    sampled = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=gen).view(batch, n - 1)
    hit = torch.rand(batch, n - 1, generator=gen) < 0.7
    guess = torch.where(hit, logits[:, :-1].argmax(-1), sampled)
    tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.long), guess], 1)
    return logits, tokens, draft_probs


def test_chain_lossless_at_temperature_zero_is_greedy():
    logits, tokens, draft_probs = _chain_inputs(seed=10)
    chain = build_tree_buffers([(0,) * d for d in range(1, 4)], num_heads=3, top_k=1)
    lossless = accept_chain_lossless(logits, tokens, draft_probs, temperature=0.0)
    greedy = accept_greedy(logits, tokens, chain)
    assert torch.equal(lossless.path_nodes, greedy.path_nodes)
    assert torch.equal(lossless.next_token, greedy.next_token)
    assert 0 < lossless.accept_length.float().mean() < 3


def test_chain_lossless_is_draft_rule_on_warped_target():
    logits, tokens, draft_probs = _chain_inputs(seed=12)
    result = accept_chain_lossless(logits, tokens, draft_probs, 0.8, 3, 0.9,
                                   generator=torch.Generator().manual_seed(13))
    accept_length, next_token = accept_draft_lossless(
        warp_logits(logits, 0.8, 3, 0.9), draft_probs, tokens[:, 1:], torch.Generator().manual_seed(13))
    assert torch.equal(result.accept_length, accept_length)
    assert torch.equal(result.next_token, next_token)
    for nodes, length in zip(result.path_nodes.tolist(), accept_length.tolist()):
        assert nodes == list(range(length + 1)) + [-1] * (3 - length)


# --------------------------------------------------------------------------------------------
# The root-only tree (plain decoding)
# --------------------------------------------------------------------------------------------

def test_rules_on_root_only_tree_just_pick_the_next_token():
    buffers = root_only_tree()
    logits = torch.tensor([[[0.0, 4.0, 1.0]], [[2.0, 0.0, 0.0]]])
    tokens = torch.zeros(2, 1, dtype=torch.long)
    gen = torch.Generator().manual_seed(14)
    for result in (
        accept_greedy(logits, tokens, buffers),
        accept_typical(logits, tokens, buffers, 1.0, generator=gen),
        accept_lossless(logits, tokens, buffers, 1.0, generator=gen),
    ):
        assert result.accept_length.tolist() == [0, 0]
        assert result.path_nodes.tolist() == [[0], [0]]
    assert accept_greedy(logits, tokens, buffers).next_token.tolist() == [1, 0]
    sampled = accept_lossless(100 * logits, tokens, buffers, 1.0, generator=gen).next_token
    assert sampled.tolist() == [1, 0]


def test_greedy_plain_step_keeps_the_root_and_takes_the_argmax():
    """A root-only tree (a plain decoding step) takes a shortcut; its result has the shapes and
    values of every other greedy acceptance."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 1, 11, generator=gen)
    result = accept_greedy(logits, torch.zeros(3, 1, dtype=torch.long), root_only_tree())
    assert result.accept_length.tolist() == [0, 0, 0]
    assert result.path_nodes.tolist() == [[0], [0], [0]]
    assert torch.equal(result.next_token, logits[:, 0].argmax(-1))
    assert result.accept_length.dtype == result.path_nodes.dtype == result.next_token.dtype == torch.long


def test_a_rejection_against_a_draft_equal_to_the_target_up_to_rounding_samples_the_target():
    """The draft's rejected token had q > p, so max(0, p - q) holds at least that much; only rounding can
    make it all zero (a draft that is the target: p <= q everywhere by a few ulps). The residual is then
    the target itself, not an all-zero row that multinomial refuses."""
    p = torch.tensor([[0.25, 0.25, 0.5]])
    q = torch.tensor([[0.25, 0.25 + 3e-8, 0.5]])  # one ulp above p at token 1, equal elsewhere
    assert float((p - q).clamp(min=0).sum()) == 0.0
    torch.testing.assert_close(acceptance._residual(p, q), p)
    draws = torch.multinomial(acceptance._residual(p, q), 1000, replacement=True, generator=torch.Generator().manual_seed(0))
    assert set(draws.flatten().tolist()) <= {0, 1, 2}
    # where the leftover is positive it is normalised as before
    torch.testing.assert_close(acceptance._residual(torch.tensor([[0.6, 0.4]]), torch.tensor([[0.2, 0.8]])),
                               torch.tensor([[1.0, 0.0]]))
    # and the rejection path of accept_draft_lossless samples from it instead of raising
    real_rand = torch.rand
    try:
        torch.rand = lambda *shape, **kwargs: torch.full(shape[0], 1.0 - 2**-24)  # reject the drafted token
        length, token = accept_draft_lossless(torch.stack([p, p], 1), q[:, None], torch.tensor([[1]]))
    finally:
        torch.rand = real_rand
    assert length.tolist() == [0] and 0 <= int(token) <= 2



# Killing tests from a mutation round (each failed on one surviving mutant, none on the code)

def test_top_k_1_is_the_argmax_one_hot():
    logits = torch.randn(5, 9, generator=torch.Generator().manual_seed(0))
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), 9).float()
    for temperature in (0.7, 1.0, 1.5):
        assert torch.equal(warp_logits(logits, temperature, top_k=1), one_hot)
        assert torch.equal(warp_logits(logits, temperature, top_k=1, top_p=0.9), one_hot)


def test_typical_tie_break_scores_only_the_accepted_prefix():
    """Equally long accepted prefixes are ranked by the log-likelihood of the accepted nodes alone: a node
    below a rejected one passing its own parent's test must not count (it is never emitted)."""
    # node:  0     1     2     3       4
    # path: root  (0,)  (1,)  (0, 0)  (0, 0, 0)
    buffers = build_tree_buffers([(0,), (1,), (0, 0), (0, 0, 0)], num_heads=3, top_k=2)
    root = torch.tensor([0.45, 0.40, 0.10, 0.05]).log()  # node 1's token (0) likelier than node 2's (1)
    at_1 = torch.tensor([0.97, 0.01, 0.01, 0.01]).log()  # node 3's token 3 is rejected (0.01 < 0.09)
    at_3 = torch.tensor([0.50, 0.48, 0.01, 0.01]).log()  # node 4's token 0 passes under node 3 (never reached)
    logits = torch.stack([root, at_1, torch.zeros(4), at_3, torch.zeros(4)])[None]
    tokens = torch.tensor([[0, 0, 1, 3, 0]])
    result = accept_typical(logits, tokens, buffers, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert result.accept_length.tolist() == [1]
    assert result.path_nodes.tolist() == [[0, 1, -1, -1]]


def test_a_draft_equal_to_the_target_is_accepted_even_for_its_rarest_tokens():
    """min(1, p/q) = 1 whenever q = p, however small they are (a long-tailed vocabulary's draws often are)."""
    q = torch.tensor([1e-6, 1e-4, 1.0 - 1e-4 - 1e-6])
    probs = q.expand(2000, 2, 3)  # target after 0 and 1 drafted tokens, both equal to the draft
    drafted = torch.tensor([0, 1]).repeat(1000)[:, None]  # half the rows drafted token 0, half token 1
    accept_length, _ = accept_draft_lossless(probs, probs[:, :1], drafted, generator=torch.Generator().manual_seed(0))
    assert accept_length.tolist() == [1] * 2000


def test_typical_takes_the_thresholds_documented_bounds():
    """epsilon lies in (0, 1]: 1.0 is taken (the threshold is then delta * exp(-H) alone)."""
    from medusa_infer.acceptance import check_typical_thresholds

    check_typical_thresholds(1.0, 0.3)
    buffers = build_tree_buffers([(0,)], num_heads=1, top_k=1)
    result = accept_typical(torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), buffers, 1.0, epsilon=1.0,
                            delta=4.0, generator=torch.Generator().manual_seed(0))
    assert result.accept_length.tolist() == [0]  # p = 0.25 against min(1.0, 4 / 4) = 1.0
