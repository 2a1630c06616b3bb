"""Trees fitted to the heads and to the hardware.

Two measurements decide the best tree on a device:

* the heads' measured acceptance (from training's held-out evaluation or a calibration run): how
  often each path of ranks is right at once, which gives, for each tree, the expected tokens per
  step (``trees.expected_accept_length``);
* the device's verification cost ``t(n)``: one forward of ``n`` tokens at a typical context length
  (and, where measured, at a longer one: on a CPU a tree's cost grows with the context it attends
  over faster than one token's, so the adaptive fallback prices a step at its own context).

The tree of each size that maximises the expected tokens is built greedily (``trees.greedy_tree``);
the size chosen maximises expected tokens per second, ``tau(n) / t(n + 1)``, against plain
decoding's ``1 / t(1)``. The same heads therefore get a small tree on a CPU, whose cost grows
quickly with n, and a large one on a GPU, where verifying 64 tokens costs about as much as one.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from medusa_infer.kv_cache import AttentionLayout, KVState
from medusa_infer.trees import (
    AcceptanceModel,
    Path,
    expected_accept_length,
    greedy_tree,
    tree_capacity,
    tree_depth,
)

logger = logging.getLogger(__name__)

DEFAULT_SIZES = tuple(range(1, 18)) + (24, 32, 48, 64)
"""The forward sizes a cost profile measures: every size a tree of up to 16 nodes verifies, since
on a CPU the cost is not smooth between powers of two (the default model on a 2-core Xeon, with
the linear kernels chosen per row count: t(5) / t(1) 1.42, t(7) 1.61, t(8) 1.45;
docs/step-costs/sizes.log), then a few larger ones to interpolate between."""


LONG_CONTEXT_SIZES = (1, 2, 3, 5, 9, 12, 17, 32, 64)
"""The forward sizes measured at the long context (``measure_verify_cost(long_context=...)``): what grows with
the context is attention over it, smooth in the number of new tokens, so fewer sizes than at the typical context
(whose unevenness between sizes, the linear kernels', does not change with the context) price every size."""

LONG_CONTEXT = 2048
"""The long context a calibration measures forwards over, where the model attends that far (``long_context``):
on the default model and a 2-core CPU t(11) / t(1) is 1.05 over 256 cached tokens, 1.34 over 1500 and 1.46 over 2048
(docs/long-context-s72/demo_calibration.json)."""


EXTRAPOLATION_FLOOR = 1 / 16
"""Past the largest size measured, a token costs at least this share of a token's mean time at that size
(``CostProfile.ratio``): a profile that measured flat prices larger forwards as rising, and one a little
steeper prices them alike (the rule changes smoothly with the times)."""


@dataclass
class CostProfile:
    """Measured seconds of one verification forward of ``sizes[i]`` new tokens.

    Attributes:
        sizes: tokens per forward, ascending, starting at 1.
        seconds: median seconds per forward for each size.
        device: where it was measured, with the dtype (``device_label``: e.g. ``"cpu float32"``,
            ``"NVIDIA H200 bfloat16"``).
        context: cached tokens before the new ones during the measurement.
        head_seconds: median seconds of running the first ``d`` Medusa heads (and their top-k) at
            one position, at index ``d - 1``: a tree of depth ``d`` runs only those (empty: not
            measured, the heads cost nothing).
        longer: the same forwards measured over a longer context (its ``context``), at fewer sizes;
            None: not measured, every context priced as ``context``. Past ``context`` a size's
            seconds follow the line through its two measurements (``forward_seconds``).
    """

    sizes: list[int]
    seconds: list[float]
    device: str = ""
    context: int = 0
    head_seconds: list[float] = field(default_factory=list)
    longer: CostProfile | None = None

    def __post_init__(self) -> None:
        whole = all(isinstance(n, int) and not isinstance(n, bool) for n in self.sizes)  # (a NaN or an infinity,
        # which JSON readers take, sorted as sizes: every forward past them priced as the last finite one, or NaN)
        if not whole or not self.sizes or self.sizes[0] != 1 or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"sizes must be whole numbers of tokens, ascending, distinct and start at 1, got "
                             f"{self.sizes}")
        if len(self.seconds) != len(self.sizes) or not all(0 < t < math.inf for t in self.seconds):
            raise ValueError(f"seconds must hold one positive, finite time per size, got {self.seconds} (a NaN or an "
                             "infinity, which JSON readers take, kept the adaptive fallback on plain decoding)")
        if not all(0 <= t < math.inf for t in self.head_seconds):
            raise ValueError(f"head_seconds must be finite and not negative, got {self.head_seconds}")
        # no forward costs less than one token's: a profile saved before measure_verify_cost raised each
        # time to the smaller sizes' can hold t(n) < t(1), which promises a speedup above tau (dips between
        # larger sizes can be real on a CPU, where the linear kernels are chosen per row count)
        self.seconds = [max(t, self.seconds[0]) for t in self.seconds]
        # running deeper heads costs no less than running fewer (measure_head_seconds measures so; a profile written
        # by hand or another tool may not say so, and the fit, which takes it so, then missed the fastest tree)
        self.head_seconds = list(itertools.accumulate(self.head_seconds, max))
        if self.longer is not None:
            longer = self.longer
            if not isinstance(longer, CostProfile) or longer.longer is not None or longer.context <= self.context:
                raise ValueError(f"longer must be one cost profile measured over more than {self.context} cached "
                                 f"tokens, measured at one context itself; got {longer!r:.200}")

    def forward_seconds(self, n: int, context: int | None = None) -> float:
        """Seconds of one forward of ``n`` new tokens over ``context`` cached ones (None: ``self.context``):
        linearly interpolated between the sizes measured (extrapolated past the largest, never decreasing);
        past ``context``, with a ``longer`` profile, moved along the line through the two contexts' times
        (extrapolated past the longer one: attention's cost grows in proportion to the context), growing
        no less than one token's forward does (attention over the context grows with the tokens that
        attend; a noisy longer measurement of ``n`` tokens that grew less, or read faster, would price
        ``n`` tokens below one token far past it)."""
        near = self._interpolated(n)
        longer = self.longer
        if longer is None or context is None or context <= self.context:
            return near
        growth = max(longer._interpolated(n) - near, longer._interpolated(1) - self._interpolated(1), 0.0)
        return near + growth * (context - self.context) / (longer.context - self.context)

    def ratio(self, n: int, context: int | None = None) -> float:
        """``t(n) / t(1)`` over ``context`` cached tokens (``forward_seconds``)."""
        if n <= 1:
            return 1.0
        return self.forward_seconds(n, context) / self.forward_seconds(1, context)

    def _interpolated(self, n: int) -> float:
        """``forward_seconds(n)`` at this profile's own context."""
        sizes, secs = self.sizes, self.seconds
        if n <= 1:
            return secs[0]
        for i in range(1, len(sizes)):
            if n <= sizes[i]:
                lo, hi = sizes[i - 1], sizes[i]
                return secs[i - 1] + (secs[i] - secs[i - 1]) * (n - lo) / (hi - lo)
        if len(sizes) == 1:
            return secs[0] * n
        # never flat: a noisy profile's last slope can be < 0, and a tie at its end (common, as
        # measure_verify_cost raises each time to the smaller sizes') is 0, which would make ever larger
        # forwards (a batch's tree step prices batch * nodes tokens) look free; the slope over the whole
        # profile stands in (the H200 profile in docs/gpu/376fcb4, t(10..64) / t(1) all 1.123, priced
        # a 2080-token forward like a 64-token one)
        # a profile measured flat (every size alike) was priced in proportion to tokens, one a microsecond
        # steeper by that tiny slope: 32.5x against 1.006x at 2080 tokens, flipping a batch's tree
        last = (secs[-1] - secs[-2]) / (sizes[-1] - sizes[-2])
        overall = (secs[-1] - secs[0]) / (sizes[-1] - sizes[0])
        slope = max(last, overall, secs[-1] / sizes[-1] * EXTRAPOLATION_FLOOR)
        return secs[-1] + slope * (n - sizes[-1])

    def head_ratio(self, depth: int, context: int | None = None) -> float:
        """Cost of running the heads a tree of ``depth`` needs, as a fraction of ``t(1)`` over ``context``
        cached tokens (0 for depth 0 or when not measured; past the measured depths, the deepest
        measured). The heads read one position: their seconds do not grow with the context."""
        if depth <= 0 or not self.head_seconds:
            return 0.0
        return self.head_seconds[min(depth, len(self.head_seconds)) - 1] / self.forward_seconds(1, context)

    def to_dict(self) -> dict:
        data = {"sizes": list(self.sizes), "seconds": list(self.seconds), "device": self.device,
                "context": self.context}
        if self.head_seconds:
            data["head_seconds"] = list(self.head_seconds)
        if self.longer is not None:
            data["longer"] = self.longer.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "CostProfile":
        """The inverse of ``to_dict``. Profiles written before ``head_seconds`` hold one
        ``head_overhead`` (all heads' cost over ``t(1)``), which is then charged at every depth."""
        seconds = list(data["seconds"])
        head_seconds = data.get("head_seconds")
        if head_seconds is None and data.get("head_overhead") is not None and seconds:  # (none: refused below)
            head_seconds = [float(data["head_overhead"]) * seconds[0]]
        longer = data.get("longer")
        return cls(list(data["sizes"]), seconds, data.get("device", ""), data.get("context", 0),
                   list(head_seconds or []), cls.from_dict(longer) if longer is not None else None)


