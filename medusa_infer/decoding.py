"""The speculative decoding loop: prefill, then propose -> verify -> accept -> commit.

One step, for every active row of the batch at once::

    proposal = proposer.propose(roots)              # [batch, n] tree of candidates, node 0 = root
    out = model(proposal.tokens, tree mask, positions = root position + node depth)
    acc = acceptance rule(out.logits, proposal)     # longest accepted path + the next root
    keep only the accepted path's KV slots          # a gather, no second forward
    proposer.observe(accepted tokens, hidden state at the last accepted node)

The proposer decides what is proposed (Medusa heads, a draft model, prompt lookup, nothing at
all for plain decoding); everything else is shared. All state lives in ``DecodeBatch``, one object
per call, never on the model.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import numbers
import re
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import torch

from medusa_infer import acceptance as rules
from medusa_infer.adaptive import StepCosts, TreeController, frozen_acceptance, thawed_acceptance, tree_ladder
from medusa_infer.chat import chat_prompt_ids, encode_chat
from medusa_infer.kv_cache import AttentionLayout, KVState
from medusa_infer.metrics import GenerationMetrics
from medusa_infer.proposers.base import Proposal, Proposer, StepContext, row_groups
from medusa_infer.proposers.autoregressive import AutoregressiveProposer
from medusa_infer.proposers.medusa import MedusaProposer
from medusa_infer.speculation_gate import SpeculationGate, gated_step
from medusa_infer.tree_fit import CostProfile, fit_tree, warn_if_measured_elsewhere
from medusa_infer.trees import TREE_PRESETS, get_tree, greedy_tree, tree_depth

ACCEPTANCE_RULES = ("greedy", "typical", "lossless")
TYPICAL_EPSILON, TYPICAL_DELTA = 0.09, 0.3
"""Typical acceptance's defaults: Medusa's ``posterior_threshold`` and ``posterior_alpha`` (its sqrt)."""


def _real(value: Any) -> float | None:
    """``value`` as a float when it is a real number (not a bool), else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        value = value.item()
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None


def _integer(value: Any) -> int | None:
    """``value`` as an int when it is an integer (numpy's, a 0-d integer tensor; not a bool), else None."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")) or getattr(value, "shape", ()) != ():
        return None  # (a bool tensor, or a one-element tensor of any shape, read as its number)
    try:
        return int(value.__index__())
    except (AttributeError, TypeError, RuntimeError):
        return None


def token_outside(ids: Iterable[Any], vocab: int) -> str | None:
    """Why ``ids`` (prompt token ids) cannot be fed to a model of ``vocab`` rows, naming the first id that is
    not one of them (not an integer, or outside ``[0, vocab)``) and the two usual causes; None when all are.
    The one check of ``generate``, ``Engine.submit`` and the server's requests."""
    for token in ids:
        number = _integer(token)
        if number is None or not 0 <= number < vocab:
            return (f"token id {token if number is None else number!r} is outside the vocabulary [0, {vocab}): "
                    "encode prompts with the model's tokenizer (a token added to it needs the model's embeddings "
                    "resized)")
    return None


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. ``acceptance`` greedy needs no sampling; typical and lossless sample
    at ``temperature``. Lossless also applies ``top_k``/``top_p`` exactly as plain sampling does;
    typical acceptance (Medusa-2's rule) is defined on the tempered distribution alone, so it
    refuses ``top_k`` and ``top_p`` rather than ignore them."""

    acceptance: str = "greedy"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_epsilon: float = TYPICAL_EPSILON
    typical_delta: float = TYPICAL_DELTA

    def __post_init__(self) -> None:
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {self.acceptance!r}")
        # numpy and 0-d torch numbers are taken as the Python numbers they hold
        temperature, top_p, top_k = _real(self.temperature), _real(self.top_p), _integer(self.top_k)
        if temperature is None or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if top_p is None or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if top_k is None or top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "top_k", top_k)
        # checked whatever the rule (kept unchecked, a list failed the first step, and an unused value made rows of
        # equal settings two groups)
        epsilon, delta = _real(self.typical_epsilon), _real(self.typical_delta)
        if epsilon is None or delta is None:  # a string or a bool: named, not a bare TypeError later
            bad = ("typical_epsilon", self.typical_epsilon) if epsilon is None else ("typical_delta",
                                                                                      self.typical_delta)
            raise ValueError(f"{bad[0]} must be a number, got {bad[1]!r}")
        try:
            rules.check_typical_thresholds(epsilon, delta)  # before any prefill
        except ValueError as err:
            raise ValueError(f"typical_epsilon={self.typical_epsilon!r}, typical_delta={self.typical_delta!r}: "
                             f"{err}") from None
        if self.acceptance != "typical" and (epsilon, delta) != (TYPICAL_EPSILON, TYPICAL_DELTA):
            raise ValueError(f"typical_epsilon={self.typical_epsilon!r} and typical_delta={self.typical_delta!r} set "
                             f"typical acceptance, and this config accepts by {self.acceptance!r}; pass "
                             f"acceptance='typical', or leave them at {TYPICAL_EPSILON} and {TYPICAL_DELTA}")
        object.__setattr__(self, "typical_epsilon", epsilon)
        object.__setattr__(self, "typical_delta", delta)
        if self.acceptance == "typical" and (self.top_k or self.top_p < 1):
            given = [f"top_k={self.top_k!r}"] if self.top_k else []
            given += [f"top_p={self.top_p!r}"] if self.top_p < 1 else []
            raise ValueError(f"acceptance='typical' samples at the temperature only (Medusa-2's rule) and would ignore "
                             f"{' and '.join(given)}; leave top_k at 0 and top_p at 1.0, or use "
                             "acceptance='lossless', which applies them exactly")

    @property
    def greedy(self) -> bool:
        return self.acceptance == "greedy" or self.temperature == 0

    def first_token(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Choose ``[batch]`` tokens from ``[batch, vocab]`` logits, as plain decoding would."""
        if self.greedy:
            return rules.greedy_tokens(logits)
        probs = rules.warp_logits(logits.float(), self.temperature, self.top_k, self.top_p)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)

    def accept(self, logits: torch.Tensor, proposal: Proposal, generator: torch.Generator | None) -> rules.Acceptance:
        logits = logits.float()
        if self.greedy:
            return rules.accept_greedy(logits, proposal.tokens, proposal.tree)
        if self.acceptance == "typical":
            return rules.accept_typical(
                logits, proposal.tokens, proposal.tree, self.temperature,
                epsilon=self.typical_epsilon, delta=self.typical_delta, generator=generator,
            )
        if proposal.draft_probs is not None:
            return rules.accept_chain_lossless(
                logits, proposal.tokens, proposal.draft_probs, self.temperature, self.top_k, self.top_p, generator
            )
        return rules.accept_lossless(
            logits, proposal.tokens, proposal.tree, self.temperature, self.top_k, self.top_p, generator=generator
        )


def first_tokens(samplings: Sequence[SamplingConfig], logits: torch.Tensor,
                 generator: torch.Generator | None) -> torch.Tensor:
    """``[batch]`` tokens from ``[batch, vocab]`` logits, each row's chosen as ``SamplingConfig.first_token``
    chooses with its own setting (``samplings``, one per row)."""
    groups = row_groups(samplings)
    if len(groups) == 1:  # one setting: one draw for all rows
        return groups[0][0].first_token(logits, generator)
    tokens = torch.empty(len(logits), dtype=torch.long, device=logits.device)
    for sampling, rows in groups:
        index = torch.tensor(rows, device=logits.device)
        tokens[index] = sampling.first_token(logits[index], generator)
    return tokens


def accept_rows(samplings: Sequence[SamplingConfig], logits: torch.Tensor, proposal: Proposal,
                generator: torch.Generator | None) -> rules.Acceptance:
    """One verification step's ``Acceptance`` for rows that may choose differently (``samplings``, one per
    row): each setting's acceptance rule (``SamplingConfig.accept``) over its own rows."""
    groups = row_groups(samplings)
    if len(groups) == 1:
        return groups[0][0].accept(logits, proposal, generator)
    batch, device = len(logits), logits.device
    accept_length = torch.zeros(batch, dtype=torch.long, device=device)
    path_nodes = torch.full((batch, proposal.tree.max_depth + 1), -1, dtype=torch.long, device=device)
    next_token = torch.zeros(batch, dtype=torch.long, device=device)
    for sampling, rows in groups:
        index = torch.tensor(rows, device=device)
        probs = None if proposal.draft_probs is None else proposal.draft_probs[index]
        part = sampling.accept(logits[index], replace(proposal, tokens=proposal.tokens[index], draft_probs=probs),
                               generator)
        accept_length[index] = part.accept_length
        path_nodes[index, : part.path_nodes.shape[1]] = part.path_nodes
        next_token[index] = part.next_token
    return rules.Acceptance(accept_length, path_nodes, next_token)


TEXT_CONTEXT_TOKENS = 6
"""Prompt tokens decoded before a generation's first tokens so that their text comes out as it reads
after the prompt (a SentencePiece tokenizer drops the leading space of a text's first word)."""


def special_ids(tokenizer: Any) -> set[int]:
    """The ids of ``tokenizer``'s special tokens, which decode to nothing in text (``skip_special_tokens``)."""
    return set(getattr(tokenizer, "all_special_ids", None) or ())


