"""Tokenised training examples: chat rendering, assistant-only labels, caching, splits.

An example is a dict ``{"id": str, "input_ids": [seq], "labels": [seq]}``. ``labels`` are the input
ids with every token that is not written by the assistant set to ``IGNORE_INDEX`` (system and user
turns, the template's markup around them, the assistant header of the generation prompt). The
assistant's end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, ``</s>``...) stays in the labels so
the heads learn to predict the end of an answer, except after an answer the model never ended: a
distillation row with ``finish_reason: "length"`` (cut by ``max_new_tokens``) ends its example at the
answer's last token, with no end-of-turn markup. Labels are not shifted: position ``t`` holds the
token at ``t``, as in Hugging Face causal-LM losses.

Assistant spans are found without knowing the template: the conversation is rendered up to each
assistant turn with ``add_generation_prompt=True`` and then including that turn; the difference is
the turn. Both renderings must be prefixes of the full conversation ("prefix-stable"), otherwise
``TemplateError`` is raised.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from datasets import Dataset, load_from_disk
from transformers import PreTrainedTokenizerBase

from medusa_infer.chat import ChatTemplateError, render_template

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
CACHE_FORMAT_VERSION = 6  # 6: distilled rows' examples from their response_ids
"""Bump when the tokenisation or the example layout changes: old caches are then ignored."""

ROLES = ("system", "user", "assistant")

#: ShareGPT's turn authors (``{"from": ..., "value": ...}``, the layout of FasterDecoding/Medusa's and Vicuna's
#: training data) and the chat roles they are
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}


def sharegpt_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """A ShareGPT row's ``conversations`` (``[{"from": "human" | "gpt" | "system", "value": ...}]``) as chat
    messages; ``ValueError`` naming the row and the turn for anything else."""
    name, turns = row.get("id", "?"), row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"row {name!r}: 'conversations' must be a non-empty list of ShareGPT turns "
                         f"({{\"from\": \"human\", \"value\": ...}}), got {turns!r:.80}")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or not isinstance(turn.get("value"), str):
            raise ValueError(f"row {name!r}: conversations[{i}] must have a string 'from' and 'value' (ShareGPT), "
                             f"got {turn!r:.80}")
        role = SHAREGPT_ROLES.get(turn["from"].lower())
        if role is None:
            raise ValueError(f"row {name!r}: conversations[{i}] is from {turn['from']!r:.40}, which is no ShareGPT "
                             f"author this reads ({', '.join(SHAREGPT_ROLES)}); drop the row or rename it")
        messages.append({"role": role, "content": turn["value"]})
    return messages


class TemplateError(ValueError):
    """The tokenizer's chat template cannot be used to find the assistant tokens."""


# ---------------------------------------------------------------------------------------------
# Rendering


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def row_messages(row: dict[str, Any], system_prompt: str | None = None) -> list[dict[str, str]]:
    """The chat messages of a row: its ``messages``, its ShareGPT ``conversations``, or ``prompt`` (+ ``response``
    if present).

    ``system_prompt`` is put first unless the conversation already starts with a system message.
    """
    name = row.get("id", "?")
    if "messages" in row and row["messages"] is not None:
        given = row["messages"]
        if not isinstance(given, list) or not given:
            raise ValueError(f"row {name!r}: 'messages' must be a non-empty list of messages, got {given!r:.80}")
        for i, m in enumerate(given):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"row {name!r}: messages[{i}] must have a string 'role' and 'content', "
                                 f"got {m!r:.80}")
        messages = [{"role": m["role"], "content": m["content"]} for m in given]
    elif row.get("conversations") is not None:
        messages = sharegpt_messages(row)
    elif "prompt" in row:
        for key, may_be_null in (("prompt", False), ("response", True)):
            if not isinstance(row.get(key), str) and not (may_be_null and row.get(key) is None):
                raise ValueError(f"row {name!r}: {key!r} must be a string{' or null' if may_be_null else ''}, "
                                 f"got {row.get(key)!r:.80}")
        messages = [{"role": "user", "content": row["prompt"]}]
        if row.get("response") is not None:
            messages.append({"role": "assistant", "content": row["response"]})
    else:
        raise ValueError(
            f"row {row.get('id', '?')!r} has neither 'messages', 'conversations' (ShareGPT) nor 'prompt' (keys: "
            f"{sorted(row)})"
        )
    for i, message in enumerate(messages):
        if message["role"] not in ROLES:
            raise ValueError(f"row {name!r}: unknown role {message['role']!r}, expected one of {ROLES}")
        if message["role"] == "assistant" and not any(m["role"] == "user" for m in messages[:i]):
            raise ValueError(f"row {name!r}: messages[{i}] is an assistant turn with no user turn before it; "
                             "a conversation answers a user, so start it with one (or drop the row)")
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, str]],
    add_generation_prompt: bool = False,
) -> str:
    """The chat template applied to ``messages``, as text (``ChatTemplateError`` where it refuses them)."""
    return render_template(tokenizer, messages, add_generation_prompt)


def render_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str, system_prompt: str | None = None
) -> str:
    """Text the model continues to answer ``prompt``: the chat template with the generation
    prompt, or the plain prompt text when the tokenizer has no template."""
    if not has_chat_template(tokenizer):
        return prompt
    return render_chat(tokenizer, row_messages({"prompt": prompt}, system_prompt), True)


