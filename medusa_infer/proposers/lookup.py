"""Prompt lookup as a proposer: continue the text the way it continued before.

Each step, for every row, the longest suffix of its history (prompt and output, ``max_ngram``
tokens down to ``min_ngram``) is searched earlier in that history; the tokens that followed its
most recent earlier occurrence (at most ``num_tokens``) are proposed as a chain. No model runs,
and the drafts are deterministic, so the verifier's tree rules apply unchanged: greedy stays
exact and lossless sampling stays lossless. A row without a match proposes nothing; when no row
matches, the step is plain decoding (the root alone).

Rows of a batch share one chain: a row whose draft is shorter than the longest is padded with
its last token, an ordinary (deterministic) candidate that the verifier accepts or rejects.

With a measured cost profile (``LookupGate``), a draft is only verified when the acceptance seen
so far for matches of its n-gram length pays for the extra tokens in the forward pass: on a CPU,
verifying 2 to 16 tokens costs ~1.5-1.7x one token, so a 1-gram match that is usually wrong makes
decoding slower, while on a GPU almost every match pays.
"""

from __future__ import annotations

import torch

from medusa_infer.proposers.base import ChainTrees, Proposal, StepContext
from medusa_infer.tree_fit import CostProfile


def find_match(history: list[int], max_ngram: int, min_ngram: int, limit: int) -> tuple[int, list[int]]:
    """``(n, continuation)``: up to ``limit`` tokens that followed the most recent earlier
    occurrence of the longest suffix of ``history`` (``n`` tokens, between ``max_ngram`` and
    ``min_ngram``); ``(0, [])`` if none."""
    if limit <= 0:
        return 0, []
    length = len(history)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = history[length - n:]
        first = suffix[0]
        for start in range(length - n - 1, -1, -1):  # an occurrence that has a continuation
            if history[start] == first and history[start : start + n] == suffix:
                return n, history[start + n : start + n + limit]
    return 0, []


def pad_drafts(drafts: list[list[int]], roots: list[int], length: int) -> list[list[int]]:
    """Each row's draft padded to ``length`` with its last token (the root's for an empty draft):
    rows of a batch share one chain, and a padding token is an ordinary candidate."""
    return [d + [(d or [r])[-1]] * (length - len(d)) for d, r in zip(drafts, roots)]


class LookupGate:
    """Decides, per draft, whether verifying it is expected to pay under a cost profile.

    For each matched n-gram length it keeps the tokens accepted per verified draft (starting from an
    optimistic prior of ``prior`` tokens, weighted as ``prior_weight`` drafts). A draft of ``L``
    tokens added to a forward of ``base`` tokens per row, in a batch of ``B`` rows, is verified when
    ``1 + expected accepted >= t(B * (base + L)) / t(B * base)`` (the rows share one forward); a
    refused n-gram length is still tried every ``probe_every``-th time, so the estimate recovers
    when the text turns repetitive.

    Args:
        cost: the device's verification cost (``MedusaConfig.cost_profile``).
        prior, prior_weight: the optimistic start.
        probe_every: how often a refused length is verified anyway.
    """

    def __init__(self, cost: CostProfile, prior: float = 1.0, prior_weight: float = 2.0, probe_every: int = 8) -> None:
        self.cost, self.prior, self.prior_weight, self.probe_every = cost, prior, prior_weight, probe_every
        self.drafts: dict[int, int] = {}
        self.accepted: dict[int, int] = {}
        self.refused: dict[int, int] = {}

    def expected(self, n: int) -> float:
        """Expected accepted tokens of a draft after an ``n``-gram match."""
        return (self.accepted.get(n, 0) + self.prior * self.prior_weight) / (self.drafts.get(n, 0) + self.prior_weight)

    def allow(self, n: int, length: int, base: int = 1, batch: int = 1) -> bool:
        if length <= 0:
            return False
        if 1 + self.expected(n) >= self.cost.ratio(batch * (base + length)) / self.cost.ratio(batch * base):
            return True
        self.refused[n] = self.refused.get(n, 0) + 1
        return self.refused[n] % self.probe_every == 0

    def record(self, n: int, accepted: int) -> None:
        """A draft after an ``n``-gram match was verified and ``accepted`` of its tokens kept."""
        self.drafts[n] = self.drafts.get(n, 0) + 1
        self.accepted[n] = self.accepted.get(n, 0) + accepted


