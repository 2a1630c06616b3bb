"""Experiment (not adopted): self-labelled, teacher-forced positions as extra Medusa-1 training data.

Distilled answers are expensive: the model writes them one token at a time. Head 1 of a
``next_token_input`` head reads (hidden state at t, token t + 1) and predicts what the model says
after token t + 1, and *any* text gives that target from one forward pass: the model's argmax at
t + 1. This script adds such positions to the quick recipe's training split (never to its held-out
split) and trains as the recipe does:

* the user turns of the distilled conversations (no extra backbone cost in a fused pipeline), and
* ``N_EXTRA`` prompts the model never answered, as chat-rendered user turns.

The system prompt every conversation shares is left unlabelled. Head k > 1's target at t is then
the model's argmax at t + k given the real text, not its own continuation: an approximation.

    python docs/self-label/augment.py OUT N_EXTRA USER_TURNS ROWS PROMPTS [recipe overrides ...]
    python docs/self-label/augment.py runs/augA 0 1 runs/demo/data/distilled.jsonl ../shared/data/train_prompts.jsonl
    python docs/self-label/augment.py runs/augB 1000 1 runs/demo/data/distilled.jsonl ../shared/data/train_prompts.jsonl

Measured on the demo's 400 answers (docs/self-label/aug*.txt): held-out head-1 top-1 0.338 without
(`python train_heads.py --config recipes/smollm2-135m.yaml output_dir=runs/demo --heldout-only`),
0.344 with the user turns (+25% positions), 0.349 with them and 1000 more prompts (+117%
positions), against 0.369 for 800 distilled answers and 0.432 for 1600. Off-policy positions
are worth little to these heads.
"""

import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_heads as th  # noqa: E402
from medusa_infer.models import load_base_model, load_tokenizer  # noqa: E402
from medusa_train import dataset as ds  # noqa: E402
from medusa_train.features import pad_batch  # noqa: E402

OUT, N_EXTRA, USER_TURNS = sys.argv[1], int(sys.argv[2]), bool(int(sys.argv[3]))
ROWS, PROMPTS = sys.argv[4], sys.argv[5]
MAX_PROMPT = 320


@torch.inference_mode()
def argmax_rows(model, seqs: list[list[int]], batch_size: int = 8) -> list[list[int]]:
    """The model's argmax next token at every position of each sequence."""
    out: list[list[int]] = [[] for _ in seqs]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for s in range(0, len(order), batch_size):
        chosen = order[s:s + batch_size]
        batch = pad_batch([{"input_ids": seqs[i], "labels": seqs[i]} for i in chosen])
        top = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
        for r, i in enumerate(chosen):
            out[i] = top[r, :len(seqs[i])].tolist()
    return out


def self_labels(ids: list[int], argmax: list[int], prefix: int, keep: list[int] | None = None) -> list[int]:
    """labels[t + 1] = the model's argmax at t after the shared prefix; ``keep``'s labels win."""
    labels = [-100] * len(ids)
    for t in range(max(prefix - 1, 0), len(ids) - 1):
        labels[t + 1] = argmax[t]
    for t, value in enumerate(keep or []):
        if value != -100:
            labels[t] = value
    return labels


def stage_data(config, accelerator, *args, **kwargs):  # (train_heads' own arguments since 2fa46f1 passed along)
    train, heldout = original_stage_data(config, accelerator, *args, **kwargs)
    started = time.time()
    tokenizer = load_tokenizer(config.model.name)
    model = load_base_model(config.model.name, dtype=torch.float32, device="cpu").eval()
    a = ds.encode_rendered(tokenizer, ds.render_prompt(tokenizer, "a"))
    b = ds.encode_rendered(tokenizer, ds.render_prompt(tokenizer, "b c"))
    prefix = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    augmented = list(train)
    if USER_TURNS:
        tops = argmax_rows(model, [e["input_ids"] for e in train])
        augmented = [{"input_ids": e["input_ids"], "labels": self_labels(e["input_ids"], top, prefix, e["labels"])}
                     for e, top in zip(train, tops)]
    if N_EXTRA:
        used = {json.loads(line)["id"] for line in open(ROWS)}
        rows = [json.loads(line) for line in open(PROMPTS)]
        random.Random(1).shuffle(rows)
        seqs = []
        for row in rows:
            ids = ds.encode_rendered(tokenizer, ds.render_prompt(tokenizer, row["prompt"]))[:MAX_PROMPT]
            if row["id"] not in used and len(ids) - prefix >= 8:
                seqs.append(ids)
            if len(seqs) == N_EXTRA:
                break
        for ids, top in zip(seqs, argmax_rows(model, seqs)):
            augmented.append({"input_ids": ids, "labels": self_labels(ids, top, prefix)})
    count = lambda examples: sum(sum(v != -100 for v in e["labels"]) for e in examples)  # noqa: E731
    print(f"augment: {len(train)} -> {len(augmented)} examples, labelled {count(train)} -> {count(augmented)} "
          f"({time.time() - started:.0f} s)", flush=True)
    return augmented, heldout


original_stage_data = th.stage_data
th.stage_data = stage_data
sys.exit(th.main(["--config", "recipes/smollm2-135m.yaml", f"output_dir={OUT}", f"data.rows={ROWS}", *sys.argv[6:]]))
