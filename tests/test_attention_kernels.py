"""The attention kernels decoding forwards run on: no cuDNN attention on CUDA, PyTorch's choice elsewhere.

PyTorch's kernel switches are process-wide flags, so these tests read them on the CPU too; the GPU
test (tests/test_cuda.py) checks the same during a real CUDA generation.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from medusa_infer.attention_kernels import decoding_attention
from medusa_infer.decoding import generate
from medusa_infer.model import MedusaModel
from tiny import tiny_model


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

