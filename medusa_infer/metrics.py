"""Counters and timings of one generation call.

Definitions follow vLLM and Spec-Bench: ``tau`` (mean accepted tokens per step) counts the bonus
token, so plain decoding scores 1.0; the acceptance rate at depth d is the fraction of row-steps
whose accepted path reached depth d among those whose proposal offered depth d to a row that could
emit a draft there (not past its ``max_new_tokens``, nor past a draft it stopped on).
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

PHASES = ("propose", "verify", "accept", "commit")
RECENT_STEPS = 1024  # per-step tree sizes kept for inspection


@dataclass
class GenerationMetrics:
    """Metrics of one ``generate`` call, summed over the rows of the batch.

    Attributes:
        steps: decoding steps (forwards of the target after the prefill).
        row_steps: sum over steps of the rows active in that step.
        new_tokens: tokens generated, all rows, the first (prefill) token included.
        step_tokens: tokens the steps emitted, all rows (the prefill's not included).
        accepted_by_depth: per depth d (1-based index d-1), row-steps that emitted depth d's draft.
        offered_by_depth: per depth d, row-steps whose proposal reached depth d and whose row could emit
            depth d's draft (``record_step``'s ``reachable``).
        phase_s: seconds spent in propose / verify / accept / commit.
        prefill_s: seconds of the prompt forward.
        ttft_s: time to the first token (the prefill, sampling included).
        total_s: wall-clock seconds of the call (of a stream, less the time its consumer kept each chunk).
        tree_nodes: sum over steps of the tree size (nodes, root included).
        plain_steps: steps that verified the root alone (no speculation), whatever the cause: the
            adaptive fallback, a serving gate's plain step, or a step cut to the root by
            ``max_new_tokens`` or the context's end.
        fallback_steps: steps on which the adaptive fallback chose plain decoding for the heads
            (``adaptive.TreeController``; a lookup chain grafted on may still have speculated).
        recent_tree_sizes: the tree size of each of the last ``RECENT_STEPS`` steps, oldest first.
            Bounded, so a server batch that never empties (rows keep joining) does not grow it.
        rows: rows (sequences) generated.
    """

    steps: int = 0
    row_steps: int = 0
    new_tokens: int = 0
    step_tokens: int = 0
    accepted_by_depth: list[int] = field(default_factory=list)
    offered_by_depth: list[int] = field(default_factory=list)
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    tree_nodes: int = 0
    plain_steps: int = 0
    fallback_steps: int = 0
    recent_tree_sizes: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    rows: int = 0

    @property
    def tau(self) -> float:
        """Mean tokens per decoding step and row, bonus token included (plain decoding: 1.0)."""
        return self.step_tokens / self.row_steps if self.row_steps else 1.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        return [a / o if o else 0.0 for a, o in zip(self.accepted_by_depth, self.offered_by_depth)]

    @property
    def fallback_fraction(self) -> float:
        """Share of steps decoded without speculation (tree of the root alone)."""
        return self.plain_steps / self.steps if self.steps else 0.0

    @property
    def adaptive_fallback_fraction(self) -> float:
        """Share of steps on which the adaptive fallback chose plain decoding (``fallback_steps``)."""
        return self.fallback_steps / self.steps if self.steps else 0.0

    @property
    def mean_tree_size(self) -> float:
        """Mean tree size per step, root included (plain decoding: 1.0; 0.0 before any step)."""
        return self.tree_nodes / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first, per row: the rows' decoding seconds (the call's, in
        proportion to the steps each row was decoding in: a row finishing early is not charged the
        others' steps) over their later tokens."""
        later_tokens = self.new_tokens - self.rows
        if later_tokens <= 0 or not self.steps:
            return 0.0
        return (self.total_s - self.ttft_s) * self.row_steps / self.steps / later_tokens

    def record_step(self, accepted: torch.Tensor | Sequence[int], offered_depth: int, tree_size: int,
                    fallback: bool = False, emitted: Sequence[int] | None = None,
                    reachable: Sequence[int] | None = None) -> None:
        """Count one step of a tree of ``tree_size`` nodes reaching ``offered_depth``.

        Args:
            accepted: ``[rows]`` per active row, the drafts it emitted. Tokens accepted past a row's
                stopping point (an EOS, a stop string, ``max_new_tokens``) were dropped and are not
                counted, so tau and the acceptance by depth describe the output.
            offered_depth: the proposal's depth.
            tree_size: nodes verified, root included.
            fallback: the adaptive fallback chose plain decoding for the heads this step.
            emitted: ``[rows]`` the tokens each row emitted; default its drafts and the token every step
                yields after them, which a row that stopped on a draft did not emit.
            reachable: ``[rows]`` the deepest draft each row could have emitted (its ``max_new_tokens``
                left, or the draft it stopped on); default ``offered_depth`` for every row. A depth past it
                is not counted as offered to the row: a row cut short by its own limit, or ended by an EOS
                draft, was counted as rejecting drafts that were right.
        """
        accepted = torch.as_tensor(accepted, dtype=torch.long)
        rows = accepted.numel()
        tokens = int(accepted.sum()) + rows if emitted is None else int(sum(emitted))
        self.steps += 1
        self.row_steps += rows
        self.step_tokens += tokens
        self.tree_nodes += tree_size
        self.plain_steps += tree_size == 1
        self.fallback_steps += bool(fallback)
        self.recent_tree_sizes.append(tree_size)
        reach = None if reachable is None else torch.as_tensor(reachable, dtype=torch.long).clamp(max=offered_depth)
        if reach is not None:  # a depth no row could reach is not offered (nor listed, until one can)
            offered_depth = int(reach.max()) if rows else 0
        while len(self.offered_by_depth) < offered_depth:
            self.offered_by_depth.append(0)
            self.accepted_by_depth.append(0)
        for depth in range(1, offered_depth + 1):
            self.offered_by_depth[depth - 1] += rows if reach is None else int((reach >= depth).sum())
            self.accepted_by_depth[depth - 1] += int((accepted >= depth).sum())
        self.new_tokens += tokens

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_s[name] += time.perf_counter() - start

    def to_dict(self) -> dict[str, object]:
        return {
            "rows": self.rows,
            "steps": self.steps,
            "new_tokens": self.new_tokens,
            "tau": round(self.tau, 4),
            "acceptance_by_depth": [round(a, 4) for a in self.acceptance_by_depth],
            "phase_s": {k: round(v, 4) for k, v in self.phase_s.items()},
            "prefill_s": round(self.prefill_s, 4),
            "ttft_s": round(self.ttft_s, 4),
            "tpot_s": round(self.tpot_s, 5),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "total_s": round(self.total_s, 4),
            "mean_tree_size": round(self.mean_tree_size, 2),
            "fallback_fraction": round(self.fallback_fraction, 4),
            "adaptive_fallback_fraction": round(self.adaptive_fallback_fraction, 4),
        }

    def summary(self) -> str:
        rates = ", ".join(f"{r:.2f}" for r in self.acceptance_by_depth)
        return (
            f"{self.new_tokens} tokens in {self.total_s:.2f} s ({self.tokens_per_s:.1f} tok/s), "
            # no decoding step (every row ended at its first token): no tau to tell, as medusa-bench's "-"
            f"{self.steps} steps, tau {f'{self.tau:.2f}' if self.row_steps else '-'}, acceptance by depth [{rates}], "
            f"TTFT {self.ttft_s * 1000:.0f} ms, TPOT {self.tpot_s * 1000:.1f} ms"
        )
