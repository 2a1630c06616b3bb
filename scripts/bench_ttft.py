"""Time to the first token of layerskip self-speculation against plain decoding's, interleaved.

    python scripts/bench_ttft.py [--lengths 21 200 500] [--rounds 7]

A layerskip draft is the target's first N layers (a third by default): their keys and values over
the prompt are the target's, so the draft takes them from the target's cache after its prefill
(``DraftProposer.start``) instead of running a prefill of its own. This script times, round by round
and in turn, the first token (``GenerationMetrics.ttft_s``: the prefill, the proposer's start and
the first token's choice) of greedy ``generate`` on the default model with one real prompt cut or
repeated to each length, for:

* ``ar``: plain decoding (the floor: one prefill of the target);
* ``layerskip``: the draft's layers copied from the target's cache;
* ``layerskip-own-prefill``: the draft running its own prefill (what it did before).

It prints each one's median in milliseconds and the ratios to ``ar``. All three produce the same
first token (checked).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from medusa_infer.decoding import generate
from medusa_infer.model import MedusaModel
from medusa_infer.models import load_base_model, load_tokenizer
from medusa_infer.proposers import AutoregressiveProposer, LayerSkipProposer

PROMPT = ("Explain how speculative decoding speeds up a language model without changing its output, and what "
          "limits the speedup on a CPU compared with a GPU.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--lengths", type=int, nargs="+", default=[21, 200, 500])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.rounds < 1 or min(args.lengths) < 1:
        parser.error(f"--rounds and --lengths must be at least 1, got {args.rounds} and {args.lengths}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = MedusaModel.without_heads(load_base_model(args.model, dtype=torch.float32, device="cpu"),
                                      load_tokenizer(args.model))
    text_ids = model.tokenizer(PROMPT)["input_ids"]

    def proposer(method: str):
        if method == "ar":
            return AutoregressiveProposer(model)
        skip = LayerSkipProposer(model)
        if method == "layerskip-own-prefill":
            skip.shared_layers = 0
        return skip

    methods = ("ar", "layerskip", "layerskip-own-prefill")
    print(f"{args.model}, float32 on the CPU ({torch.get_num_threads()} threads), layerskip draft of "
          f"{LayerSkipProposer(model).num_layers} of {model.base_model.config.num_hidden_layers} layers; "
          f"median of {args.rounds} rounds")
    for length in args.lengths:
        ids = torch.tensor([(text_ids * (length // len(text_ids) + 1))[:length]])
        times: dict[str, list[float]] = {m: [] for m in methods}
        firsts = set()
        with torch.inference_mode():
            for round_ in range(args.rounds + 1):  # the first round warms up and is discarded
                for method in methods:
                    out = generate(model, ids, max_new_tokens=1, proposer=proposer(method))
                    firsts.add(out.new_tokens[0][0])
                    if round_:
                        times[method].append(out.metrics.ttft_s)
        if len(firsts) != 1:
            raise SystemExit(f"the methods chose different first tokens: {sorted(firsts)}")
        median = {m: statistics.median(t) * 1000 for m, t in times.items()}
        print(f"{length:4d} prompt tokens: " + ", ".join(f"{m} {median[m]:.1f} ms" for m in methods) + "; "
              + ", ".join(f"{m}/ar {median[m] / median['ar']:.3f}" for m in methods[1:]))


if __name__ == "__main__":
    main()
