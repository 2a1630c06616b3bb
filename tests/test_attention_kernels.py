"""The attention kernels decoding forwards run on: shared key/value heads read in place under a tree
mask (``sdpa_gqa``); no cuDNN attention on CUDA, PyTorch's choice elsewhere.

PyTorch's kernel switches are process-wide flags, so these tests read them on the CPU too; the GPU
test (tests/test_cuda.py) checks the same during a real CUDA generation.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from medusa_infer.attention_kernels import SDPA_GQA, decoding_attention, sdpa_gqa_attention
from medusa_infer.decoding import generate
from medusa_infer.kv_cache import AttentionLayout, KVState
from medusa_infer.model import MedusaModel
from medusa_infer.trees import TREE_PRESETS, build_tree_buffers
from tiny import VOCAB, sliding_window_base, tiny_model

GQA_ARCHS = ("llama", "qwen3", "gemma3_text")  # tiny configs: 4 query heads on 2 key/value heads


@pytest.fixture
def repeat_kv_calls(monkeypatch) -> dict[str, int]:
    """Counts transformers' copies of key/value heads (``repeat_kv`` in its sdpa attention)."""
    import transformers.integrations.sdpa_attention as sdpa

    calls = {"n": 0}
    original = sdpa.repeat_kv

    def counted(hidden, n_rep):
        calls["n"] += 1
        return original(hidden, n_rep)

    monkeypatch.setattr(sdpa, "repeat_kv", counted)
    return calls


def tree_logits(model: MedusaModel, implementation: str) -> torch.Tensor:
    """Logits of a 16-node tree verified over a 7-token prompt, with ``implementation``."""
    model.base_model.set_attn_implementation(implementation)
    layout = AttentionLayout.from_config(model.base_model.config)
    kv = KVState.empty(1, layout, torch.device("cpu"))
    prompt = torch.arange(3, 10)[None]
    positions = torch.arange(7)[None]
    valid = torch.ones_like(positions, dtype=torch.bool)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    with torch.inference_mode():
        model(prompt, attention_mask=kv.attention_mask(positions, valid, causal, torch.float32),
              position_ids=positions, cache=kv.cache, logits_positions=slice(-1, None))
        kv.append(valid, positions)
        tree = build_tree_buffers(TREE_PRESETS["tree-16"], 4, 10)
        tokens = torch.randint(3, VOCAB, (1, tree.num_nodes), generator=torch.Generator().manual_seed(0))
        new_positions = 7 + tree.depths[None]
        mask = kv.attention_mask(new_positions, torch.ones_like(new_positions, dtype=torch.bool), tree.attn_mask,
                                 torch.float32)
        return model(tokens, attention_mask=mask, position_ids=new_positions, cache=kv.cache).logits


@pytest.mark.parametrize("arch, window", [(a, None) for a in GQA_ARCHS] + [("mistral", 4), ("gemma3_text", 4)])
def test_sdpa_gqa_verifies_a_tree_as_sdpa_does_without_copying_heads(arch, window, repeat_kv_calls):
    base = tiny_model(arch, attn_implementation="sdpa") if window is None else \
        sliding_window_base(arch, window, attn_implementation="sdpa")
    model = MedusaModel.without_heads(base)
    expected = tree_logits(model, "sdpa")
    assert repeat_kv_calls["n"] > 0  # transformers' sdpa copies the shared heads under a mask
    repeat_kv_calls["n"] = 0
    found = tree_logits(model, SDPA_GQA)
    assert repeat_kv_calls["n"] == 0
    assert torch.equal(found, expected)


