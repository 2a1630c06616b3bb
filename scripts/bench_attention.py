"""Tree steps with transformers' ``sdpa`` attention against ``sdpa_gqa`` (``medusa_infer.attention_kernels``).

    python scripts/bench_attention.py [--model smollm2-135m-instruct] [--contexts 260 700 1400]
        [--sizes 1 3 5 9] [--repeats 200] [--rounds 8] [--threads 2]

1. One attention call of the model's shape (its heads, key/value heads and head size): ``n`` new
   queries under a 4D float mask over ``context`` slots, as transformers' ``sdpa`` makes it (each
   key/value head copied once per query head it serves, ``repeat_kv``) and as ``sdpa_gqa`` makes
   it (``enable_gqa``: the heads read in place). Prints each one's median microseconds and the
   largest difference between their outputs. (For one new token transformers folds the query
   heads instead of copying, and a plain decoding step passes no mask: those rows are for scale.)
2. The model's whole forward of ``n`` new tokens over ``context`` cached ones, under a causal 4D
   mask (``tree_fit.measure_verify_cost``, which calibration runs), with each implementation:
   ``--rounds`` short profiles of each (3 forwards per size), alternating and in alternating
   order, so a noisy machine slows both alike; the median over the rounds and the ratio. With one
   new token both run the same code (a plain step passes no mask), so that row shows the noise.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

from medusa_infer.attention_kernels import SDPA_GQA
from medusa_infer.model import MedusaModel
from medusa_infer.models import load_base_model
from medusa_infer.tree_fit import measure_verify_cost


def _median_us(fn, repeats: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def one_layer(config, contexts: list[int], sizes: list[int], repeats: int) -> None:
    text = config.get_text_config()
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    groups = heads // kv_heads
    print(f"one attention call: {heads} query heads on {kv_heads} key/value heads of {dim}")
    generator = torch.Generator().manual_seed(0)
    for context in contexts:
        for n in sizes:
            query = torch.randn(1, heads, n, dim, generator=generator)
            key, value = (torch.randn(1, kv_heads, context, dim, generator=generator) for _ in range(2))
            mask = torch.zeros(1, 1, n, context)
            mask[..., context - n:] = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)

            def repeated() -> torch.Tensor:
                k = key[:, :, None].expand(1, kv_heads, groups, context, dim).reshape(1, heads, context, dim)
                v = value[:, :, None].expand(1, kv_heads, groups, context, dim).reshape(1, heads, context, dim)
                return F.scaled_dot_product_attention(query, k, v, attn_mask=mask)

            def in_place() -> torch.Tensor:
                return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)

            with torch.inference_mode():
                diff = float((repeated() - in_place()).abs().max())
                a, b = _median_us(repeated, repeats), _median_us(in_place, repeats)
            print(f"  {n:2d} new over {context:5d} slots: repeat_kv {a:7.1f} us, enable_gqa {b:7.1f} us "
                  f"({a / b:.2f}x), max difference {diff:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--contexts", type=int, nargs="+", default=[260, 700, 1400])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 3, 5, 9])
    parser.add_argument("--repeats", type=int, default=200, help="calls timed per attention case")
    parser.add_argument("--rounds", type=int, default=8, help="short profiles of the whole forward per implementation")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if min(args.sizes) < 1 or max(args.sizes) > min(args.contexts) or args.threads < 1:  # (a RuntimeError of shapes)
        parser.error(f"--sizes must be at least 1 and at most the smallest of --contexts ({min(args.contexts)}), and "
                     f"--threads at least 1; got --sizes {args.sizes}, --threads {args.threads}")
    torch.set_num_threads(args.threads)
    model = MedusaModel.without_heads(load_base_model(args.model))
    one_layer(model.base_model.config, args.contexts, args.sizes, args.repeats)
    print(f"\nwhole forward, median ms over {args.rounds} rounds (interleaved) of the cost profiles, each of which "
          "raises a size's time to the largest of the smaller sizes' (never decreasing):")
    for context in args.contexts:
        times: dict[str, list[dict[int, float]]] = {"sdpa": [], SDPA_GQA: []}
        for round_ in range(args.rounds):
            for name in (("sdpa", SDPA_GQA) if round_ % 2 == 0 else (SDPA_GQA, "sdpa")):
                model.base_model.set_attn_implementation(name)
                profile = measure_verify_cost(model, args.sizes, context=context, repeats=3)
                # by size: the profile sorts the sizes and measures one token too
                times[name].append(dict(zip(profile.sizes, profile.seconds)))
        for n in args.sizes:
            a = statistics.median(s[n] for s in times["sdpa"]) * 1e3
            b = statistics.median(s[n] for s in times[SDPA_GQA]) * 1e3
            print(f"  {n:2d} new over {context:5d} cached: sdpa {a:6.1f} ms, {SDPA_GQA} {b:6.1f} ms ({a / b:.3f}x)")


if __name__ == "__main__":
    main()
