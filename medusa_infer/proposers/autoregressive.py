"""Plain decoding as a proposer: the root alone, one token a step (the baseline of every method)."""

from __future__ import annotations

import torch

from medusa_infer.proposers.base import Proposal, StepContext
from medusa_infer.trees import root_only_tree


class AutoregressiveProposer:
    """Proposes nothing beyond the root: each step verifies one token, as ``model.generate`` does.

    Args:
        model: the target ``MedusaModel`` (only its device is read).
    """

    def __init__(self, model) -> None:
        self.tree = root_only_tree().to(model.device)

    def start(self, context: StepContext, hidden: torch.Tensor) -> None:
        pass

    def propose(self, roots: torch.Tensor, context: StepContext) -> Proposal:
        return Proposal(roots[:, None], self.tree)

    def observe(self, accepted: list[list[int]], hidden: torch.Tensor, context: StepContext) -> None:
        pass

    def select_rows(self, rows: torch.Tensor) -> None:
        pass

    def merge(self, other: "AutoregressiveProposer") -> None:
        pass  # no per-row state
