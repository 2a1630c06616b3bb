"""Lookup drafts with and without the heads' datastore, interleaved question by question.

For every question each method answers every turn twice, once searching the heads' datastore
(``datastore.safetensors``) and once not, in alternating order, so both runs share the machine's
conditions. Prints tokens/s and tau of each, the speed ratio, and whether the answers are identical
(they must be: greedy decoding is exact either way).

    python scripts/bench_datastore.py --heads runs/demo/heads --limit 26
    python scripts/bench_datastore.py --heads runs/heads-large-ds --limit 80 --output docs/datastore/large.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from medusa_infer.interop import base_model_name
from medusa_infer.model import MedusaModel
from medusa_infer.models import load_base_model, load_tokenizer
from medusa_train import benchmark as bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", required=True, help="heads folder with a datastore.safetensors")
    parser.add_argument("--questions", default="data/specbench.jsonl")
    parser.add_argument("--limit", type=int, default=26)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--methods", default="lookup,medusa-lookup")
    parser.add_argument("--output", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    unread = [m for m in args.methods.split(",") if m.strip() not in ("lookup", "medusa-lookup")]
    if unread:  # (their with/without ratio was noise, reported as the store's effect)
        parser.error(f"--methods {','.join(unread)} never search the datastore: give lookup and/or medusa-lookup")

    bench_args = bench.parse_args(["--heads", args.heads, "--questions", args.questions, "--limit", str(args.limit),
                                   "--max-new-tokens", str(args.max_new_tokens), "--methods", args.methods])
    try:
        name = base_model_name(args.heads)  # (a FasterDecoding folder's too, as medusa-bench reads it)
    except ValueError as err:  # (no folder, no config.json: a traceback)
        parser.error(str(err))
    if not name:
        parser.error(f"{args.heads}/config.json names no base model (base_model_name_or_path)")
    model = MedusaModel.from_pretrained(args.heads, base_model=load_base_model(name), tokenizer=load_tokenizer(name))
    if model.datastore is None:
        parser.error(f"{args.heads} has no datastore.safetensors; build one with `python -m medusa_train.datastore`")
    runner = bench.Runner(model, bench_args)
    questions = bench.load_questions(args.questions, args.limit)
    for use in (True, False):  # untimed, as medusa-bench: the first pass through the CPU kernels, the store's
        bench_args.datastore = use  # index (about 1.9 s and 0.2 s on 2 cores) landed on the first turn timed
        bench.warm_up(runner, bench_args.methods, questions, 1)
    variants = [(m, use) for m in bench_args.methods for use in (True, False)]
    totals = {v: bench.MethodTotals() for v in variants}
    answers: dict[tuple[str, bool], list[list[int]]] = {v: [] for v in variants}
    for number, question in enumerate(questions):
        for method, use in variants if number % 2 == 0 else variants[::-1]:
            bench_args.datastore = use  # read by the runner each call
            conversation: list[dict] = []
            for turn_text in question["turns"]:
                conversation.append({"role": "user", "content": turn_text})
                turn = runner.run(method, conversation)
                totals[method, use].add(turn)
                answers[method, use].append(turn.tokens)
                conversation.append({"role": "assistant",
                                     "content": runner.tokenizer.decode(turn.tokens, skip_special_tokens=True)})
        print(f"question {number + 1}/{len(questions)}", file=sys.stderr, flush=True)
    results = {}
    print(f"{len(model.datastore)} datastore tokens; {len(questions)} questions, at most {args.max_new_tokens} "
          "new tokens a turn\n")
    print("| method | tokens/s with | tokens/s without | ratio | tau with | tau without | identical |")
    print("|---|---|---|---|---|---|---|")
    for method in bench_args.methods:
        on, off = totals[method, True].summary(None), totals[method, False].summary(None)
        ratio = on["tokens_per_s"] / off["tokens_per_s"]
        same = answers[method, True] == answers[method, False]
        results[method] = {"with": on, "without": off, "ratio": round(ratio, 3), "identical": same}
        print(f"| {method} | {on['tokens_per_s']:.2f} | {off['tokens_per_s']:.2f} | {ratio:.3f} | {bench._tau(on['tau'])} | "
              f"{bench._tau(off['tau'])} | {'yes' if same else 'NO'} |")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"heads": args.heads, "datastore_tokens": len(model.datastore),
                                                 "questions": len(questions), "max_new_tokens": args.max_new_tokens,
                                                 "methods": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
