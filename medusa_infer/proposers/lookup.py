"""Prompt lookup as a proposer: continue the text the way it continued before.

Each step, for every row, the longest suffix of its history (prompt and output, ``max_ngram``
tokens down to ``min_ngram``) is searched earlier in that history; the tokens that followed its
most recent earlier occurrence (``num_tokens``, a repeating stretch repeated on) are proposed as a chain. No model runs,
and the drafts are deterministic, so the verifier's tree rules apply unchanged: greedy stays
exact and lossless sampling stays lossless. A row without a match proposes nothing; when no row
matches, the step is plain decoding (the root alone).

Rows of a batch share one chain: a row whose draft is shorter than the longest is padded with
its last token, an ordinary (deterministic) candidate that the verifier accepts or rejects.

With a measured cost profile (``LookupGate``), the acceptance seen so far for matches of a draft's
n-gram length decides how many of its tokens to verify, if any: on a CPU verifying 2 to 16 tokens
costs 1.2-1.7x one token, so a 1-gram match that is usually wrong makes decoding slower while a
long run of correct matches pays for a long draft; on a GPU almost every match pays.

With a ``Datastore`` (the model's own earlier answers, ``medusa_infer.datastore``) each row also
gets the store's continuation of its text. Without a cost profile the longer match wins (the
prompt's on a tie); with one, the draft that pays better, each source's acceptance being measured
per n-gram length, and for the store also per confidence class (keys ``("prompt", n)`` and
``("datastore", n, confidence)``, see ``DatastoreMatch.confidence``), each followed by the row's acceptance rule
where the batch's rows say theirs (``row_kinds``: a sampled row's drafts are accepted far less than a greedy
row's beside it).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from medusa_infer.datastore import Datastore
from medusa_infer.proposers.base import ChainTrees, Proposal, StepContext, whole_number
from medusa_infer.speculation_gate import row_kind
from medusa_infer.tree_fit import CostProfile, warn_if_measured_elsewhere


def find_match(history: list[int], max_ngram: int, min_ngram: int, limit: int) -> tuple[int, list[int]]:
    """``(n, continuation)``: ``limit`` tokens that followed the most recent earlier occurrence of the
    longest suffix of ``history`` (``n`` tokens, between ``max_ngram`` and ``min_ngram``); ``(0, [])``
    if none. Where that occurrence overlaps the suffix (a stretch repeating with a period shorter than
    ``limit``: "7 7 7", "a b a b"), the continuation runs on into itself, as the repetition would,
    instead of stopping at the end of the history after a period's worth."""
    if limit <= 0:
        return 0, []
    length = len(history)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = history[length - n:]
        first = suffix[0]
        for start in range(length - n - 1, -1, -1):  # an occurrence that has a continuation
            if history[start] == first and history[start : start + n] == suffix:
                draft = history[start + n : start + n + limit]
                while len(draft) < limit:  # copied on from the draft itself: history + draft repeats
                    draft.append(draft[start + n + len(draft) - length])
                return n, draft
    return 0, []


def pad_drafts(drafts: list[list[int]], roots: list[int], length: int) -> list[list[int]]:
    """Each row's draft padded to ``length`` with its last token (the root's for an empty draft):
    rows of a batch share one chain, and a padding token is an ordinary candidate."""
    return [d + [(d or [r])[-1]] * (length - len(d)) for d, r in zip(drafts, roots)]


LOOKUP_MAX_TOKENS = 16  # the longest draft a cost gate may choose to verify


