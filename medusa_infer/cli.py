"""``medusa-generate``: speculative generation from the command line, streamed to the terminal.

    medusa-generate "What is the capital of France?"                      # plain decoding
    medusa-generate --heads runs/demo/heads "Explain speculative decoding"  # Medusa heads
    medusa-generate --method lookup "Repeat after me: ..."                # prompt lookup
    medusa-generate --method layerskip "Explain speculative decoding"     # first layers as the draft
    medusa-generate --method draft --draft-model SMALL_MODEL "..."         # a draft model
    medusa-generate --heads runs/demo/heads --chat                        # interactive chat

The run's metrics (tokens per step, tokens/s, ...) are printed to stderr at the end.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path
from typing import Sequence

from medusa_infer.proposers import METHODS, build_proposer
from medusa_infer.proposers.draft import SCHEDULES, as_draft_model
from medusa_infer.proposers.lookup import LOOKUP_MAX_TOKENS

DEFAULT_MODEL = "smollm2-135m-instruct"
MAX_THREADS = 4096
"""The most ``--threads`` taken (medusa-serve, medusa-bench): torch.set_num_threads took up to 2**31 - 1 and
failed past it with a traceback, and no machine has more hardware threads than this."""
MAX_NEW_TOKENS = 2**31 - 1
"""The most ``--max-new-tokens`` taken: a 32-bit C long's largest (an answer stops at the end of the model's context
anyway); 10**20 failed generating, after the first token, with an error naming no flag."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="medusa-generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", help="the prompt (omit with --chat)")
    parser.add_argument("--model", default=None,
                        help=f"base model: a default-model name, folder or Hub id (default {DEFAULT_MODEL}, "
                             "or the one the heads were trained for)")
    parser.add_argument("--heads", help="Medusa heads folder or Hub repo (needed by --method medusa)")
    parser.add_argument("--method", choices=METHODS, default=None,
                        help="how candidates are proposed (default: medusa with --heads, else autoregressive)")
    parser.add_argument("--draft-model", help="draft model for --method draft (same tokenizer as the model)")
    add_draft_arguments(parser)
    parser.add_argument("--lookup-max-ngram", type=int, default=None,
                        help="longest n-gram lookup drafts search for in the conversation, then shorter ones "
                             "(--method lookup, or medusa with --lookup-tokens; default 3; the heads' datastore "
                             "searches the lengths it was built with, 6 to 2 by default)")
    parser.add_argument("--lookup-min-ngram", type=int, default=None,
                        help="shortest n-gram lookup drafts accept as a match in the conversation, longer: "
                             "fewer, surer drafts (default 1; not the heads' datastore's, see --lookup-max-ngram)")
    parser.add_argument("--layerskip-layers", type=int, default=None,
                        help="target layers used as the draft by --method layerskip (default: a third)")
    add_tree_arguments(parser)
    parser.add_argument("--lookup-tokens", type=int, default=0,
                        help="--method medusa: also graft a prompt-lookup chain of up to N tokens onto the tree "
                             "(0: heads only; with a cost profile, the length that pays, up to --lookup-max-tokens)")
    parser.add_argument("--no-datastore", dest="datastore", action="store_false",
                        help="lookup drafts search only the conversation, not the heads' datastore of the "
                             "model's own answers (datastore.safetensors, used when the heads folder has one)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="the most tokens an answer gets (default 256)")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=None, help="with --do-sample (default 1.0)")
    parser.add_argument("--top-p", type=float, default=None, help="with --do-sample (default 1.0: off)")
    parser.add_argument("--top-k", type=int, default=None, help="with --do-sample (default 0: off)")
    parser.add_argument("--acceptance", choices=("greedy", "typical", "lossless"), default=None,
                        help="acceptance rule (default: greedy, or lossless with --do-sample; typical and "
                             "lossless need --do-sample; typical accepts more, but its samples do not follow "
                             "the model's distribution, lossless's do)")
    parser.add_argument("--seed", type=int, default=None, help="with --do-sample: seed of the sampling")
    parser.add_argument("--system", help="system prompt for the chat template (not with --raw)")
    parser.add_argument("--raw", action="store_true",
                        help="send the prompt as is, without the chat template (with --chat: the whole "
                             "conversation as one text, each later line on a new line after the answer)")
    parser.add_argument("--chat", action="store_true", help="interactive chat (empty line or Ctrl-D ends it)")
    args = parser.parse_args(argv)
    refuse_empty(parser, [("--model", args.model, MODEL_INSTEAD), ("--heads", args.heads, HEADS_INSTEAD),
                          ("--draft-model", args.draft_model, DRAFT_INSTEAD)])
    if args.prompt is None and not args.chat:
        parser.error("give a prompt, or --chat for an interactive chat")
    if args.prompt is not None and args.chat:
        parser.error(f"--chat reads its prompts interactively; drop the prompt {args.prompt!r} or drop --chat")
    if args.prompt is not None and not args.prompt.strip():  # (an unset shell variable: an empty turn was answered)
        parser.error(f"the prompt is empty ({args.prompt!r}): give the text to answer, or --chat")
    for what, text in (("the prompt", args.prompt), ("--system", args.system)):
        if text is not None and not is_text(text):  # (the tokenizer failed on it with a TypeError)
            parser.error(f"{what} is not UTF-8 text ({ascii(text)[:60]}): fix its encoding")
    sampling_only = [flag for flag, value in (("--temperature", args.temperature), ("--top-p", args.top_p),
                                              ("--top-k", args.top_k), ("--seed", args.seed)) if value is not None]
    if sampling_only and not args.do_sample:
        parser.error(f"{', '.join(sampling_only)} set the sampling, but without --do-sample decoding is greedy: "
                     "add --do-sample (or drop them)")
    if args.acceptance in ("typical", "lossless") and not args.do_sample:
        parser.error(f"--acceptance {args.acceptance} samples: add --do-sample (or use --acceptance greedy)")
    if args.acceptance == "greedy" and args.do_sample:
        given = " ".join(["--do-sample", *sampling_only])
        parser.error(f"--acceptance greedy takes the model's top token, so {given} would change nothing: drop "
                     f"--acceptance greedy to sample (lossless by default), or drop {given}")
    if args.raw and args.system is not None:
        parser.error("--system goes into the chat template, which --raw leaves out: drop --system (or put it at the "
                     "start of the prompt), or drop --raw")
    args.temperature = 1.0 if args.temperature is None else args.temperature
    args.top_p = 1.0 if args.top_p is None else args.top_p
    args.top_k = 0 if args.top_k is None else args.top_k
    shaping = [flag for flag, unused in (("--top-p", args.top_p != 1.0), ("--top-k", args.top_k != 0),
                                         ("--seed", args.seed is not None)) if unused]
    if args.acceptance in ("typical", "lossless"):  # (named: both decode greedily at temperature 0)
        shaping.append(f"--acceptance {args.acceptance}")
    if args.do_sample and args.temperature == 0 and shaping:  # as generation refuses it, before the model loads
        parser.error(f"{', '.join(shaping)} shape sampling, and --temperature 0 decodes greedily: give a temperature "
                     "above 0, or drop them")
    # first: a rule the method does not use is refused as such, not for the settings it would refuse
    check_method_flags(parser, args, "train some with train_heads.py or `make demo` (in the medusa-forge repository)")
    if args.do_sample:  # the sampling settings, checked as generation will (before the model loads)
        from medusa_infer.decoding import SamplingConfig

        try:
            SamplingConfig(args.acceptance or "lossless", args.temperature, args.top_k, args.top_p)
        except ValueError as err:
            parser.error(str(err))
    longest = 3 if args.lookup_max_ngram is None else args.lookup_max_ngram
    shortest = 1 if args.lookup_min_ngram is None else args.lookup_min_ngram
    for flag, value in (("--lookup-max-ngram", longest), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.max_new_tokens > MAX_NEW_TOKENS:
        parser.error(f"--max-new-tokens must be at most {MAX_NEW_TOKENS}, got {args.max_new_tokens} (an answer stops "
                     "at the end of the model's context anyway)")
    if shortest < 1 or shortest > longest:
        parser.error(f"--lookup-min-ngram must lie in [1, --lookup-max-ngram={longest}], got {shortest}")
    return args


MODEL_INSTEAD = "name the base model (a folder, a Hub id or a default-model name), or leave --model out for the default"
HEADS_INSTEAD = "name a heads folder or Hub repo, or leave --heads out to decode without heads"
DRAFT_INSTEAD = "name the draft model (a folder, a Hub id or a default-model name), or leave --draft-model out"


def refuse_empty(parser: argparse.ArgumentParser, options: Sequence[tuple[str, str | None, str]]) -> None:
    """``parser.error`` for a name or path given as empty text (or blanks), which read as not given (the default
    model loaded, heads left out, a report written into the working folder, without a word); ``options`` holds
    each option's flag, value and what to do instead."""
    for flag, value, instead in options:
        if value is not None and not value.strip():
            parser.error(f"{flag} is empty ({value!r}): {instead}")


def decode_utf8(data: bytes, where: str | Path, line: int = 1, offset: int = 0) -> str:
    """``data`` decoded as UTF-8; ``ValueError`` naming ``where``'s line (``line``: that of ``data``'s first byte) and
    byte (``offset``: ``data``'s first byte's in the file) where it is not (the codec's own message named neither).
    A byte order mark that opens a file (``offset`` 0: Notepad and PowerShell write one) is left out."""
    skip = 3 if offset == 0 and data.startswith(b"\xef\xbb\xbf") else 0  # (utf-8-sig counted from after it)
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as err:
        start = skip + err.start
        at = line + data[:start].count(b"\n")
        raise ValueError(f"{where}:{at} is not UTF-8 text ({err.reason} at byte {offset + start}): save it as "
                         "UTF-8") from None


def is_text(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8: bytes that are not (in a command's arguments, or a line read) arrive as
    lone surrogates, which tokenizers refuse with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def reads_datastore(args: argparse.Namespace) -> bool:
    """Whether ``args.method`` drafts from the heads' datastore: lookup, or medusa with ``--lookup-tokens``
    (the others leave it unread: a damaged one stopped them, and --no-datastore was refused for them)."""
    return args.method == "lookup" or (args.method == "medusa" and bool(args.lookup_tokens))


def load(args: argparse.Namespace):
    from medusa_infer.model import MedusaModel

    if args.heads:
        # --no-datastore, or a method that drafts none: the store left unread (one that does not load stops nothing)
        return MedusaModel.from_pretrained(args.heads, base_model=args.model,
                                           datastore=args.datastore and reads_datastore(args))
    return MedusaModel.without_heads(args.model or DEFAULT_MODEL)


def add_draft_arguments(parser: argparse.ArgumentParser) -> None:
    """``--draft-tokens`` and ``--draft-schedule`` (draft, layerskip, lookup), shared by ``medusa-generate`` and
    ``medusa-serve``."""
    parser.add_argument("--draft-tokens", type=int, default=None,
                        help="tokens proposed a step by draft, layerskip (the first k: --draft-schedule adapts it, "
                             "up to 16 or this) and lookup (default 4; lookup with heads that carry a cost profile: "
                             "the length that pays, up to this, or 16 when not given)")
    parser.add_argument("--draft-schedule", choices=SCHEDULES, default=None,
                        help="draft and layerskip: adapt k to the acceptance (heuristic, the default) or keep "
                             "it (constant)")


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tree``, ``--no-fallback`` and ``--lookup-max-tokens`` (``--method medusa``), shared by ``medusa-generate``
    and ``medusa-serve``."""
    parser.add_argument("--tree", help="--method medusa only: a tree preset, or fitted-N for the N-node tree fitted to "
                        "the heads' measured accuracies (default: the heads' own tree). With heads that carry a "
                        "cost profile (calibrated) the adaptive fallback starts from it and shrinks it while "
                        "smaller trees pay better; --no-fallback keeps it at every step")
    parser.add_argument("--no-fallback", dest="adaptive", action="store_const", const=False, default=None,
                        help="--method medusa only: keep the tree at every step (no adaptive fallback)")
    parser.add_argument("--lookup-max-tokens", type=int, default=None,
                        help="--method medusa with --lookup-tokens, heads that carry a cost profile: the longest "
                             f"lookup chain its gate may choose (default {LOOKUP_MAX_TOKENS}; without a cost profile "
                             "the chain is --lookup-tokens long)")


def check_method_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, heads_hint: str) -> None:
    """Settle ``args.method`` (medusa with ``--heads``, else autoregressive) and refuse, before any model
    loads, a method without what it needs and the proposer flags it would not use; shared by
    ``medusa-generate`` and ``medusa-serve``. ``heads_hint`` says where heads come from."""
    if args.method is None:
        args.method = "medusa" if args.heads else "autoregressive"
    if args.method == "medusa" and not args.heads:
        parser.error(f"--method medusa needs --heads ({heads_hint})")
    if args.method == "draft" and not args.draft_model:
        parser.error("--method draft needs --draft-model")
    if args.draft_model and args.method != "draft":
        parser.error(f"--draft-model is used by --method draft only, not --method {args.method}; drop "
                     "--draft-model (it would load a second model for nothing) or use --method draft")
    if args.tree and args.method != "medusa":
        parser.error(f"--tree shapes the Medusa heads' candidates (--method medusa), not --method {args.method}; "
                     "drop --tree")
    if getattr(args, "acceptance", None) == "typical" and args.method == "autoregressive":
        # (and its top_p and top_k refusals turned away requests plain sampling applies them to)
        parser.error("--acceptance typical is a rule for accepting drafts (Medusa-2's), and --method autoregressive "
                     "drafts none: it samples plainly, top_p and top_k applied; drop --acceptance")
    if args.adaptive is False and args.method != "medusa":
        parser.error(f"--no-fallback keeps the Medusa tree (--method medusa), not --method {args.method}; "
                     "drop --no-fallback")
    for flag, value in (("--draft-tokens", args.draft_tokens), ("--layerskip-layers", args.layerskip_layers)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value}; leave it out for the default")
    if args.lookup_tokens < 0:
        parser.error(f"--lookup-tokens must be >= 0 (0 turns the grafted lookup off), got {args.lookup_tokens}")
    if getattr(args, "lookup_max_tokens", None) is not None:
        if args.lookup_max_tokens < 1:
            parser.error(f"--lookup-max-tokens must be at least 1, got {args.lookup_max_tokens}")
        if args.method != "medusa" or not args.lookup_tokens:
            instead = ("--draft-tokens bounds --method lookup's drafts" if args.method == "lookup" else
                       "add --lookup-tokens N (--method medusa) or drop it")
            parser.error(f"--lookup-max-tokens bounds the lookup chain --lookup-tokens grafts onto the Medusa tree: "
                         f"{instead}")
    if args.lookup_tokens and args.method != "medusa":
        instead = ("use --draft-tokens" if args.method in ("draft", "layerskip", "lookup") else
                   "drop --lookup-tokens, or use --method lookup (its drafts: --draft-tokens) or medusa")
        parser.error(f"--lookup-tokens grafts lookup onto the Medusa tree (--method medusa); with --method "
                     f"{args.method} {instead}")
    if getattr(args, "datastore", True) is False and not reads_datastore(args):
        parser.error(f"--no-datastore keeps lookup drafts (--method lookup, or medusa with --lookup-tokens) off the "
                     f"heads' datastore, and --method {args.method} drafts none: drop --no-datastore")
    if getattr(args, "datastore", True) is False and not args.heads:
        parser.error("--no-datastore leaves out the datastore of a heads folder (its datastore.safetensors), and "
                     "no --heads is given: drop --no-datastore")
    if args.method == "lookup" and getattr(args, "draft_tokens", None) is not None:
        args.lookup_max_tokens = args.draft_tokens  # with a cost profile: the longest draft its gate may choose
    # the proposer flags each method reads (medusa-serve has some of them only)
    readers = {"--draft-tokens": ("draft_tokens", ("draft", "layerskip", "lookup")),
               "--layerskip-layers": ("layerskip_layers", ("layerskip",)),
               "--draft-schedule": ("draft_schedule", ("draft", "layerskip")),
               "--lookup-max-ngram": ("lookup_max_ngram", ("lookup", "medusa")),
               "--lookup-min-ngram": ("lookup_min_ngram", ("lookup", "medusa"))}
    for flag, (name, methods) in readers.items():
        if getattr(args, name, None) is None:
            continue
        if args.method not in methods:
            parser.error(f"{flag} is read by --method {' / '.join(methods)}, not --method {args.method}; drop {flag}")
        if args.method == "medusa" and not args.lookup_tokens:
            parser.error(f"{flag} shapes the lookup chain that --lookup-tokens grafts onto the Medusa tree: add "
                         f"--lookup-tokens N or drop {flag}")


def check_loaded_flags(model, args: argparse.Namespace) -> None:
    """Refuse, once the heads are loaded, a flag they would leave unused: ``--lookup-max-tokens`` bounds the
    lookup chain a cost profile chooses, and heads without one graft chains of ``--lookup-tokens`` (shared by
    ``medusa-generate`` and ``medusa-serve``, as ``medusa-bench`` refuses it)."""
    from medusa_infer.proposers.lookup import model_cost

    if args.method == "medusa" and getattr(args, "lookup_max_tokens", None) is not None and model_cost(model) is None:
        raise ValueError(f"--lookup-max-tokens bounds the lookup chain a cost profile chooses, and the heads in "
                         f"{args.heads} carry no cost profile (not calibrated): the chain is --lookup-tokens "
                         f"{args.lookup_tokens} long; drop --lookup-max-tokens, or calibrate the heads "
                         "(medusa-bench --calibrate)")


def run_turn(model, args: argparse.Namespace, messages: list[dict] | None, prompt: str | None):
    from medusa_infer.decoding import stream

    proposer = build_proposer(args.method, model, args)
    chunks = stream(
        model,
        messages=messages,
        prompt=prompt,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        acceptance=args.acceptance,
        proposer=proposer,  # with --method medusa, built with --tree
        seed=args.seed,
    )
    for chunk in chunks:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    result = chunks.result()
    print(f"[{args.method}] {result.metrics.summary()}", file=sys.stderr)
    if result.finish_reasons[0] == "context":  # a shorter answer than asked, said only by a smaller count
        from medusa_infer.decoding import context_length

        print(f"[note] the answer stopped at the end of the model's context ({context_length(model)} tokens, "
              "prompt included)", file=sys.stderr)
    return result


def prompt_tokens(tokenizer, messages: list[dict] | None, prompt: str | None) -> int:
    """The tokens of a turn's prompt, as ``decoding.generate`` encodes ``messages=`` or ``prompt=``."""
    from medusa_infer.chat import chat_prompt_ids

    if messages is not None:
        return len(chat_prompt_ids(tokenizer, messages)[0])
    return len(tokenizer(prompt)["input_ids"])


def fit_history(model, history: list[dict], use_template: bool, answer_tokens: int) -> tuple[list[dict], int]:
    """``history`` less its oldest exchanges (after a system message; the last user turn stays), as few as
    leave room in the model's context for the next turn's prompt and ``answer_tokens`` (at most half the
    context) of its answer, and how many were left out; ``history`` itself is left as it is."""
    from medusa_infer.decoding import context_length

    limit = context_length(model)
    room = min(answer_tokens, limit // 2)  # (an answer of one token was all a trimmed chat left room for)
    first = int(bool(history) and history[0]["role"] == "system")
    kept, dropped = list(history), 0
    while len(kept) - first > 1 and turn_tokens(model, kept, use_template) + room > limit:
        del kept[first:first + 2]  # a user turn and its answer
        dropped += 1
    return kept, dropped


def turn_tokens(model, history: list[dict], use_template: bool) -> int:
    """The tokens of the prompt of the turn that ``history`` ends with (``--raw``: no system message)."""
    if use_template:
        return prompt_tokens(model.tokenizer, history, None)
    return prompt_tokens(model.tokenizer, None, raw_text(history))


def raw_text(history: list[dict]) -> str:
    """A conversation as one text for a model without a chat template (``--raw``): the model's answers
    continue the text they answer, and each later user line starts a new line."""
    return "".join(("\n" if i and m["role"] == "user" else "") + m["content"] for i, m in enumerate(history))


def continuation(tokenizer, text: str, tokens: Sequence[int]) -> str:
    """The text ``tokens`` add after ``text``, as it reads there: decoded alone, an answer can lose the
    space before its first word (SentencePiece's leading "▁", a word-level decoder's joining space), and
    the next turn would glue it to the prompt."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    before = tokenizer.decode(ids, skip_special_tokens=True)
    whole = tokenizer.decode(ids + list(tokens), skip_special_tokens=True)
    if whole.startswith(before):
        return whole[len(before):]
    return tokenizer.decode(list(tokens), skip_special_tokens=True)  # a tokenizer that respells its text


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``medusa-generate``; errors found once the model is loaded (heads that do not fit it, options it
    refuses) are reported as ``medusa-generate: error: ...`` with exit status 2, as argument errors are."""
    args = parse_args(argv)
    encoding = (getattr(sys.stdout, "encoding", None) or "utf-8").lower().replace("_", "-")
    if encoding not in ("utf-8", "utf8") and hasattr(sys.stdout, "reconfigure"):  # (a Windows console, a file in
        sys.stdout.reconfigure(errors="backslashreplace")  # cp1252: an emoji ended the answer with a codec error)
    try:
        return generate_from_args(args)
    except BrokenPipeError:  # the reader went away (`| head`): nothing left to say, and no one to say it to
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 1
    except (ValueError, OSError, NotImplementedError, RuntimeError) as error:  # NotImplementedError: an
        # unsupported model; RuntimeError: a default model that could not be fetched or whose cached copy is damaged
        sys.stdout.flush()
        print(f"medusa-generate: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: no traceback (in a chat it stops the answer; at the prompt, the chat)
        sys.stdout.flush()
        print(file=sys.stderr)
        return 130


def generate_from_args(args: argparse.Namespace) -> int:
    """Load the model and answer the prompt, or chat; ``ValueError`` for what the model refuses."""
    model = load(args)
    check_loaded_flags(model, args)
    if args.method == "draft":
        args.draft_model = as_draft_model(args.draft_model, target=model)  # loaded once, shared by the turns
    build_proposer(args.method, model, args)  # checks the options against the model
    tokenizer = model.tokenizer
    use_template = not args.raw and getattr(tokenizer, "chat_template", None) is not None
    if args.system is not None and not use_template:
        raise ValueError("--system goes into the chat template, and this model's tokenizer has none: drop --system "
                         "(or put it at the start of the prompt)")
    if use_template:  # a template that refuses a system role (Gemma 2's, Mistral-Instruct's), or wants one
        from medusa_infer.chat import check_conversation

        check_conversation(tokenizer, args.system, "--system", instead=" (or put it at the start of the prompt)")
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system is not None else []
    if not args.chat:
        if use_template:
            run_turn(model, args, history + [{"role": "user", "content": args.prompt}], None)
        else:
            run_turn(model, args, None, args.prompt)
        return 0
    from medusa_infer.decoding import context_length

    if hasattr(sys.stdin, "reconfigure") and getattr(sys.stdin, "errors", None) != "surrogateescape":
        try:  # bytes that are not UTF-8 arrive as lone surrogates, said per line (strict decoding ended the chat)
            sys.stdin.reconfigure(errors="surrogateescape")
        except (io.UnsupportedOperation, ValueError):  # read from already: left as it is
            pass
    if sys.stdin is None:  # (started with stdin closed, pythonw)
        raise ValueError("--chat reads its prompts from stdin, which is closed: give the prompt as an argument")
    interactive = sys.stdin.isatty()  # (piped lines: no "> " written into the answers)
    if interactive:  # line editing and history: without it the terminal read lines itself, arrow keys reached the
        try:  # model as escape codes and a pasted line was cut at 4095 characters
            import readline  # noqa: F401
        except ImportError:  # (Windows)
            pass
        if not sys.stdout.isatty():  # input() edits lines only where stdout is a terminal too
            print("[note] stdout is not a terminal (piped, as to tee): no line editing, and a line longer than 4095 "
                  "characters is cut", file=sys.stderr)
    first = True
    while True:
        try:
            line = input("> " if interactive else "").strip()
        except EOFError:  # Ctrl-D: the shell's prompt on a line of its own
            if interactive:
                print()
            break
        if first:  # a file saved by Notepad or PowerShell starts with a byte order mark, which is no text of its
            line, first = line.removeprefix("\ufeff").strip(), False
        if not line:
            if not interactive:  # a prompts file with blank lines between prompts: the rest was left unread, unsaid
                print("[note] the chat ended at an empty line (an empty line or the input's end ends it)",
                      file=sys.stderr)
            break
        if not is_text(line):
            print(f"medusa-generate: error: that line is not UTF-8 text ({ascii(line)[:60]}); it was left out, the "
                  "conversation kept", file=sys.stderr)
            continue
        try:
            # the session ended with "does not fit the model's context" once the conversation outgrew it
            turn, dropped = fit_history(model, history + [{"role": "user", "content": line}], use_template,
                                        args.max_new_tokens)
            text = None if use_template else raw_text(turn)
            if dropped and turn_tokens(model, turn, use_template) < context_length(model):
                print(f"[note] the conversation outgrew the model's context ({context_length(model)} tokens): its "
                      f"{dropped} oldest exchange{'s' if dropped > 1 else ''} left out", file=sys.stderr)
            result = run_turn(model, args, turn if use_template else None, text)
        except KeyboardInterrupt:  # Ctrl-C while it answers: that answer stops, the chat goes on without it
            sys.stdout.write("\n")
            sys.stdout.flush()
            print("[interrupted: that answer was left out, the conversation kept]", file=sys.stderr)
            continue
        except ValueError as error:  # this turn's own (a line longer than the context): the chat goes on as it was
            sys.stdout.flush()
            print(f"medusa-generate: error: {error}; that line was left out, the conversation kept", file=sys.stderr)
            continue
        answer = tokenizer.decode(result.new_tokens[0], skip_special_tokens=True) if use_template else \
            continuation(tokenizer, text, result.new_tokens[0])
        history[:] = turn + [{"role": "assistant", "content": answer}]
    return 0


if __name__ == "__main__":
    sys.exit(main())