def context_start(tokenizer: Any, ids: Sequence[int], start: int) -> int:
    """Where the tokens decoded before ``ids[start:]`` as their context begin: ``TEXT_CONTEXT_TOKENS``
    back, and up to 3 tokens further while the context's text begins inside a character. A byte-fallback
    tokenizer (Llama-2, Mistral) decodes a run of byte tokens that starts mid-character to U+FFFD, every
    byte of it, those of the text after the context that continue the run too (an emoji after a prompt
    ending in emoji came out as four U+FFFD, and a stop string in it was never seen). Special tokens, which
    decode to nothing, are not counted (after a prompt ending in 6 of them the context held no text, and a
    SentencePiece answer lost its leading space)."""
    special = special_ids(tokenizer)
    begin, counted = start, 0
    while begin > 0 and counted < TEXT_CONTEXT_TOKENS and start - begin < 8 * TEXT_CONTEXT_TOKENS:
        begin -= 1
        counted += ids[begin] not in special
    for _ in range(3):  # a UTF-8 character is at most 4 bytes
        context = list(ids[begin:start])  # (its last character whole: a byte-fallback tokenizer reads all of a run
        text = tokenizer.decode(context, skip_special_tokens=True)  # cut inside one as U+FFFD, its start too)
        if begin == 0 or not whole_text(tokenizer, context, text).startswith("\ufffd"):
            break
        begin -= 1
    return begin


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class ByteRun:
    """Where the run of byte tokens a growing list of token ids ends in begins, for text that must wait
    for it: the ``<0xNN>`` tokens a byte-fallback tokenizer (Gemma, Llama-2, Mistral) spells a character
    outside its vocabulary with. Its decoder decodes a run of them as one (special tokens in between are
    skipped before, so they join it): while the run ends inside a character, every byte of it reads
    U+FFFD, characters it completed before included, so its text is known only once another token ends
    it (or the text ends). Each call looks only at the ids added since the last one."""

    def __init__(self, tokenizer: Any, start: int = 0) -> None:
        """``start``: the ids before it are never part of a run (a prompt decoded as context)."""
        self.tokenizer, self.start, self.checked = tokenizer, start, start
        self._special: set[int] | None = None

    def __call__(self, ids: Sequence[int]) -> int:
        """The index of the first id of the trailing run of ``ids`` (``len(ids)`` where there is none);
        ``ids`` is the list of the last call with ids appended."""
        end = i = len(ids)
        while i > self.checked and self._in_run(int(ids[i - 1])):
            i -= 1
        if i > self.checked:  # a token that ends any run before it: the run, if any, begins after it
            self.start = i
        self.checked = end
        return self.start

    def _in_run(self, token_id: int) -> bool:
        try:
            token = self.tokenizer.convert_ids_to_tokens(token_id)
        except Exception:  # a tokenizer that refuses some ids (e.g. remote-code tiktoken ones): no byte token
            token = None
        if isinstance(token, str) and _BYTE_TOKEN.fullmatch(token):
            return True
        if self._special is None:
            self._special = special_ids(self.tokenizer)
        return token_id in self._special


def ends_in_byte_token(tokenizer: Any, ids: Sequence[int]) -> bool:
    """Whether ``ids`` end in a byte-fallback ``<0xNN>`` token (special tokens after it, which decode to nothing,
    skipped): whose tokenizer reads every byte of a run cut inside a character as U+FFFD (``ByteRun``)."""
    specials = special_ids(tokenizer)
    for token_id in reversed(ids):
        if int(token_id) not in specials:
            token = tokenizer.convert_ids_to_tokens(int(token_id))
            return isinstance(token, str) and _BYTE_TOKEN.fullmatch(token) is not None
    return False


def whole_text(tokenizer: Any, context: Sequence[int], text: str) -> str:
    """The text of ``context``'s tokens up to its last whole character, ``text`` being theirs: ``text`` unless
    it ends in U+FFFD (tokens cut inside a character's bytes), else that of up to 3 fewer tokens, special tokens
    (which decode to nothing) not counted: three of them after the cut character kept its U+FFFD, and added one."""
    if not text.endswith("\ufffd"):  # (most calls: no special ids read)
        return text
    specials = special_ids(tokenizer)
    end, dropped = len(context), 0
    while end > 0 and dropped < 3 and text.endswith("\ufffd"):  # a UTF-8 character is at most 4 bytes
        end -= 1
        if int(context[end]) in specials:  # (no byte of the character: the text is the same without it)
            continue
        dropped += 1
        text = tokenizer.decode(list(context[:end]), skip_special_tokens=True)
    return text


def text_start(before: str, whole: str, after: str) -> int | None:
    """Where, in ``after`` (the text of a context's tokens and of tokens after them), the later tokens' text
    begins: past the longest of these that ``after`` begins with: ``before``, the context's text; ``before``
    without the U+FFFD it ends in where the context ends inside a character (prompt ids cut there), which the
    later tokens complete: a byte-level tokenizer (GPT-2, SmolLM2) reads only that character so; and ``whole``
    (``whole_text``): a byte-fallback one (Llama-2, Gemma) reads all the run of byte tokens it ends in so,
    characters complete before it included. None where it begins with none of them (a tokenizer that rewrote
    the seam)."""
    found = [len(text) for text in (before, before.rstrip("\ufffd"), whole) if after.startswith(text)]
    return max(found) if found else None


def generated_text_tail(tokenizer: Any, history: Sequence[int], prompt_length: int, window: int) -> str:
    """The text of (up to) the last ``window`` generated tokens of ``history`` (prompt, then generated
    tokens), special tokens left out, as it reads after what precedes it: the text a client is sent,
    where stop strings are looked for. Text of the prompt itself is never part of it, bar a character the
    prompt's ids end inside of, which the answer completes."""
    decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
    start = max(prompt_length, len(history) - window)
    for _ in range(4):  # a window that begins inside a character (a run of byte tokens longer than it): at it
        context = list(history[context_start(tokenizer, history, start) : start])
        before = decode(context) if context else ""
        after = decode(context + list(history[start:]))
        at = text_start(before, whole_text(tokenizer, context, before), after)
        tail = after[at:] if at is not None else decode(list(history[start:]))
        if start <= prompt_length or ((at is not None or not cleans_spaces(tokenizer))
                                      and (not tail.startswith("\ufffd") or after.endswith("\ufffd"))):
            # (a byte-fallback tokenizer read all the run as U+FFFD: a stop string in it was missed; while the
            # history ends inside a character it reads so from any start: 47 decodes a call found nothing more.
            # A cleanup that rewrote the window's seam, "x n" and "' t" read "xn't": the window's text alone,
            # "' t", held a stop string the text never did; from a token earlier the seam is inside the window)
            break
        start -= 1
    return tail


def special_stop_ids(tokenizer: Any, stop_strings: str | Sequence[str]) -> tuple[int, ...]:
    """The ids of the special tokens whose text is one of ``stop_strings`` (``"<|im_start|>"``): stop strings are
    matched in text with special tokens left out, where such a token never appears (the model's next turn ran on
    to the token limit). A row stops at them as at a stop string (which stays one: a model may write the same
    text as plain pieces)."""
    strings = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings or ())
    found = []
    for text in strings if tokenizer is not None else ():
        token = tokenizer.convert_tokens_to_ids(text) if isinstance(text, str) and text else None
        # a special token of that very text (an unknown text gives the unk id, or None where there is none)
        if isinstance(token, int) and tokenizer.decode([token], skip_special_tokens=False) == text \
                and not tokenizer.decode([token], skip_special_tokens=True):
            found.append(token)
    return tuple(dict.fromkeys(found))


@dataclass
class StopConfig:
    """When a row stops: any of ``eos_token_ids``, a stop string (or one of ``stop_token_ids``, the special tokens
    whose text is one: ``special_stop_ids``), ``max_new_tokens``.

    ``stop_strings`` may be one string (as Hugging Face's ``generate`` takes it) or several; it is
    kept as a tuple, and matched in the row's generated text (not in its prompt). An empty stop
    string, which every text contains, is a ``ValueError``.
    """

    max_new_tokens: int = 128
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    @functools.cached_property  # read at every step of a row with stop strings
    def window(self) -> int:
        """How many of a row's last tokens a stop string can span: a token holds at least one byte
        of text (byte-level and byte-fallback pieces of a character hold less than a character),
        plus some for tokens that decode to nothing (special tokens)."""
        return 8 + max((len(text.encode("utf-8")) for text in self.stop_strings), default=0)

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, numbers.Integral) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        self.max_new_tokens = int(self.max_new_tokens)
        if not isinstance(self.stop_strings, Iterable):  # (tuple() of 5: "'int' object is not iterable")
            raise ValueError(f"stop_strings must be a string or a list of strings, got {self.stop_strings!r}")
        strings = (self.stop_strings,) if isinstance(self.stop_strings, str) else tuple(self.stop_strings)
        if any(not isinstance(text, str) for text in strings):
            raise ValueError(f"stop_strings must be a string or a list of strings, got {self.stop_strings!r}")
        for text in strings:  # (a lone surrogate failed the engine step, and every request batched with it)
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ValueError(f"stop string {text!r} is not valid Unicode (a lone surrogate at {err.start}): "
                                 "give whole characters (a surrogate pair read from JSON is one)") from err
        if "" in strings:
            raise ValueError(f"stop_strings={list(strings)!r} holds an empty stop string, which every text "
                             "contains (the row would stop after one token); remove it")
        self.stop_strings = strings


@dataclass
class GenerationOutput:
    """Result of ``generate``.

    Attributes:
        sequences: ``[batch, prompt + new]`` prompt (left-padded as given) and new tokens, rows
            that stopped early padded with the pad token, as ``model.generate`` returns them (on the model's
            device).
        metrics: the call's counters and timings.
        finish_reasons: per row, ``"eos"``, ``"stop"``, ``"length"`` or ``"context"``.
        new_tokens: per row, the generated token ids (no padding).
    """

    sequences: torch.Tensor
    metrics: GenerationMetrics
    finish_reasons: list[str]
    new_tokens: list[list[int]] = field(default_factory=list)