def encode_rendered(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of rendered text. A chat template writes its own BOS, so no special tokens are
    added; plain text gets the tokenizer's usual ones."""
    return tokenizer(text, add_special_tokens=not has_chat_template(tokenizer))["input_ids"]


# ---------------------------------------------------------------------------------------------
# Labels


_MARK = "\ue000"  # a private-use character: no template or tokenizer gives it a meaning


def assistant_char_spans(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]
) -> tuple[str, list[tuple[int, int]]]:
    """The full rendered conversation and the ``[start, end)`` character span of each assistant
    turn in it: its content and end-of-turn markup, without trailing whitespace separators.

    Raises:
        TemplateError: the template is not prefix-stable for this conversation.
    """
    full = render_chat(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
        through = _through_turn(tokenizer, messages[: i + 1])
        if i == len(messages) - 1 and len(through) > len(full) and through.startswith(full):
            full = through  # the end of turn a template writes only where another turn follows (_through_turn)
        for name, text in (("up to", before), ("through", through)):
            if not full.startswith(text):
                raise TemplateError(
                    f"the chat template is not prefix-stable: the conversation rendered {name} "
                    f"assistant turn {i} is not a prefix of the whole conversation (templates that "
                    "rewrite earlier turns, e.g. dropping reasoning, are not supported). Rendered "
                    f"prefix ends with {text[-60:]!r}, whole conversation there reads "
                    f"{full[len(text) - 60:len(text)]!r}."
                )
        if not through.startswith(before):
            raise TemplateError(
                f"the chat template's generation prompt for assistant turn {i} ({before[-40:]!r}) is "
                "not how the template renders that turn; pass a template whose "
                "add_generation_prompt output is the start of the assistant turn."
            )
        end = len(before) + len(through[len(before):].rstrip())
        spans.append((len(before), end))
    return full, spans


def _through_turn(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]) -> str:
    """The conversation rendered through its last turn, without what the template writes only at a
    conversation's end: Phi-3's templates, say, end one with the EOS token after the last turn's
    ``<|end|>\n``, which no turn followed by another holds (it was labelled as the answer's, and made such
    templates fail on multi-turn rows as not prefix-stable). Found as the tokens the rendering shares
    with one where a user turn follows, up to the first EOS token after the turn's content (a template that
    writes the generation prompt after every turn, an assistant's too, shares the next header's first token);
    the rendering itself where that one continues it (most templates), or where the tokenizer gives no
    character offsets. Where the one a user turn follows continues it with the EOS token, a template writing a
    turn's end only before another turn (``{% if not loop.last %}<|im_end|>{% endif %}``), the rendering through
    that token: the model ends its answers with it (as its distilled ``response_ids`` hold), and was never
    taught to."""
    through = render_chat(tokenizer, messages)
    try:
        following = render_chat(tokenizer, [*messages, {"role": "user", "content": _MARK}])
    except ChatTemplateError:  # a template that takes no user turn there: the rendering as it is
        return through
    eos = tokenizer.eos_token if isinstance(tokenizer.eos_token, str) and tokenizer.eos_token else None
    if following.startswith(through):
        rest = following[len(through):]
        # (not where the turn ends with it already: the next turn's BOS, where BOS and EOS are one token)
        if eos is not None and rest.lstrip().startswith(eos) and not through.rstrip().endswith(eos):
            return following[: len(following) - len(rest.lstrip()) + len(eos)]
        return through
    ids, offsets = _with_offsets(tokenizer, through)
    shared = _shared_prefix(ids, tokenizer(following, add_special_tokens=False)["input_ids"])
    if offsets is not None:
        cut = offsets[shared - 1][1] if shared else 0
    else:  # no offsets: the shared tokens' text, where it is the start
        text = tokenizer.decode(ids[:shared], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        cut = len(text) if through.startswith(text) else len(through)
    # only what follows the turn's content is cut: a template that writes the last turn itself otherwise
    # (Qwen3's thinking block, written only for a last assistant turn) parts before it. The content is
    # looked for from the turn's start (a short answer, "end", is also found inside an <|im_end|> after it)
    start = len(render_chat(tokenizer, messages[:-1], add_generation_prompt=True))
    content = str(messages[-1].get("content") or "").strip()
    found = through.find(content, start)
    if not (found >= 0 and cut >= found + len(content) and cut > start):
        return through
    end = through.find(eos, found + len(content)) if eos is not None else -1  # the turn ends with the EOS token
    return through[: min(cut, end + len(eos))] if end >= 0 else through[:cut]


def _with_offsets(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
    """``text``'s token ids and their character offsets, None for a tokenizer that gives none: transformers
    5's pure-Python ones (SentencePiece's among them) leave them out of the encoding, earlier ones raised."""
    try:
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError):  # (mistral-common's backend raises ValueError)
        return tokenizer(text, add_special_tokens=False)["input_ids"], None
    offsets = encoding.get("offset_mapping")
    return list(encoding["input_ids"]), None if offsets is None else [tuple(pair) for pair in offsets]


def _shared_prefix(first: Sequence[int], second: Sequence[int]) -> int:
    """How many leading tokens ``first`` and ``second`` share."""
    shared = 0
    for mine, theirs in zip(first, second):
        if mine != theirs:
            break
        shared += 1
    return shared


class CutOffNotFound(TemplateError):
    """The chat template rewrites an answer, so where a cut-off answer ends cannot be found."""


def tokenize_chat(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], cut_off: bool = False
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of a whole conversation, labels masked outside assistant turns.

    With ``cut_off`` the last message is an assistant answer cut by a token limit: the example is
    the conversation's text up to the end of that answer, without the end-of-turn markup the model
    never wrote, and every token of the answer is labelled.

    Raises:
        TemplateError: the template is not prefix-stable; ``CutOffNotFound`` when, with
            ``cut_off``, it does not write the answer as given (whitespace trimming is fine).
    """
    full, spans = assistant_char_spans(tokenizer, messages)
    if cut_off:
        end = _cut_off_end(tokenizer, messages, full)
        full, spans = full[:end], spans[:-1] + [(spans[-1][0], end)]
    input_ids, offsets = _with_offsets(tokenizer, full)
    if offsets is None:  # tokenizers without offsets (pure-Python or SentencePiece)
        return _tokenize_chat_by_prefix(tokenizer, messages, full, cut_off)
    labels = [IGNORE_INDEX] * len(input_ids)
    for k, (start, stop) in enumerate(spans):
        open_end = cut_off and k == len(spans) - 1  # the text ends inside this answer
        for t, (tok_start, tok_end) in enumerate(offsets):
            # A token straddling the header/content boundary holds content: it is labelled. So is
            # a token at the cut answer's very end (some tokenizers give a trailing space (end, end)).
            if (tok_start < stop and tok_end > start) or (open_end and tok_start >= start):
                labels[t] = input_ids[t]
    return input_ids, labels


def _cut_off_end(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], full: str) -> int:
    """Where the last message, an assistant answer, ends in ``full``, the rendered conversation.

    The answer starts where the template writes a marker put in its place; from there ``full``
    must hold the answer as given, or trimmed of surrounding whitespace.

    Raises:
        ValueError: the last message is not an assistant's.
        CutOffNotFound: the template writes the answer otherwise.
    """
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("only a conversation that ends with an assistant answer can be cut off")
    content = messages[-1]["content"]
    marked = render_chat(tokenizer, [*messages[:-1], {"role": "assistant", "content": _MARK}])
    start = marked.find(_MARK)
    for written in (content, content.strip()):
        if start >= 0 and full.startswith(written, start):
            return start + len(written)
    raise CutOffNotFound(
        f"the chat template does not write the last assistant answer as given (looked for {content[:40]!r}), "
        "so where an answer cut by the token limit ends cannot be found"
    )


def _tokenize_chat_by_prefix(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], full: str, cut_off: bool = False
) -> tuple[list[int], list[int]]:
    """Labels from token prefixes, for tokenizers that give no character offsets. With ``cut_off``
    ``full`` ends inside the last answer (``tokenize_chat``). A token the conversation's tokens merge across a
    turn's boundary (an answer starting with whitespace after its header's newline) is labelled, as a token
    straddling it is with offsets."""

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    input_ids = encode(full)
    labels = [IGNORE_INDEX] * len(input_ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = encode(render_chat(tokenizer, messages[:i], add_generation_prompt=True))
        open_end = cut_off and i == len(messages) - 1
        through = input_ids if open_end else encode(_through_turn(tokenizer, messages[: i + 1]).rstrip())
        start = _shared_prefix(input_ids, before)  # the token from which they differ straddles the boundary
        stop = _shared_prefix(input_ids, through)
        stop += stop < min(len(through), len(input_ids))  # (one straddling the answer's end, too)
        if start < len(before) - 1 or stop < len(through) - 1:  # more than one token's merge: not a boundary's
            raise TemplateError(
                f"assistant turn {i} does not tokenise as a prefix of the whole conversation "
                "(tokens merge across the turn boundary); use a tokenizer with offsets (fast) "
                "or a template that separates turns with special tokens."
            )
        labels[start:stop] = input_ids[start:stop]
    return input_ids, labels


BUILD_STATS_NAME = "medusa_build_stats.json"
"""The ``BuildStats`` of a cached tokenised dataset, in its folder."""


@dataclass
class BuildStats:
    """Counters of one ``build_examples`` call."""

    rows: int = 0
    examples: int = 0
    truncated: int = 0
    cut_off: int = 0
    cut_off_unfound: int = 0
    dropped_no_assistant: int = 0
    dropped_too_long: int = 0
    tokens: int = 0
    label_tokens: int = 0
    from_ids: int = 0
    ids_unused: int = 0

    def left_out(self, setting: str, max_length: int) -> list[str]:
        """What the build cut or dropped, in words (the counts that are not 0); ``setting``: the name
        the caller gives ``max_length`` (``data.max_length``, ``--max-length``)."""
        return [f"{count} {what}" for count, what in (
            (self.truncated, f"cut to {setting}={max_length} tokens"),
            (self.dropped_no_assistant, "dropped with no assistant turn"),
            (self.dropped_too_long, f"dropped with a prompt that fills {setting}={max_length}"),
        ) if count]


def build_examples(
    rows: Iterable[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    system_prompt: str | None = None,
    stats: BuildStats | None = None,
    fixes: tuple[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Tokenise rows into examples with assistant-only labels.

    Args:
        rows: dicts with ``prompt`` and ``response`` (a distillation row) or ``messages`` (a list
            of ``{"role", "content"}``, multi-turn allowed); ``id`` is kept when present. A row
            with ``finish_reason: "length"`` whose last message is the assistant's ends at that
            answer's content: no end-of-turn label where the model did not end its turn.
        tokenizer: a tokenizer with a chat template.
        max_length: longer examples are cut to this many tokens (counted); a row with no
            assistant turn, or whose prompt fills ``max_length`` so that no assistant token is
            left, is dropped (counted apart: ``dropped_no_assistant``, ``dropped_too_long``).
        system_prompt: put first in conversations that have no system message.
        stats: filled with the counts when given.
        fixes: the advice for a tokenizer without a chat template and for rows another template rendered
            (default ``RECIPE_TEMPLATE_FIXES``, a recipe's keys; ``CLI_TEMPLATE_FIXES``: ``--chat-template``).

    Raises:
        TemplateError: the tokenizer has no chat template, or it is not prefix-stable.
        ValueError: a distilled row's prompt was rendered by another template (``check_prompt_template``).
    """
    no_template, changed = fixes or RECIPE_TEMPLATE_FIXES
    if not has_chat_template(tokenizer):
        raise TemplateError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; {no_template}")
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    stats = stats if stats is not None else BuildStats()
    examples = []
    rendering = rendering_digest(tokenizer)  # once: the template is hashed, not per row
    for index, row in enumerate(rows):
        stats.rows += 1
        check_prompt_template([row], tokenizer, changed, rendering)
        messages = row_messages(row, system_prompt)
        if not any(m["role"] == "assistant" for m in messages):
            stats.dropped_no_assistant += 1
            continue
        # A distilled answer cut by max_new_tokens: the model did not end its turn there.
        cut_off = row.get("finish_reason") == "length" and messages[-1]["role"] == "assistant"
        try:
            written = _as_written(tokenizer, row, messages, stats)  # (renders the chat: errors name the row)
            if written is not None:  # the tokens the model wrote, not its text tokenised again
                input_ids, labels = written
            else:
                try:
                    input_ids, labels = tokenize_chat(tokenizer, messages, cut_off)
                except CutOffNotFound:  # kept whole, counted and reported below
                    stats.cut_off_unfound += 1
                    cut_off = False
                    input_ids, labels = tokenize_chat(tokenizer, messages)
        except (TemplateError, ChatTemplateError) as error:  # one row's: name it, in a file of thousands
            # (the template's own raise_exception, e.g. Gemma's and Mistral's on roles that do not
            # alternate)
            raise TemplateError(f"row {row.get('id', index)!r}: {error}") from error
        input_ids, labels, cut = cut_example(input_ids, labels, max_length)
        n_label = sum(label != IGNORE_INDEX for label in labels)
        if n_label == 0:
            if cut:
                stats.dropped_too_long += 1
            else:
                stats.dropped_no_assistant += 1
            continue
        stats.truncated += cut
        stats.cut_off += cut_off
        stats.from_ids += written is not None
        stats.examples += 1
        stats.tokens += len(input_ids)
        stats.label_tokens += n_label
        examples.append(
            # a row without an id has none (its index as its id joined it with another row's id "0" in the split)
            {"id": None if row.get("id") is None else str(row["id"]), "input_ids": input_ids, "labels": labels}
        )
    if stats.ids_unused:
        logger.warning(
            "%d rows' response_ids do not decode to their response (edited, or of another tokenizer): their "
            "answers were tokenised from the text", stats.ids_unused,
        )
    if stats.cut_off_unfound:
        logger.warning(
            "%d answers cut by the token limit keep an end-of-turn label: the chat template does not write "
            "them as given, so where they end cannot be found (a template that rewrites answers, e.g. "
            "dropping reasoning)", stats.cut_off_unfound,
        )
    logger.info(
        "built %d examples from %d rows (%d from the answers' token ids as generated; %d tokens, %d labelled); "
        "%d truncated to %d tokens, "
        "%d answers cut by the token limit (no end-of-turn label), %d dropped with no assistant turn, "
        "%d with a prompt that fills max_length",
        stats.examples, stats.rows, stats.from_ids, stats.tokens, stats.label_tokens, stats.truncated,
        max_length, stats.cut_off, stats.dropped_no_assistant, stats.dropped_too_long,
    )
    return examples


