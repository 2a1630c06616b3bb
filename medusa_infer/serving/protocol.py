"""The OpenAI wire format: request validation and response bodies.

Every request is checked here before it reaches the engine; anything wrong becomes an
``APIError`` whose body has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
Parsing is strict where OpenAI's is (types, ranges, ``n``), and refuses the features this server
does not have (log-probabilities, tools, penalties) instead of silently ignoring them, as it refuses
parameters it does not know (``parameters`` lists what each endpoint takes).
"""

from __future__ import annotations

import difflib
import json
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from medusa_infer.chat import ChatTextError, chat_prompt_ids
from medusa_infer.decoding import token_outside
from medusa_infer.serving import parameters

MAX_BODY_BYTES = 8 << 20
MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 512
MAX_CHARS_PER_TOKEN = 256  # a prompt with more characters than this per context token cannot fit (real
# vocabularies' longest tokens are under 100 characters: SmolLM2's, a newline and 80 spaces)
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # OpenAI's int64 seeds, and unsigned 64-bit ones (decoding.generator_seed)
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant")
ACCEPTANCE_CHOICES = ("lossless", "typical")
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}

NO_RETRY = {"x-should-retry": "false"}
"""The header OpenAI's SDKs read before retrying a failed request (they retry any status >= 500 twice by
default): sent where a retry would only do the same work again (a timeout, a failed generation)."""


class APIError(Exception):
    """An error answered to the client as ``status`` with an OpenAI-style body, and ``headers``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


@dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know about the served model.

    Attributes:
        name: the model id clients must send.
        tokenizer: the model's tokenizer (fast tokenizers are safe to call from the event loop).
        context_length: prompt plus completion may hold at most this many tokens.
        vocab_size: token ids must be below this.
    """

    name: str
    tokenizer: Any
    context_length: int
    vocab_size: int


@dataclass(frozen=True)
class GenerationParams:
    """A validated request. ``acceptance`` is None for greedy requests and for the server default."""

    kind: str  # "completion" or "chat"
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    acceptance: str | None


# -- reading the body ---------------------------------------------------------------------------


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object (NaN and Infinity refused, as JSON has none)."""
    if not raw.strip():
        raise invalid("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
        if json.detect_encoding(raw) != "utf-8" or _SURROGATE.search(raw):  # (else none: walking 8 MB took 1 s)
            _refuse_surrogates(body, "")  # walks every level, as deep as json.loads went
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise invalid(f"the request body is not valid JSON: {_short(error)}") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {_type(body)}")
    return body


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
"""Where a UTF-8 body can hold a lone surrogate: an escape ``\\ud800`` to ``\\udfff``, or its UTF-8 form, which
``json.loads`` decodes (``surrogatepass``)."""


def _refuse_surrogates(value: Any, where: str) -> None:
    """Raise a 400 naming the first string (key or value) with a lone UTF-16 surrogate such as
    ``"\\ud83d"``: legal JSON, as a client that cut an emoji in two sends it, but no text the
    tokenizer (or an error message echoing it) can encode."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        path = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key)
        for text in (key, item):
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as error:
                    bad = text[error.start:error.end].encode("utf-8", "backslashreplace").decode()
                    param = _clip(path.encode("utf-8", "backslashreplace").decode())
                    raise invalid(f"{param} holds a lone UTF-16 surrogate ({bad}), which is not text; send "
                                  "whole characters (an emoji is two surrogates or one escape)", param) from None
        _refuse_surrogates(item, path)


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def parse_completion(body: dict[str, Any], model: ModelInfo) -> GenerationParams:
    """Validate a ``/v1/completions`` body and tokenise its prompt."""
    _check_common(body, model, "completion")
    prompt_ids = _prompt_ids(body, model)
    return _params("completion", body, model, prompt_ids, "max_tokens", DEFAULT_COMPLETION_TOKENS)


