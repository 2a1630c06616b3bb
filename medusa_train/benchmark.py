"""``medusa-bench``: speed and acceptance on Spec-Bench-format questions, methods interleaved.

Protocol (Spec-Bench's): every question's turns are answered in the conversation so far; speed is
new tokens over wall-clock time; speedup is the ratio of speeds against Hugging Face ``generate``
measured in the same run; tau is the mean tokens per decoding step, the bonus token counted, as
Spec-Bench, vLLM and ``GenerationMetrics.tau`` count it (the prefill's token is no step's; Hugging Face's
assisted methods verify drafts in their first forward already: one that accepted some is a step of its
tokens past the first, one that accepted none counts as the prefill alone), so plain decoding scores 1.0.
Methods run one after the other on each question (interleaved), so a noisy machine slows all of them alike;
each group of questions starts with the next method in turn (rotated), so that none (the baseline was)
always meets a question first and pays what that costs.

With ``--batch-size B`` the questions are answered in groups of B: for each turn index, the rows of
the group that have that turn are decoded together as one left-padded batch, and each row's answer
goes on in its own conversation. Speed is still all new tokens over all wall-clock seconds, a
batch's seconds counted once (per category, a batch's seconds are shared among its rows in
proportion to their tokens). tau is per row: a row's tokens after its first over the decoding steps it
took part in (while it was unfinished), so a batch that decodes plainly still scores 1.0. TTFT is the batch's time to its first tokens and TPOT the time per token of one
row (its decoding seconds over its later tokens: the batch's decoding seconds in proportion to the steps
the row was still decoding in, so a row finishing early is not charged the others' steps), as a user of
one row would see them.
``hf-lookup`` and ``hf-assisted`` run at batch size 1 only (Hugging Face's assisted generation
refuses larger batches). Every method first answers one short turn untimed (``warm_up``): the first
kernel passes (and on CUDA the kernels' set-up) would otherwise count against the first method.

``--time-budget S`` starts no new question once S seconds have passed since medusa-bench started
(model loading and calibration included), and takes the questions round robin across categories,
so the report (written as usual, when the questions being answered are done) still covers every
category; it says how many questions were answered. A caller with a hard time limit keeps a report.

    medusa-bench --heads runs/demo/heads --questions data/specbench.jsonl --limit 80 \\
        --methods hf,hf-lookup,ar,medusa,lookup --output runs/bench
    medusa-bench --heads runs/demo/heads --questions data/specbench.jsonl --limit 80 --batch-size 8 \\
        --methods hf,ar,medusa,lookup --output runs/bench-b8
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
import json
import math
import os
import platform
import random
import re
import statistics
import sys
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from medusa_infer.adaptive import StepCosts
from medusa_infer.attention_kernels import decoding_attention
from medusa_infer.checkpoint import load_heads_state
from medusa_infer.cli import (DRAFT_INSTEAD, HEADS_INSTEAD, MAX_THREADS, MODEL_INSTEAD, decode_utf8, is_text,
                              refuse_empty)
from medusa_infer.decoding import context_length, eos_ids, padding_id
from medusa_infer.interop import base_model_name, is_medusa_layout, read_medusa_layout
from medusa_infer.model import PROCESSOR_SETTINGS
from medusa_infer.proposers.lookup import LOOKUP_MAX_TOKENS
from medusa_train.evaluate import HeadAccuracy, head_accuracy, walked_tokens_per_step

HF_METHODS = ("hf", "hf-lookup", "hf-assisted")
OUR_METHODS = ("ar", "medusa", "medusa-lookup", "medusa-typical", "medusa-lossless", "draft", "lookup", "layerskip")
ALL_METHODS = HF_METHODS + OUR_METHODS
SAMPLING_METHODS = ("medusa-typical", "medusa-lossless")
DEFAULT_METHODS = ("hf", "hf-lookup", "ar", "medusa", "lookup")
UNBATCHED_METHODS = ("hf-lookup", "hf-assisted")  # Hugging Face's assisted generation: batch size 1 only
DRAFT_METHODS = ("hf-assisted", "draft")  # need --draft-model
LOOKUP_METHODS = ("hf-lookup", "lookup", "medusa-lookup")  # drafts of up to --lookup-tokens tokens
HF_LOOKUP_TOKENS = 10
"""hf-lookup's ``prompt_lookup_num_tokens`` without ``--lookup-tokens``; lookup and medusa-lookup
then propose ``proposers.DEFAULT_DRAFT_TOKENS`` (4) without a cost profile."""


@dataclass
class Turn:
    """One row's answered turn.

    Attributes:
        tokens: the new tokens.
        seconds: the row's share of the call's wall-clock seconds (all of it at batch size 1).
        steps: target forwards the row took part in after the prefill.
        ttft_s: the call's time to its first tokens.
        peak_mem_mb: the call's peak memory.
        call_s: wall-clock seconds of the whole call (equal to ``seconds`` at batch size 1).
        call_steps: the most ``steps`` of any row of the call (the steps its decoding took).
        first_tokens: tokens the call's first forward gave the row: 1, or more where it verified drafts
            too (Hugging Face's assisted methods).
    """

    tokens: list[int]
    seconds: float
    steps: int
    ttft_s: float
    peak_mem_mb: float
    call_s: float
    call_steps: int
    first_tokens: int = 1


@dataclass
class MethodTotals:
    """Sums over row-turns; ``decode_s`` sums each row's decoding time (its call's seconds after the
    first token, in proportion to the steps the row was decoding in), the numerator of the per-row
    TPOT."""

    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    step_tokens: int = 0  # tokens the decoding steps gave (all but the prefill's first)
    later_tokens: int = 0  # tokens after the first forward's (TPOT's denominator; its numerator is their time)
    ttft: list[float] = field(default_factory=list)
    decode_s: float = 0.0
    peak_mem_mb: float = 0.0
    identical: int = 0  # row-turns whose tokens equal the reference method's
    compared: int = 0  # row-turns compared with it (0: not compared)

    def add(self, turn: Turn) -> None:
        self.tokens += len(turn.tokens)
        self.seconds += turn.seconds
        # a first forward that accepted drafts (Hugging Face's assisted methods) is also a step, of the tokens
        # it gave past the prefill's (one that accepted none looks like the prefill alone: not counted)
        self.steps += turn.steps + (min(turn.first_tokens, len(turn.tokens)) > 1)
        self.step_tokens += max(len(turn.tokens) - 1, 0)
        # an assisted first forward's accepted drafts came in the TTFT's time: not in TPOT's
        self.later_tokens += len(turn.tokens) - min(max(turn.first_tokens, 1), len(turn.tokens))
        self.ttft.append(turn.ttft_s)
        if len(turn.tokens) > 1:  # a row that stopped at its first token has no later tokens to charge
            self.decode_s += (turn.call_s - turn.ttft_s) * turn.steps / max(turn.call_steps, 1)
        self.peak_mem_mb = max(self.peak_mem_mb, turn.peak_mem_mb)

    def summary(self, baseline_speed: float | None) -> dict[str, Any]:
        speed = self.tokens / self.seconds if self.seconds else 0.0
        later = self.later_tokens
        return {
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            # tokens per decoding step (None: every turn ended at its first token, with no step to count)
            "tau": round(self.step_tokens / self.steps, 3) if self.steps else None,
            "tokens_per_s": round(speed, 3),
            "speedup": round(speed / baseline_speed, 3) if baseline_speed else None,
            "exact": self.identical == self.compared if self.compared else None,
            "identical_turns": self.identical if self.compared else None,
            "turns": len(self.ttft),
            "ttft_s": round(sum(self.ttft) / len(self.ttft), 4) if self.ttft else None,
            "tpot_s": round(self.decode_s / later, 5) if later > 0 else None,
            "peak_mem_mb": round(self.peak_mem_mb, 1),
        }


class _PeakMemory:
    """Peak resident memory (CPU) or peak allocated memory (CUDA) while the block runs, in MB: the
    process's, so the model and what earlier blocks left allocated count too. Memory freed before is
    given back to the system first (``_give_back_freed_memory``), or a resident peak would carry over.

    On Linux the kernel's own high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``), which
    misses no short peak; elsewhere resident memory sampled every 10 ms and once more at the end."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peak = device, 0.0

    def __enter__(self) -> "_PeakMemory":
        self._thread = None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        _give_back_freed_memory()
        if _reset_high_water_mark():
            return self
        import psutil

        process = psutil.Process()
        self._stop = threading.Event()
        self.peak = process.memory_info().rss / 2**20

        def sample() -> None:
            while not self._stop.wait(0.01):
                self.peak = max(self.peak, process.memory_info().rss / 2**20)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device) / 2**20
        elif self._thread is None:
            self.peak = _high_water_mark_mb()
        else:
            self._stop.set()
            self._thread.join()
            import psutil

            self.peak = max(self.peak, psutil.Process().memory_info().rss / 2**20)


def _give_back_freed_memory() -> None:
    """Collect unreachable objects and return the C heap's free pages to the system (glibc's
    ``malloc_trim``, where there is one), so that the resident memory counts what is held, not what an
    earlier method freed: a method measured after another was charged with the first one's peak."""
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _reset_high_water_mark() -> bool:
    """Reset this process's peak resident memory (Linux); False where that cannot be done."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _high_water_mark_mb() > 0
    except (OSError, ValueError):
        return False


def _high_water_mark_mb() -> float:
    """This process's peak resident memory since the last reset (``VmHWM``), in MB."""
    found = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
    if found is None:
        raise ValueError("/proc/self/status has no VmHWM")
    return int(found.group(1)) / 1024


class _FirstTokenTimer:
    """A ``generate`` streamer that records when the first new token arrives."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.first_tokens = 1  # of a row, in the first forward (more where it verified drafts)
        self._puts = 0

    def put(self, value: torch.Tensor) -> None:
        self._puts += 1
        if self._puts == 2 and self.first is None:  # the first put is the prompt
            self.first = time.perf_counter() - self.start
            self.first_tokens = int(value.shape[-1]) if value.dim() else 1

    def end(self) -> None:
        pass


class _ForwardCounter:
    """Counts forwards of a module (the target's verification steps)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.count = 0
        self._handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, *args: Any) -> None:
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


def load_questions(path: str | Path, limit: int | None = None, seed: int = 0,
                   exclude_ids: Sequence[Any] = ()) -> list[dict]:
    """Spec-Bench-format questions (``id``, ``category``, ``turns``); with ``limit``, a sample
    balanced across categories (round robin in a seeded shuffle), in file order."""
    return pick_questions(read_questions(path), limit, seed, exclude_ids)


