"""Hidden states kept while distilling, so that the feature cache need not run the backbone again.

Self-distillation decodes every answer with the frozen backbone: each decoding step computes the
final hidden state of the token it feeds. The Medusa-1 feature cache (``features``) needs exactly
those states at the answer's positions, and computing them again costs a forward pass over every
prompt and answer (on the default recipe, about a third of distillation's time). With
``DistillConfig.save_hidden`` the local backend keeps them instead, one file per batch:

``<output>.hidden/batch-<digest>.safetensors``: for R rows, ``tokens`` (each row's prompt ids and
answer ids, without the end-of-sequence token, concatenated), ``token_offsets [R + 1]``,
``prompt_lengths [R]``, ``hidden`` ``[sum m_r, H]`` (row r's states at positions
``prompt_length - 1`` onwards, one per new token, end of sequence included) and
``hidden_offsets [R + 1]``; metadata ``model``, the model's ``features.model_fingerprint`` as JSON.

A batch's file is written before its rows are synced to the JSONL shard, so a killed run leaves
at most states of rows that the resumed run answers again (greedy: the same tokens).

``CapturedHidden`` finds an example's states by its prompt tokens and uses them only where the
example's tokens (the chat template applied to prompt and response, tokenised again) agree with the
tokens that were decoded; any example they do not cover is left to the forward pass. The states
start at the last prompt token, where decoding first runs the heads and where the feature cache's
rows start, so a captured example gives the same rows as a forward pass.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from medusa_infer.proposers import AutoregressiveProposer
from medusa_infer.proposers.base import StepContext
from medusa_train.features import weights_fingerprint
from medusa_train.losses import IGNORE

logger = logging.getLogger(__name__)

SUFFIX = ".hidden"


def hidden_dir(output: str | Path) -> Path:
    """The folder of the states kept while distilling into ``output`` (the merged JSONL)."""
    output = Path(output)
    return output.with_name(output.name + SUFFIX)


def kept_states(output: str | Path) -> Path | None:
    """``hidden_dir(output)`` when it holds states, else None."""
    folder = hidden_dir(output)
    return folder if any(folder.glob("batch-*.safetensors")) else None


class HiddenRecorder(AutoregressiveProposer):
    """Plain decoding that keeps the target's final hidden state at every token it feeds.

    One object per ``generate`` call. After it, ``states()[r]`` ``[m_r, H]`` holds row ``r``'s
    states at positions ``prompt_length - 1 .. prompt_length + m_r - 2``: the last prompt token
    (from the prefill), then each new token that was fed back; ``m_r`` is the row's number of new
    tokens.
    """

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self._active: list[int] = []
        self._states: list[list[torch.Tensor]] = []

    def start(self, context: StepContext, hidden: torch.Tensor) -> None:
        self._active = list(range(hidden.shape[0]))
        # copies: a row of ``hidden`` is a view that would keep the prefill's whole [B, L, H] output alive
        self._states = [[hidden[row].clone()] for row in self._active]

    def observe(self, accepted: list[list[int]], hidden: torch.Tensor, context: StepContext) -> None:
        if any(len(tokens) != 1 for tokens in accepted):
            raise ValueError("HiddenRecorder records plain decoding: one token a step per row")
        for index, row in enumerate(self._active):
            self._states[row].append(hidden[index])

    def select_rows(self, rows: torch.Tensor) -> None:
        self._active = [self._active[i] for i in rows.tolist()]

    def merge(self, other: "AutoregressiveProposer") -> None:
        raise ValueError("a HiddenRecorder belongs to one generate call; its batch cannot be merged")

    def states(self) -> list[torch.Tensor]:
        """``[m_r, H]`` per row, float32 on the CPU."""
        return [torch.stack(row).float().cpu() for row in self._states]


def save_batch(
    folder: str | Path,
    ids: Sequence[str],
    prompt_ids: Sequence[Sequence[int]],
    answers: Sequence[Sequence[int]],
    ended: Sequence[bool],
    states: Sequence[torch.Tensor],
    model: Mapping[str, Any],
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write one batch's states (see the module docstring); returns the file.

    Args:
        answers: each row's answer without its end-of-sequence token.
        ended: whether each row ended with an end-of-sequence token (which was decoded too).
        states: the recorder's, one per answer token plus one where the row ended.
        model: the model's ``features.model_fingerprint``.
    """
    if not len(ids) == len(prompt_ids) == len(answers) == len(ended) == len(states):
        raise ValueError("ids, prompt_ids, answers, ended and states must have one entry per row")
    for row, (tokens, eos, state) in enumerate(zip(answers, ended, states)):
        if len(state) != len(tokens) + bool(eos):
            raise ValueError(f"row {ids[row]!r}: {len(state)} hidden states for {len(tokens)} answer tokens "
                             f"{'and an' if eos else 'and no'} end of sequence")
    sequences = [list(p) + list(t) for p, t in zip(prompt_ids, answers)]
    tensors = {
        "tokens": torch.tensor([t for s in sequences for t in s], dtype=torch.long),
        "token_offsets": _offsets([len(s) for s in sequences]),
        "prompt_lengths": torch.tensor([len(p) for p in prompt_ids], dtype=torch.long),
        "hidden": torch.cat(list(states)).to(dtype).contiguous(),
        "hidden_offsets": _offsets([len(s) for s in states]),
    }
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()[:20]
    path = folder / f"batch-{digest}.safetensors"
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"model": json.dumps(dict(model), sort_keys=True)})
    os.replace(tmp, path)
    return path


