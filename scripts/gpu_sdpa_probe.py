"""Milliseconds per token of decoding on a CUDA GPU, first pass and warm, with or without cuDNN attention.

    python scripts/gpu_sdpa_probe.py HEADS_DIR --cudnn allow   # PyTorch's own kernel choice
    python scripts/gpu_sdpa_probe.py HEADS_DIR --cudnn off     # no cuDNN attention anywhere

Run each mode in its own process: PyTorch keeps cuDNN's execution plans for the life of a process,
so the first round of a process is the cold one. Each round decodes 64 new tokens of one
Spec-Bench prompt (the base model in bfloat16) three ways: our loop with plain decoding (``ar``),
our loop with the heads' tree (``medusa``), and Hugging Face ``generate`` (``hf``); it prints
milliseconds per new token. ``allow`` lifts medusa-forge's own restriction too
(``medusa_infer.attention_kernels``), so it shows what the restriction avoids; ``off`` switches
cuDNN attention off for the whole process, ``generate`` included. The log in
``docs/gpu/sdpa_probe.log`` (cited by ``medusa_infer/attention_kernels.py`` and the README's "On a
GPU") came from an earlier form of this script with the same measurement and no ``round`` labels;
this form has not run on a GPU yet.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("heads", help="a trained heads folder (its base model must be in the model cache)")
    parser.add_argument("--cudnn", choices=("allow", "off"), required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--questions", default="data/specbench.jsonl")
    parser.add_argument("--question-index", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_sdpa_probe: no CUDA device; this probe measures GPU attention kernels")

    from medusa_infer import model as model_module
    from medusa_infer.decoding import generate
    from medusa_infer.model import MedusaModel
    from medusa_infer.models import load_base_model, load_tokenizer
    from medusa_infer.proposers.autoregressive import AutoregressiveProposer

    if args.cudnn == "off":
        torch.backends.cuda.enable_cudnn_sdp(False)
    else:  # PyTorch's own choice in our forwards too
        model_module.decoding_attention = lambda device: contextlib.nullcontext()
    from medusa_infer.interop import base_model_name  # (an export's medusa_forge_base_model: the model loaded)

    name = base_model_name(args.heads)
    base = load_base_model(name, dtype=torch.bfloat16, device="cuda")
    # the tokenizer through from_pretrained: it gets the chat template the heads were trained on, if they carry one
    model = MedusaModel.from_pretrained(args.heads, base_model=base, tokenizer=load_tokenizer(name))
    model = model.to("cuda", torch.bfloat16)
    tokenizer = model.tokenizer
    with open(args.questions) as f:
        question = [json.loads(line) for line in f][args.question_index]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question["turns"][0]}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    plain = AutoregressiveProposer
    runs = {
        "ar": lambda: generate(model, ids, max_new_tokens=args.tokens, proposer=plain(model)).new_tokens[0],
        "medusa": lambda: generate(model, ids, max_new_tokens=args.tokens).new_tokens[0],
        "hf": lambda: model.base_model.generate(ids.cuda(), attention_mask=torch.ones_like(ids).cuda(),
                                                max_new_tokens=args.tokens, do_sample=False)[0, ids.shape[1]:],
    }
    print(f"cuDNN attention: {args.cudnn}; {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for round_ in range(args.rounds):
        for method, run in runs.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            n = len(run())
            torch.cuda.synchronize()
            print(f"round {round_}: {method}: {(time.perf_counter() - start) / n * 1000:.1f} ms/token, {n} tokens",
                  flush=True)


if __name__ == "__main__":
    main()
