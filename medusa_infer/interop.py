"""Import and export of the FasterDecoding/Medusa heads layout, which TGI and TensorRT-LLM read.

A FasterDecoding-layout folder holds:

* ``config.json`` with ``medusa_num_heads``, ``medusa_num_layers`` and ``base_model_name_or_path``
  (TGI finds the base model through it); we also write ``hidden_size``, ``vocab_size`` and
  ``version``. No ``architectures`` or ``model_type``: TGI reads a speculator config that names
  ``architectures`` as some other kind of speculator. Heads trained on a default model
  (``medusa_infer.models``: float32 weights dequantized from a GGUF file) name its original Hub
  repository there, for other engines, and medusa-forge's own name for it in ``BASE_MODEL_KEY``,
  which ``base_model_name`` reads first: re-imported, the heads get the weights they were trained on.
* ``medusa_lm_head.safetensors`` (read by TGI) or ``medusa_lm_head.pt`` (the original trainer's
  output; TensorRT-LLM reads either, ``.pt`` first) with, for head ``k`` and block ``l``:
  ``{k}.{l}.linear.weight`` ``[hidden, hidden]``, ``{k}.{l}.linear.bias`` ``[hidden]`` and, in
  version 1, the head's own bias-free vocabulary projection ``{k}.{num_layers}.weight``
  ``[vocab, hidden]``. Version 2 stores no projection: the heads reuse the base model's
  ``lm_head`` (our ``shared`` projection). TGI reads version 2 only with one block per head and
  TensorRT-LLM not at all. FasterDecoding's own loader shares one module among a head's blocks,
  so it reads heads of more than one block wrongly (``write_medusa_layout`` warns).

Which variant a folder holds is decided by its tensors, as TGI decides, not by ``version``.
Everything is checked strictly: a missing, unexpected or mis-shaped tensor raises ``ValueError``.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from medusa_infer.checkpoint import (
    CARD_NAME,
    FASTERDECODING_WEIGHTS,
    IMPORTED_FROM,
    check_state_dict,
    first_existing,
    foreign_config,
    model_card,
    unreadable_weights,
    write_in_place,
)
from medusa_infer.checkpoint import WEIGHTS_NAME as OUR_WEIGHTS_NAME
from medusa_infer.config import MedusaConfig
from medusa_infer.heads import MedusaHeads

CONFIG_NAME = "config.json"
SAFETENSORS_NAME, PT_NAME = FASTERDECODING_WEIGHTS
WEIGHTS_NAMES = {"safetensors": SAFETENSORS_NAME, "pt": PT_NAME}
BASE_MODEL_KEY = "medusa_forge_base_model"
"""``config.json`` key naming the base model as medusa-forge loads it, where that differs from the Hub id."""

TOP_K_KEY = "medusa_forge_top_k"
"""``config.json`` key keeping the heads' ``top_k`` (the candidates per head their default tree may rank),
which the layout has no place for: heads with no tree of their own decode with the default tree it allows."""

TRAINING_MODE_KEY = "medusa_forge_training_mode"
"""``config.json`` key set to ``"medusa2"`` for heads trained with a LoRA adapter on the backbone, which the layout
does not hold: read back, the heads' config records that mode (``MedusaConfig.trained_with_adapter``), so that
loading them on a base model without that adapter merged is warned about and ``heads.init_from`` refuses them."""

ADAPTER_DIGEST_RECORD = "adapter_digest"
"""The training record's key (``MedusaConfig.training``) keeping ``ADAPTER_DIGEST_KEY`` of imported heads."""
ADAPTER_DIGEST_KEY = "medusa_forge_adapter_digest"
"""``config.json`` key keeping the digest (``model.adapter_digest``) of the Medusa-2 adapter the heads were
trained with, which the layout does not hold: read back, the heads load onto a base model with that adapter merged
and are refused on one with another merged (onto any, without the key)."""

BASE_MODEL_TYPE_KEY = "medusa_forge_base_model_type"
"""``config.json`` key keeping the ``model_type`` of the base model the heads were trained on
(``MedusaConfig.base_model_type``): read back, loading them on a model of another type is refused as for
heads saved with ``save_pretrained`` (a llama's heads on a qwen2 of the same sizes draft nothing useful)."""

