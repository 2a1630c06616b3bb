"""Prefill and plain decoding cost with an explicit 4D attention mask against the model's own masks.

``KVState.attention_mask`` leaves an unpadded causal prefill, and a plain decoding step that may
attend every slot, to the model (it returns None); this script measures what that saves,
interleaving both paths, and checks that the logits (prefill) and greedy tokens (decoding) agree.

    python scripts/bench_prefill.py --tokens 1000 --repeats 5
    python scripts/bench_prefill.py --tokens 200 --decode-steps 64 --repeats 10
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
    parser.add_argument("--decode-steps", type=int, default=0,
                        help="also time this many plain decoding steps after the prefill, each way")
    args = parser.parse_args()
    for flag, value, least in (("--tokens", args.tokens, 1), ("--repeats", args.repeats, 1),
                               ("--decode-steps", args.decode_steps, 0)):
        if value < least:
            parser.error(f"{flag} must be at least {least}, got {value}")
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
    if args.decode_steps:
        decode(model, ids, args.decode_steps, args.repeats)


def decode(model: MedusaModel, ids: torch.Tensor, steps: int, repeats: int) -> None:
    """Time ``steps`` greedy plain steps after a prefill of ``ids``, with a 4D mask allowing every
    slot (what such a step got before) and with the model's own masks, interleaved."""
    layout = AttentionLayout.from_config(model.base_model.config)
    n = ids.shape[1]
    with torch.inference_mode():
        kv = KVState.empty(1, layout, torch.device("cpu"))
        positions = torch.arange(n)[None]
        out = model(ids, position_ids=positions, cache=kv.cache, logits_positions=slice(-1, None))
        kv.append(torch.ones(1, n, dtype=torch.bool), positions)
        first = out.logits[:, -1].argmax(-1)
        one = torch.ones(1, 1, dtype=torch.bool)

        def run(explicit: bool) -> tuple[float, list[int]]:
            state = kv.copy()
            token, tokens = first, []
            start = time.perf_counter()
            for step in range(steps):
                position = torch.full((1, 1), n + step)
                mask = state.attention_mask(position, one, one, torch.float32)
                if explicit:
                    zeros = torch.zeros(1, 1, 1, state.num_slots + 1)
                    mask = {t: zeros for t in layout.windows} if layout.as_dict else zeros
                logits = model(token[:, None], attention_mask=mask, position_ids=position, cache=state.cache).logits
                state.append(one, position)
                token = logits[:, -1].argmax(-1)
                tokens.append(int(token))
            return time.perf_counter() - start, tokens

        run(True), run(False)  # warm-up
        times: dict[bool, float] = {True: 0.0, False: 0.0}
        same = True
        for repeat in range(repeats):
            results = {explicit: run(explicit) for explicit in ((True, False) if repeat % 2 else (False, True))}
            for explicit, (seconds, _) in results.items():
                times[explicit] += seconds
            same &= results[True][1] == results[False][1]
    print(f"{steps} plain decoding steps after {n} tokens, total of {repeats}: explicit 4D mask {times[True]:.2f} s, "
          f"model's own masks {times[False]:.2f} s, ratio {times[True] / times[False]:.3f}; "
          f"same tokens: {'yes' if same else 'no'}")


if __name__ == "__main__":
    main()
