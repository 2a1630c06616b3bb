"""Helpers to test the server without a real model: a word-level tokenizer with a chat template,
a uvicorn server on a free loopback port in a thread, and reading one value from ``/metrics``."""

from __future__ import annotations

import re
import socket
import threading
import time
from typing import Any, Sequence

WORDS = tuple(
    "the a cat dog sat on mat and ran to red blue green big small house tree sun moon star is was "
    "it he she we they see saw go went up down in out of with one two three four five six seven eight "
    "nine ten yes no hello world good bad day night time way man woman child city road river sea sky "
    "rain snow wind fire water stone bird fish apple bread milk book pen door".split()
)
SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")
ROLE_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def word_tokenizer(words: Sequence[str] = WORDS):
    """A ``PreTrainedTokenizerFast`` over whitespace-separated ``words`` (ids: pad 0, bos 1, eos 2,
    unk 3, then the role markers, then the words), with a simple chat template; built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIAL, *ROLE_MARKERS, *words))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


class ServerThread:
    """Runs an ASGI ``app`` with uvicorn on 127.0.0.1 (a free port) in a daemon thread.

    Use as a context manager; ``base_url`` is ``http://127.0.0.1:PORT``.
    """

    def __init__(self, app: Any, startup_timeout: float = 60.0) -> None:
        from medusa_infer.serving.app import uvicorn_server

        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn_server(app, drain_s=2.0, log_level="warning", lifespan="on")
        self.startup_timeout = startup_timeout
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name=f"uvicorn-{self.port}", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the test server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.socket.close()


_SAMPLE = re.compile(r'^([^\s{]+)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)$')  # (a "}" in a quoted value)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` whose labels include ``labels`` in Prometheus ``text``
    (0.0 if absent); several matching samples are summed."""
    total = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match.group(1) != name:
            continue
        found = {key: re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], value)  # (as written: escaped)
                 for key, value in _LABEL.findall(match.group(2) or "")}
        if all(found.get(k) == str(v) for k, v in labels.items()):
            total += float(match.group(3))
    return total


def wait_until(condition: Any, timeout: float = 10.0, interval: float = 0.01, message: str = "") -> None:
    """Poll ``condition()`` until it is true; ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(message or f"condition not met within {timeout} s")
        time.sleep(interval)


class serve:
    """``with serve(model, method, **options) as (server, engine):`` the app of ``build_app`` run
    by a ``ServerThread``; options as ``build_app``'s (``api_key``, ``max_batch``, ...)."""

    def __init__(self, model: Any, method: str = "autoregressive", name: str = "tiny", **options: Any) -> None:
        from medusa_infer.serving.cli import build_app

        app, self.engine = build_app(model, name, method, **options)
        self.server = ServerThread(app)

    def __enter__(self) -> tuple[ServerThread, Any]:
        return self.server.__enter__(), self.engine

    def __exit__(self, *exc: Any) -> None:
        self.server.__exit__(*exc)


class torch_threads:
    """Run a block with ``n`` torch CPU threads (one is far faster for tiny models on a busy machine)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self) -> None:
        import torch

        self.previous = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: Any) -> None:
        import torch

        torch.set_num_threads(self.previous)
