"""The decoding loop on tiny models: exactness, batching, tree attention, stopping, errors."""

from __future__ import annotations

import itertools
import random
import re
import time
from unittest import mock

import pytest
import torch

from medusa_infer import acceptance as rules
from medusa_infer.adaptive import StepCosts
from medusa_infer.chat import chat_prompt_ids
from medusa_infer.decoding import StopConfig, encode_chat, generate, generator_seed, resolve_tree, stream
from medusa_infer.kv_cache import AttentionLayout, KVState
from medusa_infer.metrics import GenerationMetrics
from medusa_infer.model import MedusaModel
from medusa_infer.proposers.autoregressive import AutoregressiveProposer
from medusa_infer.proposers.base import Proposal, StepContext
from medusa_infer.tree_fit import CostProfile
from medusa_infer.trees import TREE_PRESETS, build_tree_buffers, get_tree, root_only_tree, tree_depth
from tiny import ARCHITECTURES, VOCAB, sanitizes_control_tokens, sliding_window_base, tiny_model, word_medusa

EXACT_ARCHS = ("llama", "qwen3", "gemma3_text", "gpt2")
NO_EOS: list[int] = []


def medusa(arch: str, seed: int = 0, num_heads: int = 4, **kwargs) -> MedusaModel:
    """A tiny model with random (untrained) heads, so that proposals are partly right."""
    model = MedusaModel.from_base(tiny_model(arch, seed=seed, **kwargs), num_heads=num_heads, num_layers=1)
    torch.manual_seed(seed + 1)
    for p in model.heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model


def reference(model: MedusaModel, prompt: torch.Tensor, max_new_tokens: int, eos: int | None = None) -> list[int]:
    """Hugging Face greedy decoding of one unpadded prompt ``[seq]``."""
    out = model.base_model.generate(
        prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=max_new_tokens,
        do_sample=False, eos_token_id=eos, pad_token_id=0,
    )
    tokens = out[0, len(prompt):].tolist()
    if eos is not None and eos in tokens:
        tokens = tokens[: tokens.index(eos) + 1]
    return tokens


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        mask[row, width - len(p):] = 1
    return ids, mask


class OracleProposer:
    """Proposes a tree in which the target's own greedy continuation sits at a random rank of each
    depth (or, with ``rank=0``, a chain of exactly that continuation); other nodes get random tokens."""

    def __init__(self, futures: list[list[int]], paths, seed: int = 0) -> None:
        self.futures, self.paths = futures, [tuple(p) for p in paths]
        self.rng = random.Random(seed)
        self.rows = list(range(len(futures)))
        self.emitted = [0] * len(futures)

    def start(self, context: StepContext, hidden: torch.Tensor) -> None:
        pass

    def propose(self, roots: torch.Tensor, context: StepContext) -> Proposal:
        paths = [p for p in self.paths if len(p) <= context.max_depth]
        tree = build_tree_buffers(paths, 4, 10) if paths else root_only_tree()
        tokens = torch.zeros(len(self.rows), tree.num_nodes, dtype=torch.long)
        for i, row in enumerate(self.rows):
            future = self.futures[row][self.emitted[row] + 1:]
            truth_rank = [self.rng.randrange(2) for _ in range(4)]
            tokens[i, 0] = roots[i]
            for node, path in enumerate(tree.paths, start=1):
                on_truth = all(r == truth_rank[d] for d, r in enumerate(path))
                depth = len(path)
                tokens[i, node] = future[depth - 1] if on_truth and depth <= len(future) else self.rng.randrange(3, VOCAB)
        return Proposal(tokens, tree)

    def observe(self, accepted, hidden, context) -> None:
        for row, tokens in zip(self.rows, accepted):
            self.emitted[row] += len(tokens)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in rows.tolist()]


@pytest.mark.parametrize("arch", EXACT_ARCHS)
def test_greedy_identical_to_generate_on_50_prompts(arch):
    model = medusa(arch)
    gen = torch.Generator().manual_seed(0)
    for i in range(50):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen)
        tree = ("tree-8", "tree-16", "chain-3")[i % 3]
        out = generate(model, prompt[None], max_new_tokens=16, tree=tree, eos_token_id=5)
        assert out.new_tokens[0] == reference(model, prompt, 16, eos=5), f"prompt {i}"
        assert torch.equal(out.sequences[0, : len(prompt)], prompt)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_batched_rows_identical_to_running_alone(arch, batch):
    model = medusa(arch)
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, VOCAB, (int(torch.randint(1, 14, (1,), generator=gen)),), generator=gen)
               for _ in range(batch)]
    ids, mask = left_pad(prompts)
    out = generate(model, ids, attention_mask=mask, max_new_tokens=20, tree="tree-16", eos_token_id=7,
                   speculation_gate=False)  # every step a tree step, whatever the machine's timings
    for row, prompt in enumerate(prompts):
        assert out.new_tokens[row] == reference(model, prompt, 20, eos=7), f"row {row}"
        alone = generate(model, prompt[None], max_new_tokens=20, tree="tree-16", eos_token_id=7)
        assert out.new_tokens[row] == alone.new_tokens[0]
    # sequences are laid out as model.generate lays them out: prompt, new tokens, pad
    hf = model.base_model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                                   eos_token_id=7, pad_token_id=0)
    assert torch.equal(out.sequences[:, : hf.shape[1]], hf)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_oracle_chain_reaches_depth_plus_one(arch, depth):
    model = medusa(arch)
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (4, 9, 6)]
    max_new = 4 * (depth + 1) + 1  # the prefill token, then whole steps
    futures = [reference(model, p, max_new) for p in prompts]
    ids, mask = left_pad(prompts)
    chain = TREE_PRESETS[f"chain-{depth}"]
    oracle = OracleProposer(futures, chain)
    oracle.rng = _ZeroRng()
    out = generate(model, ids, attention_mask=mask, max_new_tokens=max_new, proposer=oracle, eos_token_id=NO_EOS)
    assert out.new_tokens == futures
    assert out.metrics.tau == pytest.approx(depth + 1)
    assert out.metrics.acceptance_by_depth == [1.0] * depth


class _ZeroRng(random.Random):
    """Puts the truth at rank 0 every time (a pure chain oracle)."""

    def randrange(self, *args):  # noqa: D401 - same signature as random.Random
        return 0 if args == (2,) else super().randrange(*args)


@pytest.mark.parametrize("arch", EXACT_ARCHS)
def test_partial_oracle_trees_stay_exact_in_batches(arch):
    """Truth hidden at random ranks: rows accept different lengths every step, all stay exact."""
    model = medusa(arch)
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (2, 11, 5, 8)]
    futures = [reference(model, p, 30) for p in prompts]
    ids, mask = left_pad(prompts)
    oracle = OracleProposer(futures, TREE_PRESETS["tree-16"], seed=3)
    out = generate(model, ids, attention_mask=mask, max_new_tokens=30, proposer=oracle, eos_token_id=NO_EOS,
                   speculation_gate=False)  # every step a tree step, whatever the machine's timings
    assert out.new_tokens == futures
    assert out.metrics.tau > 1.5


def test_only_an_unpadded_prefill_or_an_unrestricted_plain_step_leaves_the_mask_to_the_model():
    kv = KVState.empty(2, AttentionLayout.from_config(medusa("llama").base_model.config), torch.device("cpu"))
    positions = torch.arange(4).expand(2, 4)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    valid = torch.ones(2, 4, dtype=torch.bool)
    assert kv.attention_mask(positions, valid, causal, torch.float32) is None
    padded = valid.clone()
    padded[1, 0] = False
    assert kv.attention_mask(positions, padded, causal, torch.float32).shape == (2, 1, 4, 4)
    assert kv.attention_mask(positions, valid, torch.eye(4, dtype=torch.bool), torch.float32) is not None
    kv.append(valid, positions)  # with a cache, several new tokens always get a 4D mask
    assert kv.attention_mask(positions + 4, valid, causal, torch.float32).shape == (2, 1, 4, 8)
    one, root = torch.ones(2, 1, dtype=torch.bool), torch.ones(1, 1, dtype=torch.bool)
    assert kv.attention_mask(torch.full((2, 1), 4), one, root, torch.float32) is None  # a plain step
    with_padding = KVState(kv.cache, padded, kv.positions, kv.layout)
    assert with_padding.attention_mask(torch.full((2, 1), 4), one, root, torch.float32).shape == (2, 1, 1, 5)
    for window, unmasked in ((5, True), (4, False)):  # 4 slots at 0..3, the new token at 4
        windowed = KVState(kv.cache, valid, positions, AttentionLayout({"full_attention": window}, as_dict=False))
        mask = windowed.attention_mask(torch.full((2, 1), 4), one, root, torch.float32)
        assert (mask is None) == unmasked


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_an_unmasked_plain_step_gives_the_masked_steps_logits(arch):
    model = medusa(arch)
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    layout = AttentionLayout.from_config(model.base_model.config)
    logits = []
    for unmasked in (True, False):
        kv = KVState.empty(1, layout, model.device)
        with torch.no_grad():
            positions = torch.arange(8)[None]
            valid = torch.ones_like(positions, dtype=torch.bool)
            model(ids[:, :8], attention_mask=None, position_ids=positions, cache=kv.cache)
            kv.append(valid, positions)
            root, position = torch.ones(1, 1, dtype=torch.bool), torch.full((1, 1), 8)
            mask = kv.attention_mask(position, root, root, model.dtype)
            assert mask is None  # all 9 positions lie within every tiny model's window
            if not unmasked:  # the 4D mask such a step used to get: every slot allowed
                zeros = torch.zeros(1, 1, 1, 9, dtype=model.dtype)
                mask = {t: zeros for t in layout.windows} if layout.as_dict else zeros
            logits.append(model(ids[:, 8:], attention_mask=mask, position_ids=position, cache=kv.cache).logits)
    assert (logits[0] - logits[1]).abs().max() <= 1e-5


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tree_forward_matches_sequential_paths(arch):
    model = medusa(arch)
    prompt = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    tree = build_tree_buffers(TREE_PRESETS["tree-16"], 4, 10)
    tokens = torch.randint(3, VOCAB, (1, tree.num_nodes), generator=torch.Generator().manual_seed(2))
    kv = KVState.empty(1, AttentionLayout.from_config(model.base_model.config), model.device)
    with torch.no_grad():
        ids = prompt[:, :-1]
        positions = torch.arange(ids.shape[1])[None]
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
        mask = kv.attention_mask(positions, torch.ones_like(ids, dtype=torch.bool), causal, model.dtype)
        model(ids, attention_mask=mask, position_ids=positions, cache=kv.cache)
        kv.append(torch.ones_like(ids, dtype=torch.bool), positions)
        tokens[0, 0] = prompt[0, -1]
        positions = ids.shape[1] + tree.depths[None]
        valid = torch.ones_like(positions, dtype=torch.bool)
        mask = kv.attention_mask(positions, valid, tree.attn_mask, model.dtype)
        tree_logits = model(tokens, attention_mask=mask, position_ids=positions, cache=kv.cache).logits[0]
        for node in range(tree.num_nodes):
            chain = [node]
            while tree.parents[chain[-1]] >= 0:
                chain.append(int(tree.parents[chain[-1]]))
            path = torch.cat([ids[0], tokens[0, list(reversed(chain))]])[None]
            sequential = model.base_model(path).logits[0, -1]
            assert (tree_logits[node] - sequential).abs().max() <= 1e-4, f"node {node}"


@pytest.mark.parametrize("arch", ["gemma3_text", "mistral"])
def test_sliding_window_models_stay_exact_past_the_window(arch):
    assert_exact_past_the_window(MedusaModel.from_base(sliding_window_base(arch, 6), num_heads=4), 24)


def assert_exact_past_the_window(model: MedusaModel, new_tokens: int) -> None:
    """Tree steps (an oracle's drafts) over a padded batch of a 3- and a 10-token prompt, and the longer
    prompt alone, give Hugging Face's greedy tokens well past a 6-token window."""
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 10)]
    futures = [reference(model, p, new_tokens) for p in prompts]
    ids, mask = left_pad(prompts)
    out = generate(model, ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=NO_EOS,
                   proposer=OracleProposer(futures, TREE_PRESETS["tree-8"], seed=1))
    assert out.new_tokens == futures
    # one unpadded row: the prefill takes the model's own (sliding-window) masks, past the window
    out = generate(model, prompts[1][None], max_new_tokens=new_tokens, eos_token_id=NO_EOS,
                   proposer=OracleProposer(futures[1:], TREE_PRESETS["tree-8"], seed=1))
    assert out.new_tokens == futures[1:]


