"""The configuration of a training run: dataclasses loaded from a YAML recipe plus ``key=value``
overrides, and ``plan()``, which lays out the run (stages, sizes, steps) without loading a model.

A recipe mirrors the dataclasses::

    output_dir: runs/smollm2-135m
    model: {name: smollm2-135m-instruct}
    data: {prompts: ../shared/data/train_prompts.jsonl, n: 300}
    heads: {num_heads: 4, reduced_vocab_size: 8192}
    training: {mode: medusa1, lr: 1.0e-3, epochs: 3}

and ``training.lr=3e-4`` on the command line overrides one key (dotted path, value converted to the
field's type; an unknown key is an error that lists the valid ones).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MODES = ("medusa1", "medusa2")
LOSSES = ("ce", "kl")
PRECISIONS = ("no", "bf16", "fp16")
SCHEDULERS = ("cosine", "linear", "constant")
HEADS_WEIGHT_SCHEDULES = ("linear", "sine", "constant")
DTYPES = ("float32", "bfloat16", "float16")
PROJECTIONS = ("shared", "own")
LAUNCH_VARIABLES = {"size": ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"),
                    "rank": ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")}
"""Where a launch's number of processes and this process's rank are read, in accelerate's order: torchrun's
(``accelerate launch``), then MPI's (``mpirun``, which sets no WORLD_SIZE until accelerate's state does), which
accelerate reads on the CPU only."""


def first_launch_process() -> bool:
    """Whether this process is a launch's first, or in no launch: the first of its rank variables set
    (``LAUNCH_VARIABLES``) is 0. Read where no state has formed yet: Ctrl-C in a launcher's rendezvous reaches
    every process, and mpirun sets no RANK until accelerate's state does."""
    rank = next((os.environ[name].strip() for name in LAUNCH_VARIABLES["rank"] if os.environ.get(name, "").strip()),
                "0")
    return rank == "0"


def _home(path: str | None) -> str | None:
    """A path with a leading ``~`` expanded, as ``model.name`` is (``~/x.jsonl`` was looked for in ``./~``)."""
    return os.path.expanduser(path) if isinstance(path, str) and path.startswith("~") else path


@dataclass
class ModelSection:
    """The base model.

    Attributes:
        name: default-model name (``smollm2-135m-instruct``), local folder or Hub id.
        dtype: weights' dtype while training and extracting features.
        attn_implementation: ``eager``, ``sdpa``, ``flash_attention_2`` or None (transformers picks).
        trust_remote_code: run the model repository's own code (only for models that need it).
        hub_id: the Hub id of the very weights ``name`` holds (a local copy's): the heads' config names the
            base model by it, and ``from_pretrained`` loads it (not the model a fine-tune came from), and
            the model card links it.
        chat_template: a jinja chat template for tokenizers that ship none (e.g. Vicuna).
    """

    name: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    attn_implementation: str | None = None
    trust_remote_code: bool = False
    hub_id: str | None = None
    chat_template: str | None = None


@dataclass
class DataSection:
    """Self-distilled training data.

    Attributes:
        prompts: JSONL of ``{"id", "source", "prompt"}`` rows the base model answers.
        rows: the distilled rows (JSONL); made from ``prompts`` when missing. Default:
            ``<output_dir>/data/distilled.jsonl``, which a later run with ``prompts`` checks
            against the recipe (the same model and generation settings, else an error) and
            completes (prompts not answered yet, e.g. after a kill or a larger ``n``). A file
            given here that exists is read as it is.
        tokenized: a JSONL of ready examples ``{"input_ids", "labels"}`` (labels -100 outside
            assistant tokens, not shifted); when set, distillation and tokenisation are skipped
            (``max_length`` still cuts them).
        n: prompts to distil (balanced over sources); ``null``: all of them. A recipe that sets
            ``per_source`` and not ``n`` takes the quotas whole.
        per_source: quotas ``{source: count}`` instead of ``n``'s round robin; ``n``, when set,
            must be at least their sum.
        max_new_tokens: longest distilled answer.
        distill_batch_size: prompts per ``generate`` call.
        max_length: longest tokenised example (longer ones are cut).
        system_prompt: system message put before each prompt.
        heldout_fraction: share of the examples kept for evaluation.
        distill_options: further ``medusa_train.distill.DistillConfig`` settings, e.g.
            ``{backend: openai, endpoint: http://127.0.0.1:8000}`` to distil through vLLM (or
            ``data.distill_options.backend=openai`` on the command line); not the ones this
            recipe's other keys set (``medusa_train.distill.RECIPE_KEYS``).
        pack: every backbone forward of training (feature extraction, Medusa-2, Medusa-1
            without the feature cache, held-out evaluation without it) lays its batch's examples
            end to end in as few rows as fit instead of padding each to the longest
            (``medusa_train.features.pad_batch``); position ids restart per example and attention
            stays within it, which is checked on the model before use. The same features and
            losses as padding, to float rounding, on fewer tokens. A resumed run keeps the setting
            it started with.
    """

    prompts: str | None = None
    rows: str | None = None
    tokenized: str | None = None
    n: int | None = 300
    per_source: dict[str, int] | None = None
    max_new_tokens: int = 256
    distill_batch_size: int = 16
    max_length: int = 1024
    system_prompt: str | None = None
    heldout_fraction: float = 0.1
    distill_options: dict[str, Any] = field(default_factory=dict)
    pack: bool = False

    def __post_init__(self) -> None:
        if self.per_source == {}:  # no quotas, as null (distilling read it as "no source", 0 prompts)
            self.per_source = None
        self.prompts, self.rows, self.tokenized = (_home(p) for p in (self.prompts, self.rows, self.tokenized))


@dataclass
class HeadsSection:
    """The heads (see ``medusa_infer.config.MedusaConfig``).

    Attributes:
        reduced_vocab_size: score only the N most frequent target tokens (plus end-of-turn ids);
            much cheaper on CPU. None: the full vocabulary.
        next_token_input: each head also reads the token at t + 1, the base model's own next
            token (known at decoding time: the tree's root). Not exportable to the
            FasterDecoding/Medusa layout.
        path_input: each head k also reads the tokens t + 2 .. t + k + 1 of the candidate path
            it extends (trained with the true tokens; needs ``next_token_input``).
        init_from: a heads folder (``from_pretrained`` layout, e.g. a Medusa-1 run's ``heads/``)
            whose weights training starts from instead of fresh ones; its head vocabulary is kept.
            Medusa's two-stage recipe on a CPU: Medusa-1 on the feature cache, then
            ``training.mode=medusa2 heads.init_from=<that run>/heads``. The folder must have been
            trained for this model with these ``heads.*`` settings and carry no adapter.
    """

    num_heads: int = 4
    num_layers: int = 1
    projection: str = "shared"
    reduced_vocab_size: int | None = None
    next_token_input: bool = False
    path_input: bool = False
    init_from: str | None = None

    def __post_init__(self) -> None:
        self.init_from = _home(self.init_from)