def accepted_prefix(draft: list[int], committed: list[int]) -> int:
    """How many leading tokens of ``draft`` the step committed (its last token is the bonus)."""
    count = 0
    for proposed, kept in zip(draft, committed[:-1]):
        if proposed != kept:
            break
        count += 1
    return count


class LookupProposer:
    """N-gram prompt lookup (no draft model).

    Args:
        model: the target ``MedusaModel`` (only its device is read).
        num_tokens: at most this many tokens proposed a step (k).
        max_ngram: longest suffix searched for.
        min_ngram: shortest suffix searched for.
        cost: the device's verification cost; with it, drafts are gated by ``LookupGate``.
            Default: the heads' measured profile when the model has one, else no gating.
    """

    def __init__(self, model, num_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 1,
                 cost: CostProfile | None = None) -> None:
        if num_tokens < 1:
            raise ValueError(f"prompt lookup needs num_tokens >= 1, got {num_tokens}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.trees = ChainTrees(model.device)
        cost = cost if cost is not None else model_cost(model)
        self.gate = LookupGate(cost) if cost is not None else None
        self.matches: list[tuple[int, list[int]]] = []  # per row: the verified draft and its n-gram length

    def start(self, context: StepContext, hidden: torch.Tensor) -> None:
        pass

    def propose(self, roots: torch.Tensor, context: StepContext) -> Proposal:
        limit = min(self.num_tokens, context.max_depth)
        self.matches = gated_matches(context.sequences, self.max_ngram, self.min_ngram, limit, self.gate)
        drafts = [draft for _, draft in self.matches]
        depth = max((len(d) for d in drafts), default=0)
        tree = self.trees.at_depth(depth)
        if depth == 0:
            return Proposal(roots[:, None], tree)
        chain = torch.tensor(pad_drafts(drafts, roots.tolist(), depth), dtype=torch.long, device=roots.device)
        return Proposal(torch.cat([roots[:, None], chain], dim=1), tree)

    def observe(self, accepted: list[list[int]], hidden: torch.Tensor, context: StepContext) -> None:
        record_matches(self.gate, self.matches, accepted)

    def select_rows(self, rows: torch.Tensor) -> None:
        pass  # the histories come with each step's context: nothing kept per row

    def merge(self, other: "LookupProposer") -> None:
        pass


def model_cost(model) -> CostProfile | None:
    """The heads' measured verification cost, if ``model`` (a ``MedusaModel``) has one."""
    profile = getattr(getattr(model, "config", None), "cost_profile", None) if model.heads is not None else None
    return CostProfile.from_dict(profile) if profile else None


def gated_matches(sequences: list[list[int]], max_ngram: int, min_ngram: int, limit: int,
                  gate: LookupGate | None, base: int = 1) -> list[tuple[int, list[int]]]:
    """Per row ``(n, draft)``: the lookup draft, or ``(n, [])`` when ``gate`` refuses it (for a
    batch of ``len(sequences)`` rows, each verifying ``base`` tokens without the draft)."""
    out = []
    for history in sequences:
        n, draft = find_match(history, max_ngram, min_ngram, limit)
        if draft and gate is not None and not gate.allow(n, len(draft), base, len(sequences)):
            draft = []
        out.append((n, draft))
    return out


def record_matches(gate: LookupGate | None, matches: list[tuple[int, list[int]]], accepted: list[list[int]]) -> None:
    """Tell ``gate`` how far each verified draft was accepted."""
    if gate is None:
        return
    for (n, draft), committed in zip(matches, accepted):
        if draft:
            gate.record(n, accepted_prefix(draft, committed))
