"""Proposers: what suggests candidate tokens for the shared verifier.

``build_proposer(method, model, options)`` is the one place that maps a method name to a proposer.
"""

from __future__ import annotations

from typing import Any

from medusa_infer.proposers.base import Proposal, Proposer, StepContext
from medusa_infer.proposers.medusa import MedusaProposer

METHODS = ("medusa", "autoregressive")


def build_proposer(method: str, model: Any, options: Any = None) -> Proposer:
    """A fresh proposer (one per generation call) for ``method``.

    Args:
        method: one of ``METHODS``.
        model: the target ``MedusaModel``.
        options: an object with the method's settings as attributes (e.g. CLI arguments):
            ``tree`` for medusa.
    """
    if method == "medusa":
        from medusa_infer.decoding import resolve_tree

        return MedusaProposer(model, resolve_tree(model, getattr(options, "tree", None)))
    if method == "autoregressive":
        return MedusaProposer(model, [])
    raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")


__all__ = ["METHODS", "Proposal", "Proposer", "StepContext", "MedusaProposer", "build_proposer"]