CHAT_TEMPLATE_KEY = "medusa_forge_chat_template"
"""``config.json`` key keeping the chat template the heads were trained on where it is not the tokenizer's own
(``MedusaConfig.chat_template``, e.g. a recipe's Vicuna template), which the layout has no place for: read back, the
heads render chats as they were trained to; other engines need to be given that template themselves."""

logger = logging.getLogger(__name__)

_BLOCK = re.compile(r"heads\.(\d+)\.blocks\.(\d+)\.linear\.(weight|bias)")
_PROJ = re.compile(r"heads\.(\d+)\.proj\.weight")
_HEAD_INDEX = re.compile(r"(\d+)\.")
_FD_NAME = re.compile(r"\d+\.\d+\.(linear\.(weight|bias)|weight)")
"""Every tensor name of the layout: a head's block's linear layer, or its vocabulary projection."""


def is_medusa_layout(path: str | Path) -> bool:
    """Whether ``path`` is a folder with a FasterDecoding-style ``config.json`` (its weights file is
    checked when it is read: ``weights_file``). A ``config.json`` that does not read, or is no JSON object,
    beside this layout's weights file counts as one: ``read_medusa_layout`` then names what is wrong with it."""
    path = Path(path)
    try:
        data = json.loads((path / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        data = None
    if isinstance(data, dict):
        return "medusa_num_heads" in data and "medusa_num_layers" in data
    return (path / CONFIG_NAME).is_file() and any((path / name).is_file() for name in (SAFETENSORS_NAME, PT_NAME))


def weights_file(path: str | Path) -> Path:
    """The weights file of a FasterDecoding-layout folder: ``medusa_lm_head.safetensors``, else ``.pt``.

    Raises:
        ValueError: the folder holds neither.
    """
    path = Path(path)
    for name in (SAFETENSORS_NAME, PT_NAME):
        if (path / name).is_file():
            return path / name
    raise ValueError(
        f"{path} has a FasterDecoding-layout config.json but neither {SAFETENSORS_NAME} nor {PT_NAME}: "
        "the heads' weights are missing; download or export the folder again with its weights file"
    )


def base_model_name(path: str | Path) -> str | None:
    """The base model a heads folder's ``config.json`` names, as medusa-forge loads it: ``BASE_MODEL_KEY``
    when an export wrote it, else ``base_model_name_or_path`` (either layout); None when it names none."""
    return _base_model(_read_json_object(Path(path) / CONFIG_NAME, "a heads folder"))


def _base_model(data: dict[str, Any]) -> str | None:
    """The base model a ``config.json``'s keys name: ``BASE_MODEL_KEY``, else ``base_model_name_or_path``."""
    return data.get(BASE_MODEL_KEY) or data.get("base_model_name_or_path")


def _choices(raw: Any, num_heads: int, where: Path) -> list[list[int]] | None:
    """``medusa_choices`` (a tree as paths of ranks, as ``write_medusa_layout`` and TensorRT-LLM write it)
    checked ([] kept: plain decoding), or None when absent."""
    if raw is None or raw == []:  # [] is a tree too: plain decoding (what calibration may measure fastest)
        return raw
    from medusa_infer.trees import validate_tree

    try:
        ranks = [int(rank) for path in raw for rank in path]
        # (ranks all negative: top_k 0 was named, not the path)
        return [list(path) for path in validate_tree(raw, num_heads, max(max(ranks, default=0), 0) + 1)]
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: medusa_choices is not a tree of rank paths ({err}); fix or remove it") from err


def _top_k(raw: Any, where: Path) -> int:
    """``TOP_K_KEY``'s value checked, or ``MedusaConfig``'s default where an export did not write it."""
    if raw is None:
        return MedusaConfig.top_k
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise ValueError(f"{where}: {TOP_K_KEY} must be a positive integer, got {raw!r}; fix or remove it")
    return raw


def read_medusa_layout(
    path: str | Path,
    hidden_size: int | None = None,
    vocab_size: int | None = None,
    lm_head_weight: torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
    given_by: str | None = None,
) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """Read a FasterDecoding-layout folder as our config and state dict.

    ``medusa_lm_head.safetensors`` is read when present, else ``medusa_lm_head.pt`` (only with
    ``torch.load(weights_only=True)``). Heads with projection tensors become ``projection="own"``;
    heads without (version 2) become ``"shared"``, as do heads whose every projection is an exact copy
    of ``lm_head_weight`` (version 1 of shared heads, which ``write_medusa_layout`` writes
    so; as ``own`` they would hold a copy of the vocabulary projection each and compute their logits
    head by head, not bitwise as the heads exported). Tensor dtypes are kept. The config's ``training``
    records the import (``checkpoint.IMPORTED_FROM``), and its base model is ``base_model_name``'s.

    Args:
        path: the folder.
        hidden_size: the base model's hidden size; checked against the tensors and ``config.json``,
            needed only when neither tells it (shared heads with no blocks).
        vocab_size: the base model's vocabulary size; checked likewise, needed for shared heads
            when ``config.json`` has no ``vocab_size`` (the original trainer never wrote it).
        lm_head_weight, lm_head_bias: the base model's ``lm_head`` weight and bias, to recognise
            projections that copy it (a bias other than zeros: they cannot).
        given_by: what gave ``hidden_size`` and ``vocab_size``, as an error naming a disagreement says it
            (e.g. ``"the base model (llama)"``); default: "the hidden_size argument".

    Returns:
        ``(config, state_dict)``, the state dict in our naming, ready for
        ``MedusaHeads(config).load_state_dict(state_dict)``.
    """
    path = Path(path)
    data = _read_config_json(path / CONFIG_NAME)
    num_heads, num_layers = data["medusa_num_heads"], data["medusa_num_layers"]
    weights_path = weights_file(path)
    tensors = _load_weights(weights_path)

    foreign = sorted(name for name in tensors if not _FD_NAME.fullmatch(name))
    if foreign:  # first: sizes read from them named the wrong thing ("nothing tells the heads' hidden_size")
        raise ValueError(f"{weights_path} holds tensors the FasterDecoding layout does not name, such as {foreign[:3]} "
                         f"({len(foreign)} in all; its names are '<head>.<layer>.linear.weight|bias' and "
                         "'<head>.<layers>.weight'): strip a prefix another tool added, or convert heads of another "
                         "layout (vLLM's, EAGLE's) first")
    heads_found = sorted({int(m[1]) for m in map(_HEAD_INDEX.match, tensors) if m})
    if heads_found and heads_found[-1] + 1 != num_heads:
        raise ValueError(
            f"{weights_path} holds heads {heads_found} but {path / CONFIG_NAME} says medusa_num_heads={num_heads}; "
            f"if the weights are complete, set medusa_num_heads to {heads_found[-1] + 1} in config.json "
            "(some early FasterDecoding uploads understate it)"
        )
    layers_found = _layers_found(tensors)
    if layers_found is not None and layers_found != num_layers:
        raise ValueError(
            f"{weights_path} holds heads of {layers_found} ResBlock layers but {path / CONFIG_NAME} says "
            f"medusa_num_layers={num_layers}; if the weights are complete, set medusa_num_layers to {layers_found} "
            "in config.json"
        )
    tree = _choices(data.get("medusa_choices"), num_heads, path / CONFIG_NAME)  # its ranks bound top_k below
    proj_names = [f"{k}.{num_layers}.weight" for k in range(num_heads)]
    block_names = [f"{k}.{l}.linear.weight" for k in range(num_heads) for l in range(num_layers)]
    has_projections = any(name in tensors for name in proj_names)
    if has_projections and _copies_lm_head([tensors.get(name) for name in proj_names], lm_head_weight, lm_head_bias):
        tensors = {name: t for name, t in tensors.items() if name not in proj_names}
        has_projections = False
    found = [tensors[name] for name in proj_names + block_names if name in tensors]  # projections first
    config = MedusaConfig(
        num_heads=num_heads,
        num_layers=num_layers,
        hidden_size=_agree("hidden_size", weights_path, found[0].shape[-1] if found else None,
                           data.get("hidden_size"), hidden_size, given_by),
        vocab_size=_agree("vocab_size", weights_path, found[0].shape[0] if has_projections else None,
                          data.get("vocab_size"), vocab_size, given_by),
        projection="own" if has_projections else "shared",
        base_model_name_or_path=_base_model(data),
        training=_imported_training(data.get(TRAINING_MODE_KEY), path / CONFIG_NAME, exported_adapter_digest(path)),
        chat_template=_chat_template(data.get(CHAT_TEMPLATE_KEY), path / CONFIG_NAME),
        base_model_type=_base_model_type(data.get(BASE_MODEL_TYPE_KEY), path / CONFIG_NAME),
        tree=tree,
        top_k=max(_top_k(data.get(TOP_K_KEY), path / CONFIG_NAME),
                  1 + max((rank for p in tree or [] for rank in p), default=0)),
    )
    expected = _expected(config)
    ours_to_theirs = {name: _their_name(name, num_layers) for name in expected}
    check_state_dict({ours_to_theirs[name]: t for name, t in expected.items()}, tensors, str(weights_path))
    return config, {ours: tensors[theirs] for ours, theirs in ours_to_theirs.items()}


def _base_model_type(raw: Any, where: Path) -> str | None:
    """``BASE_MODEL_TYPE_KEY``'s value checked: None where an export did not write it."""
    if raw is not None and (not isinstance(raw, str) or not raw):
        raise ValueError(f"{where}: {BASE_MODEL_TYPE_KEY} must be a model type such as 'llama', got {raw!r}; fix or "
                         "remove it")
    return raw


def _chat_template(raw: Any, where: Path) -> str | None:
    """``CHAT_TEMPLATE_KEY``'s value checked: None where an export did not write it (the tokenizer's template)."""
    if raw is not None and not isinstance(raw, str):
        raise ValueError(f"{where}: {CHAT_TEMPLATE_KEY} must be a jinja chat template (a string), got {raw!r:.200}; "
                         "fix or remove it")
    return raw or None


def _imported_training(mode: Any, where: Path, adapter_digest: str | None = None) -> dict[str, Any]:
    """The training record of imported heads: their origin, the Medusa-2 mode where ``TRAINING_MODE_KEY``
    says so (as ``MedusaConfig.trained_with_adapter`` reads a run's recipe) and the digest of the adapter
    they were trained with where the export names it (``ADAPTER_DIGEST_RECORD``: heads saved again in our
    layout, which then holds no adapter, are still checked against the base model's merged one)."""
    if mode not in (None, "medusa1", "medusa2"):
        raise ValueError(f"{where}: {TRAINING_MODE_KEY} must be 'medusa1' or 'medusa2', got {mode!r}")
    record: dict[str, Any] = {IMPORTED_FROM: "FasterDecoding/Medusa layout"}
    if mode is not None:
        record["recipe"] = {"training": {"mode": mode}}
    if mode == "medusa2" and adapter_digest is not None:
        record[ADAPTER_DIGEST_RECORD] = adapter_digest
    return record


def recorded_adapter_digest(config: MedusaConfig, where: Path) -> str | None:
    """The digest of the Medusa-2 adapter heads imported from an export were trained with (their training
    record's ``ADAPTER_DIGEST_RECORD``); None where not recorded."""
    raw = config.training.get(ADAPTER_DIGEST_RECORD)
    if raw is not None and (not isinstance(raw, str) or not raw):
        raise ValueError(f"{where}: training.{ADAPTER_DIGEST_RECORD} must be an adapter's digest (a hex string), got "
                         f"{raw!r}; fix or remove it")
    return raw


_FD_BLOCK = re.compile(r"\d+\.(\d+)\.linear\.weight")
_FD_PROJ = re.compile(r"\d+\.(\d+)\.weight")


def _layers_found(tensors: dict[str, torch.Tensor]) -> int | None:
    """The ResBlock layers per head that the tensors' names show (the projection's index where there
    is one, else one past the last block's), or None where they show none."""
    projections = {int(m[1]) for m in map(_FD_PROJ.fullmatch, tensors) if m}
    blocks = {int(m[1]) for m in map(_FD_BLOCK.fullmatch, tensors) if m}
    if len(projections) == 1:
        return projections.pop()
    return max(blocks) + 1 if blocks and not projections else None


def _copies_lm_head(
    projections: list[torch.Tensor | None], weight: torch.Tensor | None, bias: torch.Tensor | None
) -> bool:
    """Whether every head's projection, cast to ``weight``'s dtype (the one the heads compute in), holds
    ``weight``'s numbers exactly and the base ``lm_head`` adds no bias: version 1 of shared heads. A
    bfloat16 model's copies read onto its float32 load are copies, and so are a float32 model's read
    onto its bfloat16 load (they round to that ``lm_head``: as own heads they computed the same logits
    with a vocabulary projection per head more), and a float32 model's copies exported from its bfloat16
    load, read onto its float32 load (``weight`` rounded to the copies' dtype is them: as own heads, a
    vocabulary projection per head more, 328 MiB on SmolLM2, for logits no closer to the export's)."""
    if weight is None or (bias is not None and bool(bias.any())):
        return False
    weight = weight.detach().to("cpu")

    def same(p: torch.Tensor | None) -> bool:
        if p is None or p.shape != weight.shape:
            return False
        coarser = p.is_floating_point() and torch.finfo(p.dtype).bits < torch.finfo(weight.dtype).bits
        return torch.equal(p.to(weight.dtype), weight) or (coarser and torch.equal(weight.to(p.dtype), p))

    return all(same(p) for p in projections)


def write_medusa_layout(
    config: MedusaConfig,
    state_dict: dict[str, torch.Tensor],
    path: str | Path,
    lm_head_weight: torch.Tensor | None = None,
    fmt: Literal["safetensors", "pt"] = "safetensors",
    version: Literal["1", "2"] | None = None,
    lm_head_bias: torch.Tensor | None = None,
    adapter_digest: str | None = None,
    chat: bool = True,
) -> Path:
    """Write heads as a FasterDecoding-layout folder (``config.json`` + ``medusa_lm_head.*``), with a model card
    (``README.md``: what the layout has no place for, the measured accuracies among it, and how to load them).

    Args:
        config: the heads' configuration; ``base_model_name_or_path`` must be set (readers load the
            base model through it; see ``base_model_keys``) and the vocabulary must be full (the layout
            has no token map).
        state_dict: the heads' tensors in our naming (``MedusaHeads.state_dict()``).
        path: the folder, created if missing.
        lm_head_weight: ``[vocab, hidden]`` base ``lm_head`` weight, required for (and only for)
            version 1 of ``shared`` heads, which stores a copy of it as every head's projection.
        fmt: ``"safetensors"`` (what TGI reads) or ``"pt"`` (the original trainer's format).
        version: ``"1"`` stores a projection per head (what TensorRT-LLM reads), ``"2"`` none (the
            heads reuse the base ``lm_head``; TGI reads it with one block a head only, TensorRT-LLM
            not at all). Defaults to ``"1"`` for ``own`` heads and ``"2"`` for ``shared`` ones;
            ``own`` heads can only be written as version 1.
        lm_head_bias: the base ``lm_head``'s bias, if it has one: version 1 of ``shared`` heads is
            refused then (the layout's projections have no bias, so the copies would drop it).
        adapter_digest: of Medusa-2 heads, the digest of the adapter they were trained with, where known
            (``ADAPTER_DIGEST_KEY``).
        chat: whether the base model's tokenizer renders chats (the card's example then sends one).

    Returns:
        The folder. Tensors are written contiguous, in their own float dtype.
    """
    unheld = ([f"a reduced vocabulary ({config.reduced_vocab_size} of {config.vocab_size} tokens; the layout has no "
               "token map)"] if config.reduced_vocab_size is not None else [])
    if config.next_token_input:
        unheld.append("the token at t + 1 as an input (next_token_input=True" + (" and path_input=True" if
                      config.path_input else "") + "; the layout has no place for their token weights and its "
                      "engines do not feed them the tokens)")
    if unheld:
        raise ValueError(
            f"these heads use {' and '.join(unheld)}, which the FasterDecoding layout cannot hold: save them with "
            "save_pretrained instead, or train heads for other engines with heads.reduced_vocab_size=null "
            "heads.next_token_input=false heads.path_input=false"
        )
    if config.base_model_name_or_path is None:
        raise ValueError(
            "config.base_model_name_or_path is None; TGI and FasterDecoding's loader find the base model through it, "
            "so set it before exporting"
        )
    if fmt not in WEIGHTS_NAMES:
        raise ValueError(f"fmt must be one of {sorted(WEIGHTS_NAMES)}, got {fmt!r}")
    version = version or ("1" if config.projection == "own" else "2")
    if version not in ("1", "2"):
        raise ValueError(f"version must be '1' or '2', got {version!r}")
    if config.projection == "own" and version == "2":
        raise ValueError("heads with their own projections can only be written as version '1'")
    copies_lm_head = config.projection == "shared" and version == "1"
    if copies_lm_head and lm_head_weight is None:
        raise ValueError("version '1' of shared heads stores a copy of the base lm_head per head: pass lm_head_weight")
    if copies_lm_head and lm_head_bias is not None and bool(lm_head_bias.any()):
        raise ValueError(
            "the base model's lm_head has a bias, which version '1' of shared heads would drop (the layout's "
            "per-head projections have none): write version '2', whose readers use the base lm_head itself"
        )
    if not copies_lm_head and lm_head_weight is not None:
        raise ValueError(
            f"lm_head_weight is only used for version '1' of shared heads, not for version {version!r} "
            f"of {config.projection!r} heads; leave it out"
        )

    if config.num_layers > 1:
        logger.warning(
            "writing %d residual blocks per head: FasterDecoding's own loader (medusa/model/medusa_model.py) "
            "builds a head's blocks as one shared module ([ResBlock] * n) and loads non-strictly, so it reads only "
            "the last block without an error; this package, TGI and TensorRT-LLM read them all%s",
            config.num_layers, "" if version == "1" else " in version '1' only (TGI reads version 2 with one block "
            "a head, TensorRT-LLM reads no version 2): export with version='1'",
        )
    if config.num_layers == 0 and version == "2":
        logger.warning("heads without residual blocks in version '2' leave the weights file empty (each head is the "
                       "base lm_head itself): TGI reads version 2 with one block a head, TensorRT-LLM no version 2")
    expected = _expected(config)
    check_state_dict(expected, state_dict, "the state dict to export")
    tensors = {_their_name(name, config.num_layers): _plain(name, state_dict[name]) for name in expected}
    if copies_lm_head:
        if lm_head_weight.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"lm_head_weight has shape {tuple(lm_head_weight.shape)}, expected "
                f"({config.vocab_size}, {config.hidden_size}) (vocab_size, hidden_size) from the config"
            )
        for k in range(config.num_heads):
            tensors[f"{k}.{config.num_layers}.weight"] = _plain("lm_head_weight", lm_head_weight)

    path = Path(path).expanduser()
    existing = first_existing(path)
    if existing is not None and not existing.is_dir():  # (foreign_config's read of path/config.json said
        raise ValueError(f"{existing} is a file, not a folder: export the heads into a folder")  # NotADirectoryError)
    other = foreign_config(path, "FasterDecoding")
    if other is not None:
        raise ValueError(f"{path} holds {other}, which writing this layout there would replace: export into another "
                         "folder")
    if (path / OUR_WEIGHTS_NAME).exists():
        raise ValueError(
            f"{path} holds {OUR_WEIGHTS_NAME} (heads saved with save_pretrained, or a model's weights), which "
            "readers of this layout would find beside it: export into another folder"
        )
    path.mkdir(parents=True, exist_ok=True)
    for other in set(WEIGHTS_NAMES.values()) - {WEIGHTS_NAMES[fmt]}:
        if (path / other).exists():
            raise ValueError(
                f"{path / other} already exists and readers would pick one of the two files; "
                "remove it or write into another folder"
            )
    data: dict[str, Any] = {
        "medusa_num_heads": config.num_heads,
        "medusa_num_layers": config.num_layers,
        **base_model_keys(config.base_model_name_or_path),
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "version": version,
        TOP_K_KEY: config.top_k,
    }
    if config.base_model_type:
        data[BASE_MODEL_TYPE_KEY] = config.base_model_type
    if config.trained_with_adapter:  # the adapter is not in the layout: readers are told the heads need it
        data[TRAINING_MODE_KEY] = "medusa2"
        if adapter_digest is not None:
            data[ADAPTER_DIGEST_KEY] = adapter_digest
    if config.chat_template:  # ("" is none, as from_pretrained reads it)
        data[CHAT_TEMPLATE_KEY] = config.chat_template
        logger.warning("these heads were trained on a chat template other than the tokenizer's own (%s keeps it as "
                       "%s, which this package reads back): other engines render chats with the tokenizer's "
                       "template unless given this one", path / CONFIG_NAME, CHAT_TEMPLATE_KEY)
    if config.tree is not None:  # the heads' own (fitted) tree, in the format TensorRT-LLM's medusa_choices takes;
        # empty where calibration measured plain decoding fastest
        data["medusa_choices"] = [list(path) for path in config.tree]
    if config.head_accuracies or config.cost_profile:
        logger.info("the FasterDecoding layout has no place for the heads' measured accuracies or cost profile: "
                    "%s keeps only their tree (medusa_choices), its card the figures; save_pretrained keeps "
                    "everything", path)
    # (a card: the Hub's page of an upload said nothing of the base model, the figures or the training data, and
    # one of the heads uploaded there before stayed)
    card = model_card(config, chat=chat, exported=True) + (
        f"\nThis folder holds the heads in the FasterDecoding/Medusa layout (`config.json`, `{WEIGHTS_NAMES[fmt]}`, "
        f"version {version}), which " + ("TGI and TensorRT-LLM read" if version == "1" else
                                         "TGI reads (with one block a head; TensorRT-LLM reads version 1 only)")
        + ", and medusa-forge's `from_pretrained` too.\n")
    # both written beside, then moved in: a write that failed over an earlier export left the new config.json
    # beside the old weights (and a load then blamed an understated medusa_num_heads)
    write_in_place(path, [
        (WEIGHTS_NAMES[fmt], (lambda target: save_file(tensors, str(target), metadata={"format": "pt"}))
         if fmt == "safetensors" else (lambda target: torch.save(tensors, target))),
        (CONFIG_NAME, lambda target: target.write_text(json.dumps(data, indent=2) + "\n")),
        (CARD_NAME, lambda target: target.write_text(card, encoding="utf-8"))])
    return path


def exported_adapter_digest(path: str | Path) -> str | None:
    """``ADAPTER_DIGEST_KEY`` of a FasterDecoding-layout folder's ``config.json``: None where not written."""
    where = Path(path) / CONFIG_NAME
    raw = _read_json_object(where, "a heads folder").get(ADAPTER_DIGEST_KEY)
    if raw is not None and (not isinstance(raw, str) or not raw):
        raise ValueError(f"{where}: {ADAPTER_DIGEST_KEY} must be an adapter's digest (a hex string), got {raw!r}; fix "
                         "or remove it")
    return raw


def base_model_keys(name: str) -> dict[str, str]:
    """``config.json``'s base-model keys for heads trained on ``name``: other engines load the base model by
    ``base_model_name_or_path``, so it is a Hub id; a default model's short name (float32 weights dequantized
    from a GGUF file, not the Hub model's) is also kept in ``BASE_MODEL_KEY``, with a note, for re-import."""
    from medusa_infer.models import hub_id

    keys = {"base_model_name_or_path": hub_id(name)}
    if keys["base_model_name_or_path"] != name:
        keys[BASE_MODEL_KEY] = name
        keys["medusa_forge_note"] = (
            f"the heads were trained on medusa-forge's {name!r}: the weights of {hub_id(name)} as its GGUF file "
            f"holds them, dequantized; medusa-forge re-imports this folder with that base model ({BASE_MODEL_KEY}), "
            "other engines load base_model_name_or_path, the original weights, on which the heads' drafts may be "
            "accepted less often"
        )
    return keys


def _read_config_json(config_path: Path) -> dict[str, Any]:
    """The folder's ``config.json``, with integer ``medusa_num_heads`` and ``medusa_num_layers`` (and
    ``hidden_size`` and ``vocab_size`` integers where present)."""
    data = _read_json_object(config_path, "a FasterDecoding Medusa heads folder")
    for key in ("medusa_num_heads", "medusa_num_layers"):
        if not isinstance(data.get(key), int) or isinstance(data[key], bool):
            raise ValueError(f"{config_path} has no integer {key!r} (got {data.get(key)!r}): not a FasterDecoding "
                             "Medusa heads config")
    for key in ("hidden_size", "vocab_size"):  # a string "16" was compared with the tensors' 16 and "disagreed"
        if key in data and data[key] is not None and (not isinstance(data[key], int) or isinstance(data[key], bool)):
            raise ValueError(f"{config_path}: {key} must be an integer, got {data[key]!r} "
                             f"({type(data[key]).__name__}); fix it or remove the key")
    return data


def _read_json_object(config_path: Path, what: str) -> dict[str, Any]:
    """A ``config.json`` holding a JSON object; ``ValueError`` says why it is not ``what``."""
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"cannot read {config_path} ({err}): not {what}") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_path} is not valid JSON ({err}); re-download or re-export it") from err
    if not isinstance(data, dict):
        raise ValueError(f"{config_path} holds a {type(data).__name__}, not a JSON object: not {what}")
    return data


