"""Which request parameters each endpoint takes, and what the server does with each.

Every key of a request body must be one of OpenAI's parameters for that endpoint or one of this
server's ``EXTENSIONS``; anything else (a misspelling, another server's extension such as
``repetition_penalty``) is refused by ``protocol`` with ``unsupported_parameter``. Of OpenAI's
parameters, the server implements some, accepts the ones in ``NEUTRAL`` only at the values that
mean "not used", and accepts and ignores the ones in ``IGNORED``, which change nothing in the
answer. ``tests/test_serving_bad_input.py`` checks that every OpenAI parameter is in one of these.
"""

from __future__ import annotations

from typing import Any

# OpenAI's request body parameters, as the openai-python SDK (3.57) types them:
# ``openai.types.completion_create_params`` and ``openai.types.chat.completion_create_params``.
OPENAI_COMPLETION_PARAMETERS = frozenset({
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
})
OPENAI_CHAT_PARAMETERS = frozenset({
    "model", "messages", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "moderation", "n", "parallel_tool_calls",
    "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
    "web_search_options",
})
OPENAI_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})  # include_obfuscation: ignored

# The OpenAI parameters this server implements (``response_format`` only as {"type": "text"}).
IMPLEMENTED_COMPLETION = ("model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream",
                          "stream_options")
IMPLEMENTED_CHAT = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
                    "seed", "stream", "stream_options", "response_format")

# Not OpenAI's: vLLM-style extensions this server implements on both endpoints.
EXTENSIONS = ("top_k", "ignore_eos", "acceptance")

# OpenAI parameters the server does not implement, and the values that mean "not used" (the only ones accepted).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),  # chat's boolean; the completions endpoint's integer: see NEUTRAL_FOR
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "prediction": (None,),
    "modalities": (None, ["text"]),
    "moderation": (None,),
    "reasoning_effort": (None, "none"),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),  # nothing is stored
    "verbosity": (None, "medium"),
    "web_search_options": (None,),
}

# OpenAI parameters accepted with their JSON type and ignored: labels for the caller's records, prompt-cache
# hints (this server keeps no cache across requests), ``metadata`` (kept by OpenAI only with ``store``, which
# is refused), ``parallel_tool_calls`` (matters only with ``tools``, which are refused).
IGNORED: dict[str, type] = {
    "user": str,
    "safety_identifier": str,
    "prompt_cache_key": str,
    "prompt_cache_retention": str,
    "prompt_cache_options": dict,
    "metadata": dict,
    "parallel_tool_calls": bool,
}

# Per endpoint: /v1/completions' ``logprobs`` is a count of alternatives, where 0 still asks for the
# sampled token's log-probability, so only its absence means "not used" there.
NEUTRAL_FOR = {"completion": {**NEUTRAL, "logprobs": (None,)}, "chat": NEUTRAL}

ACCEPTED = {
    "completion": OPENAI_COMPLETION_PARAMETERS | frozenset(EXTENSIONS),
    "chat": OPENAI_CHAT_PARAMETERS | frozenset(EXTENSIONS),
}
IMPLEMENTED = {"completion": IMPLEMENTED_COMPLETION, "chat": IMPLEMENTED_CHAT}
ENDPOINTS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


def is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of the ``neutral`` values (``true`` is not ``1``, nor ``false`` ``0``)."""
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)
