"""Real Gemma-3-270M (sliding window 512): greedy Medusa output equals plain decoding past the window.

    python docs/gemma3-270m-s36/long_exact.py    # after recipes/gemma3-270m.yaml has trained runs/gemma3-270m/heads

The 4 Spec-Bench questions with the longest prompts (first turns, rendered with the heads' template), 160 new
tokens each: plain decoding, then the heads with fitted 16- and 64-node trees (no fallback) and a 16-node tree with
prompt-lookup chains; asserts every output token for token equal to plain decoding. Output: long_exact.txt.
"""
import json

import torch

from medusa_infer.model import MedusaModel
torch.set_num_threads(2)
model = MedusaModel.from_pretrained("runs/gemma3-270m/heads")
print("window", model.base_model.config.sliding_window, "impl", model.base_model.config._attn_implementation)
rows = [json.loads(l) for l in open("data/specbench.jsonl")]
tok = model.tokenizer
def n_tokens(q):
    text = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True, tokenize=False)
    return len(tok(text, add_special_tokens=False)["input_ids"])
long = sorted(rows, key=n_tokens, reverse=True)[:4]
for q in long:
    messages = [{"role": "user", "content": q["turns"][0]}]
    plain = model.generate(messages=messages, max_new_tokens=160, tree=[])
    for tree, lookup in (("fitted-16", 0), ("fitted-64", 0), ("fitted-16", 8)):
        out = model.generate(messages=messages, max_new_tokens=160, tree=tree, adaptive=False, lookup_tokens=lookup)
        same = out.new_tokens[0] == plain.new_tokens[0]
        print(q["category"], n_tokens(q), "prompt tokens;", tree, "lookup", lookup, "same", same,
              "tau", round(out.metrics.tau, 2), flush=True)
        assert same
