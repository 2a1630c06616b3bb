"""Self-distillation's decoding against Hugging Face ``generate``, interleaved batch by batch.

Distillation (``medusa_train.distill.generate_batch``) decodes with medusa_infer's loop in plain
steps, where a row that finished leaves the batch. This script answers the same prompts, sampled
as a recipe samples them and sorted longest first as distillation sorts them, with both: for each
batch, transformers' ``generate`` (greedy, float32, given a ``GrowingCache``, its fastest cache
here, as distillation used it before) and then distillation's ``generate_batch``. It prints each
batch's seconds, the ratio of the totals, and how many answers were token for token the same.

    python scripts/bench_distill.py --prompts data/train_prompts.jsonl --n 96 --batch-size 32
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import GenerationConfig

from medusa_infer.decoding import left_pad
from medusa_infer.kv_cache import GrowingCache, cache_keyword
from medusa_infer.model import MedusaModel
from medusa_infer.models import load_base_model
from medusa_train.distill import (
    DistillConfig, eos_token_ids, generate_batch, load_distill_tokenizer, prepare_prompt, sample_prompts,
)


def hf_answers(base, input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int, eos: list[int],
               max_new_tokens: int) -> list[list[int]]:
    """Greedy answers from transformers' ``generate``, cut before the first EOS."""
    settings = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id,
                                eos_token_id=eos)
    with torch.inference_mode():
        output = base.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=settings,
                               **{cache_keyword(base): GrowingCache()})
    answers = []
    for tokens in output[:, input_ids.shape[1]:].tolist():
        stop = next((i for i, token in enumerate(tokens) if token in eos), len(tokens))
        answers.append(tokens[:stop])
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", default="data/train_prompts.jsonl")
    parser.add_argument("--n", type=int, default=96, help="prompts, balanced by source as a recipe samples them")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    for flag, value in (("--n", args.n), ("--batch-size", args.batch_size), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:  # (tracebacks: an empty max(), a ValueError of the config)
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = DistillConfig(prompts=args.prompts, output="unused.jsonl", model=args.model,
                           max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    tokenizer = load_distill_tokenizer(config)
    base = load_base_model(args.model, dtype=torch.float32, device="cpu")
    eos = eos_token_ids(base, tokenizer)
    model = MedusaModel.without_heads(base, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    prompts = [prepare_prompt(tokenizer, row["prompt"], config) for row in sample_prompts(args.prompts, args.n)]
    ids = sorted((p[1] for p in prompts if p is not None), key=lambda x: -len(x))
    totals, same, tokens = {"hf": 0.0, "ours": 0.0}, 0, 0
    warm = ids[:args.batch_size]  # untimed: one-off costs (weight packing, first allocations) on neither side
    hf_answers(base, *left_pad(warm, pad_id), pad_id, eos, args.max_new_tokens)
    generate_batch(model, tokenizer, warm, config, eos)
    for first in range(0, len(ids), args.batch_size):
        batch = ids[first:first + args.batch_size]
        input_ids, attention_mask = left_pad(batch, pad_id)
        timed: dict[str, float] = {}
        for name in (("hf", "ours") if (first // args.batch_size) % 2 == 0 else ("ours", "hf")):  # alternated
            start = time.perf_counter()
            if name == "hf":
                reference = hf_answers(base, input_ids, attention_mask, pad_id, eos, args.max_new_tokens)
            else:
                ours = generate_batch(model, tokenizer, batch, config, eos)
            timed[name] = time.perf_counter() - start
        hf_s, ours_s = timed["hf"], timed["ours"]
        totals["hf"] += hf_s
        totals["ours"] += ours_s
        same += sum(a == b for a, (b, *_) in zip(reference, ours))
        tokens += sum(len(b) for b, *_ in ours)
        print(f"batch {first // args.batch_size}: {len(batch)} prompts, generate {hf_s:.1f} s, "
              f"distillation {ours_s:.1f} s ({hf_s / ours_s:.3f}x)", flush=True)
    print(f"{len(ids)} prompts, {tokens} answer tokens: generate {totals['hf']:.1f} s, distillation "
          f"{totals['ours']:.1f} s, speedup {totals['hf'] / totals['ours']:.3f}x; same answers {same}/{len(ids)}")


if __name__ == "__main__":
    main()