def read_questions(path: str | Path) -> list[dict]:
    """Every Spec-Bench-format question of ``path``, checked (read once: it may be a pipe; ``question_id``, as
    Spec-Bench's and MT-Bench's own ``question.jsonl`` name it, is read as ``id``); ``ValueError`` naming
    two lines of one id (81 and "81" alike): questions are left out by id (calibration's, ``--exclude-ids``), and
    each of a duplicated id's questions was left out with the one named."""
    rows, lines = [], {}
    text = decode_utf8(Path(path).read_bytes(), path)
    # lines end at "\n" alone: JSON keeps U+2028, U+2029 and U+0085 in strings, which splitlines() ends lines at
    # (a question whose text held one was refused as invalid JSON); "\r" of CRLF is whitespace to json.loads
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err}); each line holds one question") from err
        if isinstance(row, dict) and "id" not in row and "question_id" in row:  # Spec-Bench's and MT-Bench's files
            row = {"id": row["question_id"], **{k: v for k, v in row.items() if k != "question_id"}}
        problem = question_problem(row)
        if problem:
            raise ValueError(f"{path}:{number}: {problem}; a question is "
                             '{"id": 1, "category": "writing", "turns": ["first turn", ...]}')
        first = lines.setdefault(str(row["id"]), number)
        if first != number:
            raise ValueError(f"{path}:{number}: id {row['id']!r} is line {first}'s too; give each question an id of "
                             "its own (questions are left out by id: calibration's, --exclude-ids)")
        rows.append(row)
    return rows


def pick_questions(questions: Sequence[dict], limit: int | None = None, seed: int = 0,
                   exclude_ids: Sequence[Any] = ()) -> list[dict]:
    """``questions`` but ``exclude_ids``; with ``limit``, a sample balanced across categories (round
    robin in a seeded shuffle), in their order."""
    excluded = {str(x) for x in exclude_ids}  # 81 and "81" alike: ids come as given in files and on command lines
    rows = [row for row in questions if str(row["id"]) not in excluded]
    if limit is None or limit >= len(rows):
        return rows
    by_category: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_category[row["category"]].append(row)
    rng = random.Random(seed)
    for items in by_category.values():
        rng.shuffle(items)
    chosen: list[dict] = []
    while len(chosen) < limit:
        for items in by_category.values():
            if items and len(chosen) < limit:
                chosen.append(items.pop())
    order = {id(row): i for i, row in enumerate(rows)}
    return sorted(chosen, key=lambda row: order[id(row)])


def question_problem(row: Any) -> str | None:
    """What is wrong with one Spec-Bench question (``id`` a string or integer, ``category`` a string,
    ``turns`` a non-empty list of strings), or None."""
    if not isinstance(row, dict):
        return f"a question is a JSON object, got {type(row).__name__}"
    missing = sorted({"id", "category", "turns"} - set(row))
    if missing:
        return f"a question needs id, category and a non-empty turns list (missing {missing})"
    if isinstance(row["id"], bool) or not isinstance(row["id"], (str, int)):
        return f"id must be a string or an integer, got {row['id']!r}"
    if not isinstance(row["category"], str):
        return f"category must be a string, got {row['category']!r}"
    turns = row["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        return f"turns must be a non-empty list of strings, got {turns!r}"
    for what, text in [("id", row["id"]), ("category", row["category"]),
                       *((f"turn {n}", turn) for n, turn in enumerate(turns, 1))]:
        if isinstance(text, str) and not is_text(text):  # (the tokenizer failed on it with a TypeError)
            return (f"{what} holds a lone surrogate (an escape such as \\ud83d without its pair), which is no text "
                    "a model can be given; fix the line")
    return None


SEARCH_SETTINGS = ("num_beams", "num_beam_groups", "diversity_penalty", "penalty_alpha", "dola_layers")
"""``GenerationConfig`` fields that pick another search than greedy (beam, diverse beam, contrastive, DoLa): a
model's ``generation_config.json`` setting one made the ``hf`` baseline another decoding (or fail: beam search
takes no streamer), which no method of ours follows."""


@contextlib.contextmanager
def plain_greedy(base) -> Iterator[None]:
    """Within the block, ``base.generate`` decodes plain greedy: its ``generation_config`` without the
    ``PROCESSOR_SETTINGS`` and ``SEARCH_SETTINGS`` (``generate`` fills a setting its arguments leave unset from the
    model's config, so passing a neutral config or value cannot remove them all). Restored on exit."""
    own = base.generation_config
    plain = copy.deepcopy(own)
    for name in PROCESSOR_SETTINGS + SEARCH_SETTINGS:
        if hasattr(plain, name):
            setattr(plain, name, None)
    base.generation_config = plain
    try:
        yield
    finally:
        base.generation_config = own


class Runner:
    """Answers one turn of a batch of conversations with one method; holds the loaded models."""

    def __init__(self, model, args: argparse.Namespace) -> None:
        self.model, self.args = model, args
        self.tokenizer = model.tokenizer
        self.gates: dict[str, Any] = {}  # method -> SpeculationGate of its greedy batches
        self.step_costs: dict[str, StepCosts] = {}  # medusa method -> cost ratios its steps measured
        self.assistant = self.assistant_tokenizer = self.draft = None
        if any(m in DRAFT_METHODS for m in args.methods):
            if not args.draft_model:
                raise ValueError(f"methods {' and '.join(DRAFT_METHODS)} need --draft-model")
            from medusa_infer.models import load_base_model, load_tokenizer
            from medusa_infer.proposers.draft import as_draft_model, check_same_vocabulary

            self.assistant = load_base_model(args.draft_model, dtype=model.dtype, device=model.device,
                                             cpu_kernels=args.cpu_kernels)
            try:  # checked once here: the proposers get the bare model, whose tokenizer each turn would compare
                draft_tokenizer = load_tokenizer(args.draft_model)
            except (OSError, ValueError):  # a folder without a tokenizer: the vocabulary sizes alone are compared
                draft_tokenizer = None
            check_same_vocabulary(model, as_draft_model(self.assistant, draft_tokenizer))
            self.assistant_tokenizer = draft_tokenizer
            # the proposers' draft: the same tokenizer (just checked), as the target's own object, which
            # they take without comparing again (an LM head padded to another size needs one)
            self.draft = as_draft_model(self.assistant, model.tokenizer)

    def run(self, method: str, messages: list[dict]) -> Turn:
        """The next turn of one conversation."""
        return self.run_batch(method, [messages])[0]

    def run_batch(self, method: str, conversations: list[list[dict]], max_new_tokens: int | None = None
                  ) -> list[Turn]:
        """The next turn of each conversation, decoded together as one left-padded batch; one
        ``Turn`` per conversation, in order. ``max_new_tokens`` overrides ``args.max_new_tokens``."""
        limit = max_new_tokens or self.args.max_new_tokens
        from medusa_infer.chat import chat_prompt_ids
        from medusa_infer.decoding import left_pad

        opening = system_turn(getattr(self.args, "system_prompt", None))
        # as generate(messages=) and the server encode them: a control token written in a question is its text
        rows = chat_prompt_ids(self.tokenizer, [opening + chat for chat in conversations])
        ids, mask = left_pad(rows, padding_id(self.model, self.tokenizer))  # (a tokenizer without one: None failed)
        ids, mask = ids.to(self.model.device), mask.to(self.model.device)
        with _PeakMemory(self.model.device) as memory:
            first = 1
            if method in HF_METHODS:
                tokens, steps, ttft, seconds, first = self._run_hf(method, ids, mask, limit)
            else:
                tokens, steps, ttft, seconds = self._run_ours(method, ids, mask, limit)
        total = sum(len(t) for t in tokens)
        # a batch's seconds shared by tokens (equally where no row got one: they were lost, 0 s each)
        shares = [seconds] if len(tokens) == 1 else [seconds * len(t) / total if total else seconds / len(tokens)
                                                      for t in tokens]
        return [Turn(t, share, s, ttft, memory.peak, seconds, max(steps), first)
                for t, share, s in zip(tokens, shares, steps)]

    def _run_hf(self, method: str, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int
                ) -> tuple[list[list[int]], list[int], float, float, int]:
        """Per row: new tokens and target forwards after the prefill; the call's TTFT and seconds, and the
        tokens a row got from the first forward (more than 1 where it verified drafts: batch size 1)."""
        extra: dict[str, Any] = {}
        if method == "hf-lookup":
            extra["prompt_lookup_num_tokens"] = _or(self.args.lookup_tokens, HF_LOOKUP_TOKENS)
        elif method == "hf-assisted":
            extra["assistant_model"] = self.assistant
            if self.assistant.get_output_embeddings().weight.shape[0] != self.model.lm_head.weight.shape[0]:
                # LM heads padded to other sizes (the tokenizers are the same: checked): generate takes the
                # pair only with both tokenizers
                extra.update(tokenizer=self.tokenizer, assistant_tokenizer=self.assistant_tokenizer)
        base = self.model.base_model
        counter = _ForwardCounter(base)
        timer = _FirstTokenTimer()
        start = time.perf_counter()
        # the attention kernels our methods decode with (attention_kernels), so both sides are
        # timed on the same kernels
        drafts = plain_greedy(self.assistant) if method == "hf-assisted" else contextlib.nullcontext()
        # the ids our methods stop at (generate's own are its generation config's alone: a fine-tune naming its
        # end-of-turn token in its tokenizer only answered on past it, and was reported inexact and slower)
        eos = list(eos_ids(self.model, self.tokenizer))
        with torch.inference_mode(), decoding_attention(self.model.device), plain_greedy(base), drafts:
            out = base.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                do_sample=False, streamer=timer, pad_token_id=padding_id(self.model, self.tokenizer),
                                **extra)  # (finished rows are fed it: an id the model embeds)
        _sync(self.model.device)
        seconds = time.perf_counter() - start
        counter.close()
        answers = [hf_answer(row, eos) for row in out[:, ids.shape[1]:].tolist()]
        if len(answers) == 1:
            steps = [max(counter.count - 1, 0)]
        else:  # plain decoding (the only batched HF method): one forward per token of a row
            steps = [max(len(row) - 1, 0) for row in answers]
        return answers, steps, timer.first or seconds, seconds, timer.first_tokens if len(answers) == 1 else 1

    def _run_ours(self, method: str, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int
                  ) -> tuple[list[list[int]], list[int], float, float]:
        """As ``_run_hf``; a row's steps are the decoding steps it was unfinished in. The time to build
        the proposer and the stream (trees, controllers, caches) counts, as ``generate``'s set-up does
        on the Hugging Face side."""
        from medusa_infer.decoding import stream
        from medusa_infer.proposers import DEFAULT_DRAFT_TOKENS, build_proposer
        from medusa_infer.speculation_gate import SpeculationGate

        start = time.perf_counter()

        options = argparse.Namespace(
            tree=self.args.tree, draft_model=self.draft, layerskip_layers=None,
            draft_tokens=self.args.lookup_tokens if method == "lookup" else None,  # None: DEFAULT_DRAFT_TOKENS
            lookup_max_tokens=self.args.lookup_max_tokens, datastore=self.args.datastore,
        )
        sampling: dict[str, Any] = {}
        if method == "medusa-typical":
            sampling = dict(do_sample=True, acceptance="typical", temperature=self.args.temperature)
        elif method == "medusa-lossless":
            sampling = dict(do_sample=True, acceptance="lossless", temperature=self.args.temperature)
        if method in ("medusa", "medusa-lookup") and self.args.step_costs == "learned" and self.args.fallback \
                and self.adaptive:
            # kept across questions; greedy only, whose output does not depend on the trees (a
            # seeded sample's would then depend on the clock)
            options.step_costs = self.step_costs.setdefault(method, StepCosts())
        if method == "medusa-lookup":  # the heads' tree plus a grafted prompt-lookup chain
            options.lookup_tokens = _or(self.args.lookup_tokens, DEFAULT_DRAFT_TOKENS)
            options.adaptive = None if self.args.fallback else False
            # adaptive when calibrated, as in stream(), unless --no-fallback
            proposer = build_proposer("medusa", self.model, options)
        elif method.startswith("medusa"):
            proposer = None  # stream() builds the Medusa proposer, adaptive when calibrated unless --no-fallback
            sampling["tree"] = self.args.tree
            sampling["step_costs"] = getattr(options, "step_costs", None)
            sampling["adaptive"] = None if self.args.fallback else False
        else:
            proposer = build_proposer("autoregressive" if method == "ar" else method, self.model, options)
        if self.args.speculation_gate == "off":
            sampling["speculation_gate"] = False
        elif ids.shape[0] > 1 and "do_sample" not in sampling:  # greedy batches: one gate per method
            sampling["speculation_gate"] = self.gates.setdefault(method, SpeculationGate())
        if "do_sample" in sampling:
            sampling["seed"] = self.args.seed
        run = stream(self.model, ids, mask, max_new_tokens=max_new_tokens, proposer=proposer, **sampling)
        set_up = time.perf_counter() - start  # the stream's own clock starts when it runs
        out = run.result()  # what generate() returns; the stream also keeps each row's step count
        m = out.metrics
        return out.new_tokens, list(run.state.row_steps.values()), set_up + m.ttft_s, set_up + m.total_s


    @functools.cached_property
    def adaptive(self) -> bool:
        """Whether the medusa methods run the adaptive fallback, whose controller learns step costs
        (``stream()`` refuses step costs where none runs)."""
        from medusa_infer.decoding import fallback_paths, resolve_tree

        return fallback_paths(self.model, resolve_tree(self.model, self.args.tree), None) is not None


