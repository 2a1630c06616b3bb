"""The growing cache: the same contents as transformers' DynamicCache under every KVState operation."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig

from medusa_infer.kv_cache import (
    SPARE_SLOTS,
    AttentionLayout,
    GrowingCache,
    KVState,
    cache_keyword,
    copy_cache,
)
from tiny import ARCHITECTURES, VOCAB, tiny_config

LAYOUT = AttentionLayout({"full_attention": None}, as_dict=False)


def _append(kv: KVState, new: int, generator: torch.Generator, layers: int = 2) -> None:
    batch = kv.valid.shape[0]
    for index in range(layers):
        keys = torch.randn(batch, 2, new, 4, generator=generator)
        kv.cache.update(keys, keys * 2, index)
    start = kv.positions[:, -1:] + 1 if kv.num_slots else torch.zeros(batch, 1, dtype=torch.long)
    kv.append(torch.ones(batch, new, dtype=torch.bool), start + torch.arange(new))


def test_growing_cache_matches_dynamic_cache_under_every_operation():
    rng = random.Random(0)
    for trial in range(20):
        states = {cls: KVState(cls(), torch.zeros(3, 0, dtype=torch.bool), torch.zeros(3, 0, dtype=torch.long),
                               LAYOUT) for cls in (GrowingCache, DynamicCache)}
        seed = rng.randrange(1 << 30)
        ops = [rng.choice(["append", "append", "keep_prefix", "keep_gather", "select", "merge", "compact"])
               for _ in range(25)]
        for cls, kv in states.items():
            generator = torch.Generator().manual_seed(seed)
            choice = random.Random(seed)
            _append(kv, 5, generator)
            for op in ops:
                batch = kv.valid.shape[0]
                if op == "append" or batch == 0:
                    _append(kv, choice.randint(1, 40), generator)
                elif op.startswith("keep"):
                    new = choice.randint(2, 6)
                    _append(kv, new, generator)
                    if op == "keep_prefix":
                        keep = torch.arange(choice.randint(1, new)).expand(batch, -1).clone()
                    else:
                        keep = torch.tensor([[choice.randrange(new) for _ in range(2)] for _ in range(batch)])
                        keep[0, 1] = -1  # a hole
                    kv.keep_new(new, keep)
                elif op == "select" and batch > 1:
                    kv.select_rows(torch.tensor(sorted(choice.sample(range(batch), batch - 1))))
                elif op == "merge" and batch < 6:
                    other = KVState(cls(), torch.zeros(1, 0, dtype=torch.bool), torch.zeros(1, 0, dtype=torch.long),
                                    LAYOUT)
                    _append(other, choice.randint(1, 30), generator)
                    kv.merge(other)
                elif op == "compact":
                    kv.compact()
        grown, dynamic = states[GrowingCache], states[DynamicCache]
        assert torch.equal(grown.valid, dynamic.valid) and torch.equal(grown.positions, dynamic.positions)
        for a, b in zip(grown.cache.layers, dynamic.cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), f"trial {trial}: {ops}"


@pytest.mark.parametrize("cls", [GrowingCache, DynamicCache])
@pytest.mark.parametrize("empty_side", [None, "mine"])
def test_a_merge_that_fails_midway_leaves_both_states_as_they_were(cls, empty_side, monkeypatch):
    """Out of memory in one layer's copy (each layer is briefly held twice on a loaded GPU) left earlier layers
    merged and later ones not: the batch's next step failed for every row in it."""
    from medusa_infer import kv_cache

    generator = torch.Generator().manual_seed(0)

    def state(rows: int, slots: int) -> KVState:
        kv = KVState(cls(), torch.zeros(rows, 0, dtype=torch.bool), torch.zeros(rows, 0, dtype=torch.long), LAYOUT)
        if slots:
            _append(kv, slots, generator, layers=3)
        return kv

    def snapshot(kv: KVState) -> list[torch.Tensor]:
        layers = [t.clone() for layer in kv_cache._layers(kv.cache) for t in (layer.keys, layer.values)]
        return [kv.valid.clone(), kv.positions.clone(), *layers]

    for fail_at in range(1, 9):  # each layer's keys and values, then valid and positions
        mine, theirs = state(2, 0 if empty_side == "mine" else 5), state(1, 7)
        before = [snapshot(mine), snapshot(theirs)]
        calls, cat = [0], torch.cat

        def flaky(tensors, *args, **kwargs):
            calls[0] += 1
            if calls[0] == fail_at:
                raise torch.OutOfMemoryError("injected")
            return cat(tensors, *args, **kwargs)

        monkeypatch.setattr(kv_cache.torch, "cat", flaky)
        with pytest.raises(torch.OutOfMemoryError):
            mine.merge(theirs)
        monkeypatch.undo()
        after = [snapshot(mine), snapshot(theirs)]
        assert all(len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(before, after))
        mine.merge(theirs)  # and it merges after all, as one that never failed
        assert mine.valid.shape == (3, 7) and all(layer.keys.shape[:3] == (3, 2, 7)
                                                  for layer in kv_cache._layers(mine.cache))


