"""The first-level weighting rules side by side, on the simulations of tests/test_adaptive.py.

    python docs/long-context-s72/weightings.py > docs/long-context-s72/weightings.txt

Loads medusa_infer/adaptive.py as it was at each commit (git show) and drives its TreeController:
71fc414, every observation weighs ``smoothing``; 6178e92, plain steps' reports alone weigh by their rate;
4f80108, a tree step's depth 1 weighs by its own rung's rate; HEAD, every first-level observation by the
largest tree's rate. Prints the share of plain steps of moderately weak heads as calibrated on a tree that pays
(test_moderately_weak_heads_as_calibrated_keep_a_tree_that_pays), the share of tree steps of weak heads
where no tree pays (test_rare_hits_...), and the scale's long-run mean against the true 0.5 and 1.0
(test_first_level_observations_weigh_alike_...), each over seeds 0 to 4.
"""

import importlib.util
import itertools
import random
import subprocess
import sys
import tempfile

from medusa_infer.tree_fit import CostProfile
from medusa_infer.trees import greedy_tree


def controller_module(rev: str):
    source = subprocess.run(["git", "show", f"{rev}:medusa_infer/adaptive.py"], capture_output=True, text=True,
                            check=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as file:
        file.write(source)
    spec = importlib.util.spec_from_file_location(f"adaptive_{rev}", file.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def moderately_weak(module, seed: int) -> float:
    control = module.TreeController(module.tree_ladder([(0,)]), [[0.2]], CostProfile([1, 2], [1.0, 1.1], "cpu"))
    rng, plain = random.Random(seed), 0
    for _ in range(4000):
        rung, hit = control.choose(), float(rng.random() < 0.2)
        control.observe_shadow(hit) if rung == 0 else control.observe(rung, [hit])
        plain += rung == 0
    return plain / 4000


def rare_hits(module, seed: int) -> float:
    acc = [[0.03, 0.02, 0.015, 0.01, 0.01], [0.01] * 5]
    ladder = module.tree_ladder(greedy_tree(acc, 5), sizes=(5,), acceptance=acc)
    control = module.TreeController(ladder, acc, CostProfile([1, 2, 8], [1.0, 1.2, 1.25], "cpu"))
    rng, trees = random.Random(seed), 0
    for _ in range(2000):
        rung, hit = control.choose(), float(rng.random() < 0.085)
        if rung == 0:
            control.observe_shadow(hit)
        else:
            control.observe(rung, [hit] + [0.0] * (len(control.reach_cal[rung]) - 1))
        trees += rung > 0
    return trees / 2000


def scale_mean(module, seed: int, factor: float) -> float:
    acc = [[0.12, 0.04, 0.02, 0.02], [0.08, 0.04, 0.0, 0.0]]
    ladder = module.tree_ladder(greedy_tree(acc, 6), sizes=(1, 2, 4), acceptance=acc)
    control = module.TreeController(ladder, acc, CostProfile([1, 2, 3, 5, 7], [1.0, 1.1, 1.2, 1.4, 1.6], "cpu"))
    rng, scales = random.Random(seed), []
    for _ in range(12000):
        rung = control.choose()
        if rung == 0:
            control.observe_shadow(float(rng.random() < factor * control.first_level_cal))
        else:
            first = rng.random() < factor * control.reach_cal[rung][0]
            deeper = [first and rng.random() < r / control.reach_cal[rung][0] for r in control.reach_cal[rung][1:]]
            control.observe(rung, [float(first)] + [float(d) for d in itertools.accumulate(deeper, min)])
        scales.append(control.scale)
    return sum(scales[1000:]) / len(scales[1000:])


def main() -> None:
    seeds = range(5)
    print("rule                plain share (moderately weak)  tree share (rare hits)  scale mean at 0.5 / 1.0")
    for rev in ("71fc414", "6178e92", "4f80108", "HEAD"):
        module = controller_module(rev)
        plain = sum(moderately_weak(module, s) for s in seeds) / len(seeds)
        trees = sum(rare_hits(module, s) for s in seeds) / len(seeds)
        half = sum(scale_mean(module, s, 0.5) for s in seeds) / len(seeds)
        whole = sum(scale_mean(module, s, 1.0) for s in seeds) / len(seeds)
        print(f"{rev:18s}  {plain:29.3f}  {trees:22.3f}  {half:.3f} / {whole:.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
