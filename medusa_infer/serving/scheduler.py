"""The engine: one thread owns the model and decodes every request, batched.

Each turn of the engine loop::

    apply cancellations and timeouts      # rows leave their batch (DecodeBatch.cancel)
    admit queued requests                 # up to max_batch rows in all and max_prefill_tokens of
                                          # prompt a turn (at least one request); those without a
                                          # seed of their own are prefilled together, then merged
                                          # into the running batch if it can
    step every running batch once         # each row's new tokens go to its request's callback;
                                          # speculative or plain, whichever the SpeculationGate
                                          # measures faster at that batch size
    drop finished batches

Greedy and sampled requests share a batch, whatever their acceptance rule (greedy, lossless,
typical), temperature, top-k and top-p: ``DecodeBatch`` chooses and accepts each row's tokens with its
own setting, and the speculation gate learns each rule's yield apart (a rule's drafts are accepted at a
rate of their own) and expects a batch's from its rows' rules. A sampled request with a seed gets a
batch of its own with its own ``torch.Generator``, so its output depends on nothing else the server is
doing.

The engine knows nothing of HTTP: a ``Request`` carries token ids in and hands ``Update`` objects
to its ``on_update`` callback, called on the engine thread.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
import types
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator

import torch

from medusa_infer.adaptive import StepCosts
from medusa_infer.decoding import (
    DecodeBatch,
    SamplingConfig,
    StopConfig,
    context_length,
    generator_seed,
    left_pad,
    padding_id,
    token_outside,
)
from medusa_infer.metrics import GenerationMetrics
from medusa_infer.proposers import build_proposer, proposer_options
from medusa_infer.proposers.draft import as_draft_model
from medusa_infer.serving.metrics import ServingMetrics
from medusa_infer.speculation_gate import SpeculationGate, gated_step

log = logging.getLogger(__name__)

ABORT_REASONS = ("disconnect", "timeout", "error", "shutdown")
"""``Update.finish`` of a request that did not finish by itself (see ``DecodeBatch.finish`` for the rest)."""


CANCEL_MESSAGES = {"disconnect": "the client went away", "shutdown": "the server is shutting down",
                   "timeout": "the request timed out", "error": "the request failed"}


class QueueFull(Exception):
    """The queue of waiting requests is full."""


class EngineStopped(Exception):
    """The engine is shutting down (or its thread died) and takes no requests."""


@dataclass
class Update:
    """What the engine tells a request after a step.

    Attributes:
        token_ids: tokens generated since the last update.
        finish: None while running; then ``DecodeBatch``'s reason (``eos``, ``stop``, ``length``,
            ``context``) or one of ``ABORT_REASONS``.
        error: a message when ``finish`` is an abort reason.
        draft_steps: decoding steps the request has been through (after its prefill).
        accepted_tokens: draft tokens accepted over those steps.
    """

    token_ids: list[int]
    finish: str | None = None
    error: str | None = None
    draft_steps: int = 0
    accepted_tokens: int = 0


_request_ids = itertools.count()


class Request:
    """One generation as the engine sees it.

    Args:
        prompt_ids: the prompt's token ids.
        sampling: how tokens are chosen.
        stop: when the request stops (max tokens, EOS ids, stop strings).
        on_update: called on the engine thread with every ``Update``; must not block.
        seed: seeds the request's own random generator (sampled requests only).
        timeout: seconds from now after which the request is aborted with ``timeout``.
    """

    def __init__(self, prompt_ids: list[int], sampling: SamplingConfig, stop: StopConfig,
                 on_update: Callable[[Update], None], seed: int | None = None, timeout: float | None = None) -> None:
        if not prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        self.id = next(_request_ids)
        self.prompt_ids, self.sampling, self.stop, self.seed = list(prompt_ids), sampling, stop, seed
        self.on_update = on_update
        self.arrival = time.monotonic()
        self.deadline = self.arrival + timeout if timeout else None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.generated = 0
        self.finish: str | None = None
        self.slot: tuple[_Running, int] | None = None  # (batch, row) once decoding

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def batch_key(self) -> Hashable:
        """Requests with equal keys may share a batch: every request (``"shared"``), greedy or sampled,
        whatever its acceptance rule, temperature, top-k and top-p, but a seeded sampled one, which shares
        with none."""
        if self.seed is not None and not self.sampling.greedy:
            return ("seeded", self.id)
        return "shared"


@dataclass(eq=False)
class _Running:
    key: Hashable
    batch: DecodeBatch
    requests: dict[int, Request] = field(default_factory=dict)  # row -> request

    @property
    def can_merge(self) -> bool:
        return not isinstance(self.key, tuple) and hasattr(self.batch.proposer, "merge")


class Engine:
    """Decodes requests on a thread of its own.

    Args:
        model: a ``MedusaModel`` (with heads for ``method="medusa"``).
        tokenizer: its tokenizer (stop strings are matched on decoded text).
        method: a proposer method of ``medusa_infer.proposers.METHODS``.
        options: the method's settings (see ``build_proposer``).
        max_batch: at most this many rows are decoded at once, all batches together.
        max_queue: at most this many requests wait beyond those the rows free now take at the next turn;
            ``submit`` raises ``QueueFull`` beyond.
        max_prefill_tokens: prompt tokens a turn prefills at most (a longer prompt alone): a burst of
            long prompts is prefilled over several turns, each followed by a step of the running
            batches and by the cancellations and timeouts that came in, instead of in one long turn
            that stalls every stream.
        metrics: where counters go (a fresh ``ServingMetrics`` by default).
        gate: decides, per step and batch size, whether to speculate, from the step times it
            measures and what speculative steps yield (``speculation_gate.SpeculationGate``). Default: a
            fresh gate for a speculative method; None for ``autoregressive``. Pass ``False`` to
            speculate on every step. A seeded sampled request is never gated, so that its output
            depends on its seed alone.

    Attributes:
        step_costs: for ``method="medusa"``, the ``adaptive.StepCosts`` every request's adaptive
            fallback shares (``options.step_costs`` if given, else a fresh one): what steps taken
            while one request was decoding alone measured of the trees' costs serves the next
            request, as ``medusa-bench`` shares one across questions (seeded sampled requests
            neither use nor feed it: ``options_for``). None for other methods.
    """

    def __init__(self, model, tokenizer, method: str = "autoregressive", options: Any = None, *,
                 max_batch: int = 16, max_queue: int = 64, max_prefill_tokens: int = 2048,
                 metrics: ServingMetrics | None = None, gate: SpeculationGate | bool | None = None) -> None:
        if max_batch < 1 or max_queue < 1:  # every request passes through the queue
            raise ValueError(f"need max_batch >= 1 and max_queue >= 1, got {max_batch} and {max_queue}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.max_prefill_tokens = max_prefill_tokens
        self.step_costs: StepCosts | None = None
        options = proposer_options(options)  # as build_proposer takes them (its attributes were read: a crash)
        if method == "draft" and getattr(options, "draft_model", None) is not None:
            # loaded once (a name), not for every batch: batches join only batches with the same draft
            options = copy.copy(options)
            options.draft_model = as_draft_model(options.draft_model, target=model)
        self._seeded_options = options
        if method == "medusa":
            given = getattr(options, "step_costs", None)
            self.step_costs = given if given is not None else StepCosts()
            options = copy.copy(options) if options is not None else types.SimpleNamespace()
            options.step_costs = self.step_costs
            # timed trees would make a seeded request's tree sizes, so its draws, depend on the clock
            self._seeded_options = copy.copy(options)
            self._seeded_options.step_costs = None
        build_proposer(method, model, options)  # fail now, not on the first request
        self.model, self.tokenizer, self.method, self.options = model, tokenizer, method, options
        self.max_batch, self.max_queue = max_batch, max_queue
        self.metrics = metrics or ServingMetrics("model")
        if gate is None or gate is True:
            gate = SpeculationGate() if method != "autoregressive" else None
        self.gate: SpeculationGate | None = gate or None
        self.context_length = context_length(model)
        self.vocab_size = model.base_model.get_output_embeddings().weight.shape[0]
        self.pad_token_id = padding_id(model, tokenizer)
        self._lock = threading.Lock()  # guards everything below that other threads touch
        self._wake = threading.Condition(self._lock)
        self._waiting: deque[Request] = deque()
        self._cancels: dict[Request, str] = {}
        self._holds = 0
        self._in_turn = False
        self._stopping = False
        self._batches: list[_Running] = []  # engine thread only
        self._prefilling: _Running | None = None  # engine thread only: a batch whose prefill's tokens are delivered
        self._admitted: list[Request] = []  # engine thread only: taken from the queue this turn, batched or not yet
        self._active: dict[int, Request] = {}  # engine thread only: id -> request, waiting or decoding
        self._num_batches = 0
        self._num_running = 0  # rows decoding or being prefilled, as last published (under the lock)
        self._thread = threading.Thread(target=self._run, name="medusa-engine", daemon=True)

    # -- the public surface (any thread) ------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left (``shutdown``) and end the engine thread."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, request: Request) -> None:
        """Queue ``request``; raises ``QueueFull`` or ``EngineStopped``, and ``ValueError`` for a prompt the model
        cannot take (ids outside its vocabulary, or no room left in its context): prefilled with others, it
        failed them all with an error that named neither it nor its value."""
        ids = request.prompt_ids
        if len(ids) >= self.context_length:
            raise ValueError(f"a prompt of {len(ids)} tokens leaves no room in the model's context of "
                             f"{self.context_length} tokens: shorten it")
        outside = token_outside(ids, self.vocab_size)
        if outside is not None:
            raise ValueError(f"the prompt's {outside}")
        with self._lock:
            if not self.alive:
                raise EngineStopped("the engine is not running")
            # the rows free now take their share of a burst at the next turn: those requests never wait (a burst
            # on an idle server was refused past --max-queue with every row free)
            free = max(0, self.max_batch - self._num_running)
            if len(self._waiting) >= self.max_queue + free:
                raise QueueFull(f"{len(self._waiting)} requests are already queued for {free} free rows "
                                f"(--max-batch {self.max_batch}) and {self.max_queue} waiting places "
                                f"(--max-queue {self.max_queue})")
            self._waiting.append(request)
            self.metrics.waiting.set(len(self._waiting))
            self._wake.notify_all()

    def cancel(self, request: Request, reason: str = "disconnect") -> None:
        """End ``request`` between steps (no-op once it has finished): one of ``ABORT_REASONS``,
        or ``stop`` when the caller found a stop string the engine did not (a normal finish)."""
        if reason not in ABORT_REASONS + ("stop",):
            raise ValueError(f"reason must be one of {ABORT_REASONS + ('stop',)}, got {reason!r}")
        with self._lock:
            if not request.done:
                self._cancels.setdefault(request, reason)  # the first reason given wins
                if request.slot is None and request in self._waiting:  # its queue place is free now, not
                    self._waiting.remove(request)  # after a long turn: the engine's next turn tells its client
                    self.metrics.waiting.set(len(self._waiting))
                self._wake.notify_all()

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Pause the engine between two turns while the block runs (for tests and maintenance):
        requests can still be queued and cancelled, and take effect once the block ends."""
        with self._lock:
            self._holds += 1
            while self._in_turn:
                self._wake.wait()
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
                self._wake.notify_all()

    def render_metrics(self) -> str:
        """``/metrics``' text, read under the engine's lock as ``snapshot`` is: a request being taken from
        the queue is counted running or waiting, never in neither gauge or in both."""
        with self._lock:
            return self.metrics.render()

    def snapshot(self) -> dict[str, int]:
        """Counts for health checks and tests: rows decoding, requests waiting, cancels pending."""
        with self._lock:
            return {"running": int(self.metrics.running.value()), "waiting": len(self._waiting),
                    "pending_cancels": len(self._cancels), "batches": self._num_batches}

    # -- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stopping and (self._holds or not self._has_work()):
                        self._wake.wait()
                    if self._stopping:
                        break
                    self._in_turn = True
                try:
                    with torch.inference_mode():
                        self._turn()
                except Exception as error:  # a bug must not leave clients waiting forever
                    log.exception("engine turn failed; aborting the requests being decoded")
                    for running in list(self._batches):
                        self._fail_batch(running, error)
                finally:
                    with self._lock:
                        self._in_turn = False
                        self._wake.notify_all()
        finally:
            with self._lock:
                self._stopping = True
                waiting, self._waiting = list(self._waiting), deque()
                cancels, self._cancels = self._cancels, {}
            self._batches.clear()  # before any client hears: the counts it may read hold nothing
            self._publish_counts()
            for request, reason in cancels.items():  # cancelled but not yet told (a cancel leaves the queue at once)
                if request.slot is None:
                    self._finish(request, reason, error=CANCEL_MESSAGES.get(reason))
            for request in list(self._active.values()) + waiting:
                self._finish(request, "shutdown", error="the server is shutting down")

    def _has_work(self) -> bool:
        return bool(self._waiting or self._cancels or self._batches)

    def _turn(self) -> None:
        with self._lock:
            cancels, self._cancels = self._cancels, {}
        for request, reason in cancels.items():
            self._abort(request, reason, CANCEL_MESSAGES.get(reason))
        now = time.monotonic()
        with self._lock:
            overdue = [r for r in self._waiting if r.deadline is not None and r.deadline <= now]
        overdue += [r for r in self._active.values() if r.deadline is not None and r.deadline <= now]
        for request in overdue:
            timeout = (request.deadline or now) - request.arrival
            self._abort(request, "timeout", f"the request did not finish within its {timeout:g} s timeout")
        self._admit()
        for running in list(self._batches):
            if not running.batch.done:
                self._step(running)
        self._batches = [r for r in self._batches if not r.batch.done]
        self._publish_counts()

    def _admit(self) -> None:
        room = self.max_batch - sum(len(r.batch.rows) for r in self._batches)
        admitted: list[Request] = []
        tokens = 0
        with self._lock:
            while self._waiting and len(admitted) < room:
                tokens += len(self._waiting[0].prompt_ids)
                if admitted and tokens > self.max_prefill_tokens:
                    break
                admitted.append(self._waiting.popleft())
            if not admitted:
                return
            self._admitted = admitted  # running from here (their prefills may take seconds): in the same
            self._publish_counts_locked()  # hold of the lock as they leave the queue, never in neither count
        try:
            self._start_batches(admitted)
        finally:
            self._admitted = []

    def _start_batches(self, admitted: list[Request]) -> None:
        groups: dict[Hashable, list[Request]] = {}
        for request in admitted:
            self._active[request.id] = request
            groups.setdefault(request.batch_key, []).append(request)
        for key, requests in groups.items():
            try:
                self._start_batch(key, requests)
            except Exception as error:
                log.exception("prefill failed")
                for request in requests:
                    if request.slot is not None:
                        running, row = request.slot
                        running.requests.pop(row, None)
                        request.slot = None
                    self._finish(request, "error", error=f"prefill failed: {error}")

    def options_for(self, key: Hashable) -> Any:
        """The proposer settings for a batch of ``key`` (``Request.batch_key``): a seeded sampled
        request's leave out ``step_costs``, so that its output depends on its seed alone."""
        return self._seeded_options if isinstance(key, tuple) else self.options

    def _start_batch(self, key: Hashable, requests: list[Request]) -> None:
        seed = requests[0].seed
        ids, mask = left_pad([r.prompt_ids for r in requests], self.pad_token_id)
        generator = None
        if isinstance(key, tuple) and seed is not None:  # a seeded request: its own generator
            generator = torch.Generator(device=self.model.device).manual_seed(generator_seed(seed))
        proposer = build_proposer(self.method, self.model, self.options_for(key))
        batch = DecodeBatch(self.model, ids, mask, proposer, [r.sampling for r in requests], [r.stop for r in requests],
                            self.tokenizer, generator)
        self.metrics.prompt_tokens.inc(sum(len(r.prompt_ids) for r in requests))
        fresh = _Running(key, batch, dict(enumerate(requests)))
        for row, request in fresh.requests.items():
            request.slot = (fresh, row)
        emitted = batch.prefill()
        self._prefilling = fresh  # counted while its first tokens are delivered (it joins the batches after)
        try:
            self._deliver(fresh, emitted)
        finally:
            self._prefilling = None
        if batch.done:
            return
        target = next((r for r in self._batches if r.key == key and r.can_merge and not r.batch.done), None)
        if target is None:
            self._batches.append(fresh)
            return
        try:
            joined = target.batch.merge(batch)
        except Exception:  # (out of memory copying the caches): both batches as they were; this one goes on alone
            log.exception("a prefilled batch could not join a running one: it decodes on its own")
            self._batches.append(fresh)
            return
        self.metrics.batch_joins.inc(len(joined))
        for row, new_row in zip(batch.rows, joined):
            request = fresh.requests[row]
            target.requests[new_row] = request
            request.slot = (target, new_row)

    def _step(self, running: _Running) -> None:
        before = _spec_counts(running.batch.metrics)
        rows = len(running.batch.rows)
        self.metrics.batch_steps.inc()
        self.metrics.batch_row_steps.inc(rows)
        # A seeded request's batch is never gated: which steps speculate changes how its random
        # generator is drawn, and its output must depend on its seed alone, not on timings.
        gate = self._gate_for(running.key)
        try:
            emitted, gated = gated_step(running.batch, gate)
        except Exception as error:
            log.exception("decoding step failed")
            self._fail_batch(running, error)
            return
        if gated:
            self.metrics.gated_steps.inc()
        self._record_speculation(before, _spec_counts(running.batch.metrics))
        self._deliver(running, emitted)

    def _gate_for(self, key: Hashable) -> SpeculationGate | None:
        """The gate of batches of ``key``: a seeded request's batch has none (which steps speculate
        changes how its random generator is drawn, and its output must depend on its seed alone, not
        on timings); the others' is ``self.gate``, which learns each acceptance rule's yield apart."""
        return None if isinstance(key, tuple) else self.gate

    def _deliver(self, running: _Running, emitted: dict[int, list[int]]) -> None:
        batch, now = running.batch, time.monotonic()
        for row, tokens in emitted.items():
            request = running.requests.get(row)
            if request is None:
                continue
            if tokens and request.first_token_at is None:
                request.first_token_at = now
                self.metrics.ttft.observe(now - request.arrival)
            elif tokens:  # a decoding step's tokens: the time since the request's last ones
                for histogram in (self.metrics.itl, self.metrics.itl_alias):
                    histogram.observe(now - request.last_token_at)
            if tokens:
                request.last_token_at = now
            request.generated += len(tokens)
            self.metrics.generation_tokens.inc(len(tokens))
            finish = batch.finish[row]
            if finish is None:
                _notify(request, Update(tokens, None, None, batch.row_steps[row], batch.row_accepted[row]))
            else:
                del running.requests[row]
                self._finish(request, finish, tokens)
                batch.release(row)  # its tokens were delivered: a long-lived batch keeps none

    def _abort(self, request: Request, reason: str, message: str | None) -> None:
        if request.done:
            return
        slot = request.slot
        if slot is None:
            with self._lock:
                if request in self._waiting:
                    self._waiting.remove(request)
                self.metrics.waiting.set(len(self._waiting))
        else:
            running, row = slot
            running.batch.cancel(row)
            running.requests.pop(row, None)
        self._finish(request, reason, error=message)  # reads the row's counts: before its release
        if slot is not None and running.batch.finish.get(row) is not None:
            running.batch.release(row)

    def _fail_batch(self, running: _Running, error: Exception) -> None:
        requests = list(running.requests.values())
        running.requests.clear()
        if running in self._batches:
            self._batches.remove(running)
        for request in requests:
            self._finish(request, "error", error=f"decoding failed: {error}")

    def _finish(self, request: Request, finish: str, tokens: list[int] | None = None,
                error: str | None = None) -> None:
        if request.done:
            return
        request.finish = finish
        self._active.pop(request.id, None)
        steps = accepted = 0
        if request.slot is not None:
            running, row = request.slot
            steps, accepted = running.batch.row_steps[row], running.batch.row_accepted[row]
        now = time.monotonic()
        if finish in ABORT_REASONS:
            self.metrics.aborted.inc(reason=finish)
        else:
            self.metrics.request_success.inc(finished_reason="length" if finish in ("length", "context") else "stop")
            self.metrics.e2e.observe(now - request.arrival)
            if request.first_token_at is not None and request.generated > 1:
                self.metrics.tpot.observe((now - request.first_token_at) / (request.generated - 1))
        self._publish_counts()  # before its client hears: the counts it may read next no longer hold it
        _notify(request, Update(tokens or [], finish, error, steps, accepted))

    def _record_speculation(self, before: tuple[list[int], list[int]], after: tuple[list[int], list[int]]) -> None:
        offered = [a - (before[0][i] if i < len(before[0]) else 0) for i, a in enumerate(after[0])]
        accepted = [a - (before[1][i] if i < len(before[1]) else 0) for i, a in enumerate(after[1])]
        if not offered or offered[0] == 0:
            return
        self.metrics.spec_drafts.inc(offered[0])
        self.metrics.spec_draft_tokens.inc(sum(offered))
        self.metrics.spec_accepted_tokens.inc(sum(accepted))
        for position, count in enumerate(accepted):
            self.metrics.spec_accepted_per_pos.inc(count, position=position)

    def _publish_counts(self) -> None:
        with self._lock:
            self._publish_counts_locked()

    def _publish_counts_locked(self) -> None:
        """The counts ``snapshot`` and ``render_metrics`` read under the lock, all set under it (a reader sees
        all of a change or none)."""
        batches = self._batches + ([self._prefilling] if self._prefilling is not None else [])
        live = [r for r in batches if not r.batch.done]  # a batch whose last row just ended: gone at turn's end
        running = {request.id for r in live for request in r.requests.values()}
        running.update(request.id for request in self._admitted if not request.done)  # batched or being prefilled
        self.metrics.running.set(len(running))
        self.metrics.waiting.set(len(self._waiting))
        self._num_batches, self._num_running = len(live), len(running)


def _notify(request: Request, update: Update) -> None:
    try:
        request.on_update(update)
    except Exception:  # the client's side is gone (e.g. its event loop closed): nothing to tell
        log.debug("could not deliver an update to request %s", request.id, exc_info=True)


def _spec_counts(metrics: GenerationMetrics) -> tuple[list[int], list[int]]:
    return list(metrics.offered_by_depth), list(metrics.accepted_by_depth)


