"""Where heads fall short: their accuracy per question category on the model's own greedy answers.

For each category of a Spec-Bench-format file, on the base model's greedy answers to the first turns
(as ``medusa-bench --calibrate`` measures the heads, and training's held-out evaluation): each head's
top-1 accuracy, and the share of the answers' tokens the heads' vocabulary holds (with
``reduced_vocab_size`` a token outside it is one no head can propose). Several heads folders for the
same base model are measured on the same answers, which are generated once::

    python scripts/heads_by_category.py --heads runs/a/heads runs/b/heads \\
        --questions data/specbench.jsonl --limit 40 --max-new-tokens 64 --output runs/by-category.json

The JSON holds ``{heads folder: {category: {"top1": [head 1, ...], "scored": [head 1, ...],
"in_head_vocab": share, "tokens": n}}}``, with an ``"all"`` row over every category; a table is
printed. ``scored`` counts the positions each head was scored on (``top1`` is null where none);
``tokens`` counts the answer tokens after the first, the ones a head is ever asked to propose (the
first comes from the prompt's own logits), and ``in_head_vocab`` is their share in the heads'
vocabulary.

All folders share one base model. A Medusa-2 folder (one with a LoRA adapter) merges its adapter
into it, so it is measured alone (answers and heads on the merged model, as decoding runs them) and
refused beside others.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import torch

from medusa_train.benchmark import first_turn_answers, head_topk_accuracy, load_questions
from medusa_train.evaluate import HeadAccuracy


def accuracy_by_category(model, categories: Sequence[str], answers: Sequence[tuple[torch.Tensor, int]]
                         ) -> dict[str, dict[str, Any]]:
    """``{category: {"top1", "in_head_vocab", "tokens"}}`` and ``"all"`` for ``model``'s heads on
    ``answers`` (``(prompt and answer ids, prompt length)``, one per entry of ``categories``)."""
    if len(categories) != len(answers):
        raise ValueError(f"{len(categories)} categories for {len(answers)} answers: give one per answer")
    token_map = model.heads.token_map
    grouped: dict[str, list[tuple[torch.Tensor, int]]] = defaultdict(list)
    for category, answer in zip(categories, answers):
        grouped[category].append(answer)
    rows: dict[str, dict[str, Any]] = {}
    hits = totals = None
    held = covered = 0
    for category in sorted(grouped):
        # the first answer token comes from the prompt's logits: heads propose from the second on
        tokens = torch.cat([seq[start + 1:] for seq, start in grouped[category]])
        inside = int(torch.isin(tokens, token_map.to(tokens.device)).sum()) if token_map is not None else len(tokens)
        if not len(tokens):  # answers of one token: nothing for a head to propose
            rows[category] = {"top1": [None] * model.config.num_heads, "scored": [0] * model.config.num_heads,
                              "in_head_vocab": None, "tokens": 0}
            continue
        accuracy = head_topk_accuracy(model, grouped[category], top_k=1)
        rows[category] = _row(accuracy, inside, len(tokens))
        hits = accuracy.hits if hits is None else hits + accuracy.hits
        totals = accuracy.totals if totals is None else totals + accuracy.totals
        held, covered = held + len(tokens), covered + inside
    if hits is None:
        raise ValueError("no answer of two tokens or more to measure the heads on: raise --max-new-tokens")
    rows["all"] = _row(HeadAccuracy(hits, totals, torch.empty(0, len(totals))), covered, held)
    return rows


def _row(accuracy: HeadAccuracy, inside: int, tokens: int) -> dict[str, Any]:
    scored = [int(n) for n in accuracy.totals]
    return {"top1": [round(row[0], 3) if n else None for row, n in zip(accuracy.topk(), scored)],
            "scored": scored, "in_head_vocab": round(inside / tokens, 3), "tokens": tokens}


def _cell(row: dict[str, Any]) -> str:
    top1, share = row["top1"][0], row["in_head_vocab"]
    return "-" if top1 is None else f"{top1:.3f}, {share:.3f}"


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Markdown: a row per category, per heads folder its head-1 top-1 and in-vocabulary share."""
    names = list(results)
    categories = list(next(iter(results.values())))
    lines = ["| category | " + " | ".join(f"{n}: head 1 top-1, in vocab" for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for category in categories:
        cells = [_cell(r[category]) for r in results.values()]
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", nargs="+", required=True, help="heads folders of one base model")
    parser.add_argument("--questions", type=Path, required=True, help="Spec-Bench-format JSONL")
    parser.add_argument("--limit", type=int, default=None, help="questions, balanced across categories")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model", help="the base model (default: the one the heads' config names)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--output", type=Path, help="JSON file for the results")
    args = parser.parse_args(argv)
    from medusa_infer.checkpoint import ADAPTER_DIR
    from medusa_infer.model import MedusaModel, heads_folder
    from medusa_infer.models import load_base_model, load_tokenizer

    folders = [heads_folder(h) for h in args.heads]  # a folder, or a Hub repo as from_pretrained takes it
    for folder in folders:
        if len(folders) > 1 and (folder / ADAPTER_DIR).is_dir():
            parser.error(f"{folder} holds a LoRA adapter (Medusa-2), which would change the base model the "
                         "other heads are measured on: give it alone to --heads")
    from medusa_infer.interop import base_model_name  # (an export's medusa_forge_base_model: the model loaded)

    bases = {base_model_name(f) for f in folders}
    base_name = args.model or (bases.pop() if len(bases) == 1 else None)
    if not base_name:
        parser.error(f"the heads name {sorted(map(str, bases))} as base_model_name_or_path, not one model: "
                     "pass --model NAME (the heads must all be for that model)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    base = load_base_model(base_name, dtype=getattr(torch, args.dtype), device=device)
    tokenizer = load_tokenizer(base_name)
    questions = load_questions(args.questions, args.limit)
    answers = None
    results = {}
    # one base model for every folder: the hidden states are the same, only the heads differ
    for name, folder in zip(args.heads, folders):
        model = MedusaModel.from_pretrained(folder, base_model=base, tokenizer=tokenizer)
        if answers is None:
            answers = first_turn_answers(model, questions, args.max_new_tokens)
        results[name] = accuracy_by_category(model, [q["category"] for q in questions], answers)
    print(table(results))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