@dataclass
class FeaturesSection:
    """Medusa-1 feature cache: the frozen backbone runs once over the data.

    Attributes:
        enabled: train from cached hidden states (else run the backbone every step).
        dir: where caches live (``<dir>/<key>/``, key = model + data + settings); share it
            between runs (``<dir>/indexes/`` tells a run's ``--plan`` which caches the others built).
            Default ``<output_dir>/features``.
        topk: base-model candidates kept per position for soft labels (0: none; ``loss: kl``
            needs them). Only ``loss: kl`` reads them, so with ``loss: ce`` none are computed
            (``TrainConfig.soft_label_topk``): that saves a projection onto the whole vocabulary
            at every cached position.
        batch_size: sequences per backbone forward while extracting.
        shard_examples: examples per safetensors shard.
        dtype: stored hidden states' dtype.
        from_distillation: when this run distils its data with the local model, keep the model's
            hidden states of the answers as it decodes them (``medusa_train.captured``) and build
            the cache from them, running the backbone only over the examples they do not cover.
            That saves the forward pass over the data (on the default recipe, about a third of
            the distillation's time). The states take about as much disk as the cache, and stay
            (in ``<rows>.hidden/``) for another cache of the same data. Only with
            ``model.dtype=float32``, the dtype distillation decodes in: a cache of another dtype's
            backbone takes none (mixed in, its examples' states were the float32 model's).
    """

    enabled: bool = True
    dir: str | None = None
    topk: int = 20
    batch_size: int = 8
    shard_examples: int = 256
    dtype: str = "float32"
    from_distillation: bool = True

    def __post_init__(self) -> None:
        self.dir = _home(self.dir)


@dataclass
class TrainingSection:
    """Optimisation.

    Attributes:
        mode: ``medusa1`` (heads only, frozen backbone) or ``medusa2`` (LoRA backbone + heads).
        lr: learning rate (the heads' in Medusa-1; the LoRA adapter's in Medusa-2).
        heads_lr: the heads' learning rate in Medusa-2 (default ``lr``).
        epochs: passes over the training data (fractions allowed) unless ``max_steps`` is set.
        batch_size: sequences per process per micro-step (live backbone, Medusa-2).
        batch_tokens: cached positions per process per micro-step (Medusa-1 with features).
        grad_accum: micro-steps per optimizer step.
        warmup_ratio: share of the steps with a linear LR warm-up.
        loss: ``ce`` against the data's tokens or ``kl`` against the base model's top-k.
        head_decay: head k's loss weighs ``head_decay**k`` (normalised). In Medusa-1 each head's weights
            learn from its own loss alone, and AdamW's steps do not change when a loss is scaled: the weights
            act there only through the gradient clip (``max_grad_norm``), which sees every head's gradient
            together (0.8 and 0.01 gave the same held-out accuracies unclipped). In Medusa-2 the adapter
            learns from every head, and they set each head's share of it.
        mixed_precision: ``no``, ``bf16`` or ``fp16`` (accelerate's autocast; fp16 on a GPU only).
        save_every: checkpoint every N optimizer steps (0: only at the end).
        keep_checkpoints: newest checkpoints kept.
        stage1_steps: Medusa-2: steps training the heads alone before the joint stage.
        kl_weight: Medusa-2: weight of KL(original model || adapted model) on the base logits.
        heads_loss_weight: Medusa-2: the heads' loss weight once warmed up.
        heads_warmup_steps: Medusa-2: steps of the joint stage over which that weight rises.
        heads_weight_schedule: ``linear``, ``sine`` or ``constant`` rise.
        gradient_checkpointing: Medusa-2: recompute the backbone's activations in backward.
        cpu: force the CPU even where an accelerator exists.
    """

    mode: str = "medusa1"
    lr: float = 1e-3
    heads_lr: float | None = None
    weight_decay: float = 0.0
    epochs: float = 1.0
    max_steps: int | None = None
    batch_size: int = 4
    batch_tokens: int = 1024
    grad_accum: int = 1
    warmup_ratio: float = 0.05
    scheduler: str = "cosine"
    max_grad_norm: float = 1.0
    loss: str = "ce"
    head_decay: float = 0.8
    mixed_precision: str = "no"
    seed: int = 0
    save_every: int = 0
    keep_checkpoints: int = 2
    stage1_steps: int = 0
    kl_weight: float = 1.0
    heads_loss_weight: float = 0.2
    heads_warmup_steps: int = 0
    heads_weight_schedule: str = "linear"
    gradient_checkpointing: bool = False
    cpu: bool = False


@dataclass
class LoraSection:
    """Medusa-2's LoRA adapter on the backbone (peft)."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class LogSection:
    """Where training metrics go: stdout and ``<output_dir>/logs/train.jsonl`` always (jsonl may be
    turned off), TensorBoard and wandb on request (``WANDB_MODE=offline`` works)."""

    jsonl: bool = True
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "medusa-forge"
    every: int = 10
    progress: bool = True


@dataclass
class EvalSection:
    """Held-out evaluation and the fitted tree.

    Attributes:
        tree_size: nodes of the tree fitted to the measured accuracies (16 suits a CPU).
        top_k: accuracies measured for ranks 1..top_k.
        push_to_hub: Hub repo id to upload the heads to (``--push-to-hub`` sets it).
        private: create that repo private (``--private`` sets it; None: the Hub's default, public).
            The upload holds the datastore (below) when there is one: the training conversations.
        datastore: write the training split's conversations (the model's own answers) into the
            heads folder as ``datastore.safetensors``, which lookup drafts also search.
    """

    tree_size: int = 16
    top_k: int = 10
    push_to_hub: str | None = None
    private: bool | None = None
    datastore: bool = True


@dataclass
class TrainConfig:
    """A whole run; ``output_dir`` gets ``data/ features/ checkpoints/ heads/ logs/``."""

    output_dir: str = "runs/smollm2-135m"
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    heads: HeadsSection = field(default_factory=HeadsSection)
    features: FeaturesSection = field(default_factory=FeaturesSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    lora: LoraSection = field(default_factory=LoraSection)
    log: LogSection = field(default_factory=LogSection)
    eval: EvalSection = field(default_factory=EvalSection)

    def __post_init__(self) -> None:
        self.output_dir = _home(self.output_dir)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self, *sections: str) -> str:
        """Short hash of the named sections (all when none): what must not change on resume."""
        data = self.to_dict()
        picked = {name: data[name] for name in sections} if sections else data
        return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def uses_feature_cache(self) -> bool:
        return self.training.mode == "medusa1" and self.features.enabled

    @property
    def keeps_distillation_hidden(self) -> bool:
        """Whether the distillation keeps hidden states for the feature cache
        (``features.from_distillation`` with the local backend, which decodes in float32: for a backbone of
        ``model.dtype`` float32 only, as the rest of the cache is extracted)."""
        backend = self.data.distill_options.get("backend", "local")
        return (self.uses_feature_cache and self.features.from_distillation and backend == "local"
                and self.model.dtype == "float32")

    @property
    def soft_label_topk(self) -> int:
        """Soft-label candidates the run computes: ``features.topk`` with ``loss: kl``, else 0
        (``loss: ce`` never reads them)."""
        return self.features.topk if self.training.loss == "kl" else 0


# ---------------------------------------------------------------------------------------------
# Loading


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) and isinstance(tp, type)


BOOLEAN_WORDS = ("true", "yes", "on", "1", "false", "no", "off", "0")
"""The command line's words for a boolean setting."""


