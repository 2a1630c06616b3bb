"""Tests for medusa_infer.trees: validation, buffers, presets and tree fitting."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from medusa_infer.trees import (
    REFERENCE_HEAD_ACCURACY,
    TREE_PRESETS,
    build_tree_buffers,
    expected_accept_length,
    get_tree,
    greedy_tree,
    path_frequencies,
    per_rank_accuracies,
    root_only_tree,
    tree_capacity,
    tree_float_mask,
    validate_tree,
)

# node:   0     1     2     3       4       5       6
# path:  root  (0,)  (1,)  (0, 0)  (0, 1)  (1, 0)  (0, 0, 0)
EXAMPLE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


@pytest.fixture
def example():
    return build_tree_buffers(EXAMPLE, num_heads=3, top_k=3)


# --------------------------------------------------------------------------------------------
# Buffers on a hand-written tree
# --------------------------------------------------------------------------------------------

def test_example_scalars_and_paths(example):
    assert example.paths == tuple(EXAMPLE)
    assert (example.num_nodes, example.max_depth, example.top_k) == (7, 3, 3)


def test_example_attention_mask(example):
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert example.attn_mask.dtype == torch.bool
    assert torch.equal(example.attn_mask, expected)


def test_example_index_buffers(example):
    assert torch.equal(example.depths, torch.tensor([0, 1, 1, 2, 2, 2, 3]))
    assert torch.equal(example.parents, torch.tensor([-1, 0, 0, 1, 1, 2, 3]))
    # 1 + (depth - 1) * top_k + rank with top_k = 3
    assert torch.equal(example.candidate_index, torch.tensor([0, 1, 2, 4, 5, 4, 7]))
    assert torch.equal(example.children, torch.tensor(
        [[1, 2], [3, 4], [5, -1], [6, -1], [-1, -1], [-1, -1], [-1, -1]]))
    assert torch.equal(example.retrieve_indices, torch.tensor(
        [[0, 1, 3, 6], [0, 1, 4, -1], [0, 2, 5, -1]]))
    for tensor in (example.depths, example.parents, example.candidate_index,
                   example.children, example.retrieve_indices):
        assert tensor.dtype == torch.long


def test_candidate_index_gathers_flat_topk():
    buffers = build_tree_buffers(EXAMPLE, num_heads=3, top_k=3)
    root = torch.tensor([100])
    head_topk = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])  # [heads, top_k]
    flat = torch.cat([root, head_topk.flatten()])
    node_tokens = flat[buffers.candidate_index]
    assert node_tokens.tolist() == [100, 10, 11, 20, 21, 20, 30]


def test_input_is_normalised():
    messy = [[0, 0, 0], (1, 0), [0], (0, 1), (1,), (0, 0), (0,), [1, 0]]
    buffers = build_tree_buffers(messy, num_heads=3, top_k=3)
    assert buffers.paths == tuple(EXAMPLE)
    assert validate_tree(messy, num_heads=3, top_k=3) == EXAMPLE


def test_float_mask(example):
    mask = tree_float_mask(example, torch.float16)
    assert mask.dtype == torch.float16 and mask.shape == (7, 7)
    assert torch.all(mask[example.attn_mask] == 0)
    assert torch.all(mask[~example.attn_mask] == torch.finfo(torch.float16).min)


def test_to_returns_moved_copy(example):
    moved = example.to("meta")
    assert moved is not example
    assert moved.attn_mask.device.type == "meta" and moved.retrieve_indices.device.type == "meta"
    assert example.attn_mask.device.type == "cpu"
    assert moved.paths == example.paths and moved.num_nodes == example.num_nodes


def test_chain_buffers():
    buffers = build_tree_buffers(TREE_PRESETS["chain-3"], num_heads=3, top_k=1)
    assert torch.equal(buffers.attn_mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert buffers.retrieve_indices.tolist() == [[0, 1, 2, 3]]
    assert buffers.candidate_index.tolist() == [0, 1, 2, 3]


def test_root_only_tree():
    buffers = root_only_tree(top_k=3)
    assert (buffers.paths, buffers.num_nodes, buffers.max_depth, buffers.top_k) == ((), 1, 0, 3)
    assert buffers.attn_mask.tolist() == [[True]]
    assert buffers.depths.tolist() == [0] and buffers.candidate_index.tolist() == [0]
    assert buffers.parents.tolist() == [-1] and buffers.children.tolist() == [[-1]]
    assert buffers.retrieve_indices.tolist() == [[0]]


# --------------------------------------------------------------------------------------------
# Validation errors
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("paths, message", [
    ([(0,), ()], r"empty path"),
    ([(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)], r"\(0, 0, 0, 0\) has depth 4 but there are only 3 heads"),
    ([(0,), (-1,)], r"\(-1,\) has rank -1 outside \[0, 3\)"),
    ([(0,), (3,)], r"\(3,\) has rank 3 outside \[0, 3\)"),
    ([(0,), (1, 0)], r"\(1, 0\) has no parent \(1,\)"),
    ([(0,), (0, 0, 1)], r"\(0, 0, 1\) has no parent \(0, 0\)"),
    ([(0,), (0.0,)], r"non-integer rank 0.0"),
    ([(0,), ("1",)], r"non-integer rank '1'"),
    ([(True,)], r"non-integer rank True"),
    ([(0,), 1], r"path 1 is not a sequence"),
    ([], r"tree has no paths"),
    ("tree-8", r"use get_tree\(\)"),
])
def test_validation_errors(paths, message):
    with pytest.raises(ValueError, match=message):
        validate_tree(paths, num_heads=3, top_k=3)


def test_a_tree_too_large_for_its_mask_is_refused_by_its_size():
    """Every path of 4 heads at top_k 10 is 11,110 paths: its (paths + 1)^2 mask (12 GB and 30 s at 5 heads)
    was built without a word."""
    import itertools

    from medusa_infer.trees import MAX_TREE_NODES

    paths = [p for depth in range(1, 5) for p in itertools.product(range(10), repeat=depth)]
    with pytest.raises(ValueError, match=f"the tree has 11110 paths, more than MAX_TREE_NODES={MAX_TREE_NODES}"):
        validate_tree(paths, num_heads=4, top_k=10)
    assert len(validate_tree(paths[:MAX_TREE_NODES], num_heads=4, top_k=10)) == MAX_TREE_NODES


@pytest.mark.parametrize("num_heads, top_k, message", [
    (0, 3, r"num_heads must be a positive integer, got 0"),
    (3, 0, r"top_k must be a positive integer, got 0"),
    (2.0, 3, r"num_heads must be a positive integer, got 2.0"),
])
def test_size_errors(num_heads, top_k, message):
    with pytest.raises(ValueError, match=message):
        validate_tree([(0,)], num_heads=num_heads, top_k=top_k)


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------

PRESET_SIZES = {"chain-1": 1, "chain-2": 2, "chain-3": 3, "chain-4": 4,
                "tree-8": 8, "tree-16": 16, "tree-32": 32, "tree-64": 64}


@pytest.mark.parametrize("name, size", PRESET_SIZES.items())
def test_presets_valid_and_sized(name, size):
    tree = get_tree(name, num_heads=4, top_k=10)
    assert len(tree) == size
    assert tree == TREE_PRESETS[name]  # presets are stored normalised
    assert build_tree_buffers(tree, num_heads=4, top_k=10).num_nodes == size + 1


@pytest.mark.parametrize("size", [8, 16, 32, 64])
def test_tree_presets_are_greedy_fits_of_reference_profile(size):
    assert TREE_PRESETS[f"tree-{size}"] == greedy_tree(REFERENCE_HEAD_ACCURACY, size)


def test_chain_presets_are_chains():
    for k in range(1, 5):
        assert TREE_PRESETS[f"chain-{k}"] == [(0,) * depth for depth in range(1, k + 1)]


def test_get_tree_unknown_name_lists_presets():
    with pytest.raises(ValueError, match=r"unknown tree preset 'tree-7'.*chain-1.*tree-64"):
        get_tree("tree-7", num_heads=4, top_k=10)


def test_get_tree_preset_too_big_for_model():
    with pytest.raises(ValueError, match=r"'tree-32' needs top_k >= 10, got top_k=5; presets that fit these heads: "
                                         r"chain-1, chain-2, chain-3, chain-4, tree-8 \(or fitted-N"):
        get_tree("tree-32", num_heads=4, top_k=5)
    # from a review: 3 heads scoring 10 candidates were told to raise top_k, which met tree-16's need already
    with pytest.raises(ValueError) as err:
        get_tree("tree-16", num_heads=3, top_k=10)
    assert str(err.value).startswith("tree preset 'tree-16' needs 4 heads, got num_heads=3; presets that fit these "
                                     "heads: chain-1, chain-2, chain-3, tree-8")
    with pytest.raises(ValueError, match=r"'tree-8' needs 3 heads, got num_heads=2 and top_k >= 4, got top_k=3; "
                                         r"presets that fit these heads: chain-1, chain-2 \("):
        get_tree("tree-8", num_heads=2, top_k=3)


def test_get_tree_accepts_explicit_paths():
    assert get_tree([[1], (0,), (0, 0)], num_heads=2, top_k=2) == [(0,), (1,), (0, 0)]


# --------------------------------------------------------------------------------------------
# Tree fitting
# --------------------------------------------------------------------------------------------

def test_expected_accept_length_by_hand():
    acc = [[0.5, 0.2], [0.4, 0.1]]
    assert expected_accept_length([(0,)], acc) == pytest.approx(1.5)
    assert expected_accept_length([(0,), (0, 0)], acc) == pytest.approx(1 + 0.5 + 0.5 * 0.4)
    assert expected_accept_length([(0,), (1,), (0, 0), (1, 1)], acc) == pytest.approx(
        1 + 0.5 + 0.2 + 0.5 * 0.4 + 0.2 * 0.1)


@pytest.mark.parametrize("acc, paths, message", [
    ([[0.5, 0.6]], [(0,)], r"sum to 1.1000 > 1"),
    ([[0.5, -0.1]], [(0,)], r"must lie in \[0, 1\]"),
    ([], [(0,)], r"one non-empty row"),
    ([[0.5, 0.2]], [(0,), (0, 0)], r"depth 2 but there are only 1 heads"),
    ([[0.5, 0.2]], [(2,)], r"rank 2 outside \[0, 2\)"),
    # measured path probabilities where a path beats its parent (hand-edited, another tool's): the greedy fit
    # took a worse tree as optimal, and the adaptive ladder failed with "has no parent in the tree"
    ({(0,): 0.5, (0, 0): 0.6}, [(0,)], r"path probability \(0, 0\): 0.6 exceeds its parent \(0,\)'s \(0.5"),
    ({(1,): 0.3, (0, 0): 0.2}, [(1,)], r"path probability \(0, 0\): 0.2 exceeds its parent \(0,\)'s \(0.0"),
    # siblings accepted more often together than their parent (at most one of them is, at a position): a 2-node
    # tree was expected to give 2.8 tokens a step, and fitted so
    ({(0,): 0.9, (1,): 0.9}, [(0,)], r"the paths under \(\) have probabilities summing to 1.8, more than 1"),
    ({(0,): 0.5, (0, 0): 0.3, (0, 1): 0.3}, [(0,)], r"the paths under \(0,\) have probabilities summing to 0.6, "
                                                     r"more than theirs \(0.5\)"),
])
def test_expected_accept_length_errors(acc, paths, message):
    with pytest.raises(ValueError, match=message):
        expected_accept_length(paths, acc)


def test_a_path_of_probability_0_under_a_parent_left_out_is_taken():
    """Its siblings' sum was checked against the parent the table leaves out: a KeyError (at load too)."""
    assert greedy_tree({(0,): 0.5, (1, 0): 0.0}, 1) == [(0,)]


