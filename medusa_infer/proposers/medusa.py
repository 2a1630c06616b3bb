"""Medusa heads as a proposer: the heads' top-k tokens, arranged as a candidate tree."""

from __future__ import annotations

from typing import Sequence

import torch

from medusa_infer.proposers.base import Proposal, StepContext
from medusa_infer.trees import TreeBuffers, build_tree_buffers, root_only_tree


class TreeCache:
    """A tree's buffers and its depth-limited sub-trees (near the end of the context or of
    ``max_new_tokens``), built once per depth and moved to the model's device."""

    def __init__(self, paths: Sequence[Sequence[int]], num_heads: int, top_k: int, device: torch.device) -> None:
        self.paths = [tuple(p) for p in paths]
        self.num_heads, self.top_k, self.device = num_heads, top_k, device
        self._by_depth: dict[int, TreeBuffers] = {}
        self.full = self.at_depth(max((len(p) for p in self.paths), default=0))

    def at_depth(self, depth: int) -> TreeBuffers:
        if depth not in self._by_depth:
            paths = [p for p in self.paths if len(p) <= depth]
            buffers = build_tree_buffers(paths, self.num_heads, self.top_k) if paths else root_only_tree(self.top_k)
            self._by_depth[depth] = buffers.to(self.device)
        return self._by_depth[depth]


class MedusaProposer:
    """Proposes ``tree`` over the heads' top-k candidates at the last accepted position.

    Args:
        model: a ``MedusaModel``.
        tree: validated paths (an empty list means plain decoding: the root alone).
    """

    def __init__(self, model, tree: Sequence[Sequence[int]]) -> None:
        self.model = model
        num_heads = model.config.num_heads if model.heads is not None else 0
        self.trees = TreeCache(tree, max(num_heads, 1), _top_k(tree), model.device)
        self.topk: torch.Tensor | None = None  # [batch, heads, top_k] token ids

    def _update(self, hidden: torch.Tensor) -> None:
        if self.trees.full.max_depth == 0:
            return
        depth, k = self.trees.full.max_depth, self.trees.top_k
        logits = self.model.head_logits(hidden)[:depth]  # [depth, batch, head_vocab]
        ids = logits.topk(k, dim=-1).indices
        self.topk = self.model.heads.to_full_vocab(ids).transpose(0, 1)

    def start(self, context: StepContext, hidden: torch.Tensor) -> None:
        self._update(hidden)

    def propose(self, roots: torch.Tensor, context: StepContext) -> Proposal:
        tree = self.trees.at_depth(min(context.max_depth, self.trees.full.max_depth))
        if tree.max_depth == 0:
            return Proposal(roots[:, None], tree)
        flat = torch.cat([roots[:, None], self.topk[:, : tree.max_depth].flatten(1)], dim=1)
        return Proposal(flat[:, tree.candidate_index], tree)

    def observe(self, accepted: list[list[int]], hidden: torch.Tensor, context: StepContext) -> None:
        self._update(hidden)

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.topk is not None:
            self.topk = self.topk.index_select(0, rows)

    def merge(self, other: "MedusaProposer") -> None:
        """Append the rows of another proposer of the same tree (batches joining)."""
        if other.trees.paths != self.trees.paths:
            raise ValueError("cannot merge Medusa proposers with different trees")
        if self.topk is not None:
            self.topk = torch.cat([self.topk, other.topk])


def _top_k(tree: Sequence[Sequence[int]]) -> int:
    return max((rank for path in tree for rank in path), default=0) + 1