def test_sdpa_gqa_leaves_training_to_transformers_sdpa(repeat_kv_calls):
    model = tiny_model("llama", attn_implementation="sdpa").train()
    model.set_attn_implementation(SDPA_GQA)
    ids = torch.tensor([[3, 4, 5, 6], [0, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])  # padding: transformers builds a 4D mask
    loss = model(ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert repeat_kv_calls["n"] > 0
    assert all(p.grad is not None for p in model.model.layers[0].self_attn.parameters())


@pytest.mark.parametrize("arch", GQA_ARCHS)
def test_greedy_medusa_decoding_on_sdpa_gqa_is_identical_to_generate_on_sdpa(arch):
    model = MedusaModel.from_base(tiny_model(arch, attn_implementation="sdpa"), num_heads=4, num_layers=1)
    torch.manual_seed(1)
    for p in model.heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator) for n in (3, 9, 14)]
    for prompt in prompts:
        model.base_model.set_attn_implementation("sdpa")
        reference = model.base_model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None],
                                              max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
        model.base_model.set_attn_implementation(SDPA_GQA)
        out = generate(model, prompt[None], max_new_tokens=20, tree="tree-16", eos_token_id=[])
        assert out.new_tokens[0] == reference[0, len(prompt):].tolist()
    # a padded batch: every step is masked, one-token steps included (the same numbers to float
    # rounding there, where transformers folds the query heads instead)
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = (torch.arange(width)[None] >= width - torch.tensor([len(p) for p in prompts])[:, None]).long()
    out = generate(model, ids, attention_mask=mask, max_new_tokens=20, tree="tree-16", eos_token_id=[])
    model.base_model.set_attn_implementation("sdpa")
    for row, prompt in enumerate(prompts):
        reference = model.base_model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None],
                                              max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert out.new_tokens[row] == reference[0, len(prompt):].tolist(), f"row {row}"


def switches() -> tuple[bool, bool, bool, bool]:
    b = torch.backends.cuda
    return b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()


def test_cuda_inference_runs_without_cudnn_attention_and_restores_the_switches():
    before = switches()
    with torch.no_grad(), decoding_attention("cuda"):
        assert switches() == (False, True, True, True)
    assert switches() == before


@pytest.mark.parametrize("device, grad", [("cpu", False), ("cuda:0", True)])
def test_cpu_and_training_keep_pytorchs_choice(device, grad):
    before = switches()
    with torch.set_grad_enabled(grad), decoding_attention(device):
        assert switches() == before


def test_the_switches_come_back_after_an_error_inside():
    before = switches()
    with pytest.raises(RuntimeError), torch.no_grad(), decoding_attention("cuda"):
        raise RuntimeError("a forward failed")
    assert switches() == before


def test_every_decoding_forward_runs_inside_the_choice(monkeypatch):
    """A spy in place of ``decoding_attention``: the base decoder is only ever called inside it."""
    depth = {"now": 0, "calls": 0, "attention": 0, "outside": 0}

    @contextlib.contextmanager
    def spy(device):
        assert torch.device(device).type == "cpu"  # the device of the forward's inputs
        depth["now"] += 1
        depth["calls"] += 1
        try:
            yield
        finally:
            depth["now"] -= 1

    monkeypatch.setattr("medusa_infer.model.decoding_attention", spy)
    model = MedusaModel.from_base(tiny_model("llama"), num_heads=2, num_layers=1)

    def hook(module, args):
        depth["attention"] += 1
        depth["outside"] += depth["now"] == 0

    attention = [m for name, m in model.base_model.named_modules() if name.endswith("self_attn")]
    handles = [m.register_forward_pre_hook(hook) for m in attention]
    try:
        out = generate(model, torch.tensor([[5, 6, 7, 8]]), max_new_tokens=6, eos_token_id=[])
    finally:
        for handle in handles:
            handle.remove()
    assert len(out.new_tokens[0]) == 6
    assert depth["calls"] > 1 and depth["attention"] >= len(attention) * depth["calls"]
    assert depth["outside"] == 0



def test_sdpa_gqa_refuses_soft_capping_as_sdpa_does():
    """A forward with attention soft-capping is refused: read in place with enable_gqa, or left to transformers'
    sdpa (which refuses it since 5.18, and dropped it in 5.17, the oldest this project takes), the cap would be
    silently dropped."""
    from torch import nn

    module = nn.Module()
    module.num_key_value_groups = 2
    query, key = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    mask = torch.zeros(1, 1, 3, 5)
    with torch.no_grad(), pytest.raises(ValueError, match="has no soft-capping \\(softcap=50.0\\), which would be "
                                                          "dropped: load the model with attn_implementation='eager'"):
        sdpa_gqa_attention(module, query, key, key, mask, softcap=50.0)
    with pytest.raises(ValueError, match="softcap=50.0"):  # with gradients: transformers' own sdpa
        sdpa_gqa_attention(module, query, key, key, mask, softcap=50.0)
