"""Medusa-1 feature cache: the frozen backbone runs once over the data; the heads train from disk.

For each example (``input_ids`` and unshifted ``labels``, -100 outside assistant tokens) the cache
keeps:

* ``hidden``: the final (post-norm) hidden state at every position ``t`` where decoding runs the
  heads and head 0 has a target: ``labels[t + 1]`` and ``labels[t + 2]`` both ``!= -100``, so from
  the last prompt position (the base model predicts the answer's first token there) to two before
  the answer's last token. The position before it (the chat template's assistant header) has a
  head-0 target too, but decoding never runs heads there; the states kept while distilling
  (``medusa_train.captured``) give exactly these rows;
* ``labels``: the whole label row, so the targets of any number of heads can be derived
  (head ``k`` at ``t`` predicts ``labels[t + k + 2]``);
* ``tokens``: the whole token row, so what the heads read can be derived: token ``t + 1``
  (``next_token_input``) and, for ``path_input`` head ``k``, ``tokens[t + 2 .. t + k + 1]``,
  masked positions included;
* ``soft_ids`` / ``soft_probs``: the base model's top-k next-token distribution at every position
  ``t`` where the base model predicts an assistant token (``labels[t + 1] != -100``). Head ``k``'s
  soft target at ``t`` is the entry at ``t + k + 1``, the base model's own prediction of token
  ``t + k + 2``.

A cache is a folder ``<root>/<key>/`` of safetensors shards, ``lm_head.safetensors`` (the base
output projection, so head training never loads the backbone, and ``embed``, its input embedding,
when that is not the same tensor) and ``manifest.json`` (written last:
a folder without it is incomplete). The key hashes the model (its weights and, as they change its
hidden states, the dtype and attention implementation it runs with), the examples and the settings
(``shard_examples`` included: a shard left by an interrupted run is reused only under the same
split), so a second run, or another recipe over the same data, reuses it. Each shard's metadata also
lists the example indices it holds; a resumed run makes again a shard whose list is not its plan's.

Tensors of a *block* (one shard, or one live batch), for E examples, R hidden rows, P soft rows:
``example_index [E]``, ``label_start [E]``, ``label_length [E]``, ``labels [sum L]``,
``tokens [sum L]``, ``row_example [R]``, ``row_position [R]``, ``hidden [R, H]``,
``soft_example [P]``, ``soft_position [P]``, ``soft_ids [P, k]``, ``soft_probs [P, k]``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from medusa_infer.models import digest_samples
from medusa_train.losses import IGNORE, to_head_vocab

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from medusa_train.captured import CapturedHidden

# 2: blocks hold row_next; 3: tokens instead (row_next derives from them); 4: no row at the
# second-to-last prompt position, shards list their examples
FORMAT_VERSION = 4
MANIFEST = "manifest.json"
LM_HEAD = "lm_head.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHARD_EXAMPLES = 256
BACKBONE = ("dtype", "attn_implementation")  # fingerprint entries that describe how the model runs

Block = dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Targets


def head_targets(labels: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[..., L, K]`` targets: entry ``[t, k]`` is ``labels[t + k + 2]``, ``IGNORE`` past the end."""
    length = labels.shape[-1]
    pad = torch.full((*labels.shape[:-1], num_heads + 1), IGNORE, dtype=labels.dtype, device=labels.device)
    padded = torch.cat([labels, pad], dim=-1)
    return torch.stack([padded[..., k + 2 : k + 2 + length] for k in range(num_heads)], dim=-1)


def _as_long(values: Any) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.long)


def examples_hash(examples: Sequence[Mapping[str, Any]]) -> str:
    """SHA-256 of the examples' ``input_ids`` and ``labels``, in order."""
    digest = hashlib.sha256()
    for example in examples:
        for name in ("input_ids", "labels"):
            digest.update(_as_long(example[name]).numpy().tobytes())
            digest.update(b"|")
    return digest.hexdigest()


def model_fingerprint(name_or_path: str, dtype: str | None = None,
                      attn_implementation: str | None = None) -> dict[str, Any]:
    """What identifies a base model without loading it: its name (a local folder's path, normalised) and,
    for a local folder, its ``config.json`` and each weight file's (those ``from_pretrained`` loads) size,
    modification time and first and last MiB (the
    time catches weights saved again over the same folder, changed only in the middle: hashing
    every byte would read the whole model at every run); for a Hub id, the revision its ``main``
    points to (``hub_revision``: the id alone reused old features after weights were pushed again
    under it); with ``dtype``, also the dtype and attention implementation it is loaded with (None:
    transformers' choice), which change its hidden states (``build_feature_cache`` checks them
    against the model it runs)."""
    from medusa_infer.models import model_weight_files, names_default_model, resolve_model

    resolved = Path(resolve_model(name_or_path))
    # a local folder's path normalised (m, ./m and m/ are one folder: kept distillation states and feature
    # caches were thrown away for another spelling), not made absolute (a moved project keeps its caches)
    local = resolved.is_dir() and not names_default_model(name_or_path)
    found: dict[str, Any] = {"name": os.path.normpath(name_or_path) if local else name_or_path}
    if not resolved.is_dir():
        revision = hub_revision(name_or_path)
        if revision is not None:
            found["revision"] = revision
    if dtype is not None:
        found.update(dtype=dtype, attn_implementation=attn_implementation)
    if resolved.is_dir():
        digest = hashlib.sha256()
        config = resolved / "config.json"
        if config.is_file():
            digest.update(config.read_bytes())
        for code in sorted(resolved.glob("*.py")):  # a trust_remote_code model's modeling code decides its states
            digest.update(code.name.encode() + b":" + code.read_bytes())  # (none in most folders: their key is kept)
        # the files from_pretrained loads (a training_args.bin or an adapter's file dropped beside them changed the
        # key: extracted again, a killed run refused its resume, distillation's kept states set aside)
        loaded = model_weight_files(resolved)
        for weights in loaded or sorted(resolved.glob("*.safetensors")) + sorted(resolved.glob("*.bin")):
            stat = weights.stat()
            size = stat.st_size
            digest.update(f"{weights.name}:{size}:{stat.st_mtime_ns}".encode())
            digest_samples(digest, weights, (0, max(0, size - (1 << 20))))
        found["content"] = digest.hexdigest()
    return found