def _as_written(tokenizer: PreTrainedTokenizerBase, row: dict[str, Any], messages: Sequence[dict[str, str]],
                stats: BuildStats) -> tuple[list[int], list[int]] | None:
    """``(input_ids, labels)`` of a distilled row from the tokens the model wrote (its ``response_ids``, the end
    token included where it ended its turn) after its prompt as decoding renders it; None for a row without them
    (an endpoint's, a conversation), or whose ids do not decode to its ``response`` or hold one past the
    tokenizer's (counted in ``ids_unused``).
    Its text tokenised again parts otherwise in some answers (SmolLM2: ``"\n\n1."`` as two
    newline tokens the model wrote as one; an answer starting with a newline merged with the header's): the
    heads learnt from sequences decoding never produces."""
    ids = row.get("response_ids")
    if ids is None or row.get("messages") is not None or messages[-1]["role"] != "assistant":
        return None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"row {row.get('id', '?')!r}: 'response_ids' must be a list of token ids (integers >= 0), "
                         f"got {ids!r:.80}")
    answer = ids[:-1] if row.get("finish_reason") == "eos" and ids else ids
    # an id past the tokenizer's (a padded embedding's row the model sampled) has no text: as ids that do not decode
    if any(t >= len(tokenizer) for t in ids) or \
            tokenizer.decode(answer, skip_special_tokens=False) != messages[-1]["content"]:
        stats.ids_unused += 1
        return None
    prompt = encode_rendered(tokenizer, render_chat(tokenizer, messages[:-1], add_generation_prompt=True))
    return prompt + list(ids), [IGNORE_INDEX] * len(prompt) + list(ids)


