"""Medusa heads as a proposer: the heads' top-k tokens, arranged as a candidate tree.

Optionally (``lookup_tokens > 0``) a prompt-lookup chain is grafted onto the tree as one more
branch from the root: the tokens that followed the most recent earlier occurrence of the text's
last n-gram (``proposers.lookup.find_match``). Heads guess the next tokens from the hidden
state; lookup copies them from the context (summaries, rewrites, code edits, repetition). Both
branches are verified in the same forward pass, so the step accepts whichever goes further, and
the acceptance rules stay exact (greedy) and lossless (sampling): the lookup tokens are
deterministic candidates like the heads' top-k.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Hashable
from typing import Sequence

import torch

from medusa_infer.adaptive import TreeController, reached_shares
from medusa_infer.datastore import Datastore
from medusa_infer.proposers.base import Proposal, StepContext, whole_number
from medusa_infer.proposers.lookup import (
    LOOKUP_MAX_TOKENS,
    LookupGate,
    checked_datastore,
    gated_matches,
    model_cost,
    pad_drafts,
    record_matches,
    row_kinds,
)
from medusa_infer.trees import (
    ExpansionLevel,
    TreeBuffers,
    build_tree_buffers,
    expansion_plan,
    root_only_tree,
    tree_depth,
)


class TreeCache:
    """A tree's buffers and its depth-limited sub-trees (near the end of the context or of
    ``max_new_tokens``), built once per depth and moved to the model's device. Read only once built:
    proposers of one tree share one (``tree_cache``)."""

    def __init__(self, paths: Sequence[Sequence[int]], num_heads: int, top_k: int, device: torch.device) -> None:
        self.paths = [tuple(p) for p in paths]
        self.num_heads, self.top_k, self.device = num_heads, top_k, device
        self._by_depth: dict[tuple[int, int], TreeBuffers] = {}
        self._plans: dict[tuple[int, int], list[ExpansionLevel]] = {}
        self._chains: dict[tuple[int, int], torch.Tensor] = {}
        self._heads_children: dict[tuple[int, int], list[list[int]]] = {}
        self.full = self.at_depth(tree_depth(self.paths))

    def chain_nodes(self, depth: int, chain: int) -> torch.Tensor:
        """``[chain]`` node indices of the grafted chain in ``at_depth(depth, chain)``, root side first."""
        if (depth, chain) not in self._chains:
            node_of = {path: i + 1 for i, path in enumerate(self.at_depth(depth, chain).paths)}
            self._chains[depth, chain] = torch.tensor([node_of[(self.top_k,) * d] for d in range(1, chain + 1)],
                                                      dtype=torch.long, device=self.device)
        return self._chains[depth, chain]

    def heads_children(self, depth: int, chain: int) -> list[list[int]]:
        """Per node of ``at_depth(depth, chain)`` (0: the root), its children among the heads'
        nodes, the grafted chain's left out."""
        if (depth, chain) not in self._heads_children:
            paths = self.at_depth(depth, chain).paths
            node_of = {path: i + 1 for i, path in enumerate(paths)}
            children: list[list[int]] = [[] for _ in range(len(paths) + 1)]
            for path in paths:
                if max(path) < self.top_k:  # the chain's nodes sit at rank top_k
                    children[node_of[path[:-1]] if len(path) > 1 else 0].append(node_of[path])
            self._heads_children[depth, chain] = children
        return self._heads_children[depth, chain]

    def plan(self, depth: int, chain: int = 0) -> list[ExpansionLevel]:
        """How heads that read their path fill ``at_depth(depth, chain)``'s heads' nodes."""
        if (depth, chain) not in self._plans:
            levels = expansion_plan(self.at_depth(depth, chain), self.top_k)
            self._plans[depth, chain] = [level.to(self.device) for level in levels]
        return self._plans[depth, chain]

    def at_depth(self, depth: int, chain: int = 0) -> TreeBuffers:
        """The paths no deeper than ``depth``; with ``chain`` > 0 also a chain of that many nodes
        under the root at the extra rank ``top_k`` (the grafted lookup branch), so candidates are
        laid out ``top_k + 1`` per depth."""
        if (depth, chain) not in self._by_depth:
            paths = [p for p in self.paths if len(p) <= depth]
            if chain:
                paths += [(self.top_k,) * d for d in range(1, chain + 1)]
                buffers = build_tree_buffers(paths, max(self.num_heads, chain), self.top_k + 1)
            else:
                buffers = build_tree_buffers(paths, self.num_heads, self.top_k) if paths else root_only_tree(self.top_k)
            self._by_depth[depth, chain] = buffers.to(self.device)
        return self._by_depth[depth, chain]


