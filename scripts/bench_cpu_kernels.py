"""The cost of verifying n tokens on the CPU with each choice of linear kernels.

    python scripts/bench_cpu_kernels.py [--model smollm2-135m-instruct] [--rounds 5] [--threads 2]

Loads the model once (float32), measures the ``tuned`` plans on its layers, one per weight shape
(``medusa_infer.cpu_kernels.measure_kernel_plan``, printed with each kernel's milliseconds per row
count), then times a forward of n new tokens over 256 cached ones (``tree_fit.measure_verify_cost``,
what calibration measures) for n in ``tree_fit.DEFAULT_SIZES`` (1 to 17, 24, 32, 48, 64) with each plan: ``default`` (PyTorch's own
kernels throughout), ``onednn`` (oneDNN with packed weights throughout), ``mkl-packed`` (MKL with
packed weights up to 64 rows) and ``tuned``. The plans
are interleaved round by round, so a noisy machine slows them alike; it prints each one's median
milliseconds, t(n) / t(1) and the time relative to ``default`` at the same n.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from medusa_infer.cpu_kernels import KERNELS, CPULinear, KernelPlan, kernel_plans, use_cpu_kernels
from medusa_infer.model import MedusaModel
from medusa_infer.models import load_base_model
from medusa_infer.tree_fit import DEFAULT_SIZES, measure_verify_cost
from medusa_train.benchmark import cpu_name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = MedusaModel.without_heads(load_base_model(args.model, dtype=torch.float32, device="cpu",
                                                      cpu_kernels="default"))
    start = time.perf_counter()
    if not use_cpu_kernels(model.base_model, "tuned"):  # what load_base_model does by default
        raise SystemExit("this PyTorch build has no working oneDNN linear kernel: only PyTorch's own kernels run here")
    tuning = time.perf_counter() - start
    layers = [m for m in model.modules() if isinstance(m, CPULinear)]
    print(f"{cpu_name()}, torch {torch.__version__}, {args.threads} threads; plans measured in {tuning:.1f} s")
    tuned = {id(layer): layer.kernel_plan for layer in layers}
    for shape, plan in kernel_plans(model.base_model).items():
        count = sum(1 for layer in layers if tuple(layer.weight.shape) == tuple(map(int, shape.split("x"))))
        print(f"\n{shape} ({count} layers): {plan.describe()}")
        print("  rows: " + ", ".join(KERNELS) + " ms")
        for rows, seconds in zip(plan.rows, plan.seconds):
            cells = [f"{seconds[k] * 1e3:6.1f}" if k in seconds else "     -" for k in KERNELS]
            print(f"  {rows:4d}: " + " ".join(cells))
    plans = {"default": KernelPlan.uniform("default"), "onednn": KernelPlan.uniform("onednn"),
             "mkl-packed": KernelPlan.uniform("mkl-packed"), "tuned": None}
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in DEFAULT_SIZES} for name in plans}
    for round_ in range(args.rounds):
        order = list(plans)[round_ % len(plans):] + list(plans)[: round_ % len(plans)]
        for name in order:
            for layer in layers:
                layer.kernel_plan = plans[name] or tuned[id(layer)]
            profile = measure_verify_cost(model, DEFAULT_SIZES, repeats=1)
            for n, seconds in zip(profile.sizes, profile.seconds):
                times[name][n].append(seconds)
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    median = {name: {n: statistics.median(v) for n, v in per.items()} for name, per in times.items()}
    print("\nforward of n tokens over 256 cached, median ms (t(n) / t(1); vs default at the same n) of the cost "
          "profiles, each of which raises a size's time to the largest of the smaller sizes' (never decreasing)")
    print("    n  " + "  ".join(f"{name:>22}" for name in plans))
    for n in DEFAULT_SIZES:
        cells = [f"{median[name][n] * 1e3:7.1f} ({median[name][n] / median[name][1]:.2f}; "
                 f"{median[name][n] / median['default'][n]:.2f})" for name in plans]
        print(f"{n:5d}  " + "  ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
