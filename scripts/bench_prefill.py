"""Prefill cost with an explicit 4D attention mask against the model's own causal masks.

``KVState.attention_mask`` leaves an unpadded causal prefill to the model (it returns None); this
script measures what that saves, interleaving both paths, and checks that the logits agree.

    python scripts/bench_prefill.py --tokens 1000 --repeats 5
"""

from __future__ import annotations

import argparse
import time

import torch

from medusa_infer.kv_cache import AttentionLayout, KVState
from medusa_infer.model import MedusaModel
from medusa_infer.models import load_base_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    base = load_base_model(args.model, dtype=torch.float32, device="cpu")
    model = MedusaModel.without_heads(base)
    n = args.tokens
    ids = torch.randint(100, base.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    valid = torch.ones(1, n, dtype=torch.bool)
    positions = torch.arange(n)[None]
    causal = torch.ones(n, n, dtype=torch.bool).tril()

    def prefill(explicit: bool) -> tuple[float, torch.Tensor]:
        kv = KVState.empty(1, AttentionLayout.from_config(base.config), torch.device("cpu"))
        # a per-row [1, n, n] causal mask is never left to the model: it forces the 4D mask
        mask = kv.attention_mask(positions, valid, causal[None] if explicit else causal, torch.float32)
        start = time.perf_counter()
        out = model(ids, attention_mask=mask, position_ids=positions, cache=kv.cache, logits_positions=slice(-1, None))
        return time.perf_counter() - start, out.logits

    with torch.inference_mode():
        prefill(True), prefill(False)  # warm-up
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for explicit in (True, False):
                seconds, logits = prefill(explicit)
                times[explicit].append(seconds)
                if explicit:
                    reference = logits
        difference = (reference - logits).abs().max().item()
    explicit, own = (sorted(times[k])[len(times[k]) // 2] for k in (True, False))
    print(f"{n}-token prefill, median of {args.repeats}: explicit 4D mask {explicit:.3f} s, model's own masks "
          f"{own:.3f} s, ratio {explicit / own:.3f}; max |logit difference| {difference:.2e}")


if __name__ == "__main__":
    main()