def test_appends_write_in_place_until_the_buffer_is_full():
    cache = GrowingCache()
    cache.update(torch.zeros(1, 2, 100, 4), torch.zeros(1, 2, 100, 4), 0)
    layer = cache.layers[0]
    first = layer.keys.data_ptr()
    for step in range(SPARE_SLOTS):  # in place until the spare slots are used up
        keys, values = cache.update(torch.full((1, 2, 1, 4), float(step)), torch.ones(1, 2, 1, 4), 0)
        assert keys.data_ptr() == first and keys.shape[2] == 101 + step
    assert torch.equal(layer.keys[0, 0, 100:, 0], torch.arange(float(SPARE_SLOTS)))
    cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)
    assert layer.keys.data_ptr() != first and layer.keys.shape[2] == 101 + SPARE_SLOTS  # full: a larger buffer
    assert torch.equal(layer.keys[0, 0, 100:100 + SPARE_SLOTS, 0], torch.arange(float(SPARE_SLOTS)))
    with pytest.raises(ValueError, match="cannot append slots of shape"):
        layer.keys = layer.keys[:1, :1]  # a cache some other code replaced with the wrong shape
        cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)


def test_a_copy_shares_nothing():
    cache = GrowingCache()
    cache.update(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4), 0)
    copy = copy_cache(cache)
    copy.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)
    assert cache.layers[0].keys.shape[2] == 10 and copy.layers[0].keys.shape[2] == 13
    assert torch.equal(copy.layers[0].keys[:, :, :10], cache.layers[0].keys)
    cache.layers[0].keys.zero_()  # the original written in place: the copy keeps what it copied
    assert copy.layers[0].keys[:, :, :10].abs().sum() > 0


def test_a_state_copies_its_first_layers_alone():
    cache = GrowingCache()
    for index in range(3):
        cache.update(torch.full((2, 1, 4, 2), float(index)), torch.full((2, 1, 4, 2), -float(index)), index)
    layout = AttentionLayout({"full_attention": None}, as_dict=False)
    state = KVState(cache, torch.ones(2, 4, dtype=torch.bool), torch.arange(4).expand(2, 4), layout)
    windowed = AttentionLayout({"sliding_attention": 2}, as_dict=True)
    first = state.copy(2, windowed)
    assert len(first.cache.layers) == 2 and first.layout == windowed and state.layout == layout
    assert [float(layer.values[0, 0, 0, 0]) for layer in first.cache.layers] == [0.0, -1.0]
    first.valid[0, 0] = False
    assert bool(state.valid[0, 0])
    assert len(state.copy().cache.layers) == 3
    for bad in (0, 4):
        with pytest.raises(ValueError, match=f"cannot copy the first {bad} layers of a cache of 3 layers"):
            state.copy(bad)