@dataclass
class StreamChunk:
    """Tokens a row committed in one step, and the text they complete (batch 1: ``row`` 0)."""

    row: int
    token_ids: list[int]
    text: str = ""


class DecodeBatch:
    """All mutable state of the rows being decoded together; one object per generation call
    (or per server batch, which other batches can join between steps with ``merge``).

    Rows are numbered in the order they were added (``0..``); ``rows`` lists the active ones. The
    per-row tables (``histories``, ``prompt_lengths``, ``generated``, ``finish``, ``stops``,
    ``samplings``, ``row_steps``, ``row_accepted``) map a row's number to its entry; ``release``
    deletes a finished row's entries, so that a batch rows keep joining holds only the rows not yet
    released. Rows may sample differently (a ``SamplingConfig`` each): each setting's rule chooses its
    own rows' tokens, from the one ``generator``.
    """

    ROW_TABLES = ("histories", "prompt_lengths", "generated", "finish", "stops", "samplings", "row_steps",
                  "row_accepted")

    def __init__(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, proposer: Proposer,
                 sampling: SamplingConfig | Sequence[SamplingConfig], stop: StopConfig | Sequence[StopConfig],
                 tokenizer: Any, generator: torch.Generator | None):
        self.model, self.proposer = model, proposer
        self.tokenizer, self.generator = tokenizer, generator
        self.input_ids, self.attention_mask = input_ids, attention_mask
        batch = input_ids.shape[0]
        stops = list(stop) if isinstance(stop, Sequence) else [stop] * batch
        if len(stops) != batch:
            raise ValueError(f"{len(stops)} stop configs for {batch} rows")
        samplings = list(sampling) if isinstance(sampling, Sequence) else [sampling] * batch
        if len(samplings) != batch:
            raise ValueError(f"{len(samplings)} sampling configs for {batch} rows")
        self.samplings: dict[int, SamplingConfig] = dict(enumerate(samplings))
        self.context_length = context_length(model)
        self.rows = list(range(batch))  # number of each active row
        self.row_count = batch  # rows ever added: the next one joining is numbered this
        self.stops: dict[int, StopConfig] = dict(enumerate(stops))
        self.histories = {b: input_ids[b][attention_mask[b].bool()].tolist() for b in range(batch)}
        self.prompt_lengths = {b: len(h) for b, h in self.histories.items()}
        self.generated: dict[int, list[int]] = {b: [] for b in range(batch)}
        self.finish: dict[int, str | None] = dict.fromkeys(range(batch))
        self.row_steps = dict.fromkeys(range(batch), 0)
        self.row_accepted = dict.fromkeys(range(batch), 0)
        self.released = 0  # finished rows whose entries were dropped (release)
        self._special_ids: set[int] | None = None  # the tokenizer's, read once (_text_window)
        self.metrics = GenerationMetrics(rows=batch)
        self.kv = KVState.empty(batch, AttentionLayout.from_config(model.base_model.config), model.device)
        self.roots = torch.zeros(batch, dtype=torch.long, device=model.device)
        self.root_pos = attention_mask.sum(dim=1).to(model.device)
        if hasattr(proposer, "configure"):  # a draft samples (rows verified losslessly) from the verifier's generator
            proposer.configure(generator)

    # -- phases -------------------------------------------------------------------------------

    def prefill(self) -> dict[int, list[int]]:
        start = time.perf_counter()
        ids, mask = self.input_ids.to(self.model.device), self.attention_mask.to(self.model.device).bool()
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril()
        attn = self.kv.attention_mask(positions, mask, causal, self.model.dtype)  # None: no padding
        out = self.model(ids, attention_mask=attn, position_ids=positions, cache=self.kv.cache,
                         logits_positions=slice(-1, None))
        self.kv.append(mask, positions)
        if not bool(torch.isfinite(out.logits[:, -1]).all()):  # (greedy took token 0 from a NaN row, every step)
            dtype = str(self.model.dtype).removeprefix("torch.")
            raise ValueError("the model's logits after the prompt hold NaN or infinity: " + (
                "its numbers overflowed in float16; load it in bfloat16 or float32 (float16 overflows inside models "
                "such as Gemma 3)" if dtype == "float16" else
                f"in {dtype} its weights (or a heads' adapter merged into them) hold NaN or infinity: a damaged or "
                "diverged checkpoint, to download or train again"))
        self.roots = first_tokens([self.samplings[r] for r in self.rows], out.logits[:, -1], self.generator)
        self.metrics.prefill_s = time.perf_counter() - start
        context = self._context()
        context.target_kv = self.kv
        self.proposer.start(context, out.hidden_states[:, -1])
        emitted = self._emit([[int(t)] for t in self.roots])
        self.metrics.new_tokens += sum(len(t) for t in emitted.values())
        self.metrics.ttft_s = time.perf_counter() - start
        return emitted

    def step(self, speculate: bool = True) -> dict[int, list[int]]:
        """One verification step of every active row; ``speculate=False`` limits the proposal to
        depth 0 (a plain decoding step: ``speculation_gate.gated_step`` takes one where speculating
        measures slower)."""
        metrics, model = self.metrics, self.model
        with metrics.phase("propose"):
            context = self._context()
            if not speculate:
                context.max_depth = 0
            proposal = self.proposer.propose(self.roots, context)
        tree, n = proposal.tree, proposal.tree.num_nodes
        with metrics.phase("verify"):
            positions = self.root_pos[:, None] + tree.depths[None]
            valid = torch.ones_like(positions, dtype=torch.bool)
            attn = self.kv.attention_mask(positions, valid, tree.attn_mask, model.dtype)
            out = model(proposal.tokens, attention_mask=attn, position_ids=positions, cache=self.kv.cache)
            self.kv.append(valid, positions)
        with metrics.phase("accept"):
            acc = accept_rows(context.samplings, out.logits, proposal, self.generator)
        with metrics.phase("commit"):
            lengths = acc.accept_length.tolist()
            # [batch, longest accepted path]: the cache keeps no column that every row left empty
            path_nodes = acc.path_nodes[:, : max(lengths) + 1]
            self.kv.keep_new(n, path_nodes)
            rows = torch.arange(len(self.rows), device=positions.device)
            last = path_nodes[rows, acc.accept_length]
            hidden = out.hidden_states[rows, last]
            path_tokens = proposal.tokens.gather(1, path_nodes.clamp(min=0))
            accepted = [
                path_tokens[i, 1 : 1 + lengths[i]].tolist() + [int(acc.next_token[i])] for i in range(len(self.rows))
            ]
            self.roots = acc.next_token
            self.root_pos = self.root_pos + acc.accept_length + 1
            self.proposer.observe(accepted, hidden, self._context())
            stepped = list(self.rows)  # _emit releases rows that stop
            # the deepest draft each row could emit: its max_new_tokens left (a row with less room than the batch's
            # deepest drops the surplus)
            room = [self.stops[row].max_new_tokens - len(self.generated[row]) for row in stepped]
            emitted = self._emit(accepted)
            # Counted as emitted: what a row accepted past its stopping point was dropped. A row that stops on
            # a draft (an EOS, its last allowed token) emits no token after it: its drafts are all it emitted.
            tokens = [len(emitted[row]) for row in stepped]
            drafts = [min(count, length) for count, length in zip(tokens, lengths)]
            for row, count in zip(stepped, drafts):
                self.row_steps[row] += 1
                self.row_accepted[row] += count
            # a row that stopped on a draft (no token of the step's own after it) could use none deeper
            reachable = [count if self.finish[row] is not None and emitted_n <= count else left
                         for row, count, emitted_n, left in zip(stepped, drafts, tokens, room)]
            if proposal.row_depths is not None:  # nor past its own draft: the padding of a shorter one, unless taken
                reachable = [min(reach, max(own, count))
                             for reach, own, count in zip(reachable, proposal.row_depths, drafts)]
            metrics.record_step(drafts, tree.max_depth, n, proposal.fallback, tokens, reachable)
        return emitted

    # -- bookkeeping --------------------------------------------------------------------------

    def room(self) -> int:
        """The deepest candidate the next step may verify (0: a plain step; the context or
        ``max_new_tokens`` leaves no room for a draft)."""
        return self._context().max_depth

    def _context(self) -> StepContext:
        room_context = self.context_length - 2 - int(self.root_pos.max())  # the bonus token must fit too
        # The row with the most room sets the depth; rows with less drop the surplus when emitting.
        room_tokens = max(self.stops[r].max_new_tokens - len(self.generated[r]) for r in self.rows) - 1
        return StepContext([self.histories[r] for r in self.rows], max(0, min(room_context, room_tokens)),
                           samplings=[self.samplings[r] for r in self.rows])

    def _emit(self, tokens: list[list[int]]) -> dict[int, list[int]]:
        """Append each active row's new tokens up to its stopping point; drop finished rows."""
        emitted: dict[int, list[int]] = {}
        keep = []
        for i, (row, new) in enumerate(zip(self.rows, tokens)):
            kept: list[int] = []
            at_context = int(self.root_pos[i]) >= self.context_length - 1  # its last token ends the row
            for j, token in enumerate(new):
                kept.append(token)
                reason = self._stop_reason(row, kept, token, last=at_context and j == len(new) - 1)
                if reason:
                    self.finish[row] = reason
                    break
            self.generated[row].extend(kept)
            self.histories[row].extend(kept)
            emitted[row] = kept
            if self.finish[row] is None and at_context:
                self.finish[row] = "context"
            if self.finish[row] is None:
                keep.append(i)
        if len(keep) < len(self.rows):
            self._keep(keep)
        return emitted

    def _keep(self, keep: list[int]) -> None:
        """Keep only the active rows at positions ``keep`` of ``self.rows``."""
        index = torch.tensor(keep, dtype=torch.long, device=self.roots.device)
        self.rows = [self.rows[i] for i in keep]
        self.roots, self.root_pos = self.roots[index], self.root_pos[index]
        self.kv.select_rows(index)
        self.proposer.select_rows(index)
        self.kv.compact()

    def cancel(self, row: int) -> None:
        """Stop decoding ``row`` now (e.g. its client went away); its KV slots are freed."""
        if row in self.rows:
            self.finish[row] = "cancelled"
            self._keep([i for i, r in enumerate(self.rows) if r != row])

    def merge(self, other: "DecodeBatch") -> list[int]:
        """Let the active rows of ``other`` (prefilled, same model; each row keeps its sampling settings)
        join this batch between steps; returns their row numbers here. A merge that raises (a refusal, or
        out of memory copying the caches) leaves both batches as they were, each able to go on alone."""
        if other.model is not self.model:
            raise ValueError("only batches of the same model can be merged")
        if not hasattr(self.proposer, "merge"):
            raise ValueError(f"{type(self.proposer).__name__} batches cannot be merged")
        if type(other.proposer) is not type(self.proposer):
            raise ValueError(f"{type(other.proposer).__name__}'s batch cannot join {type(self.proposer).__name__}'s; "
                             "only batches of one method merge")
        roots, root_pos = torch.cat([self.roots, other.roots]), torch.cat([self.root_pos, other.root_pos])
        self.proposer.merge(other.proposer)  # first: it refuses (another draft model, trees) before any change
        try:
            self.kv.merge(other.kv)  # all or nothing
        except BaseException:  # (out of memory): the proposer's joined rows out again, this batch as it was
            self.proposer.select_rows(torch.arange(len(self.rows), device=self.roots.device))
            raise
        offset = self.row_count
        for name in self.ROW_TABLES:
            getattr(self, name).update((offset + row, entry) for row, entry in getattr(other, name).items())
        self.row_count += other.row_count
        self.released += other.released
        joined = [offset + r for r in other.rows]
        self.rows += joined
        self.roots, self.root_pos = roots, root_pos
        self.metrics.rows += other.metrics.rows
        self.metrics.new_tokens += other.metrics.new_tokens  # the joining rows' prefill tokens
        return joined

    def release(self, row: int) -> None:
        """Drop a finished row's entries (its prompt, output, stop settings and counts). A server
        batch that rows keep joining never ends, and would otherwise keep every request's; ``output``
        refuses a batch with released rows."""
        if row not in self.finish:
            raise ValueError(f"row {row} is not in this batch (numbers 0..{self.row_count - 1}) or was released "
                             "already")
        if self.finish[row] is None:
            raise ValueError(f"row {row} is still decoding; only a finished row can be released")
        for name in self.ROW_TABLES:
            del getattr(self, name)[row]
        self.released += 1

    def _stop_reason(self, row: int, kept: list[int], token: int, last: bool = False) -> str | None:
        """Why ``row`` stops at ``token`` (the last of ``kept``, its new tokens so far), or None; ``last``: the
        row ends there whatever (the context is full)."""
        stop = self.stops[row]
        if token in stop.eos_token_ids:
            return "eos"
        if token in stop.stop_token_ids:
            return "stop"
        ending = last or len(self.generated[row]) + len(kept) >= stop.max_new_tokens
        if stop.stop_strings and (ending or not self._is_special(token)):  # (a special token adds no text: no
            # stop string can end at it but at the row's end, where a held-back U+FFFD counts; walking back over a
            # long run of them at every token cost a time quadratic in the run)
            history = self.histories[row] + kept
            window = self._text_window(history, self.prompt_lengths[row], stop.window)
            tail = generated_text_tail(self.tokenizer, history, self.prompt_lengths[row], window)
            # a trailing U+FFFD may be a character whose bytes are still to come (an emoji's first byte token):
            # matched once text follows it, or at the row's last token (a stop string holding U+FFFD ended rows
            # inside ordinary characters)
            if not ending:
                tail = tail.rstrip("\ufffd")
            if any(s in tail for s in stop.stop_strings):
                return "stop"
        if len(self.generated[row]) + len(kept) >= stop.max_new_tokens:
            return "length"
        return None

    def _is_special(self, token: int) -> bool:
        """Whether ``token`` is one of the tokenizer's special tokens, which decode to nothing in the text."""
        if self._special_ids is None:
            self._special_ids = special_ids(self.tokenizer)
        return token in self._special_ids

    def _text_window(self, history: list[int], prompt_length: int, tokens: int) -> int:
        """How many of ``history``'s last generated tokens hold ``tokens`` (``StopConfig.window``) that are no
        special tokens, which decode to nothing (after many of them, a stop string fell out of the window)."""
        window = counted = 0
        for index in range(len(history) - 1, prompt_length - 1, -1):  # (from the end: no copy of the history)
            window += 1
            counted += not self._is_special(history[index])
            if counted >= tokens:
                break
        return max(window, tokens)

    @property
    def done(self) -> bool:
        return not self.rows

    def output(self, pad_token_id: int) -> GenerationOutput:
        if self.released:
            raise ValueError(f"{self.released} rows were released and their tokens dropped; "
                             "call output() before release()")
        order = range(self.row_count)
        generated = [self.generated[row] for row in order]
        width = max(len(g) for g in generated)
        new = torch.full((len(generated), width), pad_token_id, dtype=torch.long)
        for row, tokens in enumerate(generated):
            new[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        prompts = self.input_ids.cpu()
        if prompts.shape[0] != len(generated):  # rows joined by merge: lay prompts out anew
            prompts, _ = left_pad([self.histories[row][: self.prompt_lengths[row]] for row in order], pad_token_id)
        # on the model's device, as model.generate's (the caller's prompts may be on the CPU: there they stayed, and
        # tests/test_cuda.py, never run since on a GPU, would have failed on it)
        sequences = torch.cat([prompts, new], dim=1).to(self.model.device)
        return GenerationOutput(sequences, self.metrics, [self.finish[row] or "length" for row in order], generated)


def left_pad(rows: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, both ``[batch, longest]``, padded on the left."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


def context_length(model) -> int:
    """The most tokens (prompt plus completion) ``model`` (a ``MedusaModel``) can attend over.

    Read from the base model's text config: ``max_position_embeddings``, else ``n_positions``
    (GPT-2), else ``max_sequence_length``. Raises ``ValueError`` when the config states none.
    """
    return config_context_length(model.base_model.config)


def config_context_length(config: Any) -> int:
    """``context_length`` from a model's config (a ``PretrainedConfig``, before the model loads).

    A model with LongRoPE scaling (Phi-3-128k, Phi-3.5, Phi-4-mini) is held to its
    ``original_max_position_embeddings``: past it, the model switches to other rotary factors for the
    whole forward, by its largest position (a tree step would switch a few tokens early), and
    ``generate`` re-encodes the history with them, which decoding from the cache cannot follow."""
    text = config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(text, name, None)
        if value:
            original = longrope_original_length(text)
            return min(int(value), original) if original else int(value)
    raise ValueError(f"{type(config).__name__} states no context length (max_position_embeddings)")


def longrope_original_length(text: Any) -> int | None:
    """The context a LongRoPE model's short rotary factors serve (None for other rotary embeddings)."""
    for rope in (getattr(text, "rope_parameters", None), getattr(text, "rope_scaling", None)):
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "longrope":
            value = rope.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings",
                                                                            None)
            return int(value) if value else None
    return None


def _prepare_inputs(model, tokenizer, input_ids, attention_mask, prompt, messages) -> tuple[torch.Tensor, torch.Tensor]:
    given = [x is not None for x in (input_ids, prompt, messages)]
    if sum(given) != 1:
        raise ValueError("pass exactly one of input_ids, prompt or messages")
    if input_ids is None:
        if attention_mask is not None:
            raise ValueError("attention_mask= goes with input_ids=; prompt= and messages= are tokenised and "
                             "padded here, with a mask of their own: drop attention_mask=")
        if tokenizer is None:
            raise ValueError("prompt= and messages= need a tokenizer; load the model with one or pass tokenizer=")
        texts = encode_chat(tokenizer, messages) if messages is not None else prompt
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"prompt must be a string or a list of strings, got {type(prompt).__name__}; "
                             "pass token ids as input_ids=")
        # padded here: a tokenizer without a pad token (GPT-2's, Llama 2's) refuses to pad
        if messages is not None:
            rows = chat_prompt_ids(tokenizer, messages, texts)
        else:
            rows = tokenizer(list(texts), add_special_tokens=True)["input_ids"] if texts else []
        if not rows:
            raise ValueError("empty prompt: give at least one token of input")
        empty = [i for i, row in enumerate(rows) if not row]  # "" is a prompt where the tokenizer adds a BOS (Gemma's)
        if empty:
            raise ValueError(f"empty prompt: row {empty[0]} ({texts[empty[0]]!r}) tokenises to no token; give every "
                             "row at least one token of input")
        input_ids, attention_mask = left_pad(rows, padding_id(model, tokenizer))
    def is_text(value: Any) -> bool:  # a string, or (nested) lists of them
        return isinstance(value, str) or (isinstance(value, (list, tuple)) and bool(value) and all(map(is_text, value)))

    if is_text(input_ids):
        raise ValueError(f"input_ids must be token ids, got text {input_ids!r:.60}: pass text as prompt= (or a chat "
                         "as messages=)")
    if isinstance(input_ids, Mapping):  # a tokenizer's output (a BatchEncoding), given whole
        raise ValueError(f"input_ids must be token ids, got a mapping of {sorted(input_ids)}: unpack a tokenizer's "
                         "output, generate(model, **encoded)")
    try:
        rows = isinstance(input_ids, (list, tuple)) and input_ids and all(torch.is_tensor(r) for r in input_ids)
        input_ids = torch.stack(list(input_ids)) if rows else torch.as_tensor(input_ids)  # (tensors: rows)
    except (ValueError, TypeError, RuntimeError) as error:  # rows of different lengths
        raise ValueError(f"input_ids must be one row of token ids or rows of equal length ({error}): left-pad rows "
                         "of different lengths and pass attention_mask=, or give the texts as prompt=") from None
    if input_ids.numel() == 0:  # ([] and [[]] read as float32 tensors)
        raise ValueError("empty prompt: every row needs at least one token of input")
    if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    input_ids = input_ids.long()
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length] or [length], got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        pad, bos = _known_token_id(model, tokenizer, "pad_token_id"), _known_token_id(model, tokenizer, "bos_token_id")
        # one row too (its pads were attended to as prompt), unless the pad id is also the BOS it starts with
        padded = input_ids.shape[0] > 1 or pad != bos
        if padded and pad is not None and input_ids.shape[1] and bool((input_ids[:, 0] == pad).any()):
            raise ValueError(f"input_ids has rows that start with the pad id {pad} and no attention_mask: pass "
                             "attention_mask (1 for prompt tokens, 0 for the left padding), or the prompts as prompt=")
        attention_mask = torch.ones_like(input_ids)
    attention_mask = torch.as_tensor(attention_mask)
    if attention_mask.dim() == 1:
        attention_mask = attention_mask[None]
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (token), got values "
                         f"{sorted(set(attention_mask.flatten().tolist()))[:8]}")
    attention_mask = attention_mask.long()
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != "
                         f"input_ids shape {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError("empty prompt: every row needs at least one token of input")
    if bool((attention_mask.sum(1) == 0).any()):
        row = int((attention_mask.sum(1) == 0).nonzero()[0])
        raise ValueError(f"empty prompt: row {row}'s attention_mask is all 0; every row needs at least one token "
                         "of input")
    if bool((attention_mask[:, -1] == 0).any()):
        row = int((attention_mask[:, -1] == 0).nonzero()[0])
        raise ValueError(f"input is right-padded (row {row} ends in padding); pad on the left "
                         "(tokenizer.padding_side = 'left')")
    limit = context_length(model)
    gaps = (attention_mask[:, 1:] < attention_mask[:, :-1]).any(1)  # a 0 after a 1: not left padding
    windows = [w for w in AttentionLayout.from_config(model.base_model.config).windows.values() if w is not None]
    if any(w < limit for w in windows) and bool(gaps.any()):  # (a window as long as the context never slides)
        # positions count tokens, a sliding window here counts positions and transformers' counts cache slots:
        # the answer would be neither model.generate's nor that of the prompt without the masked tokens
        raise ValueError(f"attention_mask row {int(gaps.nonzero()[0])} has a 0 after a 1 (masked tokens inside the "
                         "prompt), which a model with sliding-window attention cannot decode as transformers does: "
                         "drop those tokens from the row and left-pad it")
    lengths = attention_mask.sum(1)
    longest = int(lengths.max())
    if longest >= limit:  # (a prompt of exactly the context leaves no room for a new token)
        row = f"row {int(lengths.argmax())}'s " if len(lengths) > 1 else ""
        raise ValueError(f"{row}prompt of {longest} tokens does not fit the model's context of {limit} tokens with room "
                         f"for a new token; shorten it to at most {limit - 1} tokens")
    vocab = model.base_model.get_output_embeddings().weight.shape[0]
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"input_ids: {token_outside(input_ids.flatten().tolist(), vocab)}")
    return input_ids, attention_mask


