"""Spread of the verification cost profile: three profiles of 5 repeats and three of 20, alternating.

    python docs/bench80-large-s25/cost_noise.py runs/heads-large-80-s25
"""
import sys, time, torch
from medusa_infer.model import MedusaModel
from medusa_infer.tree_fit import measure_verify_cost
torch.set_num_threads(2)
model = MedusaModel.from_pretrained(sys.argv[1]).eval()
for repeats in (5, 20, 5, 20, 5, 20):
    t0 = time.time()
    with torch.inference_mode():
        c = measure_verify_cost(model, repeats=repeats)
    r = [round(s / c.seconds[0], 3) for s in c.seconds]
    print(repeats, "t(1) ms", round(c.seconds[0] * 1000, 1), "ratios", r, round(time.time() - t0, 1), "s", flush=True)
