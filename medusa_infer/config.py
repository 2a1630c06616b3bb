"""The heads' configuration: what a checkpoint's ``config.json`` holds."""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from medusa_infer.trees import AcceptanceModel

PROJECTIONS = ("shared", "own")
FORMAT_VERSION = 2
# Version 1 stored, in a calibrated config (one with a cost profile), per-rank accuracies in
# head_accuracies; version 2 always stores cumulative top-k accuracies there.


logger = logging.getLogger(__name__)

FREE_FORM_RECORDS = ("acceptance", "cost_profile", "training")
"""The heads config's fields that hold records (measured or a run's) rather than settings."""

@dataclass
class MedusaConfig:
    """Configuration of a set of Medusa heads.

    Attributes:
        num_heads: K, the number of heads; head k predicts the token k + 2 positions ahead of the
            hidden state it reads (head 0 predicts the token after the base model's next token).
        num_layers: L, residual blocks ``x + SiLU(Linear(x))`` per head.
        hidden_size: the base model's hidden size (checked against the base model on load).
        vocab_size: the base model's vocabulary size (rows of its ``lm_head``).
        projection: ``"shared"`` reuses the base model's frozen ``lm_head`` (not stored in the
            checkpoint); ``"own"`` gives each head its own projection, initialised from it.
        reduced_vocab_size: when set, the heads score only this many token ids (the most frequent
            ones in the training data); the checkpoint then stores the ``token_map`` tensor.
        next_token_input: each head also reads the token at t + 1, the base model's own next
            token, which is known whenever the heads run (it is the candidate tree's root): its
            input embedding (the base model's, frozen) enters through a per-head zero-initialised
            ``Linear(hidden, hidden)``. Not part of the FasterDecoding/Medusa layout.
        path_input: each head k also reads the tokens t + 2 .. t + k + 1 of the candidate path it
            extends (Hydra-style sequentially dependent heads; needs ``next_token_input``). A
            tree's nodes then get their children from their own path.
        base_model_name_or_path: the base model the heads were trained for.
        base_model_type: ``config.model_type`` of that base model (checked on load).
        tree: the default candidate tree, a list of paths of top-k ranks (Medusa's format).
        top_k: candidates taken from each head when building trees.
        head_accuracies: measured top-k accuracy per head, ``[num_heads][k]``: entry ``[d][j]`` is
            how often head d's target is among its ``j + 1`` best candidates (cumulative).
        path_accuracies: measured joint acceptance of the most probable tree paths,
            ``[[path, probability], ...]``: how often every rank along the path is right at once.
            When set, trees are fitted to it instead of to ``head_accuracies`` taken as
            independent (heads share their errors, so deep paths are likelier than that says).
        acceptance: measured acceptance figures (tokens per step, per-depth rates, ...).
        cost_profile: measured verification cost per tree size on some device.
        chat_template: the jinja chat template the heads were trained on when it is not the
            tokenizer's own (a recipe's ``model.chat_template``, e.g. Vicuna's v1.1 format, whose
            tokenizer ships none). ``MedusaModel.from_pretrained`` installs it on the tokenizer, so
            chats are rendered as in training. ``None``: the tokenizer's own template.
        training: free-form training metadata (recipe, data, steps, ...).
    """

    num_heads: int = 4
    num_layers: int = 1
    hidden_size: int = 0
    vocab_size: int = 0
    projection: str = "shared"
    reduced_vocab_size: int | None = None
    next_token_input: bool = False
    path_input: bool = False
    base_model_name_or_path: str | None = None
    base_model_type: str | None = None
    tree: list[list[int]] | None = None
    top_k: int = 10
    head_accuracies: list[list[float]] | None = None
    path_accuracies: list[list[Any]] | None = None
    acceptance: dict[str, Any] | None = None
    cost_profile: dict[str, Any] | None = None
    chat_template: str | None = None
    training: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for name, kind in (("num_heads", int), ("num_layers", int), ("hidden_size", int), ("vocab_size", int),
                           ("top_k", int), ("next_token_input", bool), ("path_input", bool), ("training", dict),
                           ("reduced_vocab_size", (int, type(None))), ("tree", (list, type(None))),
                           ("base_model_name_or_path", (str, type(None))), ("base_model_type", (str, type(None))),
                           ("chat_template", (str, type(None))), ("acceptance", (dict, type(None))),
                           ("cost_profile", (dict, type(None)))):
            value = getattr(self, name)
            kinds = kind if isinstance(kind, tuple) else (kind,)
            if not isinstance(value, kind) or (int in kinds and isinstance(value, bool)):
                names = " or ".join(k.__name__ for k in kinds)
                raise ValueError(f"heads config {name} must be {names.replace('NoneType', 'null')}, got {value!r}")
        for name in FREE_FORM_RECORDS:  # (JSON keys: an integer one failed the save, and
            key = _non_string_key(getattr(self, name))  # a nested one came back a string)
            if key is not None:
                raise ValueError(f"heads config {name} keys must be strings (JSON's), got {key!r}")
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
        for name in ("hidden_size", "vocab_size"):  # 0: not known yet (filled in from the base model)
            if getattr(self, name) < 0:
                raise ValueError(f"heads config {name} must be >= 0, got {getattr(self, name)}")
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {self.num_layers}")
        if self.projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {self.projection!r}")
        if self.reduced_vocab_size is not None and not 0 < self.reduced_vocab_size <= self.vocab_size:
            raise ValueError(
                f"reduced_vocab_size must be in (0, vocab_size={self.vocab_size}], "
                f"got {self.reduced_vocab_size}"
            )
        if self.path_input and not self.next_token_input:
            raise ValueError("path_input=True needs next_token_input=True (the path starts at the token t + 1); "
                             "set both")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        self._check_tables()
        if self.tree is not None:
            self.tree = [list(p) for p in self.tree]
        if self.head_accuracies is not None:
            if len({len(row) for row in self.head_accuracies}) > 1:  # trees rank every head's candidates alike
                raise ValueError(f"heads config head_accuracies rows have lengths "
                                 f"{[len(row) for row in self.head_accuracies]}; give every head the same top-k "
                                 "(cut the longer rows to the shortest)")
            for head, row in enumerate(self.head_accuracies):
                if any(b < a - 1e-9 for a, b in zip(row, row[1:])):
                    raise ValueError(f"head_accuracies[{head}] = {row} must be cumulative top-k accuracies "
                                     "(non-decreasing); trees.per_rank_accuracies gives per-rank ones")
        if self.path_accuracies is not None:
            self.path_accuracies = [[list(path), float(prob)] for path, prob in self.path_accuracies]
        self._check_against_heads()

    def _check_against_heads(self) -> None:
        """The tree, the accuracies and the cost profile fit these heads (a hand-edited config.json with a
        tree deeper than the heads loaded, then failed at the first generate with an error about a path
        the user never gave, and was exported as it was)."""
        from medusa_infer.trees import validate_tree

        if self.tree:
            try:  # kept normalised: duplicates were saved, and exported as medusa_choices (nodes to engines)
                self.tree = [list(path) for path in validate_tree(self.tree, self.num_heads, self.top_k)]
            except ValueError as err:
                raise ValueError(f"heads config tree: {err} (config.json's tree, top_k {self.top_k}, "
                                 f"{self.num_heads} heads)") from None
            # (ranks past a reduced vocabulary loaded, and the first generate named a tree nobody passed)
            # (vocab_size 0: not known yet, filled in from the base model)
            past = next((path for path in self.tree if max(path) >= self.head_vocab_size), None)
            if past is not None and self.head_vocab_size > 0:
                scored = "reduced_vocab_size" if self.reduced_vocab_size else "vocab_size"
                raise ValueError(f"heads config tree: path {tuple(past)} takes rank {max(past)}, and the heads score "
                                 f"{self.head_vocab_size} tokens ({scored}): use ranks below "
                                 f"{self.head_vocab_size} (config.json's tree)")
        if self.head_accuracies is not None:
            if len(self.head_accuracies) > self.num_heads:
                raise ValueError(f"heads config head_accuracies has {len(self.head_accuracies)} rows for "
                                 f"{self.num_heads} heads: one row per head")
            if any(not 0.0 <= value <= 1.0 for row in self.head_accuracies for value in row):  # NaN too
                raise ValueError(f"heads config head_accuracies must hold accuracies in [0, 1], got "
                                 f"{self.head_accuracies!r:.200}")
        for path, prob in self.path_accuracies or []:
            if not path or len(path) > self.num_heads or min(path) < 0 or not 0.0 <= prob <= 1.0:
                raise ValueError(f"heads config path_accuracies entry {[path, prob]}: a path of 1 to "
                                 f"{self.num_heads} ranks >= 0 and a probability in [0, 1]")
        if self.path_accuracies:  # (a table that no path could have been measured with was named at the first
            from medusa_infer.trees import check_accuracies  # generate, not as the config's)

            try:
                check_accuracies({tuple(path): prob for path, prob in self.path_accuracies})
            except ValueError as err:
                raise ValueError(f"heads config path_accuracies: {err}; remove path_accuracies from config.json "
                                 "(medusa-bench --calibrate then measures them again)") from None
        if self.cost_profile is not None:
            from medusa_infer.tree_fit import CostProfile

            try:
                CostProfile.from_dict(self.cost_profile)
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"heads config cost_profile {self.cost_profile!r:.120} is not a cost profile "
                                 f"({type(err).__name__}: {err}); remove it, or measure it again "
                                 "(medusa-bench --calibrate)") from None

    def _check_tables(self) -> None:
        """``tree``, ``head_accuracies`` and ``path_accuracies`` have their documented shapes (a
        hand-edited config.json with a flat list failed later with a bare TypeError)."""
        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_number(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        def rows(value: Any, ok: Callable[[Any], bool]) -> bool:
            return isinstance(value, (list, tuple)) and all(ok(row) for row in value)

        checks = (
            ("tree", lambda v: rows(v, lambda path: rows(path, is_int)), "a list of rank paths, e.g. [[0], [0, 0], [1]]"),
            ("head_accuracies", lambda v: rows(v, lambda row: rows(row, is_number)),
             "a list of each head's cumulative top-k accuracies, e.g. [[0.5, 0.6], [0.3, 0.4]]"),
            ("path_accuracies", lambda v: rows(v, lambda pair: isinstance(pair, (list, tuple)) and len(pair) == 2
                                               and rows(pair[0], is_int) and is_number(pair[1])),
             "a list of [rank path, probability] pairs, e.g. [[[0], 0.5], [[0, 0], 0.3]]"),
        )
        for name, ok, shape in checks:
            value = getattr(self, name)
            if value is not None and not ok(value):
                raise ValueError(f"heads config {name} must be null or {shape}, got {value!r:.200}")

    def acceptance_model(self) -> "AcceptanceModel | None":
        """What trees are fitted to: the joint path accuracies when measured, else the per-rank
        accuracies (independent across heads); None when neither was measured. Only ranks below ``top_k``,
        the ranks a tree may hold (a config.json whose top_k was lowered by hand measured more: a fitted tree
        then failed on a rank it held)."""
        from medusa_infer.trees import per_rank_accuracies

        if self.path_accuracies:
            return {tuple(path): prob for path, prob in self.path_accuracies if max(path) < self.top_k}
        if self.head_accuracies:
            return per_rank_accuracies([row[:self.top_k] for row in self.head_accuracies])
        return None

    @property
    def trained_with_adapter(self) -> bool:
        """Whether training's record (``training.recipe.training.mode``) says Medusa-2: heads trained with a
        LoRA adapter on the backbone, whose hidden states they read."""
        recipe = self.training.get("recipe")
        section = recipe.get("training") if isinstance(recipe, dict) else None
        return isinstance(section, dict) and section.get("mode") == "medusa2"

    @property
    def head_vocab_size(self) -> int:
        """Width of each head's logits: the reduced vocabulary when set, else the full one."""
        return self.reduced_vocab_size or self.vocab_size

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        recipe = _recipe_model(data["training"])
        # None is left out, the common case, readable by releases that predate the field; it is kept
        # where the recipe names a template, which from_dict would otherwise take (heads set back to the
        # tokenizer's own template came back with the recipe's)
        if data["chat_template"] is None and not (isinstance(recipe, dict) and recipe.get("chat_template")):
            del data["chat_template"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MedusaConfig":
        if not isinstance(data, dict):
            raise ValueError(f"a heads config is a JSON object of settings, got {type(data).__name__}: {data!r:.80}")
        known = {f.name for f in dataclasses.fields(cls)}
        version = data.get("format_version", FORMAT_VERSION)  # first: a newer release's keys are its own
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ValueError(f"heads config format_version must be an integer >= 1 (this release writes "
                             f"{FORMAT_VERSION}), got {version!r}")
        if version > FORMAT_VERSION:
            raise ValueError(
                f"heads config format_version {version} is newer than this medusa-forge supports "
                f"({FORMAT_VERSION}); upgrade medusa-forge"
            )
        unknown = sorted(set(data) - known)
        if unknown:
            close = {key: difflib.get_close_matches(key, known, n=1) for key in unknown}
            meant = "; ".join(f"{key!r}: did you mean {match[0]!r}?" for key, match in close.items() if match)
            raise ValueError(
                f"unknown keys {unknown} in a medusa-forge heads config{f' ({meant})' if meant else ''}; known keys: "
                f"{sorted(known)}. Misspelt, or written by a newer medusa-forge (which needs an upgrade). Nor is it "
                "the FasterDecoding/Medusa layout "
                "(a config.json with medusa_num_heads and medusa_num_layers, which MedusaModel.from_pretrained "
                "reads too); heads in another layout (vLLM's, EAGLE's) need converting to one of the two."
            )
        rows = data.get("head_accuracies")
        if version < 2 and data.get("cost_profile") and isinstance(rows, list):
            # calibrated under version 1: per-rank accuracies, made cumulative here (a row that is no list of
            # numbers is left as it is, for _check_tables to name)
            data = {**data, "head_accuracies": [
                [_capped(round(sum(row[: j + 1]), 5)) for j in range(len(row))]
                if isinstance(row, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in row)
                else row for row in rows]}
        if not isinstance(data.get("training", {}), (dict, type(None))):  # (None: named by __post_init__)
            raise ValueError(f"heads config training must be dict (the run's record), got {data['training']!r:.80}")
        if "chat_template" not in data:  # heads saved before the field: their recipe's template
            data = {**data, "chat_template": _recipe_model(data.get("training")).get("chat_template")}
        return cls(**{**data, "format_version": FORMAT_VERSION})

    def to_json(self) -> str:
        """``config.json``'s text: strict JSON (NaN and infinities, which other readers refuse, were written as
        ``NaN``). In the free-form records (``training``, ``acceptance``, ``cost_profile``: a diverged run's last
        loss, say) a NaN or an infinity is written as null, and said; a value JSON has no form for is a
        ``ValueError`` naming where it is."""
        data = self.to_dict()
        nonfinite: list[str] = []
        for name in FREE_FORM_RECORDS:
            data[name] = plain_record(data[name], name, nonfinite)
        if nonfinite:
            logger.warning("heads config %s %s not a finite number, written as null (JSON has no NaN or infinity)",
                           ", ".join(nonfinite[:5]) + (f" and {len(nonfinite) - 5} more" if len(nonfinite) > 5 else ""),
                           "is" if len(nonfinite) == 1 else "are")
        for name, value in data.items():
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as err:
                raise ValueError(f"heads config {name} cannot be written as JSON ({err}): give finite numbers, "
                                 "strings, booleans, null, and lists and string-keyed dicts of them") from None
        return json.dumps(data, indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "MedusaConfig":
        """A heads folder's ``config.json``: ``ValueError`` naming the file where it is no JSON, or lacks a key
        every saved config holds (``num_heads``, ``hidden_size``, ``num_layers``, ``vocab_size``, ``projection``:
        their defaults would be blamed on the weights, or on the base model)."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not valid JSON ({err}): re-save or re-export the heads") from None
        missing = [key for key in ("num_heads", "hidden_size", "num_layers", "vocab_size", "projection")
                   if isinstance(data, dict) and key not in data]
        if missing:
            raise ValueError(f"{path} has no {' and no '.join(missing)}, which every saved heads config holds: it is "
                             "damaged or not a heads config; re-save or re-export the heads")
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as err:  # (a value's own error named neither the file nor a way out)
            raise ValueError(f"{path}: {err}; fix it there, or re-save or re-export the heads") from err


def _recipe_model(training: Any) -> dict[str, Any]:
    """The ``model`` section of a training record's recipe (``training.recipe.model``); {} where any level
    is missing or no mapping (the record is free-form: a recipe given as a path crashed saving)."""
    recipe = training.get("recipe") if isinstance(training, dict) else None
    model = recipe.get("model") if isinstance(recipe, dict) else None
    return model if isinstance(model, dict) else {}


def _capped(total: Any) -> Any:
    """A sum of version 1's per-rank accuracies, each rounded to 5 digits: 1.00002 where the truth is 1."""
    return 1.0 if isinstance(total, float) and 1.0 < total <= 1.0 + 1e-4 else total


def plain_record(value: Any, path: str, nonfinite: list[str]) -> Any:
    """``value`` (a free-form record's, ``FREE_FORM_RECORDS``) with each NaN or infinity replaced by None, its path
    added to ``nonfinite``; ``ValueError`` naming the path of a value JSON has no form for (a numpy float32, a
    Path)."""
    if isinstance(value, float) and not math.isfinite(value):
        nonfinite.append(path)
        return None
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {key: plain_record(item, f"{path}.{key}", nonfinite) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_record(item, f"{path}[{i}]", nonfinite) for i, item in enumerate(value)]
    raise ValueError(f"heads config {path} is a {type(value).__name__} ({value!r:.60}), which JSON has no form for: "
                     "give numbers, strings, booleans, null, and lists and string-keyed dicts of them")


def _non_string_key(value: Any) -> Any:
    """The first dict key in ``value`` (dicts and lists, nested) that is not a string, or None."""
    if isinstance(value, dict):
        for key, item in value.items():
            found = key if not isinstance(key, str) else _non_string_key(item)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for item in value:
            found = _non_string_key(item)
            if found is not None:
                return found
    return None