def _check_unused_sampling(do_sample: bool, acceptance: str, temperature: Any, top_k: Any, top_p: Any,
                           seed: int | None, typical_epsilon: float, typical_delta: float) -> None:
    """``ValueError`` for a setting this call would ignore: sampling ones without ``do_sample`` (a greedy
    temperature of 0 is taken), typical acceptance's thresholds with another acceptance."""
    if not do_sample:
        given = [f"{name}={value!r}" for name, value, neutral in (
            ("temperature", temperature, (None, 0, 1)), ("top_k", top_k, (None, 0)), ("top_p", top_p, (None, 1)),
            ("seed", seed, (None,))) if value not in neutral]
        if given:
            raise ValueError(f"{', '.join(given)} shape sampling, but do_sample=False decodes greedily; pass "
                             "do_sample=True, or drop them")
    if do_sample and _real(temperature) == 0:  # greedy: the settings that shape sampling would do nothing
        typical = (("typical_epsilon", typical_epsilon, (TYPICAL_EPSILON,)),
                   ("typical_delta", typical_delta, (TYPICAL_DELTA,))) if acceptance == "typical" else ()
        given = [f"{name}={value!r}" for name, value, neutral in (
            ("top_k", top_k, (None, 0)), ("top_p", top_p, (None, 1)), ("seed", seed, (None,)), *typical)
            if value not in neutral]
        if given:
            raise ValueError(f"{', '.join(given)} shape sampling, but temperature=0 decodes greedily; give a "
                             "temperature above 0, or drop them")
    if acceptance != "typical" and (typical_epsilon, typical_delta) != (TYPICAL_EPSILON, TYPICAL_DELTA):
        raise ValueError(f"typical_epsilon={typical_epsilon!r} and typical_delta={typical_delta!r} set typical "
                         f"acceptance, and this call accepts by {acceptance!r}; pass acceptance='typical', or drop them")


