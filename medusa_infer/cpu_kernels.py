"""Matrix-product kernels for a model's ``nn.Linear`` layers on the CPU, chosen by measurement.

Verifying a tree costs one forward over n new tokens. On a CPU that forward is a chain of
matrix products with n rows, each bound by reading the weights when n is small, and which kernel
reads them fastest depends on the CPU, on n and on the weight's shape. Three are at hand in
PyTorch's CPU builds:

* ``default``: PyTorch's own (MKL's ``sgemm``);
* ``onednn``: oneDNN's (the ones PyTorch's own compiler uses for CPU linear layers), with each
  weight laid out once in oneDNN's blocked format (a packed copy kept beside the parameter);
* ``mkl-packed``: MKL's ``sgemm`` on a weight packed once by ``sgemm_pack``, for at most
  ``MKL_PACKED_MAX_ROWS`` rows. MKL documents a packed weight for the row count it was packed
  for; one copy serves every count here, which ``mkl_packed_works`` checks against ``F.linear``
  for each weight shape before a plan may choose it.

Measured on this project's machines (``scripts/bench_cpu_kernels.py``): on an AMD EPYC, ``default``
was much slower for 2 to 16 rows than for one, and slower than oneDNN for one row too; on an Intel
Xeon with AVX-512, ``default`` read one to three rows' weights fastest, was much slower from 4 rows
up, most of all for the wide ``lm_head`` (49152 x 576: 13.3 ms against 5.4 for oneDNN at 8 rows),
and the packed kernels held on. So ``use_cpu_kernels`` times the kernels on the model's own
layers, shape by shape, for 1 to 128 rows and keeps the fastest for each (a ``KernelPlan`` per
weight shape; ``"tuned"``, the default of ``load_base_model``); ``"onednn"`` takes oneDNN for every
row count, ``"default"`` leaves the model alone. Either way:

* each ``nn.Linear`` becomes a ``CPULinear`` (a subclass; same parameters, same state dict, tied
  weights stay tied), so ``model.generate`` and every method of this package use the same kernels;
* only float32 inference on the CPU takes the plan; with gradients enabled (training), other
  dtypes or devices, or under ``torch.autocast``, a layer computes ``F.linear`` as before;
* a packed copy is made when a layer first takes a packed kernel, and made again when the weight
  changes (another tensor, storage, or an in-place update), and dropped by any forward with gradients
  enabled (a fused optimizer, ``AdamW(fused=True)``, updates weights without bumping their version, so
  the copy after training would be of the old weights); it is never saved, pickled or
  deep-copied. Each packed kernel a layer takes adds a copy of its weight to memory (a layer can
  take both at different row counts: keeping one packed kernel per shape measured slower, t(4)
  53.5 ms against 46.7 with MKL's packed kernel throughout, on the Intel machine).

Results agree with ``F.linear`` to float32 rounding (no kernel gives bit-identical rows for
different numbers of rows). ``restore_linear`` undoes the switch.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.nn import functional as F

logger = logging.getLogger(__name__)

CPU_KERNELS = ("tuned", "onednn", "default")
KERNELS = ("default", "onednn", "mkl-packed")
PLAN_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128)  # the row counts ``measure_kernel_plan`` times
CHECK_ROWS = tuple(range(1, 17)) + (24, 32, 48, 64)  # the row counts ``mkl_packed_works`` checks
PACK_ROWS = 8  # the row count weights are packed for (oneDNN runs any count on them; see MKL_PACKED_MAX_ROWS)
MKL_PACKED_MAX_ROWS = 64  # the most rows "mkl-packed" serves: the range checked against F.linear
MEASURE_BYTES = 128 * 2**20  # weights timed per pass: more than any CPU cache holds, so reads come from memory


def _op(namespace: str, name: str) -> Any:
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None


_ONEDNN = (_op("mkldnn", "_linear_pointwise"), _op("mkldnn", "_reorder_linear_weight"))
if not torch.backends.mkldnn.is_available() or None in _ONEDNN:
    _ONEDNN = None
_MKL = (_op("mkl", "_mkl_linear"), _op("mkl", "_mkl_reorder_linear_weight"))
if not torch._C.has_mkl or None in _MKL:
    _MKL = None
_MKL_CHECKED: dict[tuple[tuple[int, ...], torch.dtype], bool] = {}  # mkl_packed_works, per weight shape


@dataclass(frozen=True)
class KernelPlan:
    """Which kernel a product with a given number of rows takes.

    Attributes:
        rows: ascending row counts; ``kernels[i]`` serves ``rows[i]`` up to ``rows[i + 1] - 1``
            rows, the last one every count above (``"mkl-packed"`` up to ``MKL_PACKED_MAX_ROWS``: past it
            ``F.linear``, see ``kernel``).
        kernels: one of ``KERNELS`` per entry of ``rows``.
        seconds: per entry, the measured seconds of each kernel (``{kernel: s}``), empty when the
            plan was not measured (not compared: plans are equal when they choose alike).
    """

    rows: tuple[int, ...]
    kernels: tuple[str, ...]
    seconds: tuple[dict[str, float], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.kernels) or list(self.rows) != sorted(set(self.rows)):
            raise ValueError(f"a KernelPlan needs ascending distinct rows and one kernel each, got rows={self.rows} "
                             f"kernels={self.kernels}")
        if self.rows[0] != 1:
            raise ValueError(f"a KernelPlan's rows must start at 1, got {self.rows}")
        unknown = set(self.kernels) - set(KERNELS)
        if unknown:
            raise ValueError(f"unknown kernels {sorted(unknown)}: use {KERNELS}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "KernelPlan":
        """The plan ``to_dict`` wrote; ``ValueError`` (or ``KeyError``/``TypeError``) for anything else."""
        return cls(tuple(int(r) for r in data["rows"]), tuple(str(k) for k in data["kernels"]),
                   tuple({str(k): float(v) for k, v in s.items()} for s in data.get("seconds", ())))

    @classmethod
    def uniform(cls, kernel: str) -> "KernelPlan":
        """The same kernel for every row count."""
        return cls((1,), (kernel,))

    def kernel(self, rows: int) -> str:
        """The kernel a product with ``rows`` rows runs on: ``"default"`` past ``MKL_PACKED_MAX_ROWS`` rows
        where the plan names ``"mkl-packed"`` (which serves no more)."""
        kernel = self.kernels[max(bisect.bisect_right(self.rows, rows) - 1, 0)]
        return "default" if kernel == "mkl-packed" and rows > MKL_PACKED_MAX_ROWS else kernel

    def describe(self) -> str:
        """For example ``"default for 1-2 rows, onednn for 3+"``: the kernels ``kernel`` runs on."""
        spans: list[tuple[int, int | None, str]] = []
        starts = sorted(set(self.rows) | {MKL_PACKED_MAX_ROWS + 1})
        for i, start in enumerate(starts):
            kernel = self.kernel(start)
            end = starts[i + 1] - 1 if i + 1 < len(starts) else None
            if spans and spans[-1][2] == kernel:
                spans[-1] = (spans[-1][0], end, kernel)
            else:
                spans.append((start, end, kernel))
        if len(spans) == 1:
            return f"{spans[0][2]} for every row count"
        parts = []
        for start, end, kernel in spans:
            span = f"{start}+" if end is None else (str(start) if end == start else f"{start}-{end}")
            parts.append(f"{kernel} for {span} row{'' if span == '1' else 's'}")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"rows": list(self.rows), "kernels": list(self.kernels), "seconds": [dict(s) for s in self.seconds],
                "summary": self.describe()}


def _takes_plan(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_ONEDNN is not None and not torch.is_grad_enabled() and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.numel() > 0  # (oneDNN makes no primitive for an empty weight; F.linear's answer is zeros)
            and not torch.is_autocast_enabled("cpu"))  # (autocast: F.linear computes in its dtype)


def tensor_version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter (bumped by in-place updates), what derived copies are kept by; -1 for
    an inference tensor, which has none (and cannot change outside inference mode: an in-place change
    within it goes unseen; ``CPULinear`` drops its packed copy when it loads a state dict, other code
    changing an inference tensor in place calls ``forget_packed``)."""
    return -1 if tensor.is_inference() else tensor._version


