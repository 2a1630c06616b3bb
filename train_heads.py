#!/usr/bin/env python
"""Train Medusa heads end to end: distil -> dataset -> features -> train -> evaluate.

    python train_heads.py --config recipes/smollm2-135m.yaml [key=value ...] [--push-to-hub REPO]
    accelerate launch --config_file recipes/accelerate/ddp.yaml train_heads.py --config recipes/X.yaml
    python train_heads.py --config recipes/X.yaml --plan      # print the plan, load nothing
    python train_heads.py --config recipes/X.yaml --heldout-only   # a finished run's held-out table

Every stage writes into ``<output_dir>/{data,features,checkpoints,heads,logs}`` and is skipped when
its output is already there, so a second run reuses the first one's work and a killed run resumes
from its last checkpoint.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shutil
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch

from medusa_train.train_config import (
    LAUNCH_VARIABLES,
    RunPaths,
    TrainConfig,
    example_settings,
    feature_indexes,
    feature_settings,
    features_root,
    first_launch_process,
    heads_from_final,
    load_config,
    owns_rows,
    plan,
    rows_path,
    run_paths,
    save_config,
)



def deepspeed_launch() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def accelerator_on_cpu(config: TrainConfig) -> bool:
    """Whether ``make_accelerator`` runs on the CPU: asked to, or without a GPU (except under a DeepSpeed launch
    config, which has a CPU accelerator of its own)."""
    return config.training.cpu or not (torch.cuda.is_available() or deepspeed_launch())


def launch_value(what: str, config: TrainConfig) -> int | None:
    """The launch's number of processes (``what="size"``) or this process's rank (``"rank"``), read as accelerate
    reads them (``LAUNCH_VARIABLES``; MPI's on the CPU only): the first set to a number >= 0, None when none is.
    ``ValueError`` naming a variable that is no whole number."""
    names = LAUNCH_VARIABLES[what] if accelerator_on_cpu(config) else LAUNCH_VARIABLES[what][:1]
    for name in names:
        given = os.environ.get(name, "").strip()
        if not given:
            continue
        try:
            value = int(given)
        except ValueError:
            raise ValueError(f"{name}={given!r} is not a whole number (a launch's {what}): unset it, or launch "
                             "with accelerate launch") from None
        if value >= 0:
            return value
    return None


def ignored_mpi_launch(config: TrainConfig) -> str | None:
    """A warning where MPI's variables say a launch of several processes that accelerate does not count: on a
    GPU it reads torchrun's alone, so under ``mpirun`` each process would train alone, into the same output_dir
    (the variables may also be an outer job's, around one run: a warning, not a refusal). None otherwise."""
    if accelerator_on_cpu(config) or launch_value("size", config) is not None:  # (torchrun's, on a GPU)
        return None
    for name in LAUNCH_VARIABLES["size"][1:]:
        given = os.environ.get(name, "").strip()
        if given.isdigit() and int(given) > 1:
            return (f"{name}={given} says an MPI launch of {given} processes, and accelerate counts MPI's on the "
                    "CPU only: on a GPU each process trains alone, all into the same output_dir. Launch with "
                    "`accelerate launch` (or torchrun) to train on several GPUs; where an outer job set it around "
                    "one run, go on")
    return None


def make_accelerator(config: TrainConfig) -> Any:
    from accelerate import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs

    log_with = [name for name, on in (("tensorboard", config.log.tensorboard), ("wandb", config.log.wandb)) if on]
    # Extracting features or distilling on the main process can outlast the default timeout.
    handlers: list[Any] = [InitProcessGroupKwargs(timeout=timedelta(hours=6)),
                           # the adapter gets no gradient in Medusa-2's heads-only stage; the buffers (the
                           # frozen lm_head and embeddings Medusa-1's heads read, rotary tables) are the same
                           # on every process and never change: not sent from the first before every forward
                           # (2.1 GB a micro-step for Llama-3.1-8B's lm_head)
                           DistributedDataParallelKwargs(find_unused_parameters=config.training.mode == "medusa2",
                                                         broadcast_buffers=False)]
    # Without a GPU accelerate runs on the CPU, except under a DeepSpeed launch config: DeepSpeed has a
    # CPU accelerator of its own (its ZeRO stages, gloo), which accelerate uses unless told cpu=True.
    if deepspeed_launch() and not (config.training.cpu or torch.cuda.is_available()):
        from accelerate import PartialState

        # accelerate finds no process-group backend for cpu=False without a GPU, and would count one
        # process where DeepSpeed runs several
        PartialState(backend="gloo", timeout=timedelta(hours=6))
    return Accelerator(
        cpu=accelerator_on_cpu(config),
        mixed_precision=config.training.mixed_precision,
        gradient_accumulation_steps=config.training.grad_accum,
        log_with=log_with or None,
        project_dir=str(run_paths(config).logs),
        kwargs_handlers=handlers,
    )


def say(accelerator: Any, message: str) -> None:
    if accelerator.is_main_process:
        print(f"[train_heads] {message}", flush=True)


def main_process_says(accelerator: Any, value: Any) -> Any:
    """``value`` as the main process computed it, on every process (a collective call)."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value], from_process=0)[0]


LOCK_NAME = ".train_heads.lock"
"""The file a run's main process holds locked in its output_dir while it runs (``hold_output_dir``)."""


def hold_output_dir(root: Path) -> tuple[Any, str | None]:
    """``(held, None)``: ``root``'s lock file, locked by this process (kept open for the run: the lock goes with
    it), or ``(None, why)`` where another process holds it, or the folder cannot be made or written. Two runs in
    one output_dir wrote the same checkpoints, log and heads at once (a launcher killed with SIGKILL leaves its
    workers training; a relaunch joined them). Where the system (Windows) or the filesystem takes no locks, nothing
    is locked (``locks.try_lock``)."""
    from medusa_train.locks import try_lock

    try:
        handle, holder = try_lock(root / LOCK_NAME)
    except OSError as err:  # (a traceback: a folder under /proc, a read-only disk, another user's folder)
        return None, (f"output_dir {root} cannot be made or written ({err.strerror or err}"
                      + (f": {err.filename}" if err.filename else "") + "): give a folder this user can write")
    if holder is not None:
        return None, (f"{root} is in use by another train_heads.py run (process {holder}), which writes its "
                      "checkpoints, log and heads: wait for it to end or stop it, or give this run another output_dir")
    return handle, None


def _real_folder(final: Path) -> Path:
    """``final``, or the folder it points to where it is a symbolic link (``output_dir/heads`` linked to another
    disk): that folder is replaced, and the link kept (rmtree of a link failed without a word, and renaming the
    new folder onto the link failed every evaluation after training)."""
    return final.resolve() if final.is_symlink() else final


def _partial_folder(final: Path) -> Path:
    """Where ``final`` is written before ``_commit_folder`` renames it into place (beside ``_real_folder``)."""
    real = _real_folder(final)
    return real.with_name(real.name + ".partial")


def _atomic_folder(final: Path) -> Path:
    partial = _partial_folder(final)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def _commit_folder(partial: Path, final: Path) -> None:
    real = _real_folder(final)
    shutil.rmtree(real, ignore_errors=True)
    os.replace(partial, real)


# ---------------------------------------------------------------------------------------------
# Stages


RECIPE_FIXES = ("set model.chat_template=null (the tokenizer's own)", "set model.chat_template to that template",
                "set data.system_prompt=null", "set data.system_prompt to it")
"""``dataset.check_rows``'s advice for rows given as ``data.rows``, in the recipe's keys."""


def stage_data(config: TrainConfig, accelerator: Any, pending: int | None,
               record: bool = True) -> tuple[list[dict], list[dict]]:
    """(a) distil the rows that are missing (``pending``: ``distill_pending``'s count; 0 distils
    nothing), (b) tokenise and split; returns (train, heldout) examples. ``record``: note the settings
    with the tokenised dataset (``example_settings``, what ``--plan`` reads)."""
    paths = run_paths(config)
    d = config.data
    try:
        from medusa_train import dataset as ds
    except ImportError as err:
        raise SystemExit(f"medusa_train.dataset is not available ({err}); it builds the training examples") from err
    if d.tokenized:
        examples, cut, dropped = ds.truncate_examples(ds.read_rows(d.tokenized), d.max_length)
        if cut or dropped:
            say(accelerator, f"data: {cut} of {len(examples) + dropped} examples in {d.tokenized} cut to "
                             f"data.max_length={d.max_length} tokens; {dropped} dropped with no labelled token "
                             "(left)")
        # ids kept where given: the examples of one prompt are held out together (tokenized_split draws the same)
        named = any("id" in e for e in examples)
        dataset = ds.to_dataset([{"input_ids": e["input_ids"], "labels": e["labels"],
                                  **({"id": None if e.get("id") is None else str(e["id"])} if named else {})}
                                 for e in examples])
    else:
        rows = rows_path(config)
        if not rows.is_file() and not d.prompts:
            raise SystemExit(f"{rows} does not exist and data.prompts is not set: give prompts to distil")
        from medusa_infer.models import load_tokenizer

        tokenizer = load_tokenizer(config.model.name, trust_remote_code=config.model.trust_remote_code)
        if config.model.chat_template:
            tokenizer.chat_template = config.model.chat_template
        if owns_rows(config) and (pending is None or pending > 0):  # a killed or enlarged run's are completed
            from medusa_train.distill import DistillError, distill, recipe_config

            ds.check_template(tokenizer, d.system_prompt)  # before the answers, which take the time
            say(accelerator, f"distilling {d.n or 'all'} prompts from {d.prompts} into {rows}")
            with unpartitioned(accelerator):  # the model answers alone, in no DeepSpeed engine
                try:
                    distill(recipe_config(config), accelerator)  # on its device, one process or several
                except DistillError as err:  # an endpoint's failures, said with what to do (not a traceback)
                    raise SystemExit(f"train_heads.py: error: distillation: {err}") from err
        elif owns_rows(config) and accelerator.is_main_process:  # nothing to answer, so no distill() to say it
            from medusa_train.distill import recipe_config, warn_rows_outside_sample

            warn_rows_outside_sample(recipe_config(config))
        stats = ds.BuildStats()
        with accelerator.main_process_first():
            dataset = ds.load_or_build_dataset(rows, tokenizer, d.max_length, paths.data, d.system_prompt, stats,
                                               record={"settings": example_settings(config)} if record else None)
        left_out = stats.left_out("data.max_length", d.max_length)
        if stats.rows and stats.from_ids < stats.examples:  # (a cached dataset's too: its build's counts are kept)
            unused = ", or ids that do not decode to the text" if stats.ids_unused else ""
            left_out.append(f"{stats.examples - stats.from_ids} of {stats.examples} examples tokenised from the "
                            "answers' text (rows without the token ids the model wrote: conversations, an "
                            f"endpoint's answers, earlier files{unused})")
        if left_out:
            say(accelerator, f"data: {len(dataset)} examples from {stats.rows} rows of {rows}; " + ", ".join(left_out))
    train, heldout = ds.split_heldout(dataset, d.heldout_fraction, config.training.seed)

    def plain(split: Any) -> list[dict]:
        return [{"input_ids": list(r["input_ids"]), "labels": list(r["labels"])} for r in split]

    train = plain(train)
    warn_heldout_beside_start(config, accelerator, train)
    return train, plain(heldout)


def warn_heldout_beside_start(config: TrainConfig, accelerator: Any, train: list[dict]) -> None:
    """Say so where ``heads.init_from``'s heads were trained on other examples than the ones left for training now:
    the held-out split may then hold examples they learned, and its accuracies (and the tree fitted to them) read
    high. A warning: a second stage on other data is a choice, its overlap with the first unknown here."""
    from medusa_train.features import examples_hash

    start = Path(config.heads.init_from) / "config.json" if config.heads.init_from else None
    if start is None or not start.is_file():
        return
    try:
        recorded = (json.loads(start.read_text()).get("training") or {}).get("train_examples_sha256")
    except (OSError, ValueError, AttributeError):  # check_init_from names an unreadable folder
        return
    if recorded is not None and recorded != examples_hash(train):
        say(accelerator, f"warning: the heads in heads.init_from={config.heads.init_from} were trained beside another "
                         "held-out split (another training.seed, data.heldout_fraction or data.max_length, or other "
                         "rows): this run's held-out examples may include ones they were trained on, and its held-out "
                         "accuracies and fitted tree read high; for a second stage keep those settings and give "
                         "data.rows=<the first run>/data/distilled.jsonl")


def check_inputs(config: TrainConfig) -> None:
    """What the run reads and where it uploads, checked before anything runs (``--plan`` too):
    ``ValueError`` for a model name that is neither a folder, a default model nor a Hub id (or is a heads
    folder), a data file that is not there, a model medusa-forge cannot decode or Medusa-2 LoRA targets it cannot
    take (``check_model_early``), a logger whose package is missing, or an upload that cannot happen (offline, or no
    Hub login)."""
    from medusa_infer.checkpoint import first_existing
    from medusa_infer.models import names_default_model, resolve_model

    name, d = config.model.name, config.data
    for key, folder in (("output_dir", config.output_dir), ("features.dir", config.features.dir)):
        existing = first_existing(Path(folder).expanduser()) if folder else None  # (the folder, or one on its
        if existing is not None and not existing.is_dir():  # way, a file: a traceback after distilling)
            raise ValueError(f"{key}={folder!r}: {existing} is a file, not a folder; name a folder")
    if not names_default_model(name):  # (a default model is not fetched here)
        resolve_model(name)  # a missing folder, a heads folder or an unknown bare name is named; a Hub id passes
    files = [("data.tokenized", d.tokenized)] if d.tokenized else []
    if owns_rows(config):
        files.append(("data.prompts", d.prompts))
    elif d.rows and not d.tokenized:  # rows given to be read as they are
        files.append(("data.rows", d.rows))
    for key, value in files:
        if not Path(value).is_file():
            raise ValueError(f"{key}: {value} is not a file; give the path of an existing JSONL file")
    if d.rows and not d.tokenized and not owns_rows(config):  # distilled elsewhere: as the recipe renders prompts?
        from medusa_train.dataset import check_rows, read_rows

        check_rows(read_rows(d.rows), config.model.chat_template, d.system_prompt, RECIPE_FIXES)
    if d.distill_options and not owns_rows(config):  # checked as a run that distils checks them (distill_pending):
        from medusa_train.distill import recipe_config  # a misspelt option passed, and backend=bogus changed the

        stand_in = d.prompts or "the prompts"  # plan's features stage; no prompt is read
        recipe_config(dataclasses.replace(config, data=dataclasses.replace(d, prompts=stand_in)))
    check_attn_implementation(config.model.attn_implementation)
    check_vocabulary_settings(config)
    check_model_early(config)
    from accelerate.utils import is_tensorboard_available, is_wandb_available

    for tracker, available in (("tensorboard", is_tensorboard_available), ("wandb", is_wandb_available)):
        # accelerate leaves out a tracker whose package is missing with a debug message only
        if getattr(config.log, tracker) and not available():
            raise ValueError(f"log.{tracker}=true logs through the {tracker} package, which is not installed: "
                             f"pip install {tracker}, or set log.{tracker}=false")
    if config.eval.push_to_hub:
        from huggingface_hub import constants, get_token
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(config.eval.push_to_hub)
        except HFValidationError as err:  # the upload would fail after training
            raise ValueError(f"--push-to-hub {config.eval.push_to_hub!r} is no Hub repo id ({err})") from None

        heads = run_paths(config).heads
        private = ", private=True" if config.eval.private else ""
        later = (f"leave --push-to-hub out and upload {heads} later (python -c \"from medusa_infer.checkpoint import "
                 f"push_folder_to_hub; print(push_folder_to_hub('{heads}', '{config.eval.push_to_hub}'{private}))\", "
                 "which also deletes an earlier upload's adapter and datastore)")
        if constants.is_offline_mode():
            raise ValueError(f"uploading to {config.eval.push_to_hub} needs the Hub, but HF_HUB_OFFLINE is set; "
                             f"unset it, or {later}")
        if get_token() is None:
            raise ValueError(f"uploading to {config.eval.push_to_hub} needs a Hub login: run `hf auth login` "
                             f"or set HF_TOKEN, or {later}")
        if config.eval.private:
            from medusa_infer.checkpoint import check_private_upload

            try:
                check_private_upload(config.eval.push_to_hub)
            except ValueError:
                raise
            except Exception:  # the Hub not reached now: the upload checks again before it sends anything
                pass


def check_attn_implementation(name: str | None) -> None:
    """``ValueError`` for a ``model.attn_implementation`` transformers does not know (a typo failed at feature
    extraction, after distilling); a Hub kernel (``org/repo``) passes, checked when the model loads."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import medusa_infer.attention_kernels  # noqa: F401  (registers this project's sdpa_gqa)

    known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    plain = name.removeprefix("paged|") if name is not None else None  # transformers still takes paged|<name>
    if name is not None and plain not in known and "/" not in name:
        raise ValueError(f"model.attn_implementation={name!r} is none transformers knows: one of {known}, a Hub "
                         "kernel (org/repo), or null to let transformers pick")
    if plain is not None and plain.startswith("flash_attention"):  # (it failed loading for features, after distilling)
        import torch

        gpu = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
        if not gpu:  # (its package, or the kernels package's Hub kernel, transformers checks when it loads)
            raise ValueError(f"model.attn_implementation={name!r} needs a GPU, which this machine has not; use sdpa "
                             "(or null) here")


def _model_folder(config: TrainConfig) -> Path | None:
    """The folder holding the recipe model's ``config.json`` where it is on disk (a folder, or a default
    model already fetched), else None (a Hub model, checked when it loads)."""
    from medusa_infer.models import DEFAULT_MODELS, default_model_folder, names_default_model

    name = config.model.name
    folder = default_model_folder(DEFAULT_MODELS[name]) if names_default_model(name) else Path(name).expanduser()
    return folder if (folder / "config.json").is_file() else None


def check_vocabulary_settings(config: TrainConfig) -> None:
    """``features.topk`` and ``heads.reduced_vocab_size`` checked against the model's vocabulary, where its
    config is on disk: past it, they failed after distilling and feature extraction (topk in a traceback)."""
    folder = _model_folder(config)
    if folder is None:
        return
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(folder, trust_remote_code=config.model.trust_remote_code)
    vocab = getattr(model_config.get_text_config(), "vocab_size", None)
    if vocab is None:
        return
    soft = config.soft_label_topk
    for key, value in (("features.topk", soft), ("heads.reduced_vocab_size", config.heads.reduced_vocab_size)):
        if value is not None and value > vocab:
            raise ValueError(f"{key}={value} is past the model's vocabulary of {vocab} tokens; lower it")


def check_training_steps(config: TrainConfig, train: list[dict], num_processes: int) -> None:
    """``step_counts``' refusal (batches the training split cannot fill, no optimizer step, no joint stage) as soon
    as the examples are known, before the features stage: with rows the plan could only estimate (``data.rows``),
    the refusal came after the backbone had run over all of them. The positions counted are those the feature
    cache keeps (``head_positions``)."""
    from medusa_train.dataset import head_positions
    from medusa_train.train_config import step_counts

    units = sum(head_positions(e["labels"]) for e in train) if config.uses_feature_cache else len(train)
    step_counts(config, units, num_processes)


def check_examples_fit(config: TrainConfig, examples: list[dict]) -> None:
    """Examples longer than the model's context, or holding a token id past its vocabulary (where its config is
    on disk), refused before any feature or training step: past it a model of learned positions (GPT-2) failed
    with an IndexError in the feature extraction (a device-side assert on a GPU), and a rotary one runs past the
    positions it learned; an id past the embedding failed the same way. Rows the run distils fit both;
    ``data.tokenized`` examples (made with another tokenizer, say), or rows made elsewhere, may not."""
    folder = _model_folder(config)
    if folder is None or not examples:
        return
    from transformers import AutoConfig

    from medusa_infer.decoding import config_context_length

    model_config = AutoConfig.from_pretrained(folder, trust_remote_code=config.model.trust_remote_code)
    vocab = getattr(model_config.get_text_config(), "vocab_size", None)
    past = next(((example["input_ids"], token) for example in examples
                 for token in example["input_ids"] if vocab is not None and token >= vocab), None)
    if past is not None:
        why = ("the examples were made with another tokenizer; make them with this model's (or give data.rows and "
               "let the run tokenise them)" if config.data.tokenized else
               f"the tokenizer in {folder} holds more tokens than the model's embedding (added without resizing "
               "it): resize the model's embeddings (and save it), or remove the added tokens")
        raise ValueError(f"an example holds the token id {past[1]}, past the model's vocabulary of {vocab} tokens "
                         f"(input_ids {past[0]!r:.60}): {why}")
    try:
        context = config_context_length(model_config)
    except ValueError:  # a config that states no context length
        return
    longest = max(len(example["input_ids"]) for example in examples)
    if longest > context:
        raise ValueError(f"examples of up to {longest} tokens are past the model's context of {context} positions "
                         f"(data.max_length={config.data.max_length} cuts them at that length); set "
                         f"data.max_length={context} or lower")


def check_model_early(config: TrainConfig) -> None:
    """The model checked on its module tree, built on the meta device from its config, where that config is on
    disk (a folder, or a default model already fetched): one medusa-forge cannot decode (``check_supported``:
    logits scaled after the lm_head, ALiBi, ...) refused before distillation (it was refused with a traceback
    at the features stage, after every prompt was distilled, through a paid endpoint too), and Medusa-2's
    ``lora.target_modules`` checked. A Hub model's are checked when it loads, after distillation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from medusa_infer.model import check_supported
    from medusa_train.lora import check_lora_targets

    folder = _model_folder(config)
    if folder is None:
        return
    trust = config.model.trust_remote_code
    with torch.device("meta"):  # eager attention: the attention a load picks is the load's to check
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, trust_remote_code=trust),
                                                    trust_remote_code=trust, attn_implementation="eager")
    try:
        check_supported(skeleton)
    except NotImplementedError as err:
        raise ValueError(f"model.name={config.model.name!r}: {err}") from None
    if config.training.mode == "medusa2":
        check_lora_targets(skeleton, config.lora.target_modules)