@pytest.mark.parametrize("types", [["full_attention"] * 2, ["sliding_attention", "full_attention"]],
                         ids=["all-full", "mixed"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_layers_keep_the_attention_their_layer_types_name_past_the_window(arch, types):
    # Qwen configs with use_sliding_window and max_window_layers >= num_hidden_layers: every layer is
    # full attention, while the config still holds a sliding_window that no layer uses
    base = sliding_window_base(arch, 6, layer_types=types)
    layout = AttentionLayout.from_config(base.config)
    assert set(layout.windows.values()) == ({None, 6} if "sliding_attention" in types else {None})
    assert_exact_past_the_window(MedusaModel.from_base(base, num_heads=4), 16)


@pytest.mark.parametrize("arch", ["gemma3_text", "mistral"])
def test_plain_steps_stay_exact_across_the_window_after_a_row_leaves(arch):
    model = MedusaModel.without_heads(sliding_window_base(arch, 8, attn_implementation="sdpa"))
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (2, 4)]
    expected = reference(model, prompts[0], 12)
    ids, mask = left_pad(prompts)
    chunks = stream(model, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=NO_EOS,
                    proposer=AutoregressiveProposer(model))
    unmasked = []
    for _ in chunks:
        state = chunks.state
        if 1 in state.rows:
            state.cancel(1)  # row 0 goes on alone: its padding columns are compacted away
        elif state.rows:
            unmasked.append(state.kv._attends_every_slot(state.root_pos[:, None]))
    assert chunks.result().new_tokens[0] == expected
    assert True in unmasked and unmasked[-1] is False  # unmasked steps, then masked ones past the window


def test_streaming_yields_the_same_tokens_in_order():
    model = medusa("llama")
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 6)]
    ids, mask = left_pad(prompts)
    chunks = stream(model, ids, attention_mask=mask, max_new_tokens=12, tree="tree-8", eos_token_id=NO_EOS)
    seen: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks:
        seen[chunk.row].extend(chunk.token_ids)
    result = chunks.result()
    assert seen == {0: result.new_tokens[0], 1: result.new_tokens[1]}
    assert all(len(t) == 12 for t in seen.values())


def test_a_draft_a_row_stops_on_counts_as_accepted():
    """A row that stops on a draft (here its 4th, the EOS) emits no token after it: its drafts are all it
    emitted, and acceptance by depth counts the 4th as accepted (it counted one draft fewer, taking every
    step to end in a token of its own)."""
    model = medusa("llama")
    prompt = torch.tensor([5, 17, 33, 41, 8, 60])
    future = reference(model, prompt, 12)
    assert future[4] not in future[:4]
    every_path = [p for depth in range(1, 5) for p in itertools.product(range(2), repeat=depth)]
    out = generate(model, prompt[None], max_new_tokens=12, proposer=OracleProposer([future], every_path),
                   eos_token_id=[future[4]])
    assert out.new_tokens[0] == future[:5] and out.metrics.steps == 1
    assert out.metrics.accepted_by_depth == [1, 1, 1, 1] and out.metrics.acceptance_by_depth == [1.0] * 4
    assert out.metrics.step_tokens == 4 and out.metrics.new_tokens == 5


def test_acceptance_by_depth_counts_only_the_drafts_a_row_could_emit():
    """With the truth always in the tree, every depth's acceptance is 1.0: a row cut short by its own
    max_new_tokens (beside a row that sets the tree's depth) and a row that ends on an EOS draft were counted
    as rejecting the right drafts past that point (0.857 / 0.833 and 0.0 at depths 3 and 4)."""
    from medusa_infer.decoding import DecodeBatch, SamplingConfig, StopConfig

    model = medusa("llama")
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (4, 9)]
    futures = [reference(model, p, 30) for p in prompts]
    every_path = [p for depth in range(1, 5) for p in itertools.product(range(2), repeat=depth)]
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        batch = DecodeBatch(model, ids, mask, OracleProposer(futures, every_path), SamplingConfig(),
                            [StopConfig(3), StopConfig(30)], None, None)
        batch.prefill()
        while not batch.done:
            batch.step()
    assert batch.generated == {0: futures[0][:3], 1: futures[1]}
    assert batch.metrics.acceptance_by_depth == [1.0] * 4
    assert batch.metrics.offered_by_depth[0] > batch.metrics.offered_by_depth[3]  # row 0 could emit 2 drafts only
    future = futures[1]
    assert future[2] not in future[:2]
    out = generate(model, prompts[1][None], max_new_tokens=30, proposer=OracleProposer([future], every_path),
                   eos_token_id=[future[2]])
    assert out.new_tokens[0] == future[:3] and out.metrics.steps == 1
    assert out.metrics.acceptance_by_depth == [1.0, 1.0]  # depths 3 and 4 came after the end


def test_a_streams_seconds_leave_out_the_time_its_consumer_keeps_each_chunk():
    """medusa-generate writes each chunk out before asking for the next: that time was the generation's,
    so its tokens/s and TPOT depended on the terminal (streamed ~17x slower than generate() in a repro)."""
    model = medusa("llama")
    chunks = stream(model, torch.tensor([[5, 17, 33]]), max_new_tokens=8, tree="tree-8", eos_token_id=NO_EOS)
    slept = 0.0
    for _ in chunks:
        time.sleep(0.2)
        slept += 0.2
    metrics = chunks.result().metrics
    assert slept >= 0.4 and metrics.total_s < slept  # a tiny model's eight tokens take milliseconds
    assert metrics.tokens_per_s > 8 / slept


def test_stops_at_any_eos_and_at_max_new_tokens():
    model = medusa("qwen2")
    prompt = torch.randint(3, VOCAB, (5,), generator=torch.Generator().manual_seed(4))
    free = reference(model, prompt, 30)
    eos_a, eos_b = free[6], free[3]
    out = generate(model, prompt[None], max_new_tokens=30, eos_token_id=[eos_a, eos_b])
    assert out.new_tokens[0] == free[: free.index(eos_b) + 1] and out.finish_reasons == ["eos"]
    # given as an iterator (map, a generator): the check read it empty, and no row stopped on any end token
    out = generate(model, prompt[None], max_new_tokens=30, eos_token_id=iter([eos_a, eos_b]))
    assert out.new_tokens[0] == free[: free.index(eos_b) + 1] and out.finish_reasons == ["eos"]
    out = generate(model, prompt[None], max_new_tokens=9, eos_token_id=NO_EOS)
    assert out.new_tokens[0] == free[:9] and out.finish_reasons == ["length"]


def test_finished_rows_are_padded_with_the_generation_configs_first_eos_as_model_generate_pads_them():
    """With no pad id anywhere, the first of the generation config's end ids pads (the smallest of all the
    end ids did: 80 where model.generate writes 86)."""
    model = medusa("llama")
    base = base.generation_config if (base := model.base_model) else None
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 7)]
    free, other = reference(model, prompts[0], 12), reference(model, prompts[1], 12)
    early = next(t for t in free[1:] if t not in other)  # ends row 0 and not row 1
    late = max(t for t in range(3, VOCAB) if t not in free + other)  # ends none: it only pads
    assert late > early
    base.eos_token_id, base.pad_token_id = [late, early], None
    model.base_model.config.pad_token_id = model.base_model.config.eos_token_id = None
    ids, mask = left_pad(prompts)
    ours = generate(model, ids, attention_mask=mask, max_new_tokens=12)
    theirs = model.base_model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert ours.sequences.tolist() == theirs.tolist()
    assert ours.sequences[0, -1].item() == late
    # a tokenizer's pad id (Llama-3's usual pad_token = eos_token) is not model.generate's: it padded with it
    from tiny import metaspace_tokenizer

    tokenizer = metaspace_tokenizer()
    assert tokenizer.pad_token_id not in (None, late)
    with_tokenizer = MedusaModel(model.base_model, model.heads, tokenizer)
    assert generate(with_tokenizer, ids, attention_mask=mask, max_new_tokens=12).sequences.tolist() == theirs.tolist()
    # nor the model config's beside a generation config without one (model.generate pads with the end id)
    model.base_model.config.pad_token_id = 0
    assert model.base_model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False).tolist() \
        == theirs.tolist()
    assert generate(model, ids, attention_mask=mask, max_new_tokens=12).sequences.tolist() == theirs.tolist()
    from medusa_infer.decoding import eos_ids

    base.eos_token_id = [late, late, early]  # each id once
    assert eos_ids(model, None) == (late, early)


