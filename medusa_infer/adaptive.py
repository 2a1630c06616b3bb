"""Adaptive fallback: shrink the tree, down to plain decoding, when speculation stops paying.

The controller holds a ladder of nested trees (rung 0 is plain decoding, the root alone). For each
rung it knows the expected tokens per step under the heads' calibration, ``tau_cal(r)``, and the
verification cost ratio ``c(r) = t(B * (nodes + 1)) / t(B)`` for a batch of ``B`` rows (a batch's
rows share one forward, so on a CPU a tree that pays for one row can cost more than it brings
for eight). While generating it tracks, depth by depth, how often the accepted path went on to
depth d among the steps that reached d - 1, against what the calibration predicted for the trees
actually used (``scales[d - 1]``, an exponential moving average of the observed over the
calibrated share). It predicts ``tau(r) = 1 + sum_d reach_cal(r)[d - 1] *
scales[0] * ... * scales[d - 1]`` and picks the rung with the highest ``tau(r) / c(r)``. So deep
heads that degrade pull down the deep trees and leave a one-level tree's prediction as it was.
On rung 0 no tree is verified, so a proposer that can still read its heads reports, after each
plain step, whether the token that came next was among head 1's candidates of the largest tree
(``observe_shadow``): the ratio to the calibrated rate moves ``scales[0]`` as a tree step
would, at the cost of head 1's forward and no verification. Without such reports,
every ``probe_every`` steps on rung 0 it tries the smallest tree once to see whether acceptance
has recovered. Likewise every ``probe_every`` steps on a tree shallower than the ladder's deepest
it takes one step on the smallest tree that reaches a level further: only such steps measure the
depths below, whose scales would otherwise keep a low mark for good.

The cost ratios come from the calibration's profile, measured once in a few seconds, at the context
each step attends over where the profile measured a long context beside the typical one (on a CPU
a tree's cost over one token's grows with the context: the demo's 10-node tree cost 1.05 plain steps
over 256 cached tokens and 1.46 over 2048, docs/long-context-s72/demo_calibration.json, where heads that
paid at the first no longer pay). On a shared
machine one noisy moment there can make a bigger tree look cheap (docs/bench80-large-s25). Given a
``StepCosts``, a batch-1 controller also learns them from the steps it takes: every
``explore_every`` steps it takes one step on a neighbouring rung, compares that step's seconds with
the steps just before it, and the running estimate of each pair of neighbouring rungs' cost ratio
replaces the profile's as samples accumulate.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import median
from typing import Sequence

from medusa_infer.metrics import RECENT_STEPS
from medusa_infer.tree_fit import CostProfile
from medusa_infer.trees import AcceptanceModel, Path, expected_accept_length, path_probability, tree_depth


def frozen_acceptance(acceptance: AcceptanceModel) -> tuple:
    """``acceptance`` as a hashable key (``thawed_acceptance`` gives it back): ``("paths", ((path, p), ...))``
    for joint path probabilities, ``("ranks", ((a, ...), ...))`` for per-rank accuracies."""
    if isinstance(acceptance, Mapping):
        return "paths", tuple(sorted((tuple(path), p) for path, p in acceptance.items()))
    return "ranks", tuple(tuple(row) for row in acceptance)


def thawed_acceptance(key: tuple) -> AcceptanceModel:
    kind, entries = key
    return dict(entries) if kind == "paths" else [list(row) for row in entries]


@functools.lru_cache(maxsize=32)
def _calibrated(ladder: tuple[tuple[Path, ...], ...], acceptance: tuple
                ) -> tuple[tuple[float, ...], tuple[tuple[float, ...], ...]]:
    """Per rung of ``ladder``, its expected tokens a step and ``reach_probabilities`` under ``acceptance``
    (``frozen_acceptance``): computed once per calibration, not for every controller (one per server batch
    and chat turn; 1 to 2 ms for a 64-node ladder on a 2-core CPU)."""
    model = thawed_acceptance(acceptance)
    return (tuple(expected_accept_length(t, model) if t else 1.0 for t in ladder),
            tuple(tuple(reach_probabilities(t, model)) for t in ladder))


def reach_probabilities(tree: Sequence[Path], acceptance: AcceptanceModel) -> list[float]:
    """Per depth d = 1 .. the tree's depth, the probability under ``acceptance`` that a greedy
    step's accepted path reaches depth d (``1 + sum`` of it is ``expected_accept_length``)."""
    paths = {tuple(p) for p in tree}
    reach = [0.0] * tree_depth(paths)
    for path in paths:
        reach[len(path) - 1] += path_probability(path, acceptance)
    return reach