def convert_value(value: Any, tp: Any, key: str) -> Any:
    """``value`` (from YAML or a command-line string) as type ``tp``; ``ValueError`` naming ``key``."""
    if tp is Any:  # converted where its type is known (data.distill_options: distill.recipe_config); a
        return value  # string stays one (YAML had read a quoted '0123' as a string, parsing it again read 83)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "~")):
            if type(None) in options:
                return None
        errors = []
        if isinstance(value, str) and value.strip().startswith("["):  # a list given on the command line: the
            options = sorted(options, key=lambda option: typing.get_origin(option) is not list)  # list, not text
        for option in options:
            if option is type(None):
                continue
            try:
                return convert_value(value, option, key)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(errors[0] if errors else f"{key}: cannot be {value!r}")
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str):
            parsed = _yaml_value(value, key) if value.strip().startswith("[") else [
                v.strip() for v in value.split(",") if v.strip()
            ]
            value = parsed
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}: expected a list, got {value!r}")
        return [convert_value(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_type, value_type = typing.get_args(tp)
        if isinstance(value, str):
            value = _yaml_value(value, key)
        if not isinstance(value, dict):
            raise ValueError(f"{key}: expected a mapping like {{a: 1, b: 2}}, got {value!r}")
        return {convert_value(k, key_type, key): convert_value(v, value_type, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in BOOLEAN_WORDS:
            return value.lower() in ("true", "yes", "on", "1")
        raise ValueError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:  # digits exactly (a float would round past 2**53: a seed changed silently)
                return int(value.strip().replace("_", ""), 0 if value.strip().lower().startswith(("0x", "0o", "0b"))
                           else 10)
            except ValueError:
                pass
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if number.is_integer():
                return int(number)
        raise ValueError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"{key}: expected a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key}: expected a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ValueError(f"{key}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, (dict, list)) or value is None or (isinstance(value, str) and not value.strip()):
            raise ValueError(f"{key}: expected a non-empty string, got {value!r}")
        if value is False and key.endswith("mixed_precision"):  # YAML 1.1 reads an unquoted no as false
            return "no"
        if isinstance(value, bool) or (isinstance(value, str) and value.strip().lower() in ("true", "false")):
            # (eval.push_to_hub: false uploaded the heads to a repo named "False")
            raise ValueError(f"{key}: expected a text, got {value!r}, a boolean (a text setting is never true or "
                             "false): null leaves it unset")
        return str(value)
    raise TypeError(f"{key}: unsupported field type {tp!r}")


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def valid_keys(cls: type = TrainConfig, prefix: str = "") -> list[str]:
    """Every dotted key a recipe or override may set."""
    keys = []
    for name, tp in _fields(cls).items():
        if _is_section(tp):
            keys += valid_keys(tp, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    if not isinstance(values, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'the recipe'}: expected a mapping, got {values!r}")
    fields = _fields(cls)
    kwargs = {}
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            raise ValueError(
                f"unknown key {dotted!r}; valid keys: {', '.join(valid_keys(cls, prefix))}"
            )
        tp = fields[key]
        # an empty section (`data:` with nothing under it) is the defaults; [] or 0 there is a mistake, named
        kwargs[key] = (_build(tp, {} if value is None else value, f"{dotted}.") if _is_section(tp)
                       else convert_value(value, tp, dotted))
    return cls(**kwargs)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key repeated in one mapping: PyYAML keeps the last one without a
    word, so a second ``training:`` section appended to a recipe set every setting of the first back to
    its default."""

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """Check each mapping once, as written: before ``<<`` merges its keys into it (in place: a mapping
        reached again through an alias holds a merged key beside its own)."""
        checked = self.__dict__.setdefault("_checked", set())
        if id(node) not in checked:
            checked.add(id(node))
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: keys given beside it override its own
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: construct_mapping names it
                    continue
                seen[key] = key_node.start_mark.line
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"{key!r} appears twice in one mapping (first on line {first + 1}): YAML would "
                        "keep only the last; merge the two into one", key_node.start_mark)
        super().flatten_mapping(node)


# a date-like value (a run folder named `output_dir: 2024-06-01`) stays the text it is: PyYAML made it a date, which
# no setting takes (a TypeError traceback)
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def read_yaml(text: str) -> Any:
    """``text`` as ``yaml.safe_load`` reads it, except that a key repeated in one mapping is a
    ``yaml.YAMLError`` (naming it and its lines) instead of the last one silently winning, and that a
    date-like value stays text."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def _yaml_value(text: str, key: str) -> Any:
    """``text`` read as YAML (a list or mapping override); ``ValueError`` naming ``key`` when it is none."""
    try:
        return read_yaml(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{key}: {text!r} is not valid YAML ({str(err).splitlines()[0]})") from None


def _set_dotted(tree: dict[str, Any], dotted: str, value: str) -> None:
    """Put an override's raw string into the nested recipe dict (converted later with the rest)."""
    parts = dotted.split(".")
    node: Any = tree
    cls: Any = TrainConfig
    for i, part in enumerate(parts):
        fields = _fields(cls) if _is_section(cls) else {}
        if part not in fields:
            raise ValueError(f"unknown key {dotted!r}; valid keys: {', '.join(valid_keys())}")
        cls = fields[part]
        mapping = typing.get_origin(cls) is dict or any(  # a mapping field, or an optional one
            typing.get_origin(option) is dict for option in typing.get_args(cls)
            if typing.get_origin(cls) in (typing.Union, types.UnionType))
        if mapping and i == len(parts) - 2:  # one entry of a mapping field
            if isinstance(node.get(part), str):  # set whole by an earlier override: its text, read now
                node[part] = _yaml_value(node[part], ".".join(parts[: i + 1]))
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                raise ValueError(f"{'.'.join(parts[: i + 1])!r} is not a mapping (in the recipe or an earlier "
                                 f"override): {node[part]!r}")
            node[part][parts[-1]] = value
            return
        if i == len(parts) - 1:
            if _is_section(cls):
                example = next(iter(_fields(cls)))
                raise ValueError(f"{dotted!r} is a section; set one of its keys, e.g. {dotted}.{example}=...")
            node[part] = value
        else:
            if not _is_section(cls):
                raise ValueError(f"{'.'.join(parts[: i + 1])!r} is not a section; "
                                 f"valid keys: {', '.join(valid_keys())}")
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ValueError(f"{'.'.join(parts[: i + 1])!r} in the recipe is not a mapping")


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    pairs = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} is not key=value (e.g. training.lr=3e-4)")
        pairs.append((key.strip(), value))
    return pairs


def _odd_value(tree: Any, prefix: str = "") -> str | None:
    """The dotted key of the first value in ``tree`` that is no JSON value (a date, bytes), or None."""
    if isinstance(tree, dict):
        items = [(f"{prefix}.{key}" if prefix else str(key), value) for key, value in tree.items()]
    elif isinstance(tree, list):
        items = [(f"{prefix}[{i}]", value) for i, value in enumerate(tree)]
    else:
        return None if tree is None or isinstance(tree, (str, int, float, bool)) else prefix
    return next((found for key, value in items if (found := _odd_value(value, key)) is not None), None)


def config_from_dict(values: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    try:
        tree = json.loads(json.dumps(values or {}))  # a deep copy holding plain containers
    except (TypeError, ValueError) as err:  # a value no setting takes: a !!timestamp, !!binary ...
        where = _odd_value(values or {})
        raise ValueError(f"the recipe's {where or 'values'} holds a value no setting takes ({err}): write it as text "
                         "or a number") from None
    for key, value in parse_overrides(overrides):
        _set_dotted(tree, key, value)
    data = tree.get("data")
    if isinstance(data, dict) and data.get("per_source") is not None and "n" not in data:
        # quotas without data.n: take them whole, not cut to n's default (read as their type first:
        # an override's "null" or "{}" sets no quotas)
        if convert_value(data["per_source"], _fields(DataSection)["per_source"], "data.per_source"):
            data["n"] = None
    config = _build(TrainConfig, tree)
    validate(config)
    return config


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """A recipe (None: the defaults) with ``key=value`` overrides applied, validated."""
    return config_from_dict(read_recipe(path) if path is not None else {}, overrides)


def read_recipe(path: str | Path) -> dict[str, Any]:
    """A recipe file's mapping (``read_yaml``); ``ValueError`` when it is missing, no YAML or no mapping."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"recipe {path} does not exist; see recipes/ in the medusa-forge repository for the shipped "
                         "ones")
    from medusa_infer.cli import decode_utf8

    try:
        values = read_yaml(decode_utf8(path.read_bytes(), f"recipe {path}")) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"recipe {path} is not valid YAML: {err}") from None
    if not isinstance(values, dict):
        raise ValueError(f"recipe {path} holds a {type(values).__name__}, not a mapping of sections")
    return values


def save_config(config: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


def validate(config: TrainConfig) -> None:
    """Raise ``ValueError`` naming the first bad value and what it may be."""
    t, h, d, f, lora = config.training, config.heads, config.data, config.features, config.lora
    for key, value in (("eval.push_to_hub", config.eval.push_to_hub), ("model.hub_id", config.model.hub_id)):
        if value is not None and value.strip().lower() in BOOLEAN_WORDS:  # a command line's off, no: a repo
            raise ValueError(f"{key}={value!r} reads as a boolean, not a Hub repo id: null leaves it unset")
    choices = (
        ("training.mode", t.mode, MODES),
        ("training.loss", t.loss, LOSSES),
        ("training.mixed_precision", t.mixed_precision, PRECISIONS),
        ("training.scheduler", t.scheduler, SCHEDULERS),
        ("training.heads_weight_schedule", t.heads_weight_schedule, HEADS_WEIGHT_SCHEDULES),
        ("model.dtype", config.model.dtype, DTYPES),
        ("features.dtype", f.dtype, DTYPES),
        ("heads.projection", h.projection, PROJECTIONS),
    )
    for key, value, allowed in choices:
        if value not in allowed:
            raise ValueError(f"{key} must be one of {allowed}, got {value!r}")
    positive = (
        ("heads.num_heads", h.num_heads), ("training.batch_size", t.batch_size),
        ("training.batch_tokens", t.batch_tokens), ("training.grad_accum", t.grad_accum),
        ("features.batch_size", f.batch_size), ("features.shard_examples", f.shard_examples),
        ("data.max_length", d.max_length), ("data.max_new_tokens", d.max_new_tokens),
        ("data.distill_batch_size", d.distill_batch_size), ("eval.tree_size", config.eval.tree_size),
        ("eval.top_k", config.eval.top_k), ("log.every", config.log.every), ("lora.r", lora.r),
        ("lora.alpha", lora.alpha), ("training.keep_checkpoints", t.keep_checkpoints),
    )
    for key, value in positive:
        if value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")
    non_negative = (
        ("heads.num_layers", h.num_layers), ("training.weight_decay", t.weight_decay),
        ("training.save_every", t.save_every), ("training.stage1_steps", t.stage1_steps),
        ("training.kl_weight", t.kl_weight), ("training.heads_loss_weight", t.heads_loss_weight),
        ("training.heads_warmup_steps", t.heads_warmup_steps), ("features.topk", f.topk),
        ("training.max_grad_norm", t.max_grad_norm),
    )
    for key, value in non_negative:
        if value < 0:
            raise ValueError(f"{key} must be >= 0, got {value}")
    if not t.lr > 0 or (t.heads_lr is not None and not t.heads_lr > 0):
        raise ValueError(f"learning rates must be > 0, got training.lr={t.lr}, training.heads_lr={t.heads_lr}")
    if t.max_steps is None and not t.epochs > 0:
        raise ValueError(f"training.epochs must be > 0 (or set training.max_steps), got {t.epochs}")
    if t.max_steps is not None and t.max_steps < 1:
        raise ValueError(f"training.max_steps must be >= 1 or null, got {t.max_steps}")
    if not 0 <= t.seed < 2**32:  # numpy's seeds (accelerate's set_seed, the held-out split)
        raise ValueError(f"training.seed must be in [0, 2**32 - 1], got {t.seed}")
    if d.max_length < 2:
        raise ValueError(f"data.max_length must be >= 2 (a prompt token and an answer token), got {d.max_length}")
    if not 0 <= t.warmup_ratio < 1:
        raise ValueError(f"training.warmup_ratio must be in [0, 1), got {t.warmup_ratio}")
    if not 0 < t.head_decay <= 1:
        raise ValueError(f"training.head_decay must be in (0, 1], got {t.head_decay}")
    if not 0 < d.heldout_fraction < 1:
        raise ValueError(f"data.heldout_fraction must be in (0, 1) (the evaluation and the tree need held-out "
                         f"examples), got {d.heldout_fraction}")
    if h.reduced_vocab_size is not None and h.reduced_vocab_size < 2:
        raise ValueError(f"heads.reduced_vocab_size must be >= 2 or null, got {h.reduced_vocab_size}")
    if t.loss == "kl" and f.topk < 1:
        raise ValueError("training.loss=kl trains on the model's top-k next-token distributions (soft labels): set "
                         "features.topk >= 1 (e.g. 20), or use training.loss=ce")
    if h.num_layers == 0 and h.projection == "shared" and not h.next_token_input:
        raise ValueError("heads.num_layers=0 with heads.projection=shared leaves the heads nothing to train: each "
                         "would be the base lm_head itself, predicting token t + 1 where head k should predict "
                         "t + k + 2; set heads.num_layers>=1 or heads.projection=own")
    if h.path_input and not h.next_token_input:
        raise ValueError("heads.path_input=true needs heads.next_token_input=true (the path starts at the token "
                         "t + 1); set both")
    if t.mode == "medusa1" and t.stage1_steps:
        raise ValueError("training.stage1_steps applies to training.mode=medusa2 only; set it to 0")
    if t.mode == "medusa1":  # read by Medusa-2 only, yet part of a run's settings (a change refused a rerun)
        default = TrainingSection()
        joint_only = [f"training.{name}={getattr(t, name)!r}" for name in (
            "kl_weight", "heads_loss_weight", "heads_warmup_steps", "heads_weight_schedule", "gradient_checkpointing")
            if getattr(t, name) != getattr(default, name)]
        if joint_only:
            raise ValueError(f"{', '.join(joint_only)} applies to training.mode=medusa2 only (Medusa-1 trains the "
                             "heads alone on a frozen backbone); leave it out, or train training.mode=medusa2")
    if not 0 <= lora.dropout < 1:
        raise ValueError(f"lora.dropout must be in [0, 1), got {lora.dropout}")
    if t.mode == "medusa1" and lora != LoraSection():  # set, and never read: said, as the joint-only keys are
        changed = [f"lora.{k}={v!r}" for k, v in dataclasses.asdict(lora).items() if v != getattr(LoraSection(), k)]
        raise ValueError(f"{', '.join(changed)} applies to training.mode=medusa2 only (Medusa-1 adapts no backbone "
                         "weights); leave the lora section out, or train training.mode=medusa2")
    if t.mode == "medusa2" and not lora.target_modules:
        raise ValueError("lora.target_modules is empty: Medusa-2 adapts those modules of the backbone; name some "
                         "(e.g. [q_proj, v_proj]), or train training.mode=medusa1")
    if t.mode == "medusa1" and t.heads_lr is not None:
        raise ValueError(f"training.heads_lr={t.heads_lr} applies to training.mode=medusa2 only (Medusa-1 trains "
                         "the heads alone, at training.lr); set training.lr instead, or heads_lr to null")
    if config.model.dtype != "float32" and t.mixed_precision == "no" and t.mode == "medusa2":
        raise ValueError(
            f"model.dtype={config.model.dtype} with trainable float32 heads and adapter needs "
            "training.mixed_precision=bf16 (or fp16)"
        )
    if d.n is not None and d.n < 1:
        raise ValueError(f"data.n must be >= 1 (prompts to distil) or null (all of them), got {d.n}")
    if d.per_source is not None:
        bad = {source: quota for source, quota in d.per_source.items() if quota < 1}
        if bad:
            raise ValueError(f"data.per_source quotas must be >= 1, got {bad}; leave a source out to skip it")
        if d.n is not None and d.n < sum(d.per_source.values()):
            raise ValueError(
                f"data.n={d.n} would cut data.per_source's quotas ({sum(d.per_source.values())} prompts in all); "
                "leave data.n out (or null) to take the quotas whole, or lower the quotas")
    if d.tokenized is None and d.rows is None and d.prompts is None:
        raise ValueError("set data.prompts (prompts to distil), data.rows (distilled rows) or data.tokenized")


# ---------------------------------------------------------------------------------------------
# Plan


@dataclass
class Stage:
    """One step of the pipeline and the output that lets a later run skip it."""

    name: str
    output: str
    done: bool
    detail: str


@dataclass
class Plan:
    """What a run will do, computed from the config (and the files already present) alone.

    Token and step counts are estimates until the data exist: each example is taken to have
    ``data.max_new_tokens`` assistant tokens where the run distils its rows, ``data.max_length``
    where it reads rows or examples made otherwise (upper bounds; ready examples' labelled tokens
    when fewer). Once the feature cache or the tokenised data exist, ``plan`` counts them instead
    (``exact``, of the steps, is then True; ``tokens_exact``, of the tokens, once the cache exists).
    """

    mode: str
    num_processes: int
    stages: list[Stage]
    examples: int
    train_examples: int
    heldout_examples: int
    train_units: int
    unit: str
    est_train_tokens: int
    micro_batch: int
    global_batch: int
    micro_steps_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    stage1_steps: int
    warmup_steps: int  # the heads' (Medusa-2's adapter warms up over joint_warmup_steps after stage1_steps)
    head_vocab: str
    exact: bool
    tokens_exact: bool = False
    joint_warmup_steps: int = 0  # Medusa-2: the adapter's, from the end of the heads-only stage
    warnings: list[str] = field(default_factory=list)  # settings that do not do what they say in this run

    def summary(self) -> str:
        accumulation = self.global_batch // (self.micro_batch * self.num_processes)
        # steps run on across epochs: 17 micro-batches an epoch at accumulation 2 are 8.5 steps, not 8
        per_epoch = round(self.micro_steps_per_epoch / accumulation, 2)
        rows = [
            ("mode", f"{self.mode} on {self.num_processes} process(es)"),
            ("examples", f"{self.examples} ({self.train_examples} train, {self.heldout_examples} held out)"),
            ("train tokens", f"{'' if self.tokens_exact else '<= '}{self.est_train_tokens:,} assistant tokens"),
            ("batch", f"{self.micro_batch} {self.unit} x {self.num_processes} process(es) x "
                      f"{accumulation} accumulation = "
                      f"{self.global_batch} {self.unit} per step"),
            ("steps", f"{'' if self.exact else '<= '}{self.total_steps} ({per_epoch:g} per epoch, "
                      + (f"{self.stage1_steps} heads-only; warm-up {self.warmup_steps} for the heads, "
                         f"{self.joint_warmup_steps} for the adapter after the heads-only steps)" if self.stage1_steps
                         else f"{self.warmup_steps} warm-up)")),
            ("head vocabulary", self.head_vocab),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {value}" for name, value in rows]
        lines.append("stages:")
        for stage in self.stages:
            mark = "[done] " if stage.done else "[todo] "
            lines.append(f"  {mark}{stage.name:<9} -> {stage.output}  ({stage.detail})")
        lines += [f"warning: {warning}" for warning in self.warnings]
        return "\n".join(lines)


@dataclass
class RunPaths:
    """The output folder's layout."""

    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def features(self) -> Path:
        return self.root / "features"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def final(self) -> Path:
        """The trained heads (and Medusa-2 adapter) before evaluation."""
        return self.checkpoints / "final"

    @property
    def heads(self) -> Path:
        return self.root / "heads"

    @property
    def logs(self) -> Path:
        return self.root / "logs"


def run_paths(config: TrainConfig) -> RunPaths:
    return RunPaths(Path(config.output_dir))


def rows_path(config: TrainConfig) -> Path:
    return Path(config.data.rows) if config.data.rows else run_paths(config).data / "distilled.jsonl"


def owns_rows(config: TrainConfig) -> bool:
    """Whether this run distils its rows: from ``data.prompts`` into its own file, or into a
    ``data.rows`` path that does not exist yet. A given ``data.rows`` file is read as it is."""
    d = config.data
    return bool(d.prompts) and not d.tokenized and (not d.rows or not rows_path(config).is_file())


def features_root(config: TrainConfig) -> Path:
    return Path(config.features.dir) if config.features.dir else run_paths(config).features


def _count_rows(path: Path) -> int:
    """The rows of a rows file: its lines, or the elements of its one JSON array (ShareGPT's ``.json``)."""
    from medusa_train.dataset import is_json_array, read_rows

    if is_json_array(path):
        return len(read_rows(path))
    with path.open("rb") as handle:
        return sum(1 for line in handle if line.strip())


def _row_ids(path: Path) -> list[Any] | None:
    """The ``id`` of every row of a rows file (None for a row without one), which the run's split reads (several
    answers to one prompt stay on one side: ``split_sizes``' counts alone promised fewer training examples, and
    fewer steps, than the run took); None where the file does not read."""
    from medusa_train.dataset import read_rows

    try:
        return [None if row.get("id") is None else str(row["id"]) for row in read_rows(path)]
    except (OSError, ValueError, AttributeError):  # (the run names what is wrong with the file)
        return None


def split_indices(n: int, fraction: float, seed: int,
                  ids: Sequence[Any] | None = None) -> tuple[list[int], list[int]]:
    """``(train, heldout)`` indices of ``n`` examples, each in file order, as ``dataset.split_heldout`` draws them
    (``split_sizes``' counts, a permutation by ``seed``). With ``ids`` (one per example, None for none) that repeat
    (rows answering one prompt several times), the examples of one id go to one side together: split apart, the
    held-out prompts were trained on, and their accuracies read high. The ids are then drawn in a permutation,
    each held out whose answers still fit ``split_sizes``' count of held-out examples (where none fits, the
    first whose answers leave training some)."""
    import numpy as np

    groups: dict[Any, list[int]] = {}
    for index, key in enumerate(ids if ids is not None else [None] * n):
        groups.setdefault(("id", str(key)) if key is not None else ("row", index), []).append(index)
    n_heldout = split_sizes(n, fraction)[1]
    if len(groups) == n:  # every example its own: drawn as before ids were read
        order = np.random.default_rng(seed).permutation(n)
        return sorted(order[n_heldout:].tolist()), sorted(order[:n_heldout].tolist())
    members = list(groups.values())
    if n_heldout and len(members) < 2:
        raise ValueError(f"the {n} examples all answer one prompt (id {str(ids[0])!r}), and the held-out split keeps "
                         f"one prompt's answers together (data.heldout_fraction={fraction}): give rows of at least 2 "
                         "prompts")
    order = np.random.default_rng(seed).permutation(len(members)).tolist()
    heldout: list[int] = []
    for group in order:
        if len(heldout) + len(members[group]) <= n_heldout:
            heldout += members[group]
    if n_heldout and not heldout:  # every id has more answers than the held-out count
        heldout = list(members[next(g for g in order if len(members[g]) < n)])
    chosen = set(heldout)
    return [i for i in range(n) if i not in chosen], sorted(heldout)


def tokenized_split(config: TrainConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
    """``data.tokenized``'s examples as a run keeps them (``data.max_length``) and splits them (``split_indices``):
    ``(train, heldout)``; None without ``data.tokenized``, or with too few examples to split."""
    from medusa_train.dataset import read_rows, truncate_examples

    d = config.data
    if not d.tokenized or not Path(d.tokenized).is_file():
        return None
    kept = truncate_examples(read_rows(d.tokenized), d.max_length)[0]
    if len(kept) < 2:  # (split_sizes refuses it, naming the fix: validate keeps heldout_fraction above 0)
        return None
    ids = [example.get("id") for example in kept] if any("id" in example for example in kept) else None
    train_index, heldout_index = split_indices(len(kept), d.heldout_fraction, config.training.seed, ids)
    return [kept[i] for i in train_index], [kept[i] for i in heldout_index]


def split_sizes(n: int, fraction: float) -> tuple[int, int]:
    """``(train, heldout)`` example counts of ``n`` examples with ``fraction`` held out (``dataset.split_heldout``):
    ``round(fraction * n)`` held out, at least one and at most ``n - 1`` when ``fraction > 0``.

    ``ValueError`` when ``fraction > 0`` and fewer than two examples leave one split empty.
    """
    heldout = round(fraction * n)
    if fraction > 0:
        if n < 2:
            raise ValueError(f"{n} example(s) cannot be split into training and held-out data "
                             f"(data.heldout_fraction={fraction}); give at least 2 (data.n, or more rows)")
        heldout = min(max(heldout, 1), n - 1)
    return n - heldout, heldout


def heads_from_final(paths: RunPaths) -> bool:
    """Whether the run's ``heads/`` was evaluated from its ``checkpoints/final``: both there, with the same
    record of the examples trained on (``train_examples_sha256``; heads copy their final's, so heads
    without one beside a final with one are an earlier release's). Heads of an earlier training beside a
    newer final (checkpoints removed, the run trained again and was stopped before its evaluation) are
    evaluated again."""
    digests = []
    for folder in (paths.final, paths.heads):
        try:
            digests.append((json.loads((folder / "config.json").read_text()).get("training") or {})
                           .get("train_examples_sha256"))
        except (OSError, ValueError, AttributeError):  # missing, or unreadable: evaluated again
            return False
    return digests[0] == digests[1]


def example_settings(config: TrainConfig) -> dict[str, Any]:
    """The settings besides the rows' content that shape the training examples (``load_or_build_dataset``'s
    cache key takes them from the tokenizer and its arguments): recorded with a tokenised dataset and a
    feature index, so that ``plan`` can tell whether those were made for this config."""
    from medusa_train.dataset import content_hash

    m, d = config.model, config.data
    source = Path(d.tokenized) if d.tokenized else rows_path(config)
    return {"model": m.name, "tokenizer_files": local_model_digest(m.name, "tokenizer"),
            "chat_template": m.chat_template, "max_length": d.max_length, "system_prompt": d.system_prompt,
            "source": str(source), "source_sha256": content_hash(source) if source.exists() else None}


def local_model_digest(name: str, part: str) -> str | None:
    """For a local model folder (not a default model's name), a digest of its ``part``: ``"tokenizer"``, its
    tokenizer's and chat template's files (which shape the examples), or ``"weights"``, its weights and config
    (``features.model_fingerprint``'s: which shape the hidden states); None otherwise. An edited template, or
    weights saved again in place, were planned as done by an index recorded before, and built again by the run."""
    from medusa_infer.models import TOKENIZER_FILES, names_default_model
    from medusa_train.features import model_fingerprint

    folder = Path(name).expanduser()
    if names_default_model(name) or not folder.is_dir():
        return None
    if part == "weights":
        return str(model_fingerprint(name).get("content"))[:20]
    digest = hashlib.sha256()
    for file in sorted({*TOKENIZER_FILES, "chat_template.jinja", "chat_template.json", "special_tokens_map.json"}):
        if (folder / file).is_file():
            digest.update(file.encode() + b":" + (folder / file).read_bytes())
    return digest.hexdigest()[:20]


def feature_settings(config: TrainConfig) -> dict[str, Any]:
    """``example_settings`` and the settings that shape the feature caches (``features.cache_key``'s, the
    examples' content excepted; the model's weights as ``local_model_digest`` reads them), as
    ``features/index.json`` records them."""
    f = config.features
    # the split too: an index of another split's training examples gave their positions as exact
    return {**example_settings(config), "model_weights": local_model_digest(config.model.name, "weights"),
            "heldout_fraction": config.data.heldout_fraction, "seed": config.training.seed,
            "dtype": config.model.dtype, "attn": config.model.attn_implementation,
            "features_dtype": f.dtype, "topk": config.soft_label_topk, "shard_examples": f.shard_examples,
            "from_distillation": config.keeps_distillation_hidden}


def feature_indexes(config: TrainConfig, settings: dict[str, Any] | None = None) -> list[Path]:
    """Where the feature index of a run of ``settings`` (default: ``config``'s, ``feature_settings``) is written
    and looked for: the run folder's ``features/index.json`` and, with a shared ``features.dir``, one there named
    by the settings, which another run (another ``output_dir``) sharing the caches finds as well."""
    paths = [run_paths(config).features / "index.json"]
    if config.features.dir:
        wanted = feature_settings(config) if settings is None else settings
        digest = hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()[:20]
        paths.append(Path(config.features.dir) / "indexes" / f"{digest}.json")
    return paths


def _feature_rows(config: TrainConfig) -> int | None:
    """Cached positions of the training split, when a run of these settings (``feature_settings``)
    already wrote its feature index (this run's, or one sharing ``features.dir``)."""
    if not config.features.dir and not (run_paths(config).features / "index.json").is_file():
        return None  # (nothing to read: the settings, which hash the training data, are not made)
    settings = feature_settings(config)  # once
    found = feature_indexes(config, settings)
    if config.soft_label_topk == 0 and config.features.topk:  # a kl run's caches serve loss ce (below)
        found += feature_indexes(config, {**settings, "topk": config.features.topk})[1:]
    for index in found:
        rows = _indexed_rows(config, index, settings)
        if rows is not None:
            return rows
    return None


def _indexed_rows(config: TrainConfig, index: Path, settings: dict[str, Any]) -> int | None:
    """``_feature_rows`` of the feature index at ``index``, ``settings`` being ``feature_settings(config)``."""
    try:  # damaged (a run killed mid-write before it was renamed into place): extracted again, as unmatched
        written = json.loads(index.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(written, dict):
        return None
    wanted = json.loads(json.dumps(settings))
    recorded = written.get("settings")
    if isinstance(recorded, dict) and "seed" not in recorded and "heldout_fraction" not in recorded:
        wanted = {k: v for k, v in wanted.items() if k not in ("seed", "heldout_fraction")}  # (an index from before
        # the split was recorded: taken as the split's, as then; the run reuses its cache by the examples' hash)
    if isinstance(recorded, dict) and config.soft_label_topk == 0 and config.features.topk \
            and recorded.get("topk") == config.features.topk:  # loss ce reuses a kl run's caches, soft labels and
        wanted = {**wanted, "topk": config.features.topk}  # all, as stage_features does (the plan said to extract)
    if recorded != wanted or "train" not in written:
        return None  # another run's (or an index from before the record): extracted again
    manifest = features_root(config) / str(written["train"]) / "manifest.json"
    try:  # (a damaged manifest: the features stage builds it again, saying so)
        rows = json.loads(manifest.read_text())["num_rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rows if isinstance(rows, int) else None


def _built_ids(folder: Path) -> list[Any] | None:
    """The prompt ids of a tokenised dataset folder (its ``id`` column, memory-mapped), None where unreadable."""
    try:
        from datasets import load_from_disk

        dataset = load_from_disk(str(folder))
        return list(dataset["id"]) if "id" in dataset.column_names else None
    except (OSError, ValueError, ImportError):
        return None


def _dataset_built(config: TrainConfig) -> dict[str, Any] | None:
    """The record (``BUILD_STATS_NAME``: its counts, settings and format) of the tokenised dataset of these settings
    (``example_settings``) and of this cache format in the run's data folder, with its prompt ``ids``
    (``_built_ids``); None where there is none (one of an earlier format is built again: the plan said done)."""
    from medusa_train.dataset import BUILD_STATS_NAME, CACHE_FORMAT_VERSION

    wanted = json.loads(json.dumps(example_settings(config)))
    for folder in run_paths(config).data.glob("tokenized-*"):
        try:
            saved = json.loads((folder / BUILD_STATS_NAME).read_text())
            if saved.get("settings") == wanted and saved.get("format") == CACHE_FORMAT_VERSION:
                return {**saved, "ids": _built_ids(folder)}
        except (OSError, ValueError):
            continue
    return None


def step_counts(config: TrainConfig, units: int, num_processes: int) -> tuple[int, int, int, int]:
    """``(micro_steps_per_epoch, steps_per_epoch, total_steps, warmup_steps)`` for ``units``
    training items (positions with the feature cache, else sequences); an incomplete last
    micro-batch of an epoch is dropped, and so are the micro-batches of the last epoch that do not
    fill a whole optimizer step (``grad_accum`` of them): the run's last step would take them from an
    epoch beyond ``training.epochs``."""
    t = config.training
    micro = t.batch_tokens if config.uses_feature_cache else t.batch_size
    unit = "positions" if config.uses_feature_cache else "sequences"
    micro_per_epoch = units // (micro * num_processes)
    steps_per_epoch = micro_per_epoch // t.grad_accum
    if micro_per_epoch < 1:
        raise ValueError(
            f"{units} training {unit} do not fill one micro-batch of {micro} x {num_processes} "
            "process(es); lower the batch size or add data"
        )
    # rounded first: 0.29 epochs of 100 micro-batches are 29 of them, not the 28.999... a float gives
    total = t.max_steps if t.max_steps is not None else math.floor(round(t.epochs * micro_per_epoch, 6) / t.grad_accum)
    if total < 1:
        raise ValueError(f"the run would take 0 optimizer steps ({t.epochs:g} epoch(s) of {micro_per_epoch} "
                         f"micro-batches, grad_accum {t.grad_accum} a step); raise training.epochs, lower "
                         "training.grad_accum or set training.max_steps")
    if t.mode == "medusa2" and t.stage1_steps >= total:
        raise ValueError(f"training.stage1_steps={t.stage1_steps} leaves no joint stage in {total} steps")
    return micro_per_epoch, steps_per_epoch, total, math.floor(t.warmup_ratio * total)


def left_out(config: TrainConfig, units: int, num_processes: int) -> str | None:
    """What ``step_counts`` leaves out of the training items, in words (None: nothing): the incomplete last
    micro-batch of each epoch (another random set of items each epoch, the order being a permutation per epoch)
    and, with ``training.epochs``, the last epoch's micro-batches that fill no whole optimizer step."""
    t = config.training
    micro = t.batch_tokens if config.uses_feature_cache else t.batch_size
    unit = "positions" if config.uses_feature_cache else "sequences"
    micro_per_epoch, _, total, _ = step_counts(config, units, num_processes)
    parts = []
    rest = units - micro_per_epoch * micro * num_processes
    if rest:
        parts.append(f"each epoch leaves out {rest} of its {units} {unit} ({rest / units:.1%}; they do not fill a "
                     f"micro-batch of {micro} x {num_processes} process(es)), a different random set each epoch")
    if t.max_steps is None:
        tail = math.floor(round(t.epochs * micro_per_epoch, 6)) - total * t.grad_accum
        if tail:
            parts.append(f"the last epoch's last {tail} micro-batch(es) fill no step of training.grad_accum="
                         f"{t.grad_accum} and are left out")
    return "; ".join(parts) or None


def joint_warmup_steps(training: Any, total: int) -> int:
    """Medusa-2's adapter warm-up: ``warmup_ratio`` of the steps after the heads-only ones (``training``: a
    ``TrainConfig.training``), counted from the end of those."""
    return math.floor(training.warmup_ratio * (total - training.stage1_steps))


def plan(config: TrainConfig, num_processes: int = 1, distill_pending: int | None = None) -> Plan:
    """Lay out the run from the config alone: no model, tokenizer or data is loaded.

    ``distill_pending``: prompts the run's rows do not answer yet (``train_heads.distill_pending``),
    which a run with rows already there distils before training; None: none.
    """
    validate(config)
    t, d = config.training, config.data
    paths = run_paths(config)
    rows_file = rows_path(config)
    exact, labelled, positions, split, row_ids = False, None, None, None, None
    built = None if distill_pending or d.tokenized else _dataset_built(config)
    if d.tokenized and Path(d.tokenized).is_file():  # counted as the run keeps them (data.max_length)
        from medusa_train.dataset import IGNORE_INDEX, check_head_positions, head_positions, read_rows, \
            truncate_examples

        split = tokenized_split(config)
        examples, exact = (sum(map(len, split)) if split is not None
                           else len(truncate_examples(read_rows(d.tokenized), d.max_length)[0])), True
        if split is not None:  # (else split_sizes refuses, below)
            # the training split as the run draws it, and the positions its feature cache keeps: an upper bound
            # over all examples promised steps the run refused once the features were extracted
            train_kept, heldout_kept = split
            check_head_positions(train_kept, heldout_kept, config.heads.num_heads)  # (the run's refusal, before it)
            labelled = sum(label != IGNORE_INDEX for example in train_kept for label in example["labels"])
            positions = sum(head_positions(example["labels"]) for example in train_kept)
    elif built is not None and isinstance(built.get("examples"), int):  # the dataset this run built: its
        examples, exact = built["examples"], True  # examples, not the rows it dropped some of
    elif rows_file.is_file():
        examples = _count_rows(rows_file) + (distill_pending or 0)
        if not distill_pending:  # (rows still to distil: ids not known yet)
            row_ids = _row_ids(rows_file)
    elif owns_rows(config) and Path(d.prompts).is_file():  # the prompts the run samples: data.n, cut by the
        from medusa_train.distill import recipe_config, sample_prompts  # quotas and the file (their sources named)

        distilled = recipe_config(config)
        examples = len(sample_prompts(distilled.prompts, distilled.n, distilled.per_source, distilled.seed,
                                      distilled.exclude_ids))
    elif d.n is not None:
        examples = d.n
    elif d.per_source:
        examples = sum(d.per_source.values())
    else:
        examples = 0
    train_examples, heldout_examples = split_sizes(examples, d.heldout_fraction)
    if split is not None:  # drawn as the run draws it (by prompt id where ids repeat)
        train_examples, heldout_examples = len(split[0]), len(split[1])
    else:  # the built dataset's prompt ids, else the rows' (those the tokenising drops may change which prompts
        ids = (built or {}).get("ids")  # fit the held-out share), split by prompt as the run splits them
        ids = row_ids if ids is None else ids
        if ids is not None:
            drawn = split_indices(len(ids), d.heldout_fraction, t.seed, ids)
            train_examples, heldout_examples = len(drawn[0]), len(drawn[1])
    # answers this run distils are at most max_new_tokens long; rows or examples made otherwise, max_length
    est_tokens = train_examples * (min(d.max_new_tokens, d.max_length) if owns_rows(config) else d.max_length)
    if labelled is not None:
        est_tokens = min(est_tokens, labelled)
    tokens_exact = False

    cached = None
    if config.uses_feature_cache:
        unit, micro = "positions", t.batch_tokens
        cached = None if distill_pending else _feature_rows(config)  # rows still to distil: other examples
        counted = cached if cached is not None else positions  # (ready examples: the positions a cache keeps)
        units = counted if counted is not None else est_tokens
        exact = counted is not None  # the steps count the cache's positions, as training does
        if counted is not None:
            est_tokens, tokens_exact = counted, True
    else:
        unit, micro, units = "sequences", t.batch_size, train_examples
    micro_per_epoch, steps_per_epoch, total, warmup = step_counts(config, units, num_processes)

    h = config.heads
    head_vocab = f"{h.reduced_vocab_size} most frequent target tokens" if h.reduced_vocab_size else "full"
    if h.init_from and h.reduced_vocab_size:
        head_vocab = f"the starting heads' {h.reduced_vocab_size} (heads.init_from)"
    feats = features_root(config)
    resuming = rows_file.is_file() and distill_pending
    answering = f"{distill_pending} more prompts (resuming)" if resuming else f"{examples} prompts"
    stages = [
        Stage("distill", str(rows_file), bool(d.tokenized) or (rows_file.is_file() and not distill_pending),
              "skipped: data.tokenized given" if d.tokenized else
              "rows given (data.rows), read as they are" if not owns_rows(config) and rows_file.is_file() else
              f"{config.model.name} answers {answering}, <= {d.max_new_tokens} new tokens"),
        Stage("dataset", str(d.tokenized or paths.data), bool(d.tokenized) or built is not None,
              f"tokenise, max_length {d.max_length}, hold out {d.heldout_fraction:.0%}"),
    ]
    if config.uses_feature_cache:
        soft = f"top-{config.soft_label_topk} soft labels" if config.soft_label_topk else "no soft labels (loss ce)"
        from medusa_train.captured import kept_states

        kept = config.keeps_distillation_hidden and not d.tokenized and (
            not rows_file.is_file() or kept_states(rows_file) is not None)
        source = ("the distillation's hidden states, the backbone where they do not cover an example" if kept
                  else "backbone once over the data")
        packed = ", batches packed" if d.pack else ""
        stages.append(Stage("features", str(feats), cached is not None, f"{source}, {soft}{packed}"))
    live = d.pack and not config.uses_feature_cache  # training runs the backbone
    from medusa_train.trainer import latest_checkpoint

    trained = (paths.final / "config.json").is_file()  # (its step checkpoints are kept, and never resumed)
    resumed = latest_checkpoint(paths.checkpoints) if paths.checkpoints.is_dir() and not trained else None
    ranks = min(config.eval.top_k, h.reduced_vocab_size or config.eval.top_k)  # (the accuracies measured: ranks cap)
    stages += [
        Stage("train", str(paths.final), trained,
              f"{t.mode}, {'' if exact else '<= '}{total} steps, loss {t.loss}" + (", batches packed" if live else "")
              + (f", heads from {h.init_from}" if h.init_from else "")
              + (f", resuming {resumed.name}" if resumed is not None else "")),
        Stage("evaluate", str(paths.heads), heads_from_final(paths),
              f"top-1..{ranks} accuracy on held-out data, {config.eval.tree_size}-node tree"
              + (f" (eval.top_k={config.eval.top_k}: the heads' vocabulary holds {ranks} tokens)"
                 if ranks < config.eval.top_k else "")),
    ]
    return Plan(
        mode=t.mode, num_processes=num_processes, stages=stages, examples=examples,
        train_examples=train_examples, heldout_examples=heldout_examples, train_units=units, unit=unit,
        est_train_tokens=est_tokens, micro_batch=micro, global_batch=micro * num_processes * t.grad_accum,
        micro_steps_per_epoch=micro_per_epoch, steps_per_epoch=steps_per_epoch, total_steps=total,
        stage1_steps=t.stage1_steps if t.mode == "medusa2" else 0, warmup_steps=warmup,
        head_vocab=head_vocab, exact=exact, tokens_exact=tokens_exact,
        joint_warmup_steps=joint_warmup_steps(t, total) if t.mode == "medusa2" else 0,
        warnings=_setting_warnings(config, total),
    )


def _setting_warnings(config: TrainConfig, total: int) -> list[str]:
    """What ``plan`` warns of: settings that a run of ``total`` steps does not carry out as written (a Medusa-2
    heads' loss weight whose warm-up outlasts the joint stage never reaches ``heads_loss_weight``)."""
    from medusa_train.trainer import heads_loss_weight

    t, warnings = config.training, []
    joint = total - t.stage1_steps
    reached = heads_loss_weight(config, total - 1)
    if t.mode == "medusa2" and t.heads_weight_schedule != "constant" and t.heads_warmup_steps > joint \
            and reached < t.heads_loss_weight:
        warnings.append(f"training.heads_warmup_steps={t.heads_warmup_steps} outlasts the {joint} joint steps: the "
                        f"heads' loss weight reaches {reached:.4g} by the last step, not training.heads_loss_weight="
                        f"{t.heads_loss_weight:g}; lower heads_warmup_steps or train longer")
    return warnings