@contextmanager
def script_errors() -> Iterator[None]:
    """A ``ValueError`` raised inside on purpose (rows too few to split, a bad conversation, examples
    that changed under finished heads, batches the data cannot fill) or by reading a damaged file ends
    the script with its message, not a traceback. One that no ``raise`` statement made (an unpacking
    that failed, say) is a bug, not a bad input: it keeps its traceback."""
    try:
        yield
    except ValueError as err:
        frames = traceback.extract_tb(err.__traceback__)
        unreadable = isinstance(err, (json.JSONDecodeError, UnicodeDecodeError))  # a damaged file
        if not unreadable and not (frames and (frames[-1].line or "").lstrip().startswith("raise")):
            raise
        raise SystemExit(f"train_heads.py: error: {err}") from err


def tokenized_digest(config: TrainConfig) -> str | None:
    """``features.examples_hash`` of ``data.tokenized``'s training split as the run draws it, read without any
    stage (None without ``data.tokenized``): a checkpoint or finished heads of other examples are refused before
    the features stage, not after it."""
    from medusa_train.train_config import tokenized_split

    split = tokenized_split(config)
    if split is None:
        return None
    from medusa_train.features import examples_hash

    return examples_hash(split[0])


def distill_pending(config: TrainConfig) -> int | None:
    """Prompts the recipe samples that its rows file does not hold yet, answered or not (None: no
    rows file yet, or rows the recipe does not make).

    ``ValueError`` names a bad ``data.distill_options`` entry, or rows already there that were made
    with another model or other generation settings (``medusa_train.distill.check_resumable``).
    """
    if not owns_rows(config):
        return None
    from medusa_train.distill import pending_prompts, recipe_config, shard_files

    distill_config = recipe_config(config)
    # answers left in shards by a run killed before its merge (its rows file not written yet, as a first run
    # leaves it) are pending: distill() merges them; they are checked against the recipe here, before anything
    started = rows_path(config).is_file() or shard_files(rows_path(config))
    return pending_prompts(distill_config, merged=True)[1] if started else None


