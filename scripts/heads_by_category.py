"""Where heads fall short: their accuracy per question category on the model's own greedy answers.

For each category of a Spec-Bench-format file, on the base model's greedy answers to the first turns
(as ``medusa-bench --calibrate`` measures the heads, and training's held-out evaluation): each head's
top-1 accuracy, and the share of the answers' tokens the heads' vocabulary holds (with
``reduced_vocab_size`` a token outside it is one no head can propose). Several heads folders for the
same base model are measured on the same answers, which are generated once::

    python scripts/heads_by_category.py --heads runs/a/heads runs/b/heads \\
        --questions data/specbench.jsonl --limit 40 --max-new-tokens 64 --output runs/by-category.json

The JSON holds ``{heads folder: {category: {"top1": [head 1, ...], "in_head_vocab": share,
"tokens": answer tokens}}}``, with an ``"all"`` row over every category; a table is printed.
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
        accuracy = head_topk_accuracy(model, grouped[category], top_k=1)
        tokens = torch.cat([seq[start:] for seq, start in grouped[category]])
        inside = int(torch.isin(tokens, token_map.to(tokens.device)).sum()) if token_map is not None else len(tokens)
        rows[category] = _row(accuracy, inside, len(tokens))
        hits = accuracy.hits if hits is None else hits + accuracy.hits
        totals = accuracy.totals if totals is None else totals + accuracy.totals
        held, covered = held + len(tokens), covered + inside
    if hits is None:
        raise ValueError("no answers to measure the heads on")
    rows["all"] = _row(HeadAccuracy(hits, totals, torch.empty(0, len(totals))), covered, held)
    return rows


def _row(accuracy: HeadAccuracy, inside: int, tokens: int) -> dict[str, Any]:
    return {"top1": [round(row[0], 3) for row in accuracy.topk()],
            "in_head_vocab": round(inside / max(tokens, 1), 3), "tokens": tokens}


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Markdown: a row per category, per heads folder its head-1 top-1 and in-vocabulary share."""
    names = list(results)
    categories = list(next(iter(results.values())))
    lines = ["| category | " + " | ".join(f"{n}: head 1 top-1, in vocab" for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for category in categories:
        cells = [f"{r[category]['top1'][0]:.3f}, {r[category]['in_head_vocab']:.3f}" for r in results.values()]
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", nargs="+", required=True, help="heads folders of one base model")
    parser.add_argument("--questions", type=Path, required=True, help="Spec-Bench-format JSONL")
    parser.add_argument("--limit", type=int, default=None, help="questions, balanced across categories")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--output", type=Path, help="JSON file for the results")
    args = parser.parse_args(argv)
    from medusa_infer.model import MedusaModel
    from medusa_infer.models import load_base_model, load_tokenizer

    configs = [json.loads((Path(h) / "config.json").read_text()) for h in args.heads]
    bases = {c.get("base_model_name_or_path") for c in configs}
    if len(bases) != 1 or None in bases:
        parser.error(f"the heads must name one base model (base_model_name_or_path); they name {sorted(map(str, bases))}")
    base_name = bases.pop()
    base, tokenizer = load_base_model(base_name, dtype=torch.float32), load_tokenizer(base_name)
    questions = load_questions(args.questions, args.limit)
    answers = None
    results = {}
    for heads in args.heads:
        model = MedusaModel.from_pretrained(heads, base_model=base, tokenizer=tokenizer)
        if answers is None:
            answers = first_turn_answers(model, questions, args.max_new_tokens)
        results[heads] = accuracy_by_category(model, [q["category"] for q in questions], answers)
    print(table(results))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