def parse_chat(body: dict[str, Any], model: ModelInfo) -> GenerationParams:
    """Validate a ``/v1/chat/completions`` body and render its messages with the chat template."""
    _check_common(body, model, "chat")
    messages = _messages(body)
    _response_format(body)
    tokenizer = model.tokenizer
    if getattr(tokenizer, "chat_template", None) is None:
        raise invalid("this model's tokenizer has no chat template; use /v1/completions instead", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # a template may refuse a conversation (e.g. roles not alternating)
        raise invalid(f"the chat template refused these messages: {_short(error)}", "messages") from None
    _check_length(model, text, "messages")
    try:  # a message's text is text: a control token written in it is not read as that token
        prompt_ids = chat_prompt_ids(tokenizer, messages, [text])[0]
    except ChatTextError as error:
        raise invalid(str(error), f"messages[{error.message}].content") from None
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if name == "max_completion_tokens":  # the older name, sent too, is checked as when sent alone
        _integer(body, "max_tokens", None, 1, None)
    return _params("chat", body, model, prompt_ids, name, None)


def unknown_model(name: str, model: ModelInfo) -> APIError:
    """The 404 for a model id this server does not serve."""
    return APIError(404, f"The model `{_clip(name)}` does not exist; this server serves `{model.name}`.",
                    "invalid_request_error", "model", "model_not_found")


def _check_common(body: dict[str, Any], model: ModelInfo, kind: str) -> None:
    name = body.get("model")
    if name is None:
        raise invalid("you must provide a model parameter", "model")
    if not isinstance(name, str):
        raise invalid(f"model must be a string, got {_type(name)}", "model")
    if name != model.name:
        raise unknown_model(name, model)
    n = _integer(body, "n", 1, None)
    if n != 1:
        raise invalid(f"n must be 1 (this server returns one choice per request), got {n}; "
                      "send separate requests for more", "n")
    _check_parameters(body, kind)


def _check_parameters(body: dict[str, Any], kind: str) -> None:
    """Refuse keys the endpoint does not take, and OpenAI features the server lacks unless left unused."""
    unknown = [key for key in body if key not in parameters.ACCEPTED[kind]]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, sorted(parameters.ACCEPTED[kind]), n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else ""
        more = f" (nor are {', '.join(_clip(k, 40) for k in unknown[1:4])})" if unknown[1:] else ""
        taken = ", ".join(parameters.IMPLEMENTED[kind] + parameters.EXTENSIONS)
        raise invalid(f"{_clip(key)} is not a parameter of {parameters.ENDPOINTS[kind]}{hint}{more}; this server "
                      f"takes {taken}, and OpenAI's other parameters only at their defaults", _clip(key),
                      "unsupported_parameter")
    for param, neutral in parameters.NEUTRAL_FOR[kind].items():
        if param in body and not parameters.is_neutral(body[param], neutral):
            allowed = " or ".join(json.dumps(v) for v in neutral if v is not None)
            raise invalid(f"{param}={_clip(json.dumps(body[param]))} is not supported by this server; leave it out"
                          + (f" or send {allowed}" if allowed else ""), param, "unsupported_parameter")
    for param, type_ in parameters.IGNORED.items():
        if body.get(param) is not None and not isinstance(body[param], type_):
            expected = _type(type_())
            raise invalid(f"{param} must be {'an' if expected[0] in 'aeiou' else 'a'} {expected}, got "
                          f"{_type(body[param])}", param)


def _params(kind: str, body: dict[str, Any], model: ModelInfo, prompt_ids: list[int],
            max_tokens_name: str, default_max_tokens: int | None) -> GenerationParams:
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, exclusive_minimum=True)
    top_k = _integer(body, "top_k", 0, -1, model.vocab_size) or 0
    seed = _integer(body, "seed", None, MIN_SEED, MAX_SEED)
    stream = _boolean(body, "stream", False)
    ignore_eos = _boolean(body, "ignore_eos", False)
    include_usage = _stream_options(body, stream)
    stop = _stop(body)
    acceptance = _choice(body, "acceptance", ACCEPTANCE_CHOICES)
    # given as ids, or a tokenizer's for a token added without resizing the model's embeddings (a chat's was a
    # 500: the engine refuses it)
    outside = token_outside(prompt_ids, model.vocab_size)
    if outside is not None:
        raise invalid(outside, "messages" if kind == "chat" else "prompt")
    room = model.context_length - len(prompt_ids)
    if room < 1:
        raise invalid(f"This model's maximum context length is {model.context_length} tokens, and the prompt "
                      f"has {len(prompt_ids)} tokens, which leaves no room for a completion; shorten the prompt to at most "
                      f"{model.context_length - 1} tokens.", "messages" if kind == "chat" else "prompt",
                      "context_length_exceeded")
    max_tokens = _integer(body, max_tokens_name, None, 1, None)
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise invalid(f"This model's maximum context length is {model.context_length} tokens. However, you "
                      f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                      f"{max_tokens} for the completion). Lower {max_tokens_name} to at most {room} or shorten "
                      "the prompt.", max_tokens_name, "context_length_exceeded")
    return GenerationParams(kind, prompt_ids, max_tokens, temperature, top_p, max(top_k, 0), seed, stop,
                            stream, include_usage, ignore_eos, acceptance)