@pytest.mark.parametrize("arch", ARCHITECTURES + ("gemma3_text-window-8",))
def test_transformers_generate_gives_the_same_tokens_with_a_growing_cache(arch):
    """A GrowingCache is a drop-in DynamicCache for ``generate`` (``scripts/bench_cache.py --loop hf``):
    left padding, and a sliding window it crosses."""
    config = tiny_config(arch.split("-")[0])
    if arch == "gemma3_text-window-8":
        config.sliding_window, config.layer_types = 8, ["sliding_attention", "full_attention"]
        config.num_hidden_layers = 2
    config.initializer_range = 0.2  # outputs that vary (at 0.02, keys halved in the cache left gpt2's tokens as
    torch.manual_seed(0)  # they were: its attention was near uniform)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, VOCAB, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    settings = GenerationConfig(max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        plain = model.generate(input_ids=ids, attention_mask=mask, generation_config=settings)
        grown = model.generate(input_ids=ids, attention_mask=mask, generation_config=settings,
                               **{cache_keyword(model): GrowingCache()})
    assert torch.equal(plain, grown)


@pytest.mark.parametrize("cls", [GrowingCache, DynamicCache])
def test_keeping_every_new_slot_in_place_changes_nothing_and_a_hole_still_counts(cls):
    generator = torch.Generator().manual_seed(3)
    kv = KVState(cls(), torch.zeros(2, 0, dtype=torch.bool), torch.zeros(2, 0, dtype=torch.long), LAYOUT)
    _append(kv, 5, generator)
    _append(kv, 3, generator)
    before = ([layer.keys.clone() for layer in kv.cache.layers], kv.valid.clone(), kv.positions.clone())
    kv.keep_new(3, torch.arange(3).expand(2, -1))  # a fully accepted chain
    assert kv.num_slots == 8
    assert all(torch.equal(layer.keys, keys) for layer, keys in zip(kv.cache.layers, before[0]))
    assert torch.equal(kv.valid, before[1]) and torch.equal(kv.positions, before[2])
    _append(kv, 2, generator)
    kv.keep_new(2, torch.tensor([[0, 1], [0, -1]]))  # row 1 keeps its first new slot only
    assert kv.num_slots == 10
    assert kv.valid[:, -2:].tolist() == [[True, True], [True, False]]


@pytest.mark.parametrize("cls", [GrowingCache, DynamicCache])
def test_a_path_that_does_not_lead_moves_to_the_front_of_the_new_slots(cls):
    generator = torch.Generator().manual_seed(4)
    kv = KVState(cls(), torch.zeros(2, 0, dtype=torch.bool), torch.zeros(2, 0, dtype=torch.long), LAYOUT)
    _append(kv, 6, generator)
    _append(kv, 4, generator)  # a tree of 4 nodes
    layer = kv.cache.layers[0]
    storage = layer.keys.data_ptr()
    tree_keys, tree_values = layer.keys[:, :, 6:].clone(), layer.values[:, :, 6:].clone()
    kv.keep_new(4, torch.tensor([[0, 2, 3], [0, 1, -1]]))  # row 0 kept nodes 0, 2, 3; row 1 nodes 0, 1
    assert kv.num_slots == 9 and layer.keys.shape[2] == layer.values.shape[2] == 9
    for tensor, tree in ((layer.keys, tree_keys), (layer.values, tree_values)):
        assert torch.equal(tensor[0, :, 6:], tree[0][:, [0, 2, 3]])
        assert torch.equal(tensor[1, :, 6:8], tree[1][:, [0, 1]])
    assert kv.valid[:, 6:].tolist() == [[True, True, True], [True, True, False]]
    _append(kv, 1, generator)
    assert kv.num_slots == 10
    if cls is GrowingCache:  # moved within the buffer, and the next step appends into it too
        assert layer.keys.data_ptr() == storage


