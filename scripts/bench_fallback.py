"""The adaptive fallback against the heads' fixed tree and plain decoding, interleaved question by question.

    python scripts/bench_fallback.py --heads runs/demo/heads --limit 10
    python scripts/bench_fallback.py --heads runs/demo/heads --questions-from rest --limit 40 --tree-nodes 16
    python scripts/bench_fallback.py --heads runs/demo/heads --ids 317,295,288 --methods ar,adaptive,one-context

For each question (first turns of Spec-Bench-format questions, by default the ones (up to
``--limit``) that ``medusa-bench --calibrate`` measured the heads on, as the heads record them (or
``<heads>/../calibration.json`` names them), else the first ``--limit`` of the file; ``--questions-from rest``: ``--limit`` of
the others, balanced across categories as ``medusa-bench`` samples them),
it answers greedily four ways, one after the other: plain decoding (our loop, ``ar``), the tree
with the adaptive fallback choosing by the calibration's cost profile alone (``adaptive``), the
same learning step costs with one ``StepCosts`` kept across all questions (``learned``, what
``medusa-bench`` runs), and the tree without the fallback (``fixed``), the order rotated by one
method each question so that none always runs first (on a warm or a cold cache). ``--methods``
chooses among them and ``one-context``: ``adaptive`` with the profile's long-context measurement
left out, every step priced at the profile's own context, as heads calibrated before that measurement
are (on long prompts, such as Spec-Bench's summarization questions, trees then look cheaper than they
are). The tree is the
heads' stored one, or with ``--tree-nodes N`` the best N-node tree under their calibrated
acceptance, whose sub-trees the fallback then chooses among; ``--lookup-tokens`` grafts a
prompt-lookup chain onto it (``medusa-lookup``). It prints tokens per step (tau, bonus included),
seconds and the speed ratios, per question and in all, the step costs learned, and checks that
the answers are identical. ``plain steps``: the share of steps that verified the root alone.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from medusa_infer.adaptive import StepCosts
from medusa_infer.decoding import generate
from medusa_infer.model import MedusaModel
from medusa_infer.proposers import AutoregressiveProposer
from medusa_infer.trees import greedy_tree
from medusa_train.benchmark import calibration_question_ids, load_questions, read_questions

METHODS = ("ar", "adaptive", "one-context", "learned", "fixed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", required=True)
    parser.add_argument("--questions", default="data/specbench.jsonl")
    parser.add_argument("--ids", default=None, help="comma-separated question ids (default: see above)")
    parser.add_argument("--questions-from", default="calibration", choices=("calibration", "rest"),
                        help="without --ids: the calibration's questions, or the file's other questions")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tree-nodes", type=int, default=None,
                        help="the best tree of this many nodes under the calibrated acceptance "
                             "(default: the stored tree)")
    parser.add_argument("--lookup-tokens", type=int, default=0, help="graft a prompt-lookup chain (medusa-lookup)")
    parser.add_argument("--methods", default="ar,adaptive,learned,fixed",
                        help=f"comma-separated, from {', '.join(METHODS)} (ar is always run: speeds are against it)")
    args = parser.parse_args()
    methods = ["ar"] + [m for m in dict.fromkeys(args.methods.split(",")) if m != "ar"]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    try:  # (a traceback once the model was loaded)
        ids = [int(i) for i in args.ids.split(",")] if args.ids else None
    except ValueError:
        parser.error(f"--ids takes comma-separated whole numbers (question ids), got {args.ids!r}")
    model = MedusaModel.from_pretrained(args.heads)
    # the calibration's questions: as the heads record them (medusa-bench --calibrate), else as its report names them
    calibration = Path(args.heads).parent / "calibration.json"
    calibrated = calibration_question_ids(model, args.questions) or (
        json.loads(calibration.read_text())["question_ids"] if calibration.is_file() else [])
    if args.questions_from == "rest" and not args.ids and not calibrated:
        raise SystemExit(f"--questions-from rest leaves out the calibration's questions, which neither the heads "
                         f"nor {calibration} name; calibrate the heads with medusa-bench --calibrate or pass --ids")
    if args.tree_nodes is not None and model.config.acceptance_model() is None:
        raise SystemExit(f"--tree-nodes fits a tree to the heads' measured accuracies, which {args.heads} does not "
                         "hold: calibrate the heads (medusa-bench --calibrate) or leave --tree-nodes out")
    if not (model.config.head_accuracies and model.config.cost_profile):  # (a traceback at the first warm-up answer)
        raise SystemExit(f"the fallback methods need the heads' measured accuracies and cost profile, which "
                         f"{args.heads} does not hold: calibrate the heads (medusa-bench --calibrate) first")
    profile = model.config.cost_profile
    if "one-context" in methods and "longer" not in profile:
        raise SystemExit(f"one-context leaves out the cost profile's long-context measurement, which {args.heads}'s "
                         "does not hold: calibrate the heads again (medusa-bench --calibrate), or drop one-context")
    one_context = {key: value for key, value in profile.items() if key != "longer"}
    tree = None if args.tree_nodes is None else greedy_tree(model.config.acceptance_model(), args.tree_nodes)
    step_costs = StepCosts()
    questions = read_questions(args.questions)  # (checked, as medusa-bench reads them)
    if ids is not None:
        wanted = ids
    elif calibrated and args.questions_from == "calibration":
        wanted = calibrated
    elif calibrated:  # the others, balanced across categories as medusa-bench takes them
        wanted = [q["id"] for q in load_questions(args.questions, args.limit, exclude_ids=calibrated)]
    else:
        wanted = [q["id"] for q in questions]
    chosen = [q for q in questions if q["id"] in wanted][: args.limit]
    if not chosen:
        raise SystemExit(f"no question of {args.questions} is chosen (ids {wanted[:10]}): check --ids, --limit "
                         "and --questions-from")
    totals = {m: {"step_tokens": 0, "row_steps": 0, "steps": 0, "plain": 0, "seconds": 0.0} for m in methods}

    def answer(method: str, messages: list[dict], max_new_tokens: int, costs: StepCosts):
        settings = {"proposer": AutoregressiveProposer(model)} if method == "ar" else {
            "adaptive": method != "fixed", "tree": tree, "lookup_tokens": args.lookup_tokens,
            "step_costs": costs if method == "learned" else None}
        model.config.cost_profile = one_context if method == "one-context" else profile
        try:
            with torch.inference_mode():
                return generate(model, messages=messages, max_new_tokens=max_new_tokens, **settings)
        finally:
            model.config.cost_profile = profile

    for method in methods if chosen else ():  # untimed, as medusa-bench: the first pass through the CPU kernels
        # (about 1.9 s on 2 cores) landed on the first question's first method, ar, and raised every speed against it
        answer(method, [{"role": "user", "content": chosen[0]["turns"][0]}], 8, StepCosts())
    for index, question in enumerate(chosen):
        messages = [{"role": "user", "content": question["turns"][0]}]
        answers, line = {}, {}
        shift = index % len(methods)
        for method in methods[shift:] + methods[:shift]:
            start = time.perf_counter()
            out = answer(method, messages, args.max_new_tokens, step_costs)
            seconds = time.perf_counter() - start
            answers[method] = out.sequences[0].tolist()
            metrics = out.metrics
            for name, value in (("step_tokens", metrics.step_tokens), ("row_steps", metrics.row_steps),
                                ("steps", metrics.steps), ("plain", metrics.plain_steps), ("seconds", seconds)):
                totals[method][name] += value
            line[method] = (metrics.step_tokens / max(metrics.row_steps, 1), seconds)
        if len({tuple(a) for a in answers.values()}) != 1:
            raise SystemExit(f"question {question['id']}: the answers differ between methods")
        # per question as in all (the docstring said so; only "done" was printed)
        print(f"question {question['id']} ({question['category']}): " + ", ".join(
            f"{method} tau {tau:.2f} {seconds:.2f} s ({line['ar'][1] / seconds:.3f}x ar)"
            for method, (tau, seconds) in line.items()), flush=True)
    for method in methods:
        t = totals[method]
        print(f"{method:11s} tau {t['step_tokens'] / max(t['row_steps'], 1):.3f}  "
              f"plain steps {t['plain'] / max(t['steps'], 1):.0%}  {t['seconds']:.1f} s  "
              f"speed vs ar {totals['ar']['seconds'] / t['seconds']:.3f}")
    for faster, slower in (("adaptive", "fixed"), ("learned", "adaptive"), ("adaptive", "one-context")):
        if faster in totals and slower in totals:
            print(f"{faster} / {slower} speed: {totals[slower]['seconds'] / totals[faster]['seconds']:.3f}")
    if "learned" in totals:
        print("step costs learned:", json.dumps(step_costs.summary()))


if __name__ == "__main__":
    main()
