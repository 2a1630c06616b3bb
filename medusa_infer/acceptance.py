"""Acceptance rules: pick the accepted path in a candidate tree from the base model's logits.

Conventions shared by the tree rules (``n`` = ``buffers.num_nodes``, node 0 = root):

* ``logits``: ``[batch, n, vocab]`` base-model logits at each node; node i's logits predict
  the token that follows node i.
* ``tokens``: ``[batch, n]`` long, the token placed at each node (node 0 is already committed).
* ``buffers``: :class:`~medusa_infer.trees.TreeBuffers` on the same device as ``logits``.

Each rule returns an :class:`Acceptance`. Three rules are offered:

* :func:`accept_greedy`: exact match with the base model's argmax (temperature 0).
* :func:`accept_typical`: Medusa-2 typical acceptance (fast, not distribution-preserving).
* :func:`accept_lossless`: recursive rejection sampling over the tree; the emitted tokens
  follow exactly the distribution of plain sampling with :func:`warp_logits`.

:func:`accept_draft_lossless` is the classic chain rule for a stochastic draft model, and
:func:`accept_chain_lossless` applies it to a chain proposal's logits.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from medusa_infer.trees import TreeBuffers

__all__ = [
    "Acceptance",
    "accept_chain_lossless",
    "accept_draft_lossless",
    "accept_greedy",
    "accept_lossless",
    "accept_typical",
    "greedy_tokens",
    "warp_logits",
]


@dataclass(frozen=True, eq=False)
class Acceptance:
    """Result of one verification step.

    Fields:
        accept_length: ``[batch]`` long, accepted tree tokens beyond the root (0..max_depth).
        path_nodes: ``[batch, max_depth + 1]`` long, node indices of the accepted path starting
            with the root (0), padded with -1.
        next_token: ``[batch]`` long, the bonus token drawn at the last accepted node.
    """

    accept_length: torch.Tensor
    path_nodes: torch.Tensor
    next_token: torch.Tensor


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension (the first maximum on ties, as ``argmax``), computed with
    ``max``: on the CPU ``argmax`` took about three times as long over a 49152-token vocabulary
    (PyTorch 2.13, 2 threads: 72 us against 26 for one row, 236 against 82 for six)."""
    return logits.max(-1).indices


# ---------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------

def _number(name: str, value: float) -> float:
    """``value`` as a float; ``ValueError`` naming ``name`` for anything but a real number (a bool was taken as 1,
    and a string or None failed on a comparison naming neither)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _check_sampling_args(temperature: float, top_k: int, top_p: float) -> int:
    """Raise ``ValueError`` naming the value when a sampling setting is out of range; ``top_k`` as an int (numpy's
    integers are taken, as ``SamplingConfig`` takes them)."""
    temperature, top_p = _number("temperature", temperature), _number("top_p", top_p)
    if not 0.0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature!r}")
    try:
        k = None if isinstance(top_k, bool) else operator.index(top_k)
    except TypeError:
        k = None
    if k is None or k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1] (1 disables it), got {top_p!r}")
    return k


def _check_inputs(logits: torch.Tensor, tokens: torch.Tensor, buffers: TreeBuffers) -> None:
    """Raise ``ValueError`` when logits, tokens and tree buffers do not fit together."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be [batch, nodes, vocab], got shape {tuple(logits.shape)}")
    if tokens.shape != logits.shape[:2]:
        raise ValueError(f"tokens must be [batch, nodes] = {tuple(logits.shape[:2])} to match logits, "
                         f"got shape {tuple(tokens.shape)}")
    if tokens.dtype != torch.long:
        raise ValueError(f"tokens must be torch.long token ids, got {tokens.dtype}")
    if logits.shape[1] != buffers.num_nodes:
        raise ValueError(f"logits cover {logits.shape[1]} nodes but the tree has {buffers.num_nodes} "
                         "(root included); pass one row per tree node")
    if buffers.parents.device != logits.device:
        raise ValueError(f"tree buffers are on {buffers.parents.device} but logits are on "
                         f"{logits.device}; call buffers.to(logits.device) once per request")


