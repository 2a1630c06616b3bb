"""Losses and accuracy for Medusa heads: pure functions over tensors.

Shapes: ``K`` heads, ``N`` positions, ``V`` head vocabulary (the reduced one when the heads use a
``token_map``), ``k`` soft-label candidates. Head logits come as ``[K, N, V]`` (what
``MedusaHeads`` returns for ``[N, hidden]`` input); targets as ``[N, K]`` column indices into the
head vocabulary, with

* ``IGNORE`` (-100): no target (not an assistant token, or past the end of the example);
* ``OUT_OF_VOCAB`` (-1): a real target the reduced vocabulary cannot express (left out of the
  losses, counted as a miss by the accuracy).

Head ``k`` is weighted ``decay**k`` and the weights are normalised to sum to 1, so the loss stays on
the scale of one cross-entropy whatever the number of heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

IGNORE = -100
OUT_OF_VOCAB = -1


@dataclass
class HeadLoss:
    """A weighted loss over heads.

    Attributes:
        loss: scalar, ``sum_k weight_k * per_head[k]``.
        per_head: ``[K]`` each head's loss sum over its denominator (detached): its mean over its valid
            positions when no ``denominators`` are given.
        counts: ``[K]`` valid positions per head.
        sums: ``[K]`` each head's loss summed over its valid positions (detached), so that means over
            several calls are ``sum(sums) / sum(counts)``.
    """

    loss: torch.Tensor
    per_head: torch.Tensor
    counts: torch.Tensor
    sums: torch.Tensor


def head_weights(num_heads: int, decay: float, device: torch.device | str | None = None) -> torch.Tensor:
    """``[K]`` weights ``decay**k / sum_j decay**j``."""
    if num_heads < 1 or not decay > 0:
        raise ValueError(f"need num_heads >= 1 and decay > 0, got num_heads={num_heads}, decay={decay}")
    weights = torch.tensor([decay**k for k in range(num_heads)], dtype=torch.float32, device=device)
    return weights / weights.sum()


def to_head_vocab(ids: torch.Tensor, token_map: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Map base token ids to head-vocabulary columns.

    Negative entries (``IGNORE`` and friends) pass through; ids that ``token_map`` (``[V]`` base ids
    of the head columns) does not hold become ``OUT_OF_VOCAB``. Without a ``token_map`` the ids are
    the columns.
    """
    if token_map is None:
        return ids
    lookup = torch.full((vocab_size,), OUT_OF_VOCAB, dtype=torch.long, device=ids.device)
    lookup[token_map.to(ids.device)] = torch.arange(len(token_map), device=ids.device)
    return torch.where(ids >= 0, lookup[ids.clamp(min=0).long()], ids.long())


def _divisor(denominator: torch.Tensor) -> torch.Tensor:
    """``denominator`` with zeros (no position to average over, so a zero sum) replaced by 1.
    Nothing else is raised: a step's denominators are its counts over processes x micro-batches
    (``trainer.step_denominators``), below 1 where a loss term has fewer positions than that."""
    return torch.where(denominator > 0, denominator, torch.ones_like(denominator))


def _weighted(per_sum: torch.Tensor, counts: torch.Tensor, decay: float,
              denominators: torch.Tensor | None) -> HeadLoss:
    """Turn per-head loss sums ``[K]`` into a ``HeadLoss``; ``denominators`` (``[K]``, e.g. counts
    summed over all processes) replace the local counts when given."""
    per_head = per_sum / _divisor((counts if denominators is None else denominators).to(per_sum.dtype))
    weights = head_weights(len(per_sum), decay, per_sum.device)
    return HeadLoss(loss=(weights * per_head).sum(), per_head=per_head.detach(), counts=counts, sums=per_sum.detach())