def test_sizes_may_be_numpy_integers_and_rank_tables_must_be_whole():
    """numpy's integers were refused as sizes (ranks took them); a table of ragged rows was cut to its
    shortest row, dropping ranks without a word."""
    import numpy as np

    assert validate_tree([(0,), (1,)], np.int64(3), np.int32(2)) == [(0,), (1,)]
    paths = [(0,), (0, 0), (0, 0, 199)]  # (uint8: 2 * 200 overflowed into candidate_index with a warning)
    assert build_tree_buffers(paths, np.uint8(3), np.uint8(200)).candidate_index.tolist() == \
        build_tree_buffers(paths, 3, 200).candidate_index.tolist() == [0, 1, 201, 600]
    assert greedy_tree([[0.5, 0.2]], np.int64(2)) == [(0,), (1,)]
    # as decoding's counts take them (refused as "num_nodes=tensor(2) must be an integer in [1, 2]")
    assert greedy_tree([[0.5, 0.2]], torch.tensor(2)) == [(0,), (1,)]
    assert validate_tree([(0,)], torch.tensor(3), torch.tensor(2)) == [(0,)]
    for bad in (torch.tensor(True), torch.tensor([2]), np.array([2])):  # (read as 1, 2 and 2)
        with pytest.raises(ValueError, match="num_nodes=.* must be an integer"):
            greedy_tree([[0.5, 0.2]], bad)
    with pytest.raises(ValueError, match=r"rows of one length .* got rows of \[3, 1\]: pad the short rows"):
        greedy_tree([[0.5, 0.3, 0.1], [0.4]], 3)