def packed_weight(weight: torch.Tensor, kernel: str, cache: dict[str, Any]) -> torch.Tensor | None:
    """``weight`` (``[out, in]``) packed for ``kernel`` (``"onednn"``: oneDNN's blocked layout;
    ``"mkl-packed"``: MKL's ``sgemm_pack``, None where ``mkl_packed_works`` fails for its shape),
    kept in ``cache`` while ``weight`` is the same tensor, on the same storage, at the same version
    (an in-place update bumps the version)."""
    stamp = (weight.data_ptr(), tensor_version(weight), tuple(weight.shape))
    found = cache.get(kernel)
    if found is None or found[0] is not weight or found[1] != stamp:
        if kernel == "onednn":
            packed = _ONEDNN[1](weight.detach(), PACK_ROWS)
        else:
            packed = _MKL[1](weight.detach(), PACK_ROWS) if mkl_packed_works(weight) else None
        # the storage packed is held (weight.detach(): a view of it), so that its address cannot be reused while
        # the copy lives: a Parameter whose .data is replaced (Module.to, .bfloat16().float()) frees the old
        # storage, and a later replacement landing at its address matched the stamp of the old weights
        found = (weight, stamp, packed, weight.detach())
        cache[kernel] = found
    return found[2]


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _run(kernel: str, x: torch.Tensor, rows: int, weight: torch.Tensor, bias: torch.Tensor | None,
         cache: dict[str, Any]) -> torch.Tensor:
    """``F.linear`` on ``kernel`` for ``x`` (``rows`` rows in all)."""
    if kernel == "onednn":  # (a bias that is a strided view was read as if contiguous: other numbers, or past it)
        bias = bias.contiguous() if bias is not None else None
        return _ONEDNN[0](x.contiguous(), packed_weight(weight, kernel, cache), bias, "none", [], "")
    if kernel == "mkl-packed" and 0 < rows <= MKL_PACKED_MAX_ROWS:
        packed = packed_weight(weight, kernel, cache)
        if packed is not None:
            return _mkl_packed(x, rows, weight, bias, packed)
    return F.linear(x, weight, bias)


