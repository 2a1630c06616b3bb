"""Per-request KV cache bookkeeping: which cache slots are valid, their positions, and the masks.

Rows of a batch accept different numbers of tokens each step, yet a transformers cache stores one
``[batch, kv_heads, seq, head_dim]`` tensor per layer. ``KVState`` therefore lets every row keep
its own accepted path in the same number of new slots and marks the slots a row does not use as
holes (``valid == False``). Masks are built from the validity and the position of every slot, so
holes, left padding and sliding windows are all handled by one rule:

    query q may attend slot s  <=>  valid[s] and (tree or causal order allows it)
                                     and (no window or pos[q] - pos[s] < window)
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache, DynamicLayer


@dataclass(frozen=True)
class AttentionLayout:
    """Which attention kinds a model's layers use and their windows.

    Attributes:
        windows: layer-type name -> sliding window (None: full attention).
        as_dict: pass masks as a ``{layer_type: mask}`` dict (models with mixed layer types).
    """

    windows: dict[str, int | None]
    as_dict: bool

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> "AttentionLayout":
        config = config.get_text_config()
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        if layer_types and "sliding_attention" in layer_types:
            types = dict.fromkeys(layer_types)
            return cls({t: (window if t == "sliding_attention" else None) for t in types}, as_dict=True)
        if layer_types or getattr(config, "use_sliding_window", True) is False:
            # layer types that name no sliding layer decide (a Qwen config with use_sliding_window and
            # max_window_layers >= num_hidden_layers keeps a sliding_window no layer uses)
            window = None
        return cls({"full_attention": window}, as_dict=False)


@dataclass
class KVState:
    """A cache plus, per row, the validity and position of every slot.

    Attributes:
        cache: the transformers cache (one tensor per layer, all rows the same length).
        valid: ``[batch, slots]`` bool, False for left padding and for holes.
        positions: ``[batch, slots]`` position id of each slot.
        layout: the model's attention layout.
    """

    cache: Any
    valid: torch.Tensor
    positions: torch.Tensor
    layout: AttentionLayout

    @classmethod
    def empty(cls, batch: int, layout: AttentionLayout, device: torch.device) -> "KVState":
        return cls(
            GrowingCache(),
            torch.zeros(batch, 0, dtype=torch.bool, device=device),
            torch.zeros(batch, 0, dtype=torch.long, device=device),
            layout,
        )

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    def attention_mask(
        self,
        query_positions: torch.Tensor,
        query_valid: torch.Tensor,
        new_mask: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """The 4D float mask(s) for a forward of new tokens over the cache plus themselves, or
        None where the model's own masks say the same, so that attention takes its causal or
        unmasked kernels:

        * a prefill: the cache is empty, no new token is padding and ``new_mask`` is causal. A
          materialised 4D mask made a 1000-token prefill of the default model 10% slower on a
          2-core CPU (1.70 s against 1.55 s; ``scripts/bench_prefill.py`` measures it);
        * a plain decoding step: one new token, which may attend every slot (none is a hole or
          padding, and every slot lies within each sliding window). Building and applying the
          mask cost 1.3-1.6% of such a step of the default model after 200 tokens on a 2-core
          CPU (``scripts/bench_prefill.py --tokens 200 --decode-steps 64`` measures it). Logits
          agree with the masked step's to float rounding (about 1e-6 with SDPA), not bit for bit.

        Args:
            query_positions: ``[batch, new]`` position ids of the new tokens.
            query_valid: ``[batch, new]`` False for padding among the new tokens.
            new_mask: ``[new, new]`` or ``[batch, new, new]`` bool: which new token may attend
                which (causal for a prompt, the tree mask for a candidate tree).
            dtype: the model's dtype.

        Returns:
            ``[batch, 1, new, slots + new]`` float masks (0 allowed, dtype minimum elsewhere), as
            a dict keyed by layer type for models with mixed layer types; or None (see above).
        """
        batch, new = query_positions.shape
        if self.num_slots == 0 and bool(query_valid.all()) and new_mask.dim() == 2 and torch.equal(
                new_mask, torch.ones(new, new, dtype=torch.bool, device=new_mask.device).tril()):
            return None
        if new == 1 and bool(new_mask.all()) and bool(query_valid.all()) and self._attends_every_slot(query_positions):
            return None
        key_valid = torch.cat([self.valid, query_valid], dim=1)
        key_positions = torch.cat([self.positions, query_positions], dim=1)
        if new_mask.dim() == 2:
            new_mask = new_mask.expand(batch, new, new)
        # [batch, new, slots + new] bool tensors only (a long padded prefill's masks are its largest tensors:
        # an int64 distance of that shape took twice the memory of the float mask returned)
        allowed = torch.cat([key_valid[:, None, :self.num_slots].expand(batch, new, self.num_slots),
                             new_mask & query_valid[:, None, :]], dim=2)
        padding = ~query_valid
        if bool(padding.any()):  # a query that may attend nothing (left padding) attends itself: softmax stays finite
            diagonal = torch.arange(new, device=allowed.device)
            allowed[:, diagonal, self.num_slots + diagonal] |= padding
        masks = {}
        minimum = torch.finfo(dtype).min
        for layer_type, window in self.layout.windows.items():
            ok = allowed
            if window is not None:  # keys less than `window` positions behind the query (itself always among them)
                ok = allowed & (key_positions[:, None, :] > (query_positions - window)[:, :, None])
            mask = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, minimum)
            masks[layer_type] = mask[:, None]
        return masks if self.layout.as_dict else next(iter(masks.values()))

    def _attends_every_slot(self, query_positions: torch.Tensor) -> bool:
        """Whether queries at ``query_positions`` may attend every slot: no slot is a hole or
        padding, and none lies outside a sliding window, neither by position (the rule of the
        masks built here) nor by slot index (transformers places the new token at slot
        ``num_slots`` and builds its own sliding-window masks from slot indices). Cautious across
        rows: the largest query position against the smallest slot position."""
        if not bool(self.valid.all()):
            return False
        windows = [w for w in self.layout.windows.values() if w is not None]
        if not windows or not self.num_slots:
            return True
        span = int(query_positions.max() - self.positions.min())
        return max(span, self.num_slots) < min(windows)

    def append(self, valid: torch.Tensor, positions: torch.Tensor) -> None:
        """Record slots the last forward appended to the cache (``[batch, new]`` each)."""
        self.valid = torch.cat([self.valid, valid], dim=1)
        self.positions = torch.cat([self.positions, positions], dim=1)

    def keep_new(self, num_new: int, keep: torch.Tensor) -> None:
        """Keep, of the last ``num_new`` slots, those at ``keep`` (``[batch, m]``, -1 for a hole).

        Each row keeps its own slots (its accepted path) gathered into ``m`` slots; the other new
        slots are dropped without a second forward.
        """
        start = self.num_slots - num_new
        in_front = keep == torch.arange(keep.shape[1], device=keep.device)
        if keep.shape[1] == num_new and bool(in_front.all()):
            return  # every new slot kept where it is (a plain step, a fully accepted chain)
        index = keep.clamp(min=0)
        # The kept slots move to the front of the new ones, in place (the gather copies them out
        # first), and a leading view then drops the rest: no step copies the whole cache. Where
        # they are already in front (holes aside, whose contents no query sees), nothing moves.
        prefix = bool((in_front | (keep < 0)).all())
        end = start + keep.shape[1]
        for layer in _layers(self.cache):
            for name in ("keys", "values"):
                tensor = getattr(layer, name)
                if not prefix:
                    new = tensor[:, :, start:]
                    gather = index[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3])
                    tensor[:, :, start:end] = new.gather(2, gather)
                setattr(layer, name, tensor[:, :, :end])
        self.valid = torch.cat([self.valid[:, :start], self.valid[:, start:].gather(1, index) & (keep >= 0)], dim=1)
        self.positions = torch.cat([self.positions[:, :start], self.positions[:, start:].gather(1, index)], dim=1)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` (``[k]`` indices), e.g. after some rows finished."""
        for layer in _layers(self.cache):
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)
        self.valid = self.valid.index_select(0, rows)
        self.positions = self.positions.index_select(0, rows)

    def merge(self, other: "KVState") -> None:
        """Append the rows of ``other`` (same model); the shorter side is left-padded with holes. A
        side that never cached a slot (no forward ran: a draft model's prefill skipped for a prompt
        past its context) has no layers, and its rows become holes in the other side's.

        All or nothing: a merge that fails (out of memory in a layer's copy) leaves both states as they were
        (merged layers are cut back to views of their rows: a half-merged cache broke the batch's next step).
        ``other`` is never changed: a side without layers takes layer objects of its own (it took ``other``'s, so
        an undone merge, ``DecodeBatch.merge``'s, emptied the joining batch's draft cache)."""
        mine, theirs = _layers(self.cache), _layers(other.cache)
        if mine and theirs and len(mine) != len(theirs):
            raise ValueError(f"cannot merge caches of {len(mine)} and {len(theirs)} layers")
        width = max(self.num_slots, other.num_slots)
        cache, rows = self.cache, len(self.valid)
        merged: list[tuple[Any, str, int]] = []  # (layer, name, its slots before)
        try:
            if not mine:  # its layers' objects copied (their tensors shared until replaced), my rows put first below
                self.cache = copy.copy(other.cache)
                self.cache.layers = [copy.copy(layer) for layer in other.cache.layers]
            for index, layer in enumerate(mine or _layers(self.cache)):
                for name in ("keys", "values"):
                    parts = [_pad_slots(getattr(side[index], name), width) if side else
                             _holes(getattr(layer, name), len(state.valid), width)
                             for side, state in ((mine, self), (theirs, other))]
                    before = getattr(layer, name).shape[2]
                    setattr(layer, name, torch.cat(parts))
                    merged.append((layer, name, before))
            valid = torch.cat([_pad_slots(self.valid, width), _pad_slots(other.valid, width)])
            positions = torch.cat([_pad_slots(self.positions, width), _pad_slots(other.positions, width)])
        except BaseException:
            for layer, name, before in merged if mine else ():  # (views: nothing to allocate while memory ran out)
                tensor = getattr(layer, name)[:rows]
                setattr(layer, name, tensor[:, :, tensor.shape[2] - before:])
            self.cache = cache  # (a side without layers: the copies dropped)
            raise
        self.valid, self.positions = valid, positions

    def copy(self, layers: int | None = None, layout: AttentionLayout | None = None) -> "KVState":
        """A copy of this state sharing no tensor with it: of every layer's cache, or of the first
        ``layers`` alone (a draft that runs the model's own first layers starts from them) with
        that draft's ``layout``."""
        have = len(_layers(self.cache))
        if layers is not None and not 0 < layers <= have:
            raise ValueError(f"cannot copy the first {layers} layers of a cache of {have} layers")
        return KVState(copy_cache(self.cache, layers), self.valid.clone(), self.positions.clone(),
                       layout or self.layout)

    def compact(self) -> None:
        """Drop slot columns that are holes in every row (keeps the cache from growing needlessly)."""
        used = self.valid.any(dim=0)
        if bool(used.all()):
            return
        columns = used.nonzero().squeeze(1)
        for layer in _layers(self.cache):
            layer.keys = layer.keys.index_select(2, columns)
            layer.values = layer.values.index_select(2, columns)
        self.valid = self.valid.index_select(1, columns)
        self.positions = self.positions.index_select(1, columns)


