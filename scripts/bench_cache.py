"""Decoding with ``KVState``'s growing cache against transformers' ``DynamicCache``, interleaved.

Plain (greedy, one token a step) decoding of the default model after a random prompt, one run with
each cache in turn, ``--repeats`` times; prints the median seconds per step of each, their ratio,
and whether both produced the same tokens. ``--loop ours`` decodes with this package's loop
(``KVState.empty`` builds the cache), ``--loop hf`` with transformers' ``generate`` given the cache.

    python scripts/bench_cache.py --context 800 --new-tokens 64             # one row, long context
    python scripts/bench_cache.py --loop hf --batch 32 --context 100 --new-tokens 192   # distillation's shape
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, GenerationConfig

from medusa_infer import kv_cache
from medusa_infer.decoding import generate
from medusa_infer.model import MedusaModel
from medusa_infer.models import load_base_model
from medusa_infer.proposers import build_proposer


def decode_ours(model: MedusaModel, prompt: torch.Tensor, new_tokens: int, cache_class: type) -> tuple[float, list]:
    original = kv_cache.GrowingCache
    kv_cache.GrowingCache = cache_class  # what KVState.empty builds
    try:
        out = generate(model, prompt, max_new_tokens=new_tokens, eos_token_id=[],
                       proposer=build_proposer("autoregressive", model), speculation_gate=False)
    finally:
        kv_cache.GrowingCache = original
    return (out.metrics.total_s - out.metrics.ttft_s) / max(out.metrics.steps, 1), out.sequences.tolist()


def decode_hf(model: MedusaModel, prompt: torch.Tensor, new_tokens: int, cache_class: type) -> tuple[float, list]:
    base = model.base_model
    settings = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        start = time.perf_counter()
        out = base.generate(prompt, generation_config=settings, **{kv_cache.cache_keyword(base): cache_class()})
        elapsed = time.perf_counter() - start
    return elapsed / new_tokens, out.tolist()  # the prefill is a small share at these lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--loop", choices=("ours", "hf"), default="ours")
    parser.add_argument("--context", type=int, default=800, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    torch.set_num_threads(args.threads)
    model = MedusaModel.from_base(load_base_model(args.model, dtype=torch.float32), num_heads=1)
    vocab = model.lm_head.weight.shape[0]
    prompt = torch.randint(0, vocab, (args.batch, args.context), generator=torch.Generator().manual_seed(0))
    decode = decode_ours if args.loop == "ours" else decode_hf
    caches = {"growing": kv_cache.GrowingCache, "dynamic": DynamicCache}
    step_s: dict[str, list[float]] = {name: [] for name in caches}
    tokens: dict[str, list] = {}
    for repeat in range(args.repeats + 1):  # the first round warms up and is discarded
        for name, cls in caches.items():
            seconds, tokens[name] = decode(model, prompt, args.new_tokens, cls)
            if repeat:
                step_s[name].append(seconds)
    growing, dynamic = (statistics.median(step_s[name]) for name in caches)
    print(f"loop {args.loop}, context {args.context}, batch {args.batch}, {args.new_tokens} new tokens, "
          f"{args.repeats} repeats")
    print(f"DynamicCache {dynamic * 1e3:.1f} ms/step, GrowingCache {growing * 1e3:.1f} ms/step, "
          f"speedup {dynamic / growing:.3f}x, same tokens: {tokens['growing'] == tokens['dynamic']}")


if __name__ == "__main__":
    main()