def _mkl_packed(x: torch.Tensor, rows: int, weight: torch.Tensor, bias: torch.Tensor | None,
                packed: torch.Tensor) -> torch.Tensor:
    # MKL's op takes its packed weight only for the row count it names, so it is told this call's
    # count: one packed copy serves every count up to MKL_PACKED_MAX_ROWS (``mkl_packed_works``)
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    return _MKL[0](flat, packed, weight, bias, rows).reshape(*x.shape[:-1], weight.shape[0])



def planned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: KernelPlan | None,
                   cache: dict[str, Any]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on the kernel ``plan`` names for ``x``'s number of rows (float32
    CPU inference; anything else, or no plan, computes ``F.linear``; ``"mkl-packed"`` serves at
    most ``MKL_PACKED_MAX_ROWS`` rows, more take ``F.linear``). ``cache`` keeps the packed weights
    (``packed_weight``)."""
    if plan is None or not _takes_plan(x, weight):
        return F.linear(x, weight, bias)
    rows = _rows(x)
    return _run(plan.kernel(rows), x, rows, weight, bias, cache)


class CPULinear(nn.Linear):
    """``nn.Linear`` whose float32 CPU inference takes the kernel its ``kernel_plan`` names for the
    number of rows (see the module docstring)."""

    kernel_plan: KernelPlan | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # training: the weights may change in ways no version counter shows
            self.__dict__.pop("_kernel_cache", None)
            return F.linear(x, self.weight, self.bias)
        cache = self.__dict__.setdefault("_kernel_cache", {})
        return planned_linear(x, self.weight, self.bias, self.kernel_plan, cache)

    def _apply(self, fn: Any, recurse: bool = True) -> "CPULinear":
        """A dtype or device change (``Module.to``, ``.bfloat16()``) drops the packed copies, and with them the
        storage they keep alive (the old weights, a float32 copy of each beside the new ones)."""
        self.__dict__.pop("_kernel_cache", None)
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict[str, Any]:
        """Pickling and deep copies leave out the packed weight (oneDNN's opaque tensors have no storage)."""
        state = dict(super().__getstate__())
        state.pop("_kernel_cache", None)
        return state

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        """``load_state_dict`` copies into the weight in place; under ``torch.inference_mode`` that
        bumps no version (an inference tensor has none), so the packed copy is dropped here."""
        self.__dict__.pop("_kernel_cache", None)
        super()._load_from_state_dict(*args, **kwargs)


def pack_planned(model: nn.Module) -> int:
    """Make now the packed copies (``packed_weight``) of every kernel the plans of ``model``'s switched layers
    name, which each layer otherwise makes the first time a product of that many rows takes it (in a
    benchmark, in whichever method first met that row count: ~3% of a short run's time); returns how many
    copies were made. Layers that take no plan (not float32 on the CPU) are left alone."""
    made = 0
    with torch.no_grad():
        for layer in model.modules():
            plan, weight = getattr(layer, "kernel_plan", None), getattr(layer, "weight", None)
            if not isinstance(layer, CPULinear) or plan is None or _ONEDNN is None or weight.dtype != torch.float32 \
                    or weight.device.type != "cpu":
                continue
            cache = layer.__dict__.setdefault("_kernel_cache", {})
            for kernel in sorted(set(plan.kernels) & {"onednn", "mkl-packed"}):
                if kernel == "mkl-packed" and _MKL is None:
                    continue
                before = cache.get(kernel)
                made += packed_weight(weight, kernel, cache) is not None and cache.get(kernel) is not before
    return made


def onednn_works() -> bool:
    """Whether this PyTorch build has oneDNN's linear kernel and weight packing, and they agree with ``F.linear``."""
    if _ONEDNN is None:
        return False
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, 16, generator=generator), torch.randn(24, generator=generator)
    x = torch.randn(2, 3, 16, generator=generator)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):  # float32, also where called under autocast
        try:
            found = _run("onednn", x, _rows(x), weight, bias, {})
        except RuntimeError as err:
            logger.warning("oneDNN linear kernel unavailable (%s); keeping PyTorch's default kernels", err)
            return False
        return bool(torch.allclose(found, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4))