def test_keeping_a_leading_part_of_the_new_slots_drops_the_rest():
    generator = torch.Generator().manual_seed(5)
    kv = KVState(GrowingCache(), torch.zeros(2, 0, dtype=torch.bool), torch.zeros(2, 0, dtype=torch.long), LAYOUT)
    _append(kv, 4, generator)
    _append(kv, 3, generator)
    kept = kv.cache.layers[0].keys[:, :, :6].clone()
    kv.keep_new(3, torch.arange(2).expand(2, -1))  # every row keeps the first two of three new slots
    assert kv.num_slots == 6 and kv.cache.layers[0].keys.shape[2] == 6
    assert torch.equal(kv.cache.layers[0].keys, kept) and kv.valid.shape == (2, 6)


def test_plain_steps_append_without_the_full_checks(monkeypatch):
    """A run of one-slot updates whose views nothing replaced takes the short path: only the
    first update, which makes the buffer, goes through ``_append_slots``."""
    from medusa_infer import kv_cache

    calls = []
    real = kv_cache._append_slots
    monkeypatch.setattr(kv_cache, "_append_slots", lambda *args: calls.append(1) or real(*args))
    cache = GrowingCache()
    cache.update(torch.zeros(1, 2, 10, 4), torch.zeros(1, 2, 10, 4), 0)
    for step in range(5):
        keys, values = cache.update(torch.full((1, 2, 1, 4), float(step)), torch.ones(1, 2, 1, 4), 0)
    assert len(calls) == 2  # keys and values of the first update
    assert torch.equal(keys[0, 0, 10:, 0], torch.arange(5.0)) and keys.shape[2] == values.shape[2] == 15


@pytest.mark.parametrize("new", [torch.zeros(2, 2, 1, 4), torch.zeros(1, 2, 1, 1), torch.zeros(1, 2, 1, 4).double()])
def test_slots_that_do_not_fit_the_buffer_are_refused_not_broadcast_or_cast(new):
    cache = GrowingCache()
    cache.update(torch.zeros(1, 2, 10, 4), torch.zeros(1, 2, 10, 4), 0)
    cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)  # the short path is armed
    with pytest.raises(ValueError, match="cannot append slots of shape"):
        cache.update(new, new, 0)


def test_every_query_of_a_padded_batch_may_attend_some_slot():
    """Left padding: a padding query attends itself, so that no row of the mask is all minimum (half
    precision turns such a row into -inf and its softmax into NaN, which reaches valid rows through the
    padding slots' keys and values)."""
    for layout in (AttentionLayout({"full_attention": None}, as_dict=False),
                   AttentionLayout({"sliding_attention": 3, "full_attention": None}, as_dict=True)):
        kv = KVState.empty(2, layout, torch.device("cpu"))
        valid = torch.tensor([[False, False, True, True], [True, True, True, True]])
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        causal = torch.ones(4, 4, dtype=torch.bool).tril()
        masks = kv.attention_mask(positions, valid, causal, torch.float16)
        for mask in (masks.values() if isinstance(masks, dict) else [masks]):
            assert bool((mask.amax(dim=-1) == 0).all())


def test_rows_without_layers_join_as_holes_of_their_own_row_count():
    """A joining side that never cached a slot (a draft's prefill skipped for a prompt past its context)
    becomes holes of its own rows, whatever the rows of the side it joins."""
    layout = AttentionLayout({"full_attention": None}, as_dict=False)
    mine = KVState(GrowingCache(), torch.ones(2, 3, dtype=torch.bool), torch.arange(3).expand(2, 3).clone(), layout)
    for index in range(2):
        mine.cache.update(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4), index)
    theirs = KVState.empty(1, layout, torch.device("cpu"))  # one row, no layers
    mine.merge(theirs)
    assert mine.valid.shape == (3, 3) and not bool(mine.valid[2].any())
    assert all(layer.keys.shape[:3] == (3, 2, 3) and layer.values.shape[:3] == (3, 2, 3) for layer in mine.cache.layers)
    assert bool((mine.cache.layers[0].keys[2] == 0).all())