def load_base(config: TrainConfig, accelerator: Any, whole: bool = False, cpu_kernels: str = "tuned") -> Any:
    """The recipe's base model on this process's device. Under DeepSpeed ZeRO-3, transformers
    partitions it as it loads (for training, whatever the launch config's zero3_init_flag);
    ``whole`` loads every weight in full instead, for a model no DeepSpeed engine holds (the frozen
    backbone of Medusa-1 and of feature extraction, one process's evaluation). ``cpu_kernels``:
    as ``load_base_model``'s."""
    from medusa_infer.models import load_base_model

    with unpartitioned(accelerator) if whole else nullcontext():
        return load_base_model(config.model.name, dtype=getattr(torch, config.model.dtype),
                               device=accelerator.device, attn_implementation=config.model.attn_implementation,
                               trust_remote_code=config.model.trust_remote_code, cpu_kernels=cpu_kernels)


@contextmanager
def unpartitioned(accelerator: Any) -> Iterator[None]:
    """Within the block, models load whole even under DeepSpeed ZeRO-3 (transformers partitions
    every model it loads once accelerate has set ZeRO-3 up, and a model no DeepSpeed engine holds,
    partitioned, has empty weights); ZeRO-3 again after it, as accelerate set it up."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    zero3 = plugin is not None and plugin.hf_ds_config.is_zero3()
    if zero3:
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if zero3:
            plugin.set_deepspeed_weakref()


def captured_folder(config: TrainConfig) -> Path | None:
    """The folder of the hidden states kept while distilling this run's rows
    (``features.from_distillation``), or None when there are none or the recipe keeps none
    (``TrainConfig.keeps_distillation_hidden``: a backbone in another dtype than the float32 distillation
    decodes in, say)."""
    from medusa_train.captured import kept_states

    if config.data.tokenized or not config.keeps_distillation_hidden:
        return None
    return kept_states(rows_path(config))


def stage_features(config: TrainConfig, accelerator: Any, train: list[dict] | None,
                   heldout: list[dict], reused: set[str] | None = None) -> dict[str, Path]:
    """(c) Medusa-1: the frozen backbone's features of both splits, cached on disk (``train`` None:
    the held-out split's alone, as ``--heldout-only`` needs)."""
    from medusa_infer.model import MedusaModel
    from medusa_train.features import (
        MANIFEST,
        build_feature_cache,
        cache_complete,
        cache_key,
        examples_hash,
        model_fingerprint,
    )

    f = config.features
    root = features_root(config)
    # the main process's, so that every process keys the same cache folders (nodes may hold copies
    # of the model written at other times)
    info = main_process_says(accelerator, model_fingerprint(config.model.name, config.model.dtype,
                                                            config.model.attn_implementation))
    splits = {"heldout": heldout} if train is None else {"train": train, "heldout": heldout}
    hashes = {name: examples_hash(examples) for name, examples in splits.items()}
    topk = config.soft_label_topk

    kept = captured_folder(config)

    def caches(k: int) -> dict[str, Path]:
        return {name: root / cache_key(info, digest, k, f.dtype, kept is not None, f.shard_examples)
                for name, digest in hashes.items()}

    def complete(found: dict[str, Path]) -> bool:  # finished, and whole (a damaged one is built again)
        return all(cache_complete(folder) for folder in found.values())

    # loss ce reads no soft labels, so caches extracted with them (by a kl run on the same data, or
    # before ce runs left them out) serve it as well as caches without
    options = [caches(topk)] + ([caches(f.topk)] if topk == 0 and f.topk else [])
    folders = next((found for found in options if complete(found)), options[0])
    if complete(folders):  # into ``reused``: no stage seconds of this run's for them (stage_record)
        if accelerator.is_main_process:  # a killed extraction's shard-sized temporary, finished by a later run
            from medusa_train.features import remove_dead_temporaries

            for folder in folders.values():
                remove_dead_temporaries(folder)
        say(accelerator, f"features: reusing {', '.join(str(p) for p in folders.values())}")
        if reused is not None:
            reused.add("features")
    else:
        from medusa_train.captured import CapturedHidden

        if reused is not None and train is not None:  # the training split extracted: the stage is this run's (the
            # plan found it done by an index whose model or template changed since: the record kept the earlier
            # extraction's seconds as this run's; the held-out split alone, for an evaluation, is not the stage)
            reused.discard("features")
        model = MedusaModel.from_base(load_base(config, accelerator, whole=True), num_heads=1)
        captured = CapturedHidden.load(kept, info) if kept is not None else None
        for name, examples in splits.items():
            say(accelerator, f"features: {name} split, {len(examples)} examples -> {folders[name]}")
            build_feature_cache(model, examples, root, info, topk=topk, batch_size=f.batch_size,
                                shard_examples=f.shard_examples, dtype=f.dtype, rank=accelerator.process_index,
                                world_size=accelerator.num_processes, barrier=accelerator.wait_for_everyone,
                                progress=config.log.progress and accelerator.is_main_process, captured=captured,
                                pack=config.data.pack)
            if captured is not None:
                manifest = json.loads((folders[name] / MANIFEST).read_text())
                say(accelerator, f"features: {manifest['captured_examples']} of {len(examples)} {name} examples "
                                 "from the hidden states kept while distilling, the rest by a forward pass")
        del model, captured
    if accelerator.is_main_process and train is not None:
        text = json.dumps({**{k: v.name for k, v in folders.items()}, "settings": feature_settings(config)},
                          indent=2) + "\n"
        own, *shared = feature_indexes(config)  # the run's, and a shared features.dir's (another run's --plan reads it)
        for index in (own, *shared):
            try:
                if index is not own and index.is_file() and index.read_text() == text:
                    continue  # (as is: a shared folder this user only reads stopped the run here)
                index.parent.mkdir(parents=True, exist_ok=True)
                # aside, then renamed: a half-written index (killed, or a full disk) stopped every later run and
                # --plan; named by process and time, as runs sharing features.dir may write the shared one at once
                aside = index.with_name(f"{index.name}.{os.getpid()}-{time.time_ns()}.partial")
                aside.write_text(text)
                os.replace(aside, index)
            except OSError as err:
                if index is own:
                    raise
                say(accelerator, f"features: the shared index {index} could not be written ({err}): the caches are "
                                 "used all the same; another run's --plan will not find them by it")
    return folders