class LookupGate:
    """Chooses, per draft, how many of its tokens to verify under a cost profile (0: none).

    For each kind of match ``key`` (in the proposers: ``("prompt", n)`` or ``("datastore", n,
    confidence)``, the draft's source, its matched n-gram length and, for the store, its
    ``DatastoreMatch.confidence``) it estimates ``p``, the chance that a draft token is
    accepted once the tokens before it were: accepted tokens / (accepted tokens + drafts stopped by
    a rejection), a geometric model that also counts drafts cut short by their own end, starting
    from an optimistic prior (``prior_rate``, weighted as ``prior_weight`` tokens). A draft of
    ``L`` tokens is then expected to add ``E(L) = p + p^2 + ... + p^L`` tokens to the step's one;
    added to a forward of ``base`` tokens per row, in a batch of ``B`` rows, it costs
    ``t(B * (base + L)) / t(B * base)`` (the rows share one forward) over the cached tokens the step
    attends over (``CostProfile.ratio``). The gate verifies the ``L``
    (up to the match's length) with the most expected tokens per unit of cost, when that is at least
    plain decoding's: long drafts where matches keep being right, short ones or none where they are
    not. A refused n-gram length is still tried every ``probe_every``-th time, so the estimate
    recovers when the text turns repetitive.

    Args:
        cost: the device's verification cost (``MedusaConfig.cost_profile``).
        prior_rate, prior_weight: the optimistic start.
        probe_every: how often a refused length is verified anyway.
    """

    def __init__(self, cost: CostProfile, prior_rate: float = 0.5, prior_weight: float = 2.0,
                 probe_every: int = 8) -> None:
        self.cost, self.prior_rate, self.prior_weight, self.probe_every = cost, prior_rate, prior_weight, probe_every
        self.drafts: dict[Hashable, int] = {}  # verified drafts per kind of match
        self.accepted: dict[Hashable, int] = {}
        self.stops: dict[Hashable, int] = {}
        self.refused: dict[Hashable, int] = {}

    def rate(self, n: Hashable) -> float:
        """The chance that a token of a draft after an ``n`` match is accepted, given that the
        tokens before it were."""
        accepted = self.accepted.get(n, 0)
        return (accepted + self.prior_rate * self.prior_weight) / (accepted + self.stops.get(n, 0) + self.prior_weight)

    def expected(self, n: Hashable, length: int) -> float:
        """Expected accepted tokens of a ``length``-token draft after an ``n``-gram match."""
        p = self.rate(n)
        return sum(p ** i for i in range(1, length + 1))

    def best(self, n: Hashable, available: int, base: int = 1, batch: int = 1,
             heads: float = 0.0, context: int | None = None) -> tuple[int, float]:
        """``(length, gain)``: the length (1 to ``available``) of a draft after an ``n`` match with
        the most expected tokens per unit of cost, and that ratio relative to verifying ``base``
        tokens per row of a batch of ``batch`` rows without it (>= 1: the draft pays), over
        ``context`` cached tokens (None: the profile's own).

        ``heads``: the tokens the rest of the tree (Medusa heads) is expected to add a step beyond
        the root. A step with the draft is credited ``1 + E(L) + (1 - p) * heads`` tokens, the
        heads' tokens only where the draft's first token fails (a lower bound: where the draft is
        right the heads may still go further), against ``1 + heads`` without it."""
        p, plain = self.rate(n), self.cost.ratio(batch * base, context)
        without = 1 + heads
        best, best_gain, expected, power = 1, 0.0, 0.0, 1.0
        for length in range(1, available + 1):
            power *= p
            expected += power
            cost = self.cost.ratio(batch * (base + length), context)
            gain = (1 + expected + (1 - p) * heads) / without * plain / cost
            if gain >= best_gain:
                best, best_gain = length, gain
        return best, best_gain

    def length(self, n: Hashable, available: int, base: int = 1, batch: int = 1, heads: float = 0.0,
               context: int | None = None) -> int:
        """How many leading tokens of a draft of ``available`` tokens after an ``n`` match to
        verify (0: none), for a batch of ``batch`` rows verifying ``base`` tokens each without it
        (``heads`` and ``context`` as in ``best``). A refused kind of match is still verified every
        ``probe_every``-th time it is refused."""
        if available <= 0:
            return 0
        best, gain = self.best(n, available, base, batch, heads, context)
        if gain >= 1.0:
            return best
        self.refused[n] = self.refused.get(n, 0) + 1
        return best if self.refused[n] % self.probe_every == 0 else 0

    def record(self, n: Hashable, accepted: int, drafted: int) -> None:
        """A ``drafted``-token draft after an ``n``-gram match was verified; ``accepted`` of its
        tokens were kept."""
        self.drafts[n] = self.drafts.get(n, 0) + 1
        self.accepted[n] = self.accepted.get(n, 0) + accepted
        self.stops[n] = self.stops.get(n, 0) + (accepted < drafted)

    def merge(self, other: "LookupGate") -> None:
        """Add another gate's counts to this one's (batches joining)."""
        for mine, theirs in ((self.drafts, other.drafts), (self.accepted, other.accepted),
                             (self.stops, other.stops), (self.refused, other.refused)):
            for key, count in theirs.items():
                mine[key] = mine.get(key, 0) + count


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
        num_tokens: tokens proposed a step (k) without a cost profile.
        max_ngram: longest suffix searched for.
        min_ngram: shortest suffix searched for.
        cost: the device's verification cost; with it, ``LookupGate`` chooses each draft's length,
            up to ``max_tokens``, or refuses it. Default: the heads' measured profile when the
            model has one, else no gating.
        max_tokens: the longest draft the gate may choose.
        datastore: also draft from this store of earlier text (see the module docstring).
    """

    def __init__(self, model, num_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 1,
                 cost: CostProfile | None = None, max_tokens: int = LOOKUP_MAX_TOKENS,
                 datastore: Datastore | None = None) -> None:
        num_tokens, max_tokens = whole_number("num_tokens", num_tokens, 1), whole_number("max_tokens", max_tokens, 1)
        max_ngram, min_ngram = whole_number("max_ngram", max_ngram, 1), whole_number("min_ngram", min_ngram, 1)
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.max_tokens, self.datastore = max_tokens, checked_datastore(model, datastore)
        self.trees = ChainTrees(model.device)
        cost = cost if cost is not None else model_cost(model)
        self.gate = LookupGate(cost) if cost is not None else None
        self.matches: list[tuple[Hashable, list[int]]] = []  # per row: the verified draft and its kind

    def start(self, context: StepContext, hidden: torch.Tensor) -> None:
        pass

    def propose(self, roots: torch.Tensor, context: StepContext) -> Proposal:
        limit = min(self.num_tokens if self.gate is None else self.max_tokens, context.max_depth)
        self.matches = gated_matches(context.sequences, self.max_ngram, self.min_ngram, limit, self.gate,
                                     datastore=self.datastore, kinds=row_kinds(context))
        drafts = [draft for _, draft in self.matches]
        depth = max((len(d) for d in drafts), default=0)
        tree = self.trees.at_depth(depth)
        if depth == 0:
            return Proposal(roots[:, None], tree)
        chain = torch.tensor(pad_drafts(drafts, roots.tolist(), depth), dtype=torch.long, device=roots.device)
        return Proposal(torch.cat([roots[:, None], chain], dim=1), tree, row_depths=[len(d) for d in drafts])

    def observe(self, accepted: list[list[int]], hidden: torch.Tensor, context: StepContext) -> None:
        record_matches(self.gate, self.matches, accepted)

    def select_rows(self, rows: torch.Tensor) -> None:
        pass  # the histories come with each step's context: nothing kept per row

    def merge(self, other: "LookupProposer") -> None:
        """Append the rows of another proposer of the same settings (batches joining)."""
        mine = (self.num_tokens, self.max_ngram, self.min_ngram, self.max_tokens)
        if (other.num_tokens, other.max_ngram, other.min_ngram, other.max_tokens) != mine or \
                other.datastore is not self.datastore:
            raise ValueError("cannot merge lookup proposers with different settings (num_tokens, n-gram lengths, "
                             "max_tokens or datastore): the joined rows would draft with the first batch's")
        if self.gate is not None and other.gate is not None:
            self.gate.merge(other.gate)


def checked_datastore(model, datastore: Datastore | None) -> Datastore | None:
    """``datastore``, checked to hold only token ids of ``model``'s vocabulary (``ValueError``: a store of
    another tokenizer failed in the embedding, an ``IndexError`` naming no store)."""
    if datastore is not None:
        weight = model.base_model.get_output_embeddings().weight
        datastore.check_vocabulary(getattr(weight, "ds_shape", weight.shape)[0], "the datastore")
    return datastore


def model_cost(model) -> CostProfile | None:
    """The heads' measured verification cost, if ``model`` (a ``MedusaModel``) has one."""
    profile = getattr(getattr(model, "config", None), "cost_profile", None) if model.heads is not None else None
    if profile:
        warn_if_measured_elsewhere(model)
    return CostProfile.from_dict(profile) if profile else None


