"""Candidate trees for Medusa decoding: validation, presets, fitting and tensor buffers.

A tree is a list of paths in Medusa's ``medusa_choices`` format. Each path is a tuple
of top-k ranks, one per depth: ``(0, 1)`` is "rank 0 of head 0, then rank 1 of head 1".
The root (the token the base model already chose) is implicit and is node 0 of the
buffers; path ``i`` of the validated, sorted list is node ``i + 1``.

Example, ``[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]``::

    node:   0     1     2     3       4       5       6
    path:  root  (0,)  (1,)  (0, 0)  (0, 1)  (1, 0)  (0, 0, 0)

Everything here is pure: functions take data and return new data or CPU tensors.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import numbers
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

Path = tuple[int, ...]

#: How likely each path is to be accepted: either ``[head][rank]`` probabilities that exactly rank
#: r of head d is right, taken as independent across depths (Medusa's model), or a mapping from
#: paths to the measured probability that every rank along the path is right (joint, see
#: :func:`path_frequencies`; paths it leaves out count as never accepted).
AcceptanceModel = Sequence[Sequence[float]] | Mapping[Path, float]

__all__ = [
    "AcceptanceModel",
    "Path",
    "REFERENCE_HEAD_ACCURACY",
    "TREE_PRESETS",
    "TreeBuffers",
    "ExpansionLevel",
    "build_tree_buffers",
    "expansion_plan",
    "expected_accept_length",
    "get_tree",
    "greedy_tree",
    "path_frequencies",
    "path_probability",
    "per_rank_accuracies",
    "root_only_tree",
    "tree_capacity",
    "tree_float_mask",
    "validate_tree",
]


MAX_TREE_NODES = 4096
"""The most paths (nodes besides the root) a tree may have: its attention mask is (paths + 1)^2 (every
path of 5 heads at top_k 10, 111,110 of them, took 12 GB and 30 s to build before any forward); trees
that pay for themselves have tens to hundreds."""


def validate_tree(paths: Iterable[Sequence[int]], num_heads: int, top_k: int) -> list[Path]:
    """Check a tree and return it normalised: tuples, duplicates dropped, sorted by (len, path).

    Raises ``ValueError`` naming the bad path when a path is empty, deeper than
    ``num_heads``, holds a rank that is not an integer in ``[0, top_k)``, or when a
    path's parent (the path minus its last rank) is missing from the tree; and when the tree has
    more than ``MAX_TREE_NODES`` paths.
    """
    _check_sizes(num_heads, top_k)
    if isinstance(paths, str):
        raise ValueError(f"a tree is a list of rank tuples, got the string {paths!r}; "
                         "use get_tree() to resolve a preset name")
    normalised: set[Path] = set()
    for raw in paths:
        path = _as_path(raw)
        if not path:
            raise ValueError("empty path () in tree: the root is implicit, remove the empty path")
        if len(path) > num_heads:
            raise ValueError(f"path {path} has depth {len(path)} but there are only {num_heads} "
                             f"heads; shorten it to at most {num_heads} ranks or use more heads")
        for rank in path:
            if not 0 <= rank < top_k:
                raise ValueError(f"path {path} has rank {rank} outside [0, {top_k}); "
                                 f"use ranks below top_k={top_k} or raise top_k")
        normalised.add(path)
    if not normalised:
        raise ValueError("tree has no paths; give at least one, e.g. [(0,)]")
    if len(normalised) > MAX_TREE_NODES:
        raise ValueError(f"the tree has {len(normalised)} paths, more than MAX_TREE_NODES={MAX_TREE_NODES} (its "
                         "attention mask is (paths + 1)^2); give a smaller tree")
    for path in normalised:
        if len(path) > 1 and path[:-1] not in normalised:
            raise ValueError(f"path {path} has no parent {path[:-1]} in the tree; "
                             f"add {path[:-1]} or remove {path}")
    return sorted(normalised, key=lambda p: (len(p), p))


def _is_count(value: object, minimum: int) -> bool:
    """Whether ``value`` is an integer of at least ``minimum``: as ``decoding``'s counts take them (Python's,
    numpy's, a 0-d integer tensor; not a bool)."""
    from medusa_infer.decoding import _integer  # (decoding imports this module: here, not at its top)

    number = _integer(value)
    return number is not None and number >= minimum