def hf_answer(row: list[int], eos: Sequence[int]) -> list[int]:
    """A row of ``generate``'s new tokens up to its first EOS, kept: after it, a batch pads the rows that
    finished first (with the pad id, or an EOS where the pad is one). Nothing before it is padding, even
    tokens equal to the pad id: the model wrote them."""
    return row[: next((i + 1 for i, token in enumerate(row) if token in eos), len(row))]


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` says where there is none."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _sync(device: torch.device) -> None:
    """Wait for the accelerator's queued work, so wall-clock timings cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _or(value: int | None, default: int) -> int:
    """``value``, or ``default`` where it is None (a flag not given)."""
    return default if value is None else value


def system_turn(system_prompt: str | None) -> list[dict]:
    """The messages opening every conversation (``--system-prompt``): a system message, or none."""
    return [{"role": "system", "content": system_prompt}] if system_prompt is not None else []


def fitting_questions(model, tokenizer, questions: list[dict], max_new_tokens: int,
                      system_prompt: str | None = None) -> tuple[list[dict], list]:
    """``(questions that fit, ids of those that may not)``: a question fits when all its turns, rendered
    with empty answers (after ``system_prompt``'s message), plus ``max_new_tokens`` a turn fit the model's
    context. One that does not could fail a method midway (a prompt past the context) or end some methods'
    answers early at its end while others go on, after the methods before had answered it."""
    from medusa_infer.chat import chat_prompt_ids

    limit = context_length(model)
    fits, too_long = [], []
    for question in questions:
        chat: list[dict] = system_turn(system_prompt)
        for turn in question["turns"]:
            chat += [{"role": "user", "content": turn}, {"role": "assistant", "content": ""}]
        rendered = chat_prompt_ids(tokenizer, chat[:-1])[0]
        (fits if len(rendered) + len(question["turns"]) * max_new_tokens <= limit else too_long).append(question)
    return fits, [q["id"] for q in too_long]


def usable_questions(model, questions: list[dict], args: argparse.Namespace, say: bool = True
                     ) -> tuple[list[dict], list]:
    """``(questions that fit the model's context with args.max_new_tokens a turn, ids of the others)``
    (``fitting_questions``), saying which were left out (``say``); ``ValueError`` where none fits."""
    questions, too_long = fitting_questions(model, model.tokenizer, questions, args.max_new_tokens,
                                            getattr(args, "system_prompt", None))
    if too_long and say:
        print(f"leaving out {len(too_long)} questions whose turns and answers could outgrow the model's context "
              f"of {context_length(model)} tokens: {', '.join(map(str, too_long))}", file=sys.stderr)
    if not questions and not too_long:
        raise ValueError("no questions to benchmark")
    if not questions:
        raise ValueError(f"no question fits the model's context of {context_length(model)} tokens with "
                         f"{args.max_new_tokens} new tokens a turn; lower --max-new-tokens")
    return questions, too_long


def benchmark(model, questions: list[dict], args: argparse.Namespace,
              progress: Callable[[str], None] = lambda s: None, started: float | None = None,
              runner: "Runner | None" = None) -> dict[str, Any]:
    """Run every method on every question (interleaved) and return the report dictionary.

    With ``args.batch_size`` B > 1 the questions go in groups of B (in order), and for each method
    and turn index the group's rows that have that turn are decoded as one batch. With
    ``args.time_budget`` (seconds since ``started``, a ``time.perf_counter()`` value; default: this
    call) no group but the first starts after the budget is spent. ``runner``: the ``Runner`` to answer
    with (default: a new one, which loads ``args.draft_model``). A method that fails (out of memory on a
    long turn, say) after a group has been measured stops the benchmark there: the report holds the groups
    measured in full, and ``settings["stopped_by"]`` names the error (raised where no group was).
    """
    from medusa_infer.cpu_kernels import kernel_plans, linear_kernels

    started = time.perf_counter() if started is None else started
    methods = list(args.methods)
    check_batch_size(methods, args.batch_size)
    runner = Runner(model, args) if runner is None else runner
    questions, too_long = usable_questions(model, questions, args)
    if args.time_budget is not None:
        questions = interleave_categories(questions)
    warm_up(runner, methods, questions, args.batch_size, min(8, args.max_new_tokens))  # within the context checked
    runner.step_costs.clear()  # what the untimed warm-up steps taught is left out of the report
    runner.gates.clear()
    planned = len(questions)
    totals: dict[str, MethodTotals] = {m: MethodTotals() for m in methods}
    per_category: dict[str, dict[str, MethodTotals]] = defaultdict(lambda: {m: MethodTotals() for m in methods})
    answers: dict[str, list[list[int]]] = {m: [] for m in methods}
    answer_categories: list[str] = []  # the category of each answer, in the order answers hold them
    groups: list[dict[str, Any]] = []  # per group of questions (a batch; one question at batch size 1): its
    # ids and, per method, the tokens and the seconds of its turns, measured for the group as a whole
    from tqdm import tqdm

    stopped_by = None
    bar = tqdm(total=planned, desc="benchmark", unit="question", file=sys.stderr)
    for first in range(0, planned, args.batch_size):
        if first and args.time_budget is not None and time.perf_counter() - started > args.time_budget:
            print(f"\ntime budget of {args.time_budget:g} s spent: stopping after {first} of {planned} questions",
                  file=sys.stderr)
            questions = questions[:first]
            break
        group = questions[first : first + args.batch_size]
        try:
            answered = answer_group(runner, group, methods[len(groups) % len(methods):]
                                    + methods[:len(groups) % len(methods)])
        except Exception as error:  # (Ctrl-C and exits pass): the groups measured are kept
            if not groups:
                raise
            stopped_by = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")
            # which method failed on which questions: the report named neither (only stderr did)
            stopped_by = (f"{method_of(error)} on question(s) {', '.join(str(q['id']) for q in group)}: "
                          f"{stopped_by}")
            traceback.print_exception(error, file=sys.stderr)  # (a bug in a method, not only out of memory)
            print(f"\nfailed ({stopped_by}): stopping after {first} of {planned} questions, "
                  "reporting those", file=sys.stderr)
            questions = questions[:first]
            break
        measured = {"questions": [q["id"] for q in group], "tokens": {}, "seconds": {}}
        groups.append(measured)
        for index in range(max(len(q["turns"]) for q in group)):  # answers' order: by turn, then row
            answer_categories += [q["category"] for q in group if index < len(q["turns"])]
        for method, i, turn in answered:
            measured["tokens"][method] = measured["tokens"].get(method, 0) + len(turn.tokens)
            measured["seconds"][method] = measured["seconds"].get(method, 0.0) + turn.seconds
            totals[method].add(turn)
            per_category[group[i]["category"]][method].add(turn)
            answers[method].append(turn.tokens)
        bar.update(len(group))
        bar.set_postfix({m: f"{t.tokens / t.seconds:.1f}" for m, t in totals.items() if t.seconds})
    bar.close()
    reference = _reference(methods)
    for method in methods:
        if method in SAMPLING_METHODS or reference is None:
            continue
        for ours, theirs, category in zip(answers[method], answers[reference], answer_categories):
            for group_totals in (totals[method], per_category[category][method]):
                group_totals.compared += 1
                group_totals.identical += ours == theirs

    def summarise(group: dict[str, MethodTotals]) -> dict[str, Any]:
        base = group["hf"].tokens / group["hf"].seconds if "hf" in group and group["hf"].seconds else None
        return {m: t.summary(base) for m, t in group.items()}

    overall = summarise(totals)
    for method, interval in speedup_intervals(groups, methods).items():
        overall[method]["speedup_ci95"] = interval
    # what ran: heads without a calibration run no fallback whatever the flag (the report said fallback: true)
    fallback = bool(args.fallback and any(m.startswith("medusa") for m in methods) and runner.adaptive)
    # settings no method ran with are None (recorded, they read as applied: the heads' tree beside hf and ar)
    gated = args.batch_size > 1 and any(m in OUR_METHODS and m != "ar" and m not in SAMPLING_METHODS for m in methods)
    profiled = searches_datastore(methods) and model.heads is not None and bool(model.config.cost_profile)

    return {
        "settings": {
            "model": args.model, "heads": args.heads, "questions": str(args.questions), "limit": args.limit,
            "turns": sum(len(q["turns"]) for q in questions), "max_new_tokens": args.max_new_tokens,
            "batch_size": args.batch_size, "speculation_gate": args.speculation_gate if gated else None,
            "step_costs": args.step_costs if fallback else None, "fallback": fallback,
            "lookup_tokens": args.lookup_tokens, "lookup_max_tokens": args.lookup_max_tokens if profiled else None,
            "datastore_tokens": len(model.datastore) if args.datastore and model.datastore is not None
            and searches_datastore(args.methods) else 0,
            "time_budget_s": args.time_budget, "questions_answered": len(questions), "stopped_by": stopped_by,
            "questions_left_out_for_context": too_long,
            "device": str(model.device), "dtype": str(model.dtype).replace("torch.", ""), "cpu": cpu_name(),
            "linear_kernels": linear_kernels(model.base_model),
            "attention": model.base_model.config._attn_implementation,
            "kernel_plans": {shape: plan.to_dict() for shape, plan in kernel_plans(model.base_model).items()},
            "torch_threads": torch.get_num_threads(), "methods": methods, "method_order": "rotated per group",
            "tree": _tree_note(model, args.tree) if any(m.startswith("medusa") for m in methods) else None,
            # what exact compares with (its own exact: true) and speedup divides by; None: not measured
            "exact_reference": reference, "speedup_baseline": "hf" if "hf" in methods else None,
            # which questions, drawn how, with what: enough to run the same benchmark again
            "question_ids": [q["id"] for q in questions], "seed": args.seed,
            "system_prompt": getattr(args, "system_prompt", None),
            "draft_model": getattr(args, "draft_model", None),
            "temperature": getattr(args, "temperature", None) if any(m in SAMPLING_METHODS for m in methods)
            else None,
            "versions": software_versions(),
            # at batch size > 1 a batch's seconds are shared among its rows by their tokens: the categories'
            # speeds are apportioned, not measured (their tau is their own)
            "category_speed": "measured" if args.batch_size == 1 else "apportioned by tokens within each batch",
            # what tau counts (reports before commit c190c01 counted target forwards: scripts/retau.py)
            "tau_definition": TAU_DEFINITION,
        },
        "methods": overall,
        "categories": {cat: summarise(group) for cat, group in sorted(per_category.items())},
        "groups": [{**g, "seconds": {m: round(s, 4) for m, s in g["seconds"].items()}} for g in groups],
        "step_costs": {method: costs.summary() for method, costs in runner.step_costs.items()},
    }


def answer_group(runner: "Runner", group: list[dict], methods: Sequence[str]) -> list[tuple[str, int, Any]]:
    """Every method's answers to every turn of ``group`` (its questions as one batch per turn index), in
    ``methods``' order, as ``(method, row, turn)``: by method, then turn, then row. An error is raised with
    the failing method's name as its ``benchmark_method`` attribute (``method_of``)."""
    answered = []
    for method in methods:
        conversations: list[list[dict]] = [[] for _ in group]
        for index in range(max(len(q["turns"]) for q in group)):
            rows = [i for i, q in enumerate(group) if index < len(q["turns"])]
            for i in rows:
                conversations[i].append({"role": "user", "content": group[i]["turns"][index]})
            try:
                turns = runner.run_batch(method, [conversations[i] for i in rows])
            except Exception as error:
                with contextlib.suppress(AttributeError):  # (an exception type without a __dict__)
                    error.benchmark_method = method
                raise
            for i, turn in zip(rows, turns):
                answered.append((method, i, turn))
                conversations[i].append({"role": "assistant",
                                         "content": runner.tokenizer.decode(turn.tokens, skip_special_tokens=True)})
    return answered


def method_of(error: BaseException) -> str:
    """The method ``answer_group`` says ``error`` came from, in words."""
    method = getattr(error, "benchmark_method", None)
    return f"method {method}" if method else "a method"


BOOTSTRAP_SAMPLES = 2000
MIN_INTERVAL_GROUPS = 25
"""Groups of questions below which no speedup interval is given: a bootstrap of n groups never reaches past
their own ratios, and covers the truth far less often than 95% (about 50% of the time for 2 groups, 80% for
5, 90% for 10, 89% for 15; 94% for 26, measured with a known speedup). It was 10, and the report called
those intervals 95% ones."""


def speedup_intervals(groups: list[dict[str, Any]], methods: Sequence[str], samples: int = BOOTSTRAP_SAMPLES,
                      seed: int = 0, min_groups: int | None = None) -> dict[str, list[float]]:
    """Per method, a 95% bootstrap interval of its speedup over ``hf`` (the ratio of total tokens per
    second, as reported): the groups of questions (``benchmark``'s ``groups``: one question at batch size
    1) drawn again with replacement, each method's and ``hf``'s times of a group kept together (paired).
    Every group every method ran on is drawn from; a draw whose speedup is undefined (no ``hf`` token, or
    no second, in all it drew: a few groups with an empty ``hf`` answer) is drawn again, and where most are
    (no interval to tell) there is none. Empty without ``hf`` or with fewer than ``min_groups`` groups
    (None: ``MIN_INTERVAL_GROUPS``)."""
    min_groups = MIN_INTERVAL_GROUPS if min_groups is None else min_groups
    usable = [g for g in groups if all(m in g["seconds"] for m in methods)]
    if "hf" not in methods or len(usable) < max(2, min_groups):
        return {}
    draw = random.Random(seed)
    ratios: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(samples * 2):
        if len(ratios["hf"]) == samples:
            break
        picked = [usable[draw.randrange(len(usable))] for _ in usable]
        tokens = {m: sum(g["tokens"][m] for g in picked) for m in methods}
        seconds = {m: sum(g["seconds"][m] for g in picked) for m in methods}
        if not tokens["hf"] or not all(seconds.values()):  # (a NaN ratio left the sorted draws unordered)
            continue
        for m in methods:
            ratios[m].append(tokens[m] / seconds[m] / (tokens["hf"] / seconds["hf"]))
    if len(ratios["hf"]) < samples:
        return {}
    intervals = {}
    for m, values in ratios.items():
        values.sort()
        intervals[m] = [round(values[int(0.025 * (samples - 1))], 3), round(values[int(0.975 * (samples - 1))], 3)]
    return intervals


def software_versions() -> dict[str, str | None]:
    """PyTorch's, transformers' and this project's version, and the commit of the checkout it runs from
    (``-dirty`` with changes not committed; None where it is not run from its own checkout: installed into
    a folder inside another repository, the commit was that repository's)."""
    import importlib.metadata
    import subprocess

    import transformers

    root = Path(__file__).resolve().parents[1]

    def git(*arguments: str) -> str | None:
        try:
            done = subprocess.run(["git", *arguments], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() or None if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    own = top is not None and Path(top).resolve() == root and (root / "pyproject.toml").is_file()
    try:
        version = importlib.metadata.version("medusa-forge")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"torch": torch.__version__, "transformers": transformers.__version__, "medusa_forge": version,
            "commit": _checkout_commit(git) if own else None}


def _checkout_commit(git: Callable[..., str | None]) -> str | None:
    """HEAD's short id, ``-dirty`` where tracked files differ from it."""
    head = git("rev-parse", "--short=7", "HEAD")
    changed = git("status", "--porcelain", "--untracked-files=no")
    return None if head is None else head + ("-dirty" if changed else "")


TAU_DEFINITION = "tokens per decoding step, the prefill's token no step's"
"""``settings.tau_definition`` of a report: how its tau counts (``scripts/retau.py`` converts older ones)."""


def searches_datastore(methods: Sequence[str]) -> bool:
    """Whether any of ``methods`` searches the heads' datastore (ours with lookup drafts)."""
    return any(m in ("lookup", "medusa-lookup") for m in methods)


def warm_up(runner: Runner, methods: Sequence[str], questions: list[dict], batch_size: int,
            max_new_tokens: int = 8) -> None:
    """Each method answers the first question's first turn once, ``batch_size`` times over, untimed,
    so that one-time costs (CUDA context, library handles, kernel loading, on a CPU the first pass
    through each kernel and the packing of weights) do not land on the first method measured. Every
    packed copy the CPU kernels' plans name is made first (``pack_planned``): one short answer meets few
    of the row counts the methods' trees, drafts and other prompts give, and over a run they meet nearly
    all (a plan's kernel that no product of the run takes costs a copy of its weights all the same)."""
    from medusa_infer.cpu_kernels import pack_planned

    if not questions:
        return
    for model in (runner.model, runner.assistant):
        if model is not None:
            pack_planned(model)
    batch = [[{"role": "user", "content": questions[0]["turns"][0]}]] * batch_size
    for method in methods:
        try:
            runner.run_batch(method, batch, max_new_tokens=max_new_tokens)
        except Exception as error:  # named as answer_group's are (a method failing on every input fails here)
            with contextlib.suppress(AttributeError):
                error.benchmark_method = method
            raise


def interleave_categories(questions: list[dict]) -> list[dict]:
    """The questions round robin across categories (each category in its own order), so that every
    prefix covers the categories evenly."""
    by_category: dict[str, list[dict]] = defaultdict(list)
    for question in questions:
        by_category[question["category"]].append(question)
    queues = list(by_category.values())
    longest = max((len(q) for q in queues), default=0)
    return [queue[i] for i in range(longest) for queue in queues if i < len(queue)]


MAX_BATCH_SIZE = 4096
"""The largest ``--batch-size`` taken (Spec-Bench holds 480 questions; the warm-up decodes this many rows)."""


def check_batch_size(methods: Sequence[str], batch_size: int) -> None:
    """Raise ``ValueError`` unless every method can run at ``batch_size``."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    if batch_size > MAX_BATCH_SIZE:  # (an OverflowError traceback past 2**63, warming up)
        raise ValueError(f"--batch-size must be at most {MAX_BATCH_SIZE} (rows decoded as one batch), got {batch_size}")
    unbatched = [m for m in methods if m in UNBATCHED_METHODS]
    if batch_size > 1 and unbatched:
        raise ValueError(f"method(s) {', '.join(unbatched)} cannot run at --batch-size {batch_size}: Hugging Face's "
                         f"assisted generation supports batch size 1 only; drop {', '.join(unbatched)} from "
                         f"--methods or use --batch-size 1")


def _tree_note(model, tree) -> Any:
    """The tree the medusa methods start from, as paths (``fitted-N`` and presets resolved)."""
    from medusa_infer.decoding import resolve_tree

    if model.heads is None:
        return None
    return [list(path) for path in resolve_tree(model, tree)]


def _kernels_note(kernels: str | None) -> str:
    if not kernels or kernels == "default":
        return ""
    if kernels in ("onednn", "onednn for every row count"):  # "onednn": reports before the plans
        return " (oneDNN linear kernels)"
    if kernels == "tuned":
        return " (linear kernels measured per weight shape and row count, see kernel_plans in report.json)"
    return f" (linear kernels: {kernels})"


def _left_out_note(left_out: dict[str, Any] | None) -> str:
    """The report's sentence on the questions left out before the draw (``settings.left_out_ids``)."""
    if not left_out:
        return ""
    parts = []
    if left_out.get("calibration"):
        parts.append(f"the {len(left_out['calibration'])} the heads were calibrated on"
                     + (" in this run" if left_out.get("calibrated_here") else "")
                     + f" ({', '.join(map(str, left_out['calibration']))})")
    if left_out.get("exclude_ids"):
        parts.append(f"--exclude-ids {','.join(map(str, left_out['exclude_ids']))}")
    return f" Drawn from the file's questions but {' and '.join(parts)}." if parts else ""


def report_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        f"# medusa-bench: {s['model']}" + (f" + {s['heads']}" if s["heads"] else ""),
        "",
        f"{s['turns']} turns from {s['questions']} (limit {s['limit']}), max {s['max_new_tokens']} new tokens, "
        f"{s['device']} {s['dtype']}" + (f" on {s['cpu']}" if s.get("cpu") and s["device"] == "cpu" else "")
        + _kernels_note(s.get("linear_kernels"))
        + (f", attention {s['attention']}" if s.get("attention") else "")
        + f", {s['torch_threads']} threads"
        + (f", batch size {s['batch_size']}." if s.get("batch_size", 1) > 1 else ".")
        + (f" Time budget {s['time_budget_s']:g} s: {s['questions_answered']} questions answered."
           if s.get("time_budget_s") is not None else "")
        + (f" Stopped by an error ({s['stopped_by']}) after {s['questions_answered']} questions: these figures "
           "are theirs." if s.get("stopped_by") else "")
        + (f" Left out, as their turns could outgrow the model's context: questions "
           f"{', '.join(map(str, s['questions_left_out_for_context']))}."
           if s.get("questions_left_out_for_context") else "")
        + _left_out_note(s.get("left_out_ids")),
        "",
        f"| method | tokens/s | {_speedup_title(report)} | tau | exact | TTFT s | TPOT s | peak MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method, r in report["methods"].items():
        interval = r.get("speedup_ci95")
        speedup = _fmt(r["speedup"]) + (f" ({interval[0]:.3f}-{interval[1]:.3f})" if interval else "")
        lines.append(f"| {method} | {r['tokens_per_s']:.2f} | {speedup} | {_tau(r['tau'])} | "
                     f"{_exact_cell(r)} | {_fmt(r['ttft_s'])} | {_fmt(r['tpot_s'])} | {r['peak_mem_mb']:.0f} |")
    reference = _reference(list(report["methods"]))
    lines += ["", (f"exact: greedy answers identical to {reference}'s, turn by turn (sampling methods: -)."
                   if reference else "exact: not measured (neither ar nor hf ran, whose greedy answers are the "
                   "reference).") + ("" if "hf" in report["methods"] else " speedup: not measured (hf, its "
                                     "baseline, did not run).")
              + " peak MB: the process's peak memory during the method's turns (resident on a CPU, allocated on a "
                "GPU), the model's and what earlier methods left allocated included."
              + (" In brackets after a speedup: its 95% bootstrap interval over the questions"
                 + (" (batches of them)" if s.get("batch_size", 1) > 1 else "") + ", each method's time of a "
                 "question paired with hf's." if any(r.get("speedup_ci95") for r in report["methods"].values())
                 else f" No interval for the speedups: {len(report.get('groups', []))} groups of questions, fewer "
                      f"than the {MIN_INTERVAL_GROUPS} a bootstrap interval needs to mean 95%."
                 if "hf" in report["methods"] and 1 < len(report.get("groups", [])) < MIN_INTERVAL_GROUPS else "")]
    if s["dtype"] != "float32" and any(r["exact"] is False for r in report["methods"].values()):
        lines += ["", f"In {s['dtype']} a forward of "
                  "several tokens rounds differently from one of a single token (and a padded batch from one row), "
                  "so greedy outputs can part where two tokens nearly tie, and the later turns of that conversation "
                  "then differ too; tests/test_cuda.py checks, with tiny models on a GPU, that they part only at "
                  "near-ties. In float32 they are identical."]
    methods = list(report["methods"])
    lines += ["", f"## {_speedup_title(report).capitalize()} by category (tau in brackets)", ""]
    if s.get("batch_size", 1) > 1:  # a category's rows share their batches' seconds with other categories' rows
        lines += [f"At batch size {s['batch_size']} a batch's seconds are shared among its rows by their tokens: "
                  "these speedups are apportioned, not measured per category (each category's tau is its own).", ""]
    lines += ["| category | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for cat, group in report["categories"].items():
        cells = [f"{_fmt(group[m]['speedup'])} ({_tau(group[m]['tau'])})" for m in methods]
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    learned = {m: pairs for m, pairs in report.get("step_costs", {}).items() if pairs}
    if learned:
        lines += ["", "## Cost ratios the adaptive fallback measured (batch 1, neighbouring trees)", "",
                  "| method | tokens verified | measured | profile | samples |", "|---|---|---|---|---|"]
        for method, pairs in learned.items():
            lines += [f"| {method} | {pair} | {v['ratio']:.3f} | {_fmt(v['profile'])} | {v['samples']} |"
                      for pair, v in pairs.items()]
    return "\n".join(lines) + "\n"


def _speedup_title(report: dict[str, Any]) -> str:
    return "speedup vs hf" if "hf" in report["methods"] else "speedup (no hf run)"


def _exact_cell(row: dict[str, Any]) -> str:
    if row["exact"] is False and row.get("identical_turns") is not None:
        return f"NO ({row['identical_turns']}/{row['turns']} turns)"
    return _fmt(row["exact"])


def _reference(methods: Sequence[str]) -> str | None:
    """The method whose greedy answers the others must equal: our plain loop, else ``generate``."""
    return "ar" if "ar" in methods else ("hf" if "hf" in methods else None)


def _tau(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if 0 < abs(value) < 0.1:  # a GPU's seconds a token: three significant digits (0.000 said nothing)
            return f"{value:.3g}"
        return f"{value:.3f}" if value < 10 else f"{value:.1f}"
    return str(value)


def plot_groups(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The bar groups of ``report.png``, labelled: all questions, then each category (a category named
    "all" is labelled "category all": it replaced the overall figures)."""
    return [("all", report["methods"])] + [("category all" if category == "all" else category, rows)
                                           for category, rows in report["categories"].items()]


def report_png(report: dict[str, Any], path: Path) -> bool:
    """Tokens/s and tau per method, overall and per category; False (and a line on stderr) where
    matplotlib, the ``plot`` extra, is not installed."""
    try:
        import matplotlib
    except ImportError:
        print(f"medusa-bench: {path} not drawn: it needs matplotlib: pip install 'medusa-forge[plot]'",
              file=sys.stderr)
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(report["methods"])
    groups = plot_groups(report)
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 1.4 * len(groups)), 4.5))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        xs = [g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        axes[0].bar(xs, [rows[method]["tokens_per_s"] for _, rows in groups], width, label=method)
        # (NaN: no bar where no step was measured; 0 drew one below plain decoding's 1)
        axes[1].bar(xs, [_or(rows[method]["tau"], math.nan) for _, rows in groups], width, label=method)
    for ax, title in zip(axes, ("tokens/s", "tau (tokens per decoding step)")):
        ax.set_xticks(range(len(groups)), [label for label, _ in groups], rotation=30, ha="right")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    s = report["settings"]
    batch = f", batch size {s['batch_size']}" if s.get("batch_size", 1) > 1 else ""
    fig.suptitle(f"{s['model']} on {s['device']} {s['dtype']}, {s['turns']} turns{batch}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def stored_heads_state(model, heads: str | Path) -> dict[str, torch.Tensor]:
    """The heads' weights as ``heads`` (a folder, ours or the FasterDecoding layout) stores them, in
    our naming: what a calibration saves, not the weights rounded to the model's ``--dtype``."""
    if is_medusa_layout(heads):
        # with the base's lm_head, as from_pretrained read them: a version-1 export's copies of it are shared
        # heads again (read without it, they were heads of their own, which the loaded config refused)
        lm_head = model.base_model.get_output_embeddings()
        return read_medusa_layout(heads, hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size,
                                  lm_head_weight=lm_head.weight, lm_head_bias=getattr(lm_head, "bias", None))[1]
    return load_heads_state(heads)[1]


def calibrate(model, questions: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    """Measure the heads' top-k accuracy on greedy answers to ``questions`` and this device's
    verification cost; fit the tree; store all three in the heads' config (and folder). Each candidate
    tree's expected tau is greedy decoding walked over those answers (``evaluate.walked_tokens_per_step``, as
    training's held-out figure: the average over every position runs high), its expected speedup that tau
    over the tree's cost; the fit keeps the fastest (plain decoding where none beats it)."""
    from medusa_infer.tree_fit import (LONG_CONTEXT_SIZES, check_cost_context, fit_tree, long_context,
                                       measure_verify_cost)

    if model.heads is None:
        raise ValueError("calibrate() needs a model with heads (medusa-bench --calibrate --heads FOLDER)")
    check_cost_context(model, args.calibrate_context)  # before the answers, which take the time
    longer = args.calibrate_long_context
    longer = long_context(model, args.calibrate_context) if longer is None else longer or None
    if longer is not None:
        if longer <= args.calibrate_context:
            raise ValueError(f"--calibrate-long-context {longer} must exceed --calibrate-context "
                             f"{args.calibrate_context}, or be 0 (no long context measured)")
        check_cost_context(model, longer, LONG_CONTEXT_SIZES, "--calibrate-long-context, or 0 for none")
    sequences = first_turn_answers(model, questions, args.max_new_tokens, getattr(args, "system_prompt", None))
    accuracy = head_topk_accuracy(model, sequences, top_k=model.config.top_k)
    paths = accuracy.paths()
    cost = measure_verify_cost(model, context=args.calibrate_context, long_context=longer)
    cost.head_seconds = measure_head_seconds(model)
    # each candidate's tau walked over the answers, as decoding walks them (the fit's default, the average over
    # positions, runs high: a tree it kept could walk slower than plain decoding)
    fitted = fit_tree(paths, cost, tau=lambda tree: walked_tokens_per_step(tree, accuracy))
    config = model.config
    # training's held-out accuracies, kept beside these; an earlier calibration's (on heads imported or
    # never trained) are no training record, and are replaced
    trained = "head_accuracies_measured_on" not in (config.acceptance or {}) and not config.cost_profile  # (only
    # calibration writes a profile: one of an earlier release, which wrote no marker, is no training record)
    if trained and config.head_accuracies and "heldout_head_accuracies" not in config.training:
        config.training["heldout_head_accuracies"] = config.head_accuracies
    if trained and config.path_accuracies and "heldout_path_accuracies" not in config.training:
        config.training["heldout_path_accuracies"] = config.path_accuracies
    config.head_accuracies = accuracy.topk()
    config.path_accuracies = [[list(path), prob] for path, prob in paths.items()]
    kept = {key: value for key, value in (config.acceptance or {}).items()
            if key != "expected_tokens_per_step_fitted_tree"}  # training's tree's, which this one replaces
    # a pipe's name, "63" of every <(...), names no questions: none recorded
    source = None if _is_pipe(args.questions) else Path(args.questions).name
    config.acceptance = {**kept,
                         "head_accuracies_measured_on": f"greedy answers to {len(questions)} questions "
                                                        + (f"from {source}" if source else "read from a pipe")
                                                        + (f", opened by the system prompt {args.system_prompt!r}"
                                                           if getattr(args, "system_prompt", None) is not None
                                                           else ""),
                         # left out of later benchmarks of these heads on that file (main)
                         "calibration_questions": {"file": source,
                                                   "ids": [q["id"] for q in questions]},
                         "calibrated_tree_nodes": len(fitted.paths),
                         "calibrated_expected_tau": round(fitted.expected_tau, 4),
                         "calibrated_expected_speedup": round(fitted.expected_speedup, 4)}
    config.cost_profile = cost.to_dict()
    config.tree = [list(p) for p in fitted.paths]  # empty: plain decoding measured fastest (None: a default preset)
    return {"head_accuracies": config.head_accuracies, "cost_profile": config.cost_profile,
            "tree_nodes": len(fitted.paths), "expected_tau": fitted.expected_tau,
            "expected_speedup": fitted.expected_speedup, "table": fitted.table}


def calibration_question_ids(model, questions_file: str | Path) -> list[Any]:
    """The ids of the questions of ``questions_file`` (by name) that ``model``'s heads were calibrated on
    (``calibrate``); [] for heads calibrated elsewhere, on other questions, or not at all."""
    found = ((model.config.acceptance or {}).get("calibration_questions") or {}) if model.heads is not None else {}
    if not isinstance(found, dict) or not isinstance(found.get("ids") or [], list):  # a record edited by hand
        raise ValueError(f"the heads' acceptance.calibration_questions is {found!r:.120}, not a record of a "
                         "questions file and its ids as calibration writes it: fix or remove it in their config.json")
    same = found.get("file") is not None and found.get("file") == Path(questions_file).name
    return list(found.get("ids") or []) if same and not _is_pipe(questions_file) else []


def _is_pipe(path: str | Path) -> bool:
    """Whether ``path`` is there and no regular file (a pipe, ``<(...)``, ``/dev/stdin``)."""
    return Path(path).exists() and not Path(path).is_file()


def first_turn_answers(model, questions: Sequence[dict], max_new_tokens: int, system_prompt: str | None = None
                       ) -> list[tuple[torch.Tensor, int]]:
    """The model's greedy answer to each question's first turn (after ``system_prompt``'s message, if any), as
    ``(prompt and answer ids, prompt length)``: what calibration measures the heads on, with a progress bar on
    stderr. ``model`` needs
    heads (any: the heads only run on a one-node chain, every token is the base model's greedy choice
    as the verification forward computes it)."""
    from tqdm import tqdm

    from medusa_infer.chat import chat_prompt_ids
    from medusa_infer.decoding import generate

    sequences = []
    for question in tqdm(questions, desc="first-turn answers", unit="question", file=sys.stderr, leave=False):
        chat = system_turn(system_prompt) + [{"role": "user", "content": question["turns"][0]}]
        ids = torch.tensor([chat_prompt_ids(model.tokenizer, chat)[0]])
        out = generate(model, ids, max_new_tokens=max_new_tokens, tree="chain-1", adaptive=False)
        sequences.append((out.sequences[0], ids.shape[1]))
    return sequences


@torch.inference_mode()
def head_topk_accuracy(model, sequences: list[tuple[torch.Tensor, int]], top_k: int = 10) -> HeadAccuracy:
    """How the heads rank the token ``d + 2`` ahead over the generated part of each ``(sequence
    [seq], prompt_length)``, measured as training's held-out evaluation measures it (cumulative
    top-k accuracies and, per position, each head's rank of its target). The heads run where
    decoding runs them: from the last prompt token on, each reading the token that follows and,
    with ``path_input``, the true tokens before its own (teacher forcing: the path of the only
    nodes whose children can be accepted)."""
    from medusa_train.features import head_targets, path_tokens
    from medusa_train.losses import IGNORE, to_head_vocab

    batches = []
    for seq, start in sequences:
        seq = seq.to(model.device)
        hidden = model(seq[None], logits_positions=slice(0, 0)).hidden_states[0]
        following = torch.cat([seq[1:], seq[-1:]])  # the token at t + 1 (the last one is never scored)
        true_targets = head_targets(seq, model.config.num_heads)
        targets = to_head_vocab(true_targets, model.heads.token_map, model.config.vocab_size)
        first = max(start - 1, 0)  # the last prompt token: where decoding first runs the heads
        starts = torch.zeros(len(seq) - first, dtype=torch.bool)
        starts[0] = True  # each answer one run of consecutive positions (walked_tokens_per_step)
        batches.append({"hidden": hidden[first:], "targets": targets[first:], "next_tokens": following[first:],
                        "path_tokens": path_tokens(true_targets[first:]), "run_start": starts})
    if not any(bool((b["targets"][:, 0] != IGNORE).any()) for b in batches):
        raise ValueError("no generated tokens to measure the heads on: raise --max-new-tokens")
    return head_accuracy(model.head_logits, batches, top_k, device=model.device)


@torch.inference_mode()
def measure_head_seconds(model, repeats: int = 20) -> list[float]:
    """Median seconds of running the first ``d`` heads and their top-k at one position, at index
    ``d - 1`` (``CostProfile.head_seconds``): a tree of depth ``d`` runs only those. The depths
    are interleaved within each repeat, so a noisy machine slows them alike, and a running maximum
    keeps a deeper tree from measuring cheaper than a shallower one.

    Heads that read their path (``path_input``) are timed along the greedy path, one position per
    head; a tree runs each of them over all its parents at that level, so a wide tree's heads cost
    somewhat more than this (on a CPU a few more rows through an already-running head)."""
    generator = torch.Generator().manual_seed(0)  # the global one seeds the sampled methods after calibration
    hidden = torch.randn(1, model.lm_head.weight.shape[1], generator=generator).to(model.device, model.dtype)
    root = torch.zeros(1, dtype=torch.long, device=model.device)  # decoding passes its root token
    depths = range(1, model.config.num_heads + 1)
    times: dict[int, list[float]] = {d: [] for d in depths}
    for repeat in range(repeats + 1):  # the first round warms up and is discarded
        for depth in depths:
            _sync(model.device)
            start = time.perf_counter()
            model.head_logits(hidden, root, first=depth).topk(model.config.top_k, dim=-1)
            _sync(model.device)
            if repeat:
                times[depth].append(time.perf_counter() - start)
    return list(itertools.accumulate((statistics.median(times[d]) for d in depths), max))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="medusa-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="base model (default: the heads' base, else smollm2-135m-instruct)")
    parser.add_argument("--heads", help="Medusa heads folder or Hub repo (needed by the medusa methods)")
    parser.add_argument("--questions", required=True, help="Spec-Bench-format JSONL (id, category, turns)")
    parser.add_argument("--limit", type=int, default=None, help="questions to use, balanced across categories")
    parser.add_argument("--exclude-ids", default="", help="comma-separated question ids to leave out")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--system-prompt", default=None, metavar="TEXT",
                        help="a system message opening every conversation, calibration's too (default: none, the "
                             "chat template's own; heads trained with data.system_prompt match their training data "
                             "best with it: their model card names it)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="questions answered together, turn by turn, as one left-padded batch "
                             f"(not with {', '.join(UNBATCHED_METHODS)})")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="start no new question this many seconds after starting, loading and calibration "
                             "included (the report covers the questions answered, taken round robin across "
                             "categories)")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help=f"comma-separated, from: {', '.join(ALL_METHODS)}")
    parser.add_argument("--draft-model", help="draft model for hf-assisted and draft")
    parser.add_argument("--tree", help="tree preset, fitted-N (the N-node tree fitted to the heads' measured "
                                       "accuracies, whatever this device's costs) or JSON list of paths "
                                       "(default: the heads' own)")
    parser.add_argument("--no-fallback", dest="fallback", action="store_false",
                        help="the medusa methods keep their tree at every step: no adaptive fallback, even on "
                             "calibrated heads (for tau at a fixed tree; with --batch-size > 1 add "
                             "--speculation-gate off)")
    parser.add_argument("--lookup-tokens", type=int, default=None,
                        help="tokens a prompt-lookup draft proposes, for hf-lookup (prompt_lookup_num_tokens), "
                             "lookup and medusa-lookup (the grafted chain) alike; default: 10 for hf-lookup, 4 for "
                             "the other two. With a cost profile, lookup and medusa-lookup choose each draft's "
                             "length up to --lookup-max-tokens instead")
    parser.add_argument("--lookup-max-tokens", type=int, default=None,
                        help="lookup and medusa-lookup: the longest draft the heads' cost profile may choose")
    parser.add_argument("--no-datastore", dest="datastore", action="store_false",
                        help="lookup and medusa-lookup search only the prompt and output, not the heads' "
                             "datastore of the model's own answers (datastore.safetensors)")
    parser.add_argument("--temperature", type=float, default=None, help="for the sampling methods (default 0.7)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the sampling methods' seed; also which questions --limit and --calibrate take (a "
                             "run with another seed answers other questions)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--cpu-kernels", default="tuned", choices=("tuned", "onednn", "default"),
                        help="float32 on the CPU, for every method: per number of rows, the linear kernel measured "
                             "fastest here (tuned, the default), oneDNN's throughout, or PyTorch's own "
                             "(medusa_infer.cpu_kernels)")
    parser.add_argument("--speculation-gate", default="measured", choices=("measured", "off"),
                        help="with --batch-size > 1, greedy methods take plain steps where speculating measures "
                             "slower at the batch's size (measured, the default), or always speculate (off)")
    parser.add_argument("--step-costs", default="learned", choices=("learned", "profile"),
                        help="greedy medusa methods at batch size 1: the adaptive fallback learns its trees' cost "
                             "ratios from the steps it takes, across questions (learned, the default), or trusts the "
                             "calibration's cost profile alone (profile); see medusa_infer.adaptive.StepCosts")
    parser.add_argument("--output", default="runs/bench", help="folder for report.json, report.md, report.png (default runs/bench)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure head accuracy and verification cost, fit the tree, save it into the heads "
                             "folder (--heads: a local folder in medusa-forge's layout) or --calibrated-heads")
    parser.add_argument("--calibrate-questions", type=int, default=None, help="with --calibrate (default 16)")
    parser.add_argument("--calibrate-context", type=int, default=None,
                        help="with --calibrate: cached tokens before each timed forward (default 256)")
    parser.add_argument("--calibrate-long-context", type=int, default=None,
                        help="with --calibrate: also time forwards over this many cached tokens, so that the adaptive "
                             "fallback prices a step at its own context (default 2048, or as far as the model "
                             "attends; 0: none)")
    parser.add_argument("--calibrated-heads", metavar="DIR",
                        help="with --calibrate: save the calibrated heads (medusa-forge's layout) into DIR instead of "
                             "the --heads folder; needed for --heads in the FasterDecoding layout "
                             "(medusa_lm_head.*), which has no place for the calibration and which other engines "
                             "read, so it is never overwritten")
    args = parser.parse_args(argv)
    refuse_empty(parser, [("--model", args.model, MODEL_INSTEAD), ("--heads", args.heads, HEADS_INSTEAD),
                          ("--draft-model", args.draft_model, DRAFT_INSTEAD),
                          ("--questions", args.questions, "give a Spec-Bench-format JSONL file"),
                          ("--output", args.output, "name a folder for the report, or leave --output out for "
                                                    "runs/bench (. for the working folder)"),
                          ("--calibrated-heads", args.calibrated_heads, "name a folder, or leave "
                                                                        "--calibrated-heads out")])
    # ~ as --heads takes it (--output=~/x, which no shell expands, wrote into a folder named ~ in the working one)
    args.output, args.questions = os.path.expanduser(args.output), os.path.expanduser(args.questions)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.methods:
        parser.error(f"--methods is empty; choose from {', '.join(ALL_METHODS)} (default {','.join(DEFAULT_METHODS)})")
    unknown = [m for m in args.methods if m not in ALL_METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(ALL_METHODS)}")
    repeated = sorted({m for m in args.methods if args.methods.count(m) > 1})
    if repeated:
        parser.error(f"--methods names {', '.join(repeated)} more than once; name each method once")
    for flag, value in (("--limit", args.limit), ("--max-new-tokens", args.max_new_tokens)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if any(m.startswith("medusa") for m in args.methods) and not args.heads:
        parser.error("the medusa methods need --heads")
    try:
        check_batch_size(args.methods, args.batch_size)
    except ValueError as error:
        parser.error(str(error))
    drafted = [m for m in args.methods if m in DRAFT_METHODS]
    if drafted and not args.draft_model:
        parser.error(f"--methods with {' and '.join(drafted)} needs --draft-model (a smaller model with the same "
                     "tokenizer)")
    # settings no method run reads: refused, as --lookup-tokens, --tree and --no-fallback are (the report
    # recorded them as if they had applied, and a --draft-model that does not exist was never opened)
    looked_up = searches_datastore(args.methods)
    for flag, given, read, readers in (
            ("--draft-model", args.draft_model, bool(drafted), DRAFT_METHODS),
            ("--no-datastore", not args.datastore, looked_up, ("lookup", "medusa-lookup")),
            ("--lookup-max-tokens", args.lookup_max_tokens is not None, looked_up, ("lookup", "medusa-lookup")),
            ("--temperature", args.temperature is not None, any(m in SAMPLING_METHODS for m in args.methods),
             SAMPLING_METHODS)):
        if given and not read:
            parser.error(f"{flag} is read by {', '.join(readers)}, and --methods has none of them: add one or drop "
                         f"{flag}")
    if args.step_costs != "learned" and not (args.fallback and {"medusa", "medusa-lookup"} & set(args.methods)):
        parser.error(f"--step-costs {args.step_costs} sets what the adaptive fallback of medusa and medusa-lookup "
                     "learns, and " + ("--no-fallback turns it off" if args.fallback is False else
                                       "--methods has neither") + ": drop it")
    if args.lookup_max_tokens is not None and not args.heads:
        parser.error("--lookup-max-tokens bounds the drafts a cost profile chooses, which calibrated --heads carry, "
                     "and no --heads is given: drop it (without a profile, lookup drafts --lookup-tokens)")
    if not args.datastore and not args.heads:  # (as medusa-generate and medusa-serve refuse it)
        parser.error("--no-datastore leaves out the datastore of a heads folder (its datastore.safetensors), and no "
                     "--heads is given: drop --no-datastore")
    for flag, value in (("--calibrate-questions", args.calibrate_questions),
                        ("--calibrate-context", args.calibrate_context),
                        ("--calibrate-long-context", args.calibrate_long_context)):
        if value is not None and not args.calibrate:
            parser.error(f"{flag} sets the calibration: add --calibrate or drop {flag}")
    args.lookup_max_tokens_given = args.lookup_max_tokens is not None  # (read once the heads are loaded)
    if args.lookup_max_tokens is None:
        args.lookup_max_tokens = LOOKUP_MAX_TOKENS
    if args.temperature is None:
        args.temperature = 0.7
    if args.calibrate and not args.heads:
        parser.error("--calibrate measures the heads and fits their tree: give --heads FOLDER")
    if args.calibrate and not args.calibrated_heads and not Path(args.heads).is_dir():
        parser.error(f"--calibrate writes the fitted tree into the heads folder, and --heads {args.heads} is no "
                     f"local folder (a Hub repo?): add --calibrated-heads DIR to save the calibrated heads there, or "
                     f"download them first (hf download {args.heads} --local-dir DIR) and pass --heads DIR")
    if args.calibrated_heads and not args.calibrate:
        parser.error("--calibrated-heads is where --calibrate saves the heads: add --calibrate or drop it")
    target = ("--calibrated-heads", args.calibrated_heads) if args.calibrated_heads else ("--heads", args.heads)
    if args.calibrate and is_medusa_layout(target[1]):
        parser.error(f"{target[0]} {target[1]} is in the FasterDecoding layout (medusa_lm_head.*), which has no "
                     "place for the calibration and which other engines read: add --calibrated-heads DIR (another "
                     "folder) to save the calibrated heads in medusa-forge's layout there")
    if args.lookup_tokens is not None and args.lookup_tokens < 1:
        parser.error(f"--lookup-tokens must be at least 1, got {args.lookup_tokens}")
    if args.lookup_tokens is not None and not any(m in LOOKUP_METHODS for m in args.methods):
        parser.error(f"--lookup-tokens sets the drafts of {', '.join(LOOKUP_METHODS)}, and --methods has none of "
                     "them: add one or drop --lookup-tokens")
    if args.lookup_max_tokens < 1:
        parser.error(f"--lookup-max-tokens must be at least 1, got {args.lookup_max_tokens}")
    if args.tree and not any(m.startswith("medusa") for m in args.methods):
        parser.error("--tree shapes the medusa methods' candidates, and --methods has none of them: add one or "
                     "drop --tree")
    if not args.fallback and not any(m.startswith("medusa") for m in args.methods):
        parser.error("--no-fallback keeps the medusa methods' trees fixed, and --methods has none of them: add one or "
                     "drop --no-fallback")
    if args.tree and args.tree.startswith("["):
        try:
            paths = json.loads(args.tree)
            if not isinstance(paths, list) or not all(isinstance(p, list) and all(
                    isinstance(i, int) and not isinstance(i, bool) for i in p) for p in paths):
                raise ValueError("not a list of lists of integers")
        except ValueError as error:
            parser.error(f"--tree {args.tree!r} is no tree: give a JSON list of paths, each a list of candidate "
                         f"ranks such as [[0], [1], [0, 0]], or a name (fitted-N, ...) ({error})")
        args.tree = [tuple(p) for p in paths]
    if not (args.temperature > 0 and math.isfinite(args.temperature)):  # NaN too
        parser.error(f"--temperature must be a finite number > 0 (the sampling methods' temperature), got "
                     f"{args.temperature}")
    if args.time_budget is not None and not (args.time_budget > 0 and math.isfinite(args.time_budget)):
        parser.error(f"--time-budget must be a number of seconds > 0, got {args.time_budget}")  # NaN: no budget, written as NaN
    if args.calibrate and isinstance(args.tree, str) and args.tree.startswith("fitted-") and not (
            args.tree[len("fitted-"):].isdigit() and int(args.tree[len("fitted-"):]) >= 1):
        parser.error(f"--tree {args.tree!r}: a fitted tree is fitted-N, N >= 1 nodes")
    for flag, value, least in (("--threads", args.threads, 1), ("--calibrate-questions", args.calibrate_questions, 1),
                               ("--calibrate-context", args.calibrate_context, 1),
                               ("--calibrate-long-context", args.calibrate_long_context, 0)):
        if value is not None and value < least:
            parser.error(f"{flag} must be at least {least}, got {value}")
    if args.threads is not None and args.threads > MAX_THREADS:
        parser.error(f"--threads must be at most {MAX_THREADS}, got {args.threads}")
    args.calibrate_questions = 16 if args.calibrate_questions is None else args.calibrate_questions
    args.calibrate_context = 256 if args.calibrate_context is None else args.calibrate_context
    if args.calibrate_long_context and args.calibrate_long_context <= args.calibrate_context:
        parser.error(f"--calibrate-long-context {args.calibrate_long_context} must exceed --calibrate-context "
                     f"{args.calibrate_context}, or be 0 (no long context measured)")
    if Path(args.output).exists() and not Path(args.output).is_dir():
        parser.error(f"--output {args.output} is a file: give a folder for report.json, report.md and report.png")
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError as error:
            parser.error(f"--device {args.device!r} is no torch device (cpu, cuda, cuda:1, mps, ...): {error}")
        if device.type == "cuda" and not torch.cuda.is_available():
            parser.error(f"--device {args.device}: this machine's PyTorch sees no CUDA device; use --device cpu")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``medusa-bench``; what is found wrong once loading starts (a missing heads folder, heads that
    do not fit the model) is reported as ``medusa-bench: error: ...`` with exit status 2, as argument
    errors are."""
    started = time.perf_counter()
    args = parse_args(argv)
    try:
        return run(args, started)
    except KeyboardInterrupt:  # Ctrl-C: no traceback
        sys.stdout.flush()
        print("\nmedusa-bench: interrupted (a run's report.json is written once all its questions are answered)",
              file=sys.stderr)
        return 130
    except (ValueError, OSError, NotImplementedError) as error:  # NotImplementedError: an unsupported model
        sys.stdout.flush()
        method = getattr(error, "benchmark_method", None)  # (answer_group's: which method failed)
        print(f"medusa-bench: error: {f'method {method}: ' if method else ''}{error}", file=sys.stderr)
        return 2


def check_output_folder(output: Path) -> None:
    """Make ``output`` and check that files can be written there, before any question is answered: ``OSError``
    naming the folder (a read-only one failed once every question was answered)."""
    import tempfile

    output.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.NamedTemporaryFile(dir=output, prefix=".write-check-"):
            pass
    except OSError as err:
        raise OSError(f"--output {output}: no file can be written there ({err.strerror or err}); give a folder "
                      "this user can write") from None


def write_report(report: dict[str, Any], markdown: str, output: Path, calibrated: bool) -> bool:
    """Write ``report.json``, ``report.md`` and ``report.png`` into ``output`` (whether the plot was drawn), leaving
    no earlier run's file beside them. ``OSError`` naming the file that could not be written (a full disk's
    "[Errno 27] File too large" named none), after removing what of it was written."""
    if not calibrated:  # an earlier run's would pass for this one's (removed with this run's report only)
        (output / "calibration.json").unlink(missing_ok=True)
    for earlier in ("report.png", "report.md"):  # an earlier run's, beside this one's report.json if stopped between
        (output / earlier).unlink(missing_ok=True)
    aside = output / "report.json.partial"  # renamed into place: never read half-written
    target = aside
    try:
        aside.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(aside, output / "report.json")
        target = output / "report.md"
        target.write_text(markdown)
        target = output / "report.png"
        drawn = report_png(report, target)
        if not drawn:  # a plot of an earlier run in this folder would pass for this one's
            target.unlink(missing_ok=True)
    except OSError as err:
        with contextlib.suppress(OSError):
            target.unlink(missing_ok=True)  # (half written)
        name = "report.json" if target == aside else target.name
        raise OSError(f"{output / name} could not be written ({err.strerror or err}): the disk may be full; the "
                      "report's table is printed above") from None
    return drawn


def check_profile_flags(model, args: argparse.Namespace) -> None:
    """``ValueError`` for flags that set what calibrated heads' cost profile does, on heads that carry none (they
    were recorded in the report as if they had applied): ``--lookup-max-tokens`` and ``--step-costs profile``."""
    from medusa_infer.decoding import fallback_paths, resolve_tree

    if model.heads is None:
        return
    where = f"the heads in {args.heads} carry no cost profile (not calibrated)"
    if getattr(args, "lookup_max_tokens_given", False) and not model.config.cost_profile:
        raise ValueError(f"--lookup-max-tokens bounds the drafts a cost profile chooses, and {where}: calibrate them "
                         "(--calibrate) or drop it (without a profile, lookup drafts --lookup-tokens)")
    if args.step_costs != "learned" and fallback_paths(model, resolve_tree(model, args.tree), None) is None:
        raise ValueError(f"--step-costs {args.step_costs} sets what the adaptive fallback learns, and no fallback "
                         f"runs on these heads ({where}, or their tree gives none): calibrate them (--calibrate) "
                         "or drop it")


def _benchmark_questions(questions: Sequence[dict], args: argparse.Namespace, exclude: Sequence[Any],
                         calibrated: bool) -> list[dict]:
    """The questions to benchmark (``--limit`` of them, ``exclude`` left out); ``ValueError`` when none is left."""
    picked = pick_questions(questions, args.limit, seed=args.seed, exclude_ids=exclude)
    if not picked:
        left_out = ("--exclude-ids and the calibration's questions" if calibrated and args.exclude_ids.strip() else
                    "the calibration's questions" if calibrated else "--exclude-ids")
        raise ValueError(f"no question of {args.questions} is left to benchmark after {left_out}; "
                         "exclude fewer, or give more questions"
                         + (" (or fewer --calibrate-questions)" if args.calibrate else ""))
    return picked


def run(args: argparse.Namespace, started: float) -> int:
    """Load the model and heads, calibrate if asked, benchmark and write the report."""
    questions = Path(args.questions)
    if not questions.exists() or questions.is_dir():  # else found after loading the model (a pipe passes)
        raise ValueError(f"--questions {args.questions} is not a file; give a Spec-Bench-format JSONL")
    if args.threads:
        torch.set_num_threads(args.threads)
    from medusa_infer.model import MedusaModel, heads_folder
    from medusa_infer.models import load_base_model, load_tokenizer

    # a regular file's questions are checked before any model loads (minutes for a 7B one); a pipe is read once
    early = None if _is_pipe(args.questions) else read_questions(args.questions)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    heads = None
    if args.heads:
        heads = heads_folder(args.heads)  # a folder, or a Hub repo downloaded as from_pretrained does
        base_name = args.model or base_model_name(heads)
        if not base_name:
            raise ValueError(f"{heads}/config.json names no base_model_name_or_path; pass --model")
        base = load_base_model(base_name, dtype=dtype, device=device, cpu_kernels=args.cpu_kernels)
        # read where a method searches it (a store that does not load stopped every method, --no-datastore refused
        # beside those), and where --calibrate saves the heads, which keep what it holds
        model = MedusaModel.from_pretrained(heads, base_model=base, tokenizer=load_tokenizer(base_name),
                                            datastore=(args.datastore and searches_datastore(args.methods))
                                            or args.calibrate)
    else:
        base_name = args.model or "smollm2-135m-instruct"
        model = MedusaModel.without_heads(load_base_model(base_name, dtype=dtype, device=device,
                                                          cpu_kernels=args.cpu_kernels),
                                          tokenizer=load_tokenizer(base_name))
    args.model = base_name
    # before any answer: a template that refuses a system role (Gemma's), or wants one (a traceback at the first)
    if getattr(model.tokenizer, "chat_template", None) is None:
        raise ValueError(f"medusa-bench asks its questions in the chat template, and {base_name}'s tokenizer has "
                         "none: give --heads trained with model.chat_template (the recipe's template comes with "
                         "them), or a model with a chat template")
    from medusa_infer.chat import check_conversation

    check_conversation(model.tokenizer, args.system_prompt, "--system-prompt")
    fitted_later = args.calibrate and isinstance(args.tree, str) and args.tree.startswith("fitted-")
    if args.tree and heads is not None and not fitted_later:
        from medusa_infer.decoding import resolve_tree

        # a bad --tree (fitted-N on unmeasured heads, an unknown preset) fails before any method runs, and before
        # calibrating (a fitted tree needs the calibration's accuracies: checked after it)
        resolve_tree(model, args.tree)
    given_excluded = [x.strip() for x in args.exclude_ids.split(",") if x.strip()]  # as written: "007" is not 7
    exclude = list(given_excluded)
    output = Path(args.output)
    check_output_folder(output)  # (a folder it cannot write failed once every question was answered)
    if args.calibrate:  # the folder calibration saves into, checked before the answers (refused only then)
        model.check_save_target(args.calibrated_heads or heads)
    calibrated_on = calibration_question_ids(model, args.questions)
    if calibrated_on and not args.calibrate:  # their tree and fallback were fitted on these answers
        exclude += calibrated_on
        print(f"leaving out the {len(calibrated_on)} questions of {Path(args.questions).name} these heads were "
              "calibrated on", file=sys.stderr)
    all_questions = early if early is not None else read_questions(args.questions)  # once: it may be a pipe
    if not all_questions:
        raise ValueError(f"{args.questions} holds no question; each line holds one: "
                         '{"id": 1, "category": "writing", "turns": ["first turn", ...]}')
    unknown = sorted(set(given_excluded) - {str(q["id"]) for q in all_questions})
    if unknown:  # a mistyped id left the question meant in, and the report said it was left out
        raise ValueError(f"--exclude-ids names {', '.join(unknown)}, which no question of {args.questions} has "
                         "(ids as the file writes them); check them")
    questions, runner = None, None
    if args.calibrate:
        calib_questions = pick_questions(all_questions, args.calibrate_questions, seed=args.seed + 1,
                                         exclude_ids=exclude)
        # calibration answers first turns: one too long for the context (with its answer) is left out, as
        # the benchmark leaves out questions that may not fit (it stopped the run)
        first_turns = [{**q, "turns": q["turns"][:1]} for q in calib_questions]
        fit, too_long = fitting_questions(model, model.tokenizer, first_turns, args.max_new_tokens, args.system_prompt)
        if too_long:
            print(f"leaving out {len(too_long)} calibration questions whose first turn and {args.max_new_tokens} "
                  f"new tokens may not fit the model's context: {too_long}", file=sys.stderr)
            if not fit:
                raise ValueError("no calibration question fits the model's context with --max-new-tokens "
                                 f"{args.max_new_tokens}: lower it or give shorter --questions")
            calib_questions = [q for q in calib_questions if q["id"] not in set(too_long)]
        if not calib_questions:
            raise ValueError(f"no question of {args.questions} is left to calibrate on after --exclude-ids; "
                             "exclude fewer, or give more questions")
        exclude += [q["id"] for q in calib_questions]
        # picked, fitted to the context and the draft model loaded before calibrating, which rewrites the heads'
        # folder: a run left with nothing to benchmark, or with a draft model that does not load, had changed it
        # (and a later run left the same questions out, failing again)
        questions = _benchmark_questions(all_questions, args, exclude, calibrated=True)
        usable_questions(model, questions, args, say=False)  # (the benchmark says which it leaves out)
        runner = Runner(model, args)
        result = calibrate(model, calib_questions, args)
        result["question_ids"] = [q["id"] for q in calib_questions]  # left out of the benchmark
        if fitted_later:  # a fitted tree larger than the paths measured: refused before the heads are rewritten
            from medusa_infer.decoding import resolve_tree

            resolve_tree(model, args.tree)
        # the weights as stored (the model computes with them converted to --dtype, rounded in bfloat16)
        stored = stored_heads_state(model, heads)
        saved = model.save_pretrained(args.calibrated_heads or heads, heads_state=stored)  # a local folder (parse_args)
        (output / "calibration.json").write_text(json.dumps(result, indent=2))
        print(f"calibrated: tree of {result['tree_nodes']} nodes, expected tau {result['expected_tau']:.2f}, "
              f"expected speedup {result['expected_speedup']:.2f}x; saved into {saved}", file=sys.stderr)
    if questions is None:
        questions = _benchmark_questions(all_questions, args, exclude, bool(calibrated_on))
    check_profile_flags(model, args)
    report = benchmark(model, questions, args, started=started, runner=runner)
    # the questions drawn from were these less those left out: recorded, or --limit and --seed drew another set
    report["settings"]["left_out_ids"] = {
        "exclude_ids": given_excluded,
        "calibration": (result["question_ids"] if args.calibrate else list(calibrated_on or [])),
        "calibrated_here": bool(args.calibrate)}
    markdown = report_markdown(report)
    print(markdown)  # (first: a report that cannot be written leaves its table)
    drawn = write_report(report, markdown, output, calibrated=args.calibrate)
    print(f"wrote {output}/report.json, report.md" + (", report.png" if drawn else ""), file=sys.stderr)
    if report["settings"]["stopped_by"]:
        print(f"medusa-bench: error: the benchmark stopped early ({report['settings']['stopped_by']}); the report "
              f"holds the {report['settings']['questions_answered']} questions answered before it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