def test_greedy_tree_size_errors():
    with pytest.raises(ValueError, match=r"num_nodes=0 must be an integer in \[1, 6\]"):
        greedy_tree([[0.5, 0.2], [0.4, 0.1]], 0)
    with pytest.raises(ValueError, match=r"num_nodes=7 must be an integer in \[1, 6\]"):
        greedy_tree([[0.5, 0.2], [0.4, 0.1]], 7)


def _prefix_closed_trees(num_heads: int, top_k: int, max_size: int):
    """Every prefix-closed set of 1..max_size paths over num_heads x top_k."""
    nodes = [p for depth in range(1, num_heads + 1)
             for p in itertools.product(range(top_k), repeat=depth)]
    for size in range(1, max_size + 1):
        for subset in itertools.combinations(nodes, size):
            chosen = set(subset)
            if all(len(p) == 1 or p[:-1] in chosen for p in chosen):
                yield subset


def _random_accuracies(rng: random.Random, num_heads: int, top_k: int) -> list[list[float]]:
    rows = []
    for _ in range(num_heads):
        weights = [rng.random() for _ in range(top_k + 1)]  # last weight: "none correct"
        rows.append([w / sum(weights) for w in weights[:top_k]])
    return rows


@pytest.mark.parametrize("seed", range(10))
def test_greedy_tree_matches_brute_force(seed):
    rng = random.Random(seed)
    acc = _random_accuracies(rng, num_heads=2, top_k=2)
    best = {}
    for tree in _prefix_closed_trees(num_heads=2, top_k=2, max_size=4):
        value = expected_accept_length(tree, acc)
        best[len(tree)] = max(best.get(len(tree), 0.0), value)
    for size, value in best.items():
        greedy = greedy_tree(acc, size)
        assert len(greedy) == size
        assert expected_accept_length(greedy, acc) == pytest.approx(value, abs=1e-12)