@torch.inference_mode()
def measure_verify_cost(
    model,
    sizes: Sequence[int] = DEFAULT_SIZES,
    context: int = 256,
    repeats: int = 20,
    long_context: int | None = None,
    long_sizes: Sequence[int] = LONG_CONTEXT_SIZES,
) -> CostProfile:
    """Time one forward of ``n`` new tokens over ``context`` cached ones, for each ``n`` in ``sizes``;
    with ``long_context``, also over that many for each of ``long_sizes`` (the profile's ``longer``).

    The sizes are interleaved within each repeat (so a noisy machine slows them alike) and the
    median is kept, raised to the largest median of the smaller sizes (the profile never decreases).
    Every ratio divides by t(1), so a t(1) that a noisy moment inflates flattens the whole curve and
    makes large trees look cheap: on the default model and a 2-core CPU, three profiles of 5 repeats
    read t(4) / t(1) 1.37 to 1.46, three of 20 repeats 1.43 to 1.46
    (docs/bench80-large-s25/cost_noise.log). 20 repeats of the powers of two up to 64 took about 10 s
    there (the default sizes, 21 of them, take longer). ``model`` is a ``MedusaModel``; a causal mask
    stands in for the tree mask (the cost does not depend on the mask's pattern). The long context's
    forwards are interleaved with the others, so that the line through the two contexts' times
    (``CostProfile.forward_seconds``) compares times of one moment.
    """
    if repeats < 1 or any(int(n) < 1 for n in [*sizes, *long_sizes]):  # (a median of nothing, or a reshape error,
        # after warm-up)
        raise ValueError(f"repeats must be >= 1 and sizes >= 1 token, got repeats={repeats}, sizes={list(sizes)}, "
                         f"long_sizes={list(long_sizes)}")
    plan = {context: sorted(set(int(n) for n in sizes) | {1})}
    check_cost_context(model, context, plan[context])
    if long_context is not None:
        if long_context <= context:
            raise ValueError(f"long_context must exceed context ({context} cached tokens), got {long_context}")
        plan[long_context] = sorted(set(int(n) for n in long_sizes) | {1})
        check_cost_context(model, long_context, plan[long_context], "--calibrate-long-context")
    device, dtype = model.device, model.dtype
    vocab = model.lm_head.weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    layout = AttentionLayout.from_config(model.base_model.config)

    def prefilled(length: int) -> KVState:
        prompt = torch.randint(0, vocab, (1, length), generator=generator).to(device)
        kv = KVState.empty(1, layout, device)
        positions = torch.arange(length, device=device)[None]
        valid = torch.ones_like(positions, dtype=torch.bool)
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        model(prompt, attention_mask=kv.attention_mask(positions, valid, causal, dtype), position_ids=positions,
              cache=kv.cache, logits_positions=slice(-1, None))
        kv.append(valid, positions)
        return kv

    bases = {length: prefilled(length) for length in plan}
    times: dict[tuple[int, int], list[float]] = {(length, n): [] for length, ns in plan.items() for n in ns}
    for repeat in range(repeats + 1):  # the first round warms up and is discarded
        for length, n in times:
            kv = bases[length].copy()
            tokens = torch.randint(0, vocab, (1, n), generator=generator).to(device)
            positions = length + torch.arange(n, device=device)[None]
            valid = torch.ones_like(positions, dtype=torch.bool)
            causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            mask = kv.attention_mask(positions, valid, causal, dtype)
            _sync(device)
            start = time.perf_counter()
            model(tokens, attention_mask=mask, position_ids=positions, cache=kv.cache)
            _sync(device)
            if repeat:
                times[length, n].append(time.perf_counter() - start)

    def profile(length: int, longer: CostProfile | None = None) -> CostProfile:
        # A forward of more tokens never needs to cost less than one of fewer (it could pad them): a median
        # below a smaller size's is noise, and would promise a speedup above the tokens a step yields.
        seconds = list(itertools.accumulate((statistics.median(times[length, n]) for n in plan[length]), max))
        return CostProfile(plan[length], seconds, device_label(device, dtype), length, longer=longer)

    return profile(context, profile(long_context) if long_context is not None else None)