@functools.lru_cache(maxsize=64)
def _shared_tree_cache(paths: tuple[tuple[int, ...], ...], num_heads: int, top_k: int, device: torch.device
                       ) -> TreeCache:
    return TreeCache(paths, num_heads, top_k, device)


def tree_cache(paths: Sequence[Sequence[int]], num_heads: int, top_k: int, device: torch.device) -> TreeCache:
    """The ``TreeCache`` of ``paths``, built once and shared: a proposer is built for every server batch and chat
    turn, and building an adaptive ladder's buffers took 1.4 ms (a 16-node tree) to 4 ms (64 nodes) on a 2-core
    CPU each time."""
    return _shared_tree_cache(tuple(tuple(int(i) for i in p) for p in paths), num_heads, top_k, torch.device(device))


class MedusaProposer:
    """Proposes a tree over the heads' top-k candidates at the last accepted position.

    Args:
        model: a ``MedusaModel``.
        tree: validated paths (an empty list means plain decoding: the root alone).
        controller: optional adaptive controller; it then picks, every step, one of its ladder's
            nested trees (plain decoding included) and ``tree`` is ignored. It learns the heads'
            acceptance: on a step with a lookup branch, how far the accepted tokens run along the
            heads' own nodes. Under greedy decoding that is what the heads' tree alone would have
            accepted, and under lossless sampling it is distributed as that (the verifier tries
            the heads' nodes before the chain's); under typical acceptance, which keeps the
            longest of several accepted branches, it can fall short of it. Step seconds it learns
            only from steps without one.
        lookup_tokens: graft a prompt-lookup chain onto the tree, of this many tokens at most
            without a cost profile (0: heads only). Rows of a batch share the chain's length; a
            shorter draft is padded with its last token, an ordinary candidate the verifier accepts
            or rejects.
        lookup_ngram: ``(max_ngram, min_ngram)`` for the lookup search.
        lookup_max_tokens: the longest chain the cost gate may choose.
        datastore: also draft the lookup chain from this store of the model's earlier answers
            (``proposers.lookup.gated_matches`` chooses between the two sources).

    With a measured cost profile in the heads' config, ``proposers.lookup.LookupGate`` chooses each
    lookup draft's length, up to ``lookup_max_tokens``, from its n-gram length's acceptance so far
    and the cost of its extra nodes, or leaves it out. With an adaptive controller the chain is
    weighed against the tokens the controller expects from the heads' tree, which it partly hides.
    """

    def __init__(self, model, tree: Sequence[Sequence[int]], controller: TreeController | None = None,
                 lookup_tokens: int = 0, lookup_ngram: tuple[int, int] = (3, 1),
                 lookup_max_tokens: int = LOOKUP_MAX_TOKENS, datastore: Datastore | None = None) -> None:
        lookup_tokens = whole_number("lookup_tokens", lookup_tokens, 0, " (0 turns the lookup branch off)")
        lookup_ngram = (whole_number("lookup max_ngram", lookup_ngram[0], 1),
                        whole_number("lookup min_ngram", lookup_ngram[1], 1))
        if not lookup_ngram[1] <= lookup_ngram[0]:
            raise ValueError(f"lookup_ngram must be (max_ngram, min_ngram) with 1 <= min <= max, got {lookup_ngram}")
        self.model = model
        self.controller = controller
        lookup_max_tokens = whole_number("lookup_max_tokens", lookup_max_tokens, 1)
        self.lookup_tokens, self.lookup_ngram, self.lookup_max_tokens = lookup_tokens, lookup_ngram, lookup_max_tokens
        self.datastore = checked_datastore(model, datastore)
        self.grafted = 0  # length of the lookup chain in the last proposal
        self.grafted_tokens: torch.Tensor | None = None  # [batch, n] that proposal's node tokens
        cost = model_cost(model) if lookup_tokens else None
        self.gate = LookupGate(cost) if cost is not None else None
        self.matches: list[tuple[Hashable, list[int]]] = []
        num_heads = max(model.config.num_heads if model.heads is not None else 0, 1)
        # heads reading their candidate path fill the tree node by node (``_expand``)
        self.path_heads = model.heads is not None and model.config.path_input
        ladder = controller.ladder if controller is not None else [list(tree)]
        scored = model.config.head_vocab_size if model.heads is not None else None
        if scored is not None and max(map(_top_k, ladder)) > scored:  # topk failed mid-decoding
            raise ValueError(f"the tree takes rank {max(map(_top_k, ladder)) - 1} of a head, but the heads score "
                             f"{scored} tokens: use a tree whose ranks are below {scored}")
        self.trees = [tree_cache(t, num_heads, _top_k(t), model.device) for t in ladder]
        self.hidden: torch.Tensor | None = None  # [batch, hidden] at the last accepted position
        self.rung = 0
        self.started = 0.0  # perf_counter() at the last propose()
        self.truncated = False  # whether the last proposal was cut below its rung's depth
        self.shadow: torch.Tensor | None = None  # [batch, n] head 1's first-level candidates, plain steps

    def _candidates(self, cache: TreeCache, depth: int, roots: torch.Tensor) -> torch.Tensor:
        """``[batch, depth * top_k]`` token ids: the first ``depth`` heads' top-k, head after head
        (heads that read the next token read the roots); the heads below ``depth`` do not run."""
        logits = self.model.head_logits(self.hidden, roots, first=depth)  # [depth, batch, head_vocab]
        ids = logits.topk(cache.top_k, dim=-1).indices
        return self.model.heads.to_full_vocab(ids).transpose(0, 1).flatten(1)

    def _expand(self, cache: TreeCache, depth: int, chain: int, roots: torch.Tensor) -> torch.Tensor:
        """``[batch, n]`` node tokens of ``cache.at_depth(depth, chain)`` for heads that read their
        candidate path: depth after depth, each parent's head runs on that parent's own path and its
        children take that head's top-k. Nodes of a grafted chain are left 0 for the caller."""
        tree = cache.at_depth(depth, chain)
        batch, width = roots.shape[0], self.hidden.shape[-1]
        tokens = roots.new_zeros(batch, tree.num_nodes)
        tokens[:, 0] = roots
        for level in cache.plan(depth, chain):
            parents = len(level.parents)
            logits = self.model.head_logits(self.hidden[:, None].expand(batch, parents, width),
                                            roots[:, None].expand(batch, parents), first=level.depth,
                                            start=level.depth - 1, path_tokens=tokens[:, level.ancestors])[0]
            top = logits.topk(level.top_k, dim=-1).indices  # [batch, parents, k]
            tokens[:, level.nodes] = self.model.heads.to_full_vocab(top[:, level.slot, level.ranks])
        return tokens

    def start(self, context: StepContext, hidden: torch.Tensor) -> None:
        self.hidden = hidden

    def propose(self, roots: torch.Tensor, context: StepContext) -> Proposal:
        self.started = time.perf_counter()  # the step's seconds, to observe(), for the controller's step costs
        # a step held to its root (a serving gate's plain step, the context's last token) is not the
        # controller's to choose: it would spend the probe or neighbour step due on it, cut to nothing
        chosen = self.controller is not None and context.max_depth > 0
        # priced over the longest row's history, which the batch's cache holds for every row
        self.rung = self.controller.choose(len(context.sequences), max(map(len, context.sequences))) if chosen else 0
        proposal = self._propose(roots, context)
        proposal.fallback = chosen and self.rung == 0
        if not chosen:  # nor does it teach the controller anything (no step time; no shadow: _propose)
            self.truncated = True
        return proposal

    def _propose(self, roots: torch.Tensor, context: StepContext) -> Proposal:
        cache = self.trees[self.rung]
        depth = min(context.max_depth, cache.full.max_depth)
        # A cut tree (the context's end, or a serving gate's plain step) says nothing about the
        # heads' acceptance on the rung's whole tree: the controller does not learn from it.
        self.truncated = depth < cache.full.max_depth
        drafts = self._lookup(context, cache, depth)
        self.grafted = max((len(d) for d in drafts), default=0)
        self.shadow = self._shadow(roots) if self.rung == 0 and context.max_depth > 0 else None
        if self.grafted:
            return self._graft(roots, cache, depth, drafts)
        tree = cache.at_depth(depth)
        if tree.max_depth == 0:
            return Proposal(roots[:, None], tree)
        if self.path_heads:
            return Proposal(self._expand(cache, depth, 0, roots), tree)
        flat = torch.cat([roots[:, None], self._candidates(cache, tree.max_depth, roots)], dim=1)
        return Proposal(flat[:, tree.candidate_index], tree)

    def _shadow(self, roots: torch.Tensor) -> torch.Tensor | None:
        """On a plain step, head 1's candidates at the controller's largest tree's first level,
        ``[batch, n]``: the next token shows whether that tree would have gone past its root."""
        ranks = self.controller.first_level_ranks if self.controller is not None else []
        if not ranks or self.model.heads is None:
            return None
        logits = self.model.head_logits(self.hidden, roots, first=1)[0]  # [batch, head_vocab]
        ids = logits.topk(ranks[-1] + 1, dim=-1).indices[:, ranks]
        return self.model.heads.to_full_vocab(ids)

    def _lookup(self, context: StepContext, cache: TreeCache, depth: int) -> list[list[int]]:
        limit = min(self.lookup_tokens if self.gate is None else self.lookup_max_tokens, context.max_depth)
        if not self.lookup_tokens or limit <= 0:
            self.matches = []
            return []
        longest, shortest = self.lookup_ngram
        heads = self.controller.expected_accepted(self.rung) if self.controller is not None else 0.0
        self.matches = gated_matches(context.sequences, longest, shortest, limit, self.gate,
                                     base=cache.at_depth(depth).num_nodes, datastore=self.datastore,
                                     heads=heads if depth == cache.full.max_depth else 0.0, kinds=row_kinds(context))
        return [draft for _, draft in self.matches]

    def _graft(self, roots: torch.Tensor, cache: TreeCache, depth: int, drafts: list[list[int]]) -> Proposal:
        """The heads' tree (to ``depth``) plus the lookup chain at the extra rank ``top_k``."""
        chain = self.grafted
        tree = cache.at_depth(depth, chain)
        k, batch = cache.top_k, roots.shape[0]
        draft = torch.tensor(pad_drafts(drafts, roots.tolist(), chain), dtype=torch.long, device=roots.device)
        heads_depth = tree_depth(p for p in cache.paths if len(p) <= depth)
        row_depths = [max(heads_depth, len(d)) for d in drafts]  # past the heads' nodes, a row's own chain's
        if self.path_heads:
            tokens = self._expand(cache, depth, chain, roots)
            tokens[:, cache.chain_nodes(depth, chain)] = draft
            self.grafted_tokens = tokens
            return Proposal(tokens, tree, row_depths=row_depths)
        grid = torch.zeros(batch, tree.max_depth, k + 1, dtype=torch.long, device=roots.device)
        if heads_depth:
            grid[:, :heads_depth, :k] = self._candidates(cache, heads_depth, roots).view(batch, heads_depth, k)
        grid[:, :chain, k] = draft
        flat = torch.cat([roots[:, None], grid.flatten(1)], dim=1)
        self.grafted_tokens = flat[:, tree.candidate_index]
        return Proposal(self.grafted_tokens, tree, row_depths=row_depths)

    def observe(self, accepted: list[list[int]], hidden: torch.Tensor, context: StepContext) -> None:
        self.hidden = hidden
        record_matches(self.gate, self.matches, accepted)
        if self.controller is not None and len(accepted) == 1 and not self.grafted and not self.truncated:
            self.controller.observe_seconds(self.rung, time.perf_counter() - self.started)
        if self.shadow is not None:  # the first token after the root is the next one, accepted or not
            following = torch.tensor([a[0] for a in accepted], device=self.shadow.device)
            self.controller.observe_shadow(float((self.shadow == following[:, None]).any(1).float().mean()))
            self.shadow = None
        elif self.controller is not None and self.rung and not self.truncated:
            counts = self._heads_accepted(accepted) if self.grafted else [len(a) - 1 for a in accepted]
            self.controller.observe(self.rung, reached_shares(counts, len(self.controller.reach_cal[self.rung])))
        self.grafted_tokens = None

    def _heads_accepted(self, accepted: list[list[int]]) -> list[int]:
        """Per row of the last (grafted) step, how many of its accepted tokens the heads' own
        nodes hold in a row from the root: a path along them, the lookup chain's left out."""
        cache = self.trees[self.rung]
        children = cache.heads_children(cache.full.max_depth, self.grafted)  # observed steps are not cut
        counts = []
        for row, tokens in zip(self.grafted_tokens.tolist(), accepted):
            node, count = 0, 0
            for token in tokens[:-1]:  # the last is the step's bonus token, no node's
                node = next((c for c in children[node] if row[c] == token), -1)
                if node < 0:
                    break
                count += 1
            counts.append(count)
        return counts

    def select_rows(self, rows: torch.Tensor) -> None:
        self.hidden = self.hidden.index_select(0, rows)

    def merge(self, other: "MedusaProposer") -> None:
        """Append the rows of another proposer of the same trees (batches joining)."""
        if [t.paths for t in other.trees] != [t.paths for t in self.trees]:
            raise ValueError("cannot merge Medusa proposers with different trees")
        if (other.lookup_tokens, other.lookup_ngram, other.lookup_max_tokens) != (
                self.lookup_tokens, self.lookup_ngram, self.lookup_max_tokens) or other.datastore is not self.datastore:
            raise ValueError("cannot merge Medusa proposers with different lookup settings")
        self.hidden = torch.cat([self.hidden, other.hidden])
        if self.gate is not None and other.gate is not None:
            self.gate.merge(other.gate)


def _top_k(tree: Sequence[Sequence[int]]) -> int:
    return max((rank for path in tree for rank in path), default=0) + 1