def hub_revision(repo_id: str) -> str | None:
    """The commit a Hub model's ``main`` points to: the Hub's answer online, the local Hub cache's offline
    (the same before and after the model is downloaded, so a run's first fingerprint keys what later ones
    find); None where neither tells (offline and never downloaded)."""
    from huggingface_hub import HfApi, constants, snapshot_download

    if not constants.HF_HUB_OFFLINE:
        try:
            return HfApi().model_info(repo_id, timeout=10).sha  # a Hub that never answers: the cache's
        except Exception:  # unreachable, gated, or a private repo without a login: the cache's, if any
            pass
    try:
        return Path(snapshot_download(repo_id, local_files_only=True)).name
    except (OSError, ValueError):
        return None


def weights_fingerprint(model: Mapping[str, Any]) -> dict[str, Any]:
    """A fingerprint without how the model runs (``BACKBONE``): what names its weights."""
    return {name: value for name, value in model.items() if name not in BACKBONE}


def backbone_fingerprint(model: Any, model_info: Mapping[str, Any]) -> dict[str, Any]:
    """``model_info`` with the dtype and attention implementation of ``model`` (a ``MedusaModel``)
    where it gives none; where it does, they must be the model's (an attention implementation of
    None, transformers' choice, is taken as given)."""
    found = dict(model_info)
    if model is None:  # only looking for a finished cache
        return found
    dtype = str(model.dtype).removeprefix("torch.")
    attention = getattr(model.base_model.config, "_attn_implementation", None)
    if "dtype" not in found:
        found.update(dtype=dtype, attn_implementation=attention)
    elif found["dtype"] != dtype or found.get("attn_implementation") not in (None, attention):
        raise ValueError(f"the model runs in {dtype} with {attention!r} attention, but its fingerprint says "
                         f"{found['dtype']} with {found.get('attn_implementation')!r}: pass model_fingerprint("
                         "name, dtype, attn_implementation) with the settings the model was loaded with")
    return found


def cache_key(model: Mapping[str, Any], data_hash: str, topk: int, dtype: str, captured: bool = False,
              shard_examples: int = SHARD_EXAMPLES) -> str:
    """The cache folder's name; ``model``: its fingerprint, with the dtype and attention
    implementation it runs with (``backbone_fingerprint``); ``captured``: built from the states
    kept while distilling (``medusa_train.captured``), which differ from a forward pass's in float
    rounding; ``shard_examples``: examples per shard, which decides what each shard file holds."""
    parts = {"format": FORMAT_VERSION, "model": dict(model), "data": data_hash, "topk": topk, "dtype": dtype,
             "shard_examples": shard_examples}
    if captured:
        parts["hidden"] = "distillation"
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


# ---------------------------------------------------------------------------------------------
# Blocks: features of a batch of examples


def pad_batch(examples: Sequence[Mapping[str, Any]], pad_id: int = 0, pack: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``labels`` (``IGNORE`` on padding), ``attention_mask``,
    ``position_ids``, all ``[B, L]``, and ``lengths`` ``[B]``.

    With ``pack`` the batch also holds the layout a forward runs on instead (``batch_hidden``):
    the examples laid end to end in as few rows of ``L`` tokens as first-fit decreasing finds
    (``pack_rows``): ``packed_ids`` and ``packed_positions`` ``[R, L]``, positions restarting at 0
    for every example (and for a row's padded tail), and ``slot_row`` / ``slot_start`` ``[B]``,
    where each example starts. The padded tensors stay: the targets are read from them.
    """
    lengths = [len(e["input_ids"]) for e in examples]
    width = max(lengths)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (example, length) in enumerate(zip(examples, lengths)):
        ids[row, :length] = _as_long(example["input_ids"])
        labels[row, :length] = _as_long(example["labels"])
        mask[row, :length] = 1
    positions = torch.arange(width).expand(len(examples), width).clone()
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": positions,
             "lengths": torch.tensor(lengths, dtype=torch.long)}
    if pack:
        rows = pack_rows(lengths, width)
        packed_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        packed_positions = torch.zeros((len(rows), width), dtype=torch.long)
        slot_row = torch.zeros(len(examples), dtype=torch.long)
        slot_start = torch.zeros(len(examples), dtype=torch.long)
        for r, members in enumerate(rows):
            start = 0
            for i in members:
                packed_ids[r, start : start + lengths[i]] = ids[i, : lengths[i]]
                packed_positions[r, start : start + lengths[i]] = torch.arange(lengths[i])
                slot_row[i], slot_start[i] = r, start
                start += lengths[i]
            packed_positions[r, start:] = torch.arange(width - start)  # the tail: a sequence of its own
        batch.update(packed_ids=packed_ids, packed_positions=packed_positions, slot_row=slot_row,
                     slot_start=slot_start)
    return batch


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into rows of at most ``width`` tokens, first-fit decreasing
    (longest first, each into the first row it fits; ties keep their order)."""
    if any(n > width for n in lengths):
        raise ValueError(f"an example of {max(lengths)} tokens does not fit rows of width={width}; "
                         "make the rows at least as wide as the longest example")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r, left in enumerate(room) if left >= lengths[i]), None)
        if r is None:
            rows.append([])
            room.append(width)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= lengths[i]
    return rows


