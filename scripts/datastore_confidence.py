"""How often the heads' datastore drafts are right, by matched n-gram length and confidence class.

The model answers the first turn of each question greedily; then, at every position of each answer,
the store is searched with the text so far (prompt and answer) as decoding would, and its draft is
compared with what the model actually wrote next. Prints, per ``(n, confidence)`` key of the
lookup gate (``DatastoreMatch.confidence``): drafts, the share whose first token was right, and the
tokens accepted per draft (a chain is accepted up to its first wrong token).

    python scripts/datastore_confidence.py --heads runs/heads-large-ds --limit 80
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

from medusa_infer.model import MedusaModel
from medusa_infer.models import load_base_model, load_tokenizer
from medusa_infer.proposers.lookup import LOOKUP_MAX_TOKENS, accepted_prefix
from medusa_train.benchmark import first_turn_answers, load_questions

CLASSES = ("single", "low", "mid", "high")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", required=True, help="heads folder with a datastore.safetensors")
    parser.add_argument("--questions", default="data/specbench.jsonl")
    parser.add_argument("--limit", type=int, default=80)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft-tokens", type=int, default=LOOKUP_MAX_TOKENS)
    args = parser.parse_args(argv)

    from medusa_infer.interop import base_model_name  # (an export's medusa_forge_base_model: the model loaded)

    name = base_model_name(args.heads)
    model = MedusaModel.from_pretrained(args.heads, base_model=load_base_model(name), tokenizer=load_tokenizer(name))
    store = model.datastore
    if store is None:
        parser.error(f"{args.heads} has no datastore.safetensors; build one with `python -m medusa_train.datastore`")
    stats: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0, 0])  # drafts, first right, accepted
    questions = load_questions(args.questions, args.limit)
    for answered, start in first_turn_answers(model, questions, args.max_new_tokens):
        sequence = answered.tolist()
        for t in range(start, len(sequence) - 1):  # the text so far ends at t; what follows is known
            match = store.match(sequence[: t + 1], args.draft_tokens)
            if match.draft:
                # accepted_prefix reads its second argument as committed tokens plus a bonus token
                right = accepted_prefix(match.draft, sequence[t + 1 :] + [-1])
                row = stats[match.n, match.confidence()]
                row[0] += 1
                row[1] += right > 0
                row[2] += right
    print(f"{len(store)} datastore tokens; greedy answers to the first turns of {len(questions)} questions, "
          f"at most {args.max_new_tokens} tokens\n")
    print("| n | confidence | drafts | first token right | tokens accepted per draft |")
    print("|---|---|---|---|---|")
    for n in range(store.max_ngram, store.min_ngram - 1, -1):
        for confidence in CLASSES:
            drafts, first, accepted = stats.get((n, confidence), (0, 0, 0))
            if drafts:
                print(f"| {n} | {confidence} | {drafts} | {first / drafts:.2f} | {accepted / drafts:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