# -- fields -------------------------------------------------------------------------------------


def _prompt_ids(body: dict[str, Any], model: ModelInfo) -> list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("you must provide a prompt", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or (
            isinstance(prompt[0], list) and all(_is_int(t) for t in prompt[0]))):
        prompt = prompt[0]  # a batch of one (a string or ids: [["text"]] was told to send one prompt, got 1)
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        ids = _tokenize(model, prompt, True, "prompt")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid(f"send one prompt per request (got {len(prompt)})", "prompt")
    else:
        raise invalid("prompt must be a string, a list of token ids, or a list with one of these", "prompt")
    if not ids:
        raise invalid("the prompt has no tokens", "prompt")
    return ids


def _tokenize(model: ModelInfo, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """Token ids of ``text``; text far too long for the context is refused before tokenising it."""
    _check_length(model, text, param)
    return list(model.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _check_length(model: ModelInfo, text: str, param: str) -> None:
    """Refuse text far too long for the context before tokenising it."""
    if len(text) > model.context_length * MAX_CHARS_PER_TOKEN:
        raise invalid(f"This model's maximum context length is {model.context_length} tokens, and the prompt "
                      f"has {len(text)} characters, far more than fit; shorten the prompt.", param,
                      "context_length_exceeded")


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise invalid("you must provide messages", "messages")
    if not isinstance(messages, list):
        raise invalid(f"messages must be a list of message objects, got {_type(messages)}", "messages")
    if not messages:
        raise invalid("messages must not be empty", "messages")
    out = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{param} must be an object with role and content, got {_type(message)}", param)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"{param}.role must be one of {', '.join(CHAT_ROLES)}; got {_clip(repr(role))}",
                          f"{param}.role")
        for key, value in message.items():  # fields a client echoes back from a response may be null
            if key not in ("role", "content") and value not in (None, [], {}):
                raise invalid(f"{param}.{_clip(key, 40)} is not supported by this server (only a message's role "
                              "and content reach the chat template); leave it out", f"{param}.{_clip(key, 40)}",
                              "unsupported_parameter")
        content = _content(message.get("content"), f"{param}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for index, part in enumerate(content):
            where = f"{param}[{index}]"
            if not isinstance(part, dict):
                raise invalid(f"{where} must be a content part object ({{\"type\": \"text\", \"text\": ...}}), got "
                              f"{_type(part)}", where)
            if part.get("type") != "text":
                kind = part.get("type")
                shown = f"a part of type {kind!r}" if isinstance(kind, str) else "a part without a type"
                raise invalid(f"{where} is {_clip(shown, 60)}; this server serves a text-only model: send only text "
                              "parts ({\"type\": \"text\", \"text\": ...}) or a string", where,
                              "unsupported_parameter" if isinstance(kind, str) else None)
            if not isinstance(part.get("text"), str):
                raise invalid(f"{where}.text must be a string, got {_type(part.get('text'))}", f"{where}.text")
            for key, value in part.items():  # cache_control and the like: refused as a message's other fields are
                if key not in ("type", "text") and value is not None:
                    field = f"{where}.{_clip(key, 40)}"
                    raise invalid(f"{field} is not supported by this server (only a text part's type and text "
                                  "reach the chat template); leave it out", field, "unsupported_parameter")
            texts.append(part["text"])
        return "\n".join(texts)
    if content == []:
        raise invalid(f"{param} is an empty list: give at least one text part, or a string", param)
    if content is None:
        raise invalid(f"{param} is required", param)
    raise invalid(f"{param} must be a string or a list of text parts, got {_type(content)}", param)


def _response_format(body: dict[str, Any]) -> None:
    value = body.get("response_format")
    if value is None or value == {"type": "text"}:
        return
    raise invalid("response_format other than {\"type\": \"text\"} is not supported", "response_format",
                  "unsupported_parameter")


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("stop must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    if any(not s for s in stop):
        raise invalid("stop strings must not be empty", "stop")
    if any(len(s) > MAX_STOP_LENGTH for s in stop):
        raise invalid(f"stop strings may be at most {MAX_STOP_LENGTH} characters long", "stop")
    return tuple(stop)


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict):
        raise invalid(f"stream_options must be an object, got {_type(options)}", "stream_options")
    unknown = next((key for key in options if key not in parameters.OPENAI_STREAM_OPTIONS), None)
    if unknown is not None:
        raise invalid(f"stream_options.{_clip(unknown)} is not a stream option; this server takes include_usage "
                      "(and ignores include_obfuscation)", f"stream_options.{_clip(unknown)}",
                      "unsupported_parameter")
    _boolean(options, "include_obfuscation", True, "stream_options.include_obfuscation")
    return _boolean(options, "include_usage", False, "stream_options.include_usage")


def _integer(body: dict[str, Any], name: str, default: int | None, minimum: int | None,
             maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise invalid(f"{name} must be an integer, got {_type(value)} {_clip(repr(value))}", name)
    if minimum is not None and value < minimum:
        raise invalid(f"{name} must be at least {minimum}, got {value}", name)
    if maximum is not None and value > maximum:
        raise invalid(f"{name} must be at most {maximum}, got {_clip(str(value))}", name)
    return value


def _number(body: dict[str, Any], name: str, default: float, minimum: float, maximum: float,
            exclusive_minimum: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{name} must be a number, got {_type(value)} {_clip(repr(value))}", name)
    # (an integer is compared as it is: JSON's integers have no bound, and one past a float's range made
    # math.isfinite raise OverflowError, a 500)
    low_ok = value > minimum if exclusive_minimum else value >= minimum
    if not low_ok or value > maximum or (isinstance(value, float) and math.isnan(value)):
        interval = f"({minimum}, {maximum}]" if exclusive_minimum else f"[{minimum}, {maximum}]"
        raise invalid(f"{name} must be a finite number in {interval}, got {_clip(str(value))}", name)
    return float(value)


def _boolean(body: dict[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{param or name} must be true or false, got {_type(value)} {_clip(repr(value))}", param or name)
    return value


def _choice(body: dict[str, Any], name: str, choices: tuple[str, ...]) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if value not in choices:
        raise invalid(f"{name} must be one of {', '.join(choices)}; got {_clip(repr(value))}", name)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(value), type(value).__name__)


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(error: BaseException) -> str:
    return _clip(str(error) or type(error).__name__, 200)


# -- responses ----------------------------------------------------------------------------------


@dataclass
class Speculation:
    """A request's speculative statistics: ``draft_steps`` decoding steps (after the prefill) in
    which ``accepted_tokens`` draft tokens were accepted and emitted, ``step_tokens`` tokens emitted in
    all; ``tau`` is tokens per step, the bonus token counted (a request that stopped on a draft emitted
    none after it)."""

    method: str
    draft_steps: int = 0
    accepted_tokens: int = 0
    step_tokens: int = 0

    @property
    def tau(self) -> float:
        return self.step_tokens / self.draft_steps if self.draft_steps else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "tau": round(self.tau, 4), "accepted_tokens": self.accepted_tokens,
                "draft_steps": self.draft_steps}


def usage(prompt_tokens: int, completion_tokens: int, speculation: Speculation) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens_details": {"accepted_prediction_tokens": speculation.accepted_tokens},
        "speculative": speculation.to_dict(),
    }


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def response_body(kind: str, request_id: str, model: str, created: int, text: str, finish_reason: str,
                  usage_: dict[str, Any]) -> dict[str, Any]:
    """The whole (non-streamed) answer."""
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": request_id, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": [choice], "usage": usage_}


def chunk_body(kind: str, request_id: str, model: str, created: int, text: str | None,
               finish_reason: str | None = None, first: bool = False, include_usage: bool = False) -> dict[str, Any]:
    """One streamed chunk of the answer. It carries no usage: with ``include_usage`` its ``usage`` is
    null, as OpenAI's are, and ``usage_chunk`` follows the last one."""
    body = _chunk_head(kind, request_id, model, created)
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        body["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    else:
        body["choices"] = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
    if include_usage:
        body["usage"] = None
    return body


def usage_chunk(kind: str, request_id: str, model: str, created: int, usage_: dict[str, Any]) -> dict[str, Any]:
    """The extra last chunk of a stream that asked for ``stream_options.include_usage``: no choices,
    the whole request's usage (with ``usage.speculative``)."""
    return {**_chunk_head(kind, request_id, model, created), "choices": [], "usage": usage_}


def _chunk_head(kind: str, request_id: str, model: str, created: int) -> dict[str, Any]:
    return {"id": request_id, "created": created, "model": model,
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion"}


def now() -> int:
    return int(time.time())