def test_context_limit_is_a_clean_stop():
    model = medusa("llama")
    limit = model.base_model.config.max_position_embeddings
    prompt = torch.randint(3, VOCAB, (limit - 10,), generator=torch.Generator().manual_seed(0))
    out = generate(model, prompt[None], max_new_tokens=50, tree="tree-16", eos_token_id=NO_EOS)
    assert out.finish_reasons == ["context"]
    assert len(prompt) + len(out.new_tokens[0]) == limit
    assert out.new_tokens[0] == reference(model, prompt, 10)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "empty prompt"),
        (dict(input_ids=torch.full((1, 300), 5)), "^prompt of 300 tokens does not fit the model's context of 256 .*at most 255"),
        (dict(input_ids=torch.full((1, 256), 5)), "^prompt of 256 tokens does not fit .*at most 255 tokens"),
        (dict(input_ids=torch.full((3, 256), 5), attention_mask=torch.tensor([[0] * 250 + [1] * 6, [1] * 256,
                                                                            [0] * 200 + [1] * 56])),
         "^row 1's prompt of 256 tokens does not fit .*at most 255 tokens"),
        (dict(tree=[(0,), (0, 0, 0, 0)]), "no parent"),
        (dict(tree=[(0, 0, 0, 0, 0)]), "depth 5 but there are only 4 heads"),
        (dict(do_sample=True, temperature=-0.5), "temperature must be a finite number >= 0"),
        (dict(do_sample=True, top_p=0.0), "top_p must be in"),
        (dict(do_sample=True, top_p=1.5), "top_p must be in"),
        (dict(do_sample=True, top_k=-1), "top_k must be an integer >= 0"),
        (dict(do_sample=True, top_k=2.5), r"top_k must be an integer >= 0 \(0 disables it\), got 2.5"),
        (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
        (dict(acceptance="typical"), "pass do_sample=True"),
        (dict(do_sample=True, acceptance="beam"), "acceptance must be one of"),
        (dict(do_sample=True, acceptance="greedy", temperature=1.5, top_k=5),
         "acceptance='greedy' takes the model's top token.*would change nothing"),
        (dict(tree="tree-1000"), "tree-1000"),
        (dict(stop_strings=["ok", ""]), "empty stop string"),
        (dict(do_sample=True, acceptance="typical", top_k=5), "temperature only.*would ignore top_k=5;"),
        (dict(do_sample=True, acceptance="typical", top_p=0.9), "temperature only.*would ignore top_p=0.9;"),
        (dict(input_ids=torch.tensor([[5.9, 17.9]])), "integer token ids, got dtype torch.float32"),
        (dict(input_ids=torch.tensor([[True, False]])), "integer token ids, got dtype torch.bool"),
        (dict(input_ids=torch.ones(1, 2, 3, dtype=torch.long)),
         r"\[batch, length\] or \[length\], got shape \(1, 2, 3\)"),
        (dict(input_ids=[[3, 4], [5, 6]], attention_mask=[[1, 1], [1, 0]]), r"right-padded \(row 1 ends in padding\)"),
        (dict(input_ids=[[3, 4], [5, 6]], attention_mask=[[1, 1], [0, 0]]), r"row 1's attention_mask is all 0"),
        (dict(attention_mask=torch.tensor([[2, 2, 2]])), r"only 0 \(padding\) and 1 \(token\), got values \[2\]"),
        (dict(max_new_tokens=True), "max_new_tokens must be a positive integer, got True"),
        (dict(tree=3), "tree must be a preset name"),
        (dict(eos_token_id="</s>"), "eos_token_id must be a token id in \\[0, 96\\).*got '</s>'"),
        (dict(eos_token_id=-1), "eos_token_id must be a token id"),
        (dict(eos_token_id=2.0), "eos_token_id must be a token id in .* got 2.0"),
        (dict(eos_token_id=[2, 10**6]), "eos_token_id must be a token id"),
        # a typo was told to pass do_sample=True, and only then named
        (dict(acceptance="losless"), r"acceptance must be one of \('greedy', 'typical', 'lossless'\), got 'losless'"),
        # failed at the first step with an AttributeError ('str' object has no attribute 'speculate')
        (dict(speculation_gate="off"), "speculation_gate must be True, False, None or a SpeculationGate, got 'off'"),
        # a setting read from JSON, YAML or a command line as text: "false" sampled
        (dict(do_sample="false"), "do_sample must be True or False, got 'false'"),
        (dict(do_sample=2), "do_sample must be True or False, got 2"),
        (dict(do_sample=torch.tensor([True, False])), "do_sample must be True or False"),
        # rows of different lengths or a list of tensors: torch's own words, with no way out
        (dict(input_ids=[[5, 6, 7], [8, 9]]), "left-pad rows of different lengths and pass attention_mask="),
        (dict(input_ids=[torch.tensor([5, 6]), torch.tensor([8])]), "rows of equal length"),
        # it named neither the id nor a fix
        (dict(input_ids=torch.tensor([[5, 96]])), r"input_ids: token id 96 is outside the vocabulary \[0, 96\): "
                                                  r"encode prompts with the model's tokenizer"),
        # read as float32 tensors: "must hold integer token ids"
        (dict(input_ids=[]), "empty prompt"),
        (dict(input_ids=[[]]), "empty prompt"),
        # a tokenizer's output given whole: blamed on rows of different lengths, told to pass attention_mask=
        (dict(input_ids={"input_ids": torch.tensor([[5, 6]]), "attention_mask": torch.ones(1, 2)}),
         r"got a mapping of \['attention_mask', 'input_ids'\]: unpack a tokenizer's output, generate\(model, "
         r"\*\*encoded\)"),
    ],
)
def test_bad_input_is_a_clear_value_error(kwargs, message):
    """(A list of rows as tensors of one length is a batch.)"""
    model = medusa("llama")
    rows = [torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10])]
    assert generate(model, input_ids=rows, max_new_tokens=2, eos_token_id=NO_EOS).new_tokens == \
        generate(model, input_ids=torch.stack(rows), max_new_tokens=2, eos_token_id=NO_EOS).new_tokens
    kwargs.setdefault("input_ids", torch.tensor([[5, 6, 7]]))
    with pytest.raises(ValueError, match=message):
        generate(model, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tree="no-such-tree"), "tree='no-such-tree' shapes the Medusa proposer that stream\\(\\) builds"),
        (dict(tree=[(0,)]), "does not apply to a proposer passed in"),
        (dict(adaptive=True), "adaptive=True sets the fallback"),
        (dict(adaptive=False), "adaptive=False sets the fallback"),
        (dict(lookup_tokens=2), "lookup_tokens= grafts prompt lookup"),
    ],
)
def test_medusa_options_beside_a_proposer_are_refused(kwargs, message):
    """tree=, adaptive=, step_costs= and lookup_tokens= shape the Medusa proposer stream() builds:
    with a proposer passed in they would go unused, so they raise."""
    model = medusa("llama")
    with pytest.raises(ValueError, match=message):
        generate(model, torch.tensor([[5, 6, 7]]), proposer=AutoregressiveProposer(model), **kwargs)


def test_an_attention_mask_beside_text_is_refused():
    """prompt= and messages= are padded here with their own mask: one given beside them went unused."""
    for text in (dict(prompt="the cat"), dict(messages=[{"role": "user", "content": "the cat"}])):
        with pytest.raises(ValueError, match="attention_mask= goes with input_ids="):
            generate(word_medusa(0), attention_mask=torch.zeros(1, 9), max_new_tokens=2, **text)


def test_an_empty_prompt_text_a_tokenizer_gives_a_bos_is_a_prompt():
    """prompt="" with a tokenizer that adds a BOS (Gemma's, Llama 2's) is that token, as input_ids=[[bos]]
    (it was refused as empty before tokenising); without one it stays an empty prompt."""
    from tokenizers.processors import TemplateProcessing

    model = word_medusa(0)
    with pytest.raises(ValueError, match="empty prompt"):
        generate(model, prompt="", max_new_tokens=2)
    model.tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert model.tokenizer("")["input_ids"] == [1]
    assert generate(model, prompt="", max_new_tokens=4).new_tokens == \
        generate(model, torch.tensor([[1]]), max_new_tokens=4).new_tokens


@pytest.mark.parametrize("prompt, message", [
    ([], "empty prompt"),
    (["the cat", ""], r"row 1 \(''\) tokenises to no token"),  # (which row was not said)
    (5, "prompt must be a string or a list of strings, got int"),
    (["the cat", 5], "prompt must be a string or a list of strings, got list"),
])
def test_bad_prompt_text_is_a_clear_value_error(prompt, message):
    with pytest.raises(ValueError, match=message):
        generate(word_medusa(0), prompt=prompt, max_new_tokens=2)


def test_integer_types_of_numpy_and_torch_are_integers():
    np = pytest.importorskip("numpy")
    model = medusa("llama")
    ids = torch.tensor([[5, 6, 7]])
    expected = generate(model, ids, max_new_tokens=3, eos_token_id=0).new_tokens
    for count, eos in ((np.int64(3), np.int64(0)), (torch.tensor(3).item(), [np.int32(0)])):
        assert generate(model, ids, max_new_tokens=count, eos_token_id=eos).new_tokens == expected


def test_right_padding_is_refused():
    model = medusa("llama")
    with pytest.raises(ValueError, match="pad on the left"):
        generate(model, torch.tensor([[5, 6, 0]]), attention_mask=torch.tensor([[1, 1, 0]]))


def test_a_mask_with_a_gap_inside_the_prompt_is_refused_only_where_a_window_makes_it_differ():
    """A 0 after a 1 in a row's mask: a sliding window counted in positions here and in cache slots by
    transformers decoded such a row unlike ``model.generate`` (at batch size 1, plain steps too); without a
    window the answer is ``model.generate``'s."""
    ids, mask = torch.tensor([[3, 8, 6, 12, 0, 9, 10]]), torch.tensor([[1, 1, 1, 1, 0, 1, 1]])
    windowed = MedusaModel.from_base(sliding_window_base("mistral", 5), num_heads=2)
    with pytest.raises(ValueError, match=r"attention_mask row 0 has a 0 after a 1 .*sliding-window"):
        generate(windowed, ids, attention_mask=mask, max_new_tokens=10)
    wide = MedusaModel.from_base(sliding_window_base("mistral", 4096), num_heads=2)  # past the context: no slide
    out = generate(wide, ids, attention_mask=mask, max_new_tokens=10, eos_token_id=NO_EOS)
    expected = wide.base_model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
    assert out.new_tokens[0] == expected[0, ids.shape[1]:].tolist()
    model = medusa("llama")
    out = generate(model, ids, attention_mask=mask, max_new_tokens=10, eos_token_id=NO_EOS)
    expected = model.base_model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)
    assert out.new_tokens[0] == expected[0, ids.shape[1]:].tolist()


def test_typical_and_lossless_sampling_run_and_are_reproducible(monkeypatch):
    """Each acceptance runs its own rule, with the step's settings (the typical branch calling the greedy rule
    passed: runs, reproducible, as long)."""

    model = medusa("llama")
    prompt = torch.tensor([[5, 6, 7, 8]])
    called: list[tuple[str, float]] = []
    for name in ("accept_typical", "accept_lossless", "accept_greedy"):
        real = getattr(rules, name)

        def spy(logits, tokens, tree, *args, _real=real, _name=name, **kwargs):
            called.append((_name, args[0] if args else None))
            return _real(logits, tokens, tree, *args, **kwargs)

        monkeypatch.setattr(rules, name, spy)
    for acceptance, top_p in (("typical", 1.0), ("lossless", 0.9)):  # typical takes no top-p
        called.clear()
        a = generate(model, prompt, max_new_tokens=20, do_sample=True, temperature=0.8, top_p=top_p,
                     acceptance=acceptance, seed=11, eos_token_id=NO_EOS)
        assert called and set(called) == {(f"accept_{acceptance}", 0.8)}  # every step: its rule, its temperature
        b = generate(model, prompt, max_new_tokens=20, do_sample=True, temperature=0.8, top_p=top_p,
                     acceptance=acceptance, seed=11, eos_token_id=NO_EOS)
        assert a.new_tokens == b.new_tokens and len(a.new_tokens[0]) == 20


def test_metrics_are_filled():
    model = medusa("llama")
    out = generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=12, tree="tree-8", eos_token_id=NO_EOS)
    m = out.metrics
    assert m.new_tokens == 12 and m.steps >= 1 and m.tau >= 1.0
    assert len(m.acceptance_by_depth) == 3
    assert m.ttft_s > 0 and m.total_s >= m.ttft_s and m.tokens_per_s > 0
    assert set(m.phase_s) == {"propose", "verify", "accept", "commit"} and m.phase_s["verify"] > 0
    assert "tau" in m.to_dict() and "tokens_per_s" in m.to_dict()
    assert f"tau {m.tau:.2f}," in m.summary()
    # a call whose rows all ended at their first token took no decoding step: no tau to tell (it said 1.00,
    # where medusa-bench says "-")
    one = generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=1, tree="tree-8", eos_token_id=NO_EOS).metrics
    assert one.steps == 0 and "0 steps, tau -," in one.summary()


def test_tpot_charges_a_row_the_steps_it_was_decoding_in():
    """Rows of 2 and 40 tokens decoded together: TPOT is about one step's time (it charged every row the
    whole batch's decoding time, about twice that here)."""
    from medusa_infer.metrics import GenerationMetrics

    steps, step_s = 39, 0.001
    m = GenerationMetrics(steps=steps, row_steps=1 + steps, new_tokens=2 + 40, rows=2, ttft_s=0.002,
                          total_s=0.002 + steps * step_s)
    assert m.tpot_s == pytest.approx(step_s)
    alone = GenerationMetrics(steps=steps, row_steps=steps, new_tokens=40, rows=1, ttft_s=0.002,
                              total_s=0.002 + steps * step_s)
    assert alone.tpot_s == pytest.approx(step_s)


def test_batches_merge_between_steps_and_rows_can_be_cancelled():
    """Rows joining a running batch (as the server does) and leaving it stay exact."""
    from medusa_infer.decoding import DecodeBatch, SamplingConfig, StopConfig
    from medusa_infer.proposers.medusa import MedusaProposer

    model = medusa("llama")
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (4, 9, 6)]
    futures = [reference(model, p, 20) for p in prompts]
    tree = TREE_PRESETS["tree-8"]

    def batch(rows):
        ids, mask = left_pad([prompts[r] for r in rows])
        return DecodeBatch(model, ids, mask, MedusaProposer(model, tree), SamplingConfig(),
                           StopConfig(20), None, None)

    with torch.no_grad():
        running = batch([0])
        running.prefill()
        running.step()
        late = batch([1, 2])
        late.prefill()
        assert running.merge(late) == [1, 2]
        running.step()
        running.cancel(2)
        while not running.done:
            running.step()
    assert running.generated[0] == futures[0] and running.generated[1] == futures[1]
    assert running.finish[2] == "cancelled" and futures[2][: len(running.generated[2])] == running.generated[2]
    assert running.row_steps[0] >= 1 and running.row_accepted[0] + running.row_steps[0] + 1 == len(futures[0])
    emitted = sum(len(tokens) for tokens in running.generated.values())  # the joining rows' prefill tokens included
    assert running.metrics.new_tokens == running.metrics.rows + running.metrics.step_tokens == emitted