def check_template(tokenizer: PreTrainedTokenizerBase, system_prompt: str | None = None) -> None:
    """Raise ``TemplateError`` unless ``build_examples`` can label a distilled answer with ``tokenizer``:
    it has a chat template, and with ``system_prompt`` first the template renders the conversation
    as its generation prompt followed by the answer. ``train_heads`` checks this before distilling,
    whose answers are of no use otherwise (Mistral-7B-Instruct-v0.3's template writes the system
    prompt into the last user turn only: into the prompt a model answers, not into the conversation
    that holds the answer)."""
    row = {"id": "a sample question", "prompt": "What is 2 + 2?", "response": "2 + 2 is 4."}
    fix = ", or leave out data.system_prompt" if system_prompt is not None else ""
    try:
        examples = build_examples([row], tokenizer, 10**6, system_prompt)
    except TemplateError as error:
        if system_prompt is None and has_chat_template(tokenizer):  # one that wants a system message first
            try:
                build_examples([row], tokenizer, 10**6, "You are a helpful assistant.")
                fix = " (it renders them with a system message first: set data.system_prompt)"
            except TemplateError:
                pass
        raise TemplateError(
            f"{tokenizer.name_or_path!r}: the training examples cannot be built from distilled answers "
            f"({error}); set model.chat_template to one that can{fix}"
        ) from error
    labelled = [tokenizer.decode([t for t in ex["labels"] if t != IGNORE_INDEX]) for ex in examples]
    if not any(row["response"] in text for text in labelled):
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        hint = (f" (model.chat_template is the template's text, and {template!r:.80} has no {{{{ or {{% in it: "
                "give the template itself, not a file's name)" if "{{" not in template and "{%" not in template
                else "")
        raise TemplateError(
            f"{tokenizer.name_or_path!r}: the chat template does not write an assistant's answer into the "
            f"conversation (a sample answer {row['response']!r} came out labelled as {labelled or 'nothing'})"
            f"{hint}; set model.chat_template to one that does{fix}"
        )


