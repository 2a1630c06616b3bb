"""Build the datastore that lookup drafts search (``medusa_infer.datastore``) from distilled data.

``train_heads.py`` writes one into the heads folder from the training split's conversations (the
prompts and the model's own answers). This command adds or replaces it for existing heads:

    python -m medusa_train.datastore --heads runs/demo/heads --rows runs/demo/data/distilled.jsonl

Ready examples (``input_ids`` and ``labels`` per line, a recipe's ``data.tokenized``) are stored as they are,
cut to the maximum length as training cuts them.

The conversations are rendered as training rendered them: the chat template, system prompt and
maximum length default to those of the recipe recorded in the heads' config, and distilled rows
that record another template or system prompt are refused (their tokens would not be the text
decoding sees). ``--chat-template ''`` selects the tokenizer's own template and
``--system-prompt ''`` no system prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from medusa_infer.checkpoint import note_datastore
from medusa_infer.datastore import DATASTORE_NAME, Datastore, tokenizer_digest, tokenizer_ids
from medusa_train.dataset import check_rows  # noqa: F401  (also this command's: the tests import it from here)


def build_datastore(examples: Iterable[Mapping[str, Any]], tokenizer: Any = None) -> Datastore:
    """A store of the examples' whole conversations (``input_ids``: template, prompt and answer); with the
    ``tokenizer`` they were made with, the store records it (``tokenizer_digest``), and loading it with
    heads on a model of another tokenizer is refused."""
    digest = tokenizer_digest(tokenizer) if tokenizer is not None else None
    size = tokenizer_ids(tokenizer) if tokenizer is not None else None
    store = Datastore.from_sequences((list(e["input_ids"]) for e in examples), tokenizer=digest, tokenizer_size=size)
    if not len(store):
        raise ValueError("no tokens to build a datastore from: the examples are empty")
    return store


def main(argv: Sequence[str] | None = None) -> int:
    """Build the datastore; Ctrl-C ends with a line, not a traceback (exit status 130)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\npython -m medusa_train.datastore: interrupted; run it again to build the datastore",
              file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m medusa_train.datastore", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", required=True, help="the heads folder to write datastore.safetensors into")
    parser.add_argument("--rows", required=True, nargs="+",
                        help="distilled JSONL files (prompt and response, or messages, per line), ready examples "
                             "(input_ids and labels per line, as data.tokenized) or datasets folders")
    parser.add_argument("--model", help="the model whose tokenizer and chat template to use "
                                        "(default: the heads' base_model_name_or_path)")
    parser.add_argument("--chat-template", metavar="FILE",
                        help="a jinja chat template replacing the tokenizer's ('': the tokenizer's own; "
                             "default: the heads' own, recorded in their config)")
    parser.add_argument("--max-length", type=int,
                        help="longer conversations are cut, in tokens (default: the heads' recipe's, else 1024)")
    parser.add_argument("--system-prompt", help="the system prompt the rows were distilled with ('': none; "
                                                "default: the heads' recipe's)")
    parser.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=None,
                        help="load a tokenizer that runs its repository's code (default: the heads' recipe's "
                             "model.trust_remote_code)")
    args = parser.parse_args(argv)
    if args.max_length is not None and args.max_length < 2:
        parser.error(f"--max-length must be at least 2 tokens, got {args.max_length}")

    from jinja2 import TemplateError

    from medusa_infer.checkpoint import foreign_config
    from medusa_infer.interop import base_model_name
    from medusa_infer.models import load_tokenizer
    from medusa_train.dataset import CLI_TEMPLATE_FIXES, BuildStats, build_examples, read_rows, truncate_examples

    heads = Path(args.heads)
    if not (heads / "config.json").is_file():
        parser.error(f"{heads} has no config.json: not a heads folder")
    # read as JSON: FasterDecoding-layout heads (medusa_num_heads, ...) have a config.json too
    try:
        config = json.loads((heads / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        parser.error(f"{heads}/config.json cannot be read as JSON ({err}): re-save or re-export the heads")
    other = foreign_config(heads, "medusa-forge") if foreign_config(heads, "FasterDecoding") else None
    if other is not None:  # (a model's config may hold num_heads too: GPT-Neo's)
        parser.error(f"{heads} holds {other}, not heads: pass the folder the heads were saved in (the base model "
                     "goes to --model)")
    # as from_pretrained names it: an export of a default model records it beside the Hub id
    model = args.model or base_model_name(heads)
    if not model:
        parser.error(f"{heads}/config.json names no base model; pass --model")
    recipe = (config.get("training") or {}).get("recipe") or {}
    recipe_model, recipe_data = recipe.get("model") or {}, recipe.get("data") or {}
    if args.chat_template is not None:
        try:
            chat_template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
        except (OSError, UnicodeDecodeError) as err:
            parser.error(f"--chat-template {args.chat_template}: {err}")
    else:
        chat_template = config.get("chat_template") or recipe_model.get("chat_template")  # older folders: the recipe's
    if args.system_prompt is not None:
        system_prompt = args.system_prompt or None
    else:
        system_prompt = recipe_data.get("system_prompt")
    max_length = args.max_length if args.max_length is not None else recipe_data.get("max_length") or 1024
    remote = args.trust_remote_code if args.trust_remote_code is not None else bool(
        recipe_model.get("trust_remote_code"))
    stats = BuildStats()
    try:  # a missing or bad rows file, a tokenizer that does not load, a template that fails: the message alone
        rows = [row for path in args.rows for row in read_rows(path)]
        ready = [isinstance(row, dict) and "input_ids" in row and not {"messages", "prompt", "conversations"} & set(row)
                 for row in rows]
        if any(ready):
            if not all(ready):
                raise ValueError(f"{' '.join(args.rows)} mix ready examples (input_ids; row {ready.index(True) + 1}) "
                                 f"with conversations (row {ready.index(False) + 1}): give one kind")
            for flag, given in (("--chat-template", args.chat_template), ("--system-prompt", args.system_prompt)):
                if given is not None:  # the examples' text was rendered when they were tokenised
                    raise ValueError(f"{flag} renders conversations, and {' '.join(args.rows)} hold ready examples "
                                     f"(input_ids), stored as they are: drop {flag}")
            examples, stats.truncated, stats.dropped_too_long = truncate_examples(rows, max_length)
        else:
            check_rows(rows, chat_template, system_prompt)
        tokenizer = load_tokenizer(model, trust_remote_code=remote)
        if not any(ready):
            if chat_template:
                tokenizer.chat_template = chat_template
            examples = build_examples(rows, tokenizer, max_length, system_prompt, stats, CLI_TEMPLATE_FIXES)
    except (OSError, ValueError, TemplateError) as err:
        parser.error(str(err))
    if not examples:
        parser.error(f"no conversation to build a datastore from: {len(rows)} rows in {' '.join(args.rows)}: "
                     f"{', '.join(stats.left_out('--max-length', max_length)) or 'none given'}")
    store = build_datastore(examples, tokenizer)
    # a store the heads' model would refuse at load (another tokenizer's ids) would replace a working one: refused
    # before writing (--model names the tokenizer to build with; the heads' config the model they decode with)
    named = base_model_name(heads)
    try:
        if args.model and named and named != args.model:
            try:
                own = load_tokenizer(named, trust_remote_code=remote)
            except (OSError, ValueError):  # (offline, a Hub id not downloaded: not compared)
                own = None
            store.check_tokenizer(own, f"the store built with --model {args.model}'s tokenizer", "")
        if isinstance(config.get("vocab_size"), int):
            store.check_vocabulary(config["vocab_size"], f"the store built with {model}'s tokenizer", "")
    except ValueError as err:  # (this command's own fix: a load's advice, to rebuild or leave it unread, is not it)
        if args.model:
            parser.error(f"{err} (the heads decode with {named or 'their base model'}; drop --model or give that "
                         "model's tokenizer; nothing was written)")
        # (the tokenizer built with is the one the heads' config names: that name is what is wrong)
        parser.error(f"{err} (the heads' config.json names {named or 'no base model'} as their base model, whose "
                     "tokenizer goes past the heads' vocabulary: correct base_model_name_or_path there, or give "
                     "--model, the model the heads were trained on; nothing was written)")
    store.origin = ("written by `python -m medusa_train.datastore` from the "
                    + ("ready examples" if any(ready) else "conversations") + " in "
                    + ", ".join(Path(p).name for p in args.rows))
    path = store.save(heads / DATASTORE_NAME)
    note_datastore(heads, len(store), store.origin)
    left_out = stats.left_out("--max-length", max_length)  # cut or dropped rows were not said
    print(f"{path}: {len(store)} tokens from {len(examples)} conversations of {len(rows)} rows"
          + (f" ({', '.join(left_out)})" if left_out else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
