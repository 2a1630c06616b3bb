"""oneDNN matrix products for a model's ``nn.Linear`` layers on the CPU (inference only).

Verifying a tree costs one forward over n new tokens. On a CPU that forward is a chain of
matrix products with n rows, and PyTorch's default float32 kernel (MKL's ``sgemm``) is much
slower for 2 to 16 rows than for one, on the AMD machines this project runs on at least. oneDNN's
kernels (the ones PyTorch's own compiler uses for CPU linear layers) stay close to the cost of
reading the weights once, so verifying a few tokens costs little more than decoding one, and
one-token decoding gets faster too (``medusa-bench --calibrate`` prints the measured cost of n
tokens; ``--cpu-kernels default`` measures PyTorch's own). ``use_onednn_linear`` switches a
loaded model's linear layers to them, in place:

* each ``nn.Linear`` becomes a ``OneDNNLinear`` (a subclass; same parameters, same state dict,
  tied weights stay tied), so ``model.generate`` and every method of this package use them;
* only float32 inference on the CPU takes the oneDNN path; with gradients enabled (training),
  other dtypes or devices, a layer computes ``F.linear`` as before.

Results agree with ``F.linear`` to float32 rounding (neither kernel gives bit-identical rows for
different numbers of rows). ``restore_linear`` undoes the switch. ``load_base_model`` applies it
to float32 CPU models unless told ``cpu_kernels="default"``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional as F

logger = logging.getLogger(__name__)

CPU_KERNELS = ("onednn", "default")


def _pointwise_op():
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if mkldnn is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        return mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_LINEAR = _pointwise_op()


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on oneDNN for float32 CPU inference (else ``F.linear``)."""
    if (_LINEAR is None or torch.is_grad_enabled() or x.device.type != "cpu"
            or x.dtype != torch.float32 or weight.dtype != torch.float32):
        return F.linear(x, weight, bias)
    return _LINEAR(x.contiguous(), weight, bias, "none", [], "")


class OneDNNLinear(nn.Linear):
    """``nn.Linear`` whose float32 CPU inference runs on oneDNN (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.weight, self.bias)


def onednn_works() -> bool:
    """Whether this PyTorch build has oneDNN's linear kernel and it agrees with ``F.linear``."""
    if _LINEAR is None:
        return False
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, 16, generator=generator), torch.randn(24, generator=generator)
    x = torch.randn(2, 3, 16, generator=generator)
    try:
        with torch.no_grad():
            found = _LINEAR(x, weight, bias, "none", [], "")
    except RuntimeError as err:
        logger.warning("oneDNN linear kernel unavailable (%s); keeping PyTorch's default kernels", err)
        return False
    return bool(torch.allclose(found, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4))


def use_onednn_linear(model: nn.Module) -> int:
    """Switch every plain ``nn.Linear`` of ``model`` to ``OneDNNLinear`` in place; returns how many.

    Returns 0 (and changes nothing) when this PyTorch build lacks a working oneDNN kernel.
    """
    if not onednn_works():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            count += 1
    return count


def restore_linear(model: nn.Module) -> int:
    """Undo ``use_onednn_linear``; returns how many layers went back to ``nn.Linear``."""
    count = 0
    for module in model.modules():
        if type(module) is OneDNNLinear:
            module.__class__ = nn.Linear
            count += 1
    return count


def linear_kernels(model: nn.Module) -> str:
    """``"onednn"`` when ``model`` has layers switched by ``use_onednn_linear``, else ``"default"``."""
    return "onednn" if any(isinstance(m, OneDNNLinear) for m in model.modules()) else "default"


def apply_cpu_kernels(model: nn.Module, kernels: str) -> int:
    """``kernels="onednn"``: ``use_onednn_linear`` when the model is float32 on the CPU (else
    nothing); ``"default"``: PyTorch's own kernels. Returns the number of layers switched."""
    if kernels not in CPU_KERNELS:
        raise ValueError(f"cpu_kernels must be one of {CPU_KERNELS}, got {kernels!r}")
    parameter = next(model.parameters(), None)
    if kernels == "default" or parameter is None:
        return 0
    if parameter.device.type != "cpu" or parameter.dtype != torch.float32:
        return 0
    return use_onednn_linear(model)
