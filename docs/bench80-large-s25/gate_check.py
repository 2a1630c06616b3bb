"""adaptive_check.py plus SpeculationGate (batch decoding's measured on/off switch) at batch 1:
one gate per method, kept across questions. Does a measured gate rescue a tree fitted to a wrong
cost profile?

    python docs/bench80-large-s25/gate_check.py runs/heads-large-80-s25 runs/bench80-large-s25 20
"""
import json, sys, time
import torch
from medusa_infer.model import MedusaModel
from medusa_infer.decoding import encode_chat, generate
from medusa_train.benchmark import load_questions

heads, report, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(2)
model = MedusaModel.from_pretrained(heads).eval()
calib = json.load(open(report + "/calibration.json"))
qs = load_questions("data/specbench.jsonl", n, seed=0, exclude_ids=calib["question_ids"])
tree = [list(p) for p in model.config.tree]
from medusa_infer.speculation_gate import SpeculationGate
gates = {"adaptive+gate": SpeculationGate(), "fixed-tree+gate": SpeculationGate()}  # one per method, kept across questions
runs = {"ar": None, "adaptive": dict(tree=None, adaptive=None),
        "adaptive+gate": dict(tree=None, adaptive=None, speculation_gate=gates["adaptive+gate"]),
        "fixed-tree+gate": dict(tree=tree, adaptive=False, speculation_gate=gates["fixed-tree+gate"]),
        "fixed-1": dict(tree=[[0]], adaptive=False)}
stats = {k: [0.0, 0, 0, 0, 0] for k in runs}
phases = {k: {} for k in runs}
ref = {}
for q in qs:
    text = encode_chat(model.tokenizer, [{"role": "user", "content": q["turns"][0]}])[0]
    ids = model.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    for name, kw in runs.items():
        t0 = time.perf_counter()
        if kw is None:
            hf = model.base_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)
            dt = time.perf_counter() - t0
            stats[name][0] += dt; stats[name][1] += hf.shape[1] - ids.shape[1]; stats[name][2] += hf.shape[1] - ids.shape[1] - 1
            continue
        out = generate(model, ids, max_new_tokens=64, **kw)
        dt = time.perf_counter() - t0
        seq = out.sequences[0].tolist()
        ref.setdefault(q["id"], seq)
        assert seq == ref[q["id"]], name
        new = len(seq) - ids.shape[1]
        stats[name][0] += dt; stats[name][1] += new; stats[name][2] += out.metrics.steps; stats[name][3] += out.metrics.plain_steps; stats[name][4] += out.metrics.tree_nodes
        for ph, v in out.metrics.phase_s.items(): phases[name][ph] = phases[name].get(ph, 0) + v
base = stats["ar"][1] / stats["ar"][0]
for name, (s, tok, steps, plain, nodes) in stats.items():
    print(f"{name:11s} tokens/s {tok / s:6.2f} speedup {tok / s / base:.3f} steps {steps} tau {(tok - len(qs)) / max(steps, 1):.2f} plain {plain / max(steps, 1):.2f} nodes/step {nodes / max(steps, 1):.2f} s/step {s / max(steps, 1) * 1000:.1f} ms")

for name, ph in phases.items():
    steps = max(stats[name][2], 1)
    print(name, {k: round(v / steps * 1000, 2) for k, v in ph.items()}, "ms/step")