def generator_seed(seed: int) -> int:
    """``seed`` as a torch generator's seed: itself in [0, 2**63), else (a negative seed, as OpenAI's
    int64 seeds may be, or one past 2**63) a 63-bit hash of it. ``ValueError`` for a non-integer.
    torch's CPU generator keeps 63 bits, so 2**63 + s drew as s, and it refuses seeds past 64 bits."""
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    seed = int(seed)
    if 0 <= seed < 2**63:
        return seed
    return int.from_bytes(hashlib.sha256(str(seed).encode()).digest()[:8], "big") >> 1


class GenerationStream:
    """An iterator of ``StreamChunk`` as tokens are accepted; ``result()`` gives the final
    ``GenerationOutput`` (draining the iterator first if needed)."""

    def __init__(self, state: "DecodeBatch", pad_token_id: int, gate: SpeculationGate | None = None) -> None:
        self.state, self.pad_token_id, self.gate = state, pad_token_id, gate
        self.input_ids = state.input_ids
        self._run = _StreamRun(_TextTracker(state.tokenizer, len(state.rows)))
        # (the generator holds no reference to the stream: a stream dropped unfinished, a loop over it left with
        # break, is freed at once, with its generator, not at the next garbage collection)
        self._chunks = _stream_chunks(state, gate, pad_token_id, self._run)

    @property
    def running(self) -> bool:
        """Whether the generation may still go on: not finished, failed, or closed (``close()`` of its iterator)."""
        return self._chunks.gi_frame is not None

    def __iter__(self) -> Iterator[StreamChunk]:
        return self._chunks

    def _without_text(self) -> None:
        """Chunks from here on carry their tokens only: each chunk's text re-decodes its row's whole answer,
        work quadratic in its length (generate() and medusa-bench's timings paid for it unread)."""
        self._run.texts = _TextTracker(None, 0)

    def result(self) -> GenerationOutput:
        """The finished generation: iterates what is left of it first. ``RuntimeError`` for a stream closed or
        failed before it finished (its output is lost: start another)."""
        self._without_text()  # the chunks drained here are read by no one
        for _ in self._chunks:
            pass
        if self._run.output is None:
            ended = self._run.ended
            how = ("was closed" if ended is None or isinstance(ended, GeneratorExit)
                   else f"failed ({type(ended).__name__}: {ended})")
            raise RuntimeError(f"this stream {how} before it finished, so it has no result; call result() instead "
                               "of closing a stream whose output is wanted, or start another stream()") from ended
        return self._run.output


@dataclass
class _StreamRun:
    """What a stream's generator and the stream share: the text tracker, and how the generation ended."""

    texts: "_TextTracker"
    output: GenerationOutput | None = None
    ended: BaseException | None = None  # what ended it before it finished (GeneratorExit: closed)


def _stream_chunks(state: "DecodeBatch", gate: SpeculationGate | None, pad_token_id: int,
                   run: _StreamRun) -> Iterator[StreamChunk]:
    """The chunks of ``GenerationStream``, its output left in ``run``."""
    try:
        start = time.perf_counter()
        away = 0.0  # spent by the consumer between chunks (writing them out, say): not the generation's time
        with torch.inference_mode():
            emitted = state.prefill()
        while True:
            for row, tokens in emitted.items():
                if tokens:
                    chunk = StreamChunk(row, tokens, run.texts.update(row, state.generated[row],
                                                                      final=state.finish[row] is not None))
                    handed = time.perf_counter()
                    yield chunk
                    away += time.perf_counter() - handed
            if state.done:
                break
            with torch.inference_mode():
                emitted, _ = gated_step(state, gate)
        state.metrics.total_s = time.perf_counter() - start - away
        run.output = state.output(pad_token_id)
    except BaseException as error:
        run.ended = error
        raise