def _check_sizes(num_heads: int, top_k: int) -> None:
    """Raise unless ``num_heads`` and ``top_k`` are positive integers."""
    if not _is_count(num_heads, 1):
        raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}")
    if not _is_count(top_k, 1):
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")


def _as_path(raw: Sequence[int]) -> Path:
    """Turn one user-given path into a tuple of ints, rejecting non-integer ranks."""
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
        raise ValueError(f"path {raw!r} is not a sequence of ranks; write it as a tuple like (0, 1)")
    for rank in raw:
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
            raise ValueError(f"path {tuple(raw)!r} has non-integer rank {rank!r}; "
                             "ranks are integer top-k positions like 0, 1, 2")
    return tuple(int(rank) for rank in raw)


@dataclass(frozen=True, eq=False)
class TreeBuffers:
    """Tensors describing one candidate tree; ``n = num_nodes = 1 + len(paths)``, node 0 is the root.

    Fields:
        paths: validated paths sorted by (len, path); path ``i`` is node ``i + 1``.
        attn_mask: ``[n, n]`` bool, True where node i may attend node j (j is i or an ancestor).
        depths: ``[n]`` long, depth of each node (root 0); position id = current length + depth.
        candidate_index: ``[n]`` long, index of each node's token in the flat candidate vector
            ``concat([root_token], topk[head 0], topk[head 1], ...)``:
            ``1 + (depth - 1) * top_k + rank`` for depth >= 1, 0 for the root.
        parents: ``[n]`` long, parent node of each node (-1 for the root).
        children: ``[n, max_children]`` long, child nodes of each node in rank order, padded with -1.
        retrieve_indices: ``[num_leaves, max_depth + 1]`` long, node indices from the root to each
            leaf, padded with -1; leaves are in lexicographic path order (low ranks first).
        num_nodes, max_depth, top_k: sizes.
    """

    paths: tuple[Path, ...]
    attn_mask: torch.Tensor
    depths: torch.Tensor
    candidate_index: torch.Tensor
    parents: torch.Tensor
    children: torch.Tensor
    retrieve_indices: torch.Tensor
    num_nodes: int
    max_depth: int
    top_k: int

    def to(self, device: torch.device | str) -> TreeBuffers:
        """Return a copy with every tensor on ``device``."""
        moved = {
            field.name: getattr(self, field.name).to(device)
            for field in dataclasses.fields(self)
            if isinstance(getattr(self, field.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


def build_tree_buffers(paths: Iterable[Sequence[int]], num_heads: int, top_k: int) -> TreeBuffers:
    """Validate ``paths`` and build the CPU tensors that drive tree decoding and acceptance."""
    tree = validate_tree(paths, num_heads, top_k)
    num_heads, top_k = int(num_heads), int(top_k)  # checked: numpy's uint8 overflowed in candidate_index
    node_of: dict[Path, int] = {(): 0}
    node_of.update({path: i + 1 for i, path in enumerate(tree)})
    n = len(node_of)

    parents = [-1] + [node_of[path[:-1]] for path in tree]
    depths = [0] + [len(path) for path in tree]
    candidate_index = [0] + [1 + (len(path) - 1) * top_k + path[-1] for path in tree]

    attn_mask = torch.zeros(n, n, dtype=torch.bool)
    attn_mask[0, 0] = True
    for node in range(1, n):  # parents precede children in the sorted order
        attn_mask[node] = attn_mask[parents[node]]
        attn_mask[node, node] = True

    child_lists: list[list[int]] = [[] for _ in range(n)]
    for node in range(1, n):  # siblings arrive in rank order
        child_lists[parents[node]].append(node)
    max_children = max(len(kids) for kids in child_lists)
    children = torch.full((n, max_children), -1, dtype=torch.long)
    for node, kids in enumerate(child_lists):
        children[node, : len(kids)] = torch.tensor(kids, dtype=torch.long)

    max_depth = max(depths)
    leaves = sorted(path for path in tree if not child_lists[node_of[path]])
    retrieve_indices = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        chain = [node_of[leaf[:depth]] for depth in range(len(leaf) + 1)]
        retrieve_indices[row, : len(chain)] = torch.tensor(chain, dtype=torch.long)

    return TreeBuffers(
        paths=tuple(tree),
        attn_mask=attn_mask,
        depths=torch.tensor(depths, dtype=torch.long),
        candidate_index=torch.tensor(candidate_index, dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        children=children,
        retrieve_indices=retrieve_indices,
        num_nodes=n,
        max_depth=max_depth,
        top_k=top_k,
    )


@dataclass(frozen=True, eq=False)
class ExpansionLevel:
    """How one depth of a tree is filled by heads that read their candidate path
    (``MedusaConfig.path_input``): head ``depth - 1`` runs once per parent, on that parent's path.

    Fields:
        depth: the depth filled (1 = the root's children).
        parents: ``[P]`` node indices at ``depth - 1`` with children to fill.
        ancestors: ``[P, depth - 1]`` node indices from depth 1 down to each parent (its path's
            tokens, the head's path input; empty at depth 1).
        nodes: ``[M]`` the node indices filled at this depth.
        slot: ``[M]`` each node's parent as an index into ``parents``.
        ranks: ``[M]`` each node's rank among its parent's head's candidates.
        top_k: candidates to take per parent (``max(ranks) + 1``).
    """

    depth: int
    parents: torch.Tensor
    ancestors: torch.Tensor
    nodes: torch.Tensor
    slot: torch.Tensor
    ranks: torch.Tensor
    top_k: int

    def to(self, device: torch.device | str) -> ExpansionLevel:
        """A copy with every tensor on ``device``."""
        return dataclasses.replace(self, **{name: getattr(self, name).to(device)
                                            for name in ("parents", "ancestors", "nodes", "slot", "ranks")})


def expansion_plan(buffers: TreeBuffers, top_k: int | None = None) -> list[ExpansionLevel]:
    """The levels that fill ``buffers``' nodes from heads reading their path, shallowest first.

    Only nodes whose every rank is below ``top_k`` (default: the tree's) come from the heads;
    others (a grafted lookup chain at rank ``top_k``) are left out, for the caller to fill.
    """
    limit = buffers.top_k if top_k is None else top_k
    node_of = {path: i + 1 for i, path in enumerate(buffers.paths)}
    levels = []
    for depth in range(1, buffers.max_depth + 1):
        paths = [p for p in buffers.paths if len(p) == depth and max(p) < limit]
        if not paths:
            break  # a node's parent is one of the heads' nodes too, so nothing deeper follows
        parents = list(dict.fromkeys(p[:-1] for p in paths))
        slot_of = {parent: i for i, parent in enumerate(parents)}
        levels.append(ExpansionLevel(
            depth=depth,
            parents=torch.tensor([node_of.get(p, 0) for p in parents], dtype=torch.long),
            ancestors=torch.tensor([[node_of[p[:j]] for j in range(1, depth)] for p in parents],
                                   dtype=torch.long).view(len(parents), depth - 1),
            nodes=torch.tensor([node_of[p] for p in paths], dtype=torch.long),
            slot=torch.tensor([slot_of[p[:-1]] for p in paths], dtype=torch.long),
            ranks=torch.tensor([p[-1] for p in paths], dtype=torch.long),
            top_k=max(p[-1] for p in paths) + 1,
        ))
    return levels


def tree_float_mask(buffers: TreeBuffers, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask ``[n, n]``: 0.0 where allowed, ``finfo(dtype).min`` elsewhere."""
    mask = torch.zeros(buffers.attn_mask.shape, dtype=dtype, device=buffers.attn_mask.device)
    return mask.masked_fill(~buffers.attn_mask, torch.finfo(dtype).min)


# ---------------------------------------------------------------------------------------------
# Fitting a tree to measured head accuracies
# ---------------------------------------------------------------------------------------------

def per_rank_accuracies(cumulative: Sequence[Sequence[float]]) -> list[list[float]]:
    """``[head][rank]`` probability that exactly rank r is right, from cumulative top-k
    accuracies (``MedusaConfig.head_accuracies``: the target is among the k best)."""
    return [[max(0.0, b - a) for a, b in zip([0.0, *row[:-1]], row)] for row in cumulative]


def path_frequencies(ranks: torch.Tensor, max_paths: int | None = None) -> dict[Path, float]:
    """The measured probability of each path, joint over depths.

    Args:
        ranks: ``[positions, num_heads]`` the rank of the correct token among head d's candidates
            at each position, or -1 when it is not among them (or there is no target).
        max_paths: keep only this many of the most probable paths (ties: shorter, then smaller).
            A child is never more probable than its parent, so what is kept is a valid tree.

    Returns:
        ``{path: fraction of positions where every rank along the path is right}``. Heads that
        share errors (a hard position is hard for every head) make deep paths far more likely
        than the product of per-head accuracies says.
    """
    if ranks.dim() != 2 or ranks.shape[0] == 0:
        raise ValueError(f"ranks must be a non-empty [positions, num_heads] tensor, got shape {tuple(ranks.shape)}")
    counts: Counter[Path] = Counter()
    for row in ranks.tolist():
        path: list[int] = []
        for rank in row:
            if rank < 0:
                break
            path.append(int(rank))
            counts[tuple(path)] += 1
    total = ranks.shape[0]
    ordered = sorted(counts.items(), key=lambda item: (-item[1], len(item[0]), item[0]))
    if max_paths is not None:
        ordered = ordered[:max_paths]
    return {path: count / total for path, count in ordered}


def check_accuracies(model: AcceptanceModel) -> None:
    """Raise if ``model`` is neither a table of per-rank probabilities, one row per head, nor a
    mapping from paths to probabilities."""
    if isinstance(model, Mapping):
        if not model:
            raise ValueError("the path probabilities are empty: no path was ever accepted")
        for path, prob in model.items():
            if not isinstance(path, tuple) or not path or any(r < 0 for r in path) or not 0.0 <= prob <= 1.0:
                raise ValueError(f"path probability {path!r}: {prob!r} must map a non-empty tuple of ranks "
                                 "to a probability in [0, 1]")
        for path, prob in model.items():  # a path is accepted only where its parent is: the fits rely on it
            parent = model.get(path[:-1], 0.0) if len(path) > 1 else 1.0
            if prob > parent + 1e-9:
                raise ValueError(f"path probability {path!r}: {prob!r} exceeds its parent {path[:-1]!r}'s "
                                 f"({parent!r}, 0 where not given): a path is accepted only where its parent is")
        children: dict[tuple[int, ...], float] = {}
        for path, prob in model.items():  # at most one child of a path is accepted (the token its head chose)
            children[path[:-1]] = children.get(path[:-1], 0.0) + prob
        for parent, total in children.items():
            bound = model.get(parent, 0.0) if parent else 1.0  # (a parent left out: 0, its children all 0 too)
            if total > bound + 1e-4:  # (rounding of stored figures aside)
                raise ValueError(f"the paths under {parent!r} have probabilities summing to {total!r}, more than "
                                 f"{'theirs' if parent else '1'} ({bound!r}): at most one of them is accepted at a "
                                 "position; the expected tokens would exceed what a tree can give")
        return
    if not model or any(len(row) == 0 for row in model):
        raise ValueError("head_topk_acc needs one non-empty row of top-k accuracies per head, "
                         f"got {model!r}")
    if len({len(row) for row in model}) > 1:  # (a table cut to its shortest row dropped ranks without a word)
        raise ValueError(f"head_topk_acc needs rows of one length (the same ranks for every head), got rows of "
                         f"{[len(row) for row in model]}: pad the short rows with 0.0 or cut the long ones")
    for head, row in enumerate(model):
        if any(not 0.0 <= acc <= 1.0 for acc in row):
            raise ValueError(f"head {head} accuracies {list(row)} must lie in [0, 1]")
        if sum(row) > 1.0 + 1e-6:
            raise ValueError(f"head {head} accuracies {list(row)} sum to {sum(row):.4f} > 1; "
                             "rank-r accuracies are disjoint events, pass P(rank r is correct) "
                             "(per_rank_accuracies converts cumulative top-k accuracies)")


def tree_capacity(model: AcceptanceModel) -> int:
    """The most nodes a useful tree can have under ``model``: every path the heads' depth and
    ranks allow, or, for measured path probabilities, the paths ever accepted."""
    check_accuracies(model)
    if isinstance(model, Mapping):
        return sum(1 for prob in model.values() if prob > 0)
    num_heads, top_k = _shape(model)
    return sum(top_k ** depth for depth in range(1, num_heads + 1))


def _shape(model: AcceptanceModel) -> tuple[int, int]:
    """``(num_heads, top_k)`` the model covers."""
    if isinstance(model, Mapping):
        return max(len(p) for p in model), 1 + max(max(p) for p in model)
    return len(model), min(len(row) for row in model)


def tree_depth(paths: Iterable[Sequence[int]]) -> int:
    """The longest path's length: how many heads a tree reads (0 for the empty tree)."""
    return max((len(p) for p in paths), default=0)


def path_probability(path: Path, model: AcceptanceModel) -> float:
    """Probability that every rank along ``path`` is correct under ``model``."""
    if isinstance(model, Mapping):
        return model.get(path, 0.0)
    return math.prod(model[depth][rank] for depth, rank in enumerate(path))


def expected_accept_length(paths: Iterable[Sequence[int]], head_topk_acc: AcceptanceModel) -> float:
    """Expected tokens per step under greedy decoding: 1 (bonus) + sum of path probabilities.

    ``head_topk_acc`` is an :data:`AcceptanceModel`: per-rank accuracies ``[d][r]`` taken as
    independent across depths (Medusa's calibration model), or measured joint path
    probabilities. A node is accepted iff its whole path is correct, so the expected accept
    length is the sum over nodes.
    """
    check_accuracies(head_topk_acc)
    if isinstance(head_topk_acc, Mapping):  # paths the measurement never saw accepted count as 0
        paths = [_as_path(p) for p in paths]
        num_heads, top_k = _shape({**head_topk_acc, **{p: 0.0 for p in paths if p}})
    else:
        num_heads, top_k = _shape(head_topk_acc)
    tree = validate_tree(paths, num_heads, top_k)
    return 1.0 + sum(path_probability(path, head_topk_acc) for path in tree)


def greedy_tree(head_topk_acc: AcceptanceModel, num_nodes: int) -> list[Path]:
    """The ``num_nodes``-node tree maximising :func:`expected_accept_length` (Medusa's method).

    Repeatedly adds the most probable path whose parent is already in the tree. A child is never
    more probable than its parent (under either kind of :data:`AcceptanceModel`), so this picks
    the ``num_nodes`` most probable paths overall, which is optimal. Ties go to the shorter, then
    lexicographically smaller path.
    """
    check_accuracies(head_topk_acc)
    num_heads, top_k = _shape(head_topk_acc)
    capacity = sum(top_k ** depth for depth in range(1, num_heads + 1))
    if not _is_count(num_nodes, 1) or int(num_nodes) > capacity:
        raise ValueError(f"num_nodes={num_nodes!r} must be an integer in [1, {capacity}] for "
                         f"{num_heads} heads with top_k={top_k}")
    num_nodes = int(num_nodes)

    def entry(path: Path) -> tuple[float, int, Path]:
        return (-path_probability(path, head_topk_acc), len(path), path)

    frontier = [entry((rank,)) for rank in range(top_k)]
    heapq.heapify(frontier)
    tree: list[Path] = []
    while len(tree) < num_nodes:
        _, depth, path = heapq.heappop(frontier)
        tree.append(path)
        if depth < num_heads:
            for rank in range(top_k):
                heapq.heappush(frontier, entry(path + (rank,)))
    return sorted(tree, key=lambda p: (len(p), p))


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------

#: Accuracy profile the ``tree-*`` presets were fitted to: ``[head][rank]`` probability that the
#: rank-r candidate of the head is correct. Head 0 matches a typical Medusa-1 head 0
#: ([0.6, 0.1, 0.05, ...]); each later head is scaled down. ``greedy_tree(REFERENCE_HEAD_ACCURACY,
#: size)`` reproduces each ``tree-<size>`` preset (checked by the tests).
REFERENCE_HEAD_ACCURACY: tuple[tuple[float, ...], ...] = tuple(
    tuple(round(scale * acc, 6) for acc in (0.6, 0.1, 0.05, 0.03, 0.02, 0.015, 0.012, 0.01, 0.008, 0.006))
    for scale in (1.0, 0.7, 0.53, 0.42)
)

TREE_PRESETS: dict[str, list[Path]] = {
    "chain-1": [(0,)],
    "chain-2": [(0,), (0, 0)],
    "chain-3": [(0,), (0, 0), (0, 0, 0)],
    "chain-4": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)],
    "tree-8": [
        (0,), (1,), (2,), (3,),
        (0, 0), (0, 1), (1, 0),
        (0, 0, 0),
    ],
    "tree-16": [
        (0,), (1,), (2,), (3,), (4,), (5,),
        (0, 0), (0, 1), (0, 2), (1, 0), (2, 0),
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
        (0, 0, 0, 0),
    ],
    "tree-32": [
        (0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,), (8,), (9,),
        (0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (0, 6), (1, 0), (1, 1), (2, 0), (3, 0),
        (4, 0), (5, 0), (6, 0),
        (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 2, 0), (1, 0, 0), (2, 0, 0),
        (0, 0, 0, 0),
    ],
    "tree-64": [
        (0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,), (8,), (9,),
        (0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (0, 6), (0, 7), (0, 8), (0, 9), (1, 0),
        (1, 1), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (4, 0), (5, 0), (6, 0),
        (7, 0), (8, 0), (9, 0),
        (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 0, 4), (0, 0, 5), (0, 1, 0), (0, 1, 1),
        (0, 2, 0), (0, 3, 0), (0, 4, 0), (0, 5, 0), (1, 0, 0), (1, 0, 1), (1, 1, 0), (2, 0, 0),
        (3, 0, 0), (4, 0, 0), (5, 0, 0), (6, 0, 0),
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 1, 0), (0, 0, 2, 0), (0, 1, 0, 0),
        (0, 2, 0, 0), (1, 0, 0, 0), (2, 0, 0, 0),
    ],
}
"""Named trees. ``chain-k``: one candidate per depth (k nodes). ``tree-n``: n nodes fitted by
:func:`greedy_tree` to :data:`REFERENCE_HEAD_ACCURACY`; tree-8 needs 3 heads and top_k >= 4,
tree-16 needs 4 heads and top_k >= 6, tree-32 and tree-64 need 4 heads and top_k >= 10."""


def get_tree(name_or_paths: str | Iterable[Sequence[int]], num_heads: int, top_k: int) -> list[Path]:
    """Resolve a preset name (see :data:`TREE_PRESETS`) or explicit paths to a validated tree."""
    if not isinstance(name_or_paths, str):
        return validate_tree(name_or_paths, num_heads, top_k)
    if name_or_paths not in TREE_PRESETS:
        raise ValueError(f"unknown tree preset {name_or_paths!r}; known presets: "
                         f"{', '.join(TREE_PRESETS)} (or explicit paths: generate()'s tree=, medusa-bench's --tree "
                         "[[0], [1], [0, 0]]; generate() and the command lines also take fitted-N, the N-node tree "
                         "fitted to the heads' measured accuracies)")
    _check_sizes(num_heads, top_k)
    num_heads, top_k = int(num_heads), int(top_k)
    def needs(paths: list[Path]) -> tuple[int, int]:  # (heads, top_k)
        return tree_depth(paths), 1 + max(max(path) for path in paths)

    preset = TREE_PRESETS[name_or_paths]
    needed_heads, needed_top_k = needs(preset)
    if num_heads < needed_heads or top_k < needed_top_k:  # only what is unmet is named (top_k has no flag)
        unmet = [f"{needed_heads} heads, got num_heads={num_heads}"] if num_heads < needed_heads else []
        unmet += [f"top_k >= {needed_top_k}, got top_k={top_k}"] if top_k < needed_top_k else []
        fitting = [name for name, paths in TREE_PRESETS.items()
                   if needs(paths)[0] <= num_heads and needs(paths)[1] <= top_k]
        raise ValueError(f"tree preset {name_or_paths!r} needs {' and '.join(unmet)}; presets that fit these heads: "
                         f"{', '.join(fitting) or 'none'} (or fitted-N, the N-node tree fitted to their accuracies)")
    return validate_tree(preset, num_heads, top_k)


def root_only_tree(top_k: int = 1) -> TreeBuffers:
    """The empty tree: the root alone (plain decoding, one token a step)."""
    return TreeBuffers(
        paths=(),
        attn_mask=torch.ones(1, 1, dtype=torch.bool),
        depths=torch.zeros(1, dtype=torch.long),
        candidate_index=torch.zeros(1, dtype=torch.long),
        parents=torch.full((1,), -1, dtype=torch.long),
        children=torch.full((1, 1), -1, dtype=torch.long),
        retrieve_indices=torch.zeros(1, 1, dtype=torch.long),
        num_nodes=1,
        max_depth=0,
        top_k=top_k,
    )