def _load_weights(weights_path: Path) -> dict[str, torch.Tensor]:
    """Float tensors of ``medusa_lm_head.safetensors`` or ``.pt`` (the latter unpickled tensors-only)."""
    if weights_path.suffix == ".safetensors":
        try:
            loaded = load_file(str(weights_path))
        except (SafetensorError, OSError) as err:
            raise unreadable_weights(weights_path, err) from err
    else:
        with weights_path.open("rb") as handle:  # an old release's bare pickle (\x80), or torch.save's zip archive
            torch_file = handle.read(1) == b"\x80" or zipfile.is_zipfile(handle)
        if not torch_file:  # random bytes, a Git LFS pointer, an HTML error page: torch.load called them unsafe
            raise unreadable_weights(weights_path, "not a file torch.save writes")
        try:
            loaded = torch.load(weights_path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(
                f"{weights_path} holds objects other than tensors, which torch.load(weights_only=True) refuses to "
                "unpickle (they could run arbitrary code); if you trust the file, convert it to "
                f"{SAFETENSORS_NAME} holding only the tensors"
            ) from err
        except (RuntimeError, EOFError, OSError) as err:
            raise unreadable_weights(weights_path, err) from err
        if not isinstance(loaded, dict):
            raise ValueError(f"{weights_path} holds a {type(loaded).__name__}, expected a dict of tensors")
    bad = sorted(
        str(k) for k, v in loaded.items()
        if not isinstance(k, str) or not isinstance(v, torch.Tensor) or not v.is_floating_point()
    )
    if bad:
        raise ValueError(f"{weights_path} holds entries that are not named float tensors: {bad}")
    return loaded


class SizesUnknown(ValueError):
    """Neither a FasterDecoding folder's tensors nor its config.json tell the heads' hidden or vocabulary size
    (shared heads of no blocks, a config.json without ``vocab_size``): the base model's config does, where they
    are loaded."""


def _agree(name: str, weights_path: Path, from_tensors: int | None, from_config: int | None, given: int | None,
           given_by: str | None = None) -> int:
    """The one value of ``name`` that the tensors, ``config.json`` and the caller (``given_by``) agree on."""
    sources = {"the tensors": from_tensors, "config.json": from_config, given_by or f"the {name} argument": given}
    known = {source: value for source, value in sources.items() if value is not None}
    if not known:
        raise SizesUnknown(
            f"nothing in {weights_path.parent} tells the heads' {name} (neither the tensors nor config.json); "
            f"pass {name}= from the base model's config"
        )
    if len(set(known.values())) > 1:
        raise ValueError(
            f"{name} disagrees for {weights_path.parent}: "
            + ", ".join(f"{source}: {value}" for source, value in known.items())
            + "; the heads were made for another base model or the folder is inconsistent"
        )
    return next(iter(known.values()))


def _expected(config: MedusaConfig) -> dict[str, torch.Tensor]:
    """Our state dict for ``config`` as shape-only meta tensors (names and shapes from ``MedusaHeads``)."""
    with torch.device("meta"):
        return MedusaHeads(config).state_dict()


def _their_name(name: str, num_layers: int) -> str:
    """FasterDecoding name of one of our tensors: ``heads.k.blocks.l.linear.weight`` -> ``k.l.linear.weight``."""
    if block := _BLOCK.fullmatch(name):
        return f"{block[1]}.{block[2]}.linear.{block[3]}"
    if proj := _PROJ.fullmatch(name):
        return f"{proj[1]}.{num_layers}.weight"
    raise ValueError(f"tensor {name!r} has no counterpart in the FasterDecoding layout")


def _plain(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of a float tensor, in its own dtype."""
    if not tensor.is_floating_point():
        raise ValueError(f"{name} has dtype {tensor.dtype}; Medusa head weights must be floating point")
    return tensor.detach().to("cpu").clone(memory_format=torch.contiguous_format)