def stream(
    model,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    prompt: str | Sequence[str] | None = None,
    messages: Any = None,
    max_new_tokens: int = 128,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    acceptance: str | None = None,
    tree: str | Sequence[Sequence[int]] | None = None,
    proposer: Proposer | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    stop_strings: str | Sequence[str] = (),
    seed: int | None = None,
    tokenizer: Any = None,
    typical_epsilon: float | None = TYPICAL_EPSILON,
    typical_delta: float | None = TYPICAL_DELTA,
    adaptive: bool | None = None,
    lookup_tokens: int = 0,
    speculation_gate: SpeculationGate | bool | None = None,
    step_costs: StepCosts | None = None,
) -> GenerationStream:
    """Start a generation whose tokens (and text, with a tokenizer) are yielded as they are
    accepted. Arguments as ``generate``; nothing runs until the stream is iterated."""
    from medusa_infer.model import _warn_processors, check_tokenizer

    check_tokenizer(tokenizer)  # (a name: "'str' object is not callable" at the first prompt)
    if proposer is not None and not isinstance(proposer, Proposer):
        # (a method's name, as --method takes it: an AttributeError after the prompt's forward, or at iteration)
        hint = f"; for the method {proposer!r}: proposers.build_proposer({proposer!r}, model)" \
            if isinstance(proposer, str) else ""
        raise ValueError(f"proposer= must be a Proposer (proposers.build_proposer(method, model)), got "
                         f"{type(proposer).__name__}{hint}")
    _warn_processors(model.base_model)  # a generation config changed since the model was wrapped: said once
    flag = torch.is_tensor(do_sample) and do_sample.dtype == torch.bool and do_sample.dim() == 0  # (a 0-d bool)
    if do_sample is not None and type(do_sample).__name__ not in ("bool", "bool_") and not flag \
            and _integer(do_sample) not in (0, 1):
        raise ValueError(f"do_sample must be True or False, got {do_sample!r}")  # "false" sampled
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    input_ids, attention_mask = _prepare_inputs(model, tokenizer, input_ids, attention_mask, prompt, messages)
    # None is "not set", as Hugging Face's generate takes it
    temperature = 1.0 if temperature is None else temperature
    top_k, top_p = (0 if top_k is None else top_k), (1.0 if top_p is None else top_p)
    stop_strings = () if stop_strings is None else stop_strings
    lookup_tokens = 0 if lookup_tokens is None else lookup_tokens
    typical_epsilon = TYPICAL_EPSILON if typical_epsilon is None else typical_epsilon
    typical_delta = TYPICAL_DELTA if typical_delta is None else typical_delta
    if acceptance is None:
        acceptance = "lossless" if do_sample else "greedy"
    if acceptance not in ACCEPTANCE_RULES:  # before what it implies (a typo was told to pass do_sample=True)
        raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {acceptance!r}")
    if not do_sample and acceptance != "greedy":
        raise ValueError(f"acceptance={acceptance!r} samples; pass do_sample=True (or acceptance='greedy')")
    if do_sample and acceptance == "greedy":
        raise ValueError("acceptance='greedy' takes the model's top token, so do_sample=True and its temperature, "
                         "top_k and top_p would change nothing; drop acceptance='greedy' to sample (lossless by "
                         "default), or pass do_sample=False")
    _check_unused_sampling(do_sample, acceptance, temperature, top_k, top_p, seed, typical_epsilon, typical_delta)
    sampling = SamplingConfig(acceptance, temperature if do_sample else 0.0, top_k, top_p,
                              typical_epsilon, typical_delta)
    stop = StopConfig(max_new_tokens, eos_ids(model, tokenizer, eos_token_id), stop_strings)  # (checked, a tuple)
    stop.stop_token_ids = special_stop_ids(tokenizer, stop.stop_strings)  # (a generator was read up before)
    if stop.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer; pass tokenizer=")
    if proposer is None and model.heads is None:
        given = {"tree": tree, "adaptive": adaptive, "step_costs": step_costs, "lookup_tokens": lookup_tokens or None}
        name = next((name for name, value in given.items() if value is not None), None)
        if name is not None:
            value = "" if name == "step_costs" else repr(given[name])
            raise ValueError(f"{name}={value} shapes the Medusa proposer, but this model has no Medusa heads; "
                             f"load heads (MedusaModel.from_pretrained), pass a proposer, or drop {name}=")
        proposer = AutoregressiveProposer(model)  # no heads: plain decoding, one token a step
    elif proposer is None:
        paths = resolve_tree(model, tree)
        controller = make_controller(model, paths, adaptive, step_costs)
        if controller is None and step_costs is not None:
            raise ValueError("step_costs= is learned by the adaptive fallback, which this call does not run "
                             "(adaptive=False, heads without a calibration, or plain decoding asked for): drop "
                             "step_costs=")
        proposer = MedusaProposer(model, paths, controller=controller, lookup_tokens=lookup_tokens,
                                  datastore=getattr(model, "datastore", None))
    elif tree is not None:
        raise ValueError(f"tree={tree!r} shapes the Medusa proposer that stream() builds; it does not apply to a "
                         "proposer passed in (give the tree to the proposer, e.g. proposers.build_proposer's tree "
                         "option, or drop proposer=)")
    elif adaptive is not None:
        raise ValueError(f"adaptive={adaptive!r} sets the fallback of the Medusa proposer that stream() builds; for a "
                         "proposer passed in, give it to its controller (proposers.build_proposer's adaptive option)")
    elif step_costs is not None:
        raise ValueError("step_costs= is learned by the Medusa proposer that stream() builds; for a proposer passed "
                         "in, give it to its controller (proposers.build_proposer's step_costs option)")
    elif lookup_tokens:
        raise ValueError("lookup_tokens= grafts prompt lookup onto the Medusa tree; it does not apply to a "
                         "proposer passed in (use the lookup proposer's own num_tokens)")
    if not (speculation_gate is None or isinstance(speculation_gate, (bool, SpeculationGate))):
        raise ValueError(f"speculation_gate must be True, False, None or a SpeculationGate, got {speculation_gate!r}")
    if speculation_gate is None:  # greedy batches: the output is the same whichever steps speculate
        speculation_gate = sampling.greedy and input_ids.shape[0] > 1
    if isinstance(proposer, AutoregressiveProposer):
        speculation_gate = None  # plain decoding: nothing to gate
    elif speculation_gate is True:
        speculation_gate = SpeculationGate()
    generator = None
    if seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(generator_seed(seed))
    with _PROPOSER_LOCK:  # checked and taken at once: two threads given one proposer both passed the check, and
        # shared it (a shape error, or a draft's generator replaced by the other call's)
        live = _PROPOSER_RUNS.get(id(proposer))
        if live is not None and live.gi_frame is not None:  # (its state is a call's: the other stream failed with a
            # shape error)
            raise ValueError(f"this proposer ({type(proposer).__name__}) drives another stream that has not finished; "
                             "pass a proposer per call (proposers.build_proposer), or finish that stream (result()) "
                             "or close it first")
        state = DecodeBatch(model, input_ids, attention_mask, proposer, sampling, stop, tokenizer, generator)
        chunks = GenerationStream(state, _pad_id(model, tokenizer, stop), speculation_gate or None)
        _PROPOSER_RUNS[id(proposer)] = chunks._chunks
    return chunks


_PROPOSER_RUNS: "weakref.WeakValueDictionary[int, Iterator[StreamChunk]]" = weakref.WeakValueDictionary()
"""The generator of the stream each proposer was last given to, by ``id`` (it holds the proposer: the id is not
reused while the entry lives): a proposer keeps one call's state, so a second stream is refused it while the first
runs. A stream dropped unfinished (a loop left with break) frees its generator, and the proposer, at once."""

_PROPOSER_LOCK = threading.Lock()
"""Held while a stream checks that its proposer is free and takes it (``_PROPOSER_RUNS``)."""