def truncate_examples(examples: Iterable[dict[str, Any]], max_length: int) -> tuple[list[dict[str, Any]], int, int]:
    """Ready examples (``data.tokenized``) under the rule ``build_examples`` applies: each cut to its first
    ``max_length`` tokens, and one with no labelled token (left) dropped. Returns ``(examples, cut,
    dropped)``; ``ValueError`` naming an example with a negative token id, whose labels are not one per token, or
    not each either -100 or
    the token at its own position (labels shifted by one, or another ignore value such as -1, trained on
    other targets than the heads are meant to, the prompt's soft labels included, without a word)."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    kept, cut, dropped = [], 0, 0
    for index, example in enumerate(examples):
        for key in ("input_ids", "labels"):
            value = example.get(key)
            if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                raise ValueError(f"ready example {example.get('id', index)!r} needs {key!r} as a list of token ids "
                                 f"(-100 for labels not trained on), got {value!r:.80}")
        negative = next((t for t in example["input_ids"] if t < 0), None)
        if negative is not None:  # (an embedding's IndexError, or a device-side assert, at the first forward)
            raise ValueError(f"ready example {example.get('id', index)!r} holds the token id {negative} in its "
                             "input_ids: ids are >= 0 (padding, if any, belongs in no ready example)")
        if len(example["labels"]) != len(example["input_ids"]):
            raise ValueError(f"ready example {example.get('id', index)!r} has {len(example['labels'])} labels for "
                             f"{len(example['input_ids'])} input_ids; give one label per token (-100: not trained on)")
        wrong = next((t for t, (token, label) in enumerate(zip(example["input_ids"], example["labels"]))
                      if label not in (IGNORE_INDEX, token)), None)
        if wrong is not None:
            raise ValueError(f"ready example {example.get('id', index)!r} has label {example['labels'][wrong]} at "
                             f"position {wrong}, where input_ids holds {example['input_ids'][wrong]}: labels are "
                             f"the tokens themselves, not shifted (labels[t] == input_ids[t]), and {IGNORE_INDEX} "
                             "where not trained on")
        input_ids, labels, was_cut = cut_example(list(example["input_ids"]), list(example["labels"]), max_length)
        cut += was_cut
        if all(label == IGNORE_INDEX for label in labels):
            dropped += 1
            continue
        kept.append({**example, "input_ids": input_ids, "labels": labels})
    return kept, cut, dropped


def cut_example(input_ids: list[int], labels: list[int], max_length: int) -> tuple[list[int], list[int], bool]:
    """An example's first ``max_length`` tokens and labels, and whether it was longer."""
    if len(input_ids) <= max_length:
        return input_ids, labels, False
    return input_ids[:max_length], labels[:max_length], True


# ---------------------------------------------------------------------------------------------
# Datasets and caching


def to_dataset(examples: Sequence[dict[str, Any]]) -> Dataset:
    """A ``datasets.Dataset`` with one row per example."""
    if not examples:
        raise ValueError("no examples to put in a dataset")
    return Dataset.from_list(list(examples))


def is_json_array(path: Path) -> bool:
    """Whether the file ``path`` holds one JSON array (ShareGPT's ``.json`` files) rather than JSON lines."""
    with path.open("rb") as handle:
        return handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