def mkl_packed_works(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``"mkl-packed"`` gives ``F.linear``'s results (to float32 rounding) with weights of
    this shape for each row count of ``CHECK_ROWS`` (every one to 16, then up to
    ``MKL_PACKED_MAX_ROWS``): MKL documents a packed weight for the row count it was packed for,
    and this module packs once for all of them. Checked once per shape in a process (the first
    weight's values stand for the shape's), and not at all for a shape whose plan, read from the plan cache
    of this machine and PyTorch, takes it (measuring checked it: ``use_cpu_kernels``); ``"mkl-packed"`` takes ``F.linear`` for a shape that
    fails. (Every count from 1 to 100 agreed on SmolLM2-135M's five weight shapes; checking them
    all took 3.5 s for its ``lm_head``.)"""
    if _MKL is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    key = (tuple(weight.shape), weight.dtype)
    if key not in _MKL_CHECKED:
        _MKL_CHECKED[key] = _check_mkl_packed(weight.detach(), None if bias is None else bias.detach())
    return _MKL_CHECKED[key]


def _check_mkl_packed(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    generator = torch.Generator().manual_seed(0)
    try:
        packed = _MKL[1](weight, PACK_ROWS)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):  # (under autocast F.linear gave bfloat16)
            for rows in CHECK_ROWS:
                x = torch.randn(rows, weight.shape[1], generator=generator)
                expected = F.linear(x, weight, bias)
                scale = float(expected.abs().max()) or 1.0
                if not torch.allclose(_mkl_packed(x, rows, weight, bias, packed), expected, atol=1e-5 * scale,
                                      rtol=1e-4):
                    logger.warning("MKL with a packed weight disagrees with F.linear at %d rows for a %s weight; "
                                   "not using it", rows, tuple(weight.shape))
                    return False
    except RuntimeError as err:
        logger.warning("MKL with packed weights unavailable (%s)", err)
        return False
    return True


def measure_kernel_plan(layers: Iterable[nn.Linear], rows: Sequence[int] = PLAN_ROWS, repeats: int = 2,
                        budget_bytes: int = MEASURE_BYTES) -> KernelPlan:
    """Time each kernel on ``layers`` (of one weight shape; the first of them holding
    ``budget_bytes`` of weights, in order) for each count in ``rows``, interleaved within each
    repeat so that a noisy machine slows them alike, and keep the fastest (median) per count.
    ``"mkl-packed"`` competes where ``mkl_packed_works`` and for at most ``MKL_PACKED_MAX_ROWS``
    rows (where it works, one row past that count is measured too, without it: the counts past it run on the
    faster of the others). The first round warms up and is discarded."""
    chosen: list[nn.Linear] = []
    held = 0
    for layer in layers:
        chosen.append(layer)
        held += layer.weight.numel() * layer.weight.element_size()
        if held >= budget_bytes:
            break
    if not chosen:
        raise ValueError("measure_kernel_plan needs at least one linear layer")
    shapes = {tuple(layer.weight.shape) for layer in chosen}
    if len(shapes) > 1:
        raise ValueError(f"measure_kernel_plan times layers of one weight shape, got {sorted(shapes)}: "
                         "group them by shape_key (use_cpu_kernels does)")
    caches: list[dict[str, Any]] = [{} for _ in chosen]
    weights = [(layer.weight.detach(), None if layer.bias is None else layer.bias.detach()) for layer in chosen]
    packed_ok = mkl_packed_works(*weights[0])
    rows = sorted(set(int(r) for r in rows) | {1} | ({MKL_PACKED_MAX_ROWS + 1} if packed_ok else set()))
    candidates = {r: [k for k in KERNELS if k != "mkl-packed" or (packed_ok and r <= MKL_PACKED_MAX_ROWS)]
                  for r in rows}
    generator = torch.Generator().manual_seed(0)  # not the global one: train_heads seeds it before loading
    inputs = {r: torch.randn(r, weights[0][0].shape[1], generator=generator) for r in rows}
    times: dict[tuple[int, str], list[float]] = {(r, k): [] for r in rows for k in candidates[r]}
    with torch.no_grad(), torch.autocast("cpu", enabled=False):  # float32 products, as the plans serve
        for repeat in range(repeats + 1):
            for r in rows:
                order = candidates[r][repeat % len(candidates[r]):] + candidates[r][: repeat % len(candidates[r])]
                for kernel in order:
                    start = time.perf_counter()
                    for (weight, bias), cache in zip(weights, caches):
                        _run(kernel, inputs[r], r, weight, bias, cache)
                    if repeat:
                        times[r, kernel].append(time.perf_counter() - start)
    seconds = tuple({k: statistics.median(times[r, k]) for k in candidates[r]} for r in rows)
    return KernelPlan(tuple(rows), tuple(min(s, key=s.get) for s in seconds), seconds)


def shape_key(layer: nn.Linear) -> str:
    """``"out x in"`` of a linear layer's weight, the key of its plan."""
    return "x".join(str(d) for d in layer.weight.shape)


def use_cpu_kernels(model: nn.Module, plan: KernelPlan | str = "tuned", plan_cache: str | Path | None = None) -> int:
    """Switch every ``nn.Linear`` of ``model`` to ``CPULinear`` in place; returns how many layers were
    switched (layers switched before are counted and get the new plan too).

    ``plan``: a ``KernelPlan`` for every layer; ``"onednn"``, oneDNN throughout; ``"tuned"``, one
    plan per weight shape, measured now on the model's layers of that shape
    (``measure_kernel_plan``: which kernel is faster depends on the shape as well as on the number
    of rows). Returns 0 (and changes nothing) when this PyTorch build lacks a working oneDNN kernel.

    ``plan_cache``: with ``"tuned"``, a JSON file of plans measured before, by weight shape and
    ``machine_key``: a shape found there is not measured again, and the plans measured now are
    added to it. Delete the file to measure afresh (say, after a run on a machine busy with other work).

    Only layers whose weights are float32 on the CPU are switched (the kernels serve nothing else, and
    timing float32 inputs on a bfloat16 layer failed); one switched before and cast since keeps its
    class and computes ``F.linear``.
    """
    if isinstance(plan, str) and plan not in ("tuned", "onednn"):
        raise ValueError(f"plan must be a KernelPlan, 'tuned' or 'onednn', got {plan!r}")
    if not onednn_works():
        return 0
    layers = [m for m in model.modules() if type(m) in (nn.Linear, CPULinear)
              and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu" and m.weight.numel() > 0]
    groups: dict[str, list[nn.Linear]] = {}
    for layer in layers:
        groups.setdefault(shape_key(layer), []).append(layer)
    cached = read_plan_cache(plan_cache) if plan == "tuned" and plan_cache is not None else {}
    measured: dict[str, KernelPlan] = {}
    for shape, members in groups.items():
        if plan == "tuned":  # the layers timed (up to MEASURE_BYTES) decide whether reads come from memory
            key = f"{machine_key()}|{shape}|layers={len(members)}"
            found = cached.get(key)
            chosen = found or measured.setdefault(key, measure_kernel_plan(members))
            if found is not None and "mkl-packed" in found.kernels:
                # measured on this machine and PyTorch, where MKL's packed kernel competes only for a shape
                # mkl_packed_works passes: not checked again (16 s for Gemma-3's lm_head, in every process)
                _MKL_CHECKED.setdefault((tuple(members[0].weight.shape), torch.float32), True)
        else:
            chosen = KernelPlan.uniform("onednn") if plan == "onednn" else plan
        for module in members:
            module.__class__ = CPULinear
            module.kernel_plan = chosen
    if measured and plan_cache is not None:
        write_plan_cache(plan_cache, measured)
    return len(layers)


PLAN_CACHE_VERSION = 1  # bumped when what a plan is measured on (rows, repeats, bytes, kernels) changes


def machine_key() -> str:
    """What a measured plan holds for: the CPU (its model name, and a digest of its feature flags and
    cache size, which tell apart CPUs a virtual machine names alike), the threads PyTorch runs on,
    PyTorch's version (and so its MKL and oneDNN), and how plans are measured (``PLAN_CACHE_VERSION``)."""
    name, details = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            fields = dict(line.split(":", 1) for line in handle.read().split("\n\n")[0].splitlines() if ":" in line)
        fields = {key.strip(): value.strip() for key, value in fields.items()}
        name = fields.get("model name", name)
        details = "|" + hashlib.sha256(f"{fields.get('flags')}|{fields.get('cache size')}".encode()).hexdigest()[:8]
    except OSError:
        pass
    return f"v{PLAN_CACHE_VERSION}|{name}{details}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def read_plan_cache(path: str | Path) -> dict[str, KernelPlan]:
    """The plans of a ``use_cpu_kernels`` plan cache by key; empty when the file is missing, and a
    file that cannot be read as one is ignored (with a warning), to be written again."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"a JSON object was expected, got {type(data).__name__}")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as err:  # RecursionError: JSON nested past Python's stack
        logger.warning("ignoring the kernel plan cache %s (%s); measuring again", path, err)
        return {}
    plans = {}
    for key, value in data.items():  # one bad entry costs its own measurement, not the others'
        try:
            plans[str(key)] = KernelPlan.from_dict(value)
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as err:
            logger.warning("ignoring entry %r of the kernel plan cache %s (%s)", key, path, err)
    return plans


def write_plan_cache(path: str | Path, plans: dict[str, KernelPlan]) -> None:
    """Add ``plans`` to the cache file (written whole, readable by all as the rest of the cache, then
    renamed into place, so a reader never sees half a file); a cache that cannot be written is skipped
    with a warning. Writers take turns (a lock file beside the cache, where the platform has ``fcntl``),
    so processes loading models at once, as a multi-process launch does, all keep their plans."""
    path = Path(path)
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(path.with_name(f".{path.name}.lock")):
            merged = {**read_plan_cache(path), **plans}
            handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            with os.fdopen(handle, "w") as out:
                json.dump({key: plan.to_dict() for key, plan in merged.items()}, out, indent=1)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(temporary, 0o666 & ~umask)
            os.replace(temporary, path)
    except OSError as err:
        logger.warning("could not write the kernel plan cache %s (%s)", path, err)
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)


@contextlib.contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file ``lock`` (created if missing) for the block; without
    ``fcntl`` (Windows), no lock."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def forget_packed(model: nn.Module) -> None:
    """Drop every packed weight copy kept in ``model``'s modules, and the heads' gathered ``lm_head`` rows. For
    weights changed through ``.data``
    (peft's ``merge_and_unload`` adds the LoRA delta so), which bumps no version and keeps the storage:
    ``packed_weight`` would go on serving the copy of the old weights."""
    for module in model.modules():
        module.__dict__.pop("_kernel_cache", None)
        module.__dict__.pop("_shared_projection", None)  # (MedusaHeads' lm_head rows of a reduced vocabulary)


def restore_linear(model: nn.Module) -> int:
    """Undo ``use_cpu_kernels``; returns how many layers went back to ``nn.Linear``."""
    count = 0
    for module in model.modules():
        if type(module) is CPULinear:
            module.__class__ = nn.Linear
            module.__dict__.pop("_kernel_cache", None)
            module.__dict__.pop("kernel_plan", None)
            count += 1
    return count


def kernel_plans(model: nn.Module) -> dict[str, KernelPlan]:
    """``{shape_key: plan}`` of ``model``'s switched layers (``use_cpu_kernels``); empty when none is."""
    return {shape_key(m): m.kernel_plan for m in model.modules() if isinstance(m, CPULinear)}


def match_kernels(model: nn.Module, like: nn.Module, plan_cache: str | Path | None = None) -> int:
    """Switch ``model``'s linear layers as ``like``'s are: ``like``'s plan where it has one plan,
    never measured, for every layer (``"onednn"`` or a given ``KernelPlan``), else measured on
    ``model``'s own layers (``"tuned"``; ``plan_cache`` as for ``use_cpu_kernels``: a load of heads
    with their own projections measured 10 s each time without one); nothing when ``like`` has no
    switched layer. Returns how many layers were switched."""
    plans = set(kernel_plans(like).values())
    if not plans:
        return 0
    only = next(iter(plans))
    return use_cpu_kernels(model, only if len(plans) == 1 and not only.seconds else "tuned", plan_cache)


def linear_kernels(model: nn.Module) -> str:
    """What ``model``'s linear layers run on: ``"default"`` (not switched), ``"tuned"`` (measured
    plans, ``kernel_plans`` has them) or the one plan every layer has, described."""
    plans = set(kernel_plans(model).values())
    if not plans:
        return "default"
    if any(plan.seconds for plan in plans):
        return "tuned"
    return "; ".join(sorted(plan.describe() for plan in plans))


def apply_cpu_kernels(model: nn.Module, kernels: str, plan_cache: str | Path | None = None) -> int:
    """``kernels="tuned"`` or ``"onednn"``: ``use_cpu_kernels`` when the model is float32 on the CPU
    (else nothing; ``plan_cache`` as there); ``"default"``: PyTorch's own. Returns the number of layers
    switched."""
    if kernels not in CPU_KERNELS:
        raise ValueError(f"cpu_kernels must be one of {CPU_KERNELS}, got {kernels!r}")
    parameter = next(model.parameters(), None)
    if kernels == "default" or parameter is None:
        return 0
    if parameter.device.type != "cpu" or parameter.dtype != torch.float32:
        return 0
    return use_cpu_kernels(model, kernels, plan_cache)
