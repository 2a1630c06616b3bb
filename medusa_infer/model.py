"""``MedusaModel``: a stock transformers causal LM with Medusa heads on its last hidden state.

Nothing in the base model is patched or forked. One forward runs the base decoder (whatever its
architecture) with the caller's attention mask (2D, or a 4D float tree mask), position ids and KV
cache, then projects the final hidden states through the base ``lm_head`` and the heads at the
positions the caller asks for. The model object holds weights only; generation state lives in the
decoding loop's own objects.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedModel

from medusa_infer.checkpoint import (
    ADAPTER_DIR,
    CARD_NAME,
    CONFIG_NAME,
    DATASTORE_HEADING,
    DEFAULT_COMMIT_MESSAGE,
    append_card,
    card_section,
    check_heads_target,
    check_state_dict,
    heads_path,
    load_heads_state,
    note_datastore,
    push_folder_to_hub,
    renders_chats,
    save_heads,
)
from medusa_infer.attention_kernels import decoding_attention, soft_caps_attention
from medusa_infer.cpu_kernels import forget_packed, match_kernels
from medusa_infer.config import MedusaConfig
from medusa_infer.datastore import DATASTORE_NAME, Datastore
from medusa_infer.heads import MedusaHeads, check_head_range, check_token_map
from medusa_infer.kv_cache import cache_keyword

logger = logging.getLogger(__name__)

Positions = torch.Tensor | slice | None


@dataclass
class MedusaOutput:
    """What ``MedusaModel.forward`` returns.

    Attributes:
        logits: ``[batch, positions, vocab]`` base next-token logits at ``logits_positions``.
        head_logits: ``[num_heads, batch, positions, head_vocab]`` at ``head_positions``, or None.
        hidden_states: ``[batch, seq, hidden]`` final (post-norm) hidden states of the new tokens.
        cache: the KV cache, extended by the new tokens.
    """

    logits: torch.Tensor | None
    head_logits: torch.Tensor | None
    hidden_states: torch.Tensor
    cache: Any


def _select(hidden: torch.Tensor, positions: Positions) -> torch.Tensor:
    """Pick positions along the sequence axis: a slice, ``[p]`` shared by all rows, or ``[batch, p]``."""
    if positions is None:
        return hidden
    if isinstance(positions, slice):
        return hidden[:, positions]
    if positions.dim() == 1:
        return hidden.index_select(1, positions)
    index = positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return hidden.gather(1, index)


ALIBI_MODEL_TYPES = ("bloom", "mpt")
"""Model types whose positions enter as ALiBi biases (Falcon: when its config says ``alibi``)."""

TRANSFORMED_LM_HEAD_TYPES = ("electra",)
"""Model types whose output projection, a direct child, reads a transform of the final hidden states
(the others with such heads hold the projection inside the head module, which ``check_supported`` sees)."""

TREE_LAYER_TYPES = ("full_attention", "sliding_attention")
"""Attention layer types the 4D masks of tree steps express (``kv_cache.AttentionLayout``)."""


def check_supported(base_model: PreTrainedModel) -> None:
    """``NotImplementedError`` naming what keeps ``base_model`` from decoding exactly here: logits scaled
    after the ``lm_head`` (the heads project without it), ALiBi position biases (computed from cache slot
    indices, not position ids: a tree's siblings and a batch's left padding would get other biases than
    their positions), attention layers the 4D masks cannot express (chunked attention, GPT-Neo's local
    layers), no key/value cache (RWKV's recurrent state, GPT-1), positions numbered from the cache's
    length rather than taken as ids (BART's and TrOCR's decoders), an output projection applied
    after a transform of the final hidden states (BERT-style LM heads, ModernBERT's decoder) or none at
    all (a bare decoder), attention scaled by cache slot (Llama 4's no-RoPE layers' temperature), or
    soft-capped attention under sdpa, which drops the cap."""
    name = type(base_model).__name__
    if hasattr(base_model, "peft_config") and hasattr(base_model, "get_base_model"):
        raise NotImplementedError(f"{name} is a peft wrapper: pass the model it wraps (get_base_model()), with "
                                  "the adapter merged into it (merge_and_unload()), or load heads trained with "
                                  "the adapter through MedusaModel.from_pretrained, which merges it")
    if base_model.get_output_embeddings() is None:  # a bare decoder, a classifier: no lm_head to propose with
        raise NotImplementedError(f"{name} has no language-model head (get_output_embeddings() is None): load the "
                                  "model with AutoModelForCausalLM, a *ForCausalLM class")
    text = base_model.config.get_text_config()
    supports_cache = getattr(type(base_model), "_supports_default_dynamic_cache", None)
    inputs = inspect.signature(type(base_model).forward).parameters
    if (supports_cache is not None and not supports_cache()) or not {"cache", "past_key_values"} & set(inputs):
        raise NotImplementedError(f"{name} keeps no key/value cache transformers' DynamicCache holds (a recurrent "
                                  "state, a cache of its own, or none at all), which tree steps cut back to the "
                                  "accepted path; medusa-forge supports attention models with a key/value cache")
    output = base_model.get_output_embeddings()
    head = getattr(base_model, "lm_head", None)
    if text.model_type in TRANSFORMED_LM_HEAD_TYPES or (
            output is not None and not any(child is output for child in base_model.children())) or (
            isinstance(head, nn.Module) and output is not None and head is not output):
        raise NotImplementedError(f"{name} applies its output projection inside a larger LM head (a transform of "
                                  "the final hidden states first), which Medusa heads, projecting hidden states "
                                  "with it alone, would skip; medusa-forge supports models whose lm_head reads the "
                                  "final hidden states")
    for key in ("logit_scale", "logits_scaling"):
        if getattr(text, key, None) not in (None, 1, 1.0):
            raise NotImplementedError(f"{name} scales its logits ({key}={getattr(text, key)}); medusa-forge does "
                                      "not support such models yet")
    if text.model_type in ALIBI_MODEL_TYPES or getattr(text, "alibi", False) is True:
        raise NotImplementedError(f"{name} ({text.model_type}) adds ALiBi position biases computed from cache slots, "
                                  "not position ids, so tree steps and left-padded batches would not decode as the "
                                  "model does; medusa-forge supports rotary or learned positions")
    if "position_ids" not in inputs:
        raise NotImplementedError(f"{name} takes no position_ids: it numbers new tokens from the cache's length, so "
                                  "a tree's nodes (each at its own depth) and a left-padded batch's rows would get "
                                  "other positions than their own; medusa-forge supports models that take position "
                                  "ids")
    if "local" in (getattr(text, "attention_layers", None) or ()):  # GPT-Neo
        raise NotImplementedError(f"{name} has local attention layers, whose window is a buffer indexed by cache "
                                  "slot, not position, so once the cache's slots pass the window (256 in "
                                  "EleutherAI's models) tree steps would not decode as the model does; medusa-forge "
                                  f"supports {' and '.join(TREE_LAYER_TYPES)} layers")
    if soft_caps_attention(base_model.config) and "sdpa" in str(getattr(base_model.config, "_attn_implementation",
                                                                         "")):
        raise NotImplementedError(f"{name} soft-caps its attention scores (attn_logit_softcapping="
                                  f"{text.attn_logit_softcapping}), which sdpa attention drops (transformers 5.17 "
                                  "without a word): load it with attn_implementation='eager' (load_base_model does)")
    if "flex" in str(getattr(base_model.config, "_attn_implementation", "")):
        raise NotImplementedError(f"{name} is loaded with flex attention, to which tree steps' 4D masks go as a score "
                                  "function that PyTorch's CPU kernels fail on (an index error, or an abort in a "
                                  "padded batch) and no test here runs on a GPU: load it with "
                                  "attn_implementation='sdpa' or 'eager'")
    other = sorted({t for t in getattr(text, "layer_types", None) or () if t not in TREE_LAYER_TYPES})
    if other:
        raise NotImplementedError(f"{name} has {', '.join(other)} layers, which tree steps (a 4D attention mask, "
                                  "a key/value cache cut back to the accepted path) cannot run; medusa-forge "
                                  f"supports {' and '.join(TREE_LAYER_TYPES)} layers")
    if getattr(text, "attn_temperature_tuning", False) and 0 in (getattr(text, "no_rope_layers", None) or ()):
        raise NotImplementedError(f"{name} scales attention in its no-RoPE layers by cache slot index "
                                  "(attn_temperature_tuning), not position, so a tree's nodes and a left-padded "
                                  "batch's rows would be scaled otherwise than the model does; set "
                                  "attn_temperature_tuning=False in its config only if it was trained without it")


PROCESSOR_SETTINGS = ("repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size",
                      "encoder_no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "min_length", "min_new_tokens",
                      "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
                      "exponential_decay_length_penalty", "guidance_scale", "renormalize_logits", "watermarking_config")
"""``GenerationConfig`` fields that add logits processors to decoding (penalties, banned or forced tokens,
minimum lengths). A model's ``generation_config.json`` may set them (Qwen2.5-Instruct ships a repetition
penalty); medusa-forge decodes plain greedy or samples the model's distribution, applying none."""


def processor_settings(base_model: Any) -> dict[str, Any]:
    """The ``PROCESSOR_SETTINGS`` that ``base_model``'s generation config sets to something other than
    a neutral value (None, off, 0 but for a token id, 1 for the multiplicative ones, empty)."""
    config = getattr(base_model, "generation_config", None)
    found = {}
    for name in PROCESSOR_SETTINGS:
        if name == "renormalize_logits":  # a normalisation after the others: changes no choice by itself
            continue
        value = getattr(config, name, None)
        if value is None or value is False or (isinstance(value, (list, tuple, dict)) and not value):
            continue
        if name.endswith("_token_id"):  # a token id: 0 is a token (transformers forces any but None)
            found[name] = value
            continue
        if isinstance(value, (int, float)) and value == (1 if name in ("repetition_penalty",
                                                                       "encoder_repetition_penalty",
                                                                       "guidance_scale") else 0):
            continue
        found[name] = value
    return found


SAMPLING_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
"""``GenerationConfig`` sampling fields with what ``generate`` here takes when not passed: the values
``model.generate`` takes from a model's generation config instead (Qwen2.5-Instruct ships do_sample=True,
temperature 0.7, top_p 0.8, top_k 20)."""

UNSUPPORTED_SAMPLING = {"min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None}
"""``GenerationConfig`` truncation fields (with their neutral values) that sampling here has no counterpart for."""

SEARCH_SETTINGS = {"num_beams": 1, "num_beam_groups": 1, "max_new_tokens": None, "max_length": None}
"""``GenerationConfig`` fields (with their neutral values) of the search ``model.generate`` takes from a model's
config and decoding here does not: beam search, and a length (``max_length`` counts the prompt's tokens too; its
neutral value is the installed ``GenerationConfig``'s own default, 20 in some releases)."""

DEFAULTS_HERE = ("generate() and medusa-generate decode greedily unless asked to sample (do_sample=True, --do-sample) "
                 "at the temperature, top_k and top_p they are given (1, none, none when not given); medusa-serve "
                 "samples a request at the temperature and top_p it sends (OpenAI's 1 and 1 when left out), "
                 "medusa-bench at its --temperature, and distillation (medusa_train.distill) greedily unless given "
                 "--do-sample, then at its --temperature and --top-p (no top_k)")
"""What each entry point decodes with where a model's generation config asks for other sampling settings."""

LENGTHS_HERE = ("each prompt gets one sequence (no beam search) of the new tokens it is given: generate()'s "
                "max_new_tokens (128 when not given), the --max-new-tokens of medusa-generate, medusa-bench and "
                "medusa_train.distill, a request's max_tokens in medusa-serve")
"""How long each entry point decodes where a model's generation config asks for a length or a beam search."""


def sampling_settings(base_model: Any) -> dict[str, Any]:
    """The ``SAMPLING_DEFAULTS`` and ``UNSUPPORTED_SAMPLING`` fields ``base_model``'s generation config sets to
    something else than what ``generate`` here samples with (None: not set)."""
    config = getattr(base_model, "generation_config", None)
    found = {}
    for name, neutral in {**SAMPLING_DEFAULTS, **UNSUPPORTED_SAMPLING}.items():
        value = getattr(config, name, None)
        if value is not None and value != neutral and not (name == "top_k" and value == 0):
            found[name] = value
    return found


_WARNED: "weakref.WeakKeyDictionary[Any, set[str]]" = weakref.WeakKeyDictionary()
"""Messages ``_warn_processors`` gave, per base model: each once (generate checks again at each call)."""


def said_as(view: PreTrainedModel, model: PreTrainedModel) -> None:
    """``view`` (a view of ``model`` sharing its generation config, as layerskip's draft) has said what ``model``
    said and says nothing ``model`` has said: wrapping it does not repeat ``model``'s warnings."""
    _WARNED[view] = _WARNED.setdefault(model, set())


def _warn_processors(base_model: PreTrainedModel) -> None:
    """Say which of its generation config's logits processors and sampling defaults decoding here leaves
    out: when the model is wrapped, and again at a call after the config changed."""
    name = type(base_model).__name__
    messages = []
    found = processor_settings(base_model)
    if found:
        settings = ", ".join(f"{key}={value!r}" for key, value in found.items())
        messages.append(f"{name}'s generation_config sets {settings}, which medusa-forge does not apply: greedy "
                        "decoding here is plain greedy (model.generate with these settings gives other text; set "
                        "them to None in base_model.generation_config to compare)")
    found = sampling_settings(base_model)
    if found:
        settings = ", ".join(f"{key}={value!r}" for key, value in found.items())
        unsupported = [key for key in found if key in UNSUPPORTED_SAMPLING]
        messages.append(f"{name}'s generation_config sets {settings}, which medusa-forge does not take from it "
                        f"(model.generate does): {DEFAULTS_HERE}"
                        + (f"; {', '.join(unsupported)} has no counterpart here" if unsupported else "")
                        + ": pass the settings where the entry point takes them to sample as the model's authors "
                        "set it")
    config = getattr(base_model, "generation_config", None)
    neutral_length = GenerationConfig().max_length
    found = {key: getattr(config, key, None) for key, neutral in SEARCH_SETTINGS.items()
             if getattr(config, key, None) not in (None, neutral)
             and not (key == "max_length" and getattr(config, key) == neutral_length)}
    if found:
        settings = ", ".join(f"{key}={value!r}" for key, value in found.items())
        messages.append(f"{name}'s generation_config sets {settings}, which medusa-forge does not take from it "
                        f"(model.generate does): {LENGTHS_HERE}")
    given = _WARNED.setdefault(base_model, set())
    for message in messages:
        if message not in given:
            given.add(message)
            logger.warning(message)


def _warn_longrope(base_model: PreTrainedModel) -> None:
    """Say that a LongRoPE model decodes within its original context here."""
    from medusa_infer.decoding import longrope_original_length

    text = base_model.config.get_text_config()
    original = longrope_original_length(text)
    longest = getattr(text, "max_position_embeddings", None)
    if original and longest and original < longest:
        logger.warning("%s uses LongRoPE: medusa-forge decodes it within original_max_position_embeddings=%d tokens "
                       "(of %d), prompt and answer together: past it the model switches its rotary factors, and "
                       "decoding from the cache could not follow", type(base_model).__name__, original, longest)


class MedusaModel(nn.Module):
    """A base causal LM plus Medusa heads.

    Args:
        base_model: any transformers ``*ForCausalLM`` whose ``base_model`` returns the final
            hidden state after its last norm (Llama, Mistral, Qwen2/3, Gemma3, GPT-2, ...). Built
            directly, on a model whose weights changed through ``.data`` since it last ran (peft's
            ``merge_and_unload`` after a forward), call ``cpu_kernels.forget_packed`` first, as
            ``from_base``, ``without_heads`` and ``from_pretrained`` do (its packed copies are stale).
        heads: the heads; their config must match the base model's hidden size, vocabulary
            and model type. None gives the bare target model, for the proposers that need no
            heads (plain decoding, draft model, prompt lookup).
        tokenizer: optional tokenizer, used by text-level helpers and the CLIs.

    Attributes:
        merged_adapter: the Medusa-2 adapter folder ``from_pretrained`` merged into the base
            model, or None.
        datastore: the model's own earlier answers, searched for lookup drafts
            (``medusa_infer.datastore``); ``from_pretrained`` loads the heads folder's
            ``datastore.safetensors`` when there is one, ``save_pretrained`` writes it. None: no
            datastore (set it to None to decode without one).
    """

    def __init__(self, base_model: PreTrainedModel, heads: MedusaHeads | None, tokenizer: Any = None) -> None:
        super().__init__()
        check_tokenizer(tokenizer)
        check_supported(base_model)
        _warn_longrope(base_model)
        _warn_processors(base_model)
        if heads is not None:
            check_compatible(heads.config, base_model)
            heads = heads.to(device=base_model.device, dtype=base_model.dtype)
            from medusa_infer.models import kernel_plan_cache

            match_kernels(heads, base_model, kernel_plan_cache())  # the heads use CPU kernels as the base model does
        self.base_model = base_model
        self.heads = heads
        self.tokenizer = tokenizer
        self.merged_adapter: Path | None = None  # the Medusa-2 adapter folder from_pretrained merged
        self.skipped_adapter: Path | None = None  # the one it left unmerged (adapter=False)
        self.skipped_datastore: Path | None = None  # the store it left unread (datastore=False)
        self.datastore: Datastore | None = None
        self._cache_kw = cache_keyword(self._decoder)
        self._slot_masks = _causal_slot_buffers(base_model)
        self.logit_softcap: float | None = getattr(base_model.config.get_text_config(), "final_logit_softcapping",
                                                   None)

    @property
    def _decoder(self) -> nn.Module:
        """The base model's decoder (``base_model.base_model``): not a submodule of its own, whose state dict
        held the backbone twice (a DeepSpeed checkpoint leaving the frozen weights out kept the copy). Where
        the model's ``base_model_prefix`` names no submodule (Mllama's and Llama 4's ``language_model``), its
        ``model`` (the whole model was taken for the decoder, and the first forward failed)."""
        decoder = self.base_model.base_model
        return getattr(self.base_model, "model", decoder) if decoder is self.base_model else decoder

    @property
    def config(self) -> MedusaConfig:
        if self.heads is None:
            raise ValueError("this MedusaModel has no heads; load some with MedusaModel.from_pretrained")
        return self.heads.config

    @classmethod
    def without_heads(cls, base_model: PreTrainedModel | str, tokenizer: Any = None) -> "MedusaModel":
        """The bare target model (given as an object, a default-model name, a folder or a Hub id)."""
        base_model, tokenizer, _ = _load_base(base_model, tokenizer)
        return cls(base_model, None, tokenizer)

    @property
    def lm_head(self) -> nn.Module:
        return self.base_model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return self.base_model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base_model.dtype

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_base(
        cls,
        base_model: PreTrainedModel | str,
        num_heads: int = 4,
        num_layers: int = 1,
        projection: str = "shared",
        token_map: torch.Tensor | None = None,
        tokenizer: Any = None,
        base_model_name_or_path: str | None = None,
        **config_kwargs: Any,
    ) -> "MedusaModel":
        """Fresh (untrained) heads on a base model.

        Args:
            base_model: a causal LM object, a default-model name, a local folder or a Hub id.
            num_heads: heads, each predicting one token further ahead.
            num_layers: residual blocks per head.
            projection: ``"shared"`` (every head reads its logits through the base model's ``lm_head``) or
                ``"own"`` (a vocabulary projection per head, initialised from it).
            token_map: ``[n]`` token ids the heads score (a reduced vocabulary), or None for the whole one.
            tokenizer: the tokenizer ``prompt=`` and ``messages=`` are read with: an object, or a name to load;
                None: the base model's own where it is given by name, none where it is an object (``prompt=``
                and ``messages=`` then need one).
            base_model_name_or_path: the name recorded for the base model (default: the one it was loaded by).
            **config_kwargs: other ``MedusaConfig`` fields (``tree``, ``next_token_input``, ...); those taken
                from the base model or ``token_map`` are refused.
        """
        owned = {"hidden_size": "the base model's", "vocab_size": "the base model's",
                 "base_model_type": "the base model's", "reduced_vocab_size": "token_map's length"}
        given = sorted(set(config_kwargs) & set(owned))
        if given:  # (a raw "got multiple values for keyword argument")
            raise ValueError(f"from_base sets {', '.join(given)} itself ({', '.join(owned[k] for k in given)}): drop "
                             + ("it" if len(given) == 1 else "them")
                             + ("; for a reduced vocabulary pass token_map=" if "reduced_vocab_size" in given else ""))
        from medusa_infer.models import names_default_model

        base_model, tokenizer, name = _load_base(base_model, tokenizer)
        if name is not None and not base_model_name_or_path and Path(name).expanduser().is_dir() \
                and not names_default_model(name):  # (a folder named like one does not hide it: load_base_model)
            name = str(Path(name).expanduser().resolve())  # a relative folder named nothing from elsewhere
        name = base_model_name_or_path or name
        lm_weight = base_model.get_output_embeddings().weight
        config = MedusaConfig(
            num_heads=num_heads,
            num_layers=num_layers,
            hidden_size=lm_weight.shape[1],
            vocab_size=lm_weight.shape[0],
            projection=projection,
            reduced_vocab_size=None if token_map is None else len(token_map),
            base_model_name_or_path=name,
            base_model_type=base_model.config.model_type,
            **config_kwargs,
        )
        heads = MedusaHeads(config, lm_head_weight=lm_weight.detach().float(), token_map=token_map,
                            lm_head_bias=getattr(base_model.get_output_embeddings(), "bias", None))
        return cls(base_model, heads, tokenizer)

    @classmethod
    def from_pretrained(
        cls,
        heads_path_or_repo_id: str | os.PathLike,
        base_model: PreTrainedModel | str | None = None,
        tokenizer: Any = None,
        revision: str | None = None,
        adapter: bool = True,
        datastore: bool = True,
    ) -> "MedusaModel":
        """Load heads from a folder or Hub repo (medusa-forge or FasterDecoding/Medusa layout).

        The base model named in the heads' config is loaded unless ``base_model`` is given (an
        object, a default-model name such as ``smollm2-135m-instruct``, a folder or a Hub id).

        Heads trained in Medusa-2 mode come with the LoRA adapter they were trained on, in
        ``<heads folder>/adapter`` (``checkpoint.ADAPTER_DIR``). With ``adapter=True`` (the
        default) it is loaded with peft and merged into the base model's weights, which stays a
        stock transformers model (no peft wrapper while decoding); a ``base_model`` given as an
        object is changed in place (loading heads on it again takes the same adapter as merged; other
        heads, or ``adapter=False``, are a ``ValueError``: pass a fresh base model; Medusa-2 heads of the
        FasterDecoding layout, which holds no adapter, load onto a base model with theirs merged, named by
        ``interop.ADAPTER_DIGEST_KEY``, and are refused on one with another merged). ``adapter=False``
        keeps the plain base model. Folders without an adapter load the same either way.

        Heads whose config records a ``chat_template`` (trained on a template other than the
        tokenizer's own) install it on the tokenizer, a ``tokenizer`` given as an object included,
        so that chats are rendered as in training; heads without one loaded later on that tokenizer
        put its own template back (``install_chat_template``). ``tokenizer`` may also be a name or
        folder to load it from.

        ``datastore=False`` leaves the folder's ``datastore.safetensors`` unread (``datastore`` None: no lookup
        draft searches it), an unreadable one included (``save_pretrained`` then writes the heads without it).
        """
        from medusa_infer import interop

        for flag, value in (("adapter", adapter), ("datastore", datastore)):  # ("false" merged the adapter)
            if not isinstance(value, bool):
                raise ValueError(f"{flag} must be True or False, got {value!r}")
        directory = heads_folder(heads_path_or_repo_id, revision)
        exported_digest = None  # the adapter a FasterDecoding-layout export of Medusa-2 heads was trained with
        exported = interop.is_medusa_layout(directory)
        if exported:
            interop.weights_file(directory)  # before loading a base model for nothing
            exported_digest = interop.exported_adapter_digest(directory)
            named = base_model is None
            if base_model is None:
                base_model = interop.base_model_name(directory)
                if not base_model:
                    raise ValueError(f"{directory}/config.json names no base_model_name_or_path; give the base model "
                                     "(base_model=, or the command lines' --model)")
            base_model, tokenizer, name = _load_base(base_model, tokenizer, directory if named else None)
            lm_head = base_model.get_output_embeddings()
            lm_weight = lm_head.weight
            config, state = interop.read_medusa_layout(
                directory, hidden_size=lm_weight.shape[1], vocab_size=lm_weight.shape[0], lm_head_weight=lm_weight,
                lm_head_bias=getattr(lm_head, "bias", None),
                given_by=f"the base model ({', '.join(filter(None, (name, base_model.config.model_type)))})",
            )
            if config.base_model_type is None:  # an export older than BASE_MODEL_TYPE_KEY, or another trainer's
                config.base_model_type = base_model.config.model_type
        else:
            config, state = load_heads_state(directory)
            exported_digest = interop.recorded_adapter_digest(config, directory / CONFIG_NAME)
            if base_model is None and not config.base_model_name_or_path:
                raise ValueError(
                    f"{directory}/config.json names no base_model_name_or_path; give the base model (base_model=, "
                    "or the command lines' --model)"
                )
            named = base_model is None
            # (an empty string given is refused as such, not taken for "the config's")
            base_model, tokenizer, name = _load_base(config.base_model_name_or_path if named else base_model,
                                                     tokenizer, directory if named else None)
        adapter_folder = directory / ADAPTER_DIR
        merge = adapter and adapter_folder.is_dir()
        digests = adapter_digests(adapter_folder) if merge else ()  # (this digest, and as recorded before README.md
        digest = digests[0] if merge else None  # and hidden files were left out of it)
        already = getattr(base_model, MERGED_ADAPTER_ATTR, None)
        # Medusa-2 heads of the FasterDecoding layout, which holds no adapter, need theirs merged (named by the
        # export), as do such heads saved again in our layout (their record keeps the name); in our layout a
        # Medusa-2 folder without one is otherwise plain heads' case (the adapter was not copied)
        wants_adapted = ((exported or exported_digest is not None) and config.trained_with_adapter
                         and not merge)  # (merged: checked by its digest)
        if already is not None and (digest != already[1] if merge else not wants_adapted):
            # a base_model object an earlier from_pretrained merged another adapter into
            wanted = (f"the adapter in {adapter_folder}" if merge else
                      "adapter=False" if adapter_folder.is_dir() else f"the heads in {directory} (no adapter)")
            raise ValueError(f"base_model already has the adapter in {already[0]} merged into its weights (an "
                             f"earlier from_pretrained changed it in place); {wanted} needs the plain base "
                             "model: load a fresh one")
        recorded = getattr(base_model.config, MERGED_ADAPTER_KEY, None)
        merged_in = already[1] if already is not None else recorded  # the adapter in base_model's weights, if known
        # (weights with the heads' own adapter merged differ from the plain ones training recorded: not compared;
        # with adapter=False too)
        own = () if merged_in is None else digests or (adapter_digests(adapter_folder) if adapter_folder.is_dir()
                                                        else ())
        if merged_in is None or not (merged_in in own or merged_in == exported_digest):
            _check_trained_weights(config, name, directory, adapting=merge)
        if wants_adapted and exported_digest is not None and merged_in is not None and exported_digest not in (
                adapter_digests(already[0]) if already is not None and Path(already[0]).is_dir() else (merged_in,)):
            key = interop.ADAPTER_DIGEST_KEY if exported else f"training.{interop.ADAPTER_DIGEST_RECORD}"
            raise ValueError(f"the heads in {directory} were trained with the Medusa-2 adapter {exported_digest[:12]} "
                             f"(config.json's {key}), and base_model has another merged into "
                             f"its weights ({merged_in[:12]}): load them on the base model with their own adapter "
                             "merged")
        if wants_adapted and exported_digest is None and merged_in is not None:
            logger.warning("the heads in %s were trained with a Medusa-2 adapter and their config.json does not name "
                           "it (%s): loaded onto a base model with an adapter merged, which could not be checked to "
                           "be theirs", directory, interop.ADAPTER_DIGEST_KEY)
        if merge and already is None and recorded is not None and recorded not in digests:
            raise ValueError(f"the base model's weights were saved with another Medusa-2 adapter merged into them "
                             f"(its config.json's {MERGED_ADAPTER_KEY}); the adapter in {adapter_folder} needs the "
                             "plain base model: load the heads on it (merging a second adapter on top would give "
                             "neither model)")
        # merged already: into this object, or into weights saved with this very adapter (not twice)
        in_weights = already is not None or (merge and recorded in digests)
        with torch.device("meta"):  # compared before any memory is taken: a config.json saying num_heads 50 of a
            expected = MedusaHeads(config).state_dict()  # 7B model's with projection own built tens of GB first
        check_state_dict(expected, state, str(directory))
        heads = MedusaHeads(config)
        heads.load_state_dict(state, strict=True)
        if heads.token_map is not None:
            check_token_map(heads.token_map, config)
        check_supported(base_model)
        check_compatible(config, base_model)  # first: another model's heads were blamed on their datastore
        store = None
        if datastore and (directory / DATASTORE_NAME).is_file():
            store = Datastore.load(directory / DATASTORE_NAME)
            store.check_tokenizer(tokenizer, directory / DATASTORE_NAME)
            store.check_vocabulary(config.vocab_size, directory / DATASTORE_NAME)
            if tokenizer is None and store.tokenizer is not None:
                logger.warning("%s was not checked against the model's tokenizer (a base model given as an object "
                               "and no tokenizer=): a store built with another one drafts tokens that stand for "
                               "other text; pass tokenizer= to check it", directory / DATASTORE_NAME)
        if adapter and not adapter_folder.is_dir() and config.trained_with_adapter and already is None \
                and recorded is None:
            logger.warning("the heads in %s were trained with a Medusa-2 adapter (config.json: training.recipe."
                           "training.mode medusa2) and the folder holds none (%s/): they run on the plain base "
                           "model, which they draft for worse than their accuracies say; copy the run's heads/%s "
                           "along, or pass the base model with that adapter merged", directory, ADAPTER_DIR,
                           ADAPTER_DIR)
        # every check before anything changes: a refused load leaves a given base model and tokenizer as they were
        if merge and not in_weights:
            base_model = merge_adapter(base_model, adapter_folder)
        model = cls(base_model, heads, tokenizer)
        model.merged_adapter = adapter_folder if merge else None
        model.skipped_adapter = adapter_folder if not adapter and adapter_folder.is_dir() else None
        model.datastore = store
        if not datastore and (directory / DATASTORE_NAME).is_file():
            model.skipped_datastore = directory / DATASTORE_NAME
        if tokenizer is not None:
            install_chat_template(tokenizer, config.chat_template)
        if config.chat_template and tokenizer is None:
            logger.warning("the heads in %s were trained on their own chat template (model.config.chat_template) "
                           "and no tokenizer was given to install it on; pass tokenizer=, or render chats with "
                           "model.config.chat_template", directory)
        return model

    # ------------------------------------------------------------------ saving

    def save_pretrained(self, directory: str | os.PathLike, base_model_id: str | None = None,
                        heads_state: Mapping[str, torch.Tensor] | None = None) -> Path:
        """Write the heads (not the base model) as ``config.json``, ``model.safetensors``, ``README.md``.

        The heads are written in the dtype they compute in, the base model's (``MedusaModel``
        converts them): heads loaded in float32 onto a bfloat16 model are saved rounded to
        bfloat16 unless ``heads_state`` gives the weights to write instead (the full-precision
        ones they were loaded from; their names and shapes must be the heads').

        A Medusa-2 adapter merged at load time (``merged_adapter``) is copied along into
        ``directory/adapter``, replacing what was there: the heads were trained for the adapted
        base model, so the folder (and what ``push_to_hub`` uploads) keeps both. Heads without one
        are not saved into a folder holding an adapter (``ValueError``): it would be merged under
        them. The ``datastore`` is saved too, as ``datastore.safetensors``; without one, a store
        there goes, bar the one loading these heads left unread (``datastore=False``).
        """
        config = self.config  # a model without heads: ValueError
        own = self.heads.state_dict()
        with torch.device("meta"):  # heads changed since (a head dropped) were saved, and failed to load
            expected = MedusaHeads(config).state_dict()
        check_state_dict(expected, own, "self.heads", "Saved so, they would not load: nothing was written; change "
                         "self.heads back, or the config (self.heads.config) with them")
        if heads_state is not None:
            check_state_dict(own, dict(heads_state), "heads_state")
        directory = heads_path(directory)
        self.check_save_target(directory)
        target = directory / ADAPTER_DIR
        if self.skipped_adapter is not None:
            logger.warning("these heads were loaded with adapter=False from a folder holding their Medusa-2 adapter "
                           "(%s): %s gets the heads alone, whose accuracies were measured with the adapter merged; "
                           "copy that folder along to keep them together", self.skipped_adapter, directory)
        store = directory / DATASTORE_NAME  # left unread (datastore=False) where it stays, not unwanted
        unread = (self.datastore is None and self.skipped_datastore is not None and store.is_file()
                  and self.skipped_datastore.is_file() and os.path.samefile(store, self.skipped_datastore))
        text = (directory / CARD_NAME).read_text(encoding="utf-8", errors="replace") \
            if unread and (directory / CARD_NAME).is_file() else ""  # (a card edited in another encoding: kept)
        span = card_section(text, DATASTORE_HEADING)
        section = text[span[0]:span[1]] if span else ""
        # The datastore and the adapter are written beside their places before the heads go in, then moved in:
        # a save that failed there (a full disk) had left the new heads beside the old heads' store or adapter,
        # which loaded without a word
        staged: list[tuple[Path, Path]] = []  # each listed before it is written: one cut short is removed too
        aside = directory / (DATASTORE_NAME + ".old.partial")  # an earlier save's store, kept until the heads are in
        made_folders = [folder for folder in (directory, *directory.parents) if not folder.exists()]
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if self.datastore is not None:
                staged.append((directory / (DATASTORE_NAME + ".partial"), store))
                self.datastore.save(staged[-1][0])
            if self.merged_adapter is not None and (not target.exists()
                                                    or not os.path.samefile(target, self.merged_adapter)):
                staged.append((directory / (ADAPTER_DIR + ".partial"), target))
                shutil.rmtree(staged[-1][0], ignore_errors=True)
                shutil.copytree(self.merged_adapter, staged[-1][0])
            if self.datastore is None and not unread and store.is_file():  # an earlier save's store is not these
                os.replace(store, aside)  # heads': out of the way first (the earlier heads work without it)
            out = save_heads(directory, config, dict(heads_state) if heads_state is not None else own,
                             base_model_id, renders_chats(config, self.tokenizer))
        except BaseException:
            for made, _ in staged:
                if made.is_dir():
                    shutil.rmtree(made)
                else:
                    made.unlink(missing_ok=True)
            if aside.is_file():
                os.replace(aside, store)
            for folder in made_folders:  # (a save refused by save_heads's checks left the new folder, empty)
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
            raise
        aside.unlink(missing_ok=True)
        for made, place in staged:  # moves only, once the heads are in place
            if place.is_dir():  # another adapter's files would mix with this one's
                shutil.rmtree(place)
            os.replace(made, place)
        if self.datastore is not None:
            note_datastore(out, len(self.datastore), self.datastore.origin)
        elif unread and section:  # the card written anew says what it holds again
            append_card(out, (out / CARD_NAME).read_text(encoding="utf-8"), section)
        if unread:
            logger.info("%s was left as it is: loaded with datastore=False from there", store)
        return out

    def check_save_target(self, directory: str | os.PathLike) -> None:
        """``ValueError`` where ``save_pretrained(directory)`` would refuse it, before anything is written: for a
        caller to check before work that ends in a save (``medusa-bench --calibrate``). The folder holds another
        layout's heads or another config (``checkpoint.check_heads_target``), cannot be written, or holds an
        adapter these heads have none of; the adapter merged at load time is gone, or changed since."""
        directory = heads_path(directory)
        check_heads_target(directory)
        if self.merged_adapter is not None and not Path(self.merged_adapter).is_dir():
            raise ValueError(f"the Medusa-2 adapter merged into the base model at load time ({self.merged_adapter}) "
                             "is gone, and the heads need it: nothing was written; restore that folder, or load the "
                             "heads again from a folder that holds it")
        if self.merged_adapter is not None and self._merged_digest() not in adapter_digests(self.merged_adapter):
            raise ValueError(f"the Medusa-2 adapter in {self.merged_adapter} changed since it was merged into the base "
                             "model (another run wrote there?): these heads go with the one merged, not it; nothing "
                             "was written: load the heads again with the adapter they were trained with")
        if self.merged_adapter is None and (directory / ADAPTER_DIR).exists():
            raise ValueError(f"{directory / ADAPTER_DIR} holds a Medusa-2 adapter and these heads have none merged "
                             "(merged_adapter is None): from_pretrained would merge it under them; save into another "
                             "folder, or delete that adapter if it is not wanted")

    def _merged_digest(self) -> str | None:
        """The digest of the adapter merged into the base model's weights: recorded by ``merge_adapter``
        on the object, or in the config of weights saved merged."""
        already = getattr(self.base_model, MERGED_ADAPTER_ATTR, None)
        return already[1] if already is not None else getattr(self.base_model.config, MERGED_ADAPTER_KEY, None)

    def export_medusa_layout(
        self, directory: str | os.PathLike, fmt: str = "safetensors", version: str | None = None,
        heads_state: Mapping[str, torch.Tensor] | None = None,
    ) -> Path:
        """Write the heads in the FasterDecoding/Medusa layout (read by TGI and TensorRT-LLM);
        see ``medusa_infer.interop.write_medusa_layout``. Unlike ``save_pretrained``, it writes neither
        a merged Medusa-2 adapter (those engines need the base model with it merged) nor the lookup
        datastore (no engine that reads the layout uses one); either left out is warned about.

        As with ``save_pretrained``, the heads are written in the dtype they compute in unless
        ``heads_state`` gives the weights to write (the full-precision ones they were loaded from); version
        '1''s copies of the base ``lm_head`` are the model's, in its dtype."""
        from medusa_infer.interop import recorded_adapter_digest, write_medusa_layout

        copies = version == "1" and self.config.projection == "shared"
        lm_weight, lm_bias = (self.lm_head.weight, self.lm_head.bias) if copies else (None, None)
        # heads imported from an export keep their adapter's digest where none is merged here (re-exported on the
        # plain base model, the new export lost it, and loaded beside any other adapter)
        merged_in = self._merged_digest() or recorded_adapter_digest(self.config, Path(directory))
        state = self.heads.state_dict()
        if heads_state is not None:
            check_state_dict(state, dict(heads_state), "heads_state")
            state = dict(heads_state)
        out = write_medusa_layout(self.config, state, directory, lm_head_weight=lm_weight, fmt=fmt, version=version,
                                  lm_head_bias=lm_bias, adapter_digest=merged_in,
                                  chat=renders_chats(self.config, self.tokenizer))
        self._warn_heads_only(directory)  # once written: heads the layout cannot hold fail without it
        return out

    def push_to_hub(
        self,
        repo_id: str,
        private: bool | None = None,
        revision: str | None = None,
        token: str | None = None,
        commit_message: str = DEFAULT_COMMIT_MESSAGE,
        base_model_id: str | None = None,
    ) -> str:
        """Create ``repo_id`` if needed and upload the saved heads folder (``save_pretrained``, which
        ``base_model_id`` reaches: the card's Hub id of a base model loaded from a folder);
        returns the commit URL. Medusa-2 heads without their adapter (loaded with ``adapter=False``, or onto
        a base model it was merged into beforehand) are refused: the upload would delete the repo's
        ``adapter/`` as stale, leaving heads that read an adapted backbone nobody can load."""
        if self.config.trained_with_adapter and self.merged_adapter is None:
            fix = (f"load them with adapter=True (their adapter is in {self.skipped_adapter})"
                   if self.skipped_adapter is not None else "load them from a folder holding their adapter/")
            raise ValueError(f"these Medusa-2 heads were loaded without their adapter; uploaded alone, they would "
                             f"delete {repo_id}'s adapter/ if it has one, as stale, and nobody could load the "
                             f"backbone they read: {fix} and push again, or upload a folder holding adapter/ with "
                             "medusa_infer.checkpoint.push_folder_to_hub")
        if self.skipped_datastore is not None:
            logger.warning("these heads were loaded with datastore=False: the upload holds no datastore, and deletes "
                           "the one %s holds from an earlier upload, if any", repo_id)
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp, base_model_id)  # first: a model that cannot be saved leaves no empty repo
            return push_folder_to_hub(tmp, repo_id, private=private, revision=revision, token=token,
                                      commit_message=commit_message,
                                      retry_hint="push again, or save_pretrained(DIR) and upload it with "
                                                 f"medusa_infer.checkpoint.push_folder_to_hub(DIR, {repo_id!r})")

    def _warn_heads_only(self, directory: str | os.PathLike) -> None:
        if self.skipped_adapter is not None:
            logger.warning("these heads were loaded with adapter=False from a folder holding their Medusa-2 adapter "
                           "(%s), which the layout written to %s does not include; engines that read it need the "
                           "base model with that adapter merged", self.skipped_adapter, directory)
        if self.merged_adapter is not None:
            logger.warning("writing the heads only to %s: the Medusa-2 adapter merged from %s is not included "
                           "in this layout; engines that read it need the base model with the adapter merged",
                           directory, self.merged_adapter)
        if self.datastore is not None:
            logger.warning("the lookup datastore (%d entries) is not part of the layout written to %s: "
                           "save_pretrained keeps it beside the heads", len(self.datastore), directory)

    # ------------------------------------------------------------------ forward

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Base next-token logits ``[..., vocab]`` from final hidden states ``[..., hidden]``."""
        logits = self.lm_head(hidden)
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def head_logits(self, hidden: torch.Tensor, next_tokens: torch.Tensor | None = None,
                    first: int | None = None, path_tokens: torch.Tensor | None = None,
                    start: int = 0) -> torch.Tensor:
        """Heads' logits ``[num_heads, ..., head_vocab]`` from final hidden states ``[..., hidden]``
        (``[first - start, ...]``: only heads ``start .. first - 1`` run).

        ``next_tokens`` ``[...]``: the tokens at t + 1, read by ``next_token_input`` heads (ignored
        by others). By default they are the base model's greedy choice at each position; a decoding
        step passes its root tokens (sampled ones included).

        ``path_tokens`` ``[..., j]``: the tokens at t + 2 onwards, read by ``path_input`` heads
        (head k reads the first k). By default each head reads the greedy path: head k's input at
        t + k + 1 is head k - 1's top choice, so the heads run one after another.
        """
        if not self.config.next_token_input:
            return self.heads(hidden, self.lm_head, self.logit_softcap, first=first, start=start)
        if next_tokens is None:
            next_tokens = self.project(hidden).argmax(-1)
        embed_weight = self.base_model.get_input_embeddings().weight
        if not self.config.path_input or path_tokens is not None:
            return self.heads(hidden, self.lm_head, self.logit_softcap, next_tokens, embed_weight, first=first,
                              path_tokens=path_tokens, start=start)
        stop = self.config.num_heads if first is None else first
        check_head_range(start, stop, self.config.num_heads)
        path = next_tokens.new_zeros((*next_tokens.shape, max(stop - 1, 0)))
        out = []
        for k in range(stop):
            logits = self.heads(hidden, self.lm_head, self.logit_softcap, next_tokens, embed_weight, first=k + 1,
                                path_tokens=path, start=k)[0]
            if k + 1 < stop:
                path[..., k] = self.heads.to_full_vocab(logits.argmax(-1))
            if k >= start:
                out.append(logits)
        return torch.stack(out)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        logits_positions: Positions = None,
        head_positions: Positions = slice(0, 0),
    ) -> MedusaOutput:
        """Run the base decoder on ``input_ids`` ``[batch, new]``.

        Args:
            attention_mask: ``[batch, past + new]`` 0/1 padding mask, or a 4D float mask
                ``[batch, 1, new, past + new]`` (0 where allowed, the dtype's minimum elsewhere).
            position_ids: ``[batch, new]``.
            cache: a transformers ``Cache`` (e.g. ``DynamicCache``), extended in place.
            logits_positions: where base logits are wanted (None: all new positions).
            head_positions: where heads' logits are wanted (None: all; default: none).

        On a CUDA device, inference runs on the attention kernels ``attention_kernels``
        chooses for decoding.
        """
        if self._slot_masks:
            past = 0 if cache is None else cache.get_seq_length()
            _widen_causal_buffers(self._slot_masks, past + input_ids.shape[1])
        with decoding_attention(input_ids.device):
            outputs = self._decoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=cache is not None,
                **{self._cache_kw: cache},
            )
        hidden = outputs.last_hidden_state
        logits = self.project(_select(hidden, logits_positions))
        head_hidden = _select(hidden, head_positions)
        heads = self.head_logits(head_hidden) if head_hidden.shape[1] and self.heads is not None else None
        return MedusaOutput(logits, heads, hidden, cache)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Speculative generation with the heads; see ``medusa_infer.decoding.generate``."""
        from medusa_infer.decoding import generate

        return generate(self, *args, **kwargs)


SLOT_MASK_SPARE = 256
"""Slots a widened causal buffer (``_widen_causal_buffers``) keeps to spare: a copy every 256 slots."""


def _causal_slot_buffers(base_model: nn.Module) -> list[nn.Module]:
    """The attention modules holding a causal mask buffer (``bias``, boolean ``[1, 1, L, L]``, L the context
    length) that they slice by cache slots: GPT-Neo's."""
    return [m for m in base_model.modules() if isinstance(m._buffers.get("bias"), torch.Tensor)
            and m._buffers["bias"].dtype == torch.bool and m._buffers["bias"].dim() == 4]


def _widen_causal_buffers(modules: list[nn.Module], slots: int) -> None:
    """Widen each module's causal buffer to cover ``slots`` cache slots (past and new). GPT-Neo's attention
    slices it by slot count, not position: a tree step near the context's end (its nodes past the last
    position's slot), or over a batch's cache with holes (rows that accepted different lengths), asked for
    more slots than positions and failed (a size mismatch), though every position fitted. The buffer is
    causal over slots only (our 4D masks say which slots each token sees), so a wider one changes nothing
    within the old size."""
    for module in modules:
        current = module._buffers["bias"]
        if current.shape[-1] >= slots:
            continue
        size = slots + SLOT_MASK_SPARE
        with torch.inference_mode(False):  # a normal tensor: made under generate's inference mode, training
            wider = torch.ones(size, size, dtype=torch.bool, device=current.device).tril()  # the model failed
        module._buffers["bias"] = wider.view(1, 1, size, size)  # kept as registered (not persistent)


def _named(name: str | None) -> str:
    return f" ({name})" if name else " (their config names none)"


def check_compatible(config: MedusaConfig, base_model: PreTrainedModel) -> None:
    """Raise ``ValueError`` when heads were trained for a different kind of base model."""
    vocab, hidden = full_shape(base_model.get_output_embeddings().weight)  # check_supported saw it is there
    if config.hidden_size != hidden:
        raise ValueError(
            f"heads were trained for hidden size {config.hidden_size}, this model has {hidden}: "
            f"load the base model they were trained for{_named(config.base_model_name_or_path)}"
        )
    if config.vocab_size != vocab:
        raise ValueError(
            f"heads were trained for a vocabulary of {config.vocab_size} tokens, this model has {vocab}: "
            f"load the base model they were trained for{_named(config.base_model_name_or_path)}"
        )
    model_type = base_model.config.model_type
    if config.base_model_type and config.base_model_type != model_type:
        raise ValueError(
            f"heads were trained for model type {config.base_model_type!r}, this model is {model_type!r}: "
            f"load the base model they were trained for{_named(config.base_model_name_or_path)}"
        )


def full_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's shape, also while DeepSpeed ZeRO-3 holds it in pieces (training under it), when
    the tensor itself is empty and the shape is kept as ``ds_shape``."""
    return getattr(param, "ds_shape", param.shape)


def embedding_lora_targets(base_model: nn.Module, target_modules: str | Sequence[str]) -> list[str]:
    """The module paths among ``base_model``'s input and output embeddings that LoRA
    ``target_modules`` (peft's matching: a regex matched whole, or names and dotted suffixes) select.

    The heads read those weights directly (shared projection, next-token input), so an adapter on
    them trains heads against one weight and decodes with another; with tied embeddings, merging it
    also changes the input embedding. Medusa-2 refuses such targets."""
    embeddings = {id(m) for m in (base_model.get_input_embeddings(), base_model.get_output_embeddings())
                  if m is not None}
    selected = []
    for path, module in base_model.named_modules():
        if path and id(module) in embeddings and lora_selects(target_modules, path):
            selected.append(path)
    return selected


def lora_selects(target_modules: str | Sequence[str], path: str) -> bool:
    """Whether LoRA ``target_modules`` select the module at ``path``, as peft matches them: a string
    is a regex matched against the whole path; a list holds names or dotted suffixes of paths."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, path) is not None
    return any(path == t or path.endswith("." + t) for t in target_modules)


def merge_adapter(base_model: PreTrainedModel, folder: str | os.PathLike) -> PreTrainedModel:
    """``base_model`` with the peft LoRA adapter saved in ``folder`` merged into its weights.

    The model is changed in place and returned as the same stock transformers class.

    Raises:
        ValueError: the adapter targets the model's input or output embeddings
            (``embedding_lora_targets``), lacks files or weights, or does not fit the model; the model is
            then left as it was.
    """
    from peft import PeftConfig, PeftModel

    config_file = Path(folder) / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder} holds no adapter_config.json: the adapter was not saved whole; save or download "
                         "it again")
    if not any((Path(folder) / name).is_file() for name in ADAPTER_WEIGHTS):
        raise ValueError(f"{folder} holds no adapter weights ({' or '.join(ADAPTER_WEIGHTS)}): the adapter was not "
                         "saved whole; save or download it again")
    try:
        settings = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:  # (a bare parse error named no file)
        raise ValueError(f"{config_file} is not valid JSON ({err}): the adapter is damaged; save or download it "
                         "again") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{config_file} holds a {type(settings).__name__}, not a JSON object: the adapter is "
                         "damaged; save or download it again")
    targets, saved = settings.get("target_modules"), settings.get("modules_to_save")
    selected = embedding_lora_targets(base_model, targets) if targets else []
    if selected:
        raise ValueError(f"the adapter in {folder} adapts {selected}, the embeddings the heads read directly: "
                         "merged, it would not be the model the heads were trained with; retrain with "
                         "lora.target_modules outside the embeddings and lm_head")
    replaced = embedding_lora_targets(base_model, saved) if saved else []
    if replaced:  # a trained copy of each, which the merge writes over the model's (target_modules were checked)
        raise ValueError(f"the adapter in {folder} replaces {replaced} (its modules_to_save), the embeddings the "
                         "heads read directly: merged, it would not be the model the heads were trained with; "
                         "retrain without modules_to_save")
    from safetensors import SafetensorError, safe_open

    from medusa_infer.checkpoint import unreadable_weights

    for weights in sorted(Path(folder).glob("*.safetensors")):  # before peft changes the model: it injects
        try:  # LoRA layers into it, then fails on a file that does not read (the header check finds a cut one)
            with safe_open(str(weights), framework="pt"):
                pass
        except (SafetensorError, OSError) as err:
            raise unreadable_weights(weights, err, "the adapter", "save or download it again") from err
    config = PeftConfig.from_pretrained(str(folder))
    config.inference_mode = True
    flags = {name: param.requires_grad for name, param in base_model.named_parameters()}  # (peft freezes all)
    wrapped = None
    try:
        wrapped = PeftModel(base_model, config)  # LoRA layers injected into base_model, taken out on any failure
        try:
            result = wrapped.load_adapter(str(folder), "default", is_trainable=False)
        except (RuntimeError, KeyError, OSError) as err:  # (a rank other than the config's: a size mismatch)
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]  # one per weight
            detail = " ".join(lines[:2]) + (f" ... ({len(lines) - 2} more)" if len(lines) > 2 else "")
            raise ValueError(f"the adapter in {folder} could not be loaded onto this model ({detail}); it was saved "
                             "for another model or is damaged: use the adapter the heads were trained with") from err
        missing = [key for key in result.missing_keys if "lora_" in key]
        if missing:  # (peft only warns: the layers it lacks weights for stayed as initialised, adding nothing)
            raise ValueError(f"the adapter in {folder} lacks {len(missing)} of the LoRA weights its config asks "
                             f"for on this model (such as {missing[0]}): merged, they would add nothing; it was "
                             "saved for another model (of fewer layers, say) or is damaged: use the adapter the "
                             "heads were trained with, as peft saved it (its keys and adapter_config.json together)")
        unexpected = [key for key in result.unexpected_keys if "lora_" in key]
        if unexpected:  # (not even a warning: the weights of layers this model lacks were dropped)
            raise ValueError(f"the adapter in {folder} holds {len(unexpected)} LoRA weights this model has no "
                             f"place for (such as {unexpected[0]}): it was saved for another model (of more "
                             "layers, say); load the heads on the model they were trained on")
        if getattr(config, "lora_bias", False):  # checked before any layer merges (peft fails midway)
            unbiased = [name for name, module in base_model.named_modules()
                        if hasattr(module, "lora_A") and getattr(module.get_base_layer(), "bias", None) is None]
            if unbiased:
                raise ValueError(f"the adapter in {folder} has lora_bias, and the layers it adapts have no bias "
                                 f"(such as {unbiased[0]}): it cannot be merged into this model")
    except BaseException:
        _take_out(wrapped, base_model, flags)  # the given model as it was: refused loads leave it so
        raise
    merged = wrapped.merge_and_unload()
    for name, param in merged.named_parameters():
        param.requires_grad_(flags.get(name, param.requires_grad))
    forget_packed(merged)  # the merge wrote through .data: copies packed before it hold the old weights
    digest = adapter_digest(folder)
    setattr(merged, MERGED_ADAPTER_ATTR, (str(folder), digest))
    setattr(merged.config, MERGED_ADAPTER_KEY, digest)  # saved with the merged weights
    return merged