def test_the_heads_read_each_rows_last_hidden_state_after_accepted_drafts_and_a_merge():
    """Exactness hides a proposer that reads the wrong state (greedy verification keeps the output the model's):
    the heads read the root's hidden state instead of the last accepted token's, or, after rows joined, another
    row's, and only drafted worse. Checked against a fresh forward over each row's history."""
    from medusa_infer.decoding import DecodeBatch, SamplingConfig, StopConfig
    from medusa_infer.proposers.medusa import MedusaProposer

    model = medusa("llama")
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (4, 9, 6)]

    def batch(rows):
        ids, mask = left_pad([prompts[r] for r in rows])
        return DecodeBatch(model, ids, mask, MedusaProposer(model, TREE_PRESETS["tree-8"], lookup_tokens=4),
                           SamplingConfig(), StopConfig(80), None, None)

    def wrong_rows(running):  # the state after the token before each row's root
        return [row for i, row in enumerate(running.rows) if not torch.allclose(
            running.proposer.hidden[i], model(torch.tensor([running.histories[row][:-1]])).hidden_states[0, -1],
            atol=1e-4)]

    accepting = 0
    with torch.no_grad():
        running = batch([0])
        running.prefill()
        for _ in range(12):
            before = running.row_accepted[0]
            running.step()
            accepting += running.row_accepted[0] > before
            assert wrong_rows(running) == []
        late = batch([1, 2])
        late.prefill()
        running.merge(late)
        assert wrong_rows(running) == []
    assert accepting >= 1  # (steps that accepted drafts were checked)


def test_batches_of_two_methods_are_refused_a_merge_by_name():
    """A layerskip batch joining a draft batch was told "DraftProposer batches cannot be merged"."""
    from medusa_infer.decoding import DecodeBatch, SamplingConfig, StopConfig
    from medusa_infer.proposers.autoregressive import AutoregressiveProposer
    from medusa_infer.proposers.lookup import LookupProposer

    model = medusa("llama")
    ids, mask = left_pad([torch.arange(3, 9)])
    with torch.no_grad():
        lookup, plain = (DecodeBatch(model, ids, mask, proposer, SamplingConfig(), StopConfig(6), None, None)
                         for proposer in (LookupProposer(model), AutoregressiveProposer(model)))
        lookup.prefill()
        plain.prefill()
        with pytest.raises(ValueError, match="AutoregressiveProposer's batch cannot join LookupProposer's"):
            lookup.merge(plain)


def test_a_finished_row_can_release_its_tokens():
    """A server batch that rows keep joining never ends: delivered rows must not keep their tokens."""
    from medusa_infer.decoding import DecodeBatch, SamplingConfig, StopConfig
    from medusa_infer.proposers.autoregressive import AutoregressiveProposer

    model = medusa("llama")
    ids, mask = left_pad([torch.arange(3, 9), torch.arange(3, 12)])
    with torch.no_grad():
        batch = DecodeBatch(model, ids, mask, AutoregressiveProposer(model), SamplingConfig(), StopConfig(6), None,
                            None)
        batch.prefill()
        batch.step()
        with pytest.raises(ValueError, match="still decoding"):
            batch.release(0)
        while not batch.done:
            batch.step()
    batch.release(1)
    for name in DecodeBatch.ROW_TABLES:  # nothing of the row is kept: not its tokens, stop settings or counts
        assert list(getattr(batch, name)) == [0], name
    # nor in a table the code's own list leaves out (a review: a table missing from ROW_TABLES kept the row)
    assert not [name for name, value in vars(batch).items() if isinstance(value, dict) and 1 in value]
    assert len(batch.generated[0]) == 6
    with pytest.raises(ValueError, match="row 1 is not in this batch .* or was released already"):
        batch.release(1)
    with pytest.raises(ValueError, match=r"1 rows were released"):
        batch.output(0)


@pytest.mark.parametrize("kwargs, name", [
    (dict(tree="chain-2"), "tree="),
    (dict(lookup_tokens=4), "lookup_tokens="),
    (dict(adaptive=True), "adaptive="),
    (dict(step_costs=StepCosts()), "step_costs="),
])
def test_medusa_options_without_heads_are_refused(kwargs, name):
    """Without heads stream() decodes plainly: an option of the Medusa proposer would go unused."""
    model = MedusaModel(tiny_model("llama"), None)
    with pytest.raises(ValueError, match=f"{name}.*this model has no Medusa heads"):
        generate(model, torch.tensor([[5, 6, 7, 5, 6, 7]]), max_new_tokens=4, eos_token_id=NO_EOS, **kwargs)


def test_several_prompts_with_a_tokenizer_that_has_no_pad_token():
    """GPT-2's and Llama 2's tokenizers have no pad token: the tokenizer refused to pad the prompts."""
    from tiny import metaspace_tokenizer

    tokenizer = metaspace_tokenizer()
    tokenizer.pad_token = None
    base = tiny_model("llama", vocab_size=len(tokenizer))
    base.config.pad_token_id = base.generation_config.pad_token_id = None
    model = MedusaModel.without_heads(base, tokenizer)
    prompts = ["the cat", "the cat sat on"]
    together = generate(model, prompt=prompts, max_new_tokens=3, eos_token_id=NO_EOS).new_tokens
    assert together == [generate(model, prompt=p, max_new_tokens=3, eos_token_id=NO_EOS).new_tokens[0]
                        for p in prompts]


def test_none_is_not_set_as_hugging_face_takes_it():
    """generate's None defaults (stop_strings, top_k, top_p, temperature) and an EOS id as a tensor."""
    model = medusa("llama")
    ids = torch.tensor([[5, 6, 7, 8]])
    greedy = generate(model, ids, max_new_tokens=4, eos_token_id=[]).new_tokens
    for kwargs in (dict(stop_strings=None), dict(top_k=None), dict(top_p=None), dict(temperature=None)):
        assert generate(model, ids, max_new_tokens=4, eos_token_id=[], **kwargs).new_tokens == greedy, kwargs
    sampled = generate(model, ids, max_new_tokens=4, eos_token_id=[], do_sample=True, seed=0).new_tokens
    for kwargs in (dict(top_k=None), dict(top_p=None), dict(temperature=None)):
        assert generate(model, ids, max_new_tokens=4, eos_token_id=[], do_sample=True, seed=0,
                        **kwargs).new_tokens == sampled, kwargs
    first = greedy[0][0]
    assert generate(model, ids, max_new_tokens=4, eos_token_id=torch.tensor(first)).new_tokens == [[first]]
    import numpy as np  # (a 0-d array failed with a bare TypeError: iteration over a 0-d array)

    for given in (np.array(first), np.array([first]), np.int64(first)):
        assert generate(model, ids, max_new_tokens=4, eos_token_id=given).new_tokens == [[first]]


def test_step_costs_without_an_adaptive_fallback_are_refused():
    """step_costs= is learned by the fallback's controller: where the call runs none (adaptive=False,
    heads without a calibration) it went unused, silently."""
    model = medusa("llama")  # uncalibrated heads: no fallback
    for kwargs in (dict(), dict(adaptive=False)):
        costs = StepCosts()
        with pytest.raises(ValueError, match="step_costs= is learned by the adaptive fallback"):
            generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=3, step_costs=costs, **kwargs)


def test_a_stop_string_given_as_one_str_is_one_stop_string():
    """Hugging Face takes ``stop_strings="..."``: it is one stop string, not one per character."""
    model = word_medusa(0)
    prompt = "the cat sat on the mat and the dog"
    free = generate(model, prompt=prompt, max_new_tokens=40, eos_token_id=NO_EOS).new_tokens[0]
    words = model.tokenizer.decode(free[:12]).split()
    stop = " ".join(words[-2:])
    as_str = generate(model, prompt=prompt, max_new_tokens=40, eos_token_id=NO_EOS, stop_strings=stop)
    as_list = generate(model, prompt=prompt, max_new_tokens=40, eos_token_id=NO_EOS, stop_strings=[stop])
    assert as_str.finish_reasons == as_list.finish_reasons == ["stop"]
    assert as_str.new_tokens == as_list.new_tokens and len(as_str.new_tokens[0]) > 2
    # given as a generator: read up by the special-token lookup before StopConfig saw it (no stop at all)
    as_generator = generate(model, prompt=prompt, max_new_tokens=40, eos_token_id=NO_EOS,
                            stop_strings=(text for text in [stop]))
    assert as_generator.new_tokens == as_str.new_tokens and as_generator.finish_reasons == ["stop"]
    assert model.tokenizer.decode(as_str.new_tokens[0]).endswith(stop)


def test_generate_documents_every_argument_stream_takes():
    """typical_epsilon and typical_delta, the only way to set typical acceptance's thresholds, were named nowhere a
    user would look."""
    import inspect

    documented = generate.__doc__
    for name in inspect.signature(stream).parameters:
        assert name == "model" or re.search(rf"\b{name}\b[^\n]*:", documented), name


def test_typical_thresholds_are_checked_and_none_is_not_set():
    """None is "not set" for every sampling argument but the typical thresholds, whose None was refused (and, under
    lossless, said to choose typical acceptance); SamplingConfig kept any threshold under another rule unchecked
    (a list failed the first step; an unused value split rows of equal settings into two groups)."""
    from medusa_infer.decoding import SamplingConfig

    model = word_medusa(0)
    for acceptance in ("typical", None):
        generate(model, prompt="the cat", max_new_tokens=3, do_sample=True, seed=0, acceptance=acceptance,
                 typical_epsilon=None, typical_delta=None)
    with pytest.raises(ValueError, match="typical_epsilon=0.5 and typical_delta=0.3 set typical acceptance, and this "
                                         "config accepts by 'lossless'; pass acceptance='typical', or leave them"):
        SamplingConfig("lossless", 0.7, typical_epsilon=0.5)
    with pytest.raises(ValueError, match=r"typical_delta must be a number, got \[0.3\]"):
        SamplingConfig("greedy", typical_delta=[0.3])
    with pytest.raises(ValueError, match="epsilon \\(posterior threshold\\) must lie in \\(0, 1\\], got 5.0"):
        SamplingConfig("typical", 0.7, typical_epsilon=5.0)
    import numpy as np

    assert SamplingConfig("lossless", 0.7, typical_epsilon=np.float64(0.09)) == SamplingConfig("lossless", 0.7)


def test_a_stop_string_that_is_not_valid_unicode_is_refused_before_decoding():
    """A lone surrogate (half a JSON escape pair) was taken, then failed the engine step that encoded it, and every
    request batched with it; generate() failed with a UnicodeEncodeError naming no argument."""
    for stops in ("\ud83d", ["fox", "a\udc00"]):
        with pytest.raises(ValueError, match="is not valid Unicode \\(a lone surrogate at [01]\\): give whole"):
            StopConfig(5, (), stops)
        with pytest.raises(ValueError, match="is not valid Unicode"):
            generate(word_medusa(0), prompt="the cat", max_new_tokens=4, stop_strings=stops)
    assert StopConfig(5, (), "\U0001F389").stop_strings == ("\U0001F389",)


def test_a_special_tokens_text_written_as_plain_pieces_still_stops_as_a_stop_string():
    """A stop string that is a special token's text stops at that token; a model may also write the text as plain
    pieces (a fine-tune whose data tokenised the marker as text), which it stops at as at any stop string."""
    from medusa_infer.models import load_tokenizer
    from tiny import scripted_model

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    pieces = tokenizer.convert_tokens_to_ids(["<", "file", "_", "sep", ">"])
    assert tokenizer.convert_tokens_to_ids("<file_sep>") not in pieces  # a special token of that text exists
    script = tokenizer("Sure", add_special_tokens=False)["input_ids"] + pieces + tokenizer(
        " then more", add_special_tokens=False)["input_ids"]
    out = generate(scripted_model(tokenizer, script), torch.tensor([script[:1]]), max_new_tokens=12,
                   stop_strings=["<file_sep>"], eos_token_id=[])
    assert out.finish_reasons == ["stop"] and out.new_tokens[0] == script[1:6]  # through ">"