def _token_map(config: TrainConfig, labels: torch.Tensor, vocab_size: int, always: list[int]) -> torch.Tensor | None:
    from medusa_train.features import choose_token_map, token_counts

    size = config.heads.reduced_vocab_size
    return None if size is None else choose_token_map(token_counts(labels, vocab_size), size, always)


def stage_train(config: TrainConfig, accelerator: Any, train: list[dict], folders: dict[str, Path] | None) -> None:
    """(d) Train (or resume); writes ``checkpoints/final``."""
    from medusa_infer.heads import MedusaHeads
    from medusa_infer.model import MedusaModel, full_shape
    from medusa_train import trainer as tr
    from medusa_train.features import FeatureCache, FeatureDataset, end_of_turn_ids, eos_token_ids, examples_hash

    paths = run_paths(config)
    t, h = config.training, config.heads
    kl = t.loss == "kl"
    topk = config.soft_label_topk
    from accelerate.utils import set_seed

    set_seed(t.seed)
    if config.uses_feature_cache:
        cache = FeatureCache.load(folders["train"])
        m = cache.manifest
        vocab, hidden, model_type = m["vocab_size"], m["hidden_size"], m["model_type"]
        init = tr.initial_heads(config, hidden, vocab)
        token_map = init[1] if init else _token_map(config, cache.block["labels"], vocab, cache.end_of_turn_ids())
        module = tr.new_heads_module(config, cache.lm_head["weight"], cache.lm_head.get("bias"), m["logit_softcap"],
                                     model_type, token_map, cache.embed_weight)
        task: Any = tr.Medusa1Task(config, module, FeatureDataset(cache.block, h.num_heads, token_map, vocab, soft=kl))
    else:
        # Medusa-1: frozen, never sharded. Medusa-2: the kernels the student's passes with grad run on, also
        # for the teacher's without (the tuned CPU kernels take those only): else the two differ at step 0
        base = load_base(config, accelerator, whole=t.mode == "medusa1",
                         cpu_kernels="tuned" if t.mode == "medusa1" else "default")
        base.requires_grad_(False)
        vocab, hidden = full_shape(base.get_output_embeddings().weight)
        model_type = base.config.model_type
        init = tr.initial_heads(config, hidden, vocab)
        if init:
            token_map = init[1]
        else:
            labels = torch.tensor([x for e in train for x in e["labels"]], dtype=torch.long)
            lengths = torch.tensor([len(e["labels"]) for e in train])
            token_map = _token_map(config, labels, vocab, end_of_turn_ids(labels, lengths, eos_token_ids(base)))
        if t.mode == "medusa1":
            medusa = MedusaModel.from_base(base, num_heads=1)
            module = tr.new_heads_module(config, medusa.lm_head.weight, getattr(medusa.lm_head, "bias", None),
                                         medusa.logit_softcap, model_type, token_map,
                                         base.get_input_embeddings().weight)
            task = tr.Medusa1Task(config, module, tr.LiveFeatures(medusa, train, h.num_heads, token_map, topk,
                                                                       config.data.pack))
        else:
            from medusa_train.lora import add_lora

            if t.gradient_checkpointing:
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                base.config.use_cache = False
            peft_model = add_lora(base, config.lora.r, config.lora.alpha, config.lora.dropout,
                                  config.lora.target_modules)
            lm = base.get_output_embeddings().weight
            with tr.gathered(lm):  # own projections start as copies of the lm_head's rows
                heads = MedusaHeads(tr.heads_config(config, hidden, vocab, model_type, token_map),
                                    lm_head_weight=lm.detach().float(), token_map=token_map,
                                    lm_head_bias=getattr(base.get_output_embeddings(), "bias", None))
            medusa = MedusaModel(peft_model.get_base_model(), heads)
            medusa.heads.float()
            if init:  # after the cast to the model's dtype and back, which would round them
                medusa.heads.load_state_dict(init[0])
            task = tr.Medusa2Task(config, tr.JointModule(medusa, peft_model, topk), train, token_map)
    if init and t.mode == "medusa1":
        module.heads.load_state_dict(init[0])
    result = tr.train(config, task, accelerator, paths, examples_hash(train),
                      folders["train"].name if config.uses_feature_cache else None)
    info = {"recipe": config.to_dict(), "settings": tr.finished_settings(config, result.model_weights),
            "train_examples_sha256": examples_hash(train), "steps": result.steps,
            "train_seconds": round(result.seconds, 1), "resumed_from_step": result.resumed_from,
            "num_processes": accelerator.num_processes,
            "final_train_record": result.last_record}
    sources = data_sources(config) if accelerator.is_main_process else None  # (only the main process saves)
    if sources:
        info["data_sources"] = sources
    partial = _partial_folder(paths.final)
    if accelerator.is_main_process:
        _atomic_folder(paths.final)
    accelerator.wait_for_everyone()
    task.save_extra(accelerator, result.module, partial)
    if accelerator.is_main_process:
        tr.save_trained(partial, tr.heads_config(config, hidden, vocab, model_type, token_map),
                        result.heads_state, info)
        _commit_folder(partial, paths.final)
    accelerator.wait_for_everyone()


