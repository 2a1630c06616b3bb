"""The contract between proposers and the verifier.

A proposer suggests candidate tokens after the current root (the last emitted token, not yet in
the target's KV cache) as a tree of ``n`` nodes, node 0 being the root itself. The verifier runs
the target once over the tree, an acceptance rule picks the accepted path, and the proposer is
told what was committed. A chain (draft model, prompt lookup) is a tree with one child per node.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from medusa_infer.trees import TreeBuffers, build_tree_buffers, root_only_tree


def whole_number(name: str, value: Any, minimum: int, note: str = "") -> int:
    """``value`` as an int, for a count setting (a draft's length, an n-gram's): ``ValueError`` naming ``name``
    for one that is no integer (2.5 failed mid-decoding with a TypeError, after tokens were streamed) or below
    ``minimum``."""
    from medusa_infer.decoding import _integer  # (decoding imports this module: here, not at its top)

    number = _integer(value)  # an int, numpy's, a 0-d integer tensor; not a bool
    if number is not None and number >= minimum:
        return number
    raise ValueError(f"{name} must be an integer >= {minimum}{note}, got {value!r}")


@dataclass
class Proposal:
    """Candidates for one step.

    Attributes:
        tokens: ``[batch, n]`` token at each tree node; column 0 holds the roots.
        tree: the tree's buffers (one shape for the whole batch), on the model's device.
        draft_probs: ``[batch, n - 1, vocab]`` draft distribution each chain token was sampled
            from, for stochastic drafts verified with ``min(1, p/q)``; None for deterministic ones.
        fallback: an adaptive controller chose plain decoding for this step (counted in
            ``GenerationMetrics.fallback_steps``).
        row_depths: per row, the deepest node holding a candidate of its own, where rows of a batch drafted
            chains of other lengths, padded to one (``lookup.pad_drafts``): the padding is verified, but counted
            as offered (``GenerationMetrics.offered_by_depth``) only where accepted. None: the tree's depth.
    """

    tokens: torch.Tensor
    tree: TreeBuffers
    draft_probs: torch.Tensor | None = None
    fallback: bool = False
    row_depths: list[int] | None = None


@dataclass
class StepContext:
    """What a proposer may read when proposing or observing.

    Attributes:
        sequences: per active row, the token history (prompt and output, no padding): in
            ``start``, the prompt alone (the first root is not chosen yet); in ``propose``, all of
            it, the current roots included; in ``observe``, as it was in that step's ``propose``
            (the tokens just accepted are ``observe``'s ``accepted``, not yet appended).
        max_depth: deepest candidate the target can still verify this step (context and
            ``max_new_tokens`` limits); proposals must not exceed it.
        target_kv: in ``start`` alone, the target's ``KVState`` after the prefill (its slots hold
            the prompts' keys and values); a proposer whose draft runs the target's own first
            layers copies them from it instead of computing them again. Read only; None elsewhere.
        samplings: per active row, how the verifier chooses its tokens (a ``decoding.SamplingConfig``;
            rows of one batch may differ), so that a draft can sample each row from the warped
            distribution its verification uses. Empty: draft deterministically.
    """

    sequences: list[list[int]]
    max_depth: int
    target_kv: Any = None
    samplings: list[Any] = field(default_factory=list)


Setting = TypeVar("Setting", bound=Hashable)


def row_groups(settings: Sequence[Setting]) -> list[tuple[Setting, list[int]]]:
    """The rows of each distinct setting in ``settings`` (one per row), settings in the order they first
    appear: ``["a", "b", "a"]`` gives ``[("a", [0, 2]), ("b", [1])]``. A batch whose rows sample
    differently applies each rule to its own rows' slice."""
    groups: dict[Setting, list[int]] = {}
    for row, setting in enumerate(settings):
        groups.setdefault(setting, []).append(row)
    return list(groups.items())


@runtime_checkable
class Proposer(Protocol):
    """What the decoding loop needs from a proposer; all state lives in the proposer object,
    which belongs to one generation call.

    A proposer may also define ``configure(generator)``: the loop then calls it once, before
    ``start``, with its random generator, from which a draft samples the rows whose
    ``StepContext.samplings`` sample losslessly (reporting the distributions as ``draft_probs``).
    """

    def start(self, context: StepContext, hidden: torch.Tensor) -> None:
        """Called after the prefill; ``hidden`` ``[batch, hidden]`` is the target's final hidden
        state at each row's last prompt token."""

    def propose(self, roots: torch.Tensor, context: StepContext) -> Proposal:
        """Candidates after ``roots`` ``[batch]``."""

    def observe(self, accepted: list[list[int]], hidden: torch.Tensor, context: StepContext) -> None:
        """After verification: ``accepted[row]`` are the tokens committed this step (the accepted
        candidates and the new root); ``hidden`` ``[batch, hidden]`` is the target's hidden state
        at the last accepted node."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the rows ``rows`` ``[k]`` (the others finished)."""


class ChainTrees:
    """Chain trees (one candidate per depth, for draft models and prompt lookup) by depth, each
    built once on ``device``; depth 0 is the root alone."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._by_depth: dict[int, TreeBuffers] = {}

    def at_depth(self, depth: int) -> TreeBuffers:
        if depth not in self._by_depth:
            if depth == 0:
                tree = root_only_tree()
            else:
                tree = build_tree_buffers([(0,) * d for d in range(1, depth + 1)], depth, 1)
            self._by_depth[depth] = tree.to(self.device)
        return self._by_depth[depth]