@pytest.mark.parametrize("tree", ["tree-16", "chain-4"])
def test_the_cache_holds_the_committed_tokens_and_no_hole(tree):
    """At batch 1, after every step the cache holds the prompt and each generated token but the
    last (the next root, verified by the next step): a step keeps only its accepted path's slots,
    so no hole is left behind and a plain step keeps the model's unmasked kernels."""
    model = medusa("llama")
    prompt = torch.tensor([[5, 17, 33, 9, 60]])
    chunks = stream(model, prompt, max_new_tokens=60, tree=tree, eos_token_id=NO_EOS)
    state, checked = chunks.state, 0
    for _ in chunks:
        if state.rows:
            assert state.kv.num_slots == prompt.shape[1] + len(state.generated[0]) - 1
            assert bool(state.kv.valid.all())
            checked += 1
    metrics = chunks.result().metrics
    assert checked == metrics.steps  # the prefill's chunk, then every step but the last
    assert 1 < metrics.tau < 1 + tree_depth(TREE_PRESETS[tree])  # some drafts accepted, some rejected


def test_tau_and_acceptance_count_the_tokens_emitted():
    """Tokens a step accepted past an EOS (or a stop string, or max_new_tokens) are dropped, and
    are not counted: tau, the accepted counts by depth and each row's counts add up to the output."""
    from medusa_infer.proposers import DraftProposer

    model = medusa("llama")
    prompt = torch.tensor([5, 17, 33, 9, 60])
    free = reference(model, prompt, 20)
    eos = free[7]
    assert eos not in free[:7]
    draft = tiny_model("llama", seed=0)  # the target's own weights: every draft is accepted
    chunks = stream(model, prompt[None], max_new_tokens=20, eos_token_id=eos,
                    proposer=DraftProposer(model, draft, num_tokens=8, schedule="constant"))
    out = chunks.result()
    metrics, state = out.metrics, chunks.state
    assert out.new_tokens[0] == free[:8] and out.finish_reasons == ["eos"]
    assert metrics.steps == 1 and metrics.tau == 7.0  # the prefill's token, then 7 (of 9 accepted) kept
    # all 7 drafts, the EOS the 7th: the step emitted no token of its own after them
    assert state.row_steps[0] == 1 and metrics.step_tokens == 7
    assert sum(metrics.accepted_by_depth) == state.row_accepted[0] == 7
    assert metrics.new_tokens == metrics.rows + metrics.step_tokens


def test_rows_counts_add_up_to_their_output_in_a_batch():
    from medusa_infer.proposers import DraftProposer

    model = medusa("llama")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (3, 8, 5)]
    ids, mask = left_pad(prompts)
    free = reference(model, prompts[1], 20)
    # row 1 stops inside a step (each emits up to 5 tokens after the prefill's)
    stop_at = next(i for i in range(2, 20) if free[i] not in free[:i] and i % 5)
    eos = free[stop_at]
    proposer = DraftProposer(model, tiny_model("llama", seed=0), num_tokens=4, schedule="constant")
    chunks = stream(model, ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos, proposer=proposer)
    out, state = chunks.result(), chunks.state
    metrics = out.metrics
    assert out.finish_reasons[1] == "eos" and out.new_tokens[1] == free[: stop_at + 1]
    for row, tokens in enumerate(out.new_tokens):
        # the prefill's token and each step's own token after its drafts; a row that stopped on a draft (row 1
        # by construction; another may too, at the same EOS) emitted none after it in its last step
        left = len(tokens) - state.row_steps[row] - state.row_accepted[row]
        assert left == (0 if row == 1 else 1) or (left == 0 and out.finish_reasons[row] == "eos"), (row, left)
    assert metrics.new_tokens == metrics.rows + metrics.step_tokens == sum(len(t) for t in out.new_tokens)
    assert sum(metrics.accepted_by_depth) == sum(state.row_accepted.values())


@pytest.mark.parametrize("num_heads, top_k, preset", [
    (4, 10, "tree-16"), (4, 6, "tree-16"), (4, 4, "tree-8"), (5, 3, "chain-4"), (3, 10, "tree-8"),
    (3, 2, "chain-3"), (2, 10, "chain-2"), (1, 1, "chain-1"),
])
def test_the_default_tree_fits_the_heads_and_their_top_k(num_heads, top_k, preset):
    model = medusa("llama", num_heads=num_heads)
    model.config.top_k = top_k
    assert resolve_tree(model, None) == get_tree(preset, num_heads, top_k)
    prompt = torch.tensor([5, 17, 33])
    assert generate(model, prompt[None], max_new_tokens=6, eos_token_id=NO_EOS).new_tokens[0] == \
        reference(model, prompt, 6)


@pytest.mark.parametrize("calibrated", [False, True])
def test_a_stored_empty_tree_is_plain_decoding_and_survives_saving(calibrated, tmp_path):
    """Calibration stores an empty tree where plain decoding measured fastest: that is what the
    heads then decode with (not the default preset), the adaptive fallback included."""
    model = medusa("llama")
    model.config.tree = []
    if calibrated:
        model.config.head_accuracies = [[0.5, 0.6, 0.65, 0.7]] * 4
        model.config.cost_profile = CostProfile([1, 2, 4, 8, 16], [1.0, 1.5, 2.0, 3.0, 5.0], "cpu").to_dict()
    model.save_pretrained(tmp_path)
    loaded = MedusaModel.from_pretrained(tmp_path, base_model=model.base_model)
    assert loaded.config.tree == [] and resolve_tree(loaded, None) == []
    prompt = torch.tensor([5, 17, 33, 9])
    out = generate(loaded, prompt[None], max_new_tokens=12, eos_token_id=NO_EOS)
    assert out.new_tokens[0] == reference(model, prompt, 12)
    metrics = out.metrics
    assert metrics.tau == 1.0 and metrics.mean_tree_size == 1.0 and metrics.fallback_fraction == 1.0
    assert metrics.steps == 11  # one token a step after the prefill's


def test_a_fitted_tree_is_greedy_tree_on_the_heads_own_accuracies():
    """``tree="fitted-N"``: the N-node tree ``greedy_tree`` fits to the heads' measured accuracies
    (path accuracies over per-head ones), decoding stays exact on it; heads with no measurement
    and sizes out of range are refused by name."""
    import itertools

    from medusa_infer.trees import REFERENCE_HEAD_ACCURACY, greedy_tree, per_rank_accuracies

    model = medusa("llama", num_heads=4)
    with pytest.raises(ValueError, match="hold none: train them"):
        resolve_tree(model, "fitted-8")
    model.config.head_accuracies = [list(itertools.accumulate(row)) for row in REFERENCE_HEAD_ACCURACY]
    by_rank = per_rank_accuracies(model.config.head_accuracies)
    assert resolve_tree(model, "fitted-8") == greedy_tree(by_rank, 8) == get_tree("tree-8", 4, 10)
    assert resolve_tree(model, "fitted-64") == greedy_tree(by_rank, 64) == get_tree("tree-64", 4, 10)
    paths = {(0,): 0.5, (1,): 0.2, (0, 0): 0.3, (0, 0, 0): 0.25, (2,): 0.1}
    model.config.path_accuracies = [[list(p), q] for p, q in paths.items()]
    assert resolve_tree(model, "fitted-3") == [(0,), (0, 0), (0, 0, 0)]
    assert resolve_tree(model, "fitted-5") == [(0,), (1,), (2,), (0, 0), (0, 0, 0)]
    with pytest.raises(ValueError, match="'fitted-0'.*num_nodes=0"):
        resolve_tree(model, "fitted-0")
    with pytest.raises(ValueError, match="hold 5 paths.*fitted-5 or fewer"):
        resolve_tree(model, "fitted-6")
    with pytest.raises(ValueError, match="unknown tree preset 'fitted-x'.*take fitted-N"):
        resolve_tree(model, "fitted-x")
    # a config.json whose top_k was lowered by hand: the tree is fitted to the ranks it may hold (it failed on
    # path (2,), which nobody gave)
    model.config.top_k = 2
    assert resolve_tree(model, "fitted-4") == [(0,), (1,), (0, 0), (0, 0, 0)]
    with pytest.raises(ValueError, match="hold 4 paths.*fitted-4 or fewer"):  # (2,) is past top_k
        resolve_tree(model, "fitted-5")
    model.config.path_accuracies = None
    assert resolve_tree(model, "fitted-8") == greedy_tree(per_rank_accuracies(
        [row[:2] for row in model.config.head_accuracies]), 8)
    assert max(rank for path in resolve_tree(model, "fitted-8") for rank in path) == 1
    model.config.top_k = 10
    model.config.path_accuracies = [[list(p), q] for p, q in paths.items()]
    prompt = torch.tensor([5, 17, 33])
    out = generate(model, prompt[None], max_new_tokens=6, eos_token_id=NO_EOS, tree="fitted-3", adaptive=False)
    assert out.new_tokens[0] == reference(model, prompt, 6)
    # measured with no path ever accepted (training and calibration store []): no tree to fit; it was
    # fitted to the per-rank accuracies instead, a tree of paths never seen accepted
    model.config.path_accuracies = []
    with pytest.raises(ValueError, match=r"'fitted-3'.*hold no path.*decode plainly \(tree=\[\]\)"):
        resolve_tree(model, "fitted-3")


def test_stop_strings_are_looked_for_in_the_text_as_it_reads_after_the_prompt():
    from medusa_infer.decoding import generated_text_tail
    from tiny import metaspace_tokenizer

    tokenizer = metaspace_tokenizer()
    prompt = tokenizer("the cat sat on the mat")["input_ids"]
    new = tokenizer("snow door road", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(new) == "snow door road"  # alone, the first word loses its space
    history = prompt + new[:1] + [tokenizer.eos_token_id] + new[1:]
    # read after the prompt, with the end-of-text token left out as the client's text leaves it out
    assert generated_text_tail(tokenizer, history, len(prompt), window=20) == " snow door road"
    assert generated_text_tail(tokenizer, history, len(prompt), window=2) == " door road"
    assert generated_text_tail(tokenizer, prompt, len(prompt), window=20) == ""  # the prompt's text is not looked in
    torch.manual_seed(0)
    model = MedusaModel.from_base(tiny_model("llama", vocab_size=len(tokenizer)), num_heads=2, tokenizer=tokenizer)
    ids = torch.tensor([prompt])
    free = generate(model, ids, max_new_tokens=6, eos_token_id=[])
    first = tokenizer.convert_ids_to_tokens(free.new_tokens[0][:2])
    stop = " " + first[0][1:] + " " + first[1][1:]  # the first two words, as they read after the prompt
    out = generate(model, ids, max_new_tokens=6, eos_token_id=[], stop_strings=stop, tokenizer=tokenizer)
    assert out.new_tokens[0] == free.new_tokens[0][:2] and out.finish_reasons == ["stop"]


def byte_tokenizer():
    """A byte-level tokenizer of one token per byte (no merges): a multi-byte character takes several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def test_a_stop_string_of_u_fffd_waits_for_a_characters_other_bytes():
    """While a character's bytes are still coming the text read ends in U+FFFD: a stop string holding one (a client
    cutting broken output) ended rows at the first byte of every emoji. It matches once text follows it."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from medusa_infer.decoding import DecodeBatch, SamplingConfig, StopConfig

    tokenizer = byte_tokenizer()
    model = MedusaModel.without_heads(tiny_model("llama", vocab_size=len(tokenizer)), tokenizer)
    prompt = tokenizer("Say:")["input_ids"]
    ids = torch.tensor([prompt])
    batch = DecodeBatch(model, ids, torch.ones_like(ids), AutoregressiveProposer(model), SamplingConfig(),
                        StopConfig(50, (), ("\ufffd", "x\ufffdy")), tokenizer, None)

    def stops_at(text: bytes) -> int | None:
        new = [tokenizer.convert_tokens_to_ids(bytes_to_unicode()[b]) for b in text]  # a token per byte
        for n in range(1, len(new) + 1):
            if batch._stop_reason(0, new[:n], new[n - 1]) == "stop":
                return n
        return None

    assert stops_at(" party 🎉 now".encode()) is None  # an emoji's first three bytes read as U+FFFD
    assert stops_at(b"ab\xffcd") == 4  # a byte that begins no character: broken text, cut
    assert stops_at(b"x\xffy") == 3
    batch.stops[0] = StopConfig(3, (), ("\ufffd",))
    assert stops_at(b"ab\xff") == 3  # at the row's last token: what the answer ends with
    batch.stops[0] = StopConfig(50, (), ("\ufffd",))
    ending = [tokenizer.convert_tokens_to_ids(bytes_to_unicode()[b]) for b in b"ab\xff"]
    assert batch._stop_reason(0, ending, ending[-1]) is None
    assert batch._stop_reason(0, ending, ending[-1], last=True) == "stop"  # the row's last token: the context full


