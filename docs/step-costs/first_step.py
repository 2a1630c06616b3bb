"""Does the first step on a neighbouring tree cost more than the next one on it?

    python docs/step-costs/first_step.py HEADS HOME OTHER [QUESTIONS]
    python docs/step-costs/first_step.py runs/demo/heads 1 2 10

A settled controller measures the pair of trees (r, r + 1) only by stepping up from r, and the
pair (r - 1, r) only by stepping down from r (``adaptive.StepCosts``): if the first step on a
tree it has not just used cost extra (a cold cache, packed weights or a plan touched for the
first time), each sample would charge it to the neighbour and the controller would keep to its
rung. This script decodes the first turns of the first QUESTIONS Spec-Bench questions (96 new
tokens each, greedy, the heads' stored tree's ladder) on a fixed schedule of 10 steps: 7 on rung
HOME, then 2 on rung OTHER, then 1 on HOME. It prints the median step seconds (``propose`` to
``observe``, as the controller times them) for each place in the schedule, and the median log
ratio of the first to the second OTHER step and of the first to the second HOME step after it.
"""

from __future__ import annotations

import json
import math
import statistics
import sys

import torch

from medusa_infer.adaptive import TreeController
from medusa_infer.decoding import make_controller, resolve_tree, stream
from medusa_infer.model import MedusaModel
from medusa_infer.proposers.medusa import MedusaProposer

TAGS = {7: "other, 1st", 8: "other, 2nd", 9: "home, 1st after", 0: "home, 2nd after"}


class Schedule(TreeController):
    """Takes the fixed schedule and records each step's seconds with its place in it."""

    log: list[tuple[str, float]] = []

    def choose(self, batch: int = 1) -> int:
        place = self._steps % 10
        self._steps += 1
        self._tag = TAGS.get(place, "home")
        return OTHER if place in (7, 8) else HOME

    def observe_seconds(self, rung: int, seconds: float) -> None:
        self.log.append((self._tag, seconds))

    def observe(self, rung: int, reached: list[float]) -> None:
        pass

    def observe_shadow(self, hit_rate: float) -> None:
        pass


def paired(log: list[tuple[str, float]], first: str, second: str) -> list[float]:
    return [math.log(a / b) for (t, a), (u, b) in zip(log, log[1:]) if t == first and u == second]


if __name__ == "__main__":
    heads, HOME, OTHER = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    count = int(sys.argv[4]) if len(sys.argv) > 4 else 10
    torch.set_num_threads(2)
    model = MedusaModel.from_pretrained(heads)
    template = make_controller(model, resolve_tree(model, None), True)
    print("ladder (nodes per rung):", [len(t) for t in template.ladder], f"home {HOME}, other {OTHER}")
    with open("data/specbench.jsonl") as handle:
        questions = [json.loads(line) for line in handle][:count]
    for question in questions:
        controller = Schedule(template.ladder, template.head_topk_acc, template.cost)
        ids = model.tokenizer.apply_chat_template([{"role": "user", "content": question["turns"][0]}],
                                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"]
        with torch.inference_mode():
            stream(model, ids, torch.ones_like(ids), max_new_tokens=96,
                   proposer=MedusaProposer(model, [], controller=controller)).result()
    steps: dict[str, list[float]] = {}
    for tag, seconds in Schedule.log:
        steps.setdefault(tag, []).append(seconds)
    for tag in ("home", "other, 1st", "other, 2nd", "home, 1st after", "home, 2nd after"):
        print(f"{tag:16s} {len(steps[tag]):4d} steps, median {statistics.median(steps[tag]) * 1e3:6.2f} ms")
    for first, second in (("other, 1st", "other, 2nd"), ("home, 1st after", "home, 2nd after")):
        ratios = paired(Schedule.log, first, second)
        print(f"median log({first} / {second}): {statistics.median(ratios):+.4f} over {len(ratios)} pairs")
