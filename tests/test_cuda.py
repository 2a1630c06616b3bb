"""The engine on a CUDA device: greedy exactness, batching, every proposer, lossless sampling, bfloat16.

These tests skip without a CUDA device (CI has none); on a GPU machine run ``pytest tests/test_cuda.py``
(``scripts/gpu_bench.sh`` runs them before its benchmark); ``MEDUSA_TEST_DEVICE=cpu`` runs them on the CPU,
a dry run of the tests themselves. The CPU suite checks the same rules in
depth; here they are checked where the kernels differ: CUDA's scaled-dot-product attention with
our 4D tree masks, sampling with a CUDA generator, and bfloat16 arithmetic.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from scipy.stats import chi2

from medusa_infer.acceptance import warp_logits
from medusa_infer.attention_kernels import decoding_attention
from medusa_infer.decoding import generate, left_pad
from medusa_infer.model import MedusaModel
from medusa_infer.proposers.draft import DraftProposer
from medusa_infer.proposers.lookup import LookupProposer
from tiny import VOCAB, tiny_model

CUDA = torch.device(os.environ.get("MEDUSA_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(CUDA.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")
NO_EOS: list[int] = []


def cuda_medusa(arch: str, attn: str = "sdpa", dtype: torch.dtype = torch.float32, vocab_size: int = VOCAB,
                seed: int = 0) -> MedusaModel:
    """A tiny model with random heads (partly right, so trees get accepted), on the GPU."""
    model = MedusaModel.from_base(tiny_model(arch, seed=seed, attn_implementation=attn, vocab_size=vocab_size),
                                  num_heads=4, num_layers=1)
    torch.manual_seed(seed + 1)
    for p in model.heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model.to(CUDA, dtype)


def hf_greedy(model: MedusaModel, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Hugging Face greedy decoding of one unpadded prompt, on the model's device and on the
    attention kernels our loop uses (so that bfloat16 comparisons compare like with like)."""
    ids = prompt[None].to(model.device)
    with torch.no_grad(), decoding_attention(model.device):
        out = model.base_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return left_pad([p.tolist() for p in prompts], pad_token_id=0)