def long_context(model, context: int, preferred: int = LONG_CONTEXT) -> int | None:
    """The long context a calibration over ``context`` cached tokens also measures ``model``'s forwards over:
    ``preferred``, or as far as the model attends (less the largest of ``LONG_CONTEXT_SIZES``); None where that
    is less than twice ``context`` (too near it to tell a slope from noise)."""
    from medusa_infer.decoding import context_length  # decoding imports this module

    length = min(preferred, context_length(model) - max(LONG_CONTEXT_SIZES))
    return length if length >= 2 * context else None


def device_label(device: torch.device, dtype: torch.dtype) -> str:
    """Where a cost profile was measured, as ``CostProfile.device`` records it: the CUDA device's name
    (else the device type) and the dtype, e.g. ``"NVIDIA H200 bfloat16"``, ``"cpu float32"``."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{name} {dtype}".replace("torch.", "")


_WARNED_ELSEWHERE: set[tuple[str, str]] = set()


def warn_if_measured_elsewhere(model) -> None:
    """Log a warning (once per pair of devices in a process) where ``model``'s heads carry a cost profile
    measured on another device or dtype than the model runs on: their stored tree, the adaptive
    fallback and lookup's draft lengths then follow the other machine's costs. The fix is calibrating
    here (``medusa-bench --calibrate --calibrated-heads DIR``)."""
    profile = getattr(getattr(model, "config", None), "cost_profile", None)
    measured = (profile or {}).get("device") or ""
    if not measured:  # profiles written by hand or before the field say nothing to compare
        return
    here = device_label(model.device, model.dtype)
    if here != measured and (measured, here) not in _WARNED_ELSEWHERE:
        _WARNED_ELSEWHERE.add((measured, here))
        logger.warning("these heads' tree and cost profile were measured on %s and the model runs on %s: the tree "
                       "and the adaptive fallback follow the other machine's costs; calibrate here for this one's "
                       "(medusa-bench --calibrate --calibrated-heads DIR)", measured, here)


def check_cost_context(model, context: int, sizes: Sequence[int] = DEFAULT_SIZES,
                       flag: str = "--calibrate-context") -> None:
    """Raise ``ValueError`` unless ``measure_verify_cost(model, sizes, context)`` fits the model's context
    (a model with learned positions failed with an IndexError past its last position); the message names
    medusa-bench's ``flag`` that sets ``context``."""
    from medusa_infer.decoding import context_length  # decoding imports this module

    limit, largest = context_length(model), max(sizes, default=1)
    if context < 1 or context + largest > limit:
        raise ValueError(
            f"a cost profile measured over {context} cached tokens needs {context} + {largest} positions, but "
            f"the model attends over {limit}: measure over a context between 1 and {limit - largest} "
            f"(medusa-bench {flag})"
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class FittedTree:
    """The chosen tree and the table it was chosen from.

    Attributes:
        paths: the chosen tree (empty: plain decoding is expected to be fastest).
        expected_tau: expected tokens per step of the chosen tree (bonus included).
        expected_speedup: expected tokens/s relative to plain decoding.
        table: per candidate size, ``{"nodes", "depth", "tau", "cost_ratio", "speedup"}`` of its
            fastest tree.
        speculative_paths: the fastest tree with nodes (``paths`` unless plain decoding won): what
            an adaptive controller grows to when acceptance turns out better than calibrated; empty where no
            tree is expected to accept a token (heads never right: no controller then).
    """

    paths: list[Path]
    expected_tau: float
    expected_speedup: float
    table: list[dict] = field(default_factory=list)
    speculative_paths: list[Path] = field(default_factory=list)


def _within_depth(model: AcceptanceModel, depth: int) -> AcceptanceModel:
    """``model`` for the first ``depth`` heads only."""
    if isinstance(model, Mapping):
        return {path: prob for path, prob in model.items() if len(path) <= depth}
    return list(model)[:depth]


def fit_tree(
    head_topk_acc: AcceptanceModel,
    cost: CostProfile,
    sizes: Sequence[int] = tuple(range(1, 17)) + (24, 32, 48, 64),
    tau: Callable[[list[Path]], float] | None = None,
) -> FittedTree:
    """Pick the tree (its size, nodes beyond the root, and depth) that maximises expected tokens per second.

    For each size, each depth d gets the best tree of that size within the first d heads
    (``greedy_tree``), charged for its forward and its d heads; the fastest is the size's entry. A
    deep tree expects more tokens than a shallow one of the same size, but pays for more heads.

    Args:
        head_topk_acc: the heads' measured acceptance (``trees.AcceptanceModel``): joint path
            probabilities, or ``[num_heads][k]`` probabilities that head d's rank-r token is right.
        cost: the device's verification cost profile; a tree of depth ``d`` also pays for its
            ``d`` heads (``CostProfile.head_ratio``).
        sizes: candidate numbers of tree nodes; one larger than the accuracies allow (every path
            ever accepted, ``tree_capacity``) stands for the largest they allow.
        tau: a tree's expected tokens per step (default: ``expected_accept_length`` under
            ``head_topk_acc``, an average over every position; calibration walks its answers as decoding
            does, which the average runs above).
    """
    expected = tau if tau is not None else (lambda paths: expected_accept_length(paths, head_topk_acc))
    table = [{"nodes": 0, "depth": 0, "tau": 1.0, "cost_ratio": 1.0, "speedup": 1.0}]
    best: tuple[float, list[Path], float] = (1.0, [], 1.0)
    speculative: tuple[float, list[Path]] = (0.0, [])
    if isinstance(head_topk_acc, Mapping) and not head_topk_acc:  # no path ever accepted: plain decoding
        return FittedTree([], 1.0, 1.0, table, [])
    capacity = tree_capacity(head_topk_acc)
    if isinstance(head_topk_acc, Mapping):
        num_heads = max((len(p) for p in head_topk_acc), default=0)
    else:
        num_heads = len(head_topk_acc)
    for n in sorted({min(int(n), capacity) for n in sizes} - {0}):
        entry = None
        for depth in range(1, num_heads + 1):
            within = _within_depth(head_topk_acc, depth)
            if n > tree_capacity(within):
                continue
            paths = greedy_tree(within, n)
            steps = expected(paths)
            ratio = cost.ratio(n + 1) + cost.head_ratio(tree_depth(paths))
            if entry is None or steps / ratio > entry[0]:
                entry = (steps / ratio, paths, steps, ratio)
        if entry is None:
            continue
        speedup, paths, steps, ratio = entry
        table.append({"nodes": n, "depth": tree_depth(paths), "tau": round(steps, 4), "cost_ratio": round(ratio, 4),
                      "speedup": round(speedup, 4)})
        if speedup > best[0]:
            best = (speedup, paths, steps)
        if speedup > speculative[0] and steps > 1.0:  # (a tree expected to accept nothing is no fallback's: heads
            # never right got a controller that ran head 1 at every plain step)
            speculative = (speedup, paths)
    return FittedTree(best[1], best[2], best[0], table, speculative[1])
