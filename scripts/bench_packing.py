"""Packed against padded Medusa-2 micro-batches (``data.pack``): tokens run and seconds per step.

Takes distilled rows (e.g. ``runs/demo/data/distilled.jsonl``, which ``make demo`` writes), draws
``--batches`` random micro-batches of ``--batch-size`` examples, and runs each one as a Medusa-2
training step would (the original model as teacher, the LoRA-adapted one as student, the heads,
then backward), once padded and once packed, alternating which goes first, so that both see the
machine's same conditions. Prints the tokens each layout runs, the seconds and their ratio, and
checks that both layouts gave the same loss.

    python scripts/bench_packing.py --rows runs/demo/data/distilled.jsonl --batch-size 8 --batches 12
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from medusa_infer.heads import MedusaHeads
from medusa_infer.model import MedusaModel
from medusa_infer.models import load_base_model, load_tokenizer
from medusa_train import trainer as tr
from medusa_train.dataset import build_examples, read_rows
from medusa_train.features import pad_batch
from medusa_train.lora import add_lora
from medusa_train.train_config import config_from_dict


class OneProcess:
    """What ``trainer.step_denominators`` asks of an accelerator, on one CPU process."""

    device = torch.device("cpu")
    num_processes = 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", required=True, help="distilled rows (JSONL with prompt and response)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    for flag, value in (("--batch-size", args.batch_size), ("--batches", args.batches)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.threads:
        torch.set_num_threads(args.threads)

    recipe = {"model": {"name": args.model}, "data": {"tokenized": args.rows},
              "heads": {"num_heads": 4},  # the heads' cost does not change with the layout
              "training": {"mode": "medusa2", "loss": "ce", "batch_size": args.batch_size},
              "lora": {"dropout": 0.0}}  # dropout would draw different masks per layout
    configs = {pack: config_from_dict({**recipe, "data": {**recipe["data"], "pack": pack}}) for pack in (False, True)}
    config = configs[False]
    tokenizer = load_tokenizer(args.model)
    examples = build_examples(read_rows(args.rows), tokenizer, args.max_length)
    base = load_base_model(args.model, dtype=torch.float32, attn_implementation="sdpa")
    base.requires_grad_(False)
    peft_model = add_lora(base, config.lora.r, config.lora.alpha, 0.0, config.lora.target_modules)
    vocab, hidden = base.get_output_embeddings().weight.shape
    heads = MedusaHeads(tr.heads_config(config, hidden, vocab, base.config.model_type, None),
                        lm_head_weight=base.get_output_embeddings().weight.detach().float())
    medusa = MedusaModel(peft_model.get_base_model(), heads)
    tasks = {pack: tr.Medusa2Task(configs[pack], tr.JointModule(medusa, peft_model, 0), examples, None,
                                  pad_id=tokenizer.pad_token_id or 0) for pack in (False, True)}

    if args.batch_size > len(examples):  # (random.sample's "Sample larger than population")
        parser.error(f"--batch-size {args.batch_size} is more than the {len(examples)} examples of {args.rows}")
    rng = random.Random(args.seed)
    seconds, tokens = {False: 0.0, True: 0.0}, {False: 0, True: 0}
    print(f"{len(examples)} examples from {args.rows}; {args.batches} micro-batches of {args.batch_size}")
    for b in range(args.batches):
        index = torch.tensor(rng.sample(range(len(examples)), args.batch_size))
        batch = pad_batch([examples[i] for i in index.tolist()], pack=True)
        tokens[False] += batch["input_ids"].numel()
        tokens[True] += batch["packed_ids"].numel()
        losses = {}
        for pack in ((False, True) if b % 2 == 0 else (True, False)):
            medusa.zero_grad(set_to_none=True)
            start = time.perf_counter()
            task = tasks[pack]
            micro = task.prepare(index, OneProcess.device)
            loss, _ = task.loss(task.module, micro, 0, tr.step_denominators(OneProcess(), [task.counts(micro)]))
            loss.backward()
            seconds[pack] += time.perf_counter() - start
            losses[pack] = float(loss.detach())
        if abs(losses[True] - losses[False]) > 1e-4 * abs(losses[False]):
            raise SystemExit(f"batch {b}: packed loss {losses[True]} != padded {losses[False]}")
    print(f"{'layout':8} {'tokens run':>11} {'seconds':>9}")
    for pack, name in ((False, "padded"), (True, "packed")):
        print(f"{name:8} {tokens[pack]:>11} {seconds[pack]:>9.2f}")
    print(f"packed / padded: tokens {tokens[True] / tokens[False]:.3f}, seconds {seconds[True] / seconds[False]:.3f}; "
          "the same loss on every batch")


if __name__ == "__main__":
    main()