def test_greedy_tree_breaks_ties_towards_shorter_paths():
    acc = [[0.6, 0.3], [0.5, 0.1]]  # (1,) and (0, 0) both have probability 0.3
    assert greedy_tree(acc, 2) == [(0,), (1,)]
    assert greedy_tree(acc, 3) == [(0,), (1,), (0, 0)]


# ----- measured joint path accuracies


def test_path_frequencies_by_hand():
    ranks = torch.tensor([[0, 0], [0, 1], [1, -1], [-1, 0], [0, 0]])
    assert path_frequencies(ranks) == {(0,): 0.6, (0, 0): 0.4, (0, 1): 0.2, (1,): 0.2}
    # the most probable paths, ties to the shorter: still a tree
    assert path_frequencies(ranks, max_paths=3) == {(0,): 0.6, (0, 0): 0.4, (1,): 0.2}
    with pytest.raises(ValueError, match="non-empty"):
        path_frequencies(torch.zeros(0, 2, dtype=torch.long))


def test_shared_errors_make_deep_paths_likelier_than_independence_says():
    """Half the positions are easy for both heads, half hard for both: a 2-chain is accepted
    whole half the time, not a quarter of it."""
    ranks = torch.tensor([[0, 0], [-1, -1]] * 50)
    joint = path_frequencies(ranks)
    independent = per_rank_accuracies([[0.5], [0.5]])
    assert expected_accept_length([(0,), (0, 0)], joint) == pytest.approx(2.0)
    assert expected_accept_length([(0,), (0, 0)], independent) == pytest.approx(1.75)
    # paths never seen accepted count as 0, at any depth or rank
    assert expected_accept_length([(0,), (1,), (0, 0), (0, 0, 3)], joint) == pytest.approx(2.0)


