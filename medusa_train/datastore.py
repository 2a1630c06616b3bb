"""Build the datastore that lookup drafts search (``medusa_infer.datastore``) from distilled data.

``train_heads.py`` writes one into the heads folder from the training split's conversations (the
prompts and the model's own answers). This command adds or replaces it for existing heads:

    python -m medusa_train.datastore --heads runs/demo/heads --rows runs/demo/data/distilled.jsonl
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from medusa_infer.datastore import DATASTORE_NAME, Datastore


def build_datastore(examples: Iterable[Mapping[str, Any]]) -> Datastore:
    """A store of the examples' whole conversations (``input_ids``: template, prompt and answer)."""
    store = Datastore.from_sequences(list(e["input_ids"]) for e in examples)
    if not len(store):
        raise ValueError("no tokens to build a datastore from: the examples are empty")
    return store


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", required=True, help="the heads folder to write datastore.safetensors into")
    parser.add_argument("--rows", required=True, nargs="+",
                        help="distilled JSONL files (prompt and response per line) or datasets folders")
    parser.add_argument("--model", help="the model whose tokenizer and chat template to use "
                                        "(default: the heads' base_model_name_or_path)")
    parser.add_argument("--max-length", type=int, default=1024, help="longer conversations are cut (tokens)")
    parser.add_argument("--system-prompt", help="the system prompt the rows were distilled with, if any")
    args = parser.parse_args(argv)

    from medusa_infer.config import MedusaConfig
    from medusa_infer.models import load_tokenizer
    from medusa_train.dataset import build_examples, read_rows

    heads = Path(args.heads)
    if not (heads / "config.json").is_file():
        parser.error(f"{heads} has no config.json: not a heads folder")
    model = args.model or MedusaConfig.load(heads / "config.json").base_model_name_or_path
    if not model:
        parser.error(f"{heads}/config.json names no base model; pass --model")
    rows = [row for path in args.rows for row in read_rows(path)]
    examples = build_examples(rows, load_tokenizer(model), args.max_length, args.system_prompt)
    store = build_datastore(examples)
    path = store.save(heads / DATASTORE_NAME)
    print(f"{path}: {len(store)} tokens from {len(examples)} conversations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