def test_streamed_text_joins_to_the_answer_when_a_row_ends_inside_a_character():
    """A byte-level tokenizer's answer cut (token limit) inside a multi-byte character: the text held
    back while waiting for the character's other bytes is sent with the row's last chunk."""
    tokenizer = byte_tokenizer()
    model = MedusaModel.without_heads(tiny_model("llama", vocab_size=len(tokenizer)), tokenizer)
    ids = torch.tensor([tokenizer("héllo wörld")["input_ids"]])
    cut_inside = 0
    for n in range(1, 24):
        chunks = stream(model, ids, max_new_tokens=n, eos_token_id=[])
        streamed = "".join(chunk.text for chunk in chunks)
        answer = tokenizer.decode(chunks.result().new_tokens[0], skip_special_tokens=True)
        assert streamed == answer, n
        cut_inside += answer.endswith("\ufffd")
    assert cut_inside  # the case this test is about occurred


def test_streamed_text_joins_to_the_answer_with_a_tokenizer_that_cleans_up_spaces():
    """decode's clean_up_tokenization_spaces (WordPiece, Unigram, WordLevel tokenizers) rewrites a text's end once
    the next tokens show ("it '" becomes "it's"): the chunks lost the characters it removed ("it ' fine")."""
    from medusa_infer.serving.testing import word_tokenizer
    from tiny import scripted_model

    tokenizer = word_tokenizer(("hello", "it", "'", "s", "fine", "do", "n't", "."))
    tokenizer.clean_up_tokenization_spaces = True
    script = tokenizer("hello it ' s fine do n't .", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    model = scripted_model(tokenizer, script)
    for limit in range(1, len(script)):
        chunks = stream(model, torch.tensor([script[:1]]), max_new_tokens=limit)
        streamed = [chunk.text for chunk in chunks]
        answer = tokenizer.decode(chunks.result().new_tokens[0], skip_special_tokens=True)
        assert "".join(streamed) == answer, (limit, streamed)
    assert answer == "it's fine don't." and len([text for text in streamed if text]) > 2  # (streamed, not at the end)


def test_a_stop_string_only_in_the_uncleaned_seam_of_the_stop_window_does_not_stop():
    """The stop-string window's text, where the cleanup rewrote its seam with the text before ("x n" and "' t" read
    "xn't"), was the window decoded alone ("' t do ..."): a stop string the answer never held ("' t") stopped the row
    some tokens later, its answer cut."""
    from medusa_infer.serving.testing import word_tokenizer
    from tiny import scripted_model

    tokenizer = word_tokenizer(("x", "n", "'", "t", "do", "it", "s", "m", "ve", "re", "don", "?", "!", ",", "."))
    tokenizer.clean_up_tokenization_spaces = True
    script = tokenizer("x n ' t do it s m ve re don ? ! , .", add_special_tokens=False)["input_ids"]
    model = scripted_model(tokenizer, script)
    prompt = torch.tensor([script[:1]])
    plain = generate(model, prompt, max_new_tokens=14, eos_token_id=[])
    assert "' t" not in tokenizer.decode(plain.new_tokens[0]) and len(plain.new_tokens[0]) == 14
    stopped = generate(model, prompt, max_new_tokens=14, eos_token_id=[], stop_strings=["' t"])
    assert stopped.new_tokens == plain.new_tokens and stopped.finish_reasons == ["length"]


def test_a_stream_closed_or_failed_before_it_finished_says_so_in_result():
    """result() of a closed stream was a bare AssertionError (None under python -O); a failed one lost its error."""
    model = word_medusa()
    chunks = stream(model, prompt="the party is", max_new_tokens=12, eos_token_id=[])
    iterator = iter(chunks)
    next(iterator)
    assert chunks.running
    iterator.close()
    assert not chunks.running
    with pytest.raises(RuntimeError, match="stream was closed before it finished"):
        chunks.result()
    failing = stream(model, prompt="the party is", max_new_tokens=12, eos_token_id=[])
    with mock.patch.object(type(failing.state), "step", side_effect=OSError("disk gone")):
        with pytest.raises(OSError, match="disk gone"):
            list(failing)
    with pytest.raises(RuntimeError, match=r"failed \(OSError: disk gone\)") as raised:
        failing.result()
    assert isinstance(raised.value.__cause__, OSError)
    assert len(stream(model, prompt="the party is", max_new_tokens=3, eos_token_id=[]).result().new_tokens[0]) == 3


def test_a_proposer_driving_an_unfinished_stream_is_refused_to_another():
    """A proposer keeps one call's state: a second call given it while a first stream ran broke the first
    (a shape error from its next step)."""
    from medusa_infer.proposers import build_proposer

    model = word_medusa()
    for name in ("medusa", "lookup"):
        proposer = build_proposer(name, model, {})
        first = stream(model, prompt="the party is", max_new_tokens=20, eos_token_id=[], proposer=proposer)
        next(iter(first))
        with pytest.raises(ValueError, match="drives another stream that has not finished"):
            generate(model, prompt="hello world", max_new_tokens=20, eos_token_id=[], proposer=proposer)
        alone = generate(model, prompt="the party is", max_new_tokens=20, eos_token_id=[],
                         proposer=build_proposer(name, model, {}))
        assert first.result().new_tokens == alone.new_tokens
        # one call after another takes it, as does a stream closed before it finished
        again = generate(model, prompt="the party is", max_new_tokens=20, eos_token_id=[], proposer=proposer)
        assert again.new_tokens == alone.new_tokens
        closed = stream(model, prompt="hello world", max_new_tokens=20, eos_token_id=[], proposer=proposer)
        iterator = iter(closed)
        next(iterator)
        iterator.close()
        generate(model, prompt="hello world", max_new_tokens=4, eos_token_id=[], proposer=proposer)
        # a loop left with break, or a stream never iterated, dropped: taken at once, not at the next garbage
        # collection (the stream and its generator referred to each other)
        import gc

        gc.disable()
        try:
            for _ in stream(model, prompt="hello world", max_new_tokens=20, eos_token_id=[], proposer=proposer):
                break
            generate(model, prompt="hello world", max_new_tokens=4, eos_token_id=[], proposer=proposer)
            stream(model, prompt="hello world", max_new_tokens=20, eos_token_id=[], proposer=proposer)
            generate(model, prompt="hello world", max_new_tokens=4, eos_token_id=[], proposer=proposer)
            # while a loop runs, its generator holds the proposer, the stream dropped or not
            with pytest.raises(ValueError, match="drives another stream that has not finished"):
                for _ in stream(model, prompt="hello world", max_new_tokens=20, eos_token_id=[], proposer=proposer):
                    generate(model, prompt="hello world", max_new_tokens=4, eos_token_id=[], proposer=proposer)
        finally:
            gc.enable()


def test_a_proposer_two_threads_are_given_at_once_is_refused_to_the_second():
    """The check that a proposer is free and its taking were apart, with the stream's set-up between: two threads
    given one proposer both passed the check and shared it (a shape error, or one draft's generator replaced by the
    other's). The first call here is held inside its set-up (its proposer's configure) until the second has set
    up too, or a second has passed."""
    import threading

    from medusa_infer.proposers import build_proposer

    model = word_medusa()
    proposer = build_proposer("lookup", model, {})
    first_in, second_in, calls = threading.Event(), threading.Event(), []

    def configure(generator) -> None:
        calls.append(generator)
        if len(calls) == 1:
            first_in.set()
            second_in.wait(1.0)
        else:
            second_in.set()

    proposer.configure = configure
    streams, errors = {}, {}

    def open_stream(name: str) -> None:
        try:
            streams[name] = stream(model, prompt="the party is", max_new_tokens=8, eos_token_id=[], proposer=proposer)
        except ValueError as error:
            errors[name] = error

    first = threading.Thread(target=open_stream, args=("first",))
    first.start()
    assert first_in.wait(5.0)
    second = threading.Thread(target=open_stream, args=("second",))
    second.start()
    first.join(10.0)
    second.join(10.0)
    assert list(streams) == ["first"] and list(errors) == ["second"], (streams, errors)
    assert "drives another stream that has not finished" in str(errors["second"]) and len(calls) == 1
    alone = generate(model, prompt="the party is", max_new_tokens=8, eos_token_id=[],
                     proposer=build_proposer("lookup", model, {}))
    assert streams["first"].result().new_tokens == alone.new_tokens


def test_numpy_and_torch_numbers_are_taken_as_sampling_settings():
    import numpy as np

    from medusa_infer.decoding import SamplingConfig

    config = SamplingConfig("lossless", temperature=np.float32(0.5), top_k=np.int64(5), top_p=torch.tensor(0.75))
    assert (config.temperature, config.top_k, config.top_p) == (0.5, 5, 0.75)
    assert all(type(v) in (int, float) for v in (config.temperature, config.top_k, config.top_p))
    assert SamplingConfig("lossless", top_k=torch.tensor(3)).top_k == 3
    model = MedusaModel.without_heads(tiny_model("llama"))
    ids = torch.tensor([[5, 6, 7]])
    plain = generate(model, ids, max_new_tokens=4, do_sample=True, top_k=5, temperature=0.5, seed=1).new_tokens
    numpy = generate(model, ids, max_new_tokens=4, do_sample=True, top_k=np.int64(5), temperature=np.float32(0.5),
                     seed=1).new_tokens
    assert numpy == plain


def test_the_stop_string_window_covers_a_string_of_byte_level_pieces():
    """Stop strings are looked for in the text of a row's last ``window()`` tokens; a byte-level
    tokenizer spends a token per byte of an emoji (four per character)."""
    from medusa_infer.decoding import StopConfig

    stop = StopConfig(stop_strings=("ab", "🙂🙂🙂"))
    assert stop.window >= len("🙂🙂🙂".encode("utf-8")) > len("🙂🙂🙂") + 8


def test_nothing_a_call_gives_is_silently_ignored():
    """Sampling settings without do_sample, typical acceptance's thresholds under another acceptance, left
    padding without its mask and chats of the wrong shape are refused by name, not decoded around."""
    model = medusa("llama")
    greedy = generate(model, torch.tensor([5, 6, 7]), max_new_tokens=4).new_tokens
    assert generate(model, torch.tensor([5, 6, 7]), max_new_tokens=4, temperature=0.0).new_tokens == greedy
    for given, says in (({"temperature": 0.7}, "temperature=0.7"), ({"seed": 5}, "seed=5"),
                        ({"top_p": 0.5, "top_k": 3}, "top_k=3, top_p=0.5")):
        with pytest.raises(ValueError, match=f"{says} shape sampling, but do_sample=False decodes greedily"):
            generate(model, torch.tensor([5, 6, 7]), max_new_tokens=4, **given)
    with pytest.raises(ValueError, match="typical_epsilon=0.5 and typical_delta=0.3 set typical acceptance, and this "
                                         "call accepts by 'lossless'"):
        generate(model, torch.tensor([5, 6, 7]), max_new_tokens=4, do_sample=True, typical_epsilon=0.5)
    for given, says in (({"typical_epsilon": 5.0}, r"typical_epsilon=5.0, typical_delta=0.3: epsilon \(posterior "
                                                   r"threshold\) must lie in \(0, 1\], got 5.0"),
                        ({"typical_delta": -1.0}, r"delta \(posterior alpha\) must be a finite number > 0, got -1.0"),
                        ({"typical_epsilon": "0.1"}, "typical_epsilon must be a number, got '0.1'"),  # a TypeError
                        ({"typical_delta": True}, "typical_delta must be a number, got True")):  # taken as 1.0
        with pytest.raises(ValueError, match=says):  # before the prefill: a 1-token answer was given, unchecked
            generate(model, torch.tensor([5, 6, 7]), max_new_tokens=1, do_sample=True, acceptance="typical", **given)
    for text in ("the cat", ["the cat", "a dog"], [["the", "cat"]]):  # positionally: a bare torch TypeError
        with pytest.raises(ValueError, match="input_ids must be token ids, got text .*: pass text as prompt="):
            generate(model, text, max_new_tokens=4)
    # temperature 0 decodes greedily: what shapes sampling beside it did nothing, in silence
    for given, says in (({"top_k": 5, "seed": 1}, "top_k=5, seed=1"),
                        ({"acceptance": "typical", "typical_epsilon": 0.5}, "typical_epsilon=0.5")):
        with pytest.raises(ValueError, match=f"{says} shape sampling, but temperature=0 decodes greedily"):
            generate(model, torch.tensor([5, 6, 7]), max_new_tokens=4, do_sample=True, temperature=0, **given)
    # thresholds of an acceptance this call does not use are named as such (the advice above would not do)
    with pytest.raises(ValueError, match="typical_epsilon=0.2 and typical_delta=0.3 set typical acceptance"):
        generate(model, torch.tensor([5, 6, 7]), max_new_tokens=4, do_sample=True, temperature=0, typical_epsilon=0.2)
    assert generate(model, torch.tensor([5, 6, 7]), max_new_tokens=4, do_sample=True, temperature=0).new_tokens == \
        generate(model, torch.tensor([5, 6, 7]), max_new_tokens=4).new_tokens
    padded = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    for rows in (padded, padded[:1]):  # one left-padded row too: its pads were decoded as prompt tokens
        with pytest.raises(ValueError, match="rows that start with the pad id 0 and no attention_mask"):
            generate(model, rows, max_new_tokens=4)
    # Qwen2.5's ids: the generation config's pad is its BOS (<|endoftext|>), the tokenizer has no BOS; one row
    # starting with it is a prompt, with the tokenizer or without
    qwen_like = word_medusa(0)
    qwen_like.base_model.generation_config.pad_token_id = qwen_like.base_model.generation_config.bos_token_id = 1
    qwen_like.tokenizer.bos_token = None
    starts_with_bos = torch.tensor([[1, 9, 10, 11]])
    assert generate(qwen_like, starts_with_bos, max_new_tokens=3).new_tokens == generate(
        MedusaModel(qwen_like.base_model, qwen_like.heads, None), starts_with_bos, max_new_tokens=3).new_tokens
    mask = (padded != 0).long()
    assert generate(model, padded, attention_mask=mask, max_new_tokens=4).new_tokens[0] == \
        generate(model, torch.tensor([5, 6]), max_new_tokens=4).new_tokens[0]
    chat_model = word_medusa()
    for messages in ("the cat", {"role": "user", "content": "the cat"}, [["the cat"]]):
        with pytest.raises(ValueError, match=r"messages must be a chat \(a list of \{'role', 'content'\} dicts\)"):
            generate(chat_model, messages=messages, max_new_tokens=2)


def test_a_result_drained_without_reading_its_chunks_decodes_no_text_per_step():
    """generate() (and medusa-bench's timings) drain the stream for its result: each chunk re-decoded its
    row's whole answer, work quadratic in the answer's length that no one read (128 decodes of 8256 tokens
    for a 128-token answer). Chunks read before result() keep their text."""
    from medusa_infer.serving.testing import word_tokenizer

    tokenizer = word_tokenizer()
    model = MedusaModel.without_heads(tiny_model("llama", vocab_size=len(tokenizer)), tokenizer)
    decoded: list[int] = []
    decode = type(tokenizer).decode
    with mock.patch.object(type(tokenizer), "decode", lambda self, ids, **kw: decoded.append(len(ids)) or
                           decode(self, ids, **kw)):
        ids = torch.tensor([tokenizer("the cat sat")["input_ids"]])
        out = generate(model, ids, max_new_tokens=40, eos_token_id=[])
        assert len(out.new_tokens[0]) == 40 and sum(decoded) <= 2 * 40, decoded
        chunks = stream(model, ids, max_new_tokens=40, eos_token_id=[])
        first = next(iter(chunks))
        assert first.text and chunks.result().new_tokens == out.new_tokens
        decoded.clear()  # a streamer takes the tokens and decodes them itself

        class Streamer:
            def __init__(self):
                self.tokens: list[int] = []

            def put(self, value):
                self.tokens.extend(value.flatten().tolist())

            def end(self):
                pass

        streamer = Streamer()
        assert generate(model, ids, max_new_tokens=40, eos_token_id=[], streamer=streamer).new_tokens == out.new_tokens
        assert streamer.tokens[ids.shape[1]:] == out.new_tokens[0] and sum(decoded) <= 2 * 40, decoded


def test_record_step_counts_the_bonus_token_by_default():
    """Without ``emitted``, each row emits its accepted drafts and the token every step yields after them:
    tau counts the bonus token (plain decoding: 1.0), as vLLM and Spec-Bench do."""
    m = GenerationMetrics()
    m.record_step([2, 0], offered_depth=3, tree_size=8)
    assert m.step_tokens == m.new_tokens == 4 and m.tau == 2.0
    assert m.accepted_by_depth == [1, 1, 0] and m.offered_by_depth == [2, 2, 2]
    plain = GenerationMetrics()
    plain.record_step([0], offered_depth=0, tree_size=1)
    assert plain.tau == 1.0 and plain.plain_steps == 1 and plain.fallback_fraction == 1.0


def test_an_eos_at_the_contexts_last_position_is_reported_as_eos():
    """A row whose last token at the context's end is an EOS finished because of the EOS, not the context."""
    model = medusa("llama")
    limit = model.base_model.config.max_position_embeddings
    prompt = torch.randint(3, VOCAB, (limit - 10,), generator=torch.Generator().manual_seed(3))
    future = reference(model, prompt, 10)
    last = future[-1]
    assert last not in future[:-1]  # the EOS is met at the context's last position only
    out = generate(model, prompt[None], max_new_tokens=50, tree="tree-16", eos_token_id=[last])
    assert out.new_tokens[0] == future
    assert out.finish_reasons == ["eos"]


def test_messages_are_tokenised_as_the_template_renders_them_without_a_second_bos():
    """A chat template writes the BOS itself: messages= must not let the tokenizer add another (prompt= does)."""
    from tokenizers.processors import TemplateProcessing

    model = word_medusa()
    tokenizer = model.tokenizer
    tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
    chat = [{"role": "user", "content": "w5 w6"}]
    expected = tokenizer(encode_chat(tokenizer, chat), add_special_tokens=False)["input_ids"][0]
    assert expected.count(tokenizer.bos_token_id) == 1
    out = generate(model, messages=chat, max_new_tokens=2)
    assert out.sequences[0, : -len(out.new_tokens[0])].tolist() == expected
    plain = generate(model, prompt="w5 w6", max_new_tokens=2)  # a plain prompt gets the tokenizer's BOS
    assert plain.sequences[0, 0].item() == tokenizer.bos_token_id


@pytest.mark.parametrize("sampled", [False, True])
def test_logits_that_overflowed_are_refused_naming_the_dtype(sampled):
    """From a review: a model whose numbers overflow in float16 (Gemma 3's do) gave NaN logits, which greedy
    decoding read as token 0 at every step (sampling: torch's "probability tensor contains either inf, nan")."""
    base = tiny_model("llama")
    with torch.no_grad():
        base.get_input_embeddings().weight.mul_(1e6)  # past float16's 65504
    model = MedusaModel.from_base(base.to(torch.float16), num_heads=3)
    with pytest.raises(ValueError, match="logits after the prompt hold NaN or infinity: its numbers overflowed in "
                                         "float16; load it in bfloat16 or float32"):
        generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=sampled, seed=0 if sampled else None)
    damaged = tiny_model("llama")  # float32 with a NaN weight: no advice to load it in float32
    with torch.no_grad():
        damaged.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="in float32 its weights .* hold NaN or infinity: a damaged or diverged"):
        generate(MedusaModel.from_base(damaged, num_heads=1), torch.tensor([[5, 6, 7]]), max_new_tokens=4)


