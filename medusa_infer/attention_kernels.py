"""Which scaled-dot-product-attention kernels a decoding forward may use on a CUDA device.

PyTorch picks a kernel for each ``F.scaled_dot_product_attention`` call among cuDNN's,
FlashAttention, memory-efficient attention and the math fallback. On Hopper GPUs recent PyTorch
versions try cuDNN's first, and cuDNN builds an execution plan for each new shape it meets.
Decoding meets a new shape at nearly every step (the key length grows by the tokens accepted),
so until a process has seen every length it pays for plans, not for attention. Measured on an
H200 (PyTorch 2.11 with CUDA 13.0, bfloat16, SmolLM2-135M, batch 1, 64 new tokens of one
Spec-Bench prompt; the log is ``docs/gpu/sdpa_probe.log``, ``scripts/gpu_sdpa_probe.py`` measures
the same): with cuDNN allowed, our loop took 108.5 ms a token on a process's first pass and 21.7
ms on the second; with cuDNN attention off, 28.4 ms on the first and 20.2 and 23.1 ms on the next
two. In the first benchmark run on that GPU, Hugging Face ``generate`` decoded 16 to 24 tokens/s
over its first two questions (``docs/gpu/first-run/gpu_bench.log``); a later run with cuDNN
attention off, on other settings, measured 56 (``docs/gpu/batch1/``).

``decoding_attention(device)`` is the one place that choice is made: a context manager that, on
a CUDA device and for inference (no gradients), allows FlashAttention, memory-efficient attention
and the math kernel, and not cuDNN's. ``MedusaModel.forward`` runs the base decoder inside it, so
every decoding method, draft model and cost measurement of this package uses the same kernels;
``medusa-bench`` runs Hugging Face ``generate`` inside it too, so that its baseline is timed on
the same kernels as ours, and so does self-distillation (``medusa_train.distill``). Training
(gradients on) and CPU forwards are left to PyTorch's choice.

PyTorch's switches are process-wide, not per thread. The restriction is set and undone around
each forward, so nothing outside a forward sees it, as long as forwards do not run in several
threads at once (the server runs every forward on its one engine thread). Were they to overlap,
cuDNN attention could stay off after both: a matter of speed (and of bfloat16 rounding), not of
correctness.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

DECODING_SDPA_BACKENDS: tuple[SDPBackend, ...] = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)


def decoding_attention(device: torch.device | str) -> ContextManager[None]:
    """The attention kernels for an inference forward on ``device`` (see the module docstring):
    ``DECODING_SDPA_BACKENDS`` on a CUDA device with gradients off, else PyTorch's own choice."""
    if torch.device(device).type != "cuda" or torch.is_grad_enabled():
        return contextlib.nullcontext()
    return sdpa_kernel(list(DECODING_SDPA_BACKENDS))
