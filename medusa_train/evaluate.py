"""Held-out evaluation of trained heads, the tree fitted to their accuracies, and the final save.

Per head, top-1..top-k accuracy (cumulative: the target is among the head's k best) over every
held-out position where the head has a target; a target outside a reduced vocabulary counts as a
miss. ``greedy_tree`` wants the probability that rank r (exactly) is right, which is the
difference of consecutive cumulative accuracies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from medusa_infer.checkpoint import push_folder_to_hub, save_heads
from medusa_infer.config import MedusaConfig
from medusa_infer.trees import expected_accept_length, greedy_tree
from medusa_train.losses import topk_correct


@dataclass
class HeadAccuracy:
    """``hits[k][j]``: positions where head k's target is in its top ``j + 1``; ``totals[k]``."""

    hits: torch.Tensor
    totals: torch.Tensor

    def topk(self) -> list[list[float]]:
        """``[K][top_k]`` cumulative accuracies (what ``MedusaConfig.head_accuracies`` holds)."""
        acc = self.hits.double() / self.totals.clamp(min=1).double().unsqueeze(1)
        return [[round(float(x), 5) for x in row] for row in acc]

    def per_rank(self) -> list[list[float]]:
        """``[K][top_k]`` probability that exactly rank r is right (what ``greedy_tree`` takes)."""
        rows = []
        for row in self.topk():
            rows.append([max(0.0, b - a) for a, b in zip([0.0] + row[:-1], row)])
        return rows


@torch.no_grad()
def head_accuracy(head_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  batches: Iterable[Mapping[str, torch.Tensor]], top_k: int = 10,
                  device: torch.device | str = "cpu") -> HeadAccuracy:
    """Accumulate accuracies over batches of ``{"hidden" [N, H], "targets" [N, K],
    "next_tokens" [N]}``; ``head_logits(hidden, next_tokens) -> [K, N, V]``."""
    hits = totals = None
    for batch in batches:
        logits = head_logits(batch["hidden"].to(device), batch["next_tokens"].to(device))
        h, n = topk_correct(logits, batch["targets"].to(device), top_k)
        hits = h.cpu() if hits is None else hits + h.cpu()
        totals = n.cpu() if totals is None else totals + n.cpu()
    if hits is None:
        raise ValueError("no held-out batches to evaluate on; raise data.heldout_fraction")
    return HeadAccuracy(hits, totals)


def fit_tree(accuracy: HeadAccuracy, size: int) -> list[tuple[int, ...]]:
    """The ``size``-node tree maximising the expected accepted length under these accuracies
    (capped at the number of paths the heads and ranks allow)."""
    per_rank = accuracy.per_rank()
    top_k, depth = len(per_rank[0]), len(per_rank)
    capacity = sum(top_k**d for d in range(1, depth + 1))
    return greedy_tree(per_rank, min(size, capacity))


def summary_table(accuracy: HeadAccuracy, tree: list[tuple[int, ...]]) -> str:
    """Per-head top-1/3/5/10 accuracy and the tree's expected tokens per step."""
    topk = accuracy.topk()
    shown = [k for k in (1, 3, 5, 10) if k <= len(topk[0])]
    lines = ["head  positions  " + "  ".join(f"top-{k:<3}" for k in shown)]
    for i, row in enumerate(topk):
        lines.append(f"{i + 1:>4}  {int(accuracy.totals[i]):>9}  " + "  ".join(f"{row[k - 1]:<7.3f}" for k in shown))
    accept = expected_accept_length(tree, accuracy.per_rank())
    lines.append(f"tree: {len(tree)} nodes, expected tokens per step {accept:.3f} (1.0 = plain decoding)")
    return "\n".join(lines)


def finalize(folder: str | Path, config: MedusaConfig, heads_state: Mapping[str, torch.Tensor],
             accuracy: HeadAccuracy, tree_size: int, base_model_id: str | None = None,
             extra: Mapping[str, Any] | None = None) -> Path:
    """Store accuracies and the fitted tree in the heads' config and save the heads with their card."""
    tree = fit_tree(accuracy, tree_size)
    config.head_accuracies = accuracy.topk()
    config.tree = [list(path) for path in tree]
    config.top_k = len(config.head_accuracies[0])
    config.acceptance = {
        "expected_tokens_per_step_fitted_tree": round(expected_accept_length(tree, accuracy.per_rank()), 4),
        "heldout_positions": [int(n) for n in accuracy.totals],
    }
    if extra:
        config.training = {**config.training, **extra}
    return save_heads(folder, config, dict(heads_state), base_model_id)


def push_to_hub(folder: str | Path, repo_id: str, private: bool | None = None) -> str:
    """Upload a saved heads folder (as ``MedusaModel.push_to_hub`` does); returns the commit URL."""
    return push_folder_to_hub(folder, repo_id, private=private)
