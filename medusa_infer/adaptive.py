"""Adaptive fallback: shrink the tree, down to plain decoding, when speculation stops paying.

The controller holds a ladder of nested trees (rung 0 is plain decoding, the root alone). For each
rung it knows the expected tokens per step under the heads' calibration, ``tau_cal(r)``, and the
verification cost ratio ``c(r) = t(B * (nodes + 1)) / t(B)`` for a batch of ``B`` rows (a batch's
rows share one forward, so on a CPU a tree that pays for one row can cost more than it brings
for eight). While generating it tracks how the observed accepted tokens compare with what the
calibration predicted for the trees actually used (``scale``, an exponential moving average),
predicts ``tau(r) = 1 + scale * (tau_cal(r) - 1)`` and picks the rung with the highest
``tau(r) / c(r)``. On rung 0 no tree is verified, so a proposer that can still read its heads
reports, after each plain step, whether the token that came next was among head 1's candidates
of the largest tree (``observe_shadow``): the ratio to the calibrated rate moves ``scale`` as a
tree step would, at the cost of head 1's forward and no verification. Without such reports,
every ``probe_every`` steps on rung 0 it tries the smallest tree once to see whether acceptance
has recovered.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from medusa_infer.metrics import RECENT_STEPS
from medusa_infer.tree_fit import CostProfile
from medusa_infer.trees import AcceptanceModel, Path, expected_accept_length, path_probability, tree_depth


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
        smoothing: weight of the newest observation in the moving average.
        probe_every: steps between probes while on plain decoding.

    Attributes:
        history: the rung chosen at each of the last ``RECENT_STEPS`` steps, oldest first.
    """

    ladder: list[list[Path]]
    head_topk_acc: AcceptanceModel
    cost: CostProfile
    smoothing: float = 0.2
    probe_every: int = 16
    scale: float = 1.0
    rung: int = field(init=False)
    history: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    _since_probe: int = 0
    _steps: int = 0
    _plain_steps: int = 0

    def __post_init__(self) -> None:
        if not self.ladder or self.ladder[0]:
            raise ValueError("the ladder must start with the empty tree (plain decoding)")
        self.tau_cal = [expected_accept_length(t, self.head_topk_acc) if t else 1.0 for t in self.ladder]
        first = [p for p in self.ladder[-1] if len(p) == 1]
        # head 1's ranks at the largest tree's first level, in order (empty: plain decoding only)
        self.first_level_ranks: list[int] = sorted(p[0] for p in first)
        # how often the largest tree's first level holds the next token, under the calibration
        self.first_level_cal = expected_accept_length(first, self.head_topk_acc) - 1.0 if first else 0.0
        self._cost_ratios: dict[int, list[float]] = {}
        self.rung = self._best()

    def cost_ratios(self, batch: int) -> list[float]:
        """Per rung, ``t(batch * (nodes + 1)) / t(batch)`` plus the heads its tree runs (rung 0: 1)."""
        if batch < 1:
            raise ValueError(f"batch size must be >= 1, got {batch}")
        if batch not in self._cost_ratios:
            plain = self.cost.ratio(batch)
            self._cost_ratios[batch] = [1.0] + [
                self.cost.ratio(batch * (len(t) + 1)) / plain + self.cost.head_ratio(tree_depth(t))
                for t in self.ladder[1:]]
        return self._cost_ratios[batch]

    def _best(self, batch: int = 1) -> int:
        speeds = [(1 + self.scale * (tau - 1)) / c for tau, c in zip(self.tau_cal, self.cost_ratios(batch))]
        return max(range(len(speeds)), key=speeds.__getitem__)

    def choose(self, batch: int = 1) -> int:
        """The rung for the next step of a batch of ``batch`` rows (records it in ``history``)."""
        rung = self.rung if batch == 1 else self._best(batch)
        if rung == 0:
            self._since_probe += 1
            if self._since_probe >= self.probe_every and len(self.ladder) > 1:
                self._since_probe = 0
                rung = 1
        self.history.append(rung)
        self._steps += 1
        self._plain_steps += rung == 0
        return rung

    def observe(self, rung: int, mean_accepted: float) -> None:
        """Record the mean accepted tokens (bonus excluded) of a step taken on ``rung``."""
        if rung == 0:
            return
        expected = self.tau_cal[rung] - 1
        if expected > 0:
            ratio = mean_accepted / expected
            self.scale = (1 - self.smoothing) * self.scale + self.smoothing * ratio
        self.rung = self._best()

    def observe_shadow(self, hit_rate: float) -> None:
        """Record, for a plain step, the share of rows whose next token was among head 1's
        candidates at the largest tree's first level (``first_level_ranks``), as a tree would
        have seen it. It stands in for a probe: the controller then does not probe."""
        self._since_probe = 0
        if self.first_level_cal > 0:
            ratio = hit_rate / self.first_level_cal
            self.scale = (1 - self.smoothing) * self.scale + self.smoothing * ratio
        self.rung = self._best()

    def expected_accepted(self, rung: int) -> float:
        """Tokens a step on ``rung`` is expected to accept beyond the root, as measured so far."""
        return max(self.scale * (self.tau_cal[rung] - 1), 0.0)

    @property
    def fallback_fraction(self) -> float:
        """Share of steps decoded without speculation."""
        return self._plain_steps / self._steps if self._steps else 0.0
