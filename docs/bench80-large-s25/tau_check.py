"""Expected tau of the calibrated tree, from head accuracies measured on the benchmark's own first turns.

    python docs/bench80-large-s25/tau_check.py runs/heads-large-80-s25 runs/bench80-large-s25
"""
import json, sys, time
import torch
from medusa_infer.model import MedusaModel
from medusa_infer.decoding import encode_chat, generate
from medusa_infer.trees import expected_accept_length, greedy_tree
from medusa_train.benchmark import load_questions, head_topk_accuracy

heads, report = sys.argv[1], sys.argv[2]
torch.set_num_threads(2)
model = MedusaModel.from_pretrained(heads).eval()
calib = json.load(open(report + "/calibration.json"))
qs = load_questions("data/specbench.jsonl", 80, seed=0, exclude_ids=calib["question_ids"])
tree = [tuple(p) for p in model.config.tree]
def measure(questions):
    seqs = []
    for q in questions:
        text = encode_chat(model.tokenizer, [{"role": "user", "content": q["turns"][0]}])[0]
        ids = model.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        out = generate(model, ids, max_new_tokens=64, tree="chain-1", adaptive=False)
        seqs.append((out.sequences[0], ids.shape[1]))
    acc = head_topk_accuracy(model, seqs, top_k=model.config.top_k)
    paths = acc.paths()
    return acc.topk(), paths
t0 = time.time()
top, paths = measure(qs)
print("bench first turns:", len(qs), "questions, top-1", [round(r[0], 3) for r in top])
print("expected tau of the calibrated tree", round(expected_accept_length(tree, paths), 3),
      "| 1-node", round(expected_accept_length([(0,)], paths), 3))
cal = {tuple(p): q for p, q in model.config.path_accuracies}
print("on calibration's paths:", round(expected_accept_length(tree, cal), 3), "| 1-node", round(expected_accept_length([(0,)], cal), 3))
print(round(time.time() - t0), "s")