def _take_out(wrapped: Any, base_model: PreTrainedModel, flags: dict[str, bool]) -> None:
    """Undo what wrapping ``base_model`` in a peft model did, nothing merged: the modules peft trains copies of
    (``modules_to_save``: its unload keeps the copies, which a refused load had half written) back to the
    originals, the LoRA layers taken out (by peft's unload; by hand where the wrapping itself failed midway,
    ``wrapped`` None: a target LoRA cannot adapt, after earlier ones were replaced), and each parameter's
    ``requires_grad`` (``flags``) as it was."""
    for name, module in list(base_model.named_modules()):
        original = getattr(module, "original_module", None)
        base = module.get_base_layer() if wrapped is None and hasattr(module, "lora_A") else None
        replacement = original if isinstance(original, nn.Module) else base
        if name and isinstance(replacement, nn.Module) and replacement is not module:
            parent, _, child = name.rpartition(".")
            setattr(base_model.get_submodule(parent) if parent else base_model, child, replacement)
    if wrapped is not None:
        wrapped.unload()
    for name, param in base_model.named_parameters():
        param.requires_grad_(flags.get(name, param.requires_grad))


ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
"""The files peft saves an adapter's weights in (either)."""

MERGED_ADAPTER_ATTR = "_medusa_merged_adapter"
"""Set by ``merge_adapter`` on the model it changed: ``(folder, adapter_digest(folder))``, so that a
second ``from_pretrained`` on the same object neither merges the adapter twice nor takes the
merged weights for the plain base model."""