def test_a_state_copies_all_its_layers_when_asked_for_all():
    cache = GrowingCache()
    for index in range(3):
        cache.update(torch.full((2, 1, 4, 2), float(index)), torch.full((2, 1, 4, 2), -float(index)), index)
    layout = AttentionLayout({"full_attention": None}, as_dict=False)
    state = KVState(cache, torch.ones(2, 4, dtype=torch.bool), torch.arange(4).expand(2, 4), layout)
    assert len(state.copy(3).cache.layers) == 3


def test_a_one_token_step_with_a_padding_query_gets_a_mask():
    """The model's own masks know nothing of a padding query: a one-token forward in which a row feeds
    padding takes a 4D mask even where every cached slot may be attended."""
    layout = AttentionLayout({"full_attention": None}, as_dict=False)
    kv = KVState.empty(2, layout, torch.device("cpu"))
    kv.append(torch.ones(2, 4, dtype=torch.bool), torch.arange(4).expand(2, 4))
    one = torch.ones(1, 1, dtype=torch.bool)
    assert kv.attention_mask(torch.full((2, 1), 4), torch.tensor([[True], [False]]), one, torch.float32) is not None


def _reference_mask(kv: KVState, query_positions, query_valid, new_mask, window) -> torch.Tensor:
    """The rule written out entry by entry: a valid query attends a valid slot or a valid new token the tree
    (or causal) mask lets it, less than ``window`` positions behind it; a padding query attends itself alone."""
    batch, new = query_positions.shape
    slots = kv.num_slots
    allowed = torch.zeros(batch, new, slots + new, dtype=torch.bool)
    for b in range(batch):
        for q in range(new):
            for k in range(slots + new):
                valid, position = (kv.valid[b, k], kv.positions[b, k]) if k < slots else \
                    (query_valid[b, k - slots], query_positions[b, k - slots])
                order = True if k < slots else bool(new_mask[b, q, k - slots])
                near = window is None or int(query_positions[b, q]) - int(position) < window
                allowed[b, q, k] = (bool(valid) and order and near) or (not query_valid[b, q] and k == slots + q)
    return allowed


def test_masks_follow_the_rule_entry_by_entry():
    """Holes among the slots, padding among the new tokens, tree masks per row, sliding windows of 1 to 6."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        window = [None, 1, 2, 3, 6][trial % 5]
        layout = AttentionLayout({"sliding_attention": window, "full_attention": None}, as_dict=True) if window \
            else LAYOUT
        batch, slots, new = (int(torch.randint(1, n, (), generator=generator)) for n in (4, 9, 7))
        kv = KVState.empty(batch, layout, torch.device("cpu"))
        kv.valid = torch.rand(batch, slots, generator=generator) > 0.3
        kv.positions = torch.randint(0, 12, (batch, slots), generator=generator)
        query_valid = torch.rand(batch, new, generator=generator) > 0.3
        query_positions = torch.randint(0, 16, (batch, new), generator=generator) * query_valid
        new_mask = torch.rand(batch, new, new, generator=generator) > 0.5
        masks = kv.attention_mask(query_positions, query_valid, new_mask, torch.float32)
        for layer_type, mask in (masks.items() if isinstance(masks, dict) else [("full_attention", masks)]):
            expected = _reference_mask(kv, query_positions, query_valid, new_mask, layout.windows[layer_type])
            assert torch.equal(mask[:, 0] == 0, expected), (trial, layer_type)


def test_a_padded_prefill_builds_no_tensor_larger_than_its_masks():
    """A long left-padded prefill's masks are its largest tensors: the sliding window's int64 distances took
    twice a float mask's memory (2.6 GB against transformers' 0.8 GB for two rows of 8k tokens)."""
    from torch.profiler import ProfilerActivity, profile

    batch, length = 2, 512
    layout = AttentionLayout({"sliding_attention": 64, "full_attention": None}, as_dict=True)
    kv = KVState.empty(batch, layout, torch.device("cpu"))
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, :10] = False
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as trace:
        kv.attention_mask(positions, valid, causal, torch.float32)
    assert max(event.cpu_memory_usage for event in trace.events()) <= batch * length * length * 4
