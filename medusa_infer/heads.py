"""Medusa heads: K small residual MLPs on the base model's last hidden state.

Head k maps the hidden state at position t to logits for the token at position t + k + 2 (the base
model's own ``lm_head`` predicts t + 1). Each head is ``num_layers`` residual blocks
``x + SiLU(Linear(x))`` followed by a vocabulary projection:

* ``shared``: the base model's ``lm_head`` (frozen, owned by the base model, not by the heads);
* ``own``: a per-head ``Linear(hidden, vocab)`` initialised from the base ``lm_head``'s weight,
  without a bias, as FasterDecoding/Medusa's layout has it (a base ``lm_head`` with a bias, as in
  Phi or GPT-J, is warned about: ``shared`` heads use it).

Every block's Linear starts at zero (weight and bias), so at initialisation each block is the
identity and every head's logits equal the base model's next-token logits (``own`` heads: less the
``lm_head``'s bias, if it has one).

With ``next_token_input`` each head also reads token t + 1, the base model's own next token. It is
known whenever the heads run (the candidate tree's root), and it is what the hidden state at t
does not yet say. Its input embedding (the base model's, frozen, not stored) is added to the
hidden state through the head's own ``token_proj`` ``Linear(hidden, hidden)``, zero at
initialisation, so such heads start where plain Medusa heads start.

With ``path_input`` as well, head k also reads the tokens between the root and its own: t + 2 ..
t + k + 1, the candidate path it extends (Hydra's sequentially dependent draft heads). Each enters
through its own zero-initialised ``Linear(hidden, hidden)`` (``path_proj``), so head 0 is unchanged
and head k has k of them. In a candidate tree, a node's children then come from running its head on
that node's own path: each level's head runs once over all the nodes above it that have children
(one row each) instead of once per depth; in training, teacher forcing gives every head the true
path.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from medusa_infer.config import MedusaConfig
from medusa_infer.cpu_kernels import CPULinear, planned_linear, tensor_version

logger = logging.getLogger(__name__)


def check_head_range(start: int, stop: int, num_heads: int) -> None:
    """Raise unless heads ``start .. stop - 1`` exist and are at least one."""
    if not 0 <= start < stop <= num_heads:
        raise ValueError(f"heads {start}..{stop - 1} asked of {num_heads} heads: need 0 <= start < first <= num_heads")


class ResBlock(nn.Module):
    """``x + SiLU(Linear(x))`` with a zero-initialised Linear (the identity at start)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHead(nn.Module):
    """One head: ``num_layers`` residual blocks and, for ``own`` projection, a vocabulary projection."""

    def __init__(self, hidden_size: int, num_layers: int, proj_size: int | None, token_input: bool = False,
                 path_inputs: int = 0) -> None:
        super().__init__()
        # A fresh module per layer: `[ResBlock(h)] * n` would share one module n times.
        self.blocks = nn.ModuleList(ResBlock(hidden_size) for _ in range(num_layers))
        self.proj = nn.Linear(hidden_size, proj_size, bias=False) if proj_size else None
        self.token_proj = nn.Linear(hidden_size, hidden_size, bias=False) if token_input else None
        if self.token_proj is not None:
            nn.init.zeros_(self.token_proj.weight)
        self.path_proj = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=False) for _ in range(path_inputs))
        for proj in self.path_proj:
            nn.init.zeros_(proj.weight)

    def transform(self, x: torch.Tensor, token_embedding: torch.Tensor | None = None,
                  path_embeddings: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[..., hidden]``; ``token_embedding`` ``[..., hidden]`` (t + 1); ``path_embeddings``
        ``[..., j, hidden]`` with j at least ``len(path_proj)`` (t + 2 onwards)."""
        if self.token_proj is not None:
            x = x + self.token_proj(token_embedding)
        for j, proj in enumerate(self.path_proj):
            x = x + proj(path_embeddings[..., j, :])
        for block in self.blocks:
            x = block(x)
        return x


def check_token_map(token_map: torch.Tensor, config: MedusaConfig) -> None:
    """``ValueError`` naming what is wrong with a reduced vocabulary's ``token_map``: its shape, ids
    outside the vocabulary, or an id given twice (two columns scoring one token: duplicate siblings in
    every tree, and one of the columns never trained)."""
    if token_map.shape != (config.reduced_vocab_size,):
        raise ValueError(f"token_map has shape {tuple(token_map.shape)}, expected ({config.reduced_vocab_size},) "
                         "to match reduced_vocab_size")
    if token_map.is_meta:  # shapes only (heads built on the meta device to name their tensors): no ids to check
        return
    if token_map.min() < 0:
        raise ValueError(f"token_map holds negative token ids {token_map[token_map < 0].unique()[:8].tolist()}: the "
                         "heads' weights file is damaged; save or download them again")
    if token_map.max() >= config.vocab_size:
        outside = token_map[token_map >= config.vocab_size].unique()
        raise ValueError(f"token_map holds token ids {outside[:8].tolist()} outside the vocabulary [0, "
                         f"{config.vocab_size}): these heads were made for a model with a larger vocabulary; "
                         "load them on that model")
    values, counts = token_map.unique(return_counts=True)
    if bool((counts > 1).any()):
        raise ValueError(f"token_map gives token ids {values[counts > 1][:8].tolist()} more than once; "
                         "each id may be scored by one column only")


class MedusaHeads(nn.Module):
    """The K heads of a Medusa checkpoint.

    Args:
        config: the heads' configuration.
        lm_head_weight: ``[vocab, hidden]`` base ``lm_head`` weight; with ``own`` projection each
            head's projection is initialised from it (rows ``token_map`` with a reduced vocabulary).
        lm_head_bias: the base ``lm_head``'s bias, if any: ``own`` projections have none, which a
            non-zero one is warned about.
        token_map: ``[reduced_vocab]`` token ids the heads score, where ``config.reduced_vocab_size``
            is set (integers: floats or a boolean mask are refused, not cut or read as ids); without
            one, ids ``0..reduced_vocab-1`` stand in until a state dict holding the real map is loaded.
    """

    def __init__(
        self,
        config: MedusaConfig,
        lm_head_weight: torch.Tensor | None = None,
        token_map: torch.Tensor | None = None,
        lm_head_bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        own = config.projection == "own"
        self.heads = nn.ModuleList(
            MedusaHead(config.hidden_size, config.num_layers, config.head_vocab_size if own else None,
                       config.next_token_input, k if config.path_input else 0)
            for k in range(config.num_heads)
        )
        if config.reduced_vocab_size is not None:
            if token_map is None:
                token_map = torch.arange(config.reduced_vocab_size)
            given = torch.as_tensor(token_map)
            if given.dtype == torch.bool or given.is_floating_point() or given.is_complex():
                mask = " (a mask of the ids to keep: mask.nonzero().squeeze(1) gives them)" \
                    if given.dtype == torch.bool else ""
                raise ValueError(f"token_map must hold integer token ids, got dtype {given.dtype}{mask}: "
                                 "floats were cut to integers, other ids than meant")
            token_map = given.long()
            check_token_map(token_map, config)
            self.register_buffer("token_map", token_map)
        elif token_map is not None:
            raise ValueError("a token_map was given but config.reduced_vocab_size is None; set it")
        else:
            self.token_map = None
        if own and lm_head_weight is not None:
            self.init_projections(lm_head_weight)
        if own and lm_head_bias is not None and bool(lm_head_bias.any()):
            logger.warning("the base model's lm_head has a bias, and projection='own' heads have none (as in the "
                           "FasterDecoding/Medusa layout): they start from its logits less that bias, and cannot "
                           "learn it; projection='shared' heads use the lm_head itself, bias included")

    @torch.no_grad()
    def init_projections(self, lm_head_weight: torch.Tensor) -> None:
        """Copy the base ``lm_head`` weight (``[vocab, hidden]``) into every ``own`` projection."""
        if self.config.projection != "own":
            raise ValueError("init_projections applies to projection='own' heads only")
        weight = lm_head_weight if self.token_map is None else lm_head_weight[self.token_map.to(lm_head_weight.device)]
        for head in self.heads:
            head.proj.weight.copy_(weight)

    def forward(
        self,
        hidden: torch.Tensor,
        lm_head: nn.Module,
        logit_softcap: float | None = None,
        next_tokens: torch.Tensor | None = None,
        embed_weight: torch.Tensor | None = None,
        first: int | None = None,
        path_tokens: torch.Tensor | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """Heads' logits.

        Args:
            hidden: ``[..., hidden]`` base hidden states after the final norm.
            lm_head: the base model's output projection (used by ``shared`` heads).
            logit_softcap: the base model's final logit soft-cap, applied as it applies it.
            next_tokens: ``[...]`` token ids at t + 1 (``next_token_input`` heads only).
            embed_weight: ``[vocab, hidden]`` the base model's input embedding weight
                (``next_token_input`` heads only).
            first: run only the first this many heads (default: all).
            path_tokens: ``[..., j]`` token ids at t + 2 .. t + j + 1, the path each head extends
                (``path_input`` heads only; j >= first - 1; head k reads the first k).
            start: skip the heads before this one (with ``first``: run heads ``start .. first - 1``).

        Returns:
            ``[num_heads, ..., head_vocab]`` logits (``[first - start, ...]`` with ``first`` and
            ``start``); with a reduced vocabulary column j scores token ``token_map[j]``.
        """
        stop = len(self.heads) if first is None else first
        check_head_range(start, stop, len(self.heads))
        heads = self.heads[start:stop]
        # the heads compute in their own dtype: float32 beside a bfloat16 base under autocast, bfloat16
        # where DeepSpeed cast the module (it casts no inputs, unlike autocast), and the base model's
        # dtype when decoding (a no-op)
        own = next(heads[0].parameters(), None)  # none: no blocks, shared projection, no token inputs
        hidden = hidden if own is None else hidden.to(own.dtype)
        embedded = path_embedded = None
        if self.config.next_token_input:
            if next_tokens is None or embed_weight is None:
                raise ValueError("these heads read the token at t + 1 (next_token_input=True): pass next_tokens "
                                 "and embed_weight, or call MedusaModel.head_logits, which supplies both")
            if next_tokens.shape != hidden.shape[:-1]:
                raise ValueError(f"next_tokens has shape {tuple(next_tokens.shape)}, expected "
                                 f"{tuple(hidden.shape[:-1])} (one token per hidden state)")
            embedded = F.embedding(next_tokens, embed_weight).to(hidden.dtype)
        if self.config.path_input and stop > 1:
            if path_tokens is None or path_tokens.shape[:-1] != hidden.shape[:-1] or path_tokens.shape[-1] < stop - 1:
                got = None if path_tokens is None else tuple(path_tokens.shape)
                raise ValueError(f"these heads read their candidate path (path_input=True): head {stop - 1} needs "
                                 f"path_tokens of shape {(*hidden.shape[:-1], stop - 1)} or wider (tokens t + 2 "
                                 f"onwards), got {got}; MedusaModel.head_logits supplies the greedy path")
            path_embedded = F.embedding(path_tokens[..., : stop - 1], embed_weight).to(hidden.dtype)
        x = torch.stack([head.transform(hidden, embedded, path_embedded) for head in heads])
        if self.config.projection == "shared":
            weight, bias = self.shared_projection(lm_head)
            # the same kernels as the base model's own lm_head (see cpu_kernels)
            plan = lm_head.kernel_plan if isinstance(lm_head, CPULinear) else None
            # lm_head's own weight (no reduced vocabulary) shares lm_head's packed copy, not a second one
            owner = lm_head if weight is lm_head.weight else self
            logits = planned_linear(x.to(weight.dtype), weight, bias, plan,
                                    owner.__dict__.setdefault("_kernel_cache", {}))
        else:
            logits = torch.stack([head.proj(x[k]) for k, head in enumerate(heads)])
        if logit_softcap:
            logits = torch.tanh(logits / logit_softcap) * logit_softcap
        return logits

    def shared_projection(self, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The ``lm_head`` weight and bias that ``shared`` heads project with: the rows of
        ``token_map`` with a reduced vocabulary.

        That gather copies ``reduced_vocab x hidden`` floats, a cost comparable to the heads
        themselves, so its result is kept while ``lm_head``'s weight, bias and ``token_map`` are the
        same tensors at the same version (any in-place update bumps the version). It is recomputed
        whenever gradients must flow into the weight.
        """
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        if self.token_map is None:
            return weight, bias
        if torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad)):
            return weight[self.token_map], None if bias is None else bias[self.token_map]
        sources = (weight, bias, self.token_map)
        stamp = tuple(None if t is None else (t.data_ptr(), tensor_version(t), t.device, t.dtype) for t in sources)
        stamp += (torch.is_inference_mode_enabled(),)  # an inference tensor cannot be saved for backward
        cached = self.__dict__.get("_shared_projection")
        if cached is None or cached[1] != stamp or any(a is not b for a, b in zip(cached[0], sources)):
            gathered = (weight[self.token_map].detach(), None if bias is None else bias[self.token_map].detach())
            # a plain attribute, not a buffer: derived, never saved, and recomputed when lm_head changes; the
            # storages it was gathered from are held, so that new weights set through .data cannot take their
            # address (and version 0) and pass for them
            held = tuple(None if t is None else t.detach() for t in sources)
            self.__dict__["_shared_projection"] = cached = (sources, stamp, gathered, held)
        return cached[2]

    def __getstate__(self) -> dict[str, Any]:
        """Pickling and deep copies leave out the gathered projection (it holds ``lm_head``'s weight)
        and its packed copy (``cpu_kernels``)."""
        state = dict(super().__getstate__())
        state.pop("_shared_projection", None)
        state.pop("_kernel_cache", None)
        return state

    def to_full_vocab(self, ids: torch.Tensor) -> torch.Tensor:
        """Map head-vocabulary indices (e.g. a top-k) to base token ids."""
        return ids if self.token_map is None else self.token_map[ids]