def generate(model: Any, *args: Any, streamer: Any = None, **kwargs: Any) -> GenerationOutput:
    """Speculative generation, shaped like Hugging Face's ``generate``.

    Args:
        model: a ``MedusaModel``.
        input_ids: ``[batch, seq]`` left-padded token ids (or pass ``prompt=`` / ``messages=``).
        attention_mask: ``[batch, seq]`` 1 for tokens, 0 for left padding.
        prompt: a string or list of strings, tokenised with the model's tokenizer.
        messages: a chat (list of ``{"role", "content"}``) or a list of chats; the tokenizer's
            chat template is applied with the generation prompt.
        max_new_tokens: at most this many new tokens per row; a row also stops where its prompt and answer
            fill the model's context (``finish_reasons`` says ``"context"``), which ``model.generate`` on a
            rotary model would pass.
        do_sample: sample instead of greedy decoding.
        temperature, top_p, top_k: the sampling distribution (lossless keeps it exactly). Typical
            acceptance samples at ``temperature`` alone (Medusa-2's rule): with it, ``top_k > 0`` or
            ``top_p < 1`` is a ``ValueError``. Unset, ``top_k`` is 0, the whole vocabulary (as vLLM), where
            Hugging Face's ``generate`` keeps the 50 likeliest tokens unless something sets it: pass
            ``top_k=50`` to sample as it does.
        acceptance: ``"greedy"`` (default without sampling; output identical to greedy
            decoding in float32, in bfloat16 or float16 parting where two tokens nearly tie; with
            ``do_sample=True`` a ``ValueError``), ``"typical"`` (Medusa-2 typical
            acceptance: more tokens accepted, but its samples do not follow the model's sampling
            distribution) or ``"lossless"`` (default with sampling; the output has exactly the
            model's sampling distribution).
        typical_epsilon, typical_delta: typical acceptance's thresholds (with ``acceptance="typical"``
            alone; None: the default): a draft token x is accepted where its probability under the
            model's tempered distribution p exceeds ``min(typical_epsilon, typical_delta * exp(-H(p)))``,
            epsilon in (0, 1], delta > 0. Medusa's ``posterior_threshold`` and ``posterior_alpha``;
            default ``TYPICAL_EPSILON`` (0.09) and ``TYPICAL_DELTA`` (0.3).
        tree: a preset name, ``fitted-N`` (the N-node tree fitted to the heads' measured
            accuracies, ``resolve_tree``) or a list of paths (an empty list: plain decoding, which
            the adaptive fallback may leave for a tree where it runs: with ``adaptive=True``, or by
            default on heads whose calibration stored plain decoding; ``adaptive=False`` keeps it);
            default: the heads' stored tree, else the largest of ``DEFAULT_TREES`` their number
            and ``top_k`` allow.
        adaptive: shrink the tree (down to plain decoding) while acceptance is too low for
            speculation to pay under the heads' measured cost profile, and grow it back; default:
            on when the heads' config holds head accuracies and a cost profile.
        lookup_tokens: also graft a prompt-lookup chain onto the Medusa tree each step (0: heads
            only), of at most this many tokens; with a cost profile in the heads' config, of the
            length that pays, up to ``proposers.lookup.LOOKUP_MAX_TOKENS`` (``build_proposer``'s
            ``lookup_max_tokens`` sets another limit); see ``proposers.medusa``. The chain also
            comes from the model's datastore when it has one (``MedusaModel.datastore``; set it
            to None to search the conversation alone).
        speculation_gate: take a plain step wherever speculating measures slower at the batch's
            size (``speculation_gate.SpeculationGate``: a batch's rows share one forward, which
            on a CPU can cost more than the drafts bring). Default: a fresh gate for a greedy
            batch of more than one row, whose output does not depend on it; ``False``: none; a
            gate object: that gate, so that it keeps learning across calls. A gate decides by the
            clock: a seeded sample it gates is no longer reproducible from its seed alone (the
            server gates no seeded request).
        step_costs: with the adaptive fallback at batch size 1, learn the trees' cost ratios from
            the steps taken (``adaptive.StepCosts``) rather than trust the calibration's profile
            alone; pass the same object to many calls so that it keeps learning. The trees then
            depend on timings: greedy output does not change, but a seeded sample is no longer
            reproducible from its seed alone. Default: none.
        proposer: another proposer (draft model, prompt lookup, plain decoding), which keeps one
            call's state: a ``ValueError`` while a stream it was given to runs. ``tree``,
            ``adaptive``, ``step_costs`` and ``lookup_tokens`` shape the Medusa proposer built when
            none is passed; with one passed in, or on a model without heads, giving any of them is
            a ``ValueError``.
        eos_token_id: one id or several; default: all of the model's EOS ids.
        stop_strings: stop a row once its generated text contains one of these (one string: that
            string). Matched in the generated text alone, as OpenAI's ``stop`` is: a string that
            begins in the prompt does not stop the row (Hugging Face's ``stop_strings`` would). The text
            leaves special tokens out: one whose text is a stop string stops the row itself. It is the
            generated text as it reads after the prompt, as the server's completion gives it: with a
            SentencePiece tokenizer the first word keeps its leading space there, which the answer decoded
            alone (and a stream's chunks) leave out, so ``" world"`` may stop a row whose text is ``"world"``.
        seed: seed for sampling (with ``do_sample=False`` a ``ValueError``, as is any sampling
            setting: nothing given is silently ignored). A row's sample depends on the seed, on the
            batch it is drawn in and on ``max_new_tokens`` (the last steps' trees are cut to the tokens
            left, which changes the random numbers a step draws: a lower limit's text agrees with the
            longer one up to its last few tokens, and is in general not a prefix of it), and on what a
            ``proposer`` passed in learned in earlier calls (a draft's length, a lookup gate's rates):
            a fresh one repeats a sample.
        tokenizer: the tokenizer ``prompt``, ``messages`` and ``stop_strings`` are read with, and the
            chunks' text decoded with (a tokenizer object); default: the model's.
        streamer: an object with ``put(token_ids)`` / ``end()`` (e.g. transformers'
            ``TextStreamer``); batch size 1. The prompt is put first, as transformers does.

    Returns:
        ``GenerationOutput`` with ``sequences`` as ``model.generate`` returns them and ``metrics``.
    """
    if streamer is not None and not all(callable(getattr(streamer, name, None)) for name in ("put", "end")):
        raise ValueError(f"streamer= needs put(token_ids) and end(), as transformers' TextStreamer has, got "
                         f"{type(streamer).__name__}")
    chunks = stream(model, *args, **kwargs)
    if streamer is None:
        return chunks.result()
    if chunks.input_ids.shape[0] != 1:
        raise ValueError("streamer= supports batch size 1; iterate medusa_infer.decoding.stream() for batches")
    streamer.put(chunks.input_ids)
    chunks._without_text()  # the streamer takes the tokens and decodes them itself
    for chunk in chunks:
        streamer.put(torch.tensor(chunk.token_ids))
    streamer.end()
    return chunks.result()


