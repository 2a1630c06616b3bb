"""Speculate only where it measurably pays, per batch size: the on/off switch of the serving
engine and of greedy batches.

A draft of k tokens per row turns a forward of ``batch`` tokens into one of ``batch * (k + 1)``.
For one row that is cheap (the forward is bound by reading the weights), but a batch of rows
already fills a CPU's matrix products: at concurrency 4 and 16, prompt lookup made the server
slower than plain decoding (README "Serving"). The cost profile that trees are fitted to is
measured for one row at one context length; a server's steps mix batch sizes, context lengths,
threads and per-row bookkeeping that no such profile captures. So the gate learns from the steps
the engine actually takes:

* the step time as a function of the tokens in the forward, ``t(N)``: the median of the last
  ``TIME_WINDOW`` steps in each power-of-two range of ``N`` (its size and time; one slow step is outvoted),
  interpolated between ranges. Every step teaches it, plain or
  speculative, at any batch size. (A table per range of batch sizes would model per-row costs
  too, but in the serving benchmark exploring each range cost more than it saved.)
  The time of a step's proposing is left out of ``t``: a draft model's (or layerskip's) k forwards
  cost the same whatever the verified forward's size, and a lone row's speculative step, charged to
  the range a batch's plain step reads, made plain steps there look dear.
* what a speculative step yields per row: tokens emitted (``a``, the bonus token included) and
  tokens verified (``v``), moving averages, and what proposing costs it (``d``, the median of the last
  ``TIME_WINDOW``), per power-of-two range of batch sizes (the adaptive fallback fits smaller trees to
  bigger batches), a batch size no speculative step has run at yet taking the averages over every size
  (how much of a draft is accepted depends on the text; ``d`` until its range holds
  ``MIN_PROPOSING_SAMPLES``). ``a`` and ``v`` are learnt for each kind of row apart (the serving engine's
  kinds are acceptance rules: greedy drafts are accepted far more than sampled ones, and one average let a
  sampled request's low yield turn speculation off for the greedy rows beside it); a batch mixing kinds
  expects the mean of its rows' kinds' yields.

A step of ``B`` rows speculates when ``a / (t(B * v) + d) >= (1 - margin) / t(B)``: where the two are
close (one row, on a CPU) speculation keeps the benefit of the doubt, and the gate only steps in
where speculation clearly costs. Until ``t`` has been seen near ``B`` (a plain step; ``MIN_PLAIN_TIMES``
of them where that range was measured at all) and near ``B * v`` (a speculative one) or on both sides of
it, or while one of its rows' kinds has yielded fewer than ``warmup`` speculative steps, it takes the step
that measures the missing one. While speculation is
off it still probes now and then, so ``a`` and ``v`` follow the text: each plain step earns
``probe_budget * t(B)`` seconds of credit, and a probe is taken when the credit pays for its extra
cost ``t(B * v) - t(B)``. Probes are thus frequent where they are cheap (one row) and rare where a
speculative step costs several plain ones (a full batch), and they take about ``probe_budget`` of
the time either way. While speculation is on, the gate likewise takes a plain step (a check) whenever
the speculative steps' ``probe_budget`` share of their time pays for one, so that ``t(B)`` follows the
machine: a plain step or two measured while another process held the cores made speculation look
cheap, and without plain steps nothing measured ``t(B)`` again. Each range of batch sizes earns and
spends its own credit for checks. Being rare, a probe weighs more in ``a`` and ``v`` than a step taken while
speculation is on (``probe_weight``): the text a probe reads is the text now, and with the ordinary
weight a server that had spent a request on text its drafts missed (a sampled request on untrained
heads, say) took several probes, hundreds of plain steps, to speculate again on text they fit.

The gate is bookkeeping: ``gated_step`` asks it, times one step of a ``decoding.DecodeBatch`` and
reports the step back, with each row's acceptance rule (``row_kind``) as its kind. The serving engine keeps
one gate for its lifetime, for all its batches but seeded sampled ones (whose output must not depend on the
clock): greedy and sampled requests share a batch, one forward a step for both; ``decoding.stream`` uses one
per call for greedy batches, or the one it is given (so a caller running many batches can let the gate learn
across them).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any


TIME_WINDOW = 8
"""Step times a range of forward sizes keeps: its time is their median, so one slow step (a garbage
collection, another process on the cores) is outvoted instead of weighing in a moving average, where
it had kept speculation off for hundreds of steps (probes being rare while it is off)."""

MIN_PLAIN_TIMES = 2
"""Step times a batch size's range holds before the gate compares speculation with it: it takes plain
steps until then (the median of two is the lower one). On one sample, a slow first plain step made
speculation look cheap (the gate speculating on every later step; at batch 8, where speculating was 1.9x
slower per token, on all of them); two slow ones did so until checks (plain steps taken while speculation
is on) outvoted them."""


def _median(values: list, key: Any = None) -> Any:
    """The median of ``values`` (the lower one of an even count)."""
    ordered = sorted(values, key=key)
    return ordered[(len(ordered) - 1) // 2]


MIN_PROPOSING_SAMPLES = 3
"""Proposing times a range of batch sizes holds before its own median prices its speculative steps."""


@dataclass
class _Average:
    """The last ``TIME_WINDOW`` steps of one power-of-two range of forward sizes, ``(tokens, seconds)`` each;
    the range's point is the median step (by time, the lower one of an even count): its size and its time.
    (A moving average of the sizes beside the median time priced a range's sizes wrong where steps of two
    sizes shared it: 24 tokens at the time of 17, where a lone row's 17-token steps and a batch's 24-token
    ones met, and speculation at 12 rows looked 15% dearer than it measured.)"""

    recent: list[tuple[float, float]]
    samples: int = 1

    def _median(self) -> tuple[float, float]:
        return _median(self.recent, key=lambda step: (step[1], step[0]))

    @property
    def tokens(self) -> float:
        return self._median()[0]

    @property
    def seconds(self) -> float:
        return self._median()[1]


@dataclass
class _Yield:
    """What speculative steps yielded per row of one kind: tokens emitted and verified, moving averages over
    every batch size and per power-of-two range of batch sizes (``[a, v]``), and the steps that taught them."""

    tokens_per_row: float = 1.0
    verified_per_row: float = 1.0
    by_batch: dict[int, list[float]] = field(default_factory=dict)
    steps: int = 0

    def at(self, key: int) -> tuple[float, float]:
        """``(a, v)`` at a range of batch sizes: its own averages, else those over every size."""
        return tuple(self.by_batch.get(key, (self.tokens_per_row, self.verified_per_row)))

    def learn(self, key: int, tokens: float, verified: float, weight: float) -> None:
        if self.steps == 0:
            self.tokens_per_row, self.verified_per_row = tokens, verified
        else:
            self.tokens_per_row = (1 - weight) * self.tokens_per_row + weight * tokens
            self.verified_per_row = (1 - weight) * self.verified_per_row + weight * verified
        same = self.by_batch.get(key)
        if same is None:
            self.by_batch[key] = [tokens, verified]
        else:
            same[0] = (1 - weight) * same[0] + weight * tokens
            same[1] = (1 - weight) * same[1] + weight * verified
        self.steps += 1


def _kind_counts(batch: int, kinds: Sequence[Hashable] | None) -> Counter:
    if kinds is None:
        return Counter({None: batch})
    if len(kinds) != batch:
        raise ValueError(f"kinds names {len(kinds)} rows for a batch of {batch}: give one kind per row")
    return Counter(kinds)


class SpeculationGate:
    """Chooses, for each step of a batch, whether to speculate, from measured step times.

    Args:
        probe_budget: share of the plain steps' time spent on probes while speculation is off.
        margin: how much slower speculation may look (as a share of plain throughput) and still
            be chosen.
        smoothing: weight of the newest step in each moving average.
        warmup: speculative steps measured before the first decision.
        probe_weight: weight of a probe (a speculative step taken while speculation is off) in the
            averages of what a speculative step yields; at least ``smoothing``.
    """

    def __init__(self, probe_budget: float = 0.02, margin: float = 0.05, smoothing: float = 0.1,
                 warmup: int = 4, probe_weight: float = 0.5) -> None:
        if not 0 < probe_budget < 1:
            raise ValueError(f"probe_budget must be in (0, 1), got {probe_budget}")
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 speculative step, got {warmup}")
        if not smoothing <= probe_weight <= 1:
            raise ValueError(f"probe_weight must be in [smoothing, 1] = [{smoothing}, 1], got {probe_weight}")
        self.probe_budget, self.margin, self.smoothing, self.warmup = probe_budget, margin, smoothing, warmup
        self.probe_weight = probe_weight
        self._probing = False  # the step asked for is a probe
        self._times: dict[int, _Average] = {}  # power-of-two range of forward sizes -> averages
        self._all = _Yield()  # a and v of every row, whatever its kind (summary)
        self._yields: dict[Hashable, _Yield] = {}  # a row's kind -> a and v of its kind's rows
        self.speculative_steps = 0
        self.plain_steps = 0
        self._credit = 0.0  # seconds of probing earned by plain steps
        self._check_credit: dict[int, float] = {}  # range of batch sizes -> seconds of checks its steps earned
        self.checks = 0  # plain steps taken as checks (speculation on)
        self._proposing: dict[int, list[float]] = {}  # range of batch sizes -> recent proposing seconds (d)
        self._proposing_all: list[float] = []  # the same over every batch size

    @property
    def tokens_per_row(self) -> float:
        """a: tokens a speculative step emits per row, a moving average over every row of every kind."""
        return self._all.tokens_per_row

    @property
    def verified_per_row(self) -> float:
        """v: tokens a speculative step verifies per row, a moving average over every row of every kind."""
        return self._all.verified_per_row

    def expected_yield(self, batch: int, kinds: Sequence[Hashable] | None = None) -> tuple[float, float]:
        """``(a, v)`` expected of a speculative step of ``batch`` rows of ``kinds`` (one per row; None: one kind):
        the mean over the rows of their kind's averages at this range of batch sizes (a kind no step has taught
        yet: 1 and 1)."""
        key, tokens, verified = self._range(batch), 0.0, 0.0
        for kind, rows in _kind_counts(batch, kinds).items():
            a, v = self._yields[kind].at(key) if kind in self._yields else (1.0, 1.0)
            tokens, verified = tokens + rows * a, verified + rows * v
        return tokens / batch, verified / batch

    # -- what has been measured ---------------------------------------------------------------

    @staticmethod
    def _range(tokens: float) -> int:
        return max(int(tokens) - 1, 0).bit_length()  # 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...

    def step_seconds(self, tokens: float) -> float | None:
        """The expected seconds of a step verifying ``tokens`` tokens in all (every row together),
        or None before any step in that range of forward sizes, or in ranges on both sides of it,
        has been measured (an average size between two measured ones, as steps of mixed draft
        lengths give, no step measures itself). Past the largest size measured, or below the smallest,
        the time is never below that size's: a segment extended past its ends (one slow step of one
        size) priced a forward at down to nothing."""
        own = self._times.get(self._range(tokens))
        same = [seconds for size, seconds in own.recent if size == tokens] if own is not None else []
        if same:  # steps of this very size in its range's window: their median (the range's median step may be
            return _median(same)  # another size's: 5-row steps priced as the 6-row steps beside them)
        if own is None:
            sizes = [a.tokens for a in self._times.values()]
            if not sizes or not min(sizes) <= tokens <= max(sizes):
                return None
        points = sorted((a.tokens, a.seconds) for a in self._times.values())
        if len(points) == 1:
            return points[0][1]
        for (n0, t0), (n1, t1) in zip(points, points[1:]):
            if tokens <= n1 or (n1, t1) == points[-1]:
                if n1 == n0:
                    return t1
                estimate = t0 + (t1 - t0) * (tokens - n0) / (n1 - n0)
                nearest = t1 if tokens > n1 else t0 if tokens < n0 else 1e-9  # extrapolated: no cheaper than it
                return max(estimate, nearest, 1e-9)
        return points[-1][1]

    @property
    def proposing_seconds(self) -> float:
        """d over every batch size: the median of the last ``TIME_WINDOW`` speculative steps' proposing."""
        return _median(self._proposing_all) if self._proposing_all else 0.0

    def _proposing_at(self, batch: int) -> float:
        """d at ``batch``'s range: its own median once it holds ``MIN_PROPOSING_SAMPLES`` (one slow first sample
        of a range turned speculation off there for good), else the median over every batch size."""
        own = self._proposing.get(self._range(batch), [])
        recent = own if len(own) >= MIN_PROPOSING_SAMPLES else self._proposing_all
        return _median(recent) if recent else 0.0

    # -- the decision -------------------------------------------------------------------------

    def speculate(self, batch: int, kinds: Sequence[Hashable] | None = None) -> bool:
        """Whether the next step of a batch of ``batch`` rows should speculate; ``kinds``: each row's kind
        (None: one kind for all)."""
        if batch < 1:
            raise ValueError(f"batch size must be >= 1, got {batch}")
        self._probing = False  # a probe whose step was never recorded (it failed) is forgotten
        counts = _kind_counts(batch, kinds)
        if any(kind not in self._yields or self._yields[kind].steps < self.warmup for kind in counts):
            return True
        plain = self.step_seconds(batch)
        measured = self._times.get(self._range(batch))
        if plain is None or (measured is not None and len(measured.recent) < MIN_PLAIN_TIMES):
            return False
        tokens, verified = self.expected_yield(batch, kinds)
        speculative = self.step_seconds(batch * verified)
        if speculative is None:
            return True
        speculative += self._proposing_at(batch)
        if tokens / speculative >= (1 - self.margin) / plain:
            # a check, paid for by this range's own speculative steps (a server's small batches spent what its
            # large ones earned): t(B) measured again, at least as often as a step priced at t(B * v) pays for,
            # the t(B) believed being maybe the wrong one (slow samples made it dearer than speculating)
            key = self._range(batch)
            credit = self._check_credit.get(key, 0.0)
            if credit >= min(plain, speculative):
                self._check_credit[key] = 0.0
                self.checks += 1
                return False
            self._check_credit[key] = credit + self.probe_budget * speculative
            return True
        self._credit += self.probe_budget * plain
        if self._credit >= speculative - plain:
            self._credit = 0.0
            self._probing = True
            return True
        return False

    def record(self, batch: int, speculated: bool, tokens: float, seconds: float, verified: int,
               proposing: float | None = None, kinds: Sequence[Hashable] | None = None,
               row_tokens: Sequence[float] | None = None) -> None:
        """A step of ``batch`` rows, speculative or not, verified ``verified`` tokens in one forward
        (all rows together) and emitted ``tokens`` in ``seconds``, its proposing left out; ``proposing``: the
        seconds proposing took, for a speculative step whose proposing is typical (None: not one, e.g. a
        draft model's that caught up on the plain steps before it). ``kinds`` and ``row_tokens``: each row's
        kind and the tokens it emitted, for a batch whose rows are of several kinds (None: one kind)."""
        if batch < 1 or not 0 <= tokens < float("inf") or not 0 < seconds < float("inf") or verified < batch or not (
                proposing is None or 0 <= proposing < float("inf")):  # (a NaN kept for good: no comparison held)
            raise ValueError(f"need batch >= 1, finite tokens >= 0 and seconds > 0, verified >= batch and proposing "
                             f"None or finite >= 0, got batch={batch}, tokens={tokens}, seconds={seconds}, "
                             f"verified={verified}, proposing={proposing}")
        counts = _kind_counts(batch, kinds)
        if kinds is not None and (row_tokens is None or len(row_tokens) != batch):
            raise ValueError(f"kinds need row_tokens, the tokens each of the {batch} rows emitted, got {row_tokens!r}")
        key, w = self._range(verified), self.smoothing
        average = self._times.get(key)
        if average is None:
            self._times[key] = _Average([(float(verified), seconds)])
        else:
            average.recent = (average.recent + [(float(verified), seconds)])[-TIME_WINDOW:]
            average.samples += 1
        probe, self._probing = self._probing and speculated, False
        if not speculated:
            self.plain_steps += 1
            return
        w, batch_key = self.probe_weight if probe else w, self._range(batch)
        self._all.learn(batch_key, tokens / batch, verified / batch, w)
        for kind, rows in counts.items():  # (every row verified as many tokens: the batch's tree)
            emitted = tokens if kinds is None else sum(t for t, k in zip(row_tokens, kinds) if k == kind)
            self._yields.setdefault(kind, _Yield()).learn(batch_key, emitted / rows, verified / batch, w)
        if proposing is not None:  # a median, as the step times: one slow proposing step is outvoted
            for recent in (self._proposing.setdefault(batch_key, []), self._proposing_all):
                recent.append(proposing)
                del recent[:-TIME_WINDOW]
        self.speculative_steps += 1

    def summary(self) -> dict[str, object]:
        """What the gate has measured: per row of a speculative step, tokens emitted and verified;
        the step-time table (``"~N tokens"`` -> seconds); the counts of each kind of step."""
        return {
            "tokens_per_row": self.tokens_per_row,
            "verified_per_row": self.verified_per_row,
            "tokens_per_row_by_kind": {str(kind): y.tokens_per_row for kind, y in self._yields.items()},
            "proposing_seconds": self.proposing_seconds,
            "step_seconds": {f"~{a.tokens:.0f} tokens": a.seconds for _, a in sorted(self._times.items())},
            "speculative_steps": self.speculative_steps,
            "plain_steps": self.plain_steps,
            "checks": self.checks,
        }


