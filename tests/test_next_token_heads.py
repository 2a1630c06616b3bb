"""Heads that also read the token at t + 1 (``next_token_input``): initialisation, the root token
wiring in decoding, saving, export refusal, and training on a task only they can learn."""

from __future__ import annotations

import json
import random

import pytest
import torch

from medusa_infer.decoding import generate
from medusa_infer.model import MedusaModel
from medusa_train.features import block_from_hidden, pad_batch, rows_from_block
from medusa_train.losses import IGNORE
from tiny import VOCAB, tiny_model


def heads_model(next_token_input: bool, arch: str = "llama", seed: int = 0, randomize: bool = True,
                **config: object) -> MedusaModel:
    """Three one-block heads on a tiny model, random (not zero) unless ``randomize`` is False."""
    model = MedusaModel.from_base(tiny_model(arch, seed=seed), num_heads=3, num_layers=1,
                                  next_token_input=next_token_input, **config)
    if randomize:
        torch.manual_seed(seed + 1)
        for p in model.heads.parameters():
            torch.nn.init.normal_(p, std=0.3)
    return model


def test_fresh_heads_start_as_plain_heads_do():
    plain, reading = heads_model(False, randomize=False), heads_model(True, randomize=False)
    hidden = torch.randn(5, plain.lm_head.weight.shape[1])
    tokens = torch.randint(3, VOCAB, (5,))
    torch.testing.assert_close(reading.head_logits(hidden, tokens), plain.head_logits(hidden), rtol=0, atol=0)
    assert all(h.token_proj is not None and not h.token_proj.weight.any() for h in reading.heads.heads)
    assert all(h.token_proj is None for h in plain.heads.heads)


def test_the_token_changes_the_logits_and_defaults_to_the_base_models_choice():
    model = heads_model(True)
    hidden = torch.randn(4, model.lm_head.weight.shape[1])
    chosen = model.project(hidden).argmax(-1)
    with torch.no_grad():
        default = model.head_logits(hidden)
        explicit = model.head_logits(hidden, chosen)
        other = model.head_logits(hidden, (chosen + 1) % VOCAB)
    assert torch.equal(default, explicit)
    assert not torch.allclose(other, explicit)


def test_heads_called_without_the_token_say_how_to_fix_it():
    model = heads_model(True)
    hidden = torch.randn(2, model.lm_head.weight.shape[1])
    with pytest.raises(ValueError, match=r"next_token_input=True\): pass next_tokens"):
        model.heads(hidden, model.lm_head)
    with pytest.raises(ValueError, match=r"expected \(2,\)"):
        model.heads(hidden, model.lm_head, None, torch.zeros(3, dtype=torch.long),
                    model.base_model.get_input_embeddings().weight)


def test_decoding_feeds_the_roots_and_stays_exact(monkeypatch):
    """Each step's heads read that step's roots, row by row (the previous step's roots, a token of the answer
    too, passed the check that the token read was emitted, and greedy verification kept the output exact)."""
    from medusa_infer.proposers.medusa import MedusaProposer

    model = heads_model(True)
    seen: list[torch.Tensor] = []
    head_logits = model.head_logits
    roots: list[torch.Tensor] = []  # the roots of the step under way
    propose = MedusaProposer.propose

    def recording(hidden, next_tokens=None, first=None):
        seen.append(next_tokens)
        assert roots and torch.equal(next_tokens, roots[-1]), "the heads read other tokens than this step's roots"
        return head_logits(hidden, next_tokens, first=first)

    def proposing(self, step_roots, context):
        roots.append(step_roots.clone())
        return propose(self, step_roots, context)

    model.head_logits = recording
    monkeypatch.setattr(MedusaProposer, "propose", proposing)
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 3)]
    for prompt in prompts:
        seen.clear()
        out = generate(model, prompt[None], max_new_tokens=16, tree="tree-8", eos_token_id=[])
        hf = model.base_model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=16,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.new_tokens[0] == hf[0, len(prompt):].tolist()
        assert seen and all(tokens is not None for tokens in seen), "the proposer did not pass its roots"
        # every step's root is an emitted token, so the heads read tokens of the answer itself
        assert all(int(tokens[0]) in out.new_tokens[0] for tokens in seen)
    # a batch of rows: each row's heads read its own root (the rows' roots differ)
    seen.clear()
    batch = torch.stack([prompts[0], torch.randint(3, VOCAB, (5,), generator=torch.Generator().manual_seed(50))])
    out = generate(model, batch, max_new_tokens=12, tree="tree-8", eos_token_id=[])
    assert any(tokens.shape[0] == 2 and tokens[0] != tokens[1] for tokens in seen)
    for row in range(2):
        alone = generate(model, batch[row][None], max_new_tokens=12, tree="tree-8", eos_token_id=[])
        assert out.new_tokens[row] == alone.new_tokens[0]


