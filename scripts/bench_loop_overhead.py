"""The decoding loop's own cost per token, against Hugging Face ``generate``, where forwards are cheap.

    python scripts/bench_loop_overhead.py [--rounds 7] [--tokens 128]

On a GPU a small model's forward is bound by Python and kernel launches, so what a decoding loop
does around each forward counts in full (the H200 run in docs/gpu/ measured our plain loop at
0.94x of ``generate``). This script makes that regime on a CPU: a random 30-layer llama of hidden
size 64 (SmolLM2-135M's depth, a tiny width) on one thread, 100 prompt tokens, greedy. It times,
interleaved round by round, milliseconds per new token of:

* ``ar``: our loop, plain decoding;
* ``ar-dynamic``: the same with transformers' ``DynamicCache`` updates (``torch.cat``) in place of
  our growing cache's, to show what the cache's bookkeeping costs;
* ``hf``: ``generate``;
* ``forwards``: a bare loop of forwards with a ``DynamicCache`` and argmax, the floor.

It prints each one's median and the ratios to ``hf``. All four produce the same tokens (checked).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig
from transformers.cache_utils import DynamicLayer

from medusa_infer import kv_cache
from medusa_infer.decoding import generate
from medusa_infer.model import MedusaModel
from medusa_infer.proposers.autoregressive import AutoregressiveProposer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.tokens < 1:
        parser.error(f"--tokens must be at least 1, got {args.tokens}")
    torch.set_num_threads(1)
    config = LlamaConfig(vocab_size=2000, hidden_size=64, intermediate_size=128, num_hidden_layers=30,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model = MedusaModel.from_base(base, num_heads=3)
    ids = torch.randint(3, 2000, (1, 100))
    n = args.tokens
    growing_update = kv_cache.GrowingLayer.update

    def ar() -> list[int]:
        return generate(model, ids, max_new_tokens=n, proposer=AutoregressiveProposer(model),
                        eos_token_id=[]).new_tokens[0]

    def ar_dynamic() -> list[int]:
        kv_cache.GrowingLayer.update = DynamicLayer.update
        try:
            return ar()
        finally:
            kv_cache.GrowingLayer.update = growing_update

    def hf() -> list[int]:
        with torch.inference_mode():
            out = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()

    def forwards() -> list[int]:
        tokens = []
        with torch.inference_mode():
            cache = DynamicCache(config=config)
            key = kv_cache.cache_keyword(base)
            token = base(ids, **{key: cache}).logits[:, -1:].argmax(-1)
            tokens.append(int(token))
            for _ in range(n - 1):
                token = base(token, **{key: cache}).logits[:, -1:].argmax(-1)
                tokens.append(int(token))
        return tokens

    runs = {"ar": ar, "ar-dynamic": ar_dynamic, "hf": hf, "forwards": forwards}
    outputs = {name: run() for name, run in runs.items()}  # also a warm-up
    if any(tokens != outputs["hf"] for tokens in outputs.values()):
        raise SystemExit(f"outputs differ: {outputs}")
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / n * 1000)
    hf_ms = statistics.median(times["hf"])
    for name, values in times.items():
        ms = statistics.median(values)
        print(f"{name:>10}: {ms:.3f} ms/token (median of {args.rounds}), {ms / hf_ms:.3f}x hf's time")


if __name__ == "__main__":
    main()