# ---------------------------------------------------------------------------------------------
# Sampling distribution
# ---------------------------------------------------------------------------------------------

def _divide_by_temperature(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """``scores / temperature`` (float32, ``temperature > 0``). Where a tiny temperature overflows
    float32 (or is 0 there), the scores are shifted by their maximum first and the best kept at 0,
    so the softmax is the near one-hot that temperature means, not NaN."""
    scaled = scores / temperature
    # only a tiny temperature can overflow (logits past 3e32 are no model's): no check, no sync, per step
    if temperature < 1e-6 and bool((~scaled.isfinite() & scores.isfinite()).any()):
        shifted = scores - scores.amax(-1, keepdim=True)
        scaled = torch.where(shifted == 0, 0.0, shifted / temperature)
    return scaled


def warp_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution ``[..., vocab]`` (float32) from logits ``[..., vocab]``.

    Applies temperature, then top-k, then top-p (nucleus), in the order of transformers'
    ``generate``: top-k keeps every token scoring at least the k-th best; top-p keeps the smallest
    set of most probable tokens whose mass reaches ``top_p`` (of tokens tied at its edge, those
    transformers keeps). ``temperature == 0`` gives a
    one-hot on the argmax (first one on ties). ``top_k == 0`` and ``top_p == 1`` disable them.
    """
    top_k = _check_sampling_args(temperature, top_k, top_p)
    scores = logits.float()
    vocab = scores.shape[-1]
    if temperature == 0:
        return F.one_hot(greedy_tokens(scores), vocab).float()
    scores = _divide_by_temperature(scores, temperature)
    if 0 < top_k < vocab:
        kth_best = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, -math.inf)
    probs = scores.softmax(-1)
    if top_p < 1.0:
        # as transformers' TopPLogitsWarper does it, its sort included (of tokens tied at the nucleus's edge,
        # which stay is the sort's choice): least probable first, dropped while the mass up to and with them
        # is at most 1 - top_p
        sorted_scores, order = torch.sort(scores, descending=False)
        drop_sorted = sorted_scores.softmax(-1).cumsum(-1) <= 1 - top_p
        drop_sorted[..., -1] = False  # the most probable token stays, however small top_p (or its float32)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


# ---------------------------------------------------------------------------------------------
# Tree rules
# ---------------------------------------------------------------------------------------------

def _select_path(
    accepted: torch.Tensor, buffers: TreeBuffers, score: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Longest accepted root-to-leaf prefix.

    Args:
        accepted: ``[batch, n]`` bool, whether each node passes its parent's test (root ignored).
        buffers: the tree.
        score: optional ``[batch, n]`` per-node log-likelihood (root ignored); among equally long
            prefixes the highest total wins. Remaining ties go to the first leaf of
            ``retrieve_indices``.

    Returns:
        accept_length ``[batch]``, path_nodes ``[batch, max_depth + 1]`` (-1 padded) and the
        last accepted node ``[batch]``.
    """
    retrieve = buffers.retrieve_indices  # [leaves, max_depth + 1]
    on_path = retrieve >= 0
    node_ok = accepted[:, retrieve.clamp(min=0)] & on_path  # [batch, leaves, max_depth + 1]
    node_ok[:, :, 0] = True
    prefix = node_ok.long().cumprod(-1).bool()
    lengths = prefix.sum(-1) - 1  # [batch, leaves]
    if score is None:
        best = lengths.argmax(-1)
    else:
        below_root = retrieve[:, 1:].clamp(min=0)
        prefix_score = torch.where(prefix[:, :, 1:], score[:, below_root], 0.0).sum(-1)
        longest = lengths == lengths.max(-1, keepdim=True).values
        best = torch.where(longest, prefix_score, -math.inf).argmax(-1)
    rows = torch.arange(accepted.shape[0], device=accepted.device)
    accept_length = lengths[rows, best]
    path_nodes = torch.where(prefix[rows, best], retrieve[best], -1)
    last_node = path_nodes[rows, accept_length]
    return accept_length, path_nodes, last_node


def accept_greedy(logits: torch.Tensor, tokens: torch.Tensor, buffers: TreeBuffers) -> Acceptance:
    """Accept a node iff its token is the argmax of its parent's logits; keep the longest path.

    ``next_token`` is the argmax at the last accepted node. Ties between equally long paths go to
    the first leaf in ``buffers.retrieve_indices``; the result is deterministic.
    """
    _check_inputs(logits, tokens, buffers)
    if buffers.num_nodes == 1:  # a plain decoding step: no path to choose
        next_token = greedy_tokens(logits[:, 0])
        none = torch.zeros(len(next_token), dtype=torch.long, device=next_token.device)
        return Acceptance(none, none[:, None].clone(), next_token)
    prediction = greedy_tokens(logits)  # [batch, n]
    accepted = tokens == prediction[:, buffers.parents.clamp(min=0)]
    accept_length, path_nodes, last_node = _select_path(accepted, buffers)
    next_token = prediction.gather(1, last_node[:, None]).squeeze(1)
    return Acceptance(accept_length, path_nodes, next_token)


def check_typical_thresholds(epsilon: float, delta: float) -> None:
    """``ValueError`` naming a typical-acceptance threshold out of range (:func:`accept_typical`)."""
    epsilon, delta = _number("epsilon (posterior threshold)", epsilon), _number("delta (posterior alpha)", delta)
    if not 0.0 < epsilon <= 1.0:
        raise ValueError(f"epsilon (posterior threshold) must lie in (0, 1], got {epsilon!r}")
    if not 0.0 < delta < math.inf:
        raise ValueError(f"delta (posterior alpha) must be a finite number > 0, got {delta!r}")


def accept_typical(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    buffers: TreeBuffers,
    temperature: float,
    epsilon: float = 0.09,
    delta: float = 0.3,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Medusa-2 typical acceptance: accept token x when ``p(x) > min(epsilon, delta * exp(-H(p)))``.

    ``p = softmax(parent logits / temperature)`` and ``H`` is its entropy (``epsilon`` is Medusa's
    ``posterior_threshold``, ``delta`` its ``posterior_alpha``, usually ``sqrt(epsilon)``). The
    longest accepted path wins, ties broken by higher path log-likelihood. ``next_token`` is sampled
    from ``p`` at the last accepted node. ``temperature == 0`` is :func:`accept_greedy`.
    Accepts more than lossless sampling but does not preserve the base model's distribution. The
    rule takes no top-k or top-p (``decoding.SamplingConfig`` refuses them with typical acceptance).
    """
    _check_sampling_args(temperature, 0, 1.0)
    check_typical_thresholds(epsilon, delta)
    _check_inputs(logits, tokens, buffers)
    if temperature == 0:
        return accept_greedy(logits, tokens, buffers)
    log_probs = torch.log_softmax(_divide_by_temperature(logits.float(), temperature), dim=-1)  # [batch, n, vocab]
    probs = log_probs.exp()
    entropy = torch.special.entr(probs).sum(-1)  # [batch, n]
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon)
    rows = torch.arange(logits.shape[0], device=logits.device)
    parents = buffers.parents.clamp(min=0)
    node_log_prob = log_probs[rows[:, None], parents[None, :], tokens]  # [batch, n]
    accepted = node_log_prob.exp() > threshold[:, parents]
    accept_length, path_nodes, last_node = _select_path(accepted, buffers, score=node_log_prob)
    next_token = torch.multinomial(probs[rows, last_node], 1, generator=generator).squeeze(1)
    return Acceptance(accept_length, path_nodes, next_token)


def accept_lossless(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    buffers: TreeBuffers,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Recursive rejection sampling over the tree (SpecInfer / EAGLE multi-draft style).

    The rule: each child token is a deterministic draft (q = point mass). At the current node,
    with target ``p = warp_logits(node logits, temperature, top_k, top_p)``, the children are tried
    in rank order: child token x is accepted with probability ``p(x)``; on rejection ``p`` becomes
    the residual ``norm(max(0, p - q))`` (x's mass removed) before the next sibling, so a repeated
    token is never accepted after its rejection. An accepted child becomes the current node; when
    every child is rejected, or at a leaf, ``next_token`` is drawn from the current (residual) ``p``.

    Computed one depth at a time in closed form: trying point-mass drafts in turn accepts the
    first child carrying token x with probability exactly ``p(x)`` and, once all are rejected,
    leaves ``p`` restricted to the other tokens. That is the law of "draw y ~ p; descend into a
    child whose token is y; if there is none, y is the next token", so only the nodes on the
    accepted path are warped and sampled. Siblings carrying the same token (a grafted lookup chain
    starting with one of the heads' candidates) share their prefix, so the target's ``p`` after
    them: the descent goes into all of them at once, and the next draw is looked for among all their
    children; the accepted path is the one through the child found deepest. The emitted tokens
    follow exactly the distribution of plain sampling with :func:`warp_logits`.
    ``temperature == 0`` is :func:`accept_greedy`.
    """
    _check_sampling_args(temperature, top_k, top_p)
    _check_inputs(logits, tokens, buffers)
    if temperature == 0:
        return accept_greedy(logits, tokens, buffers)
    batch, device = tokens.shape[0], tokens.device
    rows = torch.arange(batch, device=device)
    parents = buffers.parents.to(device)
    # the nodes the descent is in: the root, then every child carrying the drawn token
    current = torch.zeros(batch, buffers.num_nodes, dtype=torch.bool, device=device)
    current[:, 0] = True
    deepest = torch.zeros(batch, dtype=torch.long, device=device)
    next_token = torch.zeros(batch, dtype=torch.long, device=device)
    descending = torch.ones(batch, dtype=torch.bool, device=device)
    for _ in range(buffers.max_depth + 1):
        node = current.long().argmax(-1)  # any of them: the same tokens so far, so the same p
        probs = warp_logits(logits[rows, node], temperature, top_k, top_p)  # [batch, vocab]
        draw = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        children = (parents >= 0) & current.gather(1, parents.clamp(min=0).expand(batch, -1))
        matches = children & (tokens == draw[:, None])
        found = descending & matches.any(-1)
        next_token = torch.where(descending & ~found, draw, next_token)
        deepest = torch.where(found, matches.long().argmax(-1), deepest)
        current = torch.where(found[:, None], matches, current)
        descending = found
    return Acceptance(*_path_to(deepest, buffers), next_token)


def _path_to(nodes: torch.Tensor, buffers: TreeBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accept_length [batch], path_nodes [batch, max_depth + 1])`` of the path from the root to
    each row's node (``-1`` past its depth)."""
    depths, parents = buffers.depths.to(nodes.device), buffers.parents.to(nodes.device)
    accept_length = depths[nodes]
    path_nodes = torch.full((len(nodes), buffers.max_depth + 1), -1, dtype=torch.long, device=nodes.device)
    node = nodes
    for depth in range(buffers.max_depth, -1, -1):
        here = accept_length >= depth
        path_nodes[:, depth] = torch.where(here, node, -1)
        node = torch.where(here & (node > 0), parents[node.clamp(min=0)], node)
    return accept_length, path_nodes


# ---------------------------------------------------------------------------------------------
# Chain rule for a stochastic draft model
# ---------------------------------------------------------------------------------------------

def _acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """Speculative-sampling acceptance probability ``min(1, p(x) / q(x))``, elementwise.

    ``p_x`` is the target probability of the drafted token, ``q_x`` its draft probability. A token
    the target rules out (``p_x == 0``) is never accepted, even if the draft gave it ``q_x == 0``.
    """
    return (p_x / q_x.clamp(min=torch.finfo(q_x.dtype).tiny)).clamp(max=1.0)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Distribution ``norm(max(0, p - q))`` ``[..., vocab]`` to sample from after a rejection.

    A rejected token had ``q > p``, so the leftover holds at least that much; it can round to zero only
    where ``q`` equals ``p`` up to rounding (a draft that is the target), and there ``p`` is the limit."""
    leftover = (p - q).clamp(min=0.0)
    total = leftover.sum(-1, keepdim=True)
    return torch.where(total > 0, leftover / total.clamp(min=torch.finfo(leftover.dtype).tiny), p)


def accept_draft_lossless(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of a drafted chain (Leviathan et al. / Chen et al.).

    Args:
        target_probs: ``[batch, k + 1, vocab]`` target distributions after each drafted prefix
            (position i predicts the token after i drafted tokens).
        draft_probs: ``[batch, k, vocab]`` draft distributions the tokens were sampled from.
        draft_tokens: ``[batch, k]`` long, the drafted tokens (k may be 0).
        generator: random source.

    Token i is accepted with probability ``min(1, p(x) / q(x))``; at the first rejection the next
    token is drawn from ``norm(max(0, p - q))``; if all k are accepted it is drawn from
    ``target_probs[:, k]``.

    Returns:
        accept_length ``[batch]`` (0..k) and next_token ``[batch]``.
    """
    if draft_tokens.dim() != 2 or draft_tokens.dtype != torch.long:
        raise ValueError(f"draft_tokens must be a [batch, k] torch.long tensor, got shape "
                         f"{tuple(draft_tokens.shape)} and dtype {draft_tokens.dtype}")
    batch, k = draft_tokens.shape
    if draft_probs.dim() != 3 or draft_probs.shape[:2] != (batch, k):
        raise ValueError(f"draft_probs must be [batch, k, vocab] with batch, k = {batch}, {k}, "
                         f"got shape {tuple(draft_probs.shape)}")
    vocab = draft_probs.shape[2]
    if target_probs.shape != (batch, k + 1, vocab):
        raise ValueError(f"target_probs must be [batch, k + 1, vocab] = {(batch, k + 1, vocab)}, "
                         f"got shape {tuple(target_probs.shape)}")
    target = target_probs.float()
    # a zero draft after the last token makes "all accepted" sample from the target itself
    draft = torch.cat([draft_probs.float(), target.new_zeros(batch, 1, vocab)], dim=1)
    p_x = target[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, k]
    q_x = draft[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    uniform = torch.rand((batch, k), generator=generator, device=target.device)
    accepted = uniform < _acceptance_probability(p_x, q_x)
    accept_length = accepted.long().cumprod(-1).sum(-1)  # [batch]
    rows = torch.arange(batch, device=target.device)
    residual = _residual(target[rows, accept_length], draft[rows, accept_length])
    next_token = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return accept_length, next_token


def accept_chain_lossless(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """:func:`accept_draft_lossless` for a chain proposal, target warped by :func:`warp_logits`.

    Args:
        logits: ``[batch, n, vocab]`` target logits at the root and at each drafted token.
        tokens: ``[batch, n]`` long, the root then the ``n - 1`` drafted tokens.
        draft_probs: ``[batch, n - 1, vocab]`` draft distributions the tokens were sampled from.
        temperature, top_k, top_p: the target's sampling settings; ``temperature == 0`` makes the
            target a point mass on the argmax, which turns the rule into greedy acceptance.
        generator: random source.

    Returns:
        An :class:`Acceptance` whose ``path_nodes`` are ``0, 1, ..., accept_length`` then -1.
    """
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(f"logits [batch, n, vocab] and tokens [batch, n] must agree, got shapes "
                         f"{tuple(logits.shape)} and {tuple(tokens.shape)}")
    target = warp_logits(logits, temperature, top_k, top_p)
    accept_length, next_token = accept_draft_lossless(target, draft_probs, tokens[:, 1:], generator)
    nodes = torch.arange(tokens.shape[1], device=tokens.device)
    path_nodes = torch.where(nodes[None] <= accept_length[:, None], nodes[None], -1)
    return Acceptance(accept_length, path_nodes, next_token)