def read_json_array(path: Path) -> list[Any]:
    """The elements of a file holding one JSON array (``is_json_array``); ``ValueError`` naming the file where it
    is no valid JSON."""
    with utf8_errors(path), path.open(encoding="utf-8-sig") as handle:
        try:
            return json.load(handle)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err})") from err


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file, of a file holding one JSON array of them (ShareGPT's ``.json``), or of a ``datasets``
    folder saved with ``save_to_disk``."""
    path = Path(path)
    if path.is_dir():
        loaded = load_from_disk(str(path))
        if not isinstance(loaded, Dataset):  # a DatasetDict's rows were its split names
            splits = list(loaded)
            raise ValueError(f"{path} holds the splits {splits}, not one set of rows: give one split's folder "
                             f"({path}/{splits[0] if splits else 'train'}) or save that split alone")
        return list(loaded)
    if is_json_array(path):
        rows = read_json_array(path)
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
        if bad is not None:
            raise ValueError(f"{path}: element {bad} of its array is a JSON {type(rows[bad]).__name__}, not an "
                             "object: each element is one row")
        return rows
    rows = []
    with utf8_errors(path), path.open(encoding="utf-8-sig") as handle:  # (a byte order mark: left out)
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number} is not valid JSON ({err})") from err
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number} is a JSON {type(row).__name__}, not an object: each line is one "
                                 f"row, e.g. {{\"prompt\": ..., \"response\": ...}}; got {line.strip()!r:.80}")
            rows.append(row)
    return rows


@contextlib.contextmanager
def utf8_errors(path: Path) -> Iterator[None]:
    """Within the block, bytes of the file ``path`` that are not UTF-8 (a ``UnicodeDecodeError`` reading it as text)
    are a ``ValueError`` naming the line, the byte and the fix: the codec's own message named neither the file nor
    the line, and counted from the block read. The file is read again, a line at a time, to find them (not where
    ``path`` is no regular file: a pipe is read once)."""
    try:
        yield
    except UnicodeDecodeError as err:
        from medusa_infer.cli import decode_utf8

        if path.is_file():
            offset = 0
            with path.open("rb") as handle:
                for number, raw in enumerate(handle, 1):
                    decode_utf8(raw, path, number, offset)  # (raises, naming the line)
                    offset += len(raw)
        raise ValueError(f"{path} is not UTF-8 text ({err.reason}): save it as UTF-8") from None


def row_sources(path: str | Path) -> Iterator[Any]:
    """The ``source`` of each row of ``path`` (as ``read_rows`` reads it; None where a row has none), a row at a
    time: the answers and token ids are not kept (the rows file of a large run is gigabytes once parsed)."""
    path = Path(path)
    if path.is_dir() or is_json_array(path):
        loaded = load_from_disk(str(path)) if path.is_dir() else None
        if isinstance(loaded, Dataset) and "source" in loaded.column_names:
            yield from loaded["source"]
        else:
            yield from (row.get("source") for row in read_rows(path))
        return
    with utf8_errors(path), path.open(encoding="utf-8-sig") as handle:
        for line in handle:
            if line.strip():
                row = json.loads(line)
                yield row.get("source") if isinstance(row, dict) else None


def count_sources(sources: Iterable[Any]) -> dict[str, int]:
    """How many rows each prompt source gave (``row_sources``; rows without one under ``NO_SOURCE``), most
    first; empty where no row names a source."""
    counts: dict[str, int] = {}
    for source in sources:
        key = source if isinstance(source, str) and source else NO_SOURCE
        counts[key] = counts.get(key, 0) + 1
    if set(counts) <= {NO_SOURCE}:
        return {}
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


NO_SOURCE = "(no source)"
"""``count_sources``' name for rows that name no source."""


def content_hash(path: Path) -> str:
    """sha256 of a file's bytes, or of a folder's files (names and bytes, in sorted order)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else "").encode())
        with file.open("rb") as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of what decides tokenisation: name, class, vocabulary, special tokens, template, and a fast
    tokenizer's whole pipeline (normalizer, pre-tokenizer, merges, post-processor)."""
    digest = hashlib.sha256()
    digest.update(type(tokenizer).__name__.encode())
    digest.update(str(tokenizer.name_or_path).encode())
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # less the padding and truncation the last call left set, which tokenise nothing
        pipeline = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("padding", "truncation")}
        digest.update(json.dumps(pipeline, sort_keys=True).encode())
    digest.update(json.dumps(tokenizer.all_special_tokens).encode())
    digest.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return digest.hexdigest()