MERGED_ADAPTER_KEY = "medusa_forge_merged_adapter"
"""Set by ``merge_adapter`` on the model's config: the merged adapter's ``adapter_digest``. The base
model saved after the merge (``model.base_model.save_pretrained``: the merged weights other engines
load) keeps it in its ``config.json``, so that ``from_pretrained`` of the heads that adapter came with,
on that folder, does not merge it a second time; heads with another adapter are refused there (merged
on top, the weights would be neither model), and heads with none load on it as on any base model."""


ADAPTER_DIGEST_SKIPS = ("README.md",)
"""Files of an adapter folder that change nothing merged: peft's model card (and hidden files, such as
``.DS_Store``); an edit to them made the merged base model saved before look like another adapter's."""


ADAPTER_NAMING_KEYS = ("base_model_name_or_path", "revision")
"""Keys of ``adapter_config.json`` that name the base model, not the adapter: left out of its digest (a run
evaluated again with ``model.hub_id`` set renames it, and the merged export made before refused the same
adapter)."""


def adapter_digest(folder: str | os.PathLike) -> str:
    """SHA-256 of a saved adapter's files (names and contents), bar ``ADAPTER_DIGEST_SKIPS``, hidden files and
    the base model's name in ``adapter_config.json`` (``ADAPTER_NAMING_KEYS``): equal for copies of one adapter."""
    return adapter_digests(folder)[0]