def data_sources(config: TrainConfig) -> dict[str, int] | None:
    """How many rows of the run's data file each prompt source gave (``dataset.count_sources``), for the
    training record and the model card (whose sources' terms the data carries); None for ready examples
    (``data.tokenized``) and rows that name no source."""
    from medusa_train.dataset import count_sources, row_sources

    rows = rows_path(config)
    if config.data.tokenized or not rows.exists():
        return None
    return count_sources(row_sources(rows)) or None


def heldout_accuracy(config: TrainConfig, accelerator: Any, heldout: list[dict],
                     folders: dict[str, Path] | None) -> tuple[Any, Any, Any]:
    """The trained heads (``<output_dir>/checkpoints/final``) and their held-out accuracy:
    ``(MedusaConfig, MedusaHeads, evaluate.HeadAccuracy)``. Main process only."""
    from medusa_infer.checkpoint import load_heads_state
    from medusa_infer.heads import MedusaHeads
    from medusa_infer.model import MedusaModel
    from medusa_train import evaluate as ev
    from medusa_train import trainer as tr
    from medusa_train.features import FeatureCache, FeatureDataset

    paths = run_paths(config)
    mconfig, state = load_heads_state(paths.final)
    heads = MedusaHeads(mconfig)
    heads.load_state_dict(state)
    token_map = heads.token_map
    if config.uses_feature_cache:
        cache = FeatureCache.load(folders["heldout"])
        module = tr.HeadsModule(heads, cache.lm_head["weight"], cache.lm_head.get("bias"),
                                cache.manifest["logit_softcap"], cache.embed_weight).eval()
        data = FeatureDataset(cache.block, mconfig.num_heads, token_map, mconfig.vocab_size)
        batches = data.sequential(config.training.batch_tokens)
        return mconfig, heads, ev.head_accuracy(module, batches, config.eval.top_k)
    base = load_base(config, accelerator, whole=True)
    if config.training.mode == "medusa2":
        from medusa_infer.model import merge_adapter
        from medusa_train.lora import ADAPTER_DIR

        base = merge_adapter(base, paths.final / ADAPTER_DIR)  # as from_pretrained does
    # a copy: MedusaModel converts heads to the base model's dtype in place, and the heads saved
    # after this evaluation are the float32 ones training wrote
    medusa = MedusaModel(base, copy.deepcopy(heads)).eval()
    source = tr.LiveFeatures(medusa, heldout, mconfig.num_heads, token_map, 0, config.data.pack)
    size = config.training.batch_size
    batches = (source.batch(torch.arange(i, min(i + size, len(source)))) for i in range(0, len(source), size))
    return mconfig, heads, ev.head_accuracy(medusa.head_logits, batches, config.eval.top_k, device=medusa.device)


