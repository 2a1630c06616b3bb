"""A draft model as a proposer: a second, smaller causal LM drafts ``k`` tokens a step.

One step, for every active row at once::

    catch up: feed the tokens the draft has not seen (the new root, maybe the last accepted
              draft), left-aligned with holes so rows of different lengths share one forward
    draft:    k tokens, one forward each (argmax when the verifier is greedy; else sampled from
              the draft's distribution warped like the target's, and reported as draft_probs)
    observe:  keep the KV slots of the accepted drafts, drop the others (no second forward);
              adapt k to the acceptance

The draft has its own ``KVState``, so left padding, rows that accept different lengths and rows
that leave the batch work as in the target's cache. A draft that is the target's own first layers
(layerskip, or the target itself) copies the prompts' keys and values of those layers from the
target's cache after its prefill instead of running its own prefill (the same weights over the
same tokens: the same keys and values): its first token costs no more than plain decoding's. The
draft must share the target's tokenizer: its tokens are the target's token ids, and ``draft_probs``
must be over the same vocabulary.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from typing import Any

import torch

from medusa_infer.acceptance import greedy_tokens, warp_logits
from medusa_infer.kv_cache import AttentionLayout, KVState
from medusa_infer.metrics import RECENT_STEPS
from medusa_infer.proposers.base import ChainTrees, Proposal, StepContext, row_groups, whole_number

logger = logging.getLogger(__name__)
_UNCHECKED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # draft models whose tokenizer was said to go unchecked
_SAME_VOCABULARY: "weakref.WeakKeyDictionary[Any, weakref.WeakKeyDictionary[Any, tuple[int, int]]]" = \
    weakref.WeakKeyDictionary()
"""Per target tokenizer, the draft tokenizers found to hold its vocabulary, with both sizes then: a proposer is
built for every server batch and chat turn, and comparing two vocabularies takes 0.1 s (SmolLM2's 49k entries)
to 0.8 s (Gemma-3's 262k); checked again where a tokenizer has grown since (an entry changed in place, the size
kept, goes unseen: a tokenizer's vocabulary is not meant to change so)."""

SCHEDULES = ("heuristic", "constant")


class DraftProposer:
    """Speculative decoding with a draft model (Leviathan et al. / Chen et al., 2023).

    Args:
        target: the target ``MedusaModel``.
        draft: the draft: a ``MedusaModel`` (heads ignored), a transformers causal LM, or a name
            (default-model name, folder or Hub id) to load.
        num_tokens: tokens drafted a step at first (k).
        schedule: ``"heuristic"`` (transformers' rule: k + 2 after a step in which the draft was
            accepted whole, k - 1 otherwise, at least 1; in a batch, "accepted whole" by most
            rows) or ``"constant"``.
        max_tokens: the heuristic never drafts more than this (default: 16, or ``num_tokens`` if more;
            less than ``num_tokens`` is refused).
        draft_tokenizer: the draft's tokenizer, for the vocabulary check (default: the draft's own).
    """

    catches_up = True
    """Its first drafting after plain steps also feeds the draft their tokens (``speculation_gate`` reads it)."""

    def __init__(self, target, draft: Any, num_tokens: int = 4, schedule: str = "heuristic",
                 max_tokens: int | None = None, draft_tokenizer: Any = None) -> None:
        num_tokens = whole_number("num_tokens", num_tokens, 1)
        max_tokens = max(16, num_tokens) if max_tokens is None else whole_number("max_tokens", max_tokens, 1)
        if max_tokens < num_tokens:
            raise ValueError(f"max_tokens={max_tokens} is less than num_tokens={num_tokens}, the tokens drafted at "
                             "first: raise max_tokens or lower num_tokens")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.draft = as_draft_model(draft, draft_tokenizer, target)
        check_same_vocabulary(target, self.draft)
        self.vocab = target.lm_head.weight.shape[0]  # drafts are the target's tokens (fit_vocabulary)
        self.draft_vocab = self.draft.base_model.get_input_embeddings().weight.shape[0]
        self.k, self.schedule, self.max_tokens = num_tokens, schedule, max_tokens
        self.trees = ChainTrees(target.device)
        self.device = self.draft.device
        from medusa_infer.decoding import context_length

        self.context_length = context_length(self.draft)
        self.layout = AttentionLayout.from_config(self.draft.base_model.config)
        self.shared_layers = shared_layers(target, self.draft)
        self.target_layers = getattr(target.base_model.config.get_text_config(), "num_hidden_layers", None)
        self.generator: torch.Generator | None = None
        self.kv = KVState.empty(0, self.layout, self.device)
        self.cached: list[int] = []  # per row: history tokens in the draft's cache
        self.drafted = 0  # tokens drafted in the current step
        self.k_per_step: deque[int] = deque(maxlen=RECENT_STEPS)  # k at each recent step (inspection, tests)

    # -- the Proposer protocol --------------------------------------------------------------

    def configure(self, generator: torch.Generator | None) -> None:
        """The generator that rows verified losslessly draw their drafts from."""
        if generator is not None and generator.device != self.device:  # a draft on another device: a generator
            # there, seeded from the verifier's (torch.multinomial refuses one of another device)
            seed = int(torch.randint(2**62, (1,), generator=generator, device=generator.device))
            generator = torch.Generator(device=self.device).manual_seed(seed)
        self.generator = generator

    def start(self, context: StepContext, hidden: torch.Tensor) -> None:
        batch = len(context.sequences)
        self.kv = KVState.empty(batch, self.layout, self.device)
        self.cached = [0] * batch
        if self._room(context) <= 0:
            return  # no prompt token fits the draft's context: nothing to draft from
        if self.shared_layers and context.target_kv is not None and \
                len(context.target_kv.cache.layers) == self.target_layers:  # a cache layer per decoder layer
            self.kv = context.target_kv.copy(self.shared_layers, self.layout)
            self.cached = [len(s) for s in context.sequences]
        else:
            self._catch_up(context.sequences)  # the draft's prefill

    def propose(self, roots: torch.Tensor, context: StepContext) -> Proposal:
        depth = max(0, min(self.k, context.max_depth, self._room(context)))
        self.drafted = depth
        tree = self.trees.at_depth(depth)
        if depth == 0:
            return Proposal(roots[:, None], tree)
        logits = self._catch_up(context.sequences)
        positions = torch.tensor([len(s) for s in context.sequences], device=self.device)
        tokens, probs = [], []
        for step in range(depth):
            token, q = self._choose(logits, context.samplings)
            tokens.append(token)
            probs.append(q)
            if step + 1 < depth:  # the last draft is fed at the next catch-up, if accepted
                logits = self._feed_one(token, positions + step)
        chain = torch.stack([roots.to(self.device)] + tokens, dim=1).to(roots.device)
        draft_probs = None if probs[0] is None else torch.stack(probs, dim=1).to(roots.device)
        return Proposal(chain, tree, draft_probs)

    def observe(self, accepted: list[list[int]], hidden: torch.Tensor, context: StepContext) -> None:
        fed = max(self.drafted - 1, 0)
        lengths = [len(tokens) - 1 for tokens in accepted]  # accepted drafts per row
        if fed:
            slot = torch.arange(fed, device=self.device)
            kept = torch.tensor(lengths, device=self.device)[:, None].clamp(max=fed)
            self.kv.keep_new(fed, torch.where(slot[None] < kept, slot[None], -1))
            self.cached = [c + min(n, fed) for c, n in zip(self.cached, lengths)]
            self.kv.compact()
        if self.drafted:
            self.k_per_step.append(self.drafted)
        if self.schedule == "heuristic" and self.drafted == self.k:
            full = sum(n == self.k for n in lengths)
            self.k = min(self.k + 2, self.max_tokens) if 2 * full > len(lengths) else max(self.k - 1, 1)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.kv.select_rows(rows.to(self.device))
        self.cached = [self.cached[i] for i in rows.tolist()]
        self.kv.compact()

    def merge(self, other: "DraftProposer") -> None:
        """Append the rows of another proposer with the same draft (batches joining)."""
        if not _same_model(self.draft, other.draft):
            raise ValueError("cannot merge draft proposers with different draft models")
        self.kv.merge(other.kv)
        self.cached += other.cached

    # -- draft forwards ---------------------------------------------------------------------

    def _room(self, context: StepContext) -> int:
        """Deepest draft whose fed tokens stay inside the draft's context."""
        longest = max((len(s) for s in context.sequences), default=0)
        return self.context_length + 1 - longest

    def _catch_up(self, sequences: list[list[int]]) -> torch.Tensor:
        """Feed every row's unseen history tokens in one forward; ``[batch, vocab]`` logits after
        each row's last token. Shorter rows are left-padded with holes."""
        pending = [len(seq) - done for seq, done in zip(sequences, self.cached)]
        width = max(pending)
        ids = torch.tensor([[0] * (width - n) + seq[done:] for seq, done, n in zip(sequences, self.cached, pending)],
                           dtype=torch.long, device=self.device)
        pad = width - torch.tensor(pending, device=self.device)[:, None]  # [batch, 1]
        column = torch.arange(width, device=self.device)[None]
        valid = column >= pad
        done = torch.tensor(self.cached, device=self.device)[:, None]
        positions = torch.where(valid, done + column - pad, 0)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        logits = self._forward(ids, valid, positions, causal)
        self.cached = [len(seq) for seq in sequences]
        return logits

    def _feed_one(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed one drafted token per row at ``positions`` ``[batch]``; the logits after it."""
        valid = torch.ones(len(tokens), 1, dtype=torch.bool, device=self.device)
        one = torch.ones(1, 1, dtype=torch.bool, device=self.device)
        return self._forward(tokens[:, None], valid, positions[:, None], one)

    def _forward(self, ids, valid, positions, new_mask) -> torch.Tensor:
        mask = self.kv.attention_mask(positions, valid, new_mask, self.draft.dtype)
        if self.draft_vocab < self.vocab:  # a padding id of the target's (never a token) is none of the draft's
            ids = ids.clamp(max=self.draft_vocab - 1)
        out = self.draft(ids, attention_mask=mask, position_ids=positions, cache=self.kv.cache,
                         logits_positions=slice(-1, None))
        self.kv.append(valid, positions)
        return fit_vocabulary(out.logits[:, -1].float(), self.vocab)

    def _choose(self, logits: torch.Tensor, samplings: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft token per row: a sample from the warped distribution where the row is verified
        losslessly, else the argmax; with the distributions (``[batch, vocab]``, one-hot on the argmax
        rows), or None when no row samples."""
        sampled = [s if s.acceptance == "lossless" and not s.greedy else None for s in samplings]
        groups = row_groups(sampled)
        if all(s is None for s, _ in groups):
            return greedy_tokens(logits), None
        if len(groups) == 1 and len(sampled) == len(logits):  # every row samples alike: one draw for all
            s = groups[0][0]
            probs = warp_logits(logits, s.temperature, s.top_k, s.top_p)
            return torch.multinomial(probs, 1, generator=self.generator).squeeze(1), probs
        tokens = greedy_tokens(logits)
        probs = torch.zeros_like(logits).scatter_(1, tokens[:, None], 1.0)
        for s, rows in groups:
            if s is not None:
                index = torch.tensor(rows, device=logits.device)
                probs[index] = warp_logits(logits[index], s.temperature, s.top_k, s.top_p)
                tokens[index] = torch.multinomial(probs[index], 1, generator=self.generator).squeeze(1)
        return tokens, probs


def as_draft_model(draft: Any, tokenizer: Any = None, target: Any = None):
    """A ``MedusaModel`` wrapping ``draft`` (a ``MedusaModel``, a causal LM, or a name to load: on
    ``target``'s device and in its dtype when given, else on the CPU in float32), with ``tokenizer``
    (default: the draft's own; for ``target``'s own model, ``target``'s: its vocabulary is the target's)."""
    from transformers import PreTrainedModel

    from medusa_infer.model import MedusaModel
    from medusa_infer.models import load_base_model, load_tokenizer

    if isinstance(draft, MedusaModel):  # its heads are not read: a tokenizer given replaces its own
        return draft if tokenizer is None or tokenizer is draft.tokenizer else MedusaModel(draft.base_model, None,
                                                                                           tokenizer)
    if isinstance(draft, PreTrainedModel):  # (as without_heads takes one: copies packed before a merge dropped)
        if tokenizer is None and target is not None and draft is target.base_model:  # (warned "not checked")
            tokenizer = target.tokenizer
        return MedusaModel.without_heads(draft, tokenizer)
    if isinstance(draft, str):
        placed = {} if target is None else {"device": target.device, "dtype": target.dtype}
        return MedusaModel(load_base_model(draft, **placed), None,
                           tokenizer if tokenizer is not None else load_tokenizer(draft))
    raise TypeError(f"draft must be a model or a model name, got {type(draft).__name__}")


def shared_layers(target, draft) -> int:
    """How many first decoder layers ``draft`` runs that are ``target``'s own, over its own embedding,
    so that their keys and values are the target's (all of them for the target itself, N for a
    layerskip view of N layers); 0 for any other draft."""
    name, mine = _decoder_layers(target.base_model)
    try:  # the draft's at the target's name: another list of as many layers (a vision tower's) is no decoder's
        theirs = list(draft.base_model.base_model.get_submodule(name)) if mine else []
    except AttributeError:
        theirs = []
    same_input = target.base_model.get_input_embeddings() is draft.base_model.get_input_embeddings()
    if not (same_input and mine and theirs) or len(theirs) > len(mine):
        return 0
    return len(theirs) if all(a is b for a, b in zip(mine, theirs)) else 0


def _decoder_layers(model) -> tuple[str, list[Any]]:
    """The name (in ``model.base_model``) and the modules of ``model``'s decoder layers (its ``num_hidden_layers``
    of them), or ``("", [])`` where it holds no such list."""
    from medusa_infer.proposers.layerskip import decoder_layers

    decoder, total = model.base_model, getattr(model.config.get_text_config(), "num_hidden_layers", None)
    if decoder is model or not isinstance(total, int):
        return "", []
    try:
        name = decoder_layers(decoder, total)
    except ValueError:
        return "", []
    return name, list(decoder.get_submodule(name))


def _same_model(a, b) -> bool:
    """Same weights and depth (two layerskip views of one target are the same draft)."""
    config_a, config_b = a.base_model.config.get_text_config(), b.base_model.config.get_text_config()
    return a.lm_head.weight is b.lm_head.weight and config_a.num_hidden_layers == config_b.num_hidden_layers


def model_name(model) -> str:
    base = model.base_model
    return getattr(base, "name_or_path", None) or f"a {type(base).__name__}"


def check_same_vocabulary(target, draft) -> None:
    """Raise ``ValueError`` naming both models when the draft's vocabulary is not the target's. The
    same tokenizer with LM heads padded to other sizes (Qwen2.5-0.5B's 151936 rows, Qwen2.5-7B's
    152064) is the same vocabulary: the rows past the tokenizer's tokens are padding, never a token."""
    target_vocab = target.lm_head.weight.shape[0]
    draft_vocab = draft.lm_head.weight.shape[0]
    both = target.tokenizer is not None and draft.tokenizer is not None
    if both and target.tokenizer is not draft.tokenizer:  # (layerskip: the target's own)
        sizes = (len(target.tokenizer), len(draft.tokenizer))
        checked = _SAME_VOCABULARY.setdefault(target.tokenizer, weakref.WeakKeyDictionary())
        ours, theirs = ({}, {}) if checked.get(draft.tokenizer) == sizes else \
            (target.tokenizer.get_vocab(), draft.tokenizer.get_vocab())
        if ours == theirs:
            checked[draft.tokenizer] = sizes
        else:
            differing = len(set(ours.items()) ^ set(theirs.items()))
            raise ValueError(
                f"draft model {model_name(draft)} has a different tokenizer from target {model_name(target)} "
                f"({differing} token entries differ): a draft must share the target's tokenizer and vocabulary"
            )
    if target_vocab == draft_vocab:
        if target.tokenizer is not None and draft.tokenizer is None and draft.base_model not in _UNCHECKED:
            _UNCHECKED.add(draft.base_model)
            logger.warning("draft model %s came without a tokenizer (a model object and no draft_tokenizer=): its "
                           "vocabulary was not checked against target %s's; a draft of another tokenizer of the same "
                           "size stays exact but drafts tokens that stand for other text (no speedup): pass "
                           "draft_tokenizer=, or the draft by name", model_name(draft), model_name(target))
        elif target.tokenizer is None and draft.tokenizer is not None and target.base_model not in _UNCHECKED:
            _UNCHECKED.add(target.base_model)  # (MedusaModel.without_heads(model object): no tokenizer)
            logger.warning("target %s has no tokenizer: draft model %s's vocabulary was not checked against it; a "
                           "draft of another tokenizer of the same size stays exact but drafts tokens that stand for "
                           "other text (no speedup): give the target its tokenizer", model_name(target),
                           model_name(draft))
        return
    if not both:
        raise ValueError(
            f"draft model {model_name(draft)} predicts {draft_vocab} tokens but target {model_name(target)} "
            f"predicts {target_vocab}, and without both tokenizers nothing tells whether only padding rows differ: "
            "give the draft's tokenizer (a draft must share the target's tokenizer and vocabulary)"
        )
    needed = min(len(target.tokenizer), target_vocab)  # the tokens the target can predict
    if draft_vocab < needed:
        raise ValueError(
            f"draft model {model_name(draft)} predicts {draft_vocab} tokens, fewer than the {needed} of their "
            f"tokenizer that target {model_name(target)} predicts: a draft must predict every token the target can"
        )


def fit_vocabulary(logits: torch.Tensor, width: int) -> torch.Tensor:
    """A padded draft's ``[..., vocab]`` logits at the target's ``width``: its extra padding rows cut, or
    missing ones added at ``-inf`` (never drafted; probability 0)."""
    have = logits.shape[-1]
    if have >= width:
        return logits[..., :width]
    return torch.nn.functional.pad(logits, (0, width - have), value=float("-inf"))
