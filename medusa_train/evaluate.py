"""Held-out evaluation of trained heads, the tree fitted to their accuracies, and the final save.

Per head, top-1..top-k accuracy (cumulative: the target is among the head's k best) over the
held-out positions where decoding runs the heads and head 0 has a target: from the last prompt
position (where the base model predicts the answer's first token) to two before the answer's last
token, the rows of the feature cache and of live features (``features.block_from_hidden``).
Positions before it, inside the chat template, have targets for some heads (head 0's at the
second-to-last prompt position) but decoding never runs heads there: no row is made there, and
``head_accuracy`` leaves positions without a head-0 target out of any other batch, so accuracies
and path ranks count the same positions. A target outside a reduced vocabulary counts as a miss.
Trees are fitted to the joint acceptance of paths: at each held-out position, the rank of each
head's target; a path is accepted where every rank along it is right.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from medusa_infer.checkpoint import push_folder_to_hub, save_heads
from medusa_infer.config import MedusaConfig
from medusa_infer.trees import expected_accept_length, greedy_tree, path_frequencies
from medusa_train.losses import IGNORE, topk_correct


#: Paths whose joint acceptance is kept in the heads' config (``path_accuracies``) at least: more
#: than the usual fitted trees use (a larger ``eval.tree_size`` keeps that many).
MAX_STORED_PATHS = 128


@dataclass
class HeadAccuracy:
    """``hits[k][j]``: positions where head k's target is in its top ``j + 1``; ``totals[k]``;
    ``ranks`` ``[positions, K]``: the rank of each head's target at each position, -1 for a miss
    (or no target); ``starts`` ``[positions]``: where a run of one answer's consecutive positions
    begins (None when the batches did not say)."""

    hits: torch.Tensor
    totals: torch.Tensor
    ranks: torch.Tensor
    starts: torch.Tensor | None = None

    def topk(self) -> list[list[float]]:
        """``[K][top_k]`` cumulative accuracies (what ``MedusaConfig.head_accuracies`` holds)."""
        acc = self.hits.double() / self.totals.clamp(min=1).double().unsqueeze(1)
        return [[round(float(x), 5) for x in row] for row in acc]

    def paths(self, max_paths: int | None = MAX_STORED_PATHS) -> dict[tuple[int, ...], float]:
        """Joint acceptance of the most probable paths (what ``greedy_tree`` is fitted to)."""
        return {path: round(prob, 6) for path, prob in path_frequencies(self.ranks, max_paths).items()}


def target_ranks(logits: torch.Tensor, targets: torch.Tensor, max_k: int) -> torch.Tensor:
    """``[N, K]`` rank of each head's target among its ``max_k`` best, -1 when it is not among
    them (or the head has no target there). ``logits`` ``[K, N, V]``, ``targets`` ``[N, K]`` as
    in :func:`medusa_train.losses.topk_correct`."""
    top = logits.topk(min(max_k, logits.shape[-1]), dim=-1).indices  # [K, N, k]
    match = top == targets.t().long().unsqueeze(-1)
    ranks = torch.where(match.any(-1), match.long().argmax(-1), torch.full_like(match[..., 0], -1, dtype=torch.long))
    return ranks.t()


@torch.no_grad()
def head_accuracy(head_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  batches: Iterable[Mapping[str, torch.Tensor]], top_k: int = 10,
                  device: torch.device | str = "cpu") -> HeadAccuracy:
    """Accumulate accuracies over batches of ``{"hidden" [N, H], "targets" [N, K],
    "next_tokens" [N], "path_tokens" [N, K - 1]}`` (path tokens: base ids at t + 2 onwards,
    optional, passed as ``path_tokens=`` when present); ``head_logits(hidden, next_tokens) -> [K, N, V]``.
    Only positions where head 0 has a target count; batches hold only positions where decoding
    runs the heads (see the module's docstring)."""
    hits = totals = None
    ranks, starts = [], []
    for batch in batches:
        extra = {"path_tokens": batch["path_tokens"].to(device)} if "path_tokens" in batch else {}
        logits = head_logits(batch["hidden"].to(device), batch["next_tokens"].to(device), **extra)
        targets = batch["targets"].to(device)
        decoded = targets[:, 0] != IGNORE
        logits, targets = logits[:, decoded], targets[decoded]
        h, n = topk_correct(logits, targets, top_k)
        hits = h.cpu() if hits is None else hits + h.cpu()
        totals = n.cpu() if totals is None else totals + n.cpu()
        ranks.append(target_ranks(logits, targets, top_k).cpu())
        if starts is not None and "run_start" in batch:
            starts.append(batch["run_start"][decoded.to(batch["run_start"].device)].cpu())
        else:
            starts = None
    if hits is None or int(totals[0]) == 0:  # (a live example is a batch, an empty one too: finalize failed later)
        raise ValueError("no held-out positions where the heads run (answers of at least 2 labelled tokens, the "
                         "base model's next token and head 1's target): raise data.heldout_fraction, or give longer "
                         "answers")
    return HeadAccuracy(hits, totals, torch.cat(ranks), torch.cat(starts) if starts else None)


def stored_paths(accuracy: HeadAccuracy, tree_size: int) -> dict[tuple[int, ...], float]:
    """The joint path accuracies kept with heads fitted to a ``tree_size``-node tree: the
    ``max(MAX_STORED_PATHS, tree_size)`` most probable paths."""
    return accuracy.paths(max(MAX_STORED_PATHS, tree_size))


def fit_tree(accuracy: HeadAccuracy, size: int) -> list[tuple[int, ...]]:
    """The ``size``-node tree maximising the expected accepted length under the measured joint
    path accuracies (capped at the number of paths ever accepted; none: the empty tree, plain
    decoding, as heads that never guessed right would measure fastest)."""
    paths = stored_paths(accuracy, size)
    return greedy_tree(paths, min(size, len(paths))) if paths else []


def expected_tokens_per_step(tree: list[tuple[int, ...]], paths: Mapping[tuple[int, ...], float]) -> float:
    """The fitted tree's expected tokens per step under the measured path accuracies, as an average
    over every held-out position; 1.0 for the empty tree (plain decoding), whose heads may never have
    been accepted at all."""
    return expected_accept_length(tree, paths) if tree else 1.0


def walked_tokens_per_step(tree: list[tuple[int, ...]], accuracy: HeadAccuracy) -> float | None:
    """Tokens per step of greedy decoding with ``tree`` over the held-out answers, as ``metrics.tau``
    counts them (the prefill's first token is no step's): each answer is walked as decoding walks it, a
    step at a position emitting the tree's longest path whose ranks are all right there and the base
    model's next token, the next step at the position after them (None without ``accuracy.starts``). Decoding runs the heads where the last step ended, which falls on hard
    positions more often than the average over every position does (easy runs are crossed in one
    step): the walk is what decoding meets, usually below that average."""
    if accuracy.starts is None:
        return None
    accepted_paths = set(tree)
    ranks, starts = accuracy.ranks.tolist(), accuracy.starts.tolist()
    bounds = sorted({0, *(i for i, start in enumerate(starts) if start)}) + [len(starts)]
    tokens = steps = 0
    for first, end in zip(bounds, bounds[1:]):
        # heads run from the prompt's last position to two before the answer's end: the answer holds one
        # token more than there are rows, its first the prefill's (no step's, as metrics.tau counts them);
        # a step at row r emits the answer's tokens r + 1 on (its path, then the base model's next token)
        rows, at = end - first, 0
        while at < rows:
            path: tuple[int, ...] = ()
            for rank in ranks[first + at]:
                if rank < 0 or path + (rank,) not in accepted_paths:
                    break
                path += (rank,)
            made = min(1 + len(path), rows - at)
            tokens, steps, at = tokens + made, steps + 1, at + made
    return tokens / steps if steps else 1.0


def reported_tokens_per_step(tree: list[tuple[int, ...]], accuracy: HeadAccuracy,
                             paths: Mapping[tuple[int, ...], float]) -> float:
    """What the heads' config and the summary report: greedy decoding walked over the held-out answers
    (``walked_tokens_per_step``), else, for batches that did not say where answers begin, the average
    over positions (which runs high)."""
    walked = walked_tokens_per_step(tree, accuracy)
    return walked if walked is not None else expected_tokens_per_step(tree, paths)


def summary_table(accuracy: HeadAccuracy, tree: list[tuple[int, ...]]) -> str:
    """Per-head top-1/3/5/10 accuracy and the tree's expected tokens per step."""
    topk = accuracy.topk()
    shown = [k for k in (1, 3, 5, 10) if k <= len(topk[0])]
    lines = ["head  positions  " + "  ".join(f"top-{k:<3}" for k in shown)]
    for i, row in enumerate(topk):
        lines.append(f"{i + 1:>4}  {int(accuracy.totals[i]):>9}  " + "  ".join(f"{row[k - 1]:<7.3f}" for k in shown))
    accept = reported_tokens_per_step(tree, accuracy, stored_paths(accuracy, len(tree)))
    lines.append(f"tree: {len(tree)} nodes, expected tokens per step {accept:.3f} (1.0 = plain decoding)")
    return "\n".join(lines)


def finalize(folder: str | Path, config: MedusaConfig, heads_state: Mapping[str, torch.Tensor],
             accuracy: HeadAccuracy, tree_size: int, base_model_id: str | None = None,
             extra: Mapping[str, Any] | None = None, chat: bool = True) -> Path:
    """Store accuracies and the fitted tree in the heads' config and save the heads with their card (``chat``:
    whether the base model's tokenizer renders chats, ``save_heads``)."""
    tree = fit_tree(accuracy, tree_size)
    paths = stored_paths(accuracy, tree_size)
    config.head_accuracies = accuracy.topk()
    config.path_accuracies = [[list(path), prob] for path, prob in paths.items()]
    config.tree = [list(path) for path in tree]
    config.top_k = len(config.head_accuracies[0])
    config.acceptance = {
        "expected_tokens_per_step_fitted_tree": round(reported_tokens_per_step(tree, accuracy, paths), 4),
        "heldout_positions": [int(n) for n in accuracy.totals],
    }
    if extra:
        config.training = {**config.training, **extra}
    return save_heads(folder, config, dict(heads_state), base_model_id, chat)


def push_to_hub(folder: str | Path, repo_id: str, private: bool | None = None) -> str:
    """Upload a saved heads folder (as ``MedusaModel.push_to_hub`` does); returns the commit URL."""
    return push_folder_to_hub(folder, repo_id, private=private)