def adapter_digests(folder: str | os.PathLike) -> tuple[str, str, str]:
    """``adapter_digest(folder)``, and the digests earlier versions recorded (in a merged base model's
    ``config.json``, an export's): of its files with ``adapter_config.json`` as it is, and of all of its files.
    Any of them names the adapter."""
    digest, previous, every = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
    for path in sorted(p for p in Path(folder).iterdir() if p.is_file()):
        content = path.read_bytes()
        entry = path.name.encode() + b"\0" + content
        every.update(entry)
        if path.name not in ADAPTER_DIGEST_SKIPS and not path.name.startswith("."):
            previous.update(entry)
            digest.update(path.name.encode() + b"\0" + _unnamed(path.name, content))
    return digest.hexdigest(), previous.hexdigest(), every.hexdigest()


def _unnamed(name: str, content: bytes) -> bytes:
    """An adapter file's bytes as its digest reads them: ``adapter_config.json`` without ``ADAPTER_NAMING_KEYS``
    (as canonical JSON), other files (and a config that is no JSON object) as they are."""
    if name != "adapter_config.json":
        return content
    try:
        settings = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return content
    if not isinstance(settings, dict):
        return content
    return json.dumps({k: v for k, v in settings.items() if k not in ADAPTER_NAMING_KEYS}, sort_keys=True).encode()


