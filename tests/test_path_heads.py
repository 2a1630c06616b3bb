"""Heads that read their candidate path (``path_input``, Hydra-style): initialisation, the tree
filled node by node from each node's own path, exact greedy decoding (with and without a grafted
lookup chain, batch 1 and batched), saving, and training on a task only they can learn."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from medusa_infer.config import MedusaConfig
from medusa_infer.decoding import generate
from medusa_infer.model import MedusaModel
from medusa_infer.proposers import MedusaProposer
from medusa_infer.proposers.base import StepContext
from medusa_infer.trees import build_tree_buffers, expansion_plan
from medusa_train.features import block_from_hidden, concat_blocks, pad_batch, rows_from_block
from medusa_train.losses import IGNORE
from test_decoding import left_pad, reference
from test_next_token_heads import heads_model, train_on_examples
from tiny import VOCAB

TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 1)]


def path_model(path_input: bool = True, arch: str = "llama", randomize: bool = True, seed: int = 0) -> MedusaModel:
    return heads_model(True, arch=arch, seed=seed, randomize=randomize, path_input=path_input)


def test_path_input_needs_the_next_token_and_fresh_heads_start_as_token_heads_do():
    with pytest.raises(ValueError, match="path_input=True needs next_token_input=True"):
        MedusaConfig(hidden_size=8, vocab_size=16, path_input=True)
    plain, reading = path_model(False, randomize=False), path_model(True, randomize=False)
    assert [len(h.path_proj) for h in reading.heads.heads] == [0, 1, 2]
    hidden = torch.randn(5, plain.lm_head.weight.shape[1])
    nxt, path = torch.randint(3, VOCAB, (5,)), torch.randint(3, VOCAB, (5, 2))
    torch.testing.assert_close(reading.head_logits(hidden, nxt, path_tokens=path), plain.head_logits(hidden, nxt),
                               rtol=0, atol=0)


def test_head_k_reads_exactly_the_first_k_path_tokens():
    model = path_model()
    hidden = torch.randn(4, model.config.hidden_size)
    nxt, path = torch.randint(3, VOCAB, (4,)), torch.randint(3, VOCAB, (4, 2))
    with torch.no_grad():
        base = model.head_logits(hidden, nxt, path_tokens=path)
        second = path.clone()
        second[:, 1] = (second[:, 1] + 1) % VOCAB  # read by head 2 only
        changed = model.head_logits(hidden, nxt, path_tokens=second)
        # one head alone (start/first) equals its row of all heads
        alone = model.head_logits(hidden, nxt, first=2, start=1, path_tokens=path[:, :1])
    assert torch.equal(base[:2], changed[:2]) and not torch.allclose(base[2], changed[2])
    # float tolerance, not bitwise: one head alone is a matmul of another shape, and BLAS may pick another kernel
    torch.testing.assert_close(alone[0], base[1])


def test_default_path_is_the_greedy_chain_and_a_missing_path_says_how_to_fix_it():
    model = path_model()
    hidden = torch.randn(3, model.config.hidden_size)
    nxt = torch.randint(3, VOCAB, (3,))
    with torch.no_grad():
        chained = model.head_logits(hidden, nxt)
        first = model.head_logits(hidden, nxt, first=1)[0].argmax(-1)
        second = model.head_logits(hidden, nxt, first=2, start=1, path_tokens=first[:, None])[0].argmax(-1)
        explicit = model.head_logits(hidden, nxt, path_tokens=torch.stack([first, second], 1))
        other = model.head_logits(hidden, nxt, path_tokens=torch.stack([first, (second + 1) % VOCAB], 1))
    # The chain runs head by head, the explicit path all heads at once: matmuls of other shapes, which BLAS may
    # round differently (CI's CPU did, by 1e-6), hence a float tolerance. Another path is far outside it.
    assert torch.equal(chained[0].argmax(-1), first) and torch.equal(chained[1].argmax(-1), second)
    torch.testing.assert_close(chained, explicit)
    assert (chained[2] - other[2]).abs().max() > 1e-2
    with pytest.raises(ValueError, match=r"path_input=True\): head 2 needs path_tokens of shape \(3, 2\)"):
        model.heads(hidden, model.lm_head, None, nxt, model.base_model.get_input_embeddings().weight,
                    path_tokens=torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="need 0 <= start < first"):
        model.head_logits(hidden, nxt, first=1, start=1)


def test_expansion_plan_fills_every_heads_node_once_from_its_parent():
    tree = build_tree_buffers(TREE + [(3,), (3, 3)], num_heads=3, top_k=4)  # rank 3: a grafted chain
    levels = expansion_plan(tree, top_k=3)
    filled = torch.cat([level.nodes for level in levels]).tolist()
    heads_nodes = [1 + i for i, p in enumerate(tree.paths) if max(p) < 3]
    assert sorted(filled) == heads_nodes
    for level in levels:
        for node, slot, rank in zip(level.nodes.tolist(), level.slot.tolist(), level.ranks.tolist()):
            path = tree.paths[node - 1]
            parent = int(level.parents[slot])
            assert parent == int(tree.parents[node]) and rank == path[-1]
            assert level.ancestors[slot].tolist() == [1 + tree.paths.index(path[:j]) for j in range(1, len(path))]
        assert level.top_k == 1 + int(level.ranks.max())


def test_each_node_holds_its_heads_candidate_given_its_own_path():
    model = path_model()
    with torch.no_grad():  # paths that weigh enough to change the heads' choices
        for head in model.heads.heads:
            for proj in head.path_proj:
                proj.weight.mul_(10)
    hidden, roots = torch.randn(2, model.config.hidden_size), torch.tensor([4, 7])
    proposer = MedusaProposer(model, TREE)
    proposer.start(None, hidden)
    proposal = proposer.propose(roots, StepContext([[1, 4], [3, 7]], 8))
    tree = proposal.tree
    for node, path in enumerate(tree.paths, start=1):
        ancestors = [1 + tree.paths.index(path[:j]) for j in range(1, len(path))]
        path_tokens = proposal.tokens[:, ancestors]
        with torch.no_grad():
            logits = model.head_logits(hidden, roots, first=len(path), start=len(path) - 1,
                                       path_tokens=path_tokens)[0]
        expected = logits.topk(path[-1] + 1, dim=-1).indices[:, path[-1]]
        assert torch.equal(proposal.tokens[:, node], expected), path
    # siblings under different parents differ: the heads read the path, not one shared top-k
    assert not torch.equal(proposal.tokens[:, 1 + tree.paths.index((0, 0))],
                           proposal.tokens[:, 1 + tree.paths.index((1, 0))])


@pytest.mark.parametrize("lookup_tokens", [0, 4])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_greedy_decoding_with_path_heads_is_exact_batch_1_and_3(arch, lookup_tokens):
    model = path_model(arch=arch)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (4, 9, 6)]
    prompts[1][5:] = prompts[1][:4]  # a repeat for the lookup chain to find
    expected = [reference(model, p, 20) for p in prompts]
    for prompt, future in zip(prompts, expected):
        out = generate(model, prompt[None], max_new_tokens=20, tree=TREE, eos_token_id=[], lookup_tokens=lookup_tokens)
        assert out.new_tokens[0] == future
    ids, mask = left_pad(prompts)
    out = generate(model, ids, attention_mask=mask, max_new_tokens=20, tree=TREE, eos_token_id=[],
                   lookup_tokens=lookup_tokens)
    assert out.new_tokens == expected


def test_save_load_round_trip_keeps_the_path_projections(tmp_path):
    model = path_model(arch="qwen3")
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["path_input"] is True
    loaded = MedusaModel.from_pretrained(tmp_path, base_model=model.base_model)
    names = {n for n in loaded.heads.state_dict() if "path_proj" in n}
    assert names == {"heads.1.path_proj.0.weight", "heads.2.path_proj.0.weight", "heads.2.path_proj.1.weight"}
    hidden, nxt = torch.randn(2, model.config.hidden_size), torch.tensor([5, 6])
    with torch.no_grad():
        torch.testing.assert_close(loaded.head_logits(hidden, nxt), model.head_logits(hidden, nxt), rtol=0, atol=0)
    assert "reading the candidate path" in (tmp_path / "README.md").read_text()


def test_feature_rows_give_the_true_path():
    examples = [{"input_ids": [5, 6, 7, 8, 9, 10], "labels": [IGNORE, IGNORE, 7, 8, 9, 10]}]
    batch = pad_batch(examples)
    hidden = torch.randn(*batch["input_ids"].shape, 8)
    rows = rows_from_block(block_from_hidden(hidden, batch["input_ids"], batch["labels"], batch["lengths"]), 3)
    assert rows.next_tokens.tolist() == [7, 8, 9]  # from the last prompt position (t = 1) on
    # head 1 reads t + 2 (head 0's target), head 2 reads t + 2 and t + 3; 0 where there is none
    assert rows.path_tokens.tolist() == [[8, 9], [9, 10], [10, 0]]


def test_a_masked_position_inside_the_path_reads_its_token_after_caching_and_concatenation(tmp_path):
    # a one-token masked span inside an answer (a tool result, say): the labels say IGNORE there,
    # the model saw token 9 there, and that is what a head extending the path through it reads
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    examples = [{"input_ids": [3, 4, 5], "labels": [IGNORE, 4, 5]},
                {"input_ids": ids, "labels": [IGNORE, IGNORE, 7, 8, IGNORE, 10, 11, 12]}]
    blocks = []
    for example in examples:
        batch = pad_batch([example])
        hidden = torch.randn(*batch["input_ids"].shape, 8)
        blocks.append(block_from_hidden(hidden, batch["input_ids"], batch["labels"], batch["lengths"]))
    save_file(concat_blocks(blocks), str(tmp_path / "block.safetensors"))
    rows = rows_from_block(load_file(str(tmp_path / "block.safetensors")), 3)
    # rows: where t + 1 and t + 2 are both the answer's (decoding runs the heads there): t = 0 of the
    # first example; t = 1, 4, 5 of the second (t = 2 and 3 border the masked token, which the model
    # did not say)
    assert rows.targets.tolist() == [[5, IGNORE, IGNORE], [8, IGNORE, 10], [11, 12, IGNORE], [12, IGNORE, IGNORE]]
    # t = 1: head 2 reads 9 on its way to 10 (its target), where the labels are masked
    assert rows.path_tokens.tolist() == [[5, 0], [8, 9], [11, 12], [12, 0]]


def triple_examples(n: int, seed: int = 0) -> list[dict]:
    """Triples (a, b, b + 12) with a and b random: the third token of a triple is fixed by the
    second, which neither the hidden state before the triple nor its first token tells."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        ids = [3]
        for _ in range(8):
            a, b = rng.randrange(4, 16), rng.randrange(4, 16)
            ids += [a, b, b + 12]
        examples.append({"input_ids": ids, "labels": [IGNORE] + ids[1:]})
    return examples


@pytest.mark.parametrize("reads_path", [False, True])
def test_only_heads_reading_the_path_learn_what_it_decides(tmp_path, reads_path):
    config = train_on_examples(tmp_path, triple_examples(96),
                               {"num_heads": 2, "next_token_input": True, "path_input": reads_path})
    top1 = config["head_accuracies"][1][0]
    # Head 1 at t predicts t + 3 and reads t + 1 and t + 2. A third of the rows (t just before a
    # triple) have a target fixed by t + 2, the rest a random one (1 in 12): about 0.39 for heads
    # that read the path, about 0.08 for heads that do not.
    if reads_path:
        assert top1 > 0.3
    else:
        assert top1 < 0.2