def reached_shares(accepted: Sequence[int], depth: int) -> list[float]:
    """Per depth d = 1 .. ``depth``, the share of rows whose step accepted at least d tokens beyond
    the root (``accepted``: each row's count, the bonus token excluded)."""
    if not accepted:
        raise ValueError("a step has at least one row, got none")
    return [sum(n >= d for n in accepted) / len(accepted) for d in range(1, depth + 1)]


def tree_ladder(paths: Sequence[Path], sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
                acceptance: AcceptanceModel | None = None) -> list[list[Path]]:
    """Nested sub-trees of ``paths``: ``[[], first 1 path, first 2, first 4, ...]`` up to the whole
    tree. Paths come most probable first under ``acceptance`` (ties: shorter, then smaller), else
    by depth then rank; either order puts every parent before its children, so each rung is a
    valid tree, and with ``acceptance`` each rung is the best tree of its size within ``paths``."""
    ordered = sorted((tuple(p) for p in paths), key=lambda p: (len(p), p))
    if acceptance is not None:
        ordered.sort(key=lambda p: -path_probability(p, acceptance))  # stable: ties keep depth order
    ladder: list[list[Path]] = [[]]
    for n in sizes:
        if n < len(ordered):
            ladder.append(ordered[:n])
    if ordered:
        ladder.append(ordered)
    return ladder


CONTEXT_STEP = 64
"""Contexts within one step of this many tokens share their cost ratios (``TreeController.cost_ratios``)."""


RungKey = tuple[int, int]
"""A tree as step costs know it: (tokens verified, root included; the heads' depth it runs)."""


def rung_key(tree: Sequence[Path]) -> RungKey:
    """The ``RungKey`` of ``tree`` (``[]``, plain decoding: ``(1, 0)``)."""
    return len(tree) + 1, tree_depth(tree)


class StepCosts:
    """Measured cost ratios of batch-1 steps on neighbouring trees, learned while decoding.

    Step times drift with the machine's load and the context's length, so only comparisons made
    close in time are kept: a ``TreeController`` that probes a neighbouring rung measures
    ``log(probe seconds / median of the steps just before it on the rung it came from)`` and
    reports how far that is from the calibration profile's log cost ratio of the pair at the
    step's context, one sample of the pair's log residual. A pair keeps its last ``window``
    samples; its estimate at a context is the profile's there plus their median, shrunk towards
    0 by ``prior_weight`` pseudo-samples. So what steps over short prompts measured moves the
    profile's prices for long ones by as much, and not to the short ones' ratios (where a tree's
    cost against a plain step's is lower on a CPU). Pass one object to many generations
    (``generate(step_costs=...)``) and what it learns carries across them; a generation of a few
    dozen steps alone takes only a few probes.

    Args:
        window: samples kept per pair of trees.
        prior_weight: how many samples the profile's ratio counts for.
    """

    def __init__(self, window: int = 32, prior_weight: float = 2.0) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 sample, got {window}")
        if not 0 <= prior_weight < math.inf:  # (NaN too: every estimate NaN)
            raise ValueError(f"prior_weight must be finite and >= 0, got {prior_weight}")
        self.window, self.prior_weight = window, prior_weight
        self._samples: dict[tuple[RungKey, RungKey], deque[float]] = {}
        self._priors: dict[tuple[RungKey, RungKey], float] = {}  # the profile's, as last asked
        self.version = 0  # counts the samples recorded, so that estimates can be cached between them

    def record(self, smaller: RungKey, larger: RungKey, log_residual: float) -> None:
        """One measured ``log(seconds on larger / seconds on smaller)`` less the profile's log ratio of the two
        at that step's context."""
        if not math.isfinite(log_residual):
            raise ValueError(f"log_residual must be finite, got {log_residual}")
        self._samples.setdefault((smaller, larger), deque(maxlen=self.window)).append(log_residual)
        self.version += 1

    def samples(self, smaller: RungKey, larger: RungKey) -> int:
        """How many measurements the pair's estimate rests on."""
        return len(self._samples.get((smaller, larger), ()))

    def log_ratio(self, smaller: RungKey, larger: RungKey, prior: float) -> float:
        """The pair's estimated ``log(t(larger) / t(smaller))``, ``prior`` being the profile's at the context
        asked about: ``prior`` plus the samples' median residual, shrunk towards 0."""
        self._priors[smaller, larger] = prior
        measured = self._samples.get((smaller, larger))
        if not measured:
            return prior
        n = len(measured)
        return prior + n * median(measured) / (n + self.prior_weight)

    def summary(self) -> dict[str, dict[str, float | None]]:
        """Per measured pair (``"5->9 tokens, depth 2->3"``): the measured cost ratio at the context last
        asked about (the profile's ratio there times the samples' median measured over profile ratio; None
        if no controller has asked), that median (``over_profile``), the sample count and the profile's
        ratio there (None likewise)."""
        def entry(pair: tuple[RungKey, RungKey], samples: deque[float]) -> dict[str, float | None]:
            prior = self._priors.get(pair)
            return {"ratio": None if prior is None else round(math.exp(prior + median(samples)), 4),
                    "over_profile": round(math.exp(median(samples)), 4), "samples": len(samples),
                    "profile": None if prior is None else round(math.exp(prior), 4)}

        return {f"{a[0]}->{b[0]} tokens, depth {a[1]}->{b[1]}": entry((a, b), s)
                for (a, b), s in sorted(self._samples.items()) if s}


