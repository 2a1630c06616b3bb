"""Tiny random causal LMs of several architectures, built from configs (no downloads)."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase
from transformers import GPT2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

VOCAB = 96

#: transformers 5.20 and later encode a control token written in a chat message as text (before: refused)
sanitizes_control_tokens = pytest.mark.skipif(
    "sanitize_control_tokens" not in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters,
    reason="transformers before 5.20 has no sanitize_control_tokens (such messages are refused, tested apart)")

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gpt2")


def tiny_config(arch: str, vocab_size: int = VOCAB):
    if arch == "llama":
        return LlamaConfig(**{**_COMMON, "vocab_size": vocab_size})
    if arch == "mistral":
        return MistralConfig(**{**_COMMON, "vocab_size": vocab_size}, sliding_window=None)
    if arch == "qwen2":
        return Qwen2Config(**{**_COMMON, "vocab_size": vocab_size})
    if arch == "qwen3":
        return Qwen3Config(**{**_COMMON, "vocab_size": vocab_size}, head_dim=8)
    if arch == "gemma3_text":
        return Gemma3TextConfig(**{**_COMMON, "vocab_size": vocab_size}, head_dim=8, sliding_window=512, final_logit_softcapping=30.0)
    if arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=256,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
    raise ValueError(f"unknown tiny architecture {arch!r}; known: {ARCHITECTURES}")


def tiny_model(
    arch: str = "llama", seed: int = 0, attn_implementation: str = "eager", vocab_size: int = VOCAB
) -> PreTrainedModel:
    """A float32 tiny model with random weights; larger-than-default init so its outputs vary."""
    torch.manual_seed(seed)
    config = tiny_config(arch, vocab_size)
    config.initializer_range = 0.2
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.eval()


def sliding_window_base(arch: str, window: int, attn_implementation: str = "eager",
                        layer_types: list[str] | None = None) -> PreTrainedModel:
    """A tiny random ``arch`` model whose sliding-window layers see ``window`` positions
    (gemma3_text: one sliding layer, one full; qwen2, qwen3: ``use_sliding_window`` with ``layer_types``,
    as their configs derive them from ``max_window_layers``)."""
    config = tiny_config(arch)
    config.sliding_window = window
    if arch == "gemma3_text":
        config.layer_types = layer_types or ["sliding_attention", "full_attention"]
    elif arch in ("qwen2", "qwen3"):
        config.use_sliding_window = True
        config.layer_types = layer_types or ["sliding_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    config.initializer_range = 0.2
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()


def word_medusa(seed: int = 0):
    """A tiny llama with 3 random Medusa heads and the serving tests' word tokenizer: heads
    initialised large enough that their drafts are sometimes accepted."""
    from medusa_infer.model import MedusaModel
    from medusa_infer.serving.testing import word_tokenizer

    tokenizer = word_tokenizer()
    model = MedusaModel.from_base(tiny_model("llama", seed=seed, vocab_size=len(tokenizer)), num_heads=3,
                                  tokenizer=tokenizer)
    torch.manual_seed(seed + 1)
    for p in model.heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model


def metaspace_tokenizer():
    """The serving tests' words as a SentencePiece-style tokenizer (``▁`` marks a word's leading space,
    which decoding drops from a text's first word, as Llama's and Mistral's tokenizers do); with the
    serving tests' chat template, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from medusa_infer.serving.testing import CHAT_TEMPLATE, SPECIAL, WORDS

    vocab = {token: i for i, token in enumerate((*SPECIAL, *("▁" + word for word in WORDS)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def byte_fallback_tokenizer():
    """A Llama-2-style tokenizer: SentencePiece words (``▁the``, ...) and, for every other character, its
    UTF-8 bytes as ``<0xXX>`` tokens, which decoding joins back (a run of them that starts inside a
    character decodes to U+FFFD, every byte of it); built offline."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    words = ("the", "party", "time", "is", "now")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, **{f"<0x{b:02X}>": 4 + b for b in range(256)}}
    merges = []
    for word in words:  # "▁" + the word's letters, merged left to right
        vocab.update((c, len(vocab)) for c in word if c not in vocab)
        piece = "▁"
        for c in word:
            merges.append((piece, c))
            piece += c
            vocab.setdefault(piece, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<unk>")


def scripted_model(tokenizer, script: list[int]):
    """A one-layer llama (no heads) over ``tokenizer`` whose greedy next token after ``script[i]`` is
    ``script[i + 1]`` (each token's embedding points at its successor's ``lm_head`` row; tokens distinct)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from medusa_infer.model import MedusaModel

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for parameter in base.parameters():
            parameter.zero_()
        base.model.norm.weight.fill_(1.0)
        for layer in base.model.layers:
            layer.input_layernorm.weight.fill_(1.0), layer.post_attention_layernorm.weight.fill_(1.0)
        for slot, (token, following) in enumerate(zip(script, script[1:])):
            base.model.embed_tokens.weight[token, slot] = 1.0
            base.lm_head.weight[following, slot] = 20.0
    return MedusaModel(base, None, tokenizer)