@pytest.mark.parametrize("seed", range(10))
def test_greedy_tree_on_path_frequencies_matches_brute_force(seed):
    generator = torch.Generator().manual_seed(seed)
    easy = torch.rand(60, 1, generator=generator) < 0.5  # correlated: easy positions hit more often
    ranks = torch.randint(-1, 2, (60, 2), generator=generator)
    ranks = torch.where(easy & (torch.rand(60, 2, generator=generator) < 0.6), 0, ranks)
    joint = path_frequencies(ranks)
    best = {}
    for tree in _prefix_closed_trees(num_heads=2, top_k=2, max_size=4):
        best[len(tree)] = max(best.get(len(tree), 0.0), expected_accept_length(tree, joint))
    for size, value in best.items():
        if size <= tree_capacity(joint):
            assert expected_accept_length(greedy_tree(joint, size), joint) == pytest.approx(value, abs=1e-12)


def test_per_rank_accuracies_and_capacity():
    assert per_rank_accuracies([[0.5, 0.7, 0.7]])[0] == pytest.approx([0.5, 0.2, 0.0])
    assert tree_capacity([[0.5, 0.2], [0.4, 0.1]]) == 6
    assert tree_capacity({(0,): 0.5, (0, 0): 0.25, (1,): 0.0}) == 2


def test_per_rank_accuracies_clamp_a_dip_the_config_tolerates():
    """MedusaConfig accepts cumulative rows that dip by up to 1e-9 (rounding): the rank's share is 0,
    not a negative probability that check_accuracies then refuses."""
    per_rank = per_rank_accuracies([[0.5, 0.7, 0.7 - 1e-10]])
    assert per_rank == [[0.5, pytest.approx(0.2), 0.0]]
    assert expected_accept_length([(0,), (1,), (2,)], per_rank) == pytest.approx(1.7)


def test_a_nan_accuracy_is_refused():
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        expected_accept_length([(0,)], [[float("nan")]])


def test_expected_accept_length_counts_each_node_once():
    """Paths are normalised first, as validate_tree does: a repeated path (as a list or a tuple) is one node,
    and a generator of paths is read once."""
    acc = [[0.5, 0.2], [0.4, 0.1]]
    assert expected_accept_length([(0,), [0], (0,), (0, 0)], acc) == pytest.approx(1 + 0.5 + 0.2)
    assert expected_accept_length((p for p in [(0,), (0, 0)]), acc) == pytest.approx(1.7)


def test_get_tree_checks_the_sizes_before_the_preset():
    with pytest.raises(ValueError, match="num_heads must be a positive integer, got 2.5"):
        get_tree("chain-1", 2.5, 10)
    with pytest.raises(ValueError, match="top_k must be a positive integer, got True"):
        get_tree("chain-1", 4, True)