@dataclass
class TreeController:
    """Chooses the rung of ``ladder`` to use at each step from the running acceptance.

    Args:
        ladder: nested trees, ``ladder[0] == []`` (plain decoding).
        head_topk_acc: the heads' calibrated acceptance (``trees.AcceptanceModel``: joint path
            probabilities, or per-rank accuracies ``[num_heads][k]``).
        cost: the device's verification cost profile; each rung also pays for the heads its tree's
            depth needs (``CostProfile.head_ratio``). Plain steps count as 1: head 1, which they
            run to watch acceptance (``observe_shadow``), is left out, so the comparison leans
            towards plain decoding by that much (about 1% of a step on a 2-core CPU).
        smoothing: weight of the newest observation in the moving average. Where the ladder's largest
            tree's first level is calibrated at rate ``q`` below 0.5 (``first_level_cal``), an observation
            of the first level (a plain step's shadow report, or a tree step's depth 1) weighs
            ``smoothing * q / (1 - q)`` (``first_level_weight``): a moving average of ratios of a yes/no
            event of rate ``q`` varies, relative to its mean, as ``(1 - q) / q`` times the weight, and with
            weak heads (head 1's candidates right on 1 step in 14) one hit on a plain step moved the scale
            by about 2.7 and bought three or four tree steps that accepted nothing
            (docs/long-context-s72/trace.txt). Every first-level observation weighs alike, whatever the
            rung, so that the scale's mean is the observed over the calibrated rate (plain steps alone
            weighing less left moderately weak heads on plain decoding half the time where a tree paid;
            each rung's own rate biased the mean by 5-7%: docs/long-context-s72/weightings.txt).
        probe_every: steps between probes while on a tree shallower than the ladder's deepest
            (plain decoding included, where shadow reports replace them).
        step_costs: learn batch-1 cost ratios from the steps taken (``StepCosts``; reported with
            ``observe_seconds``) instead of trusting the profile alone; None: the profile alone.
        explore_every: with ``step_costs``, every ``explore_every``-th step is taken on a
            neighbouring rung (every ``4 * explore_every``-th once that pair's
            ``StepCosts.window`` is full).

    Attributes:
        context: tokens the last step chosen attends over (``choose``), at which rungs are priced;
            None: the profile's own context.
        history: the rung chosen at each of the last ``RECENT_STEPS`` steps, oldest first.
        reach_cal: per rung, ``reach_probabilities`` of its tree under the calibration.
        scales: per depth d, the observed over the calibrated share of steps whose accepted path
            went on to depth d among those that reached d - 1 (moving averages; 1.0 until seen).
    """

    ladder: list[list[Path]]
    head_topk_acc: AcceptanceModel
    cost: CostProfile
    smoothing: float = 0.2
    probe_every: int = 16
    step_costs: StepCosts | None = None
    explore_every: int = 8
    rung: int = field(init=False)
    context: int | None = field(default=None, init=False)
    history: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    _since_probe: int = 0
    _since_explore: int = 0
    _explore_up: bool = False  # whether the last neighbour step went up (the first goes up)
    _explored_from: int | None = None  # the rung a neighbour step was taken from, during that step
    _steps: int = 0
    _plain_steps: int = 0

    def __post_init__(self) -> None:
        if not self.ladder or self.ladder[0]:
            raise ValueError("the ladder must start with the empty tree (plain decoding)")
        tau_cal, reach_cal = _calibrated(tuple(tuple(tuple(p) for p in t) for t in self.ladder),
                                         frozen_acceptance(self.head_topk_acc))
        self.tau_cal = list(tau_cal)
        self.reach_cal = [list(reach) for reach in reach_cal]
        self.scales = [1.0] * max(max(map(len, self.reach_cal)), 1)
        first = [p for p in self.ladder[-1] if len(p) == 1]
        # head 1's ranks at the largest tree's first level, in order (empty: plain decoding only)
        self.first_level_ranks: list[int] = sorted(p[0] for p in first)
        # how often the largest tree's first level holds the next token, under the calibration
        self.first_level_cal = expected_accept_length(first, self.head_topk_acc) - 1.0 if first else 0.0
        self._cost_ratios: dict[tuple[int, int | None], list[float]] = {}
        if self.explore_every < 2:
            raise ValueError(f"explore_every must be >= 2 steps, got {self.explore_every}")
        if not 0 < self.smoothing <= 1:  # (above 1 turned a scale negative: plain decoding for good; NaN too)
            raise ValueError(f"smoothing must lie in (0, 1], got {self.smoothing}")
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1 step, got {self.probe_every}")
        self.keys = [rung_key(t) for t in self.ladder]
        self.depths = [tree_depth(t) for t in self.ladder]
        self._recent: deque[tuple[int, float]] = deque(maxlen=self.explore_every)  # (rung, seconds)
        self._step_cost_ratios: tuple[tuple[int, int | None], list[float]] = ((-1, None), [])  # ((StepCosts.version,
        # context bucket), ratios)
        self.rung = self._best()

    def _context_bucket(self, context: int | None) -> int | None:
        """``context`` rounded down to ``CONTEXT_STEP`` tokens; None where the profile prices every context
        alike (no long context measured, or ``context`` within the profile's own)."""
        if self.cost.longer is None or context is None or context <= self.cost.context:
            return None
        return context // CONTEXT_STEP * CONTEXT_STEP

    def cost_ratios(self, batch: int, context: int | None = None) -> list[float]:
        """Per rung, ``t(batch * (nodes + 1)) / t(batch)`` over ``context`` cached tokens (None: the
        profile's own; ``CostProfile.ratio``) plus the heads its tree runs (rung 0: 1). The heads'
        share is the one measured at one row (``CostProfile.head_ratio``): taken to grow with the
        rows as the backbone's forward does, both being linear layers (not measured at more than one
        row); a batch's forward is priced as one row of all its tokens (attention over the context
        grows with the tokens either way)."""
        if batch < 1:
            raise ValueError(f"batch size must be >= 1, got {batch}")
        key = batch, self._context_bucket(context)
        if key not in self._cost_ratios:
            at = key[1]
            plain = self.cost.ratio(batch, at)
            self._cost_ratios[key] = [1.0] + [
                max(self.cost.ratio(batch * (len(t) + 1), at) / plain, 1.0) + self.cost.head_ratio(tree_depth(t), at)
                for t in self.ladder[1:]]
        return self._cost_ratios[key]

    def step_cost_ratios(self) -> list[float]:
        """Per rung, the cost of a batch-1 step against a plain one at ``context``: the profile's
        (``cost_ratios(1, context)``), with each neighbouring pair's ratio as ``step_costs`` measured it, and none
        below 1 (a tree step costs at least a plain one, as ``CostProfile`` holds its t(n) to t(1): one noisy
        sample below it made a tree expected to accept nothing look faster than plain decoding)."""
        prior = self.cost_ratios(1, self.context)
        if self.step_costs is None:
            return prior
        key = self.step_costs.version, self._context_bucket(self.context)
        if self._step_cost_ratios[0] != key:  # recomputed only after a new sample, or at another context
            costs = [1.0]
            for r in range(1, len(self.ladder)):
                step = self.step_costs.log_ratio(self.keys[r - 1], self.keys[r], math.log(prior[r] / prior[r - 1]))
                costs.append(max(costs[-1] * math.exp(step), 1.0))
            self._step_cost_ratios = (key, costs)
        return self._step_cost_ratios[1]

    def _best(self, batch: int = 1) -> int:
        costs = self.step_cost_ratios() if batch == 1 else self.cost_ratios(batch, self.context)
        speeds = [(1 + self.expected_accepted(r)) / c for r, c in enumerate(costs)]
        return max(range(len(speeds)), key=speeds.__getitem__)

    def _neighbour(self, rung: int) -> int:
        """The rung above or below ``rung``, the other way from the last neighbour step (the one
        that exists at either end)."""
        up = rung + 1 < len(self.ladder) and (not self._explore_up or rung == 0)
        return rung + 1 if up else rung - 1

    def _explore(self, rung: int) -> int:
        """``rung``, or every ``explore_every`` steps a neighbour of it; every ``4 * explore_every``
        once the pair's window of samples is full (costs drift, so it keeps measuring)."""
        self._since_explore += 1
        neighbour = self._neighbour(rung)
        lower, upper = sorted((rung, neighbour))
        full = self.step_costs.samples(self.keys[lower], self.keys[upper]) >= self.step_costs.window
        if self._since_explore < self.explore_every * (4 if full else 1):
            return rung
        self._since_explore, self._explore_up, self._explored_from = 0, neighbour > rung, rung
        return neighbour

    def _probe(self, rung: int) -> int:
        """``rung``, or every ``probe_every`` steps on a tree shallower than the ladder's deepest, the
        smallest rung that reaches a level further (from plain decoding: the smallest tree)."""
        deeper = next((r for r in range(rung + 1, len(self.ladder)) if self.depths[r] > self.depths[rung]), None)
        if deeper is None:
            return rung
        self._since_probe += 1
        if self._since_probe < self.probe_every:
            return rung
        self._since_probe = 0
        return deeper

    def choose(self, batch: int = 1, context: int | None = None) -> int:
        """The rung for the next step of a batch of ``batch`` rows over ``context`` cached tokens (None: the
        cost profile's own context; recorded as ``context``), recorded in ``history``."""
        if context is not None and context < 0:
            raise ValueError(f"context must be >= 0 cached tokens (or None), got {context}")
        moved = self._context_bucket(context) != self._context_bucket(self.context)
        self.context = context
        if moved and batch == 1:  # the costs changed: the rung observe() chose at the last context may not be best
            self.rung = self._best()
        rung = self.rung if batch == 1 else self._best(batch)
        self._explored_from = None
        if batch != 1:  # steps of one row after it are compared with one-row steps after it, not before
            self._recent.clear()
        if batch == 1 and self.step_costs is not None and len(self.ladder) > 1:
            rung = self._explore(rung)
        if self._explored_from is None:  # a neighbour step stays as chosen: its cost is the sample
            rung = self._probe(rung)
        self.history.append(rung)
        self._steps += 1
        self._plain_steps += rung == 0
        return rung

    def observe(self, rung: int, reached: Sequence[float]) -> None:
        """Record a step taken on ``rung``: ``reached[d - 1]`` is the share of its rows whose
        accepted path reached depth d, the bonus token excluded (``reached_shares``); depths past
        the list's end count as not reached. Each depth's scale moves by the share that went on
        to it among the rows that reached the depth above, against the calibrated share; depths
        no row reached learn nothing."""
        if rung == 0:
            return
        calibrated = self.reach_cal[rung]
        if len(reached) > len(calibrated):
            raise ValueError(f"rung {rung}'s tree is {len(calibrated)} deep; got shares for {len(reached)} depths")
        shares = [float(x) for x in reached] + [0.0] * (len(calibrated) - len(reached))
        if any(not 0.0 <= b <= a + 1e-9 for a, b in zip([1.0] + shares, shares)):
            raise ValueError(f"reached shares must lie in [0, 1] and never grow with depth, got {list(reached)}")
        above, above_cal = 1.0, 1.0
        for d, (share, expected) in enumerate(zip(shares, calibrated)):
            if above <= 0 or expected <= 0:
                break
            rate = expected / above_cal
            # every first-level observation weighs alike, by the largest tree's rate (as a plain step's report
            # does): weights that differed by rung, which the scale itself chooses, biased its mean (by 5-7%)
            weight = self.first_level_weight(self.first_level_cal) if d == 0 else self.smoothing
            self.scales[d] = (1 - weight) * self.scales[d] + weight * (share / above) / rate
            above, above_cal = share, expected
        self.rung = self._best()

    def observe_seconds(self, rung: int, seconds: float) -> None:
        """Record how long a batch-1 step on ``rung`` took, its whole tree verified (no-op without
        ``step_costs``). A step on a neighbouring rung (``choose`` explored) becomes one sample of
        the pair's cost ratio against the median of the recent steps on the rung it came from, recorded
        as its excess over the profile's ratio at the step's context (``StepCosts``)."""
        if self.step_costs is None:
            return
        if seconds <= 0:
            raise ValueError(f"a step takes > 0 seconds, got {seconds}")
        start, self._explored_from = self._explored_from, None
        if start is None or start == rung:
            self._recent.append((rung, seconds))
            return
        before = [s for r, s in self._recent if r == start]
        if len(before) < 2 or abs(rung - start) != 1:
            return
        log_ratio = math.log(seconds / median(before))
        lower, upper = sorted((start, rung))
        prior = self.cost_ratios(1, self.context)  # the profile's at this step's context: the sample is the excess
        excess = (log_ratio if rung == upper else -log_ratio) - math.log(prior[upper] / prior[lower])
        self.step_costs.record(self.keys[lower], self.keys[upper], excess)
        self.rung = self._best()

    def observe_shadow(self, hit_rate: float) -> None:
        """Record, for a plain step, the share of rows whose next token was among head 1's
        candidates at the largest tree's first level (``first_level_ranks``), as a tree would
        have seen it. It stands in for a probe: the controller then does not probe."""
        if not 0.0 <= hit_rate <= 1.0:  # (a NaN kept the scale NaN for good: plain decoding from then on)
            raise ValueError(f"hit_rate must be a share in [0, 1], got {hit_rate!r}")
        self._since_probe = 0
        if self.first_level_cal > 0:
            weight = self.first_level_weight(self.first_level_cal)
            self.scale = (1 - weight) * self.scale + weight * hit_rate / self.first_level_cal
        self.rung = self._best()

    def first_level_weight(self, rate: float) -> float:
        """The moving average's weight of an observation of the first level calibrated at ``rate`` (``smoothing``,
        less below 0.5)."""
        return self.smoothing * min(1.0, rate / (1.0 - rate)) if rate < 1.0 else self.smoothing

    @property
    def scale(self) -> float:
        """Head 1's acceptance against the calibration (``scales[0]``)."""
        return self.scales[0]

    @scale.setter
    def scale(self, value: float) -> None:
        self.scales[0] = value

    def expected_accepted(self, rung: int) -> float:
        """Tokens a step on ``rung`` is expected to accept beyond the root, as measured so far: each
        depth's calibrated reach times the scales down to it, never above the depth before's."""
        total, factor, above = 0.0, 1.0, 1.0
        for scale, reach in zip(self.scales, self.reach_cal[rung]):
            factor *= max(scale, 0.0)
            above = min(reach * factor, above)
            total += above
        return total

    @property
    def fallback_fraction(self) -> float:
        """Share of steps decoded without speculation."""
        return self._plain_steps / self._steps if self._steps else 0.0
