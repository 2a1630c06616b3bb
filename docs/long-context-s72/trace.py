# One answer of the weak heads (runs/weak/heads) to question 317, 128 new tokens: H a plain step whose next token
# head 1 had among its candidates (a shadow hit), . one that it had not, [Tr+/-] a tree step on rung r that accepted
# a token or none.  python docs/long-context-s72/trace.py > docs/long-context-s72/trace.txt
# (trace.txt: at commit cc489ec, before a plain step's report of a rarely right first level weighed less;
# trace-after.txt: after)
import json, sys
sys.path.insert(0, '.')
import torch
from medusa_infer.model import MedusaModel
from medusa_infer.decoding import generate
from medusa_infer.adaptive import TreeController
model = MedusaModel.from_pretrained("runs/weak/heads")
q = [json.loads(l) for l in open("data/specbench.jsonl") if json.loads(l)["id"] == 317][0]
events = []
oc, os_, ob = TreeController.choose, TreeController.observe_shadow, TreeController.observe
def choose(self, batch=1, context=None):
    r = oc(self, batch, context); events.append(("choose", r, round(self.scale, 2))); return r
def shadow(self, hit):
    events.append(("shadow", hit)); return os_(self, hit)
def observe(self, rung, reached):
    events.append(("tree", rung, list(reached))); return ob(self, rung, reached)
TreeController.choose, TreeController.observe_shadow, TreeController.observe = choose, shadow, observe
with torch.inference_mode():
    out = generate(model, messages=[{"role": "user", "content": q["turns"][0]}], max_new_tokens=128)
c = [e for e in events if e[0] == "choose"]
print("steps", len(c), "tree steps", sum(e[1] > 0 for e in c))
line = []
for e in events:
    if e[0] == "shadow":
        line.append("H" if e[1] == 1.0 else ".")
    elif e[0] == "tree":
        line.append(f"T{e[1]}{'+' if e[2] and e[2][0] else '-'}")
print("".join(x if len(x) < 2 else f"[{x}]" for x in line))
