"""A/B of KVState.keep_new: the accepted path moved in place (now) against gathered into a fresh
copy of the whole cache (before commit 'keep_new in place'), end to end on the default model.

    python docs/kv_cache/ab_keep_new.py [HEADS_DIR]      # default runs/demo/heads (from `make demo`)

12 Spec-Bench questions spread over the file, first turns, medusa with a grafted lookup chain (as
`medusa-lookup`), 128 new tokens, 2 threads; the two versions alternate question by question in
one process (the order flips each question) and must give the same tokens. `prefix` counts steps
whose kept slots were already in front (both versions only cut a view), `moved` those the old
version copied the cache for. The log of the run the README cites is ab_keep_new.log.
"""
import json
import sys
import time

import torch

from medusa_infer.decoding import generate
from medusa_infer.kv_cache import KVState, _layers
from medusa_infer.model import MedusaModel
from medusa_infer.models import load_base_model, load_tokenizer

torch.set_num_threads(2)
new_keep = KVState.keep_new
stats = {"prefix": 0, "moved": 0}


def old_keep(self, num_new, keep):
    """keep_new as it was: a path not already in front was gathered into a new whole cache."""
    start = self.num_slots - num_new
    slots = torch.arange(keep.shape[1], device=keep.device)
    if keep.shape[1] == num_new and bool((keep == slots).all()):
        return
    index = keep.clamp(min=0)
    prefix = bool(((keep == slots) | (keep < 0)).all())
    stats["prefix" if prefix else "moved"] += 1
    for layer in _layers(self.cache):
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            if prefix:
                setattr(layer, name, tensor[:, :, : start + keep.shape[1]])
                continue
            new = tensor[:, :, start:]
            gather = index[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3])
            setattr(layer, name, torch.cat([tensor[:, :, :start], new.gather(2, gather)], dim=2))
    self.valid = torch.cat([self.valid[:, :start], self.valid[:, start:].gather(1, index) & (keep >= 0)], dim=1)
    self.positions = torch.cat([self.positions[:, :start], self.positions[:, start:].gather(1, index)], dim=1)


base = load_base_model("smollm2-135m-instruct")
model = MedusaModel.from_pretrained(sys.argv[1] if len(sys.argv) > 1 else "runs/demo/heads", base_model=base)
tokenizer = load_tokenizer("smollm2-135m-instruct")
with open("data/specbench.jsonl") as f:
    questions = [json.loads(line) for line in f][3::37][:12]
seconds, tokens = {"old": 0.0, "new": 0.0}, {"old": 0, "new": 0}
for i, question in enumerate(questions):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question["turns"][0]}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    outputs = {}
    for version in ("old", "new") if i % 2 == 0 else ("new", "old"):
        KVState.keep_new = old_keep if version == "old" else new_keep
        start = time.perf_counter()
        out = generate(model, ids, max_new_tokens=128, lookup_tokens=8)
        seconds[version] += time.perf_counter() - start
        tokens[version] += len(out.new_tokens[0])
        outputs[version] = out.new_tokens[0]
    assert outputs["old"] == outputs["new"]
    print(i, question["category"], ids.shape[1], f"old {seconds['old']:.1f}s new {seconds['new']:.1f}s", stats,
          flush=True)
old_speed, new_speed = tokens["old"] / seconds["old"], tokens["new"] / seconds["new"]
print("tokens/s old", old_speed, "new", new_speed, "ratio new/old speed", new_speed / old_speed)