def test_a_proposer_or_streamer_of_the_wrong_kind_is_refused_at_the_call():
    """From a review: proposer="lookup" (a method's name, as --method takes it) failed with an AttributeError after
    the prompt's forward (stream(): only when iterated), and a streamer without put() with another."""
    model = word_medusa()
    with pytest.raises(ValueError, match=r"proposer= must be a Proposer .*got str; for the method 'lookup': "
                                         r"proposers.build_proposer\('lookup', model\)"):
        stream(model, torch.tensor([[5, 6, 7]]), proposer="lookup")
    with pytest.raises(ValueError, match="streamer= needs put\\(token_ids\\) and end\\(\\).*got object"):
        generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=2, streamer=object())


def test_generate_shows_the_parameters_and_defaults_it_takes():
    """From a review: help(model.generate) showed (self, *args, **kwargs) alone, and decoding.generate
    (model, *args, streamer=None, **kwargs): the defaults were on stream()'s signature only."""
    import inspect

    taken = inspect.signature(stream).parameters
    for function in (generate, MedusaModel.generate):
        shown = inspect.signature(function).parameters
        assert [name for name in shown if name not in ("self", "model", "streamer")] == \
            [name for name in taken if name != "model"]
        assert all(shown[name].default == taken[name].default for name in taken if name != "model")
        assert shown["streamer"].default is None


def control_token_tokenizer():
    """The word tokenizer with a special token of its own, ``<|end|>``, which its plain text never makes."""
    from medusa_infer.serving.testing import word_tokenizer

    tokenizer = word_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    return tokenizer


@sanitizes_control_tokens
def test_a_control_token_written_in_a_message_is_text_not_the_token():
    """A message's text is text: "<|end|>" written in it is not the control token (it ended the turn there)."""
    tokenizer = control_token_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    written = [{"role": "user", "content": "w5 <|end|> w6"}]
    plain = [{"role": "user", "content": "w5 w6"}]
    [ids], [reference] = chat_prompt_ids(tokenizer, written), chat_prompt_ids(tokenizer, plain)
    assert end not in ids
    assert ids == reference[:3] + [tokenizer.unk_token_id] + reference[3:]  # the word tokenizer's text for it
    # the template's own control tokens stay tokens, the rest as before, in a batch too
    tokenizer.chat_template = tokenizer.chat_template.replace("{% endfor %}", "<|end|>{% endfor %}")
    rows = chat_prompt_ids(tokenizer, [written, plain])
    assert [row.count(end) for row in rows] == [1, 1]
    assert rows[1] == tokenizer(encode_chat(tokenizer, plain), add_special_tokens=False)["input_ids"][0]


@sanitizes_control_tokens
def test_a_control_token_that_cannot_be_text_is_refused_by_message():
    from medusa_infer.chat import ChatTextError

    tokenizer = control_token_tokenizer()  # "</s>", its EOS, is also a word of its vocabulary
    chat = [{"role": "system", "content": "w1"}, {"role": "user", "content": "w5 </s> w6"}]
    with pytest.raises(ChatTextError, match="message 1 holds '</s>', which this tokenizer cannot encode as text") as err:
        chat_prompt_ids(tokenizer, chat)
    assert (err.value.message, err.value.token) == (1, "</s>")


def test_before_transformers_5_20_a_control_token_in_a_message_is_refused(monkeypatch):
    tokenizer = control_token_tokenizer()
    template = tokenizer.apply_chat_template

    def without_sanitize(conversation, tokenize=True, add_generation_prompt=False, return_dict=True):
        return template(conversation, tokenize=tokenize, add_generation_prompt=add_generation_prompt,
                        return_dict=return_dict)

    monkeypatch.setattr(tokenizer, "apply_chat_template", without_sanitize)
    assert chat_prompt_ids(tokenizer, [{"role": "user", "content": "w5 w6"}])  # no control token: as before
    with pytest.raises(ValueError, match=r"message 0 holds '<\|end\|>'.*upgrade transformers to 5.20"):
        chat_prompt_ids(tokenizer, [{"role": "user", "content": "w5 <|end|>"}])


