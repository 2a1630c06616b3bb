"""Prompt lookup as a proposer: continue the text the way it continued before.

Each step, for every row, the longest suffix of its history (prompt and output, ``max_ngram``
tokens down to ``min_ngram``) is searched earlier in that history; the tokens that followed its
most recent earlier occurrence (at most ``num_tokens``) are proposed as a chain. No model runs,
and the drafts are deterministic, so the verifier's tree rules apply unchanged: greedy stays
exact and lossless sampling stays lossless. A row without a match proposes nothing; when no row
matches, the step is plain decoding (the root alone).

Rows of a batch share one chain: a row whose draft is shorter than the longest is padded with
its last token, an ordinary (deterministic) candidate that the verifier accepts or rejects.
"""

from __future__ import annotations

import torch

from medusa_infer.proposers.base import ChainTrees, Proposal, StepContext


def find_continuation(history: list[int], max_ngram: int, min_ngram: int, limit: int) -> list[int]:
    """Up to ``limit`` tokens that followed the most recent earlier occurrence of the longest
    suffix of ``history`` (between ``max_ngram`` and ``min_ngram`` tokens); ``[]`` if none."""
    if limit <= 0:
        return []
    length = len(history)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = history[length - n:]
        first = suffix[0]
        for start in range(length - n - 1, -1, -1):  # an occurrence that has a continuation
            if history[start] == first and history[start : start + n] == suffix:
                return history[start + n : start + n + limit]
    return []


class LookupProposer:
    """N-gram prompt lookup (no draft model).

    Args:
        model: the target ``MedusaModel`` (only its device is read).
        num_tokens: at most this many tokens proposed a step (k).
        max_ngram: longest suffix searched for.
        min_ngram: shortest suffix searched for.
    """

    def __init__(self, model, num_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if num_tokens < 1:
            raise ValueError(f"prompt lookup needs num_tokens >= 1, got {num_tokens}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.trees = ChainTrees(model.device)

    def start(self, context: StepContext, hidden: torch.Tensor) -> None:
        pass

    def propose(self, roots: torch.Tensor, context: StepContext) -> Proposal:
        limit = min(self.num_tokens, context.max_depth)
        drafts = [find_continuation(h, self.max_ngram, self.min_ngram, limit) for h in context.sequences]
        depth = max((len(d) for d in drafts), default=0)
        tree = self.trees.at_depth(depth)
        if depth == 0:
            return Proposal(roots[:, None], tree)
        rows = [[int(r)] + d + [(d or [int(r)])[-1]] * (depth - len(d)) for r, d in zip(roots.tolist(), drafts)]
        return Proposal(torch.tensor(rows, dtype=torch.long, device=roots.device), tree)

    def observe(self, accepted: list[list[int]], hidden: torch.Tensor, context: StepContext) -> None:
        pass

    def select_rows(self, rows: torch.Tensor) -> None:
        pass  # the histories come with each step's context: nothing kept per row

    def merge(self, other: "LookupProposer") -> None:
        pass