def _fingerprint(recorded: str | None) -> Any:
    """The model fingerprint a batch file records; a file without one (written before states
    carried it: a bare model name) gives the name, which no fingerprint equals."""
    if recorded is None:
        return None
    try:
        return json.loads(recorded)
    except json.JSONDecodeError:
        return recorded


def _offsets(lengths: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.long)


@dataclass(frozen=True)
class KeptRows:
    """Rows ``start:stop`` of a batch file's ``hidden``, read from the file when asked: the
    states of a run are as large as its feature cache (551 MB for the quick recipe's 1600
    answers), so ``CapturedHidden.load`` keeps only where they are."""

    path: Path
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    def read(self, count: int | None = None) -> torch.Tensor:
        """The first ``count`` of these rows (default: all), ``[count, H]``."""
        stop = self.stop if count is None else min(self.stop, self.start + count)
        with safe_open(str(self.path), framework="pt") as handle:
            return handle.get_slice("hidden")[self.start : stop]


States = torch.Tensor | KeptRows


class CapturedHidden:
    """The states of a distillation run, found by prompt tokens.

    Args:
        entries: ``{prompt ids: [(sequence ids [S], states [m, H])]}``; the states a tensor, or
            ``KeptRows`` read when an example takes them.
    """

    def __init__(self, entries: Mapping[tuple[int, ...], list[tuple[torch.Tensor, States]]]) -> None:
        self.entries = dict(entries)

    @classmethod
    def load(cls, folder: str | Path, model: Mapping[str, Any] | None = None) -> "CapturedHidden":
        """Every batch file in ``folder``: the token ids in memory, the states left in the files
        (``KeptRows``); with ``model`` (a ``features.model_fingerprint``), files of another model,
        or of other weights under the same name (a folder trained again, or written again since:
        its weight files' times are part of it), are left out with a warning, their examples then
        run through the backbone (the dtype and attention implementation it may name are not
        compared: distillation records none)."""
        entries: dict[tuple[int, ...], list[tuple[torch.Tensor, States]]] = {}
        other: list[tuple[Path, Any]] = []  # (file, the fingerprint it records)
        wanted = None if model is None else weights_fingerprint(model)
        for path in sorted(Path(folder).glob("batch-*.safetensors")):
            try:
                with safe_open(str(path), framework="pt") as handle:
                    found = _fingerprint((handle.metadata() or {}).get("model"))
                    if wanted is not None and found != wanted:
                        other.append((path, found))
                        continue
                    tensors = {name: handle.get_tensor(name) for name in handle.keys() if name != "hidden"}
            except (SafetensorError, OSError) as err:  # cut short (a power loss before its write reached the disk)
                logger.warning("hidden-state file %s cannot be read (%s), left out: the features stage runs the "
                               "backbone over its examples", path, err)
                continue
            tokens = tensors["tokens"]
            token_at, hidden_at = tensors["token_offsets"].tolist(), tensors["hidden_offsets"].tolist()
            for row, prompt_length in enumerate(tensors["prompt_lengths"].tolist()):
                sequence = tokens[token_at[row] : token_at[row + 1]]
                key = tuple(sequence[:prompt_length].tolist())
                entries.setdefault(key, []).append((sequence, KeptRows(path, hidden_at[row], hidden_at[row + 1])))
        if other:
            logger.warning("%d of the hidden-state files in %s hold states of another model or other weights than "
                           "%s (e.g. %s: %s), left out: the features stage runs the backbone over their examples; "
                           "delete them, or distil again, to keep states of this model", len(other), folder, wanted,
                           other[0][0].name, other[0][1])
        return cls(entries)

    def __len__(self) -> int:
        return sum(len(found) for found in self.entries.values())

    def states_for(self, input_ids: Sequence[int], labels: Sequence[int]) -> tuple[int, torch.Tensor] | None:
        """``(first, states)``: the example's hidden states at positions ``first ..
        first + len(states) - 1``, covering every row a head trains from (the last prompt token
        on), or None where the captured states do not cover them.

        Rows are the positions t < last - 1 (head 1 predicts t + 2); soft-label rows (``labels[t + 1]``
        an answer token) reach t = last - 1, so the states must cover that position too (else the
        last answer token's soft target would be lost: the example takes a forward pass instead).
        The state at ``last`` (reading the last token) is never needed, and decoding never computed it."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        labelled = (torch.as_tensor(labels, dtype=torch.long) != IGNORE).nonzero().flatten()
        if len(labelled) < 3:  # fewer than 3 answer tokens: no row from the answer itself
            return None
        answer, last = int(labelled[0]), int(labelled[-1])
        if answer < 1:
            return None
        needed_end = last  # positions answer - 1 .. last - 1: every row and soft row
        for sequence, states in self.entries.get(tuple(ids[:answer].tolist()), []):
            width = min(len(sequence), len(ids))
            differ = (sequence[:width] != ids[:width]).nonzero()
            agree = int(differ[0]) if len(differ) else width
            end = min(answer - 1 + len(states), agree)  # the state at t reads tokens 0..t
            if end >= needed_end:
                take = end - (answer - 1)
                return answer - 1, states[:take] if isinstance(states, torch.Tensor) else states.read(take)
        return None
