"""Where greedy speculative output parts from plain decoding in bfloat16, and how near a tie it was.

    python scripts/bf16_divergence.py --heads runs/demo/heads [--limit 10] [--tokens 48] [--device cpu]

In bfloat16 a forward of several tokens rounds differently from a forward of one, so a tree step
and a plain step can pick different tokens where the top logits (nearly) tie, and from there the
outputs differ. For ``--limit`` Spec-Bench questions spread evenly over the file, this decodes the
first turn with plain decoding (``ar``) and with ``medusa`` and ``lookup``. Where one parts from
``ar``, it runs one full forward over the prompt and ``ar``'s tokens up to that point, and prints
how far below that forward's best logit our token lies, with the top two logits. 0 means ours is
the best there (the one-token step of ``ar`` rounded the other way); one bfloat16 step is 0.125
between 16 and 32.
"""

from __future__ import annotations

import argparse
import json

import torch

from medusa_infer.decoding import generate
from medusa_infer.model import MedusaModel
from medusa_infer.models import load_base_model, load_tokenizer
from medusa_infer.proposers import build_proposer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", required=True)
    parser.add_argument("--questions", default="data/specbench.jsonl")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lookup-tokens", type=int, default=8, help="draft length of the lookup method")
    args = parser.parse_args()
    for flag, value in (("--limit", args.limit), ("--tokens", args.tokens), ("--lookup-tokens", args.lookup_tokens)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")

    from medusa_infer.interop import base_model_name  # (an export's medusa_forge_base_model: the model loaded)

    name = base_model_name(args.heads)
    base = load_base_model(name, dtype=torch.bfloat16, device=args.device)
    # the tokenizer through from_pretrained: it gets the chat template the heads were trained on, if they carry one
    model = MedusaModel.from_pretrained(args.heads, base_model=base, tokenizer=load_tokenizer(name))
    tokenizer = model.tokenizer
    with open(args.questions) as f:
        questions = [json.loads(line) for line in f]
    # medusa: the heads' own tree, no lookup chain; lookup: drafts of --lookup-tokens (its draft_tokens)
    options = {"medusa": argparse.Namespace(), "lookup": argparse.Namespace(draft_tokens=args.lookup_tokens)}
    parted = runs = 0
    for question in questions[:: max(1, len(questions) // args.limit)][: args.limit]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question["turns"][0]}],
                                            add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        plain = generate(model, ids, max_new_tokens=args.tokens,
                         proposer=build_proposer("autoregressive", model)).new_tokens[0]
        for method in ("medusa", "lookup"):
            runs += 1
            ours = generate(model, ids, max_new_tokens=args.tokens,
                            proposer=build_proposer(method, model, options[method])).new_tokens[0]
            if ours == plain:
                print(f"question {question['id']} {method}: identical")
                continue
            parted += 1
            at = next((i for i, (a, b) in enumerate(zip(ours, plain)) if a != b), min(len(ours), len(plain)))
            if at >= min(len(ours), len(plain)):
                print(f"question {question['id']} {method}: one output is a prefix of the other (at {at})")
                continue
            context = torch.cat([ids[0], torch.tensor(plain[:at])])[None].to(base.device)
            with torch.no_grad():
                logits = base(context).logits[0, -1].float()
            top = logits.topk(2).values.tolist()
            gap = float(logits.max() - logits[ours[at]])
            print(f"question {question['id']} {method}: parts at token {at}, ours {ours[at]} vs {plain[at]}; "
                  f"ours lies {gap:.3f} below the best logit (top two {top[0]:.3f}, {top[1]:.3f})")
    print(f"{parted} of {runs} outputs parted from plain decoding")


if __name__ == "__main__":
    main()
