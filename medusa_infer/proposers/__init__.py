"""Proposers: what suggests candidate tokens for the shared verifier.

``build_proposer(method, model, options)`` is the one place that maps a method name to a proposer.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from medusa_infer.proposers.autoregressive import AutoregressiveProposer
from medusa_infer.proposers.base import Proposal, Proposer, StepContext
from medusa_infer.proposers.draft import DraftProposer
from medusa_infer.proposers.layerskip import LayerSkipProposer
from medusa_infer.proposers.lookup import LOOKUP_MAX_TOKENS, LookupProposer
from medusa_infer.proposers.medusa import MedusaProposer

METHODS = ("medusa", "draft", "lookup", "layerskip", "autoregressive")

DEFAULT_DRAFT_TOKENS = 4
"""k for draft, layerskip (first k) and lookup (lookup without a cost profile; with one, its gate
chooses each draft's length up to ``lookup_max_tokens``): on CPU, verifying 2 to 5 tokens costs
about the same (1.7x one token), 9 tokens about 2x (docs/NOTES), so short chains pay off first."""


SETTINGS = ("adaptive", "datastore", "draft_model", "draft_schedule", "draft_tokens", "layerskip_layers",
            "lookup_max_ngram", "lookup_max_tokens", "lookup_min_ngram", "lookup_tokens", "step_costs", "tree")
"""The settings ``build_proposer`` reads, one method's or another's."""


def proposer_options(options: Any) -> Any:
    """``options`` as ``build_proposer`` reads them: a mapping's entries as attributes (they were read as
    attributes: every setting given was dropped). ``ValueError`` naming a mapping's key that no method reads
    (a misspelled one was silently dropped); an object's other attributes are left alone (command-line
    arguments hold more than these)."""
    if not isinstance(options, Mapping):
        return options
    unknown = sorted(set(options) - set(SETTINGS))
    if unknown:
        raise ValueError(f"unknown proposer settings {unknown}: the methods read {', '.join(SETTINGS)}")
    return SimpleNamespace(**options)


def build_proposer(method: str, model: Any, options: Any = None) -> Proposer:
    """A fresh proposer (one per generation call) for ``method``.

    Args:
        method: one of ``METHODS``.
        model: the target ``MedusaModel``.
        options: an object with the method's settings as attributes (e.g. CLI arguments), or a mapping, each
            optional: ``tree``, ``lookup_tokens`` (medusa: a grafted prompt-lookup chain);
            ``draft_model`` (draft: a name or a loaded model);
            ``draft_tokens`` (k for draft, layerskip and lookup); ``draft_schedule``
            (``heuristic`` or ``constant``); ``lookup_max_ngram``, ``lookup_min_ngram`` (lookup, and
            medusa's lookup chain);
            ``lookup_max_tokens`` (the longest lookup draft a cost profile may choose);
            ``datastore`` (lookup and medusa's lookup chain also search the model's datastore,
            ``MedusaModel.datastore``, when it has one; default True); ``layerskip_layers``;
            ``adaptive`` and ``step_costs`` (medusa: as ``decoding.generate``'s).

    The decoding loop hands the proposer its random generator (``configure``); each step's
    ``StepContext.samplings`` tell a draft which rows to sample, and how. Settings ``method`` does
    not read are ignored (a server passes one options object to every method); ``decoding.generate``
    refuses them by name.
    """

    options = proposer_options(options)

    def option(name: str, default: Any = None) -> Any:
        value = getattr(options, name, None)
        return default if value is None else value

    datastore = getattr(model, "datastore", None) if option("datastore", True) else None
    if method == "medusa":
        from medusa_infer.decoding import make_controller, resolve_tree

        paths = resolve_tree(model, option("tree"))
        controller = make_controller(model, paths, option("adaptive"), option("step_costs"))
        return MedusaProposer(model, paths, controller=controller,
                              lookup_tokens=option("lookup_tokens", 0),
                              lookup_ngram=(option("lookup_max_ngram", 3), option("lookup_min_ngram", 1)),
                              lookup_max_tokens=option("lookup_max_tokens", LOOKUP_MAX_TOKENS),
                              datastore=datastore)
    if method == "autoregressive":
        return AutoregressiveProposer(model)
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    k = option("draft_tokens", DEFAULT_DRAFT_TOKENS)
    if method == "lookup":
        return LookupProposer(model, num_tokens=k, max_ngram=option("lookup_max_ngram", 3),
                              min_ngram=option("lookup_min_ngram", 1),
                              max_tokens=option("lookup_max_tokens", LOOKUP_MAX_TOKENS), datastore=datastore)
    schedule = option("draft_schedule", "heuristic")
    if method == "layerskip":
        return LayerSkipProposer(model, option("layerskip_layers"), num_tokens=k, schedule=schedule)
    draft = option("draft_model")
    if draft is None:
        raise ValueError("method 'draft' needs a draft model (options.draft_model, --draft-model)")
    return DraftProposer(model, draft, num_tokens=k, schedule=schedule)


__all__ = [
    "METHODS",
    "AutoregressiveProposer",
    "DraftProposer",
    "LayerSkipProposer",
    "LookupProposer",
    "MedusaProposer",
    "Proposal",
    "Proposer",
    "StepContext",
    "build_proposer",
    "proposer_options",
]