SPARE_SLOTS = 256  # room a GrowingLayer buffer keeps past its slots: memory bounded, a copy every 256 steps


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends new slots into spare capacity instead of concatenating.

    ``DynamicLayer.update`` concatenates, so every decoding step copies the layer's whole cache, a
    cost that grows with the batch and the context (``python scripts/bench_cache.py`` measures it;
    README, KV cache). This layer keeps its keys and
    values in buffers with room to spare and exposes ``keys`` / ``values`` as leading views of them;
    an update writes the new slots in place. Whenever ``keys`` is no longer a leading view of the
    buffer (``KVState`` selected or merged rows into a fresh tensor), the next update
    copies it into a new buffer, so every other operation on the cache stays as it is. Cutting
    ``keys`` to a shorter leading view (dropping rejected tree slots) keeps the buffer: the next
    update overwrites the dropped slots, which nothing reads any more. While ``keys`` and
    ``values`` are still the very views the last update returned (a run of plain steps), an update
    checks only the room left and the new slots' shape: on a GPU, where a small model's forward
    costs its Python and kernel launches, every check shows in the time per token
    (``scripts/bench_loop_overhead.py`` measures the loop's overhead).
    """

    def __init__(self) -> None:
        super().__init__()
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._handed_out: tuple[torch.Tensor, torch.Tensor] | None = None  # the views update returned last

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        key_buffer, value_buffer = self._buffers or (None, None)
        handed_out = self._handed_out
        if handed_out is not None and self.keys is handed_out[0] and self.values is handed_out[1]:
            # nothing replaced the views since the last update (a plain step): they are leading
            # views of the buffers, so only the room and the new slots' shape need checking
            length = self.keys.shape[-2]
            needed = length + key_states.shape[-2]
            if needed <= key_buffer.shape[-2] and _fits(key_buffer, key_states) and _fits(value_buffer, value_states):
                key_buffer.narrow(2, length, key_states.shape[-2]).copy_(key_states)
                value_buffer.narrow(2, length, value_states.shape[-2]).copy_(value_states)
                self.keys, self.values = key_buffer.narrow(2, 0, needed), value_buffer.narrow(2, 0, needed)
                self._handed_out = (self.keys, self.values)
                return self.keys, self.values
        self.keys, key_buffer = _append_slots(self.keys, key_buffer, key_states)
        self.values, value_buffer = _append_slots(self.values, value_buffer, value_states)
        self._buffers = (key_buffer, value_buffer)
        self._handed_out = (self.keys, self.values)
        return self.keys, self.values

    def reset(self) -> None:
        self._buffers = None
        self._handed_out = None
        super().reset()


class GrowingCache(DynamicCache):
    """A ``DynamicCache`` of :class:`GrowingLayer` layers (what ``KVState.empty`` starts with)."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)


def copy_cache(cache: Any, count: int | None = None) -> GrowingCache:
    """A ``GrowingCache`` with the contents of ``cache`` (``KVState``'s: every layer a full-length
    layer, all initialised), or of its first ``count`` layers, sharing no tensor with it (each
    layer's first update writes into a new buffer)."""
    copy = GrowingCache()
    for index, layer in enumerate(cache.layers[:count]):
        copy.update(layer.keys, layer.values, index)
    return copy


def cache_keyword(module: Any) -> str:
    """The name under which ``module.forward`` (a stock transformers model) and its ``generate``
    take a KV cache: ``cache`` from transformers 5.2x, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def _append_slots(current: torch.Tensor, buffer: torch.Tensor | None, new: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(current + new along the slot axis, the buffer holding it)``; in place when ``current`` is
    a leading view of ``buffer`` with room for ``new``, else in a new buffer with ``SPARE_SLOTS``
    to spare."""
    length = current.shape[-2] if current.dim() == 4 else 0
    needed = length + new.shape[-2]
    in_place = (
        buffer is not None and current.dim() == 4 and current.data_ptr() == buffer.data_ptr()
        and current.stride() == buffer.stride() and current.shape[:2] == buffer.shape[:2]
        and current.shape[-1] == buffer.shape[-1] and needed <= buffer.shape[-2] and _fits(buffer, new)
    )
    if not in_place:
        if length and (current.shape[:2] != new.shape[:2] or current.shape[-1] != new.shape[-1]
                       or current.dtype != new.dtype or current.device != new.device):
            raise ValueError(f"cannot append slots of shape {tuple(new.shape)} ({new.dtype}, {new.device}) to a "
                             f"cache of shape {tuple(current.shape)} ({current.dtype}, {current.device})")
        buffer = new.new_empty((*new.shape[:2], needed + SPARE_SLOTS, new.shape[-1]))
        if length:
            buffer[:, :, :length].copy_(current)
    buffer[:, :, length:needed].copy_(new)
    return buffer[:, :, :needed], buffer


def _fits(buffer: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether ``new`` slots can be written into ``buffer`` as they are: same rows, heads, head
    size, dtype and device (``copy_`` would otherwise broadcast or cast them without a word)."""
    return (new.shape[:2] == buffer.shape[:2] and new.shape[-1] == buffer.shape[-1]
            and new.dtype == buffer.dtype and new.device == buffer.device)


def _holes(like: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``[rows, heads, width, dim]`` zeros shaped as ``like``'s slots: rows holding no slot."""
    return like.new_zeros((rows, like.shape[1], width, like.shape[3]))


def _pad_slots(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad the slot axis (2 for ``[batch, heads, slots, dim]``, 1 for ``[batch, slots]``) with zeros."""
    axis = 2 if tensor.dim() == 4 else 1
    missing = width - tensor.shape[axis]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[axis] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=axis)


def _layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(
            f"{type(cache).__name__} exposes no per-layer key/value tensors; "
            "medusa-forge needs a transformers DynamicCache (transformers >= 5)"
        )
    return [layer for layer in layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]
