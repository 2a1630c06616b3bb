"""Chat prompts as token ids: a chat rendered with the tokenizer's template, a message's text read as text.

OpenAI's API reads a message's content as text; transformers' chat templates read a control token written in it
(``<|im_end|>``, ``<|im_start|>system``) as that token, so that a user's message could end its turn and open
another role's. ``chat_prompt_ids`` encodes such text as its characters (transformers' ``sanitize_control_tokens``,
5.20 or later), or refuses the message (``ChatTextError``) where that cannot be done. ``generate(messages=...)``,
the server, ``medusa-generate --chat`` and ``medusa-bench`` encode chats with it.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Iterator, NamedTuple


def encode_chat(tokenizer, messages) -> list[str]:
    """Render chat ``messages`` (one conversation, or a list of them) with the chat template."""
    if not messages:
        raise ValueError("messages is empty")

    def shape(got: str) -> str:
        return (f"messages must be a chat (a list of {{'role', 'content'}} dicts) or a list of chats, got {got}; "
                "pass plain text as prompt=")

    if isinstance(messages, (str, dict)) or not isinstance(messages, (list, tuple)):
        raise ValueError(shape(type(messages).__name__))
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    for chat in conversations:
        if not isinstance(chat, (list, tuple)) or not chat or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in chat):
            raise ValueError(shape(f"an element {str(chat)[:80]!r}"))
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this tokenizer has no chat template; pass prompt= or input_ids= instead")
    return [render_template(tokenizer, c, add_generation_prompt=True) for c in conversations]


class ChatTemplateError(ValueError):
    """A chat template refused a conversation with its own ``raise_exception`` (a system message it wants
    first, roles that do not alternate, a role it takes none of), or could not be read; ``reason``: its words."""

    def __init__(self, text: str, reason: str) -> None:
        super().__init__(text)
        self.reason = reason


def render_template(tokenizer, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
    """``messages`` rendered as text with the tokenizer's chat template; ``ChatTemplateError`` (a ``ValueError``)
    where the template refuses them (jinja2's ``TemplateError`` was a traceback in every command line tool)."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as error:
        roles = ", ".join(str(m.get("role")) for m in messages)
        raise ChatTemplateError(f"the chat template refuses a conversation of {roles} ({error})", str(error)) \
            from error


def check_conversation(tokenizer, system: str | None, flag: str, as_text: bool = True, instead: str = "") -> None:
    """Raise ``ValueError`` naming ``flag`` (the option that gives a system message) where the chat template
    refuses a question, with ``system`` first where given, before any answer is asked for: a template that
    wants a system message first (and renders the question with one), one that takes no system role (Gemma's),
    one that renders no question at all, and (``as_text``: messages encoded as ``chat_prompt_ids`` encodes
    them, not as the template reads them, as distillation does) a system message whose text spells a control
    token. ``instead``: advice beside leaving ``flag`` out."""
    first = [{"role": "system", "content": system}] if system is not None else []
    question = [{"role": "user", "content": "hi"}]
    try:
        if as_text:
            chat_prompt_ids(tokenizer, first + question)
        else:
            render_template(tokenizer, first + question, add_generation_prompt=True)
    except ChatTextError as error:  # (refused at every question)
        raise ValueError(f"{flag}: {error}") from None
    except ChatTemplateError as error:
        other = question if system is not None else [{"role": "system", "content": "You are a helpful assistant."}] \
            + question
        try:
            render_template(tokenizer, other, add_generation_prompt=True)
        except ChatTemplateError:
            raise ValueError(f"the chat template cannot render a question ({error.reason})") from None
        if system is not None:
            raise ValueError(f"{flag}: the chat template refuses a system message ({error.reason}): leave {flag} "
                             f"out{instead}") from None
        raise ValueError(f"the chat template wants a system message first ({error.reason}): give {flag}") from None


class ChatTextError(ValueError):
    """A message holds the text of a control token that cannot be encoded as text (``message``: its index
    in the conversation, ``token``: the control token)."""

    def __init__(self, text: str, message: int, token: str) -> None:
        super().__init__(text)
        self.message, self.token = message, token


def _strings(value: Any) -> Iterator[str]:
    """The strings in a message's values (content as a string or as parts), depth first (a part's ``type`` left
    out: "text" is no text of the message)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if key != "type":
                yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


_CONTROL_IDS: "weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], _ControlTokens]]" = weakref.WeakKeyDictionary()


class _ControlTokens(NamedTuple):
    """A tokenizer's control tokens: ``ids`` to their text, and the characters any of them starts with."""

    ids: dict[int, str]
    first_chars: frozenset[str]


def _control_ids(tokenizer) -> _ControlTokens:
    """The tokenizer's control tokens, as transformers' ``sanitize_control_tokens`` takes them: its special
    tokens, and the added tokens named by ``tokenizer.chat_control_tokens`` where set, else those its chat template
    writes (``<|im_end|>``, ``<start_of_turn>``...) but whitespace (Gemma's added newline tokens, which a template
    holds as text); kept per tokenizer, template and set of special tokens (Gemma's has 6384 added tokens)."""
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    named = getattr(tokenizer, "chat_control_tokens", None)
    named = None if named is None else frozenset(map(str, named))
    # (an added token made special since keeps the count: the special ones are part of the key)
    key = (template, len(added), named, tuple(i for i, token in added.items() if getattr(token, "special", False)))
    try:
        cached = _CONTROL_IDS.get(tokenizer)
    except TypeError:  # (an object no weak reference can be made to)
        cached = None
    if cached is not None and cached[0] == key:
        return cached[1]

    def control(text: str) -> bool:
        return text in named if named is not None else bool(text) and text in template and not text.isspace()

    ids = {int(i): str(token) for i, token in added.items() if getattr(token, "special", False) or control(str(token))}
    tokens = _ControlTokens(ids, frozenset(text[0] for text in ids.values() if text))
    try:
        _CONTROL_IDS[tokenizer] = (key, tokens)
    except TypeError:
        pass
    return tokens


def _control_token_written(tokenizer, chat: Sequence[Mapping[str, Any]]) -> tuple[int, str, bool] | None:
    """The first message (its index) holding the text of one of the tokenizer's control tokens (``_control_ids``),
    that token, and whether the message's text parts form one only where a template joins them (with nothing
    between, or each trimmed, as Gemma's does; such a message wins over a whole token elsewhere, which
    ``sanitize_control_tokens`` would take care of): found by tokenising the strings alone, as the tokenizer matches
    added tokens (a substring search of each of Gemma's 6384 took 24 ms a message of 12,000 characters), and only
    strings holding a character some control token starts with."""
    control = _control_ids(tokenizer)
    if not control.ids:
        return None

    def may_hold(text: str) -> bool:
        return any(char in text for char in control.first_chars)

    strings: list[tuple[int, str, bool]] = []  # (message, text, whether it is the message's parts joined)
    for index, message in enumerate(chat):
        parts = [text for text in _strings({key: value for key, value in message.items() if key != "role"}) if text]
        strings += [(index, text, False) for text in parts if may_hold(text)]
        if len(parts) > 1:  # a template joining them with nothing between (Qwen's), or trimming each (Gemma's)
            strings += [(index, joined, True) for joined in {"".join(parts), "".join(p.strip() for p in parts)}
                        if may_hold(joined)]
    if not strings:
        return None
    rows = tokenizer([text for _, text, _ in strings], add_special_tokens=False)["input_ids"]
    whole = formed = None  # the first message's whole token, and the first formed by a join (strings in order)
    alone: dict[int, int] = {}  # per message: control tokens in its strings each alone
    for (index, text, joined), ids in zip(strings, rows):  # (written in the text: not an unknown word's <unk>)
        hits = [control.ids[i] for i in ids if i in control.ids and control.ids[i] in text]
        if not joined:
            alone[index] = alone.get(index, 0) + len(hits)
            whole = whole or ((index, hits[0], False) if hits else None)
        elif len(hits) > alone.get(index, 0):  # more than the parts hold each alone: the join makes one
            formed = formed or (index, hits[0], True)
    return formed or whole


def chat_prompt_ids(tokenizer, messages, texts: Sequence[str] | None = None) -> list[list[int]]:
    """Token ids of ``messages`` (a chat or a list of chats) rendered with the chat template (``texts``: what
    ``encode_chat`` rendered, when the caller has it), a message's text read as text, as OpenAI's API reads
    it: a control token written in a message (``<|im_end|>``, ``<|im_start|>system``...) is encoded as its
    characters, so that no message can end its turn or open another role's (transformers' chat templates
    read it as the token). ``ChatTextError`` (a ``ValueError``) where that cannot be done: transformers
    before 5.20 (no ``sanitize_control_tokens``), or a tokenizer whose plain text makes that token."""
    texts = list(encode_chat(tokenizer, messages) if texts is None else texts)
    conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
    rows = [list(row) for row in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    for row, chat in enumerate(conversations):
        written = _control_token_written(tokenizer, chat)
        if written is None:
            continue
        index, token, joined = written
        where = f"message {index}" + (f" of chat {row}" if len(conversations) > 1 else "")
        if joined:  # (sanitize_control_tokens reads each part alone: the template's join made the token)
            raise ChatTextError(f"{where}'s text parts, joined, form {token!r}, which the chat template would read "
                                "as that control token: send the message's text as one string, or take it out",
                                index, token)
        if "sanitize_control_tokens" not in inspect.signature(tokenizer.apply_chat_template).parameters:
            import transformers

            raise ChatTextError(
                f"{where} holds {token!r}, the text of one of this tokenizer's control tokens, which transformers "
                f"{transformers.__version__} would read as that token (ending the turn, or opening another role's), "
                "not as text: upgrade transformers to 5.20 or later, which encodes it as text, or take it out of "
                "the message", index, token)
        try:
            ids = tokenizer.apply_chat_template(list(chat), tokenize=True, return_dict=False,
                                                add_generation_prompt=True, sanitize_control_tokens=True)
        except ValueError as error:  # a tokenizer whose plain text makes the token ("</s>" a word of its own)
            raise ChatTextError(f"{where} holds {token!r}, which this tokenizer cannot encode as text ({error}), "
                                "and would read as its control token: take it out of the message", index,
                                token) from None
        rows[row] = [int(i) for i in ids]
    return rows