def test_save_load_round_trip_keeps_the_token_projection(tmp_path):
    model = heads_model(True, arch="qwen3")
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["next_token_input"] is True
    loaded = MedusaModel.from_pretrained(tmp_path, base_model=model.base_model)
    names = {n for n in loaded.heads.state_dict() if "token_proj" in n}
    assert names == {f"heads.{k}.token_proj.weight" for k in range(3)}
    ids = torch.randint(3, VOCAB, (1, 9))
    torch.testing.assert_close(loaded(ids, head_positions=None).head_logits,
                               model(ids, head_positions=None).head_logits, rtol=0, atol=0)
    assert "reading the base model's next token" in (tmp_path / "README.md").read_text()


def test_export_to_the_faster_decoding_layout_is_refused(tmp_path):
    with pytest.raises(ValueError, match="next_token_input=True.*save_pretrained"):
        heads_model(True).export_medusa_layout(tmp_path)


def test_feature_rows_carry_the_token_at_t_plus_1():
    examples = [{"input_ids": [5, 6, 7, 8, 9, 10], "labels": [IGNORE, IGNORE, 7, 8, 9, 10]},
                {"input_ids": [11, 12, 13, 14], "labels": [IGNORE, 12, 13, 14]}]
    batch = pad_batch(examples)
    hidden = torch.randn(*batch["input_ids"].shape, 8)
    rows = rows_from_block(block_from_hidden(hidden, batch["input_ids"], batch["labels"], batch["lengths"]), 2)
    # rows sit where decoding runs the heads: from the last prompt position on, where the base model's
    # token (labels[t + 1]) and head 0's target (labels[t + 2]) are both the answer's; each reads input_ids[t + 1]
    assert rows.next_tokens.tolist() == [7, 8, 9, 12, 13]
    assert rows.targets[:, 0].tolist() == [8, 9, 10, 13, 14]


def pair_examples(n: int, seed: int = 0) -> list[dict]:
    """Pairs (a, a + 12) with a random: the token after a pair's first token is fixed by it, but
    nothing before that token tells which it will be."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        ids = [3]
        for _ in range(12):
            a = rng.randrange(4, 16)
            ids += [a, a + 12]
        examples.append({"input_ids": ids, "labels": [IGNORE] + ids[1:]})
    return examples


def train_on_examples(tmp_path, examples: list[dict], heads: dict) -> dict:
    """Train heads (recipe section ``heads``) on a tiny model over ``examples``; the saved config."""
    import train_heads
    from test_training import write_recipe

    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder / "model")
    with (folder / "examples.jsonl").open("w") as handle:
        for example in examples:
            handle.write(json.dumps(example) + "\n")
    out = tmp_path / "run"
    values = {
        "output_dir": str(out),
        "model": {"name": str(folder / "model")},
        "data": {"tokenized": str(folder / "examples.jsonl"), "heldout_fraction": 0.25},
        "heads": {"num_layers": 1, "projection": "own", **heads},
        "features": {"topk": 0, "batch_size": 16},
        "training": {"lr": 0.03, "epochs": 12, "batch_tokens": 256, "warmup_ratio": 0.0},
        "log": {"every": 50, "progress": False},
        "eval": {"tree_size": 4, "top_k": 1},
    }
    train_heads.main(["--config", str(write_recipe(tmp_path / "r.yaml", values))])
    return json.loads((out / "heads" / "config.json").read_text())


@pytest.mark.parametrize("reads_token", [False, True])
def test_only_heads_reading_the_token_learn_what_it_decides(tmp_path, reads_token):
    config = train_on_examples(tmp_path, pair_examples(96), {"num_heads": 1, "next_token_input": reads_token})
    top1 = config["head_accuracies"][0][0]
    # Half the rows (t at a pair's end) have a target fixed by token t + 1, half a random one
    # (1 in 12): about 0.54 for heads that read the token, about 0.08 for heads that do not.
    if reads_token:
        assert top1 > 0.45
    else:
        assert top1 < 0.2