def head_ce_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    decay: float = 0.8,
    denominators: torch.Tensor | None = None,
) -> HeadLoss:
    """Cross-entropy of each head against its hard targets.

    Args:
        logits: ``[K, N, V]`` heads' logits.
        targets: ``[N, K]`` head-vocabulary columns; ``IGNORE`` and ``OUT_OF_VOCAB`` are left out.
        decay: head ``k`` weighs ``decay**k`` (normalised).
        denominators: ``[K]`` divisors instead of the local valid counts (training divides by the
            counts of the optimizer step's micro-batches on all processes, so the mean is over the
            step's whole batch: ``trainer.step_denominators``).
    """
    num_heads, n, vocab = logits.shape
    if targets.shape != (n, num_heads):
        raise ValueError(f"targets have shape {tuple(targets.shape)}, expected ({n}, {num_heads}) for "
                         f"logits of shape {tuple(logits.shape)}")
    targets = targets.t().long()  # [K, N]
    valid = targets >= 0
    losses = F.cross_entropy(
        logits.float().reshape(-1, vocab), targets.clamp(min=0).reshape(-1), reduction="none"
    ).view(num_heads, n)
    per_sum = (losses * valid).sum(dim=1)
    return _weighted(per_sum, valid.sum(dim=1), decay, denominators)


def head_kl_loss(
    logits: torch.Tensor,
    soft_ids: torch.Tensor,
    soft_probs: torch.Tensor,
    decay: float = 0.8,
    denominators: torch.Tensor | None = None,
) -> HeadLoss:
    """KL(p || q) of each head's distribution q against a top-k soft target p.

    The target of head ``k`` at position ``t`` is the base model's distribution at position
    ``t + k + 1`` (its prediction of token ``t + k + 2``), given as its top-k candidates. Candidates
    the head vocabulary lacks (negative ids) are dropped and the rest renormalised; positions whose
    candidates are all dropped, or whose probabilities are all 0 (no target), are left out.

    Args:
        logits: ``[K, N, V]`` heads' logits.
        soft_ids: ``[N, K, k]`` head-vocabulary columns of the candidates (negative: none).
        soft_probs: ``[N, K, k]`` their probabilities.
        decay, denominators: as in :func:`head_ce_loss`.
    """
    num_heads, n, _ = logits.shape
    if soft_ids.shape[:2] != (n, num_heads) or soft_probs.shape != soft_ids.shape:
        raise ValueError(f"soft labels have shapes {tuple(soft_ids.shape)} and {tuple(soft_probs.shape)}, "
                         f"expected ({n}, {num_heads}, k) for logits of shape {tuple(logits.shape)}")
    ids = soft_ids.permute(1, 0, 2).long()  # [K, N, k]
    probs = soft_probs.permute(1, 0, 2).float() * (ids >= 0)
    mass = probs.sum(dim=-1, keepdim=True)
    valid = mass.squeeze(-1) > 0  # [K, N]
    probs = probs / torch.where(mass > 0, mass, 1.0)  # (a floor of 1e-12 left a tiny mass unnormalised: KL < 0)
    log_q = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.clamp(min=0))
    kl = (torch.special.xlogy(probs, probs) - probs * log_q).sum(dim=-1)  # [K, N]
    per_sum = (kl * valid).sum(dim=1)
    return _weighted(per_sum, valid.sum(dim=1), decay, denominators)


def logits_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    denominator: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean KL(teacher || student) over the full vocabulary at the masked positions.

    Args:
        student_logits, teacher_logits: ``[..., V]``.
        mask: ``[...]`` bool, the positions to average over (all when None).
        denominator: divisor instead of the local number of positions.
    """
    log_q = torch.log_softmax(student_logits.float(), dim=-1)
    log_p = torch.log_softmax(teacher_logits.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    if mask is None:
        mask = torch.ones_like(kl, dtype=torch.bool)
    return (kl * mask).sum() / _divisor(mask.sum() if denominator is None else denominator)


def topk_correct(logits: torch.Tensor, targets: torch.Tensor, max_k: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head top-1..top-``max_k`` hit counts.

    Args:
        logits: ``[K, N, V]``.
        targets: ``[N, K]`` columns; ``IGNORE`` is left out, ``OUT_OF_VOCAB`` counts as a miss.

    Returns:
        ``(hits, totals)``: ``hits[k, j]`` positions where head k's target is in its top ``j + 1``
        (cumulative), ``[K, max_k]`` long; ``totals`` ``[K]`` long.
    """
    num_heads, _, vocab = logits.shape
    max_k = min(max_k, vocab)
    targets = targets.t().long()  # [K, N]
    counted = targets != IGNORE
    top = logits.topk(max_k, dim=-1).indices  # [K, N, max_k]
    hit = (top == targets.unsqueeze(-1)) & counted.unsqueeze(-1)
    hits = hit.long().cumsum(dim=-1).sum(dim=1)  # [K, max_k]
    return hits, counted.sum(dim=1)