def one_row_packing(model: Any) -> bool:
    """Whether ``model``'s attention takes packed examples only in a batch of one row: flash
    attention's variable-length path, which transformers enters from restarting position ids only
    when the batch has one row (with more, it attends causally across each row)."""
    return "flash" in str(getattr(model.base_model.config, "_attn_implementation", ""))


def batch_hidden(model: Any, batch: Mapping[str, torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Final hidden states ``[B, L, H]`` of ``pad_batch``'s batch by ``model`` (a ``MedusaModel``),
    in the padded layout whichever layout ran, on ``device`` (default: the model's).

    A packed batch runs with its restarting position ids and no attention mask, from which
    transformers keeps each example's attention within the example (``check_packed_attention``
    verifies that a model does): for eager and SDPA attention as rows of a mask it builds, for flash
    attention (``one_row_packing``) as one row, all the rows end to end. The hidden states are then
    gathered back per example.
    """
    device = model.device if device is None else device
    if "packed_ids" not in batch:
        return model(batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                     position_ids=batch["position_ids"].to(device), logits_positions=slice(0, 0)).hidden_states
    ids, positions = batch["packed_ids"].to(device), batch["packed_positions"].to(device)
    rows, width = ids.shape
    if one_row_packing(model):
        ids, positions = ids.reshape(1, -1), positions.reshape(1, -1)
    hidden = model(ids, attention_mask=None, position_ids=positions, logits_positions=slice(0, 0)).hidden_states
    hidden = hidden.reshape(rows, width, -1)
    lengths = batch["lengths"].to(device)
    start = batch["slot_start"].to(device).unsqueeze(1)
    columns = torch.minimum(start + torch.arange(int(lengths.max()), device=device),
                            start + lengths.unsqueeze(1) - 1)  # padding repeats the example's last state
    return hidden[batch["slot_row"].to(device).unsqueeze(1), columns]


def check_packed_attention(model: Any) -> None:
    """Raise ``ValueError`` unless ``model`` (a ``MedusaModel``) keeps packed examples apart: the
    hidden states of three random examples packed two to a row must match their padded forward.

    transformers builds a per-example mask from restarting position ids when a model uses its
    mask utilities with a mask-aware attention; a model that does not would let each packed
    example attend to the ones before it in its row, silently. The probe runs in eval mode (no
    dropout) and restores each module's mode.
    """
    vocab = model.lm_head.weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(vocab, (n,), generator=generator).tolist(), "labels": [IGNORE] * n}
                for n in (9, 6, 3)]
    modes = {module: module.training for module in model.modules()}
    model.eval()  # dropout (LoRA's, say) would make the two forwards differ anyway
    try:
        with torch.no_grad():
            apart = batch_hidden(model, pad_batch(examples)).float()
            packed = batch_hidden(model, pad_batch(examples, pack=True)).float()
    finally:
        for module, training in modes.items():  # as they were, module by module
            module.training = training
    valid = pad_batch(examples)["attention_mask"].bool().to(apart.device)
    error = ((apart - packed)[valid].abs().max() / apart[valid].abs().max().clamp(min=1e-6)).item()
    tolerance = 1e-3 if model.dtype == torch.float32 else 3e-2
    if not error <= tolerance:
        config = model.base_model.config
        attention = config._attn_implementation
        fix = ("set data.pack=false: this model (or this transformers version) builds no per-example mask from "
               "restarting position ids" if attention in ("sdpa", "eager") else
               "set data.pack=false, or load the model with model.attn_implementation sdpa or eager, with which "
               "transformers keeps them apart")
        raise ValueError(
            f"data.pack: {config.model_type} with attention {attention!r} does not keep packed examples apart: "
            f"three examples run packed and padded differ by {error:.3g} relative (more than {tolerance}); {fix}"
        )


def block_from_hidden(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    lengths: torch.Tensor,
    project: Any = None,
    topk: int = 0,
    example_index: torch.Tensor | None = None,
    hidden_dtype: torch.dtype | None = None,
    soft_hidden: torch.Tensor | None = None,
) -> Block:
    """A block from a padded batch's final hidden states.

    Args:
        hidden: ``[B, L, H]`` final hidden states (may carry gradients: Medusa-2 uses this too).
        input_ids: ``[B, L]`` the tokens the hidden states were computed from.
        labels: ``[B, L]`` unshifted labels, ``IGNORE`` outside assistant tokens and on padding.
        lengths: ``[B]`` real lengths.
        project: ``hidden [P, H] -> logits [P, V]`` of the base (or teacher) model; with ``topk``
            it gives the soft labels.
        topk: soft-label candidates per position (0: none).
        example_index: ``[B]`` dataset indices (default ``0..B-1``).
        hidden_dtype: dtype the hidden rows are stored in (default: unchanged).
        soft_hidden: ``[B, L, H]`` hidden states the soft labels are projected from (default
            ``hidden``; Medusa-2 passes the original model's while training the adapted one).
    """
    batch, width = labels.shape
    device = hidden.device
    labels = labels.to(device)
    lengths = lengths.to(device)
    nxt = torch.full_like(labels, IGNORE)
    nxt[:, :-1] = labels[:, 1:]
    nxt2 = torch.full_like(labels, IGNORE)
    nxt2[:, :-2] = labels[:, 2:]
    # decoding runs the heads where the base model predicts an answer token (t + 1); head 0 needs t + 2
    row_b, row_t = ((nxt != IGNORE) & (nxt2 != IGNORE)).nonzero(as_tuple=True)
    soft_b, soft_t = (nxt != IGNORE).nonzero(as_tuple=True)
    valid = torch.arange(width, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    starts = torch.cumsum(lengths, 0) - lengths
    rows = hidden[row_b, row_t]
    block: Block = {
        "example_index": (torch.arange(batch) if example_index is None else example_index).long().to(device),
        "label_start": starts,
        "label_length": lengths.clone(),
        "labels": labels[valid],
        "tokens": input_ids.to(device)[valid],
        "row_example": row_b,
        "row_position": row_t,
        "hidden": rows if hidden_dtype is None else rows.to(hidden_dtype),
        "soft_example": soft_b,
        "soft_position": soft_t,
    }
    if topk:
        with torch.no_grad():
            source = hidden if soft_hidden is None else soft_hidden
            probs = torch.softmax(project(source[soft_b, soft_t].detach()).float(), dim=-1)
            top = probs.topk(topk, dim=-1)
        block["soft_ids"] = top.indices.to(torch.int32)
        block["soft_probs"] = top.values
    return block


def concat_blocks(blocks: Sequence[Block]) -> Block:
    """One block from several, with example and label offsets shifted."""
    if len(blocks) == 1:
        return dict(blocks[0])
    out: dict[str, list[torch.Tensor]] = {name: [] for name in blocks[0]}
    examples = labels = 0
    for block in blocks:
        for name, tensor in block.items():
            if name == "label_start":
                tensor = tensor + labels
            elif name in ("row_example", "soft_example"):
                tensor = tensor + examples
            out[name].append(tensor)
        examples += len(block["example_index"])
        labels += len(block["labels"])
    return {name: torch.cat(parts) for name, parts in out.items()}


@dataclass
class Rows:
    """Training rows of a block for K heads.

    Attributes:
        hidden: ``[R, H]``.
        targets: ``[R, K]`` base token ids, ``IGNORE`` where head k has no target.
        soft_row: ``[R, K]`` index into the block's soft table for head k's soft target, -1: none.
        next_tokens: ``[R]`` the token at t + 1 (read by ``next_token_input`` heads).
        path_tokens: ``[R, K - 1]`` the true tokens at t + 2 .. t + K (read by ``path_input``
            heads: teacher forcing), taken from the tokens, so a masked position in the path reads
            what the model saw there; 0 past the example's end, where no head reading it has a
            target.
    """

    hidden: torch.Tensor
    targets: torch.Tensor
    soft_row: torch.Tensor
    next_tokens: torch.Tensor
    path_tokens: torch.Tensor


def path_tokens(targets: torch.Tensor) -> torch.Tensor:
    """``[..., K - 1]`` path tokens from targets ``[..., K]`` taken from an unmasked token row
    (``head_targets`` of the tokens themselves): head k's target is the token head k + 1 reads at
    its k-th path position. ``IGNORE`` (past the end, where no head reading it has a target)
    becomes 0. Masked labels are no source of paths: ``rows_from_block`` reads the tokens."""
    return targets[..., :-1].clamp(min=0)


def rows_from_block(block: Block, num_heads: int) -> Rows:
    """Every hidden row of ``block`` with the K heads' targets (see the module docstring)."""
    example, position = block["row_example"], block["row_position"]
    start = block["label_start"][example].unsqueeze(1)
    length = block["label_length"][example].unsqueeze(1)
    ahead = torch.arange(num_heads, device=position.device).unsqueeze(0)
    labels = block["labels"]

    def lookup(table: torch.Tensor, offset: int, missing: int) -> torch.Tensor:
        where = position.unsqueeze(1) + ahead + offset
        inside = where < length
        values = table[(start + where.clamp(max=length - 1)).clamp(max=len(table) - 1)]
        return torch.where(inside, values, torch.full_like(values, missing))

    targets = lookup(labels, 2, IGNORE)
    path = lookup(block["tokens"], 2, 0)[:, : num_heads - 1]
    soft_index = torch.full((len(labels),), -1, dtype=torch.long, device=labels.device)
    soft_at = block["label_start"][block["soft_example"]] + block["soft_position"]
    soft_index[soft_at] = torch.arange(len(soft_at), device=labels.device)
    soft_row = lookup(soft_index, 1, -1)
    return Rows(block["hidden"], targets, soft_row, lookup(block["tokens"], 1, 0)[:, 0], path)


def soft_labels(block: Block, soft_row: torch.Tensor, token_map: torch.Tensor | None,
                vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, probs)`` ``[N, K, k]`` soft targets for rows' ``soft_row`` ``[N, K]``, ids as
    head-vocabulary columns (negative where missing or outside a reduced vocabulary)."""
    present = soft_row >= 0
    index = soft_row.clamp(min=0)
    ids = block["soft_ids"][index].long()
    probs = block["soft_probs"][index].float() * present.unsqueeze(-1)
    ids = torch.where(present.unsqueeze(-1), ids, torch.full_like(ids, IGNORE))
    return to_head_vocab(ids, token_map, vocab_size), probs


# ---------------------------------------------------------------------------------------------
# Building a cache


def _backbone_block(model: Any, batch: dict[str, torch.Tensor], topk: int, example_index: torch.Tensor,
                    hidden_dtype: torch.dtype) -> Block:
    """Run ``model`` (a ``MedusaModel``) on a ``pad_batch`` batch and make its block on the CPU."""
    with torch.no_grad():
        block = block_from_hidden(batch_hidden(model, batch), batch["input_ids"], batch["labels"], batch["lengths"],
                                  model.project, topk, example_index, hidden_dtype)
    return {name: tensor.cpu() for name, tensor in block.items()}


def _captured_block(model: Any, example: Mapping[str, Any], example_index: int, first: int, states: torch.Tensor,
                    topk: int, hidden_dtype: torch.dtype) -> Block:
    """The block of one example from the states kept while distilling (``CapturedHidden``): its
    rows and soft rows at the positions ``first .. first + len(states) - 1`` they cover."""
    ids, labels = _as_long(example["input_ids"]), _as_long(example["labels"])
    hidden = torch.zeros(1, len(ids), states.shape[1], dtype=model.dtype, device=model.device)
    hidden[0, first : first + len(states)] = states.to(hidden)
    end = first + len(states)
    with torch.no_grad():
        block = block_from_hidden(hidden, ids[None], labels[None], torch.tensor([len(ids)]), model.project, topk,
                                  torch.tensor([example_index]), hidden_dtype)
    for prefix, names in (("row", ("row_example", "row_position", "hidden")),
                          ("soft", ("soft_example", "soft_position", "soft_ids", "soft_probs"))):
        where = block[f"{prefix}_position"]
        keep = (where >= first) & (where < end)
        for name in names:
            if name in block:
                block[name] = block[name][keep]
    return {name: tensor.cpu() for name, tensor in block.items()}


def build_feature_cache(
    model: Any,
    examples: Sequence[Mapping[str, Any]],
    root: str | Path,
    model_info: Mapping[str, Any],
    topk: int = 20,
    batch_size: int = 8,
    shard_examples: int = SHARD_EXAMPLES,
    dtype: str = "float32",
    rank: int = 0,
    world_size: int = 1,
    barrier: Any = None,
    progress: bool = True,
    captured: CapturedHidden | None = None,
    pack: bool = False,
) -> Path:
    """Extract (or find) the feature cache of ``examples``; return its folder.

    Args:
        model: a ``MedusaModel`` on the base model (its heads are not used).
        examples: dicts with ``input_ids`` and ``labels``.
        root: the caches' folder; the cache is ``root/<key>``.
        model_info: ``model_fingerprint(...)`` of the base model (part of the key); the dtype and
            attention implementation are read from ``model`` where it gives none.
        topk: soft-label candidates per position (0: none).
        batch_size: sequences per forward; examples are sorted by length to cut padding.
        shard_examples: examples per shard file (part of the key).
        dtype: stored hidden states' dtype.
        rank, world_size, barrier: several processes share the shards (shard ``i`` is made by
            process ``i % world_size``); ``barrier()`` waits for all of them; rank 0 writes the
            manifest.
        captured: a ``medusa_train.captured.CapturedHidden``: the examples whose states were kept
            while distilling take them from there, the others are run through the backbone.
        pack: run each batch packed (``pad_batch``; checked first by ``check_packed_attention``).
            The same features as padded batches (to float rounding), so not part of the key.
    """
    start_time = time.perf_counter()
    model_info = backbone_fingerprint(model, model_info)
    folder = Path(root) / cache_key(model_info, examples_hash(examples), topk, dtype, captured is not None,
                                    shard_examples)
    if folder.is_dir():  # (also once complete: a run restarted within DEAD_TEMPORARY_S of a kill finished it)
        remove_dead_temporaries(folder)
    if cache_complete(folder):
        return folder
    vocab = model.base_model.get_output_embeddings().weight.shape[0]
    if topk > vocab:  # (a RuntimeError "selected index k out of range" after the first forward, naming neither)
        raise ValueError(f"features.topk={topk} soft-label candidates exceed the model's vocabulary of {vocab} "
                         f"tokens; set features.topk to at most {vocab}")
    (folder / MANIFEST).unlink(missing_ok=True)  # damaged since: built again below, the intact shards kept
    if pack:
        check_packed_attention(model)
    folder.mkdir(parents=True, exist_ok=True)
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i]["input_ids"]))
    shards = [order[i : i + shard_examples] for i in range(0, len(order), shard_examples)]
    mine = [i for i in range(len(shards)) if i % world_size == rank]
    total = sum(len(shards[i]) for i in mine)
    bar = tqdm(total=total, unit="ex", desc="features", disable=not progress, dynamic_ncols=True)
    pad_id = 0
    for shard_id in mine:
        path = folder / f"shard-{shard_id:05d}.safetensors"
        if _shard_examples(path) == shards[shard_id]:  # written by an earlier, interrupted run
            bar.update(len(shards[shard_id]))
            continue
        blocks, forward = [], []
        for j in shards[shard_id]:
            found = captured.states_for(examples[j]["input_ids"], examples[j]["labels"]) if captured else None
            if found is None:
                forward.append(j)
                continue
            blocks.append(_captured_block(model, examples[j], j, *found, topk, DTYPES[dtype]))
            bar.update(1)
        reused = len(shards[shard_id]) - len(forward)
        for i in range(0, len(forward), batch_size):
            chosen = forward[i : i + batch_size]
            batch = pad_batch([examples[j] for j in chosen], pad_id, pack=pack)
            blocks.append(_backbone_block(model, batch, topk, _as_long(chosen), DTYPES[dtype]))
            bar.update(len(chosen))
        block = {name: tensor.contiguous() for name, tensor in concat_blocks(blocks).items()}
        tmp = _temporary(path)
        save_file(block, str(tmp), metadata={"format": "pt", "captured_examples": str(reused),
                                             "examples": json.dumps(shards[shard_id])})
        os.replace(tmp, path)
    bar.close()
    if barrier is not None:
        barrier()
    if rank == 0 and not (folder / MANIFEST).is_file():
        _write_manifest(model, folder, len(shards), len(examples), topk, dtype, model_info,
                        time.perf_counter() - start_time)
    if barrier is not None:
        barrier()
    return folder


def _temporary(path: Path) -> Path:
    """Where ``path`` is written before it is moved into place: a name of this process's own (two runs building one
    shared cache, ``features.dir``, wrote one file and moved each other's away: the later one failed)."""
    return path.with_name(f"{path.name}.{socket.gethostname()}-{os.getpid()}.tmp")


DEAD_TEMPORARY_S = 600.0
"""A temporary file untouched this long, of no live process of this machine, is a killed build's (a file being
written is touched as it grows, and moved into place at once: another container of this host name, whose
processes this one does not see, writes none this long)."""


def remove_dead_temporaries(folder: Path) -> None:
    """Remove the temporary files of this machine's processes that are gone (killed mid-write: a shard's is as large
    as the shard), and those an earlier release named ``shard-NNNNN.tmp`` and ``manifest.json.tmp``; those of live
    processes, of other machines sharing the folder, and any touched in the last ``DEAD_TEMPORARY_S``, are left."""
    host, manifest = re.escape(socket.gethostname()), re.escape(MANIFEST)
    ours = re.compile(rf".+\.{host}-(\d+)\.tmp|shard-\d+\.tmp|{manifest}\.tmp")
    for temporary in folder.glob("*.tmp"):
        found = ours.fullmatch(temporary.name)
        try:
            if found is None or time.time() - temporary.stat().st_mtime < DEAD_TEMPORARY_S:
                continue
            if found.group(1) is not None:
                os.kill(int(found.group(1)), 0)  # alive: left
                continue
        except (ProcessLookupError, OverflowError):  # (a number past any pid)
            pass
        except OSError:  # another user's live process (PermissionError), or the file gone meanwhile
            continue
        try:
            temporary.unlink(missing_ok=True)
        except OSError as error:  # a cache folder this user only reads: its reuse goes on
            logger.warning("a killed build's temporary file %s could not be removed (%s)", temporary, error)


def _shard_examples(path: Path) -> list[int] | None:
    """The example indices a shard file says it holds, in the plan's order (None: no such file, or one
    cut short or damaged, as a power loss between its write and its rename can leave it: built again)."""
    header = _safetensors_header(path)
    try:
        return None if header is None else json.loads((header.get("__metadata__") or {}).get("examples", "null"))
    except (ValueError, TypeError, AttributeError) as error:
        logger.warning("feature shard %s is damaged (%s): building it again", path, error)
        return None


def _safetensors_header(path: Path) -> dict[str, Any] | None:
    """A safetensors file's header, where the file is whole (None, warned about, where it is missing, cut short or
    damaged: built again)."""
    if not path.is_file():
        return None
    try:
        with path.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 0 < length <= path.stat().st_size - 8:  # (a damaged length was read as such: an OverflowError
                raise ValueError(f"a header of {length} bytes in a file of {path.stat().st_size}")  # stopped builds)
            header = json.loads(handle.read(length))
        end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"), default=0)
        if 8 + length + end != path.stat().st_size:
            raise ValueError(f"{path.stat().st_size} bytes where its header describes {8 + length + end}")
        return header
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        logger.warning("feature cache file %s is damaged (%s): building it again", path, error)
        return None


def cache_complete(folder: Path) -> bool:
    """Whether ``folder`` holds a finished cache (its manifest) whose files are whole: one damaged since it was
    written (a shard or its ``lm_head`` file cut short) is built again by ``build_feature_cache``, keeping the
    files that are whole."""
    return (folder / MANIFEST).is_file() and not _damaged_shards(folder)


def _damaged_shards(folder: Path) -> list[Path]:
    """The shard files a finished cache's manifest lists, and its ``lm_head`` file, that are missing or damaged
    (cut short or emptied after the manifest was written), each warned about (``_safetensors_header``)."""
    try:
        listed = [folder / shard["file"] for shard in json.loads((folder / MANIFEST).read_text())["shards"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("feature cache manifest %s is damaged (%s): building the cache again", folder / MANIFEST, error)
        return [folder / MANIFEST]
    damaged = [path for path in listed if _shard_examples(path) is None]
    return damaged + ([] if _safetensors_header(folder / LM_HEAD) is not None else [folder / LM_HEAD])


def _write_manifest(model: Any, folder: Path, num_shards: int, num_examples: int, topk: int, dtype: str,
                    model_info: Mapping[str, Any], seconds: float) -> None:
    lm_head = model.lm_head
    tensors = {"weight": lm_head.weight.detach().cpu().contiguous()}
    if getattr(lm_head, "bias", None) is not None:
        tensors["bias"] = lm_head.bias.detach().cpu().contiguous()
    embed = model.base_model.get_input_embeddings().weight
    if embed.data_ptr() != lm_head.weight.data_ptr():  # untied: next_token_input heads need it too
        tensors["embed"] = embed.detach().cpu().contiguous()
    written = _temporary(folder / LM_HEAD)  # (moved into place as the shards: another run may read it meanwhile)
    save_file(tensors, str(written), metadata={"format": "pt"})
    os.replace(written, folder / LM_HEAD)
    shards, rows, soft, captured = [], 0, 0, 0
    for shard_id in range(num_shards):
        name = f"shard-{shard_id:05d}.safetensors"
        with safe_open(str(folder / name), framework="pt") as handle:
            captured += int((handle.metadata() or {}).get("captured_examples", 0))
        block = load_file(str(folder / name))
        shards.append({"file": name, "examples": len(block["example_index"]), "rows": len(block["hidden"])})
        rows += len(block["hidden"])
        soft += len(block["soft_position"])
    base = model.base_model
    vocab, hidden = lm_head.weight.shape
    manifest = {
        "format_version": FORMAT_VERSION,
        "model": dict(model_info),
        "base_model_name_or_path": model_info.get("name"),
        "model_type": base.config.model_type,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "logit_softcap": model.logit_softcap,
        "eos_token_ids": eos_token_ids(base),
        "topk": topk,
        "dtype": dtype,
        "num_examples": num_examples,
        "num_rows": rows,
        "num_soft": soft,
        "captured_examples": captured,
        "shards": shards,
        "seconds": round(seconds, 1),
    }
    tmp = _temporary(folder / MANIFEST)
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, folder / MANIFEST)


def eos_token_ids(base_model: Any) -> list[int]:
    """End-of-sequence ids of a transformers model (generation config and model config)."""
    ids: set[int] = set()
    for source in (getattr(base_model, "generation_config", None), base_model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return sorted(ids)


# ---------------------------------------------------------------------------------------------
# Reading a cache


def _load_shard(folder: Path, path: Path) -> dict[str, torch.Tensor]:
    """A cache file's tensors; ``ValueError`` naming it where it cannot be read."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} cannot be read ({err}): the feature cache {folder} is damaged; run the features "
                         "stage again, which builds its damaged files again") from err


@dataclass
class FeatureCache:
    """A loaded cache: its manifest, one block with every shard, and the base ``lm_head``."""

    folder: Path
    manifest: dict[str, Any]
    block: Block
    lm_head: dict[str, torch.Tensor]

    @classmethod
    def load(cls, folder: str | Path) -> "FeatureCache":
        folder = Path(folder)
        if not (folder / MANIFEST).is_file():
            raise ValueError(f"{folder} holds no {MANIFEST}: not a feature cache, or an interrupted one; "
                             "run the features stage again (it resumes from the finished shards)")
        manifest = json.loads((folder / MANIFEST).read_text())
        version = manifest.get("format_version", 0)
        if version != FORMAT_VERSION:
            newer = "a newer medusa-forge: upgrade, or" if version > FORMAT_VERSION else "an older medusa-forge:"
            raise ValueError(f"{folder} was written by {newer} delete it and run the features stage again "
                             f"(cache format {version}, this medusa-forge reads {FORMAT_VERSION})")
        blocks = [_load_shard(folder, folder / shard["file"]) for shard in manifest["shards"]]
        return cls(folder, manifest, concat_blocks(blocks), _load_shard(folder, folder / LM_HEAD))

    @property
    def embed_weight(self) -> torch.Tensor:
        """The base model's input embedding weight (its ``lm_head`` weight when tied)."""
        return self.lm_head.get("embed", self.lm_head["weight"])

    def end_of_turn_ids(self) -> list[int]:
        """EOS ids plus every token that ends an assistant span in the data."""
        return end_of_turn_ids(self.block["labels"], self.block["label_length"], self.manifest.get("eos_token_ids", []))


def end_of_turn_ids(labels: torch.Tensor, lengths: torch.Tensor, eos: Sequence[int] = ()) -> list[int]:
    """``eos`` plus the last token of every assistant span that an unlabelled token follows inside
    its example: ``labels`` ``[sum L]`` the examples' label rows one after another, ``lengths``
    ``[E]`` theirs.

    A span that runs to its example's end is left out: it may be an answer cut by the token limit
    or by ``max_length`` (``dataset.build_examples``), whose last token ends no turn. The end of a
    turn that closes its example is the EOS token in the templates this package knows, or is
    followed by the template's own separator (ChatML's newline after ``<|im_end|>``).
    """
    labels = torch.as_tensor(labels, dtype=torch.long)
    is_label = labels != IGNORE
    unlabelled_next = torch.zeros_like(is_label)
    unlabelled_next[:-1] = ~is_label[1:]
    ends = torch.cumsum(torch.as_tensor(lengths, dtype=torch.long), 0) - 1
    unlabelled_next[ends[ends >= 0]] = False  # the next row belongs to another example
    return sorted(set(int(i) for i in eos) | set(labels[is_label & unlabelled_next].tolist()))


class FeatureDataset:
    """Training rows from a feature cache (or any block): one item per cached position.

    Args:
        block: a block (``FeatureCache.block`` or ``concat_blocks`` of live ones).
        num_heads: K.
        token_map: ``[V]`` head-vocabulary ids (reduced vocabulary) or None.
        vocab_size: the base vocabulary size.
        soft: also give soft labels (needs ``soft_ids`` in the block).
    """

    def __init__(self, block: Block, num_heads: int, token_map: torch.Tensor | None, vocab_size: int,
                 soft: bool = False) -> None:
        if soft and "soft_ids" not in block:
            raise ValueError("this feature cache holds no soft labels (built with features.topk=0); "
                             "use training.loss=ce or rebuild it with features.topk > 0")
        self.block, self.soft = block, soft
        self.token_map, self.vocab_size = token_map, vocab_size
        rows = rows_from_block(block, num_heads)
        self.hidden = rows.hidden
        self.next_tokens = rows.next_tokens
        self.path_tokens = rows.path_tokens
        self.targets = to_head_vocab(rows.targets, token_map, vocab_size)
        self.soft_row = rows.soft_row
        # where a run of consecutive positions (one answer, as decoding walks it) starts
        example, position = block["row_example"], block["row_position"]
        self.run_start = torch.ones(len(example), dtype=torch.bool, device=example.device)
        self.run_start[1:] = (example[1:] != example[:-1]) | (position[1:] != position[:-1] + 1)

    def __len__(self) -> int:
        return len(self.hidden)

    def batch(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """``hidden [N, H]``, ``targets [N, K]`` (head columns), ``next_tokens [N]``, ``path_tokens
        [N, K - 1]`` (base ids), ``run_start [N]`` (a row beginning a run of consecutive positions of
        one answer), and with ``soft``: ``soft_ids``/``soft_probs`` ``[N, K, k]``."""
        out = {"hidden": self.hidden[index], "targets": self.targets[index], "next_tokens": self.next_tokens[index],
               "path_tokens": self.path_tokens[index], "run_start": self.run_start[index]}
        if self.soft:
            out["soft_ids"], out["soft_probs"] = soft_labels(
                self.block, self.soft_row[index], self.token_map, self.vocab_size)
        return out

    def sequential(self, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        for start in range(0, len(self), batch_size):
            yield self.batch(torch.arange(start, min(start + batch_size, len(self))))


def token_counts(labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[V]`` how often each id appears among the labels (``IGNORE`` left out)."""
    labels = labels[labels != IGNORE].long()
    return torch.bincount(labels, minlength=vocab_size)


def choose_token_map(counts: torch.Tensor, size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The reduced vocabulary: ``always`` (EOS, end-of-turn) then the most frequent ids, ``[size]``.

    Ties go to the smaller id, so the map is the same on every process and every resume.
    """
    if size > len(counts):
        raise ValueError(f"reduced_vocab_size {size} exceeds the vocabulary ({len(counts)})")
    keep = list(dict.fromkeys(int(i) for i in always))[:size]
    chosen = set(keep)
    for token in torch.argsort(-counts.long(), stable=True).tolist():
        if len(keep) >= size:
            break
        if token not in chosen:
            keep.append(token)
            chosen.add(token)
    return torch.tensor(keep, dtype=torch.long)
