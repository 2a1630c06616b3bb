"""oneDNN linear kernels on the CPU: same results as F.linear, training untouched, decoding exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from medusa_infer.cpu_kernels import (
    OneDNNLinear,
    apply_cpu_kernels,
    linear_kernels,
    onednn_works,
    restore_linear,
    use_onednn_linear,
)
from medusa_infer.decoding import generate
from medusa_infer.model import MedusaModel
from tiny import VOCAB, tiny_model

pytestmark = pytest.mark.skipif(not onednn_works(), reason="this PyTorch build has no working oneDNN linear kernel")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (2, 7, 48)])
def test_results_match_f_linear(bias, shape):
    torch.manual_seed(0)
    layer = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        expected = layer(x)
        layer.__class__ = OneDNNLinear
        found = layer(x)
        strided = layer(x.transpose(-1, -2).contiguous().transpose(-1, -2))  # non-contiguous input
    assert found.shape == expected.shape
    torch.testing.assert_close(found, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(strided, expected, atol=1e-5, rtol=1e-5)


def test_training_still_gets_gradients():
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    layer.__class__ = OneDNNLinear
    layer(torch.randn(4, 16)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_switch_keeps_parameters_ties_and_state_dict_and_can_be_undone():
    model = tiny_model("llama")
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert linear_kernels(model) == "default"
    assert use_onednn_linear(model) == linears > 0
    assert linear_kernels(model) == "onednn"
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
    assert restore_linear(model) == linears
    assert all(type(m) is not OneDNNLinear for m in model.modules())


def test_only_float32_cpu_models_are_switched():
    assert apply_cpu_kernels(tiny_model("qwen3"), "onednn") > 0
    assert apply_cpu_kernels(tiny_model("qwen3"), "default") == 0
    assert apply_cpu_kernels(tiny_model("qwen3").to(torch.bfloat16), "onednn") == 0
    with pytest.raises(ValueError, match="cpu_kernels must be one of"):
        apply_cpu_kernels(tiny_model("qwen3"), "mkl")


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_greedy_decoding_stays_identical_to_generate(arch):
    model = MedusaModel.from_base(tiny_model(arch), num_heads=4, next_token_input=True)
    torch.manual_seed(1)
    for p in model.heads.parameters():
        nn.init.normal_(p, std=0.3)
    assert use_onednn_linear(model.base_model) > 0
    for n in (3, 8):
        prompt = torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n))
        out = generate(model, prompt[None], max_new_tokens=20, tree="tree-16", eos_token_id=[])
        hf = model.base_model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=20,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.new_tokens[0] == hf[0, n:].tolist()


@pytest.mark.parametrize("projection, reduced", [("shared", None), ("shared", 40), ("own", None)])
def test_heads_take_the_base_models_kernels_and_give_the_same_logits(projection, reduced):
    token_map = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:reduced] if reduced else None
    plain = MedusaModel.from_base(tiny_model("llama"), num_heads=3, num_layers=2, projection=projection,
                                  token_map=token_map, next_token_input=True)
    torch.manual_seed(0)
    for p in plain.heads.parameters():
        nn.init.normal_(p, std=0.3)
    hidden = torch.randn(2, 5, plain.base_model.config.hidden_size)
    following = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():
        expected = plain.head_logits(hidden, following)
    assert linear_kernels(plain.heads) == "default"
    use_onednn_linear(plain.base_model)
    switched = MedusaModel(plain.base_model, plain.heads)
    assert linear_kernels(switched.heads) == "onednn"
    with torch.no_grad():
        torch.testing.assert_close(switched.head_logits(hidden, following), expected, atol=1e-4, rtol=1e-4)
