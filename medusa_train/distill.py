"""Self-distillation data: the target model answers training prompts; its answers become the labels.

Prompts come from a JSONL file of ``{"id", "source", "prompt"}`` rows, sampled evenly across
sources. Two backends write the same rows:

- ``local``: the model in float32, decoded by medusa_infer's loop with plain steps, batched with
  left padding, prompts sorted by length to cut padding; greedy by default. Several processes
  (``accelerate launch``) split the prompts, process ``i`` taking prompts ``i::world_size``.
- ``openai``: an OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM, TGI), a bounded number
  of requests at a time, retried with backoff on 5xx, 408, 425, 429 and connection errors.

Each process appends rows to ``<output>.rank{i}.jsonl`` (flushed and fsynced per batch). A
restarted run skips ids already written (a half-written last line is dropped), so a killed run
continues without duplicates or gaps. At the end the main process merges everything into
``<output>`` in prompt order (and, with ``format="arrow"``, also saves a ``datasets`` folder).
With ``save_hidden`` the local backend also keeps the model's hidden states of every answer, for
the Medusa-1 feature cache (``medusa_train.captured``).

Row: ``{"id", "source", "prompt", "response", "model", "generation": {"max_new_tokens",
"do_sample", "temperature", "top_p", "seed", "chat_template", "system_prompt"}, "finish_reason":
"eos" | "length", "response_tokens"}`` (the answer's tokens, an end token not counted), and from the local backend
``"response_ids"``: the answer's token ids as the model wrote them, its end token included where it ended its turn
(training builds its examples from these: the text tokenised again can part otherwise, ``"\n\n"`` as two tokens
the model wrote as one), and ``"prompt_template"``: a digest of the chat template that rendered the prompt, the
tokenizer's own included (a resumed run and training refuse rows of another one). For greedy rows ``temperature``
is recorded as 0.0 and
``top_p`` as 1.0; ``chat_template`` is a digest of a template that replaced the tokenizer's own
(None: the tokenizer's).
``prompt`` is the text the model answered (shortened when ``prompt_overflow="truncate"`` cut it).
An endpoint's answers are its text, special tokens left out where the server leaves them out (vLLM's
and medusa-serve's default): a special token the model wrote inside an answer, which the local
backend keeps, is missing from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import http.client
import json
import logging
import os
import random
import shutil
import ssl
import sys
import threading
import time
import typing
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from medusa_infer.attention_kernels import decoding_attention
from medusa_infer.cli import MAX_NEW_TOKENS, MAX_THREADS
from medusa_infer.decoding import generate, left_pad, padding_id
from medusa_infer.model import MedusaModel
from medusa_infer.proposers import AutoregressiveProposer
from medusa_train.captured import HiddenRecorder, hidden_dir, save_batch
from medusa_train.dataset import (
    check_prompt_template,
    encode_rendered,
    has_chat_template,
    is_json_array,
    read_json_array,
    recorded_template,
    render_prompt,
    rendering_digest,
    row_messages,
    template_digest,
    utf8_errors,
)
from medusa_infer.models import weights_identity
from medusa_train.features import model_fingerprint
from medusa_train.train_config import TrainConfig, convert_value, first_launch_process, read_recipe, rows_path

logger = logging.getLogger(__name__)

BACKENDS = ("local", "openai")
BACKEND_SETTINGS = {"local": ("device", "threads"),
                    "openai": ("api_key_env", "concurrency", "request_timeout_s", "max_retries", "retry_backoff_s")}
"""The settings that backend alone reads (``endpoint``, ``endpoint_model`` and ``save_hidden`` are checked apart)."""
FORMATS = ("jsonl", "arrow")
OVERFLOW = ("skip", "truncate")
FINISH_REASONS = {"stop": "eos", "eos": "eos", "eos_token": "eos", "length": "length"}
"""OpenAI-style ``finish_reason`` values mapped to ours."""

RECIPE_KEYS = {
    "prompts": "data.prompts", "output": "data.rows", "model": "model.name", "n": "data.n",
    "per_source": "data.per_source", "max_new_tokens": "data.max_new_tokens", "batch_size": "data.distill_batch_size",
    "seed": "training.seed", "system_prompt": "data.system_prompt", "chat_template": "model.chat_template",
    "progress": "log.progress", "trust_remote_code": "model.trust_remote_code",
    "save_hidden": "features.from_distillation",  # (set here, the plan and features/index.json said otherwise)
}
"""``DistillConfig`` fields a training recipe sets through its own keys (not ``data.distill_options``)."""

BatchHook = Callable[[int, list[dict[str, Any]]], None]
"""Called after each batch is written and synced: ``hook(batch_index, rows)``."""


@dataclass
class DistillConfig:
    """What to distil and how.

    Attributes:
        model: the target model (default-model name, folder or Hub id); for ``backend="openai"``
            also the tokenizer used to check prompt lengths (when ``max_prompt_tokens`` is set).
        prompts: JSONL file of ``{"id", "source", "prompt"}`` rows.
        output: the merged JSONL file; shards are ``<output>.rank{i}.jsonl`` next to it.
        n: prompts to sample (``None``: all of them, or the sum of ``per_source``).
        per_source: quotas ``{source: count}``; sources not named are not used. Without it,
            sources take turns (round robin) so that large sources do not dominate.
        exclude_ids: ids never sampled (e.g. a held-out set); a string is a file of them, as
            ``--exclude-ids`` takes (``read_ids``: JSONL rows with an ``id``, or one id a line).
        max_new_tokens, do_sample, temperature, top_p, seed: generation settings (temperature and top_p
            only with ``do_sample``, where they default to 0.7 and 1; without it a ``ValueError``); ``seed`` also
            drives prompt sampling. Greedy rows do not depend on batching (float32); sampled rows
            are reproducible for the same batches (each batch is seeded from ``seed`` and its
            ids): a run resumed after a kill between batches draws the same samples as an
            uninterrupted one, and other samples only after a kill within a batch, or with another
            number of processes or ``n``; an endpoint gets a seed of each prompt's own, from
            ``seed`` and its id.
        batch_size: prompts per ``generate`` call (local) or rows per sync (openai).
        format: ``"jsonl"``, or ``"arrow"`` to also save a ``datasets`` folder
            (``arrow_path(output)``) once the JSONL is complete.
        max_prompt_tokens: longer rendered prompts are skipped or truncated
            (``prompt_overflow``), counted and logged; ``None``: no limit.
        system_prompt: a system message put before each prompt.
        chat_template: a jinja chat template that replaces the tokenizer's own (e.g. Vicuna's
            v1.1 template, whose tokenizer ships none) when prompts are rendered. The ``openai``
            backend sends messages, so the server applies its own template; there this one only
            renders prompts to check ``max_prompt_tokens``.
        backend: ``"local"`` or ``"openai"``.
        endpoint: base URL of the OpenAI-compatible server (``http://host:8000`` or ``.../v1``).
        api_key_env: environment variable holding the API key (no key sent when unset).
        endpoint_model: model name sent to the endpoint (default: ``model``).
        concurrency: requests in flight at once (openai), per process: N processes keep N times as many.
        request_timeout_s, max_retries, retry_backoff_s: per request (``request_timeout_s`` bounds each wait
            for the server, to connect or for the next bytes of its reply, not the whole reply); the wait before
            retry ``k``
            is ``retry_backoff_s * 2**k`` (capped at 60 s) times 1 to 1.25 at random, or the server's
            ``Retry-After`` when longer (capped at 120 s).
        device: where the local model runs (default: the accelerator's device, else CPU).
        threads: CPU threads torch uses while generating (``None``: torch's default). On a CPU
            shared with other work one thread can be several times faster than two (threads
            spin-waiting on each other); the rows do not change.
        progress: show a progress bar.
        trust_remote_code: run the model repository's own code when loading its tokenizer and
            model (only for models that need it).
        save_hidden: (local backend) also keep the model's final hidden state at every answer
            position, in ``medusa_train.captured.hidden_dir(output)``, so that the Medusa-1
            feature cache takes them instead of running the backbone over the data again.
    """

    prompts: str = ""
    output: str = "distill.jsonl"
    model: str = "smollm2-135m-instruct"
    n: int | None = None
    per_source: dict[str, int] | None = None
    exclude_ids: str | list[str] = field(default_factory=list)
    max_new_tokens: int = 256
    batch_size: int = 16
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    seed: int = 0
    format: str = "jsonl"
    max_prompt_tokens: int | None = 1024
    prompt_overflow: str = "skip"
    system_prompt: str | None = None
    chat_template: str | None = None
    backend: str = "local"
    endpoint: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    endpoint_model: str | None = None
    concurrency: int = 8
    request_timeout_s: float = 300.0
    max_retries: int = 5
    retry_backoff_s: float = 1.0
    device: str | None = None
    threads: int | None = None
    progress: bool = True
    save_hidden: bool = False
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.chat_template == "":  # --chat-template '': the tokenizer's own (a digest of '' was recorded)
            self.chat_template = None
        # ~ as a recipe's paths take it (--output=~/x, which no shell expands, wrote into a folder named ~ here)
        self.prompts, self.output = (os.path.expanduser(p) if isinstance(p, str) else p
                                     for p in (self.prompts, self.output))
        if not str(self.output).strip():
            raise ValueError("output is empty: give the path of the rows' file (JSONL), such as rows.jsonl")
        if Path(self.output).is_dir():  # (an IsADirectoryError traceback once the first answers were in)
            raise ValueError(f"output={str(self.output)!r} is a folder: give the path of the rows' file (JSONL), "
                             f"such as {Path(self.output) / 'rows.jsonl'}")
        if isinstance(self.exclude_ids, (str, Path)):  # a file of ids, as --exclude-ids takes (a name taken
            self.exclude_ids = Path(self.exclude_ids).expanduser()  # (~ as the recipe's other paths take it)
            if not Path(self.exclude_ids).is_file():  # as ids would exclude nothing, character by character)
                raise ValueError(f"exclude_ids={str(self.exclude_ids)!r} is not a file: give a file of ids (JSONL "
                                 "rows with an 'id', or one id a line) or a list of ids")
            self.exclude_ids = read_ids(self.exclude_ids)
        given = [name for name in ("temperature", "top_p") if getattr(self, name) is not None]
        if given and not self.do_sample:  # answered greedily, the setting silently dropped
            raise ValueError(f"{' and '.join(given)} set the sampling, but do_sample is off, so the answers would be "
                             "greedy: add do_sample (--do-sample, data.distill_options.do_sample=true) or drop "
                             f"{' and '.join(given)}")
        if self.do_sample:  # the defaults of sampling
            self.temperature = 0.7 if self.temperature is None else self.temperature
            self.top_p = 1.0 if self.top_p is None else self.top_p
        checks = (
            (self.backend in BACKENDS, f"backend must be one of {BACKENDS}, got {self.backend!r}"),
            (self.format in FORMATS, f"format must be one of {FORMATS}, got {self.format!r}"),
            (self.prompt_overflow in OVERFLOW,
             f"prompt_overflow must be one of {OVERFLOW}, got {self.prompt_overflow!r}"),
            (1 <= self.max_new_tokens <= MAX_NEW_TOKENS,  # (past it: "Overflow when unpacking long", after loading)
             f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens}"),
            (self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"),
            (self.system_prompt != "", "system_prompt is empty: give text, or leave it out (the chat template's own "
             "default); rows with an empty one could not be trained on (a recipe's data.system_prompt takes none)"),
            (self.concurrency >= 1, f"concurrency must be >= 1, got {self.concurrency}"),
            (self.max_retries >= 0, f"max_retries must be >= 0 (0: ask once), got {self.max_retries}"),
            (self.request_timeout_s > 0, f"request_timeout_s must be > 0 seconds, got {self.request_timeout_s}"),
            (self.retry_backoff_s >= 0, f"retry_backoff_s must be >= 0 seconds, got {self.retry_backoff_s}"),
            (not self.chat_template or "{{" in self.chat_template or "{%" in self.chat_template,
             f"chat_template {self.chat_template!r:.100} has no {{{{ or {{%, so it is no template: every prompt would "
             "render as that text; give the template's text (a recipe's model.chat_template), or a file that "
             "exists (--chat-template reads one)"),
            (self.threads is None or 1 <= self.threads <= MAX_THREADS,
             f"threads must be in [1, {MAX_THREADS}], got {self.threads}"),
            (self.n is None or self.n >= 1, f"n must be >= 1 (or left out: every prompt), got {self.n}"),
            (all(isinstance(q, int) and not isinstance(q, bool) and q >= 1 for q in (self.per_source or {}).values()),
             f"per_source quotas must be whole numbers >= 1, got {self.per_source}"),
            (not self.do_sample or self.temperature > 0,
             f"sampling needs temperature > 0, got {self.temperature}; use do_sample=False for greedy"),
            (self.top_p is None or 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
             f"max_prompt_tokens must be >= 1 or None, got {self.max_prompt_tokens}"),
            (self.backend != "openai" or bool(self.endpoint),
             "backend 'openai' needs endpoint, e.g. http://127.0.0.1:8000"),
            # (a scheme left out, or a port that is no number: each prompt retried 4 times, then exclude_ids advised)
            (self.backend != "openai" or not self.endpoint or endpoint_problem(self.endpoint) is None,
             f"endpoint {self.endpoint!r} {endpoint_problem(self.endpoint or '')}: give the server's address with its "
             "scheme, e.g. http://127.0.0.1:8000 or https://host/v1"),
            # (the local model answered, and the rows were labelled with it: a 7B model loaded for a server's work)
            (self.backend == "openai" or not (self.endpoint or self.endpoint_model),
             f"endpoint and endpoint_model are read by backend 'openai', and the backend is {self.backend!r}: add "
             "--backend openai (data.distill_options.backend=openai), or drop them"),
            (bool(self.prompts), "prompts (a JSONL file of {id, source, prompt} rows) is required"),
            (not self.save_hidden or self.backend == "local",
             "save_hidden needs the local backend (an endpoint returns text, not hidden states); "
             "set save_hidden=False, and the feature cache runs the backbone over the answers"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        # another backend's settings, given (not their defaults) and never read: silently dropped
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        other = {"local": "openai", "openai": "local"}.get(self.backend)
        unread = [name for name in BACKEND_SETTINGS.get(other, ()) if getattr(self, name) != defaults[name]]
        if unread:
            fix = ("add --backend openai (data.distill_options.backend=openai), or drop them" if other == "openai"
                   else "drop them (the server runs the model where and as it was started)")
            raise ValueError(f"{', '.join(f'{name}={getattr(self, name)!r}' for name in unread)}: read by backend "
                             f"{other!r} only, and the backend is {self.backend!r}: {fix}")

    @property
    def model_label(self) -> str:
        """The ``model`` field of the rows."""
        if self.backend == "openai" and self.endpoint_model:
            return self.endpoint_model
        return self.model

    def generation_record(self) -> dict[str, Any]:
        """The ``generation`` field of the rows."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": self.do_sample,
            "temperature": float(self.temperature) if self.do_sample else 0.0,
            "top_p": float(self.top_p) if self.do_sample else 1.0,
            "seed": self.seed,
            # what the prompts were rendered with: resuming with another template or system prompt
            # would mix two distributions in one file
            "chat_template": template_digest(self.chat_template),
            "system_prompt": self.system_prompt,
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DistillConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown distill settings {unknown}; known: {sorted(known)}")
        return cls(**values)


@dataclass
class ShardStats:
    """What one process did."""

    rank: int = 0
    already_done: int = 0
    rows: int = 0
    tokens: int = 0
    seconds: float = 0.0
    eos: int = 0
    length: int = 0
    skipped_too_long: int = 0
    truncated_prompts: int = 0
    failed: int = 0
    rejected: int = 0

    def add(self, row: dict[str, Any]) -> None:
        self.rows += 1
        self.tokens += row["response_tokens"]
        if row["finish_reason"] == "eos":
            self.eos += 1
        else:
            self.length += 1

    def summary(self) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        return (
            f"distill rank {self.rank}: {self.rows} rows written ({self.already_done} already "
            f"done), {self.tokens} response tokens in {self.seconds:.1f} s = {rate:.1f} tokens/s; "
            f"finish eos {self.eos} / length {self.length}; prompts skipped as too long "
            f"{self.skipped_too_long}, truncated {self.truncated_prompts}; failed {self.failed}"
            + (f"; refused by the endpoint {self.rejected}" if self.rejected else "")
        )


# ---------------------------------------------------------------------------------------------
# Prompts


def _encodable(text: str) -> bool:
    """Whether ``text`` is UTF-8 text (JSON's ``\\ud83d`` escapes can make strings with lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _prompt_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for each row of a prompts file: JSON lines (``path:line``), or one JSON array of rows
    (ShareGPT's ``.json``: ``path[index]``)."""
    if is_json_array(path):
        yield from ((f"{path}[{index}]", row) for index, row in enumerate(read_json_array(path)))
        return
    with utf8_errors(path), path.open(encoding="utf-8-sig") as handle:  # (a byte order mark: left out)
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                hint = (": a prompts file holds one JSON object per line (JSONL), or one JSON array of them in "
                        "all" if line.lstrip().startswith("[") else "")
                raise ValueError(f"{path}:{number} is not valid JSON ({err}){hint}") from err
            yield f"{path}:{number}", row


def _first_question(row: dict[str, Any], where: str) -> tuple[str, bool]:
    """The first user turn of a conversation row (ShareGPT ``conversations``, or ``messages``), and whether the
    conversation holds more than it (a system message, later turns), which distillation does not ask."""
    try:
        messages = row_messages(row)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first is None:
        raise ValueError(f"{where}: the conversation has no user turn to ask (a ShareGPT turn from 'human')")
    return messages[first]["content"], len(messages) > 1


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a prompts JSONL file; each needs ``id`` (a string or an integer, unique in the file) and
    ``prompt`` (a string), or instead of ``prompt`` a conversation (ShareGPT's ``conversations``, or
    ``messages``), whose first user turn is the prompt (the rest is not asked: a warning counts such rows);
    ``source`` is a string, "" when missing or null. A file of one JSON array of rows (ShareGPT's ``.json``) is
    read too. ``ValueError`` names the line (or the array's element)."""
    path = Path(path)
    rows = []
    seen: dict[str, str] = {}
    longer = 0
    for number, row in _prompt_rows(path):
        conversation = isinstance(row, dict) and "prompt" not in row and (
            row.get("conversations") is not None or row.get("messages") is not None)
        if not isinstance(row, dict) or "id" not in row or ("prompt" not in row and not conversation):
            found = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{number} needs an object with 'id' and 'prompt' (or a conversation: ShareGPT's "
                             f"'conversations', or 'messages'), has {found}")
        if conversation:
            prompt, more = _first_question(row, number)
            row, longer = {**row, "prompt": prompt}, longer + more
        source = row.get("source") or ""
        checks = (("id", row["id"], (str, int), "a string or an integer"),
                  ("prompt", row["prompt"], str, "a string"), ("source", source, str, "a string or null"))
        for key, value, kinds, kind in checks:
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise ValueError(f"{number}: '{key}' must be {kind}, got {value!r}")
            if isinstance(value, str) and not _encodable(value):
                raise ValueError(f"{number}: '{key}' holds a lone surrogate (an escape such as "
                                 "\\ud83d without its pair), which is no text a model can be given; fix the line")
        key = str(row["id"])
        if key in seen:
            raise ValueError(f"{number}: id {key!r} is already at {seen[key]}; "
                             "give every prompt its own id (the answers are kept by id)")
        seen[key] = number
        rows.append({"id": key, "source": source, "prompt": row["prompt"]})
    if longer:
        logger.warning("%d of the conversations in %s hold more than their first user turn (a system message, later "
                       "turns): the model is asked that first turn alone, and answers it itself", longer, path)
    return rows


def sample_prompts(
    path: str | Path,
    n: int | None,
    per_source: dict[str, int] | None = None,
    seed: int = 0,
    exclude_ids: Iterable[str] = (),
    shuffle_first: bool = True,
) -> list[dict[str, Any]]:
    """A deterministic sample of prompts, balanced by ``source``.

    Each source's prompts are shuffled with ``seed`` (all of them: ``exclude_ids`` are left out after, so that
    leaving out a prompt the sample did not hold changes nothing; ``shuffle_first=False``: before, as releases
    before commit 0c5145d drew it, ``run_prompts``); sources (sorted by name) then take turns,
    so every source gives the same number of prompts until it runs out. With ``per_source``
    quotas, only the named sources are used, each up to its quota (still interleaved). The
    result is cut to ``n`` (``None``: no cut). For a fixed seed a smaller ``n`` gives a prefix
    of a larger one (without quotas).
    """
    excluded = {str(i) for i in exclude_ids}
    every: dict[str, list[dict[str, Any]]] = {}  # every source's prompts, excluded ones too
    for row in read_prompts(path):
        every.setdefault(row["source"], []).append(row)
    in_file = {source: len(rows) for source, rows in every.items()}
    by_source: dict[str, list[dict[str, Any]]] = {}
    for source, rows in every.items():
        rows = list(rows) if shuffle_first else [row for row in rows if row["id"] not in excluded]
        random.Random(f"{seed}:{source}").shuffle(rows)
        kept = [row for row in rows if row["id"] not in excluded]
        if kept:
            by_source[source] = kept
    if per_source is not None:
        unknown = sorted(set(per_source) - set(in_file))
        if unknown:
            raise ValueError(
                f"per_source names sources not in {path}: {unknown}; sources there: {sorted(in_file)}"
            )
        for source, quota in per_source.items():
            eligible = len(by_source.get(source, []))
            if quota > eligible:
                left_out = in_file[source] - eligible
                logger.warning(
                    "source %s has %d prompts%s, fewer than its quota %d", source, eligible,
                    f" once {left_out} excluded ones are left out" if left_out else "", quota,
                )
    queues = []
    for source in sorted(by_source):
        rows = by_source[source]
        if per_source is not None:
            rows = rows[: per_source.get(source, 0)]
        queues.append(rows)
    sample: list[dict[str, Any]] = []
    depth = 0
    while any(depth < len(q) for q in queues) and (n is None or len(sample) < n):
        for queue in queues:
            if depth < len(queue) and (n is None or len(sample) < n):
                sample.append(queue[depth])
        depth += 1
    if n is not None and len(sample) < n:
        logger.warning("asked for %d prompts, %s holds only %d eligible", n, path, len(sample))
    return sample


def recipe_config(config: TrainConfig) -> DistillConfig:
    """The distillation a training recipe asks for (it must set ``data.prompts``).

    The recipe's data, model, seed and log keys set the fields named in ``RECIPE_KEYS``;
    ``data.distill_options`` sets any other ``DistillConfig`` field, converted to its type.
    ``ValueError`` names an unknown option, an option the recipe sets elsewhere, or a bad value.
    """
    d = config.data
    if not d.prompts:
        raise ValueError("data.prompts is not set: there is nothing to distil")
    options = dict(d.distill_options)
    owned = sorted(set(options) & set(RECIPE_KEYS))
    if owned:
        where = ", ".join(f"{key} by {RECIPE_KEYS[key]}" for key in owned)
        raise ValueError(f"data.distill_options may not set {owned}: the recipe sets {where}; set them there")
    hints = typing.get_type_hints(DistillConfig)
    unknown = sorted(set(options) - set(hints))
    if unknown:
        raise ValueError(f"unknown data.distill_options {unknown}; known: {sorted(set(hints) - set(RECIPE_KEYS))}")
    options = {key: convert_value(value, hints[key], f"data.distill_options.{key}") for key, value in options.items()}
    return DistillConfig(
        prompts=d.prompts, output=str(rows_path(config)), model=config.model.name, n=d.n, per_source=d.per_source,
        max_new_tokens=d.max_new_tokens, batch_size=d.distill_batch_size, seed=config.training.seed,
        system_prompt=d.system_prompt, chat_template=config.model.chat_template, progress=config.log.progress,
        trust_remote_code=config.model.trust_remote_code,
        **{"save_hidden": config.keeps_distillation_hidden, **options},
    )


def run_prompts(config: DistillConfig, done: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The prompts a run answers: ``sample_prompts`` of its settings; where ``exclude_ids`` are set and the rows
    written (``done``, default: ``config.output``'s and its shards') hold more of the sample releases before
    commit 0c5145d drew (excluded prompts left out before the shuffle), that one: its finished run would be
    answered again otherwise."""
    args = (config.prompts, config.n, config.per_source, config.seed, config.exclude_ids)
    sample = sample_prompts(*args)
    if not config.exclude_ids:
        return sample
    done_ids = {str(row["id"]) for row in (existing_rows(config.output) if done is None else done)}
    if not done_ids:
        return sample
    legacy = sample_prompts(*args, shuffle_first=False)
    # a merge writes rows in their sample's order (shards do not: longest prompts first, rank by rank)
    merged = list(dict.fromkeys(str(row["id"]) for row in read_jsonl_tolerant(Path(config.output))))

    def fit(prompts: list[dict[str, Any]]) -> tuple[int, bool]:  # (rows covered, and merged in its order: a
        ids = [p["id"] for p in prompts if p["id"] in done_ids]  # sample of the same prompts reordered them)
        chosen = set(ids)
        order = [i for i in merged if i in chosen]
        kept = set(order)
        return len(ids), bool(order) and order == [i for i in ids if i in kept]

    return legacy if fit(legacy) > fit(sample) else sample


def check_empty_prompts(prompts: list[dict[str, Any]], done: Iterable[dict[str, Any]], path: str | Path) -> None:
    """``ValueError`` naming the sampled prompts still to answer that are empty (or only whitespace): they were
    distilled as empty user turns, and trained on, without a word. Prompts answered already (by an earlier
    release) or outside the sample pass: their runs resume as they were."""
    done_ids = {str(row["id"]) for row in done}
    empty = [prompt["id"] for prompt in prompts if prompt["id"] not in done_ids and not prompt["prompt"].strip()]
    if empty:
        raise ValueError(f"{path}: the prompts {', '.join(map(repr, empty[:5]))}{' ...' if len(empty) > 5 else ''} "
                         "are empty: there is nothing to answer; leave them out (exclude_ids, a recipe's "
                         "data.distill_options.exclude_ids) or remove their lines")


def pending_prompts(config: DistillConfig, merged: bool = False) -> tuple[int, int]:
    """(prompts sampled, of those the ones a run would still answer): the prompts without a row in
    ``config.output`` or its shards, less those over ``max_prompt_tokens`` that a run skips (for
    which the tokenizer is loaded, when there are any without a row).

    With ``merged=True`` a prompt answered only in a shard counts as pending too: the merged file
    lacks its row until a run merges it (a run killed between its last answer and the merge).

    ``ValueError`` (``check_resumable``) when the rows there were made with another model or
    other generation settings.
    """
    done = existing_rows(config.output)
    prompts = run_prompts(config, done)
    check_resumable(done, config)
    check_prompt_texts(done, prompts, config)
    check_empty_prompts(prompts, done, config.prompts)
    if merged:
        done = read_jsonl_tolerant(Path(config.output))
    done_ids = {str(row["id"]) for row in done}
    if config.backend == "openai":  # refused before: not asked again (record_refusal)
        done_ids |= refused_ids(config, prompts)
    missing = [p for p in prompts if p["id"] not in done_ids]
    limits = prompt_limits(config) if missing and config.backend == "local" else config
    if missing and limits.max_prompt_tokens is not None:
        tokenizer = load_distill_tokenizer(config)
        missing = [p for p in missing if prepare_prompt(tokenizer, p["prompt"], limits) is not None]
    return len(prompts), len(missing)


# ---------------------------------------------------------------------------------------------
# Shard files


def shard_path(output: str | Path, rank: int) -> Path:
    return Path(f"{output}.rank{rank}.jsonl")


def shard_files(output: str | Path) -> list[Path]:
    """Every rank's shard file of ``output`` (any world size), sorted; the output's name is matched
    literally (``[``, ``*`` or ``?`` in it are no glob patterns)."""
    output = Path(output)
    return sorted(output.parent.glob(f"{glob.escape(output.name)}.rank*.jsonl"))


def arrow_path(output: str | Path) -> Path:
    """Folder of the ``datasets`` copy written with ``format="arrow"``: the output's whole name and ``.arrow``
    (its suffix replaced, ``rows.v1`` and ``rows.v2`` shared one folder: each run's copy replaced, and a
    JSONL-only merge deleted, the other's, and a rerun took the other's rows for its own)."""
    output = Path(output)
    return output.with_name(output.name + ".arrow")


def read_jsonl_tolerant(path: Path, repair: bool = False) -> list[dict[str, Any]]:
    """Rows of a JSONL file that a killed writer may have left with a half-written last line.

    An unterminated or undecodable last line is dropped (and with ``repair`` cut off the file so
    that appending continues on a clean line); an undecodable line elsewhere is an error.
    """
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    rows, good_end, offset = [], 0, 0
    for index, line in enumerate(lines):
        terminated = index < len(lines) - 1
        offset += len(line) + (1 if terminated else 0)
        if not line.strip():
            if terminated:
                good_end = offset
            continue
        row = None
        if terminated:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
        if row is None:
            is_last = all(not rest.strip() for rest in lines[index + 1 :])
            if not is_last:
                raise ValueError(
                    f"{path}: line {index + 1} is not valid JSON and is not the last line; the "
                    "file is damaged beyond a killed write. Fix or remove that line."
                )
            logger.warning("%s: dropping a half-written last line (%d bytes)", path, len(line))
            break
        rows.append(row)
        good_end = offset
    if repair and good_end < len(data):
        with path.open("r+b") as handle:
            handle.truncate(good_end)
            handle.flush()
            os.fsync(handle.fileno())
    return rows


def existing_rows(output: str | Path, repair_rank: int | None = None) -> list[dict[str, Any]]:
    """Rows already written: the merged output, then every shard file (any world size).

    ``repair_rank``: that rank's shard is repaired (its half-written line cut off) while read.
    """
    output = Path(output)
    rows = read_jsonl_tolerant(output)
    for path in shard_files(output):
        own = repair_rank is not None and path == shard_path(output, repair_rank)
        rows.extend(read_jsonl_tolerant(path, repair=own))
    return rows


def check_prompt_texts(rows: Sequence[dict[str, Any]], prompts: Sequence[dict[str, Any]], config: DistillConfig) -> None:
    """Refuse rows whose prompt text is not the one the prompts file now gives their id (the file rewritten under
    the same ids: the old answers were kept, as answers to the new prompts). A row whose prompt was cut to
    ``max_prompt_tokens`` (``prompt_cut``, under ``prompt_overflow="truncate"``, at whatever limit) holds the
    prompt's first tokens, decoded; a row written before ``prompt_cut`` was recorded is taken as cut where cutting
    the prompt under today's limit gives its text. The tokenizer is loaded for such rows only."""
    texts = {p["id"]: p["prompt"] for p in prompts}
    loaded: list[Any] = []  # [tokenizer, limits] once needed

    def cut_of(text: str, found: str, flagged: bool) -> bool:
        if not loaded:
            limits = dataclasses.replace(prompt_limits(config) if config.backend == "local" else config,
                                         prompt_overflow="truncate")
            loaded.extend([load_distill_tokenizer(config), limits])
        tokenizer, limits = loaded
        if not flagged:  # an older row: cut only if today's limit cuts the prompt so
            cut = prepare_prompt(tokenizer, text, limits) if limits.max_prompt_tokens is not None else None
            return cut is not None and cut[0] == found
        content = tokenizer(text, add_special_tokens=False)["input_ids"]

        def decoded(keep: int) -> str:  # the first tokens, decoded as prepare_prompt decodes a cut
            return tokenizer.decode(content[:keep], skip_special_tokens=True)

        def length(keep: int) -> int:  # grows with the tokens kept: a character's incomplete bytes left out
            return len(decoded(keep).rstrip("\ufffd"))

        low, high = 1, len(content)  # the fewest tokens whose text is as long as the row's
        while low < high:
            middle = (low + high) // 2
            low, high = (middle + 1, high) if length(middle) < len(found) else (low, middle)
        for keep in range(max(1, low - 1), len(content)):  # every count of that length (a character's bytes)
            if decoded(keep) == found:
                return True
            if length(keep) > len(found):
                break
        return False

    for row in rows:
        text, found = texts.get(str(row.get("id"))), row.get("prompt")
        if text is None or not isinstance(found, str) or found == text:
            continue
        flagged = row.get("prompt_cut")
        unchecked = ""
        if len(found) < len(text) and flagged is not False:
            if flagged is True and found and text.startswith(found):
                continue
            try:
                if cut_of(text, found, flagged is True):
                    continue
            except (OSError, ValueError) as err:  # the tokenizer or model config could not be read
                unchecked = f" (whether it is the prompt cut to max_prompt_tokens could not be checked: {err})"
            if not unchecked and flagged is None:  # written before rows said whether they were cut
                unchecked = (" (or it is the prompt cut at another max_prompt_tokens than today's: resume with the "
                             "limit it was written under)")
        at = next((i for i, (a, b) in enumerate(zip(found, text)) if a != b), min(len(found), len(text)))
        start = max(0, at - 20)
        raise ValueError(f"{config.output} holds row {row.get('id')!r} answering another prompt than {config.prompts} "
                         f"now gives that id (from character {at}: {found[start:at + 40]!r} there, "
                         f"{text[start:at + 40]!r} now){unchecked}: the prompts file changed under its ids; use "
                         "another output path, or the prompts the rows answered")


def _recipe_key(field_name: str, config: DistillConfig) -> str:
    """The training recipe's key that sets a distillation setting (``RECIPE_KEYS``, else ``data.distill_options``;
    an endpoint's model, ``data.distill_options.endpoint_model``)."""
    if field_name == "model":
        return "data.distill_options.endpoint_model" if config.backend == "openai" and config.endpoint_model \
            else "model.name"
    return RECIPE_KEYS.get(field_name, f"data.distill_options.{field_name}")


def check_resumable(rows: Sequence[dict[str, Any]], config: DistillConfig) -> None:
    """Refuse to mix rows made with another model or other generation settings, and rows of prompts
    ``exclude_ids`` excludes (answered before it excluded them: they would be trained on)."""
    expected = (config.model_label, config.generation_record())
    excluded = {str(i) for i in config.exclude_ids}
    weights: list[str | None] = []  # the model's weights_identity, once a row records one
    for row in rows:
        if row.get("model_weights") is not None and config.backend == "local":
            if not weights:
                weights.append(weights_identity(config.model))
            if weights[0] is not None and row["model_weights"] != weights[0]:
                raise ValueError(f"{config.output} already holds row {row.get('id')!r} answered by other weights "
                                 f"under the name {config.model!r} (weights {row['model_weights']}, now "
                                 f"{weights[0]}: its files changed since, trained, converted or downloaded again); use another "
                                 "output path, or the weights that answered them")
        if str(row.get("id")) in excluded:
            raise ValueError(f"{config.output} holds row {row.get('id')!r}, a prompt exclude_ids excludes (answered "
                             "before it was excluded): it would be trained on; delete its rows from that file (and "
                             "its shards), or distil into another output path")
        # rows written before the template and system prompt were recorded: the defaults
        generation = {"chat_template": None, "system_prompt": None, **(row.get("generation") or {})}
        generation["chat_template"] = recorded_template(generation["chat_template"])
        found = (row.get("model"), generation)
        if found[0] != expected[0] and row.get("model_weights") is not None and weights and weights[0] is not None:
            found = (expected[0], generation)  # the same weights by another name or path spelling: the same model
        if found != expected:
            differ = [("model", found[0], expected[0])] if found[0] != expected[0] else []
            differ += [(key, generation.get(key), value) for key, value in expected[1].items()
                       if generation.get(key) != value]
            differ += [(key, value, None) for key, value in generation.items() if key not in expected[1]]
            said = ", ".join(f"{key} {was!r} (now {now!r}; {_recipe_key(key, config)} in a recipe)" for key, was, now in differ)
            raise ValueError(
                f"{config.output} already holds row {row.get('id')!r} made with {said}. Use another output path "
                "(a recipe's output_dir), or the same settings to resume."
            )


class ShardWriter:
    """Appends rows to one shard file; ``sync`` flushes and fsyncs (once per batch)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.handle = path.open("a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self.handle.write(json.dumps(row, ensure_ascii=False) + "\n")

    def sync(self) -> None:
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def close(self) -> None:
        self.sync()
        self.handle.close()


def _warn_extra_rows(output: Path, row_ids: Iterable[str], sampled: Iterable[str]) -> None:
    sampled = set(sampled)
    extra = sum(row_id not in sampled for row_id in row_ids)
    if extra:
        logger.warning(
            "%s keeps %d rows whose prompts are not in this run's sample (an earlier run's, e.g. with a larger "
            "data.n or another prompt file); they stay in the data and are trained on. To use this sample "
            "only, distil into a new output path", output, extra,
        )


def warn_rows_outside_sample(config: DistillConfig) -> None:
    """Warn when ``config.output`` holds rows of prompts ``config`` does not sample (a run with a larger
    ``n`` or another prompt file made them): they are trained on. For a run that answers nothing, as
    ``distill`` warns when it has nothing left to answer."""
    prompts = run_prompts(config)
    output = Path(config.output)
    _warn_extra_rows(output, (str(row["id"]) for row in read_jsonl_tolerant(output)), (p["id"] for p in prompts))


def merge_shards(
    output: str | Path, prompts: Sequence[dict[str, Any]], fmt: str = "jsonl"
) -> Path:
    """Merge the output and all shard files into ``output``, in the order of ``prompts``.

    Duplicated ids keep their first row; rows whose id is not in ``prompts`` (from an earlier
    run with other prompts) follow, in file order. The file is replaced atomically and the shard
    files are removed afterwards. With ``fmt="arrow"`` a ``datasets`` folder is saved too.
    """
    output = Path(output)
    rows_by_id: dict[str, dict[str, Any]] = {}
    for row in existing_rows(output):
        rows_by_id.setdefault(str(row["id"]), row)
    order = {p["id"]: i for i, p in enumerate(prompts)}
    rows = sorted(
        rows_by_id.values(), key=lambda r: (order.get(str(r["id"]), len(order)),)
    )
    missing = [p["id"] for p in prompts if p["id"] not in rows_by_id]
    _warn_extra_rows(output, rows_by_id, order)
    # gone before the new rows land, whatever the format: a kill in between, or a JSONL-only merge,
    # leaves no short Arrow copy behind (a later arrow run would take it as complete)
    shutil.rmtree(arrow_path(output), ignore_errors=True)
    old = output.with_suffix(".arrow")  # where releases before commit 0c5145d saved it: left, named (it may be
    if old != arrow_path(output) and (old / "dataset_info.json").is_file() \
            and not output.with_suffix("").is_file():  # another output's own copy: that output is there)
        logger.warning("%s is where earlier releases saved the Arrow copy of %s: it may hold the rows of then, not "
                       "these (now in %s); delete it unless it is another output's", old, output, arrow_path(output))
    tmp = output.with_name(output.name + ".merging")
    with tmp.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, output)
    for path in shard_files(output):
        path.unlink()
    logger.info(
        "merged %d rows into %s (%d sampled prompts without a row: skipped, refused or failed)",
        len(rows), output, len(missing),
    )
    if fmt == "arrow":
        save_arrow(rows, arrow_path(output))
    return output


def save_arrow(rows: Sequence[dict[str, Any]], folder: Path) -> Path:
    """Save rows as a ``datasets`` folder (``load_from_disk``), replacing an older one."""
    from datasets import Dataset

    work = folder.with_name(folder.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    # every key any row has (from_list takes the first row's: an endpoint's served_model, on the rows whose
    # reply named another model only, was dropped from them all), None where a row lacks it
    keys = list(dict.fromkeys(key for row in rows for key in row))
    Dataset.from_list([{key: row.get(key) for key in keys} for row in rows]).save_to_disk(str(work))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(work, folder)
    logger.info("saved %d rows as a datasets folder: %s", len(rows), folder)
    return folder


# ---------------------------------------------------------------------------------------------
# Prompt preparation


def load_distill_tokenizer(config: DistillConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of ``config.model``, with ``config.chat_template`` installed when set."""
    from medusa_infer.models import load_tokenizer

    tokenizer = load_tokenizer(config.model, trust_remote_code=config.trust_remote_code)
    if config.chat_template:
        tokenizer.chat_template = config.chat_template
    if config.backend == "local" and config.system_prompt is not None and not has_chat_template(tokenizer):
        raise ValueError(f"system_prompt is set, but the tokenizer of {config.model} has no chat template to put it "
                         "in (prompts would go as plain text without it): set chat_template, or drop system_prompt")
    if config.backend == "local" and has_chat_template(tokenizer):  # one that refuses a question: before the model
        from medusa_infer.chat import check_conversation  # loads (a traceback at the first batch)

        check_conversation(tokenizer, config.system_prompt, "system_prompt (--system-prompt)", as_text=False)
    return tokenizer


def prompt_limits(config: DistillConfig) -> DistillConfig:
    """``config`` with ``max_prompt_tokens`` lowered to what the local model's context leaves room
    for (one new token at least): longer prompts are skipped or truncated as ``prompt_overflow``
    says, as for ``max_prompt_tokens``, instead of stopping the run when they reach the model."""
    from transformers import AutoConfig

    from medusa_infer.decoding import config_context_length
    from medusa_infer.models import resolve_model

    model_config = AutoConfig.from_pretrained(resolve_model(config.model), trust_remote_code=config.trust_remote_code)
    room = config_context_length(model_config) - 1
    if config.max_prompt_tokens is not None and config.max_prompt_tokens <= room:
        return config
    return dataclasses.replace(config, max_prompt_tokens=room)


def prepare_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str, config: DistillConfig
) -> tuple[str, list[int]] | None:
    """``(prompt text, rendered prompt ids)`` within ``max_prompt_tokens``, or ``None`` to skip.

    The prompt is rendered with the tokenizer's chat template: load it with
    ``load_distill_tokenizer`` so that it carries ``config.chat_template``. With
    ``prompt_overflow="truncate"`` the prompt text (not the template around it) is cut.
    """
    ids = encode_rendered(tokenizer, render_prompt(tokenizer, prompt, config.system_prompt))
    limit = config.max_prompt_tokens
    if limit is None or len(ids) <= limit:
        return prompt, ids
    if config.prompt_overflow == "skip":
        return None
    content = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    keep = limit - (len(ids) - len(content))
    while keep > 0:
        text = tokenizer.decode(content[:keep], skip_special_tokens=True)
        if text.endswith("\ufffd") and text.count("\ufffd") > prompt.count("\ufffd"):
            keep -= 1  # cut inside a character's bytes: keep whole characters, as answers do
            continue
        ids = encode_rendered(tokenizer, render_prompt(tokenizer, text, config.system_prompt))
        if len(ids) <= limit:
            return text, ids
        keep -= max(1, len(ids) - limit)
    return None


def make_row(
    prompt: dict[str, Any], text: str, response: str, finish: str, n_tokens: int,
    config: DistillConfig, weights: str | None = None, response_ids: Sequence[int] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> dict[str, Any]:
    """A row; ``weights``: the local model's ``models.weights_identity`` (recorded where known, so that rows
    of other weights under the same name are not mixed in: ``check_resumable``). ``prompt_cut``: whether ``text``
    is the prompt cut to ``max_prompt_tokens`` (``prompt_overflow="truncate"``; ``check_prompt_texts``).
    ``response_ids``: the answer's ids as written, the end token included (the local backend's). ``tokenizer``:
    the one that rendered the prompt (the local backend's), whose template in effect the row records
    (``prompt_template``: ``dataset.check_prompt_template``)."""
    return {
        "id": prompt["id"],
        "source": prompt["source"],
        "prompt": text,
        "prompt_cut": text != prompt["prompt"],
        "response": response,
        "model": config.model_label,
        "generation": config.generation_record(),
        "finish_reason": finish,
        "response_tokens": int(n_tokens),
        **({"model_weights": weights} if weights is not None else {}),
        **({"response_ids": [int(t) for t in response_ids]} if response_ids is not None else {}),
        **({"prompt_template": rendering_digest(tokenizer)} if tokenizer is not None else {}),
    }


# ---------------------------------------------------------------------------------------------
# Local backend


def eos_token_ids(model: Any, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """End-of-sequence ids, those decoding stops at (``decoding.eos_ids``: the generation config's, the
    model config's and the tokenizer's; the model config's were left out, so a fine-tune naming its end of
    turn there alone was distilled past it). ``model`` is a ``MedusaModel``."""
    from medusa_infer.decoding import eos_ids

    ids = list(eos_ids(model, tokenizer))
    if not ids:
        raise ValueError(f"neither the model (eos_token_id in generation_config.json or config.json) nor the tokenizer "
                         f"(eos_token in tokenizer_config.json) of {getattr(tokenizer, 'name_or_path', '?')!r} names "
                         "an end-of-sequence token, so no answer could end before max_new_tokens: set one of them to "
                         "the token the model ends its turns with")
    return ids


def generate_batch(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[Sequence[int]],
    config: DistillConfig,
    eos_ids: Sequence[int],
    proposer: AutoregressiveProposer | None = None,
) -> list[tuple[list[int], str, int | None]]:
    """Answers to a batch of tokenised prompts: ``[(response ids without EOS, finish_reason, the EOS id the
    row ended with or None)]``.

    ``model`` is a ``MedusaModel`` without heads (``MedusaModel.without_heads``): the answers come
    from medusa_infer's decoding loop with plain steps, where a row that finished leaves the batch.
    Hugging Face ``generate`` keeps computing such rows until the last one ends; on 160 of the
    recipe's prompts in batches of 32 on a 2-core CPU, this loop gave the same greedy tokens
    1.10x faster (``scripts/bench_distill.py``, ``docs/distill/bench_distill.log``). Sampling
    draws from the global RNG, which the caller seeds per batch. ``proposer``: plain decoding
    that also does something else, e.g. ``captured.HiddenRecorder`` (default: plain decoding).
    """
    input_ids, attention_mask = left_pad(prompt_ids, padding_id(model, tokenizer))  # (an id the model embeds: a pad
    # token added to a tokenizer whose model was not resized failed every batch of mixed lengths)
    settings: dict[str, Any] = {}
    if config.do_sample:
        settings.update(do_sample=True, temperature=config.temperature, top_p=config.top_p, top_k=0)
    # decoding's attention kernels on a GPU (attention_kernels: no per-length cuDNN plans)
    with torch.inference_mode(), decoding_attention(model.device):
        output = generate(model, input_ids, attention_mask=attention_mask, max_new_tokens=config.max_new_tokens,
                          eos_token_id=list(eos_ids), proposer=proposer or AutoregressiveProposer(model), **settings)
    answers = []
    for tokens, finish in zip(output.new_tokens, output.finish_reasons):
        if finish == "eos":
            answers.append((tokens[:-1], "eos", tokens[-1]))
        else:  # the token limit, or the model's context full
            answers.append((tokens, "length", None))
    return answers


def answer_text(tokenizer: PreTrainedTokenizerBase, tokens: Sequence[int], finish: str) -> tuple[list[int], str]:
    """``(tokens, text)`` of an answer. One cut at the token limit inside a character's bytes (byte-level
    BPE) keeps the whole characters only: the text would end in U+FFFD, which the model never wrote. A U+FFFD the
    model did write (its tokens are the character's own encoding) is kept (it was cut as bytes cut short)."""
    tokens = list(tokens)
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    popped: list[int] = []
    while finish == "length" and tokens and text.endswith("\ufffd"):
        popped.insert(0, tokens.pop())
        shorter = tokenizer.decode(tokens, skip_special_tokens=False)
        written = text[len(shorter):] if text.startswith(shorter) else ""  # "" while bytes are still cut short
        if written and not written.strip("\ufffd") and \
                tokenizer(written, add_special_tokens=False)["input_ids"] == popped:
            return tokens + popped, text
        text = shorter
        if written:
            popped = []
    return tokens, text


def _batch_seed(seed: int, ids: Sequence[str]) -> int:
    return (seed * 1_000_003 + zlib.crc32("\n".join(ids).encode())) % (2**63)


def run_local(
    config: DistillConfig,
    pending: Sequence[dict[str, Any]],
    writer: ShardWriter,
    stats: ShardStats,
    device: str | torch.device,
    on_batch: BatchHook | None = None,
    fingerprint: dict[str, Any] | None = None,
    done: Sequence[dict[str, Any]] = (),
) -> None:
    """Answer ``pending`` prompts with the local model, a batch at a time, into ``writer``; kept hidden
    states (``save_hidden``) record ``fingerprint`` (default: ``model_fingerprint(config.model)``). ``done``: the
    rows already written, refused when their prompts were rendered with another template than the tokenizer's
    now (``check_prompt_template``)."""
    from medusa_infer.models import load_base_model

    tokenizer = load_distill_tokenizer(config)
    check_prompt_template(done, tokenizer, "use another output path, or install the template that rendered them "
                                           "(--chat-template, or model.chat_template in a recipe)")
    if not has_chat_template(tokenizer):  # (said where it could still be stopped: train_heads refuses such rows)
        logger.warning("the tokenizer of %s has no chat template: prompts are given as plain text, and train_heads.py "
                       "cannot train on such rows (its examples are chats): give --chat-template (model.chat_template "
                       "in a recipe) to distil in one", config.model)
    limits = prompt_limits(config)
    prepared = []
    for prompt in pending:
        result = prepare_prompt(tokenizer, prompt["prompt"], limits)
        if result is None:
            stats.skipped_too_long += 1
            continue
        if result[0] != prompt["prompt"]:
            stats.truncated_prompts += 1
        prepared.append((prompt, *result))
    if stats.skipped_too_long or stats.truncated_prompts:
        logger.warning(
            "rank %d: %d prompts over max_prompt_tokens=%s skipped, %d truncated",
            stats.rank, stats.skipped_too_long, limits.max_prompt_tokens, stats.truncated_prompts,
        )
    if not prepared:
        return
    # Longest first: similar lengths share a batch (less padding), and the ETA errs high.
    prepared.sort(key=lambda item: -len(item[2]))
    threads = torch.get_num_threads()
    if config.threads is not None:  # before loading: the linear kernels' plans are measured per thread count
        torch.set_num_threads(config.threads)
    try:
        base = load_base_model(config.model, dtype=torch.float32, device=device,
                               trust_remote_code=config.trust_remote_code)
        model = MedusaModel.without_heads(base, tokenizer)
        eos_ids = eos_token_ids(model, tokenizer)
        _generate_all(config, prepared, model, tokenizer, eos_ids, writer, stats, on_batch, fingerprint)
    finally:
        torch.set_num_threads(threads)


def _generate_all(
    config: DistillConfig,
    prepared: Sequence[tuple[dict[str, Any], str, list[int]]],
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    eos_ids: Sequence[int],
    writer: ShardWriter,
    stats: ShardStats,
    on_batch: BatchHook | None,
    fingerprint: dict[str, Any] | None = None,
) -> None:
    """The batch loop of ``run_local``: generate, write, sync, report."""
    device = next(model.parameters()).device
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    bar = tqdm(total=len(prepared), unit="prompt", desc=f"distill rank {stats.rank}",
               disable=not config.progress, dynamic_ncols=True)
    start = time.perf_counter()
    if config.save_hidden and fingerprint is None:
        fingerprint = model_fingerprint(config.model)
    fingerprint = fingerprint or {}
    weights = weights_identity(config.model)
    try:
        for batch_index, first in enumerate(range(0, len(prepared), config.batch_size)):
            batch = prepared[first : first + config.batch_size]
            recorder = HiddenRecorder(model) if config.save_hidden else None
            with torch.random.fork_rng(devices=rng_devices):
                torch.manual_seed(_batch_seed(config.seed, [p["id"] for p, _, _ in batch]))
                answers = generate_batch(model, tokenizer, [ids for _, _, ids in batch], config, eos_ids, recorder)
            if recorder is not None:  # before the rows: a kill in between leaves states of unwritten rows
                save_batch(hidden_dir(config.output), [p["id"] for p, _, _ in batch], [ids for _, _, ids in batch],
                           [tokens for tokens, _, _ in answers], [finish == "eos" for _, finish, _ in answers],
                           recorder.states(), fingerprint)
            rows = []
            for (prompt, text, _), (tokens, finish, end) in zip(batch, answers):
                tokens, response = answer_text(tokenizer, tokens, finish)
                row = make_row(prompt, text, response, finish, len(tokens), config, weights,
                               tokens + ([end] if end is not None else []), tokenizer)
                writer.write(row)
                rows.append(row)
                stats.add(row)
            writer.sync()
            stats.seconds = time.perf_counter() - start
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{stats.tokens / max(stats.seconds, 1e-9):.1f}")
            if on_batch is not None:
                on_batch(batch_index, rows)
    finally:
        bar.close()


# ---------------------------------------------------------------------------------------------
# OpenAI-compatible backend


def endpoint_problem(endpoint: str) -> str | None:
    """What keeps ``endpoint`` from being a server's address (no http or https scheme, no host, a port that is no
    number), in words; None where it is one."""
    import urllib.parse

    if any(c.isspace() or not c.isprintable() for c in endpoint):  # (urlsplit drops line breaks and tabs)
        return "holds a space, a line break or another character no URL holds"
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme not in ("http", "https"):
        return "has no http:// or https:// in front"
    if not parts.hostname:
        return "names no host"
    try:
        parts.port
    except ValueError:
        return "has a port that is no number from 0 to 65535"
    return None


def chat_completions_url(endpoint: str) -> str:
    """``.../v1/chat/completions`` from a server root, a ``/v1`` base or the full URL."""
    url = endpoint.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


class RetryableError(RuntimeError):
    """A failure worth retrying: 5xx, 408, 425, 429, a dropped connection, a timeout. ``retry_after``: the
    seconds the server asked to wait (its ``Retry-After``), when it said."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


_JITTER = random.Random()  # its own generator: the global one is left as callers seeded it

MAX_RETRY_WAIT_S = 120.0
"""The longest wait before a retry, a server's ``Retry-After`` included."""


def _retry_after(headers: Any) -> float | None:
    """A ``Retry-After`` header's seconds (a number or an HTTP date); None when absent or unreadable."""
    value = headers.get("Retry-After") if headers is not None else None
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        from email.utils import parsedate_to_datetime

        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


class EndpointError(RuntimeError):
    """The endpoint itself is wrong (HTTP 401, 403, 404, 405: its address, the key or the model name), not a
    prompt: no prompt is asked again. ``status``: the HTTP status, where one came."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class DistillError(RuntimeError):
    """Distillation through an endpoint ended with prompts unanswered (the rows written are kept), or could not
    start (another run writes the same rows); the message says why and what to do."""


ENDPOINT_FIXES = {
    401: "the endpoint wants an API key: set the environment variable api_key_env names (default $OPENAI_API_KEY)",
    403: "the endpoint refuses this API key: check the key in the variable api_key_env names",
    404: "check endpoint (the server's root or its /v1 base, e.g. http://host:8000) and endpoint_model against "
         "the models the server lists at /v1/models",
    405: "check endpoint: it should be the server's root or its /v1 base, e.g. http://host:8000",
}
"""What to check for each HTTP status that says the endpoint, not the prompt, is wrong."""


class RejectedError(RuntimeError):
    """The endpoint refused this prompt itself (HTTP 4xx other than 408, 425 and 429, e.g. longer than its
    context, or a content filter): asking again would get the same answer."""


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # the 3xx reaches post_json as an HTTPError, which names the new address


_NO_REDIRECTS = urllib.request.build_opener(_RefuseRedirects)


def post_json(url: str, body: dict[str, Any], headers: dict[str, str], timeout: float) -> dict[str, Any]:
    """One POST; raises ``RetryableError`` for transient failures, ``RuntimeError`` otherwise."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with _NO_REDIRECTS.open(request, timeout=timeout) as response:
            payload = response.read()
    except urllib.error.HTTPError as err:
        try:
            detail = err.read()[:500].decode(errors="replace")
        except (http.client.HTTPException, OSError) as unread:  # the connection broke while sending it
            detail = f"(body unreadable: {type(unread).__name__})"
        if err.code >= 500 or err.code in (408, 425, 429):  # the server's state, not the prompt: worth retrying
            raise RetryableError(f"HTTP {err.code} from {url}: {detail}", _retry_after(err.headers)) from err
        if 300 <= err.code < 400:  # no redirect followed (urllib re-sent 301-303 as a GET, without the body)
            raise RuntimeError(f"HTTP {err.code} from {url}: the endpoint moved to "
                               f"{err.headers.get('Location')!r}; set endpoint to its new address") from err
        if err.code in ENDPOINT_FIXES:  # the endpoint, key or model name is wrong, not the prompt
            raise EndpointError(f"HTTP {err.code} from {url}: {detail}; {ENDPOINT_FIXES[err.code]}",
                                err.code) from err
        raise RejectedError(f"HTTP {err.code} from {url}: {detail}") from err
    except http.client.InvalidURL as err:  # an address no request can go to: each prompt was retried
        raise EndpointError(f"{url} is no address a request can be sent to ({err})") from None
    except (ValueError, UnicodeEncodeError) as err:  # http.client's on a header it cannot send: named, never shown
        raise EndpointError(f"the request to {url} could not be sent ({type(err).__name__}: a header holds a line "
                            "break or a character outside Latin-1)") from None
    except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError, ssl.SSLError) as err:
        if isinstance(getattr(err, "reason", err), ssl.SSLCertVerificationError):  # asking again gets the same
            raise RuntimeError(f"{url}'s TLS certificate was refused ({err}): check the address, or point "
                               "SSL_CERT_FILE at the CA bundle that signed it") from err
        # an SSLError while reading the body (the connection cut mid-reply) is as transient as a reset
        raise RetryableError(f"{type(err).__name__} talking to {url}: {err}") from err
    try:
        return json.loads(payload)
    except ValueError as err:  # not JSON, or not text (UnicodeDecodeError)
        raise RetryableError(f"{url} answered with non-JSON: {payload[:200]!r}") from err


def request_completion(
    url: str, body: dict[str, Any], headers: dict[str, str], config: DistillConfig,
    stop: threading.Event | None = None, what: str = "a request",
) -> dict[str, Any]:
    """``post_json`` with up to ``max_retries`` retries and exponential backoff, jittered (so that
    concurrent requests do not come back at once), and never shorter than a server's ``Retry-After``
    (both capped at ``MAX_RETRY_WAIT_S``), each retry logged as a warning naming ``what`` (the prompt).
    ``stop`` set: no more attempts (a run being stopped would otherwise wait for its retries at exit)."""
    stop = stop if stop is not None else threading.Event()
    for attempt in range(config.max_retries + 1):
        try:
            return post_json(url, body, headers, config.request_timeout_s)
        except RetryableError as err:
            if attempt == config.max_retries:
                raise RuntimeError(f"giving up after {attempt + 1} attempts: {err}") from err
            backoff = min(60.0, config.retry_backoff_s * 2**attempt) * _JITTER.uniform(1.0, 1.25)
            delay = min(MAX_RETRY_WAIT_S, max(backoff, err.retry_after or 0.0))
            # (at the debug level, 11 retries over 38 s, or a Retry-After of 120 s, passed without a line)
            logger.warning("%s: retry %d of %d in %.1f s after: %s", what, attempt + 1, config.max_retries, delay,
                           err)
            if stop.wait(delay):
                raise RuntimeError(f"stopped before retrying: {err}") from err
    raise AssertionError("unreachable")


def completion_row(
    prompt: dict[str, Any], text: str, reply: dict[str, Any], config: DistillConfig,
    tokenizer: Callable[[], PreTrainedTokenizerBase],
) -> dict[str, Any]:
    """A row from an OpenAI-style chat completion reply; ``tokenizer()`` gives the tokenizer that counts
    the answer's tokens where the reply reports no ``usage``. ``RejectedError`` for a reply that is
    no answer (a content filter's)."""
    try:
        choices = reply["choices"]
        # the one asked for (n=1); two out of order gave the second's text
        [choice] = [c for c in choices if c.get("index", 0) == 0] if len(choices) > 1 else choices
        response = choice["message"]["content"]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        raise RuntimeError(f"unexpected reply for prompt {prompt['id']!r}: {str(reply)[:300]}") from err
    if not isinstance(choice.get("finish_reason"), (str, type(None))):  # (a TypeError ended the whole run)
        raise RejectedError(f"prompt {prompt['id']!r}: finish_reason {choice.get('finish_reason')!r:.100} is no "
                            "reason's name")
    if response is not None and not isinstance(response, str):  # (was called a lone surrogate)
        raise RejectedError(f"prompt {prompt['id']!r}: the answer is a {type(response).__name__}, not text: "
                            f"{response!r:.200}")
    if response is None or (isinstance(response, str) and not response.strip()
                            and choice.get("finish_reason") == "length"):
        # no answer (vLLM's reasoning parser, cut while the model still reasoned; every token stripped, special
        # ones or reasoning_content's): no row (an empty target whose usage counted the tokens cut)
        raise RejectedError(f"prompt {prompt['id']!r}: the reply holds no answer (content {response!r}, finish_reason "
                            f"{choice.get('finish_reason')!r})")
    finish = FINISH_REASONS.get(choice.get("finish_reason") or "", None)
    if finish is None:  # content_filter, tool_calls, ...: not an answer to train on
        raise RejectedError(
            f"prompt {prompt['id']!r}: finish_reason {choice.get('finish_reason')!r}, neither an end nor the "
            "token limit"
        )
    if not isinstance(response, str) or not _encodable(response):
        raise RejectedError(f"prompt {prompt['id']!r}: the answer is not UTF-8 text (a lone surrogate): "
                            f"{response!r:.200}")
    usage = reply.get("usage")
    n_tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None  # (a malformed one: not read)
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
        n_tokens = None
    if finish == "length" and response.endswith("\ufffd"):  # cut inside a character's bytes: as answer_text,
        response = response.rstrip("\ufffd")  # the whole characters only (the model never wrote U+FFFD there)
        n_tokens = None  # fewer than the server counted: the tokenizer's count
    if n_tokens is None:  # the server's count when it reports usage; else the tokenizer's
        n_tokens = len(tokenizer()(response, add_special_tokens=False)["input_ids"])
    elif finish == "eos" and isinstance(n_tokens, int) and n_tokens > 0:
        n_tokens -= 1  # the server counts the end token (vLLM, TGI, OpenAI, medusa-serve); the rows do not
    row = make_row(prompt, text, response, finish, n_tokens, config)
    served = reply.get("model")
    if isinstance(served, str) and served != config.model_label:  # TGI and llama.cpp answer whatever is asked
        row["served_model"] = served
    return row


def _in_daemon_thread(function: Callable[..., Any], *args: Any) -> Future:
    """``function(*args)`` in a daemon thread of its own, its result in the future returned: a request in flight
    does not hold the process at exit (a ThreadPoolExecutor's workers are joined then: after Ctrl-C the run sat
    until each request in flight ended, up to request_timeout_s, then threw their answers away)."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(function(*args))
        except BaseException as err:  # (handed to the caller through the future)
            future.set_exception(err)

    threading.Thread(target=run, name="distill-request", daemon=True).start()
    return future


def refusals_path(output: str | Path, rank: int) -> Path:
    """The file where rank ``rank`` records the prompts the endpoint refused (``record_refusal``)."""
    return Path(f"{output}.refused.rank{rank}.jsonl")


def _refusal_key(config: DistillConfig, prompt: dict[str, Any]) -> dict[str, Any]:
    """What a refusal was refused for: the prompt's text and what the request was made of (the model asked, the
    generation settings, the prompt limits that cut or skip it). A refusal of other settings, or of a prompt
    rewritten since under its id, does not count."""
    return json.loads(json.dumps({
        "prompt_sha256": hashlib.sha256(prompt["prompt"].encode("utf-8", "surrogatepass")).hexdigest(),
        "model": config.model_label, "generation": config.generation_record(),
        "max_prompt_tokens": config.max_prompt_tokens, "prompt_overflow": config.prompt_overflow}))


def record_refusal(config: DistillConfig, rank: int, prompt: dict[str, Any], reason: str) -> None:
    """Append a prompt the endpoint refused (HTTP 400, a content filter, no answer) to ``refusals_path``, with what
    it was refused for (``_refusal_key``): a rerun does not ask it again (it asked, and a finished run's rerun, the
    endpoint stopped to free the GPU for training, failed on it). A half-written last line (a write cut short: a
    full disk, a kill) is cut off first: appended to, it made the next line undecodable, and the file unreadable."""
    path = refusals_path(config.output, rank)
    read_jsonl_tolerant(path, repair=True)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps({"id": str(prompt["id"]), "reason": reason[:500],
                                 **_refusal_key(config, prompt)}) + "\n")


def refused_ids(config: DistillConfig, prompts: Iterable[dict[str, Any]]) -> set[str]:
    """The ids of ``prompts`` recorded as refused (``record_refusal``) for what a request of them is now made of:
    left out of a rerun's requests. Delete the ``.refused.rank*.jsonl`` files beside the rows to ask them again."""
    output = Path(config.output)
    recorded: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(output.parent.glob(f"{glob.escape(output.name)}.refused.rank*.jsonl")):
        for row in read_jsonl_tolerant(path):
            if isinstance(row, dict):
                recorded.setdefault(str(row.get("id")), []).append(row)
    found = set()
    for prompt in prompts:
        rows = recorded.get(str(prompt["id"]))
        if rows:
            key = _refusal_key(config, prompt)
            if any(all(row.get(k) == v for k, v in key.items()) for row in rows):
                found.add(str(prompt["id"]))
    return found


def run_openai(
    config: DistillConfig,
    pending: Sequence[dict[str, Any]],
    writer: ShardWriter,
    stats: ShardStats,
    on_batch: BatchHook | None = None,
) -> None:
    """Answer ``pending`` prompts through the endpoint, ``concurrency`` requests at a time."""
    loaded: list[PreTrainedTokenizerBase] = []
    lock = threading.Lock()

    def tokenizer() -> PreTrainedTokenizerBase:  # loaded once, when first needed
        with lock:
            if not loaded:
                loaded.append(load_distill_tokenizer(config))
            return loaded[0]

    url = chat_completions_url(config.endpoint or "")
    headers = {}
    api_key = (os.environ.get(config.api_key_env) or "").strip()  # (a file saved with CRLF line endings: "key\r")
    if api_key and not (api_key.isascii() and api_key.isprintable()):  # http.client's error printed the key
        raise ValueError(f"${config.api_key_env} holds a line break or a character outside printable ASCII, which "
                         "an HTTP header cannot carry: set it to the key alone")
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    else:
        logger.info("$%s is not set: no API key sent to %s", config.api_key_env, url)
    if config.chat_template:  # the endpoint renders the messages with the template it was started with
        logger.warning("a chat template is set (model.chat_template or chat_template), but the endpoint renders "
                       "chats with its own: start the server with the same template (vLLM: --chat-template), or "
                       "its answers follow another prompt format than the one the heads are trained on")

    def body_for(prompt_id: str, text: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": config.model_label,
            "messages": row_messages({"prompt": text}, config.system_prompt),
            "max_tokens": config.max_new_tokens,
            # a seed of each prompt's own: one seed for all would give every request the same random
            # stream (vLLM seeds a generator per request), sampled answers drawn from the same numbers
            "seed": _batch_seed(config.seed, [prompt_id]),
            "n": 1,
        }
        record = config.generation_record()
        body["temperature"] = record["temperature"]
        if record["top_p"] < 1.0:  # 1.0, the API's default, is left out: TGI refuses it (top_p must be < 1)
            body["top_p"] = record["top_p"]
        return body

    jobs = []
    for prompt in pending:
        text = prompt["prompt"]
        if config.max_prompt_tokens is not None:
            result = prepare_prompt(tokenizer(), text, config)
            if result is None:
                stats.skipped_too_long += 1
                continue
            if result[0] != text:
                stats.truncated_prompts += 1
            text = result[0]
        jobs.append((prompt, text))
    if stats.skipped_too_long or stats.truncated_prompts:  # (counted with config.model's tokenizer)
        logger.warning("rank %d: %d prompts over max_prompt_tokens=%s skipped, %d truncated, counted with %s's "
                       "tokenizer%s", stats.rank, stats.skipped_too_long, config.max_prompt_tokens,
                       stats.truncated_prompts, config.model,
                       "" if config.model_label == config.model else
                       f" (model; the endpoint serves {config.model_label}: set model to it for its own count)")
    bar = tqdm(total=len(jobs), unit="prompt", desc=f"distill {url}",
               disable=not config.progress, dynamic_ncols=True)
    start = time.perf_counter()
    batch: list[dict[str, Any]] = []
    batch_index = 0
    errors: list[str] = []
    refused: list[tuple[dict[str, Any], str]] = []  # (prompt, why)
    answered, fatal = False, None  # (an answer in this run; the error that ends it)
    served_others: set[str] = set()  # model names the endpoint answered as, other than the one asked for
    # requests that failed for good one after another, none answered between: past this many the endpoint
    # is taken for down (each prompt would otherwise wait out its own retries, hours for a large sample)
    failing, give_up_after, sent = 0, max(2, config.concurrency), 0
    # 403s after answers, one after another with no answer between, are taken for a key that expired or lost the
    # model past this many, not for that many prompts' moderations (which a rerun once fixed would never ask)
    forbidden: list[int] = []  # their places in refused
    forbidden_limit = max(5, 2 * config.concurrency)
    key_gone = False  # that many came: every later 403 of the run (a reply of the same wake-up) is the key's too
    stopping = threading.Event()
    in_flight: dict[Future, tuple[dict[str, Any], str]] = {}
    try:
        queue = iter(jobs)

        def submit_next() -> bool:
            nonlocal sent
            if stopping.is_set():
                return False
            job = next(queue, None)
            if job is None:
                return False
            prompt, text = job
            future = _in_daemon_thread(request_completion, url, body_for(prompt["id"], text), headers, config,
                                       stopping, f"prompt {prompt['id']}")
            in_flight[future] = job
            sent += 1
            return True

        while len(in_flight) < config.concurrency and submit_next():
            pass
        while in_flight:
            done, _ = wait(list(in_flight), return_when=FIRST_COMPLETED)
            for future in done:
                prompt, text = in_flight.pop(future)
                try:
                    try:
                        reply = future.result()
                    except EndpointError as err:
                        if not answered or err.status != 403:  # the address, key or model: no other prompt would
                            # get through (after an answer too: a key revoked, a server restarted under another model
                            # name; taken as this prompt's refusal, every later prompt was recorded refused)
                            raise
                        # after an answer, a 403 is this prompt's own (a provider's moderation answers 403)
                        raise RejectedError(str(err)) from err
                    row = completion_row(prompt, text, reply, config, tokenizer)
                    if "served_model" in row and row["served_model"] not in served_others:
                        served_others.add(row["served_model"])
                        logger.warning("the endpoint answers as %r, not %r, the model these rows are for (kept in "
                                       "each row as served_model): self-distillation needs the model's own "
                                       "answers; check that it serves %s", row["served_model"],
                                       config.model_label, config.model_label)
                except RejectedError as err:  # counted, logged and recorded: a rerun does not ask again
                    stats.rejected += 1
                    refused.append((prompt, str(err)))
                    logger.error("prompt %s refused by the endpoint, left out: %s", prompt["id"], err)
                    if isinstance(err.__cause__, EndpointError):  # a 403 after answers
                        forbidden.append(len(refused) - 1)
                        if len(forbidden) >= forbidden_limit or key_gone:
                            stopping.set()  # not recorded: asked again once the key is right
                            count, drop = len(forbidden), set(forbidden)
                            refused = [r for i, r in enumerate(refused) if i not in drop]
                            stats.rejected -= len(drop)
                            forbidden.clear()
                            first, key_gone = not key_gone, True
                            # (another fatal error in the same wake-up first: its message stands, the 403s unrecorded)
                            fatal = fatal if fatal is not None or not first else DistillError(
                                f"the endpoint answered HTTP 403 to {count} prompts in a row after answering "
                                f"others: a key that expired or lost access to the model, more likely than that many "
                                f"moderations; check the key in the variable api_key_env names, then run again (those "
                                f"prompts are not recorded as refused; rows written so far are kept). Last: {err}")
                    continue
                except EndpointError as err:
                    stopping.set()  # no new request; the refusals so far are recorded below, then it is raised
                    hint = (f"; where the endpoint answers other prompts, a 403 is this prompt's own refusal (a "
                            f"provider's moderation): leave it out with exclude_ids=[{prompt['id']!r}]"
                            if err.status == 403 else "")
                    # the first one: replies that came with it are still written, or recorded, below
                    fatal = fatal or DistillError(f"prompt {prompt['id']}: {err}{hint} (rows written so far are kept)")
                    continue
                except RuntimeError as err:
                    stats.failed += 1
                    errors.append(f"{prompt['id']}: {err}")
                    logger.error("prompt %s failed: %s", prompt["id"], err)
                    failing += 1
                    if failing >= give_up_after and not stopping.is_set():
                        logger.error("%d requests in a row failed: asking no more (the ones in flight end)", failing)
                        stopping.set()  # no new request; those waiting to retry give up
                    continue
                failing, answered = 0, True
                forbidden.clear()
                writer.write(row)
                stats.add(row)
                batch.append(row)
                bar.update(1)
                if len(batch) >= config.batch_size:
                    writer.sync()
                    if on_batch is not None:
                        on_batch(batch_index, batch)
                    batch, batch_index = [], batch_index + 1
            if fatal is not None:  # (after every reply that came with it: those in flight are abandoned)
                in_flight.clear()
                break
            while len(in_flight) < config.concurrency and submit_next():  # (after the replies: none once stopping)
                pass
            stats.seconds = time.perf_counter() - start
            bar.set_postfix(tok_s=f"{stats.tokens / max(stats.seconds, 1e-9):.1f}")
        writer.sync()
        if batch and on_batch is not None:
            on_batch(batch_index, batch)
    except KeyboardInterrupt:
        if in_flight:  # (their threads are daemons: the process ends without them, as it did not with an executor)
            logger.warning("stopped: %d requests in flight abandoned; their prompts are asked again by a rerun",
                           len(in_flight))
        raise
    finally:
        stopping.set()  # requests waiting to retry give up
        bar.close()
    # recorded, so that a rerun does not ask them again (a finished run's rerun, its endpoint stopped to free the
    # GPU for training, failed on them); not where every prompt asked was refused (more than one, or one and no row
    # is there): a setting every request carries, most likely, which a rerun should try again once fixed (beside
    # an earlier run's rows they were recorded, and the rerun asked nothing)
    # (and not where nothing was answered: the others failed, the endpoint down after refusing for a setting)
    recorded = bool(refused) and (answered or (len(jobs) == 1 and stats.already_done > 0))
    if recorded:
        for prompt, reason in refused:
            record_refusal(config, stats.rank, prompt, reason)
        logger.warning("%d prompts the endpoint refused are recorded in %s and not asked again by a rerun (delete "
                       "the file to ask them again)", len(refused), refusals_path(config.output, stats.rank))
    if fatal is not None:
        raise fatal
    if errors:
        asked = "" if sent == len(jobs) else (
            f"; after {give_up_after} failures in a row the other {len(jobs) - sent} were not asked (the endpoint "
            "looks down)")
        raise DistillError(
            f"{len(errors)} of {len(jobs)} requests failed{asked} (rows written so far are kept; rerun "
            f"to retry the rest; a prompt that fails every time can be left out with exclude_ids). First: {errors[0]}"
        )
    if not jobs or len(refused) < len(jobs):
        return
    # every prompt refused: a setting every request carries, most likely. With no row to train on that fails;
    # beside an earlier run's rows (its refusals, once their record is deleted, are asked again) it is said
    first = f"{refused[0][0]['id']}: {refused[0][1]}"
    if not stats.already_done:
        raise DistillError(
            f"the endpoint refused all {len(jobs)} prompts and no row was written before; first: {first}. "
            "Check the settings every request carries: max_new_tokens past the served model's context, or a "
            "parameter the endpoint does not take"
        )
    again = (f"It is recorded as that prompt's refusal: delete {refusals_path(config.output, stats.rank)} to ask it "
             "again" if recorded else "If it refuses them all for a setting every request carries (max_new_tokens "
             "past its context, a parameter it does not take), fix that and run again: they are asked again")
    logger.warning("the endpoint refused all %d prompts asked (first: %s); the %d rows already there are kept. %s",
                   len(jobs), first, stats.already_done, again)


# ---------------------------------------------------------------------------------------------
# Driver


def distill_shard(
    config: DistillConfig,
    prompts: Sequence[dict[str, Any]],
    rank: int = 0,
    world_size: int = 1,
    device: str | torch.device | None = None,
    on_batch: BatchHook | None = None,
    fingerprint: dict[str, Any] | None = None,
) -> ShardStats:
    """Answer prompts ``rank::world_size`` not yet written; append them to ``shard_path`` (kept hidden
    states record ``fingerprint``, see ``run_local``)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    done = existing_rows(config.output, repair_rank=rank)
    check_resumable(done, config)
    check_prompt_texts(done, prompts, config)
    done_ids = {str(row["id"]) for row in done}
    mine = list(prompts[rank::world_size])
    refused = refused_ids(config, mine) if config.backend == "openai" else set()
    pending = [p for p in mine if p["id"] not in done_ids and str(p["id"]) not in refused]
    # rows only: the prompts refused before are no rows (counted in, a run whose every prompt was refused passed
    # for one beside an earlier run's rows, and recorded them all)
    stats = ShardStats(rank=rank, already_done=sum(p["id"] in done_ids for p in mine))
    if stats.already_done:
        logger.info("rank %d: resuming, %d of %d prompts already done", rank, stats.already_done, len(mine))
    skipped = len(mine) - stats.already_done - len(pending)
    if skipped:
        logger.warning("rank %d: %d prompts the endpoint refused before are not asked again (delete %s.refused.rank*"
                       ".jsonl to ask them again)", rank, skipped, config.output)
    if not pending:
        return stats
    writer = ShardWriter(shard_path(config.output, rank))
    try:
        if pending and config.backend == "local":
            run_local(config, pending, writer, stats, device or config.device or "cpu", on_batch, fingerprint, done)
        elif pending:
            run_openai(config, pending, writer, stats, on_batch)
    finally:
        writer.close()
        logger.info(stats.summary())
    return stats


def distill(
    config: DistillConfig, accelerator: Any = None, on_batch: BatchHook | None = None
) -> Path:
    """Run self-distillation; return the merged JSONL path (``config.output``).

    Args:
        config: what to distil.
        accelerator: an ``accelerate`` ``Accelerator`` or ``PartialState``: the local model runs on its
            device (unless ``config.device`` says otherwise) and, with several processes, each takes its
            share of the prompts and the main one merges; ``None``: one process, on the CPU.
        on_batch: called after each batch is synced, e.g. to stop a run in tests.
    """
    rank = accelerator.process_index if accelerator is not None else 0
    world_size = accelerator.num_processes if accelerator is not None else 1
    Path(config.output).parent.mkdir(parents=True, exist_ok=True)
    held = hold_output(config.output, rank, world_size)
    try:
        return _distill(config, accelerator, on_batch, rank, world_size)
    finally:
        if held is not None:
            held.close()


def output_lock(output: str | Path, rank: int) -> Path:
    """The file rank ``rank`` of a run holds locked while it distils into ``output`` (``hold_output``)."""
    output = Path(output)
    return output.with_name(f".{output.name}.rank{rank}.lock")


def hold_output(output: str | Path, rank: int, world_size: int) -> Any:
    """Lock ``output_lock(output, rank)`` for this process (the handle to keep open; None where the system has no
    locks), or raise ``DistillError`` where another run holds any rank's: two runs into one output wrote every
    answer twice into the same shard, or (of other settings) a merged file of both runs' rows, each run saying it
    had written its own."""
    from medusa_train.locks import try_lock

    held, holder = try_lock(output_lock(output, rank))
    holders = [holder]
    if world_size > 1:  # (every rank refuses, or none: one refused alone left the others at a barrier)
        from accelerate.utils import gather_object

        holders = gather_object([holder])
    busy = next((h for h in holders if h is not None), None)
    if busy is not None:
        if held is not None:
            held.close()
        raise DistillError(f"{output} is being written by another distillation (process {busy}): wait for it to end "
                           "or stop it, or give this one another output")
    return held


def _distill(config: DistillConfig, accelerator: Any, on_batch: BatchHook | None, rank: int,
             world_size: int) -> Path:
    """``distill``, its output held."""
    device = config.device or (accelerator.device if accelerator is not None else "cpu")
    done = existing_rows(config.output)
    prompts = run_prompts(config, done)
    if not prompts:  # (an empty output file, and status 0)
        raise ValueError(f"{config.prompts} gives no prompt to distil: it holds none, or exclude_ids or per_source "
                         "leave none out of it")
    check_empty_prompts(prompts, done, config.prompts)
    if rank == 0:
        sources: dict[str, int] = {}
        for prompt in prompts:
            sources[prompt["source"]] = sources.get(prompt["source"], 0) + 1
        logger.info("sampled %d prompts from %s: %s", len(prompts), config.prompts, sources)
    fingerprint = None
    if config.save_hidden:
        # the main process's, on every one: nodes may hold copies of the model written at other times
        # (a modification time is part of it), and the features stage compares them with its own
        fingerprint = model_fingerprint(config.model)
        if world_size > 1:
            from accelerate.utils import broadcast_object_list

            fingerprint = broadcast_object_list([fingerprint], from_process=0)[0]
    distill_shard(config, prompts, rank, world_size, device, on_batch, fingerprint)
    if accelerator is not None:
        accelerator.wait_for_everyone()
    output = Path(config.output)
    shards = bool(shard_files(output))
    if rank == 0 and (shards or not output.is_file() or (config.format == "arrow" and not arrow_path(output).exists())):
        merge_shards(config.output, prompts, config.format)
    elif rank == 0:  # every prompt was answered already: the file stays as it is
        _warn_extra_rows(output, (str(row["id"]) for row in read_jsonl_tolerant(output)), (p["id"] for p in prompts))
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return Path(config.output)


# ---------------------------------------------------------------------------------------------
# Command line


def _parse_quota(text: str) -> tuple[str, int]:
    source, sep, count = text.rpartition("=")
    if not sep or not source:
        raise argparse.ArgumentTypeError(f"expected SOURCE=COUNT, got {text!r}")
    try:
        return source, int(count)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"count in {text!r} is not an integer") from err


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m medusa_train.distill",
        description="Let a model answer training prompts (self-distillation) into a JSONL file.",
    )
    add = parser.add_argument
    add("--recipe", help="YAML file of DistillConfig keys (top level or under 'distill'); flags override it")
    add("--model", help="target model: default-model name, folder or Hub id")
    add("--prompts", help="JSONL file of {id, source, prompt} rows")
    add("--n", "--num-prompts", dest="n", type=int,
        help="number of prompts to sample (balanced by source); under torchrun, spell it --num-prompts")
    add("--output", help="merged JSONL output file")
    add("--per-source", type=_parse_quota, action="append", metavar="SOURCE=COUNT",
        help="quota for one source (repeatable); only named sources are used")
    add("--exclude-ids", metavar="FILE", help="JSONL (with 'id') or text file of ids never to sample")
    add("--max-new-tokens", type=int)
    add("--batch-size", type=int)
    add("--do-sample", action=argparse.BooleanOptionalAction, default=None)
    add("--temperature", type=float)
    add("--top-p", type=float)
    add("--seed", type=int)
    add("--format", choices=FORMATS)
    add("--max-prompt-tokens", type=int, help="longer prompts are skipped or truncated (0: no limit)")
    add("--prompt-overflow", choices=OVERFLOW)
    add("--system-prompt")
    add("--chat-template", metavar="FILE_OR_TEMPLATE",
        help="jinja chat template replacing the tokenizer's: a file, or the template itself")
    add("--backend", choices=BACKENDS)
    add("--endpoint", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    add("--api-key-env", help="environment variable holding the API key")
    add("--endpoint-model", help="model name sent to the endpoint")
    add("--concurrency", type=int)
    add("--max-retries", type=int)
    add("--device")
    add("--threads", type=int, help="CPU threads for generation (default: torch's choice)")
    add("--no-progress", dest="progress", action="store_false", default=None)
    add("--save-hidden", action="store_true", default=None,
        help="also keep the final hidden states of the answers, for the Medusa-1 feature cache")
    add("--trust-remote-code", action="store_true", default=None,
        help="run the model repository's own code (only for models that need it)")
    add("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return parser


def _no_id(where: str) -> str:
    raise ValueError(f"{where} is a row without an 'id' key; give rows with an 'id', or one id a line")


def read_ids(path: str | Path) -> list[str]:
    """Ids from a JSONL file with an ``id`` key per row, a file of one JSON array of such rows (ShareGPT's
    ``.json``, as prompts files may be), or a text file with one id per line."""
    if is_json_array(Path(path)):  # (read a line at a time, its whole first line was taken for one id)
        try:
            rows = list(_prompt_rows(Path(path)))
        except ValueError:  # no JSON: one id a line, the first starting with "[" ("[draft]-1")
            rows = None
        if rows is not None:  # rows with an id, or the ids themselves (["p0", "p1"])
            return [str(row["id"]) if isinstance(row, dict) and "id" in row else
                    str(row) if isinstance(row, (str, int)) and not isinstance(row, bool) else _no_id(where)
                    for where, row in rows]
    ids = []
    # (utf-8-sig: a byte order mark, as Notepad and PowerShell write, made the first id one no prompt has, and that
    # held-out prompt was distilled and trained on)
    for number, line in enumerate(Path(path).read_text(encoding="utf-8-sig").split("\n"), 1):  # not splitlines:
        line = line.strip()  # JSON strings hold U+2028
        if not line.startswith("{"):
            if line:
                ids.append(line)
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:  # (it named neither the file nor the line)
            raise ValueError(f"{path}:{number} is not valid JSON ({err}); give rows with an 'id', or one id a line") \
                from err
        if "id" not in row:  # (a KeyError traceback)
            raise ValueError(f"{path}:{number} is a JSON row without an 'id' key; give rows with an 'id', or one id "
                             "a line")
        ids.append(str(row["id"]))
    return ids


def _is_file(name: str) -> bool:
    """Whether ``name`` names a file; False for text no path can be (a long inline template)."""
    try:
        return Path(name).is_file()
    except (OSError, ValueError):  # ENAMETOOLONG, a NUL byte
        return False


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    values: dict[str, Any] = {}
    if args.recipe:
        loaded = read_recipe(args.recipe)  # a YAML error or a list was a traceback
        section = loaded.get("distill", loaded)
        if not isinstance(section, dict):  # an empty "distill:" was a TypeError traceback
            raise ValueError(f"{args.recipe}: its distill section must be a mapping of settings, got {section!r}")
        # each to its type, as a training recipe's are (do_sample: "false" sampled, a quoted number a TypeError);
        # an unknown key is named by from_dict
        hints = typing.get_type_hints(DistillConfig)
        values.update({key: value if key not in hints or (key, value) == ("chat_template", "")  # '': the tokenizer's
                       else convert_value(value, hints[key], f"{args.recipe}: {key}") for key, value in section.items()})
    skip = {"recipe", "log_level", "exclude_ids", "per_source"}
    values.update({k: v for k, v in vars(args).items() if k not in skip and v is not None})
    if args.per_source:
        named = [source for source, _ in args.per_source]
        twice = sorted({source for source in named if named.count(source) > 1})
        if twice:  # (the last quota was kept, where a repeat reads as adding)
            raise ValueError(f"--per-source names {', '.join(map(repr, twice))} more than once: give each source one "
                             "quota")
        values["per_source"] = dict(args.per_source)
    if args.exclude_ids:
        values["exclude_ids"] = read_ids(os.path.expanduser(args.exclude_ids))
    template = values.get("chat_template")
    if template and _is_file(os.path.expanduser(template)):
        values["chat_template"] = Path(template).expanduser().read_text(encoding="utf-8")
    if values.get("max_prompt_tokens") == 0:
        values["max_prompt_tokens"] = None
    config = DistillConfig.from_dict(values)
    prompts = Path(config.prompts)
    if not prompts.is_file():  # (a FileNotFoundError traceback; a pipe, read twice, gave no prompt or hung)
        why = ("no such file" if not prompts.exists() else "is a folder" if prompts.is_dir() else
               "is no regular file (a pipe or a device), and its prompts are read more than once")
        raise ValueError(f"--prompts {config.prompts}: {why}: give a JSONL file of {{id, source, prompt}} rows")
    return config


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    from accelerate import PartialState

    # On a machine without CUDA, processes started by torchrun or `accelerate launch` only form a
    # group (over gloo) when asked for CPU explicitly.
    state = None
    try:  # (Ctrl-C in a launch's rendezvous, while the state forms, too)
        state = PartialState(cpu=not torch.cuda.is_available())
        output = distill(config, state)  # on the state's device (a GPU where there is one), one process or several
    except (DistillError, ValueError) as err:  # the endpoint's failures, a prompts file's bad line, a resume of
        # rows made otherwise: said with what to do (a traceback said it too)
        sys.exit(f"{parser.prog}: error: {err}")
    except Exception as err:  # a full disk, a read-only folder: a traceback from the writer
        from medusa_infer.checkpoint import write_failure

        advice = write_failure(err)
        if advice is not None:
            sys.exit(f"{parser.prog}: error: {str(err).splitlines()[0]}: {advice}, then run the same command again "
                     "(the rows written are kept)")
        if isinstance(err, OSError) and err.filename:  # a path that cannot be read or made (--output under /proc)
            sys.exit(f"{parser.prog}: error: {err}")
        raise
    except KeyboardInterrupt:  # Ctrl-C: no traceback, said once (it reaches every process a launcher started)
        if state.is_main_process if state is not None else first_launch_process():
            print(f"\n{parser.prog}: interrupted; the rows written are kept: run the same command again to distil "
                  "the rest", file=sys.stderr)
        sys.exit(130)
    if state.is_main_process:
        print(output)


if __name__ == "__main__":
    main()