def stage_evaluate(config: TrainConfig, accelerator: Any, train: list[dict], heldout: list[dict],
                   folders: dict[str, Path] | None, timings: dict[str, float]) -> None:
    """(e) Held-out accuracies, the fitted tree, the datastore, the final heads folder; optional upload."""
    from medusa_train import evaluate as ev
    from medusa_train import trainer as tr

    paths = run_paths(config)
    if accelerator.is_main_process:
        mconfig, heads, accuracy = heldout_accuracy(config, accelerator, heldout, folders)
        mconfig.base_model_name_or_path = tr.heads_base_name(config)  # model.hub_id, set after training too
        partial = _atomic_folder(paths.heads)
        from medusa_infer.models import load_tokenizer

        try:  # (the card's example renders a chat where it can; the store records it)
            tokenizer = load_tokenizer(config.model.name, trust_remote_code=config.model.trust_remote_code)
        except Exception as err:  # pre-tokenized data may come without one, or with remote code this machine
            # cannot run: the heads are written all the same (a run failed here, and every rerun after it)
            print(f"train_heads.py: the tokenizer of {config.model.name} did not load ({type(err).__name__}: "
                  f"{err}): the model card's example sends a chat"
                  + (", and the datastore records no tokenizer" if config.eval.datastore else ""), file=sys.stderr)
            tokenizer = None
        from medusa_infer.checkpoint import renders_chats

        extra = {"stage_seconds": timings, "evaluated_with": tr.eval_settings(config)}
        if isinstance(mconfig.training.get("recipe"), dict):  # the recipe as evaluated (evaluated again with other
            # eval settings, the card's recipe named the first evaluation's beside the evaluated_with of this one)
            extra["recipe"] = {**mconfig.training["recipe"], "eval": config.to_dict()["eval"]}
        ev.finalize(partial, mconfig, heads.state_dict(), accuracy, config.eval.tree_size,
                    base_model_id=config.model.hub_id, extra=extra, chat=renders_chats(mconfig, tokenizer))
        if config.training.mode == "medusa2":
            from medusa_train.lora import ADAPTER_DIR

            shutil.copytree(paths.final / ADAPTER_DIR, partial / ADAPTER_DIR)
            from medusa_infer.models import hub_id

            # the base model as the heads name it now (model.hub_id may be set after training: the adapter
            # named the local folder, published with it)
            settings_path = partial / ADAPTER_DIR / "adapter_config.json"
            adapter_settings = json.loads(settings_path.read_text())
            adapter_settings["base_model_name_or_path"] = hub_id(mconfig.base_model_name_or_path)
            settings_path.write_text(json.dumps(adapter_settings, indent=2, sort_keys=True) + "\n")
        if config.eval.datastore:
            from medusa_infer.checkpoint import note_datastore
            from medusa_infer.datastore import DATASTORE_NAME
            from medusa_train.datastore import build_datastore

            store = build_datastore(train, tokenizer)
            d = config.data
            store.origin = ("written by `train_heads.py`: the training split's "
                            + (f"ready examples ({Path(d.tokenized).name})" if d.tokenized else
                               "conversations, prompts and the model's own answers" if owns_rows(config) else
                               f"conversations as given in {rows_path(config).name}"))
            store.save(partial / DATASTORE_NAME)
            note_datastore(partial, len(store), store.origin)
        _commit_folder(partial, paths.heads)
        print(ev.summary_table(accuracy, [tuple(p) for p in mconfig.tree]), flush=True)
    accelerator.wait_for_everyone()


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the recipe's stages; Ctrl-C ends the run with a line saying how to go on (exit status 130), not a
    traceback, as does a write the machine refused (``checkpoint.write_failure``: a full disk, a read-only
    folder; exit status 1)."""
    try:
        return _main(argv)
    except Exception as err:  # a traceback from wherever it wrote (torch.save's "unexpected pos", safetensors')
        from medusa_infer.checkpoint import write_failure

        advice = write_failure(err)
        if advice is None:
            raise
        raise SystemExit(f"train_heads.py: error: {str(err).splitlines()[0]}: {advice}, then run the same command "
                         "again to go on (distilled rows, finished stages and step checkpoints are kept)") from err
    except KeyboardInterrupt:
        sys.stdout.flush()
        if first_launch_process():  # Ctrl-C reaches every process a launcher started: said once
            print("\ntrain_heads.py: interrupted; run the same command again to go on (distilled rows, finished "
                  "stages and step checkpoints are kept)", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="recipe YAML (recipes/*.yaml); default: built-in defaults")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides, e.g. training.lr=3e-4")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the final heads to this Hub repo")
    parser.add_argument("--private", action="store_true",
                        help="with --push-to-hub: create the repo private (its datastore.safetensors holds the "
                             "training conversations)")
    parser.add_argument("--plan", action="store_true", help="print the plan and exit (loads no model)")
    parser.add_argument("--heldout-only", action="store_true",
                        help="print the trained heads' held-out accuracy and exit (reuses the run's data and "
                             "features, extracting the held-out split's where missing; trains and saves nothing)")
    args = parser.parse_intermixed_args(argv)  # overrides before and after the flags
    from medusa_infer.cli import refuse_empty

    refuse_empty(parser, [("--push-to-hub", args.push_to_hub, "give the Hub repo to upload to (user/name), or leave "
                                                              "--push-to-hub out")])  # (read as not given: the
    # recipe's eval.push_to_hub uploaded)
    if args.plan and args.heldout_only:
        parser.error("--plan and --heldout-only each print something and exit: give one")
    if args.heldout_only and (args.push_to_hub or args.private):
        parser.error("--heldout-only prints the held-out table and uploads nothing: leave out --push-to-hub and "
                     "--private")
    try:
        config = load_config(args.config, args.overrides)
        if args.push_to_hub:
            config.eval.push_to_hub = args.push_to_hub
        if args.private:
            config.eval.private = True
        if args.heldout_only:  # a recipe's upload settings: nothing is uploaded, nothing to check
            config.eval.push_to_hub, config.eval.private = None, False
        if config.eval.private and not config.eval.push_to_hub:
            raise ValueError("--private (eval.private) makes the uploaded repo private, and nothing is uploaded: add "
                             "--push-to-hub REPO_ID, or drop it")
        check_inputs(config)
        pending = distill_pending(config)
        world, rank = launch_value("size", config), launch_value("rank", config) or 0
        if (warning := ignored_mpi_launch(config)) is not None:
            print(f"train_heads.py: warning: {warning}", file=sys.stderr, flush=True)
        from medusa_train.trainer import check_checkpoint, check_finished_run, check_init_from

        if not args.heldout_only:  # which reports the trained heads whatever the settings now
            check_finished_run(config, run_paths(config))
        if not (run_paths(config).final / "config.json").is_file():  # the starting heads, before any work
            check_init_from(config)
        if not args.heldout_only:
            # a plain `--plan` of a launch's run knows no number of processes: the resume checks it
            check_checkpoint(config, run_paths(config), world if world is not None else None if args.plan else 1,
                             tokenized_digest(config))
        launched = world or 1
        layout = plan(config, launched, distill_pending=pending)
    except ValueError as err:
        parser.error(str(err))
    trains = any(stage.name == "train" and not stage.done for stage in layout.stages)
    if trains and config.training.mixed_precision == "fp16" and (config.training.cpu or not torch.cuda.is_available()):
        # (a finished fp16 run is evaluated on a CPU alike: its settings, fp16 included, must stay as trained;
        # --plan says so too: it passed, and the run stopped at once)
        raise SystemExit("train_heads.py: error: training.mixed_precision=fp16 has no autocast on the CPU "
                         "(accelerate would train in float32 and say fp16); set training.mixed_precision=bf16 "
                         "or no")
    if args.plan:
        if rank == 0:  # once, not once per process of a launch
            print(layout.summary())
        return 0

    accelerator = make_accelerator(config)
    say(accelerator, f"accelerate: {accelerator.distributed_type.value} on {accelerator.device.type}, "
                     f"{accelerator.num_processes} process(es), mixed precision {accelerator.mixed_precision}")
    if accelerator.num_processes != launched:
        raise SystemExit(f"train_heads.py: error: the launch started {launched} processes and accelerate counts "
                         f"{accelerator.num_processes} ({accelerator.distributed_type.value} on "
                         f"{accelerator.device.type}); each would train alone")
    asked = next((name for name in ("DEEPSPEED", "FSDP")
                  if os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() == "true"), None)
    if asked and accelerator.distributed_type.value != asked:
        say(accelerator, f"note: the launch config asks for {asked}, which accelerate does not run here "
                         f"({'it runs FSDP on GPUs only; ' if asked == 'FSDP' else ''}CUDA available: "
                         f"{torch.cuda.is_available()}, training.cpu={config.training.cpu}): training "
                         + ("in one process" if accelerator.num_processes == 1 else
                            f"as plain data parallel ({accelerator.distributed_type.value})") + ", nothing sharded")
    paths = run_paths(config)
    if args.heldout_only:
        return report_heldout(config, accelerator)
    held, busy = hold_output_dir(paths.root) if accelerator.is_main_process else (None, None)
    busy = main_process_says(accelerator, busy)
    if busy is not None:
        raise SystemExit(f"train_heads.py: error: {busy}")
    try:
        reused: set[str] = set()  # stages whose outputs exist before this run (main process)
        if accelerator.is_main_process:
            for folder in (paths.data, paths.checkpoints, paths.logs):
                folder.mkdir(parents=True, exist_ok=True)
            save_config(config, paths.root / "config.yaml")
            print(layout.summary(), flush=True)  # (planned for the processes accelerate counts: checked above)
            reused = {STAGE_TIMING.get(stage.name, stage.name) for stage in layout.stages if stage.done}
        accelerator.wait_for_everyone()

        timings: dict[str, float] = {}

        def note_stages() -> None:  # after each stage: a run stopped later keeps the seconds of those it did
            if accelerator.is_main_process:  # written aside, then renamed: never read half-written
                record = stage_record(paths.logs / "stages.json", timings, reused)
                aside = paths.logs / "stages.json.partial"
                aside.write_text(json.dumps(record, indent=2) + "\n")
                os.replace(aside, paths.logs / "stages.json")

        started = time.perf_counter()
        with script_errors():
            train, heldout = stage_data(config, accelerator, pending)
            from medusa_train.dataset import check_head_positions

            check_head_positions(train, heldout, config.heads.num_heads)
            check_examples_fit(config, train + heldout)
            check_training_steps(config, train, accelerator.num_processes)
        timings["data"] = round(time.perf_counter() - started, 1)
        note_stages()
        say(accelerator, f"data: {len(train)} train and {len(heldout)} held-out examples ({timings['data']} s)")
        from medusa_train.features import examples_hash
        from medusa_train.trainer import check_finished_examples

        with script_errors():
            check_finished_examples(paths, examples_hash(train))

        folders = None
        # decided once, by the main process, for all: a process that looked later could find the heads the
        # main process had just written, skip evaluating, and leave it waiting at the evaluation's barrier
        trained, evaluated = main_process_says(accelerator, ((paths.final / "config.json").is_file(),
                                                             heads_from_final(paths)))
        finished = trained and evaluated
        if config.uses_feature_cache and not finished:  # only training and evaluation read the features
            started = time.perf_counter()
            # trained heads are evaluated on the held-out split alone (whose seconds are no extraction's)
            if trained:
                reused.add("features")
            folders = stage_features(config, accelerator, None if trained else train, heldout, reused)
            timings["features"] = round(time.perf_counter() - started, 1)
            say(accelerator, f"features ready ({timings['features']} s)")
            note_stages()

        started = time.perf_counter()
        if trained:
            say(accelerator, f"train: {paths.final} exists, skipping")
        else:
            with script_errors():  # e.g. fewer cached positions than the plan's upper bound fill a batch
                stage_train(config, accelerator, train, folders)
        timings["train"] = round(time.perf_counter() - started, 1)
        note_stages()

        started = time.perf_counter()
        if evaluated:
            say(accelerator, f"evaluate: {paths.heads} exists, skipping")
            from medusa_train.trainer import heads_base_name, same_folder

            named, wanted = json.loads((paths.heads / "config.json").read_text()).get("base_model_name_or_path"), \
                heads_base_name(config)
            if not same_folder(named, wanted):  # model.hub_id set or changed after the heads were made
                say(accelerator, f"note: {paths.heads} names its base model {named!r}, not {wanted!r} (model.hub_id): "
                                 f"remove {paths.heads} to evaluate again and name it so")
        else:  # the heads' record of the stages this run reused is a previous run's, not the seconds it took to find
            # them (the main process's: it alone writes the heads, and stages.json, which others might read mid-write)
            recorded = stage_record(paths.logs / "stages.json", timings, reused) if accelerator.is_main_process else {}
            recorded.pop("evaluate", None)  # a previous evaluation's: this one is being timed
            with script_errors():
                stage_evaluate(config, accelerator, train, heldout, folders, recorded)
        timings["evaluate"] = round(time.perf_counter() - started, 1)
        note_stages()
        if accelerator.is_main_process:
            say(accelerator, "stage seconds: " + ", ".join(f"{k} {v}" for k, v in timings.items()))
            if config.eval.push_to_hub:
                from medusa_infer.models import is_path_like
                from medusa_train.evaluate import push_to_hub
                from medusa_train.trainer import heads_base_name

                named = heads_base_name(config)
                if is_path_like(named) or Path(named).expanduser().is_dir():
                    say(accelerator, f"note: the uploaded heads name their base model {named!r}, a local folder that "
                                     "does not travel: others load them with base_model=; set model.hub_id to its "
                                     "Hub id (and remove the heads folder to evaluate again) to name it so")

                with script_errors():  # e.g. a private upload to a repo made public since the run began
                    url = push_to_hub(paths.heads, config.eval.push_to_hub, config.eval.private)
                say(accelerator, f"uploaded to {url}")
        accelerator.end_training()
        return 0
    finally:  # (an error's traceback, kept by a caller, kept the file open: a rerun in that process was refused)
        if held is not None:
            held.close()


STAGE_TIMING = {"distill": "data"}
"""The ``stages.json`` key of a plan stage named otherwise (the data stage's cost is distilling)."""


def stage_record(path: Path, timings: dict[str, float], reused: set[str]) -> dict[str, float]:
    """What ``stages.json`` should hold after a run: the seconds of the stages this run did, and
    for the stages whose outputs it found (``reused``), the seconds a previous run recorded for
    them at ``path``, where there is such a record. A re-run of a finished recipe thus leaves the
    record as it was, and a partial one does not replace, say, the distillation's minutes with the
    seconds it took to find its rows. ``main`` writes the record after each stage, so that a run
    stopped later (in the evaluation, say) leaves the seconds of the stages it finished."""
    try:
        previous = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:  # emptied by a run killed while writing it (before writes were renamed into place)
        previous = {}
    record = dict(previous)
    record.update({stage: seconds for stage, seconds in timings.items()
                   if stage not in reused or stage not in previous})
    return record


def check_heldout_split(paths: RunPaths, train: Any) -> None:
    """``ValueError`` where the examples left for training are not the ones the heads were trained on: the held-out
    split would then hold examples they learned (another ``training.seed`` or ``data.heldout_fraction``, or rows
    that changed, scored them on their own training data)."""
    from medusa_train.features import examples_hash

    recorded = (json.loads((paths.final / "config.json").read_text()).get("training") or {}).get(
        "train_examples_sha256")
    if recorded is not None and recorded != examples_hash(train):
        raise ValueError(f"the held-out split drawn now is not the one the heads in {paths.final} were trained beside "
                         "(another training.seed or data.heldout_fraction, or the run's rows or data.max_length "
                         "changed): it would score them on examples they were trained on; give the settings the run "
                         "was trained with")


def report_heldout(config: TrainConfig, accelerator: Any) -> int:
    """``--heldout-only``: the held-out table of a finished run's trained heads, printed."""
    from medusa_train import evaluate as ev

    from medusa_infer.config import MedusaConfig

    paths = run_paths(config)
    if not (paths.final / "config.json").is_file():
        raise SystemExit(f"train_heads.py: error: no trained heads in {paths.final}; run the recipe first")
    adapted = MedusaConfig.load(paths.final / "config.json").trained_with_adapter
    if adapted != (config.training.mode == "medusa2"):  # scored on the backbone without its adapter (exit 0), or
        trained = "medusa2" if adapted else "medusa1"  # an adapter looked for that the run never made (a traceback)
        raise SystemExit(f"train_heads.py: error: the heads in {paths.final} were trained with training.mode="
                         f"{trained}, and the settings now say {config.training.mode}: give the overrides the run was "
                         f"trained with (training.mode={trained} among them)")
    with script_errors():  # the run's rows as they are, distilling nothing and recording nothing
        train, heldout = stage_data(config, accelerator, 0, record=False)
        check_heldout_split(paths, train)
    folders = stage_features(config, accelerator, None, heldout) if config.uses_feature_cache else None
    if accelerator.is_main_process:
        _, _, accuracy = heldout_accuracy(config, accelerator, heldout, folders)
        print(ev.summary_table(accuracy, ev.fit_tree(accuracy, config.eval.tree_size)), flush=True)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