def gated_matches(sequences: list[list[int]], max_ngram: int, min_ngram: int, limit: int,
                  gate: LookupGate | None, base: int = 1, datastore: Datastore | None = None,
                  heads: float = 0.0, kinds: Sequence[Hashable] | None = None) -> list[tuple[Hashable, list[int]]]:
    """Per row ``(key, draft)``: the lookup draft of at most ``limit`` tokens, cut to the length
    ``gate`` chooses (``[]`` when it refuses it) for a batch of ``len(sequences)`` rows, each
    verifying ``base`` tokens without the draft, whose heads are expected to add ``heads`` tokens
    a step (``LookupGate.length``), over the longest row's history (which the batch's cache holds for every
    row). ``key`` is ``("prompt", n)`` for a match of the row's own last
    ``n`` tokens earlier in it, ``("datastore", n, confidence)`` for one in ``datastore``
    (``DatastoreMatch.confidence``: how strongly the store's occurrences agree on the first token),
    followed by the row's kind where ``kinds`` gives one per row (``row_kinds``: its acceptance rule, as a
    sampled row's drafts are accepted far less than a greedy one's beside it in the batch).

    With both, the gate takes the draft whose best length pays better (``LookupGate.best``) and
    cuts it as it would alone; without a gate the longer match wins (the prompt's on a tie)."""
    out: list[tuple[Hashable, list[int]]] = []
    context = max(map(len, sequences), default=0)
    for row, history in enumerate(sequences):
        found, kind = [], () if kinds is None else (kinds[row],)
        n, draft = find_match(history, max_ngram, min_ngram, limit)
        if draft:
            found.append((("prompt", n, *kind), draft))
        if datastore is not None:
            match = datastore.match(history, limit)
            if match.draft:
                found.append((("datastore", match.n, match.confidence(), *kind), match.draft))
        if gate is None:
            found.sort(key=lambda m: -m[0][1])  # n
        elif len(found) > 1:  # the source that pays better; only its refusal counts towards a probe
            found.sort(key=lambda m: -gate.best(m[0], len(m[1]), base, len(sequences), heads, context)[1])
        if found and gate is not None:
            key, draft = found[0]
            found = [(key, draft[: gate.length(key, len(draft), base, len(sequences), heads, context)])]
        out.append(found[0] if found else (("prompt", 0, *kind), []))
    return out


def row_kinds(context: StepContext) -> list[str] | None:
    """Each row's kind for ``gated_matches`` (``speculation_gate.row_kind``: its acceptance rule), None where the
    context gives no sampling settings."""
    return [row_kind(sampling) for sampling in context.samplings] if context.samplings else None


def record_matches(gate: LookupGate | None, matches: list[tuple[Hashable, list[int]]],
                   accepted: list[list[int]]) -> None:
    """Tell ``gate`` how far each verified draft was accepted."""
    if gate is None:
        return
    for (n, draft), committed in zip(matches, accepted):
        if draft:
            gate.record(n, accepted_prefix(draft, committed), len(draft))