def prompts_of(lengths: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "gpt2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_float32_greedy_batch_identical_to_generate(arch, attn):
    model = cuda_medusa(arch, attn)
    prompts = prompts_of((3, 12, 7, 1, 9))
    ids, mask = padded(prompts)
    for tree in ("tree-16", "chain-3"):
        out = generate(model, ids, attention_mask=mask, max_new_tokens=24, tree=tree, eos_token_id=NO_EOS,
                       speculation_gate=False, adaptive=False)
        for row, prompt in enumerate(prompts):
            assert out.new_tokens[row] == hf_greedy(model, prompt, 24), f"{tree}, row {row}"
        assert out.sequences.device == model.device  # as model.generate's (they were on the CPU)
        assert torch.equal(out.sequences[:, :ids.shape[1]], ids.to(model.device))
        if tree == "tree-16":
            assert out.metrics.tau > 1.0, "random heads still get some drafts accepted"


@pytest.mark.parametrize("method", ["draft", "lookup"])
def test_classic_proposers_greedy_identical_to_generate(method):
    model = cuda_medusa("llama")
    prompts = [torch.tensor([5, 6, 7, 8, 9, 10] * 3), *prompts_of((4, 11))]
    ids, mask = padded(prompts)
    proposer = (DraftProposer(model, model.base_model, num_tokens=4) if method == "draft"
                else LookupProposer(model, num_tokens=5, max_ngram=3))
    out = generate(model, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=NO_EOS, proposer=proposer,
                   speculation_gate=False)
    assert out.new_tokens == [hf_greedy(model, p, 30) for p in prompts]
    # the self-draft is always right; lookup drafts are right on the repetitive row alone
    assert out.metrics.tau > (4.0 if method == "draft" else 1.1)


@pytest.mark.skipif(CUDA.type != "cuda", reason="a draft on another device than the target's")
def test_a_draft_on_the_cpu_samples_for_a_target_on_the_gpu():
    """The seeded generator lives on the target's device; the draft sampled with it on its own (torch
    refuses a generator of another device). A seed still gives the same answer."""
    model = cuda_medusa("llama")
    draft = tiny_model("llama", seed=3)  # on the CPU
    ids, mask = padded(prompts_of((5, 9)))
    runs = [generate(model, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=NO_EOS, do_sample=True,
                     temperature=1.0, seed=7, proposer=DraftProposer(model, draft, num_tokens=3)).new_tokens
            for _ in range(2)]
    assert runs[0] == runs[1] and all(len(row) == 12 for row in runs[0])


def test_lossless_sampling_has_the_model_distribution():
    """20,000 rows of one prompt sampled on the GPU through Medusa trees; a chi-square test of the
    first two tokens against the law enumerated with plain forwards (see test_lossless_engine)."""
    vocab, samples, prompt = 8, 20_000, torch.tensor([[3, 1, 4, 1, 5]])
    model = cuda_medusa("llama", vocab_size=vocab, seed=3)
    with torch.no_grad():
        logits = model.base_model(prompt.to(CUDA)).logits[0, -1].float()
    law: dict[tuple[int, ...], float] = {}
    first = warp_logits(logits[None], 0.8, 0, 1.0)[0]
    for a in range(vocab):
        ids = torch.cat([prompt, torch.tensor([[a]])], dim=1).to(CUDA)
        with torch.no_grad():
            second = warp_logits(model.base_model(ids).logits[0, -1:].float(), 0.8, 0, 1.0)[0]
        for b in range(vocab):
            law[(a, b)] = float(first[a] * second[b])
    out = generate(model, prompt.expand(samples, -1), max_new_tokens=4, do_sample=True, acceptance="lossless",
                   temperature=0.8, tree="tree-8", seed=0, eos_token_id=NO_EOS)
    assert out.metrics.tau > 1.2, "the heads must get tokens accepted for the test to mean anything"
    counts: dict[tuple[int, ...], int] = {}
    for tokens in out.new_tokens:
        counts[tuple(tokens[:2])] = counts.get(tuple(tokens[:2]), 0) + 1
    cells = [cell for cell, p in law.items() if samples * p >= 5]
    observed = [counts.get(c, 0) for c in cells] + [samples - sum(counts.get(c, 0) for c in cells)]
    expected = [samples * law[c] for c in cells] + [samples * (1 - sum(law[c] for c in cells))]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    assert chi2.sf(stat, len(observed) - 1) > 1e-3


def test_bfloat16_tree_decoding_leaves_the_models_greedy_path_only_at_near_ties():
    """In bfloat16 a tree forward and a one-token forward round differently, so where the top two
    logits nearly tie the pick can go the other way. Each row follows Hugging Face's bfloat16
    greedy output until such a tie: where it first differs, the model's own logits there rate our
    token within bfloat16 rounding of the best. A wrong tree mask or position breaks this."""
    model = cuda_medusa("llama", dtype=torch.bfloat16)
    prompts = prompts_of((3, 12, 7, 1, 9, 5, 10, 2), seed=1)
    ids, mask = padded(prompts)
    out = generate(model, ids, attention_mask=mask, max_new_tokens=24, tree="tree-16", eos_token_id=NO_EOS,
                   speculation_gate=False, adaptive=False)
    assert out.metrics.tau > 1.0
    same = 0
    for prompt, got in zip(prompts, out.new_tokens):
        want = hf_greedy(model, prompt, 24)
        if got == want:
            same += 1
            continue
        i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        context = torch.cat([prompt, torch.tensor(want[:i], dtype=torch.long)])[None].to(CUDA)
        with torch.no_grad():
            logits = model.base_model(context).logits[0, -1].float()
        gap = float(logits.max() - logits[got[i]])
        assert gap <= 0.02 * float(logits.abs().max()) + 0.05, (i, gap, got, want)
    assert same >= len(prompts) // 2, "near-ties are rare: most rows match exactly"


@pytest.mark.skipif(CUDA.type != "cuda", reason="the kernel choice applies on CUDA devices only")
def test_decoding_attention_runs_without_cudnn_and_leaves_the_switch_as_it_was():
    """medusa_infer.attention_kernels: no cuDNN attention inside decoding forwards, set and undone
    around each one."""
    model = cuda_medusa("llama")
    seen: list[bool] = []
    attention = [m for name, m in model.base_model.named_modules() if name.endswith("self_attn")]
    handles = [m.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
               for m in attention]
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        out = generate(model, torch.tensor([[5, 6, 7, 8]]), max_new_tokens=12, eos_token_id=NO_EOS)
    finally:
        for handle in handles:
            handle.remove()
    assert out.new_tokens[0] == hf_greedy(model, torch.tensor([5, 6, 7, 8]), 12)
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


# ---------------------------------------------------------------------------------------------
# Training through accelerate's GPU launch configs (recipes/accelerate/), one process on one GPU

LAUNCHES = [  # (config file, training mode, distributed types accelerate may report)
    ("ddp.yaml", "medusa1", ("MULTI_GPU", "NO")),  # one process may run without a process group
    ("deepspeed-zero2.yaml", "medusa1", ("DEEPSPEED",)),
    ("fsdp.yaml", "medusa2", ("FSDP",)),
    ("deepspeed-zero3.yaml", "medusa2", ("DEEPSPEED",)),
]


@pytest.mark.skipif(CUDA.type != "cuda", reason="accelerate's GPU launch configs need a CUDA device")
@pytest.mark.parametrize("config_file, mode, distributed", LAUNCHES, ids=[c for c, _, _ in LAUNCHES])
def test_accelerate_launch_config_trains_heads(config_file, mode, distributed, tmp_path):
    """``accelerate launch --config_file recipes/accelerate/X.yaml train_heads.py`` on one GPU with a
    tiny llama, in bfloat16 as the GPU recipes train: training runs to the end under that launcher
    (a checkpoint written half way), the loss falls, and the heads (and a Medusa-2 adapter) are saved,
    evaluated and load for decoding."""
    import json
    import re
    import sys

    from test_training import REPO, counting_examples, quiet_env, recipe, run_script, train_log, write_recipe

    if config_file.startswith("deepspeed"):
        pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")
    tiny = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(tiny / "model")
    with (tiny / "examples.jsonl").open("w") as handle:
        for example in counting_examples(64):
            handle.write(json.dumps(example) + "\n")
    out = tmp_path / "run"
    training = {"mixed_precision": "bf16", "max_steps": 8, "save_every": 4, "seed": 1, "lr": 0.03}
    if mode == "medusa2":
        training |= {"mode": "medusa2", "batch_size": 4, "stage1_steps": 2, "heads_warmup_steps": 2, "loss": "ce",
                     "gradient_checkpointing": True}
        values = recipe(tiny, out, training=training, lora={"r": 4, "target_modules": ["q_proj", "v_proj"]},
                        model={"dtype": "bfloat16"})
    else:
        values = recipe(tiny, out, training=training)
    env = quiet_env(tmp_path)
    env["CUDA_VISIBLE_DEVICES"] = str(CUDA.index or 0)
    result = run_script([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                         f"recipes/accelerate/{config_file}", "--num_processes", "1", "--main_process_port", "29541",
                         "train_heads.py", "--config", str(write_recipe(tmp_path / "r.yaml", values))],
                        env, timeout=150)
    reported = re.search(r"accelerate: (\w+) on (\w+)", result.stdout)
    assert reported and reported.groups() in {(d, "cuda") for d in distributed}, result.stdout[-2000:]
    log = train_log(out)
    assert [r["step"] for r in log] == list(range(1, 9))
    assert all(math.isfinite(r["loss"]) for r in log)
    assert log[-1]["loss"] < log[0]["loss"], [r["loss"] for r in log]
    assert (out / "heads" / "config.json").is_file()
    assert (out / "heads" / "adapter").is_dir() == (mode == "medusa2")
    from safetensors.torch import load_file

    saved = [out / "heads" / "model.safetensors"] + ([out / "heads" / "adapter" / "adapter_model.safetensors"]
                                                     if mode == "medusa2" else [])
    for path in saved:  # the optimizer's float32 weights, not the bfloat16 copies training computed with
        assert {t.dtype for t in load_file(path).values() if t.is_floating_point()} == {torch.float32}, path
    model = MedusaModel.from_pretrained(out / "heads", base_model=tiny_model("llama")).to(CUDA)
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    got = generate(model, prompt, max_new_tokens=8, eos_token_id=NO_EOS).new_tokens[0]
    assert got == hf_greedy(model, prompt[0], 8)