_OWN_TEMPLATE = "_medusa_forge_chat_templates"
"""A tokenizer attribute: (its own chat template, the one heads installed), kept by ``install_chat_template``."""


def install_chat_template(tokenizer: Any, template: str | None) -> None:
    """Render chats on ``tokenizer`` as heads were trained: their own ``template`` is installed in place; with
    None (heads trained on the tokenizer's own), a template heads installed before is taken back, unless it was
    changed since (one set by hand stays)."""
    now = getattr(tokenizer, "chat_template", None)
    own, installed = getattr(tokenizer, _OWN_TEMPLATE, (now, None))
    if template:
        if installed is None or now != installed:
            own = now  # (a template set by hand since is the one to come back to)
        tokenizer.chat_template = template
        setattr(tokenizer, _OWN_TEMPLATE, (own, template))
    elif installed is not None and now == installed:
        tokenizer.chat_template = own
        setattr(tokenizer, _OWN_TEMPLATE, (own, None))


def heads_folder(path_or_repo_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A heads folder on disk: the path itself, or a Hub repo's snapshot (downloaded when not cached).

    ``ValueError`` when the path is a file, a missing folder (a path object, or a string that cannot be a
    Hub id: ``models.is_path_like``), or neither a folder nor a Hub repo that could be fetched.
    """
    from medusa_infer.models import is_path_like

    if not isinstance(path_or_repo_id, (str, os.PathLike)):
        raise TypeError(f"the heads must be a folder or a Hub repo id, got a {type(path_or_repo_id).__name__}: "
                        "MedusaModel.from_pretrained(heads, base_model=model) takes the heads first and the base model "
                        "as base_model=")
    if not str(path_or_repo_id).strip():  # (an unset variable: the working directory was read as the heads)
        raise ValueError("the heads folder is an empty string: give a folder path or a Hub repo id")
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir() and revision is not None:  # (it was read as it is, whatever revision was asked for)
        raise ValueError(f"revision={revision!r} picks a version of a Hub repo, and {path_or_repo_id} is a local "
                         "folder: drop revision=, or name the repo where no folder of that name is here")
    if path.is_dir():  # absolute: an adapter merged from it is copied from there after a chdir too
        return path.absolute()
    if path.exists():
        raise ValueError(f"{path} is a file; pass the folder that holds config.json and the weights")
    if not isinstance(path_or_repo_id, str) or is_path_like(path_or_repo_id):
        raise ValueError(f"no such heads folder: {path_or_repo_id} ({path.absolute()} does not exist); "
                         "check the path, or pass a Hub repo id such as 'owner/name'")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(path_or_repo_id, revision=revision))
    except HFValidationError as err:  # "my heads": a mistyped folder more likely than a repo id
        raise ValueError(f"no such heads folder: {path_or_repo_id} ({path.absolute()} does not exist), and it "
                         f"cannot be a Hub repo id either ({err}); check the path") from err
    except (LocalEntryNotFoundError, RepositoryNotFoundError) as err:
        at = "" if revision is None else f" at revision {revision!r}"
        offline = (" (where the Hub cannot be reached, a repo is read from the cache: download it once online, "
                   "with that revision)"
                   if isinstance(err, LocalEntryNotFoundError) else "")
        raise ValueError(f"{path_or_repo_id} is no local folder, and fetching it as a Hub repo{at} failed{offline}: "
                         f"{err}") from err


def _check_trained_weights(config: MedusaConfig, name: str | None, directory: Path, adapting: bool = False) -> None:
    """Warn where the heads' training recorded other base weights (``training.settings.model_weights``) than
    ``name`` (the base model loaded, by name or by its ``name_or_path``, with no adapter merged) holds: a recipe
    whose ``model.hub_id`` named the model a fine-tune came from loaded that model, whose drafts matched little,
    without a word. ``adapting``: the heads' Medusa-2 adapter is to be merged into it."""
    settings = config.training.get("settings")
    recorded = settings.get("model_weights") if isinstance(settings, dict) else None
    if not isinstance(recorded, str) or not name:
        return
    from medusa_infer.models import names_default_model, weights_identity

    if recorded.startswith("gguf-sha256:") != names_default_model(name):  # (a default model's converted folder
        return  # by its path: its files, not its GGUF, are digested; the two are not compared)
    try:
        now = weights_identity(name)
    except (OSError, ValueError):  # (not on this machine as files: nothing to compare)
        return
    if now is None or now == recorded:
        return
    recipe = config.training.get("recipe")
    model = recipe.get("model") if isinstance(recipe, dict) else None
    trained_on = model.get("name") if isinstance(model, dict) else None
    where = f" ({trained_on})" if isinstance(trained_on, str) and trained_on != name else ""
    effect = ("their Medusa-2 adapter, merged into these, gives neither model's output" if adapting else
              "their drafts will seldom be accepted (the output is still this model's own)")
    logger.warning("the heads in %s were trained on weights%s whose files differ from those of %s (their training "
                   "recorded %s, these are %s): if these are other weights (a fine-tune's parent model, say), %s; "
                   "give the model they were trained on (base_model=, or the command lines' --model). A copy of the "
                   "same weights saved otherwise (in other shards, say) differs too", directory, where, name,
                   recorded, now, effect)


def _given_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object passes through; a name or folder is loaded; anything else is a ``ValueError``."""
    if isinstance(tokenizer, (str, os.PathLike)):
        from medusa_infer.models import load_tokenizer

        return load_tokenizer(str(tokenizer))
    check_tokenizer(tokenizer)
    return tokenizer


def check_tokenizer(tokenizer: Any) -> None:
    """``ValueError`` for a ``tokenizer=`` that is no tokenizer (None is none given): a tokenizer class or a
    function was taken, and failed at the first ``generate`` naming neither."""
    if tokenizer is not None and (not callable(tokenizer) or isinstance(tokenizer, type)
                                  or not hasattr(tokenizer, "decode")):
        raise ValueError(f"tokenizer must be a tokenizer (AutoTokenizer.from_pretrained(...)) or, where a model is "
                         f"loaded, its name or folder; got a {type(tokenizer).__name__}: {tokenizer!r:.60}")


def _load_base(
    base_model: PreTrainedModel | str, tokenizer: Any, named_by: Path | None = None
) -> tuple[PreTrainedModel, Any, str | None]:
    """An already loaded model passes through, in eval mode (one built from a config is in training mode,
    whose dropout made greedy decoding random); a name is resolved and loaded with its tokenizer. A tokenizer
    given by name or folder is loaded from there. A name that does not load raises an error naming it and the
    fix, and ``named_by`` (the heads folder whose config.json named it), where given: offline, a Hub id never
    downloaded, or a folder moved since, transformers' error named neither."""
    from medusa_infer.models import load_base_model, load_tokenizer

    tokenizer = _given_tokenizer(tokenizer)  # (its failure is not the base model's)
    if isinstance(base_model, PreTrainedModel):
        check_supported(base_model)  # before its weights are read (a bare decoder has no lm_head)
        # weights changed through .data since its last forward (peft's merge_and_unload, which check_supported
        # asks for) bump no version: copies packed before would serve the old weights
        forget_packed(base_model)
        return base_model.eval(), tokenizer, getattr(base_model, "name_or_path", None) or None
    if isinstance(base_model, nn.Module):
        if hasattr(base_model, "peft_config"):
            check_supported(base_model)  # a peft wrapper is named there, with the ways to pass it
        raise ValueError(f"base_model is a {type(base_model).__name__}, not a transformers PreTrainedModel: pass the "
                         "model itself (for a torch.compile'd one, its _orig_mod) or its name")
    name = str(base_model)
    try:
        model = load_base_model(name)
        return model, tokenizer if tokenizer is not None else load_tokenizer(name), name
    except (OSError, ValueError) as err:
        if named_by is None and isinstance(err, ValueError):  # (ours, naming the value and the fix)
            raise
        kind = OSError if isinstance(err, OSError) else ValueError
        if named_by is None:
            raise kind(f"the base model {name!r} could not be loaded: {err or repr(err)}\n(a Hub id is read from the "
                       "cache offline: download it once online; or give a local folder, a default-model name, or a "
                       "loaded model)") from err
        raise kind(f"the base model {name!r} that {named_by}/config.json names could not be loaded: "
                   f"{err or repr(err)}\n(where it cannot be had here, give the base model the heads were trained "
                   "on: base_model=, or the command lines' --model)") from err


def _generate_signature() -> inspect.Signature:
    """``MedusaModel.generate``'s signature, as help() and editors show it: ``decoding.generate``'s, the model its
    ``self`` (it forwards its arguments, which showed ``(self, *args, **kwargs)`` alone)."""
    from medusa_infer.decoding import generate

    parameters = list(inspect.signature(generate).parameters.values())
    return inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *parameters[1:]],
                             return_annotation="GenerationOutput")


MedusaModel.generate.__signature__ = _generate_signature()  # type: ignore[attr-defined]
