"""``medusa-serve``: an OpenAI-compatible HTTP server with speculative decoding.

    medusa-serve                                          # the default model, plain decoding
    medusa-serve --method lookup                          # prompt lookup, no extra weights
    medusa-serve --heads runs/demo/heads                  # Medusa heads (and their base model)
    medusa-serve --api-key "$KEY" --port 8001             # clients send Authorization: Bearer KEY

Then point any OpenAI client at http://127.0.0.1:8000/v1. The server listens on 127.0.0.1 unless
--host says otherwise; model code from the Hub runs only with --trust-remote-code.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import math
import os
import socket
import sys
from typing import Any, Sequence

from medusa_infer.cli import (DRAFT_INSTEAD, HEADS_INSTEAD, MAX_THREADS, MODEL_INSTEAD, add_draft_arguments,
                               add_tree_arguments, check_loaded_flags, check_method_flags, reads_datastore,
                               refuse_empty)
from medusa_infer.proposers import METHODS

DEFAULT_MODEL = "smollm2-135m-instruct"
API_KEY_ENV = "MEDUSA_SERVE_API_KEY"

log = logging.getLogger("medusa_infer.serving")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="medusa-serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help=f"base model: a default-model name, folder or Hub id (default {DEFAULT_MODEL}, "
                             "or the one the heads were trained for)")
    parser.add_argument("--heads", help="Medusa heads folder or Hub repo (safetensors; needed by --method medusa)")
    parser.add_argument("--method", choices=METHODS, default=None,
                        help="how candidates are proposed (default: medusa with --heads, else autoregressive)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model id clients send (default: --model, or the heads' base model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV})")
    parser.add_argument("--max-batch", type=int, default=16, help="rows decoded at once, all batches together")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests that may wait for a row beyond those the free rows take (--max-batch); more "
                             "get HTTP 503")
    parser.add_argument("--max-prefill-tokens", type=int, default=2048,
                        help="prompt tokens prefilled between two decoding steps at most (a longer prompt alone), "
                             "so a burst of long prompts does not stall running streams (default 2048)")
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="seconds a request may take, queued and decoding (0: no limit)")
    parser.add_argument("--acceptance", choices=("lossless", "typical"), default="lossless",
                        help="acceptance rule of sampled requests (greedy requests are exact anyway); typical "
                             "accepts more, but its samples do not follow the model's distribution, lossless's do")
    add_tree_arguments(parser)
    parser.add_argument("--lookup-tokens", type=int, default=0,
                        help="--method medusa: also graft a prompt-lookup chain of up to N tokens onto the tree "
                             "(0: heads only; with a cost profile, the length that pays, up to --lookup-max-tokens)")
    parser.add_argument("--no-datastore", dest="datastore", action="store_false",
                        help="lookup drafts search only the conversation, not the heads' datastore of the "
                             "model's own answers (datastore.safetensors, used when the heads folder has one)")
    parser.add_argument("--speculation-gate", choices=("measured", "off"), default="measured",
                        help="measured (default): speculate only at batch sizes where the measured step "
                             "times and acceptance say it is faster; off: speculate on every step")
    parser.add_argument("--draft-model", help="draft model for --method draft (only)")
    add_draft_arguments(parser)
    parser.add_argument("--layerskip-layers", type=int, default=None,
                        help="target layers used as the draft by --method layerskip")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow model code from the Hub to run (off by default)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice; 1 is faster on a busy machine)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    args = parser.parse_args(argv)
    refuse_empty(parser, [("--model", args.model, MODEL_INSTEAD), ("--heads", args.heads, HEADS_INSTEAD),
                          ("--draft-model", args.draft_model, DRAFT_INSTEAD),
                          ("--served-model-name", args.served_model_name, "name the model id clients send, or leave "
                           "--served-model-name out for --model's (or the heads' base model's)"),
                          ("--host", args.host, "give an address of this machine, such as 127.0.0.1 (the default), "
                           "or 0.0.0.0 to listen on every interface on purpose")])
    check_method_flags(parser, args, "or use --method lookup, which needs no weights")
    if args.method == "autoregressive" and args.speculation_gate == "off":
        parser.error("--speculation-gate off speculates at every batch size, and --method autoregressive never "
                     "speculates: drop --speculation-gate")
    if args.heads and args.trust_remote_code and not args.model:
        parser.error("--trust-remote-code applies to --model: name the base model with --model")
    if args.max_batch < 1 or args.max_queue < 1:
        parser.error(f"--max-batch and --max-queue must be >= 1, got {args.max_batch} and {args.max_queue}")
    if args.max_prefill_tokens < 1:
        parser.error(f"--max-prefill-tokens must be >= 1, got {args.max_prefill_tokens}")
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.threads is not None and args.threads > MAX_THREADS:
        parser.error(f"--threads must be at most {MAX_THREADS}, got {args.threads}")
    if not args.request_timeout >= 0 or math.isinf(args.request_timeout):  # NaN too
        parser.error(f"--request-timeout must be a number of seconds >= 0 (0: no limit), got {args.request_timeout}")
    source = "--api-key" if args.api_key is not None else f"${API_KEY_ENV}"
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV)
    if args.api_key is not None:
        # a key read from a file often ends in a newline, which no client sends: every request was refused
        args.api_key = args.api_key.strip()
        if not args.api_key:
            parser.error(f"{source} is empty")
        if not (args.api_key.isascii() and args.api_key.isprintable()):  # (the server reads headers as latin-1,
            # HTTP clients send no other characters: every request was refused, without a word at the start)
            parser.error(f"{source} must be printable ASCII (it travels in an HTTP header), got "
                         f"{len(args.api_key)} characters of which some are not")
    return args


def load_model(args: argparse.Namespace):
    """The target ``MedusaModel`` (with heads when ``--heads`` is given) and its tokenizer."""
    from medusa_infer.model import MedusaModel
    from medusa_infer.models import load_base_model, load_tokenizer

    def base(name: str):
        trust = args.trust_remote_code
        return load_base_model(name, trust_remote_code=trust), load_tokenizer(name, trust_remote_code=trust)

    if args.heads:
        model, tokenizer = base(args.model) if args.model else (None, None)
        model = MedusaModel.from_pretrained(args.heads, base_model=model, tokenizer=tokenizer,
                                            datastore=args.datastore and reads_datastore(args))
    else:
        base_model, tokenizer = base(args.model or DEFAULT_MODEL)
        model = MedusaModel(base_model, None, tokenizer)
    if model.tokenizer is None:
        raise ValueError("the model was loaded without a tokenizer; pass --model")
    if args.draft_model:  # loaded once here, not for every batch
        draft, draft_tokenizer = base(args.draft_model)
        args.draft_model = MedusaModel(draft, None, draft_tokenizer)
    return model


def warm_up(model, method: str, options: Any = None) -> None:
    """One short untimed generation with the served method (its draft model too) before the server
    takes requests. The first forward through each linear layer packs its weights for the CPU kernels
    chosen (``medusa_infer.cpu_kernels``) and builds their primitives: the default model with heads
    took 1.8 s for its first one-token answer, 0.1 s for the next, a delay the first request would
    otherwise pay. A prompt that repeats itself, so that prompt lookup drafts too."""
    from medusa_infer.decoding import generate
    from medusa_infer.proposers import build_proposer

    log.info("warming up: one short generation")
    generate(model, prompt="one two three, one two three, one two three, one two", max_new_tokens=8,
             proposer=build_proposer(method, model, options))


def served_name(args: argparse.Namespace, model) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model:
        return args.model
    return getattr(model.base_model, "name_or_path", None) or DEFAULT_MODEL


def build_app(model, name: str, method: str, *, options: Any = None, api_key: str | None = None,
              max_batch: int = 16, max_queue: int = 64, max_prefill_tokens: int = 2048,
              request_timeout: float | None = 120.0, acceptance: str = "lossless", speculation_gate: bool = True):
    """The FastAPI app and its engine for a loaded ``model`` (tests use it with tiny models).

    Args:
        name: the model id clients send.
        method: the proposer method; ``options`` its settings (see ``build_proposer``).
        request_timeout: seconds a request may take in all; None or 0: no limit.
        speculation_gate: whether the engine speculates only while it measures speculation
            faster at the running batch size (``speculation_gate.SpeculationGate``).
    """
    from medusa_infer.decoding import context_length, eos_ids
    from medusa_infer.serving.app import ServerSettings, create_app
    from medusa_infer.serving.metrics import ServingMetrics
    from medusa_infer.serving.protocol import ModelInfo
    from medusa_infer.serving.scheduler import Engine

    tokenizer = model.tokenizer
    engine = Engine(model, tokenizer, method, options, max_batch=max_batch, max_queue=max_queue,
                    max_prefill_tokens=max_prefill_tokens, metrics=ServingMetrics(name),
                    gate=None if speculation_gate else False)
    info = ModelInfo(name, tokenizer, context_length(model), model.lm_head.weight.shape[0])
    settings = ServerSettings(method, eos_ids(model, tokenizer, None), api_key, request_timeout or None, acceptance)
    return create_app(engine, info, settings), engine


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import fastapi  # noqa: F401  (the app's; checked before the model loads)
        import uvicorn
    except ImportError:
        print("medusa-serve: error: the server needs the serve extra: pip install 'medusa-forge[serve]'",
              file=sys.stderr)
        return 1
    if not _is_loopback(args.host) and args.api_key is None:
        log.warning("listening on %s without --api-key: anyone who can reach this address can use the model",
                    args.host)
    # bound before the model loads, so a busy port is said at once (and not after minutes of loading), and
    # listening only once it is loaded and warmed up (uvicorn listens on it): a connection before then is
    # refused, so a readiness probe does not pass while the model loads
    listener = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        if os.name == "posix":  # as socket.create_server: a restarted server rebinds at once
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if listener.family == socket.AF_INET6:  # as socket.create_server: an IPv6 address serves IPv6 alone
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        listener.bind((args.host, args.port))
    except OSError as error:
        listener.close()
        fix = ("pick another --port, or stop what uses this one" if error.errno in (errno.EADDRINUSE, errno.EACCES)
               else "check --host: an address of this machine, such as 127.0.0.1 or 0.0.0.0 (IPv6: ::1 or ::, "
               "without brackets)")
        print(f"medusa-serve: error: cannot listen on {args.host}:{args.port} ({error.strerror or error}); {fix}",
              file=sys.stderr)
        return 1
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        model = load_model(args)
        check_loaded_flags(model, args)
        warm_up(model, args.method, args)  # options the model refuses (a tree, layers, a draft's vocabulary) too
    except (ValueError, RuntimeError, OSError) as error:
        print(f"medusa-serve: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while loading or warming up (minutes for a large model): no traceback
        listener.close()
        print(file=sys.stderr)
        return 130
    name = served_name(args, model)
    app, _ = build_app(model, name, args.method, options=args, api_key=args.api_key, max_batch=args.max_batch,
                       max_queue=args.max_queue, max_prefill_tokens=args.max_prefill_tokens,
                       request_timeout=args.request_timeout, acceptance=args.acceptance,
                       speculation_gate=args.speculation_gate == "measured")
    log.info("serving %s with %s on http://%s:%d/v1", name, args.method, args.host, args.port)
    from medusa_infer.serving.app import uvicorn_server

    # no limit_concurrency: uvicorn counts idle keep-alive connections against it and answered every route,
    # /health included, a plain-text 503 past it; the engine's queue (--max-queue) bounds the work
    try:
        uvicorn_server(app, drain_s=5.0, host=args.host, port=args.port, log_level=args.log_level).run(
            sockets=[listener])
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down (drained) and raises it again; no traceback
        return 130
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