def dataset_cache_key(
    rows_path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    system_prompt: str | None = None,
) -> str:
    """The cache key of a tokenised dataset (hex): rows content, tokenizer, settings, format."""
    parts = {
        "format": CACHE_FORMAT_VERSION,
        "rows": content_hash(Path(rows_path)),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_length": max_length,
        "system_prompt": system_prompt,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


CLI_FIXES = ("pass --chat-template '' (the tokenizer's own)", "pass that template as --chat-template FILE",
             "pass --system-prompt ''", "pass it as --system-prompt")
"""``check_rows``'s advice in the words of a command's flags: a template of the tokenizer's own, another one, no
system prompt, another one."""


def check_rows(rows: Sequence[dict[str, Any]], chat_template: str | None, system_prompt: str | None,
               fixes: tuple[str, str, str, str] = CLI_FIXES) -> None:
    """Refuse distilled rows whose recorded chat template or system prompt differs from the ones the
    examples are built with (rows without a ``generation`` record are taken as they are): built otherwise, the
    heads learn answers to a prompt the model was never shown. ``fixes`` words the advice (``CLI_FIXES``)."""
    digest = template_digest(chat_template)
    for row in rows:
        if "prompt_template" in row and row["prompt_template"] is None:  # (endpoint rows record none)
            raise ValueError(f"row {row.get('id')!r} was distilled with its prompt as plain text (the tokenizer had "
                             "no chat template), and examples are chats: distil the rows again in a chat template "
                             "(--chat-template FILE to medusa_train.distill, model.chat_template in a recipe), into "
                             "another output path")
        generation = row.get("generation")
        if not isinstance(generation, dict):
            continue
        recorded = recorded_template(generation.get("chat_template", digest))
        if recorded != digest:
            fix = fixes[0] if recorded is None else fixes[1]
            raise ValueError(f"row {row.get('id')!r} was distilled with chat template "
                             f"{recorded or 'of the tokenizer'}, the examples would be built with "
                             f"{digest or 'the tokenizer template'}; {fix}")
        recorded = generation.get("system_prompt", system_prompt)
        if recorded != system_prompt:
            fix = fixes[2] if recorded is None else fixes[3]
            raise ValueError(f"row {row.get('id')!r} was distilled with system prompt {recorded!r}, the examples "
                             f"would be built with {system_prompt!r}; {fix}")


#: ``build_examples``' advice (no chat template; rows another template rendered) where a recipe builds the examples,
#: and where a command line does (``python -m medusa_train.datastore``)
RECIPE_TEMPLATE_FIXES = (
    "set `tokenizer.chat_template` to a jinja template before building examples (model.chat_template in a recipe)",
    "distil the rows again with the template as it is now (into another output path), or install the one that "
    "rendered them (model.chat_template in a recipe)")
CLI_TEMPLATE_FIXES = ("give the template to render the conversations with: --chat-template FILE",
                      "give the template that rendered them: --chat-template FILE")


def template_digest(template: str | None) -> str | None:
    """How rows record a chat template that replaced the tokenizer's own (None: the tokenizer's), and the one in
    effect (``rendering_digest``)."""
    return None if template is None else "sha256:" + hashlib.sha256(template.encode()).hexdigest()[:16]


def recorded_template(digest: str | None) -> str | None:
    """A row's recorded ``chat_template`` as this release records it: an earlier one recorded ``--chat-template ''``
    (the tokenizer's own) as the digest of '' (its rows were refused on resume and in training)."""
    return None if digest == template_digest("") else digest


def rendering_digest(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """``template_digest`` of the chat template ``tokenizer`` renders with (None: it has none). A distilled row
    records it (``prompt_template``): a template edited or updated on the Hub since leaves the weights'
    identity as it was, and rows answered to another rendering were resumed and trained on the new one."""
    template = getattr(tokenizer, "chat_template", None) or None
    if template is not None and not isinstance(template, str):  # named templates: {name: template}
        template = json.dumps(template, sort_keys=True)
    return template_digest(template)


def check_prompt_template(rows: Iterable[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, fix: str,
                          digest: str | None = None) -> None:
    """``ValueError`` naming the first row that records (``prompt_template``) another template in effect than
    ``tokenizer``'s (``digest``: its ``rendering_digest``, computed when not given), with ``fix``; rows that record
    none (an endpoint's, an earlier release's) pass."""
    digest = digest if digest is not None else rendering_digest(tokenizer)
    for row in rows:
        if "prompt_template" in row and row["prompt_template"] != digest:
            raise ValueError(f"row {row.get('id')!r} was distilled with its prompt rendered by chat template "
                             f"{row['prompt_template']}, and {tokenizer.name_or_path!r} renders with {digest} now "
                             f"(its template was edited or updated since: the answers are to another prompt); {fix}")


def load_or_build_dataset(
    rows_path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    cache_dir: str | Path,
    system_prompt: str | None = None,
    stats: BuildStats | None = None,
    record: dict[str, Any] | None = None,
) -> Dataset:
    """The tokenised dataset of ``rows_path`` (JSONL or a saved ``datasets`` folder), from the
    cache when it holds one for the same rows, tokenizer, template and settings; otherwise built
    and saved to ``cache_dir/tokenized-<key>`` (written aside, then renamed into place).
    ``stats``, when given, receives the build's counts (kept with the cache, ``BUILD_STATS_NAME``:
    a cached dataset reports what its build truncated and dropped as well), and ``record`` beside
    them (what the caller wants to find there later: ``train_heads`` the settings it was built for).

    One row per example: packing happens per batch, in the forward passes that pay for padding
    (``data.pack``, ``medusa_train.features.pad_batch``).

    Raises:
        ValueError: no row gave an example (the counts say why).
    """
    key = dataset_cache_key(rows_path, tokenizer, max_length, system_prompt)
    target = Path(cache_dir) / f"tokenized-{key[:24]}"
    stats = stats if stats is not None else BuildStats()
    if record:  # the folder's format (the key holds it too), which the plan cannot compute: a record of its own
        record = {**record, "format": CACHE_FORMAT_VERSION}
    if (target / "dataset_info.json").is_file():
        logger.info("loading tokenised dataset from cache %s", target)
        try:
            saved = json.loads((target / BUILD_STATS_NAME).read_text())
            for name in asdict(stats):
                setattr(stats, name, int(saved.get(name, 0)))
        except (OSError, ValueError, TypeError, AttributeError):  # a cache of an earlier release has none
            saved = {}
        if record and any(saved.get(key) != value for key, value in record.items()):
            # (a cache of an earlier release: its counts are unknown, the record is added)
            aside = target / f"{BUILD_STATS_NAME}.tmp"  # renamed into place: other processes read it
            aside.write_text(json.dumps({**saved, **record}) + "\n")
            os.replace(aside, target / BUILD_STATS_NAME)
        return load_from_disk(str(target))
    examples = build_examples(read_rows(rows_path), tokenizer, max_length, system_prompt, stats)
    if not examples:
        fix = ("raise data.max_length" if stats.dropped_too_long else
               "give rows with answers (prompts to distil go in data.prompts, not data.rows)")
        raise ValueError(f"no examples in {rows_path} ({stats.rows} rows): "
                         f"{', '.join(stats.left_out('data.max_length', max_length)) or 'none given'}; {fix}")
    dataset = to_dataset(examples)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_killed_builds(target)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        dataset.save_to_disk(str(work / "data"))
        (work / "data" / BUILD_STATS_NAME).write_text(json.dumps({**asdict(stats), **(record or {})}) + "\n")
        if target.exists():  # an incomplete folder (no dataset_info.json) from a killed run
            shutil.rmtree(target)
        os.replace(work / "data", target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    logger.info("saved tokenised dataset (%d rows) to %s", len(dataset), target)
    return load_from_disk(str(target))


KILLED_BUILD_AGE_S = 60.0
"""A work folder of a build of the tokenised dataset untouched this long is a killed build's (a build writes its
files within seconds of each other)."""


def remove_killed_builds(target: Path) -> None:
    """Remove the hidden work folders (``.<target>.partial-*``, each a whole copy of the dataset) that builds of
    ``target`` killed by SIGTERM or SIGKILL left (an interrupt's ``finally`` removes its own); nothing read them."""
    for leftover in target.parent.glob(f".{target.name}.partial-*"):
        try:
            if time.time() - leftover.stat().st_mtime < KILLED_BUILD_AGE_S:
                continue
        except OSError:  # gone meanwhile
            continue
        shutil.rmtree(leftover, ignore_errors=True)
        logger.info("removed %s, left by a killed build of the tokenised dataset", leftover)


def head_positions(labels: Sequence[int]) -> int:
    """The positions of an example where the heads are trained and scored: ``t`` whose ``labels[t + 1]``
    and ``labels[t + 2]`` are both assistant tokens (decoding runs the heads where the base model's next
    token is the answer's, and head 1 predicts the one after it)."""
    return sum(a != IGNORE_INDEX and b != IGNORE_INDEX for a, b in zip(labels[1:], labels[2:]))


def heads_with_targets(examples: Sequence[dict[str, Any]], enough: int | None = None) -> int:
    """How many heads (from head 1) have a target in ``examples`` at most: head ``k`` at a position ``t`` the
    heads run at (``labels[t + 1]`` and ``labels[t + 2]`` answer tokens) predicts ``labels[t + k + 1]``, so the
    first such ``t`` of an example reaches head ``last - t - 1``, ``last`` its last answer token. With
    ``enough``, the count once it reaches that (the examples after are not read)."""
    most = 0
    for example in examples:
        if enough is not None and most >= enough:
            break
        labels = example["labels"]
        answer = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
        labelled = set(answer)
        first = next((t for t in range(len(labels) - 2) if t + 1 in labelled and t + 2 in labelled), None)
        if first is not None:
            most = max(most, answer[-1] - first - 1)
    return most


def check_head_positions(train: Sequence[dict[str, Any]], heldout: Sequence[dict[str, Any]],
                         num_heads: int | None = None) -> None:
    """``ValueError`` where a split's examples hold no position the heads learn from or are scored at
    (``head_positions``: answers of one token), before training: the evaluation failed after it; with
    ``num_heads``, also where the last heads would learn from nothing (``heads_with_targets``), which were
    trained on no position and saved untrained without a word."""
    for name, split, use, fix in (
        ("training", train, "learn from", "distil longer answers (data.max_new_tokens) or give more rows"),
        ("held-out", heldout, "are scored at", "hold out more (data.heldout_fraction) or distil longer answers "
                                              "(data.max_new_tokens)"),
    ):
        if split and not any(head_positions(example["labels"]) for example in split):
            raise ValueError(f"none of the {len(split)} {name} examples has two answer tokens in a row, the positions "
                             f"the heads {use} (head 1 predicts the token after the base model's next one): {fix}")
    if num_heads is None:
        return
    for name, split, use, fix in (
            ("training", train, "would learn from", "give longer answers (data.max_new_tokens, data.max_length)"),
            # (scored 0.000 in config.json and the card, and left out of every fitted tree, as if measured)
            ("held-out", heldout, "would be scored at", "hold out more (data.heldout_fraction) or give longer "
                                                        "answers (data.max_new_tokens)")):
        reached = heads_with_targets(split, num_heads)
        if split and 0 < reached < num_heads:  # (none: refused above)
            raise ValueError(f"heads {reached + 1}..{num_heads} {use} no position: no {name} example's answer "
                             f"reaches {reached + 2} tokens (head k predicts the answer's token k + 1 after the "
                             f"next one); lower heads.num_heads to {reached}, or {fix}")


def split_heldout(dataset: Dataset, fraction: float, seed: int = 0) -> tuple[Dataset, Dataset]:
    """``(train, heldout)``: a deterministic random split by example, each keeping file order.

    ``heldout`` gets ``train_config.split_sizes``' count: ``round(fraction * len(dataset))``
    examples, at least one when ``fraction > 0``; ``ValueError`` when that leaves a split empty. Examples
    that share a prompt ``id`` (several answers to one prompt) stay on one side, counted by id
    (``split_indices``).
    """
    from medusa_train.train_config import split_indices

    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"held-out fraction must be in [0, 1), got {fraction}")
    ids = dataset["id"] if "id" in dataset.column_names else None
    train, heldout = split_indices(len(dataset), fraction, seed, ids)
    return dataset.select(train), dataset.select(heldout)