def test_whitespace_added_tokens_and_parts_that_join_into_a_control_token(monkeypatch):
    """From a review: Gemma's added "\\n" token, which its template holds, was taken for a control token (before
    transformers 5.20 every message holding a newline was refused), and parts a template joins with nothing between
    ("<|en" and "d|>") formed the token that no part held."""
    tokenizer = control_token_tokenizer()
    tokenizer.add_tokens(["\n"])
    tokenizer.chat_template = tokenizer.chat_template.replace("{% endfor %}", "\n{% endfor %}")
    template = tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda conversation, tokenize=True, add_generation_prompt=False,
                        return_dict=True: template(conversation, tokenize=tokenize, return_dict=return_dict,
                                                   add_generation_prompt=add_generation_prompt))
    assert chat_prompt_ids(tokenizer, [{"role": "user", "content": "w5\nw6"}])
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {% for p in m['content'] %}{{ p['text'] }}"
                               "{% endfor %} {% endfor %}<|assistant|>")
    parts = [{"role": "user", "content": [{"type": "text", "text": "w5 <|en"}, {"type": "text", "text": "d|> w6"}]}]
    with pytest.raises(ValueError, match=r"message 0's text parts, joined, form '<\|end\|>'.*as one string"):
        chat_prompt_ids(tokenizer, parts)
    # from a second review: beside a whole token in one part (which sanitising takes care of), and parts a template
    # trims (Gemma's: "<|en " and " d|>")
    for texts in (["w5 <|en", "d|> w6 <|end|>"], ["w5 <|en ", " d|>"]):
        parts = [{"role": "system", "content": "w5 <|end|>"},
                 {"role": "user", "content": [{"type": "text", "text": text} for text in texts]}]
        with pytest.raises(ValueError, match=r"message 1's text parts, joined, form '<\|end\|>'"):
            chat_prompt_ids(tokenizer, parts)


@sanitizes_control_tokens
def test_control_tokens_are_looked_for_only_where_they_may_be_and_follow_the_tokenizer(monkeypatch):
    """From a review: a chat holding no character a control token starts with is tokenised once, as before (its
    messages were tokenised a second time to look); a token made special since is one (a stale cache read it as
    the token)."""
    from medusa_infer.serving.testing import word_tokenizer

    tokenizer = word_tokenizer()
    tokenizer.add_tokens(["<|end|>"])
    chat = [{"role": "user", "content": "w5 <|end|> w6"}]
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    assert end in chat_prompt_ids(tokenizer, chat)[0]  # an ordinary added token, which the template does not write
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    assert end not in chat_prompt_ids(tokenizer, chat)[0]
    calls, call = [], type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, *a, **k: (calls.append(a), call(self, *a, **k))[1])
    chat_prompt_ids(tokenizer, [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"}])
    assert len(calls) == 1


@sanitizes_control_tokens
def test_generate_reads_a_messages_control_token_as_text():
    model = word_medusa()
    model.tokenizer = control_token_tokenizer()
    out = generate(model, messages=[{"role": "user", "content": "w5 <|end|>"}], max_new_tokens=2)
    assert model.tokenizer.convert_tokens_to_ids("<|end|>") not in out.sequences[0].tolist()


def test_generator_seed_keeps_seeds_of_63_bits_and_hashes_the_rest_into_them():
    for seed in (0, 1, 12345, 2**63 - 1):
        assert generator_seed(seed) == seed
    for seed in (-1, -(2**63), 2**63, 2**64 - 1):
        hashed = generator_seed(seed)
        assert 0 <= hashed < 2**63 and hashed == generator_seed(seed)
    assert generator_seed(2**63) != generator_seed(0) and generator_seed(-1) != generator_seed(1)
    with pytest.raises(ValueError, match="seed must be an integer"):
        generator_seed(True)


def test_eos_ids_take_the_tokenizers_end_token_after_the_models():
    """A fine-tune may name its end-of-turn token in its tokenizer only: a row stops there too."""
    from medusa_infer.decoding import eos_ids

    model = word_medusa()
    tokenizer = model.tokenizer
    model.base_model.generation_config.eos_token_id = 2
    model.base_model.config.eos_token_id = 2
    tokenizer.add_special_tokens({"eos_token": "<|assistant|>"})
    turn = tokenizer.eos_token_id
    assert turn != 2
    assert eos_ids(model, tokenizer) == (2, turn)
    assert eos_ids(model, None) == (2,)


def test_batches_of_other_sampling_settings_merge_and_each_row_keeps_its_own(monkeypatch):
    """A greedy batch takes a sampled one's row: the greedy row stays greedy decoding's, the joining row
    samples (at a temperature so low that its tokens are greedy decoding's too, but drawn: its rule is
    lossless sampling's); batches of another model are refused."""
    from medusa_infer.decoding import DecodeBatch, SamplingConfig, StopConfig
    from medusa_infer.proposers.medusa import MedusaProposer
    from medusa_infer.trees import TREE_PRESETS

    model = medusa("llama")
    prompts = [torch.arange(3, 9), torch.arange(3, 12)]

    def batch(row, sampling, target=model):
        ids, mask = left_pad([prompts[row]])
        return DecodeBatch(target, ids, mask, MedusaProposer(target, TREE_PRESETS["tree-8"]), sampling, StopConfig(8),
                           None, torch.Generator().manual_seed(0))

    cold = SamplingConfig("lossless", temperature=1e-4)
    with torch.no_grad():
        greedy, sampled = batch(0, SamplingConfig()), batch(1, cold)
        greedy.prefill()
        greedy.step()
        sampled.prefill()
        other = batch(1, SamplingConfig(), medusa("llama", seed=5))
        other.prefill()
        with pytest.raises(ValueError, match="same model"):
            greedy.merge(other)
        drawn = []  # the rows lossless sampling accepted, each step
        lossless = rules.accept_lossless
        monkeypatch.setattr(rules, "accept_lossless",
                            lambda logits, *args, **kw: drawn.append(len(logits)) or lossless(logits, *args, **kw))
        assert greedy.merge(sampled) == [1]
        assert greedy.samplings == {0: SamplingConfig(), 1: cold}
        while not greedy.done:
            greedy.step()
    assert drawn and set(drawn) == {1}
    assert greedy.generated == {0: reference(model, prompts[0], 8), 1: reference(model, prompts[1], 8)}


def test_rows_joining_after_a_row_finished_get_new_numbers_and_keep_the_finished_rows_output():
    """A merge numbers joining rows after every row ever added (finished ones too), not after the active ones."""
    from medusa_infer.decoding import DecodeBatch, SamplingConfig, StopConfig
    from medusa_infer.proposers.medusa import MedusaProposer
    from medusa_infer.trees import TREE_PRESETS

    model = medusa("llama")
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (4, 9, 6)]
    futures = [reference(model, p, 12) for p in prompts]
    tree = TREE_PRESETS["tree-8"]

    def batch(rows, stops):
        ids, mask = left_pad([prompts[r] for r in rows])
        return DecodeBatch(model, ids, mask, MedusaProposer(model, tree), SamplingConfig(), stops, None, None)

    with torch.no_grad():
        running = batch([0, 1], [StopConfig(12), StopConfig(1)])
        running.prefill()  # row 1 stops at its one token
        assert running.rows == [0] and running.finish[1] == "length"
        late = batch([2], [StopConfig(12)])
        late.prefill()
        assert running.merge(late) == [2]
        while not running.done:
            running.step()
    assert running.generated[0] == futures[0]
    assert running.generated[1] == futures[1][:1] and running.finish[1] == "length"
    assert running.generated[2] == futures[2]
    out = running.output(0)
    assert out.new_tokens == [futures[0], futures[1][:1], futures[2]]


def test_a_draft_samples_each_lossless_row_from_its_own_setting_and_argmax_elsewhere():
    """``DraftProposer._choose`` in a batch of four settings: each lossless row's reported q is its own
    setting's warped distribution, a greedy or typical row's is one-hot on the argmax (its token)."""
    from medusa_infer.acceptance import greedy_tokens, warp_logits
    from medusa_infer.decoding import SamplingConfig
    from medusa_infer.proposers import DraftProposer

    target = MedusaModel.without_heads(tiny_model("llama", seed=3))
    proposer = DraftProposer(target, tiny_model("llama", seed=17), num_tokens=2)
    proposer.configure(torch.Generator().manual_seed(0))
    hot, cool = SamplingConfig("lossless", 1.5), SamplingConfig("lossless", 0.6, 5, 0.9)
    greedy, typical = SamplingConfig(), SamplingConfig("typical", 0.8)
    logits = torch.randn(5, 96, generator=torch.Generator().manual_seed(1)) * 3
    tokens, probs = proposer._choose(logits, [hot, greedy, cool, typical, hot])
    for row, setting in ((0, hot), (2, cool), (4, hot)):
        torch.testing.assert_close(probs[row], warp_logits(logits[row], setting.temperature, setting.top_k,
                                                           setting.top_p))
        assert probs[row, tokens[row]] > 0
    argmax = greedy_tokens(logits)
    for row in (1, 3):
        assert tokens[row] == argmax[row]
        torch.testing.assert_close(probs[row], torch.nn.functional.one_hot(argmax[row], 96).float())
    # a batch verified by typical acceptance alone (or greedily) drafts the argmax and reports no q
    for only in ([typical, typical], [greedy, SamplingConfig("lossless", 0.0)]):
        tokens, probs = proposer._choose(logits[:2], only)
        assert probs is None and torch.equal(tokens, argmax[:2])


def test_a_mixed_batch_keeps_each_rows_setting_after_a_row_leaves():
    """Rows sampled at a high temperature and a greedy row: once the first row is cancelled (and released),
    the greedy row is still chosen greedily (it is not given the cancelled row's setting by position)."""
    from medusa_infer.decoding import DecodeBatch, SamplingConfig, StopConfig
    from medusa_infer.proposers import MedusaProposer

    model = medusa("llama")
    prompts = [torch.arange(3, 9), torch.arange(20, 27), torch.arange(40, 45)]
    hot = SamplingConfig("lossless", 5.0)
    ids, mask = left_pad(prompts)
    for release in (False, True):
        batch = DecodeBatch(model, ids, mask, MedusaProposer(model, [(0,), (1,), (0, 0)]), [hot, hot, SamplingConfig()],
                            StopConfig(10), None, torch.Generator().manual_seed(0))
        with torch.no_grad():
            batch.prefill()
            batch.cancel(0)
            if release:
                batch.release(0)
            batch.step()
            batch.cancel(1)
            while not batch.done:
                batch.step()
        assert batch.generated[2] == reference(model, prompts[2], 10)


def test_the_target_as_its_own_draft_accepts_every_token_of_every_row_in_a_mixed_batch():
    """A batch of two lossless settings and a greedy row, the target its own draft: each lossless row's drafts are
    verified with min(1, p/q) against the q it was sampled from, so all are accepted (verified as deterministic
    drafts, by the tree rule, a sampled row's are accepted with probability p(x) only); the greedy row's too."""
    from medusa_infer.decoding import DecodeBatch, SamplingConfig, StopConfig
    from medusa_infer.proposers import DraftProposer

    target = MedusaModel.without_heads(tiny_model("llama", seed=0))
    k = 3
    prompts = [torch.arange(3, 9), torch.arange(20, 24), torch.arange(40, 47)]
    ids, mask = left_pad(prompts)
    samplings = [SamplingConfig("lossless", 1.0), SamplingConfig(), SamplingConfig("lossless", 0.7, 10, 0.9)]
    proposer = DraftProposer(target, target.base_model, num_tokens=k, schedule="constant")
    batch = DecodeBatch(target, ids, mask, proposer, samplings, StopConfig(4 * (k + 1) + 1), None,
                        torch.Generator().manual_seed(0))
    with torch.no_grad():
        batch.prefill()
        while not batch.done:
            batch.step()
    assert batch.row_steps == {0: 4, 1: 4, 2: 4}
    assert batch.row_accepted == {0: 4 * k, 1: 4 * k, 2: 4 * k}
    assert batch.generated[1] == reference(target, prompts[1], 4 * (k + 1) + 1)


def test_a_batch_is_refused_a_sampling_list_of_another_length():
    from medusa_infer.decoding import DecodeBatch, SamplingConfig, StopConfig
    from medusa_infer.proposers import MedusaProposer

    model = medusa("llama")
    ids, mask = left_pad([torch.arange(3, 9), torch.arange(20, 24)])
    for samplings in ([SamplingConfig()], [SamplingConfig()] * 3):
        with pytest.raises(ValueError, match=f"{len(samplings)} sampling configs for 2 rows"):
            DecodeBatch(model, ids, mask, MedusaProposer(model, [(0,)]), samplings, StopConfig(4), None, None)
