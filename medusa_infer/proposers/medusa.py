"""Medusa heads as a proposer: the heads' top-k tokens, arranged as a candidate tree."""

from __future__ import annotations

from typing import Sequence

import torch

from medusa_infer.adaptive import TreeController
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
    """Proposes a tree over the heads' top-k candidates at the last accepted position.

    Args:
        model: a ``MedusaModel``.
        tree: validated paths (an empty list means plain decoding: the root alone).
        controller: optional adaptive controller; it then picks, every step, one of its ladder's
            nested trees (plain decoding included) and ``tree`` is ignored.
    """

    def __init__(self, model, tree: Sequence[Sequence[int]], controller: TreeController | None = None) -> None:
        self.model = model
        self.controller = controller
        num_heads = max(model.config.num_heads if model.heads is not None else 0, 1)
        ladder = controller.ladder if controller is not None else [list(tree)]
        self.trees = [TreeCache(t, num_heads, _top_k(t), model.device) for t in ladder]
        self.hidden: torch.Tensor | None = None  # [batch, hidden] at the last accepted position
        self.rung = 0

    def _candidates(self, cache: TreeCache, depth: int) -> torch.Tensor:
        """``[batch, depth * top_k]`` token ids: the heads' top-k, head after head."""
        logits = self.model.head_logits(self.hidden)[:depth]  # [depth, batch, head_vocab]
        ids = logits.topk(cache.top_k, dim=-1).indices
        return self.model.heads.to_full_vocab(ids).transpose(0, 1).flatten(1)

    def start(self, context: StepContext, hidden: torch.Tensor) -> None:
        self.hidden = hidden

    def propose(self, roots: torch.Tensor, context: StepContext) -> Proposal:
        self.rung = self.controller.choose() if self.controller is not None else 0
        cache = self.trees[self.rung]
        tree = cache.at_depth(min(context.max_depth, cache.full.max_depth))
        if tree.max_depth == 0:
            return Proposal(roots[:, None], tree)
        flat = torch.cat([roots[:, None], self._candidates(cache, tree.max_depth)], dim=1)
        return Proposal(flat[:, tree.candidate_index], tree)

    def observe(self, accepted: list[list[int]], hidden: torch.Tensor, context: StepContext) -> None:
        self.hidden = hidden
        if self.controller is not None:
            self.controller.observe(self.rung, sum(len(a) - 1 for a in accepted) / len(accepted))

    def select_rows(self, rows: torch.Tensor) -> None:
        self.hidden = self.hidden.index_select(0, rows)

    def merge(self, other: "MedusaProposer") -> None:
        """Append the rows of another proposer of the same trees (batches joining)."""
        if [t.paths for t in other.trees] != [t.paths for t in self.trees]:
            raise ValueError("cannot merge Medusa proposers with different trees")
        self.hidden = torch.cat([self.hidden, other.hidden])


def _top_k(tree: Sequence[Sequence[int]]) -> int:
    return max((rank for path in tree for rank in path), default=0) + 1
