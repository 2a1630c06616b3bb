"""Which scaled-dot-product-attention kernels a decoding forward uses.

Grouped-query attention with a mask (``sdpa_gqa``)
--------------------------------------------------
Verifying a tree needs a 4D attention mask (each candidate sees only its ancestors). With a mask
and more than one new token, transformers' ``sdpa`` attention copies every key/value head once per
query head it serves (``repeat_kv``) before calling PyTorch: for the default model (9 query
heads on 3 key/value heads) that writes three times the layer's whole KV cache at every layer of
every tree step, and the cost grows with the context. Plain decoding steps pass no mask and
PyTorch reads the shared heads in place (``enable_gqa``). ``SDPA_GQA`` is transformers'
``sdpa`` registered under another name (``AttentionInterface``, with ``sdpa``'s mask function),
except that a CPU inference forward with a mask also calls PyTorch with ``enable_gqa=True``:
the same kernel on the same numbers, without the copy. Measured with ``scripts/bench_attention.py``
(PyTorch 2.13, 2 CPU threads, one layer of the default model; docs/attention/bench_attention.log):
3 new tokens over 260 cached took 114 us with ``repeat_kv`` and 49 us without, over 1400 cached
740 and 197 us, with identical outputs; a whole 3-token forward over 1400 cached tokens, 85.7 ms
and 66.6 ms. A masked one-token step (a padded batch) also reads the heads in place, where
transformers folds the query heads instead: the same numbers to float rounding, not bit for bit.
``load_base_model`` sets it where transformers would choose ``sdpa``, for the model types of
``SDPA_GQA_MODEL_TYPES``; anything else (other devices, training, attention with a position bias
or soft-capping) runs transformers' ``sdpa`` unchanged.

CUDA: no cuDNN attention while decoding
---------------------------------------
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
from typing import Any, ContextManager

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SDPA_GQA = "sdpa_gqa"
"""The attention implementation ``load_base_model`` sets where transformers would use ``sdpa``."""

SDPA_GQA_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma3_text"})
"""The model types ``load_base_model`` gives ``SDPA_GQA`` (tested here). Others keep ``sdpa``: some
modeling files test the implementation's name (sparse top-k masks taken only under ``"sdpa"`` or
``"eager"``, a query slice guarded by ``== "sdpa"``), and another name would silently skip them."""

DECODING_SDPA_BACKENDS: tuple[SDPBackend, ...] = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)


SOFT_CAPPED_ATTENTION_TYPES = frozenset({"gemma2", "vaultgemma", "t5gemma"})
"""The model types whose attention applies ``attn_logit_softcapping`` (transformers passes it as ``softcap``),
which sdpa drops: Gemma 3's config holds the field, and its attention ignores it."""


def soft_caps_attention(config: Any) -> bool:
    """Whether a model of ``config`` soft-caps its attention scores (``SOFT_CAPPED_ATTENTION_TYPES``)."""
    text = config.get_text_config()
    return text.model_type in SOFT_CAPPED_ATTENTION_TYPES and bool(getattr(text, "attn_logit_softcapping", None))


def decoding_attention(device: torch.device | str) -> ContextManager[None]:
    """The attention kernels for an inference forward on ``device`` (see the module docstring):
    ``DECODING_SDPA_BACKENDS`` on a CUDA device with gradients off, else PyTorch's own choice."""
    if torch.device(device).type != "cuda" or torch.is_grad_enabled():
        return contextlib.nullcontext()
    return sdpa_kernel(list(DECODING_SDPA_BACKENDS))


def sdpa_gqa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention (same arguments: ``query`` ``[batch, heads, new, dim]``,
    ``key`` and ``value`` ``[batch, kv_heads, slots, dim]``), except that a masked CPU inference
    forward of grouped-query attention reads each key/value head in place (``enable_gqa``) instead
    of copying it once per query head (see the module docstring). Returns ``([batch, new, heads,
    dim], None)``. Attention soft-capping is refused, as transformers' ``sdpa`` does since 5.18 (5.17's dropped the
    cap without a word)."""
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{SDPA_GQA} attention has no soft-capping (softcap={kwargs['softcap']}), which would be "
                         "dropped: load the model with attn_implementation='eager'")
    if (query.device.type != "cpu" or attention_mask is None or torch.is_grad_enabled()
            or getattr(module, "num_key_value_groups", 1) <= 1 or key.shape[-1] != value.shape[-1]
            or kwargs.get("position_bias") is not None or kwargs.get("output_attentions", False)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # a mask is given, so transformers' sdpa would not pass is_causal either
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(SDPA_GQA, sdpa_gqa_attention)
AttentionMaskInterface.register(SDPA_GQA, sdpa_mask)