# generate's signature, as help() and editors show it: stream()'s parameters, their defaults, and streamer= (it
# forwards them, which showed (model, *args, streamer=None, **kwargs) alone)
generate.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [*inspect.signature(stream).parameters.values(),
     inspect.Parameter("streamer", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Any")],
    return_annotation="GenerationOutput")


CLEANUP_SPAN = 4
"""The most characters a pattern of transformers' ``clean_up_tokenization`` spans (``" n't"``): each begins with a
space that it removes once the tokens after it show."""


def cleans_spaces(tokenizer: Any) -> bool:
    """Whether ``tokenizer.decode`` may clean up spaces (WordPiece, Unigram and WordLevel tokenizers asking for it):
    a text's end may then change as tokens come, "it '" becoming "it's". A BPE tokenizer asking for it (Llama 3's
    config does) does not: transformers skips the cleanup there unless told otherwise (its text was taken through
    the cleaning tokenizers' path, which lost a character a prompt cut inside of and the answer completed)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return not (backend is not None and type(backend.model).__name__ == "BPE" and not getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))


def cleanup_settled(text: str) -> int:
    """How much of ``text``, decoded with space cleanup, more tokens after it cannot change: up to the first space
    among its last ``CLEANUP_SPAN`` characters."""
    cut = text.find(" ", max(len(text) - CLEANUP_SPAN, 0))
    return len(text) if cut < 0 else cut


class _TextTracker:
    """Incremental detokenisation: the text a row's new tokens add (empty without a tokenizer)."""

    def __init__(self, tokenizer: Any, rows: int) -> None:
        self.tokenizer, self.sent = tokenizer, [""] * rows
        self.runs = [ByteRun(tokenizer) for _ in range(rows)]
        self.cleans = cleans_spaces(tokenizer)

    def update(self, row: int, tokens: list[int], final: bool = False) -> str:
        """The text ``tokens`` (the row's new tokens so far) add; ``final``: the row ends with them, so
        no text is held back (the chunks' texts then join to the decoded answer). Until then the text
        of a run of byte tokens they end in is held back (``ByteRun``), as is an incomplete
        character."""
        if self.tokenizer is None:
            return ""
        end = len(tokens) if final else self.runs[row](tokens)
        text = self.tokenizer.decode(tokens[:end], skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:  # an incomplete multi-byte character: wait for the rest
            return ""
        if self.cleans and not final:  # held back from a space a cleanup pattern may yet remove
            text = text[: cleanup_settled(text)]
        if len(text) <= len(self.sent[row]):
            return ""
        new, self.sent[row] = text[len(self.sent[row]):], text
        return new


def eos_ids(model, tokenizer, eos_token_id=None) -> tuple[int, ...]:
    """The token ids that end a row: ``eos_token_id`` (an id, a list or a tensor of them) when given, else
    every id the model's generation config, its config and ``tokenizer`` name (a fine-tune may name its
    end-of-turn token in one of them only), in that order without repeats: the first pads finished rows
    where no pad id is known, as in ``model.generate``. ``ValueError`` for an id outside the vocabulary."""
    if hasattr(eos_token_id, "tolist"):  # a tensor or a numpy array or scalar, 0-d too
        eos_token_id = eos_token_id.tolist()
    if eos_token_id is not None:
        ids = [eos_token_id] if isinstance(eos_token_id, numbers.Integral) else eos_token_id
        vocab = model.base_model.get_output_embeddings().weight.shape[0]
        listed = not isinstance(ids, (str, bytes)) and isinstance(ids, Iterable)  # a list, tuple, numpy array
        ids = list(ids) if listed else ids  # once: an iterator read by the check was empty after it (no EOS at all)
        if not listed or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < vocab
                                 for i in ids):
            raise ValueError(f"eos_token_id must be a token id in [0, {vocab}) or a list of them, got "
                             f"{eos_token_id!r}; for a text use stop_strings=, for a token "
                             "tokenizer.convert_tokens_to_ids(...)")
        return tuple(int(i) for i in ids)
    ids: list[int] = []  # the generation config's first, in its order: the first pads, as in model.generate
    for source in (getattr(model.base_model, "generation_config", None), model.base_model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            for i in [value] if isinstance(value, int) else value:
                if int(i) not in ids:
                    ids.append(int(i))
    return tuple(ids)


def padding_id(model, tokenizer) -> int:
    """The id prompts are left-padded with (masked: any id of the model's embedding serves): the known pad id,
    0 where there is none or it lies outside the embedding (a pad token added to a tokenizer whose model was not
    resized: every prompt batched with a longer one failed, "index out of range in self")."""
    pad = _known_token_id(model, tokenizer, "pad_token_id")
    rows = model.base_model.get_input_embeddings().weight.shape[0]
    return pad if pad is not None and 0 <= pad < rows else 0


def _known_token_id(model, tokenizer, name: str) -> int | None:
    """``name`` (``pad_token_id``, ``bos_token_id``) as the model's generation config, the tokenizer or the
    model's config gives it, the first that does."""
    for source in (getattr(model.base_model, "generation_config", None), tokenizer, model.base_model.config):
        value = getattr(source, name, None) if source is not None else None
        if value is not None and not isinstance(value, (list, tuple)):  # (a list: not one id)
            return int(value)
    return None


def _pad_id(model, tokenizer, stop: StopConfig) -> int:
    """The id finished rows are padded with in ``sequences``, as ``model.generate`` picks it: the model's
    generation config's pad id (its config's where it has no generation config), else the first end id.
    Neither the tokenizer's (Llama-3's, set to its end-of-turn id, padded where ``model.generate`` pads
    with ``<|end_of_text|>``) nor, beside a generation config, the model config's is asked, as there.
    (Prompts given as text are padded with the tokenizer's: their padding is masked.)"""
    base = model.base_model
    source = getattr(base, "generation_config", None) or base.config
    found = getattr(source, "pad_token_id", None)
    if found is not None and not isinstance(found, (list, tuple)):
        return int(found)
    return stop.eos_token_ids[0] if stop.eos_token_ids else 0


def make_controller(model, paths: Sequence[Sequence[int]], adaptive: bool | None,
                    step_costs: StepCosts | None = None) -> TreeController | None:
    """The adaptive-fallback controller for ``paths``, or None where none runs (``fallback_paths``);
    it learns batch-1 cost ratios into ``step_costs`` when given (``adaptive.StepCosts``)."""
    if step_costs is not None and not isinstance(step_costs, StepCosts):
        raise ValueError(f"step_costs must be an adaptive.StepCosts (or None), got {step_costs!r}")
    start = fallback_paths(model, paths, adaptive)
    if start is None:
        return None
    config = model.config
    acceptance = config.acceptance_model()
    cost = CostProfile.from_dict(config.cost_profile)
    warn_if_measured_elsewhere(model)
    return TreeController(tree_ladder(start, acceptance=acceptance), acceptance, cost, step_costs=step_costs)


def fallback_paths(model, paths: Sequence[Sequence[int]], adaptive: bool | None) -> list | None:
    """The tree the adaptive fallback grows and shrinks for ``paths``, or None when no fallback runs:
    ``adaptive`` off (None: on for calibrated heads, those with measured accuracies and a cost profile).

    Heads whose calibration stored plain decoding (``config.tree == []``) get a fallback too,
    starting on plain decoding and able to grow to the fastest tree the fit found
    (``FittedTree.speculative_paths``) when head 1's acceptance beats its calibration; pass
    ``adaptive=False`` to keep plain decoding throughout. An empty ``paths`` on heads that have
    a tree (an explicit ``tree=[]``) is plain decoding throughout unless ``adaptive=True`` asks for
    the fallback, which then starts there as on heads that stored plain decoding.
    """
    if adaptive is not None and not isinstance(adaptive, bool):  # "false" would turn the fallback on
        raise ValueError(f"adaptive must be True, False or None (on for calibrated heads), got {adaptive!r}")
    config = model.config
    asked = adaptive is True
    known = bool(config.head_accuracies and config.cost_profile)
    if adaptive is None:
        adaptive = known
    if not adaptive:
        return None
    if not known:
        raise ValueError(
            "adaptive=True needs the heads' measured accuracies and cost profile in their config; "
            "run `medusa-bench --calibrate` or train with train_heads.py first"
        )
    acceptance = config.acceptance_model()
    if not paths:
        if config.tree != [] and not asked:
            return None  # plain decoding asked for, on heads that have a tree
        # calibration expected plain decoding to be fastest: start there (the controller's best rung
        # under the calibrated acceptance), and grow to the fastest tree if acceptance beats it
        paths = [list(p) for p in _speculative_paths(frozen_acceptance(acceptance),
                                                     json.dumps(config.cost_profile, sort_keys=True))]
        if not paths:
            return None
    if not isinstance(acceptance, Mapping):
        _check_measured(paths, acceptance)
    return list(paths)


def _check_measured(paths: Sequence[Sequence[int]], accuracies: Sequence[Sequence[float]]) -> None:
    """Refuse a tree the heads' measured per-rank accuracies do not cover (the adaptive controller
    weighs every node by them): a node deeper than the heads measured, or of a rank past them."""
    ranks = min(len(row) for row in accuracies)
    for path in paths:
        if len(path) > len(accuracies) or max(path) >= ranks:
            raise ValueError(
                f"tree path {tuple(path)} lies outside the heads' measured accuracies (head_accuracies: "
                f"{len(accuracies)} heads, ranks below {ranks}), which adaptive decoding weighs its nodes by: "
                f"use a tree within them (e.g. tree='fitted-16'), adaptive=False, or calibrate again with a "
                f"larger top_k (medusa-bench --calibrate)")


@functools.lru_cache(maxsize=32)
def _speculative_paths(acceptance: tuple, cost_profile: str) -> tuple[tuple[int, ...], ...]:
    """``fit_tree(...).speculative_paths`` for a calibration (its acceptance model as a tuple,
    its cost profile as JSON): fitted once per calibration (about 16 ms on a 2-core CPU), not at
    every ``generate`` call."""
    fitted = fit_tree(thawed_acceptance(acceptance), CostProfile.from_dict(json.loads(cost_profile)))
    return tuple(tuple(p) for p in fitted.speculative_paths)


# The default trees, largest first: the first that fits the heads' number and top_k is used.
DEFAULT_TREES = ("tree-16", "tree-8", "chain-4", "chain-3", "chain-2", "chain-1")


FITTED_TREE = re.compile(r"fitted-(\d+)")
"""``fitted-N``: the N-node tree ``greedy_tree`` fits to the heads' own measured accuracies."""


def resolve_tree(model, tree: str | Sequence[Sequence[int]] | None) -> list[tuple[int, ...]]:
    """Validated paths for ``tree`` (a preset name, ``fitted-N`` or paths); None: the heads' stored
    tree, else the largest of ``DEFAULT_TREES`` that fits the number of heads and their ``top_k``.
    An empty tree (as calibration stores it where plain decoding measured fastest) is plain
    decoding: ``[]``.

    ``fitted-N`` is the N-node tree that maximises the expected accepted length under the heads'
    measured accuracies (``MedusaConfig.acceptance_model``: calibration's where the heads were
    calibrated, else training's held-out ones), whatever this device's costs: the tree training
    fits for ``eval.tree_size``, at another size. ``ValueError`` when the heads hold no measured
    accuracies, or N is below 1 or above the paths measured (joint path accuracies keep the most
    probable paths only; per-head accuracies allow any tree their heads and ``top_k`` allow)."""
    config = model.config
    fitted = FITTED_TREE.fullmatch(tree) if isinstance(tree, str) else None
    if fitted:
        acceptance = config.acceptance_model()
        if acceptance is None:
            raise ValueError(f"tree={tree!r} fits a tree to the heads' measured accuracies, and these heads hold "
                             "none: train them with train_heads.py or run `medusa-bench --calibrate`, or pass a "
                             f"preset ({', '.join(TREE_PRESETS)}) or explicit paths")
        nodes = int(fitted.group(1))
        if config.path_accuracies == []:  # measured (acceptance_model gives the per-rank ones then, all zero)
            raise ValueError(f"tree={tree!r}: the heads' measured path accuracies hold no path (none of their drafts "
                             "was ever accepted), so there is no tree to fit: decode plainly (tree=[]) or train "
                             "the heads further")
        if isinstance(acceptance, Mapping) and nodes > len(acceptance):
            raise ValueError(f"tree={tree!r}: the heads' measured path accuracies hold {len(acceptance)} paths, so a "
                             f"fitted tree has at most {len(acceptance)} nodes (the rest would be paths never seen "
                             f"accepted); ask for fitted-{len(acceptance)} or fewer")
        try:
            paths = greedy_tree(acceptance, nodes)
        except ValueError as error:
            raise ValueError(f"tree={tree!r}: {error}") from None
        return get_tree(paths, config.num_heads, config.top_k)
    if tree is None and config.tree is not None:  # fitted to the device the heads were calibrated on
        warn_if_measured_elsewhere(model)
    if tree is None:
        # (a reduced vocabulary scores fewer tokens than top_k: a default tree ranking past them failed)
        ranks = min(config.top_k, config.head_vocab_size or config.top_k)
        tree = config.tree if config.tree is not None else next(
            name for name in DEFAULT_TREES
            if tree_depth(TREE_PRESETS[name]) <= config.num_heads and _preset_top_k(name) <= ranks)
    if not isinstance(tree, (str, Sequence)):
        raise ValueError(f"tree must be a preset name ({', '.join(TREE_PRESETS)}), 'fitted-N' or a list of paths "
                         f"(tuples of child ranks), got {tree!r}")
    if not isinstance(tree, str) and len(tree) == 0:
        return []
    return get_tree(tree, config.num_heads, config.top_k)


def _preset_top_k(name: str) -> int:
    """The smallest ``top_k`` the preset ``name`` needs."""
    return 1 + max(max(path) for path in TREE_PRESETS[name])