def row_kind(sampling: Any) -> str:
    """The kind a row is of for the gate: its acceptance rule (``"greedy"`` for a row decoded greedily)."""
    return "greedy" if sampling.greedy else sampling.acceptance


def gated_step(batch: Any, gate: SpeculationGate | None) -> tuple[dict[int, list[int]], bool]:
    """One step of ``batch`` (a ``decoding.DecodeBatch``), speculative or plain as ``gate`` decides
    (always speculative without a gate), reported back to the gate with each row's kind (``row_kind``):
    ``(emitted, gated)``, ``gated`` telling whether the gate chose a plain step (speculation measured slower,
    or a check)."""
    if gate is None:
        return batch.step(), False
    stepped = list(batch.rows)
    rows, kinds = len(stepped), [row_kind(batch.samplings[row]) for row in stepped]
    # a step with no room for a draft (every row's last token) is plain whatever the gate would say: asked, the
    # gate spent a probe on it and learnt that speculating yields one token for one verified
    room = batch.room() > 0
    speculate = room and gate.speculate(rows, kinds)
    sizes = batch.metrics.recent_tree_sizes
    # a draft model's first speculative step after plain ones feeds it their tokens: no typical proposing time
    after_plain = bool(sizes) and sizes[-1] == 1 and getattr(batch.proposer, "catches_up", False)
    start, proposing = time.perf_counter(), batch.metrics.phase_s["propose"]
    emitted = batch.step(speculate=speculate)
    seconds, proposing = time.perf_counter() - start, batch.metrics.phase_s["propose"] - proposing
    proposing = min(proposing, 0.99 * seconds)  # (a part of the step)
    row_tokens = [len(emitted.get(row, ())) for row in stepped]
    gate.record(rows, speculate, sum(row_tokens), seconds - proposing, rows * sizes[-1],
                proposing if speculate and not after_plain else None, kinds, row_tokens)
    return emitted, room and not speculate
