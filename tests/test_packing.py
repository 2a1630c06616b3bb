"""Packed training batches (``data.pack``): several examples in one row of a backbone forward,
each attending only to itself, giving the features and losses of padded batches."""

from __future__ import annotations

import json
import random

import pytest
import torch

from medusa_infer.model import MedusaModel
from medusa_train import trainer as tr
from medusa_train.features import (
    FeatureCache,
    batch_hidden,
    build_feature_cache,
    check_packed_attention,
    model_fingerprint,
    pack_rows,
    pad_batch,
)
from medusa_train.losses import IGNORE
from medusa_train.train_config import config_from_dict
from test_training import counting_examples, recipe, tiny_dir, train_log, write_recipe  # noqa: F401 (fixture)
from tiny import ARCHITECTURES, sliding_window_base, tiny_model


def sized_examples(lengths: list[int], seed: int = 0) -> list[dict]:
    """Counting examples of the given lengths (at most 20 each)."""
    return [{"input_ids": e["input_ids"][:n], "labels": e["labels"][:n]}
            for e, n in zip(counting_examples(len(lengths), seed), lengths)]


def mixed_examples(n: int, seed: int) -> list[dict]:
    """Counting examples cut to lengths from 6 to 39, so that short ones share rows."""
    rng = random.Random(seed)
    return [{"input_ids": e["input_ids"][:cut], "labels": e["labels"][:cut]}
            for e, cut in zip(counting_examples(n, seed), (rng.randrange(6, 40) for _ in range(n)))]


def test_pack_rows_is_first_fit_decreasing_and_places_every_example_once():
    assert pack_rows([3, 9, 6, 2], 9) == [[1], [2, 0], [3]]
    assert pack_rows([5, 5, 5], 10) == [[0, 1], [2]]
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randrange(1, 30) for _ in range(rng.randrange(1, 12))]
        width = max(lengths) + rng.randrange(0, 10)
        rows = pack_rows(lengths, width)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in row) <= width for row in rows)
        # first fit: an earlier row whose members all came before example i (as long or longer)
        # had no room for it
        for r, row in enumerate(rows):
            for i in row:
                assert all(sum(lengths[j] for j in rows[q]) + lengths[i] > width for q in range(r)
                           if lengths[i] <= min(lengths[j] for j in rows[q]))
    with pytest.raises(ValueError, match="30 tokens does not fit rows of width=20"):
        pack_rows([10, 30], 20)


def test_packed_batch_layout():
    examples = [{"input_ids": [5] * 3, "labels": [IGNORE] * 3}, {"input_ids": [6] * 7, "labels": [6] * 7},
                {"input_ids": [7] * 4, "labels": [7] * 4}]
    batch = pad_batch(examples, pad_id=1, pack=True)
    assert batch["input_ids"].shape == (3, 7)  # the padded layout is kept for the targets
    assert batch["packed_ids"].tolist() == [[6] * 7, [7, 7, 7, 7, 5, 5, 5]]
    assert batch["packed_positions"].tolist() == [list(range(7)), [0, 1, 2, 3, 0, 1, 2]]
    assert batch["slot_row"].tolist() == [1, 0, 1] and batch["slot_start"].tolist() == [4, 0, 0]
    tail = pad_batch(examples[:1] + examples[2:], pad_id=1, pack=True)  # 4 + 3 tokens in a row of 4: two rows
    assert tail["packed_ids"].tolist() == [[7, 7, 7, 7], [5, 5, 5, 1]]
    assert tail["packed_positions"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 0]]  # the padded tail restarts


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_forward_equals_padded_forward(arch, attn):
    model = MedusaModel.from_base(tiny_model(arch, attn_implementation=attn), num_heads=1)
    examples = mixed_examples(7, seed=2)
    check_packed_attention(model)
    with torch.no_grad():
        padded = batch_hidden(model, pad_batch(examples))
        packed_batch = pad_batch(examples, pack=True)
        packed = batch_hidden(model, packed_batch)
    assert len(packed_batch["packed_ids"]) < len(examples)  # some rows hold two examples
    valid = pad_batch(examples)["attention_mask"].bool()
    torch.testing.assert_close(packed[valid], padded[valid], atol=1e-5, rtol=1e-4)


def test_packed_forward_keeps_sliding_windows_per_example():
    # gemma3: one sliding layer of 4 positions, one full; a window counts from each example's start
    model = MedusaModel.from_base(sliding_window_base("gemma3_text", 4, "sdpa"), num_heads=1)
    examples = sized_examples([20, 9, 11, 6, 14], seed=4)  # rows: 20 | 14 + 6 | 11 + 9
    check_packed_attention(model)
    with torch.no_grad():
        padded = batch_hidden(model, pad_batch(examples))
        packed_batch = pad_batch(examples, pack=True)
        packed = batch_hidden(model, packed_batch)
    assert packed_batch["slot_start"].tolist() == [0, 11, 0, 14, 0]  # examples 1 and 3 follow another
    valid = pad_batch(examples)["attention_mask"].bool()
    torch.testing.assert_close(packed[valid], padded[valid], atol=1e-5, rtol=1e-4)


def test_flash_attention_runs_the_rows_as_one(monkeypatch):
    # flash attention packs only a batch of one row: the rows run end to end; SDPA builds the same
    # per-example mask from the one row's restarting positions, so the layout is checked here
    import medusa_train.features as features

    model = MedusaModel.from_base(tiny_model("llama", attn_implementation="sdpa"), num_heads=1)
    assert not features.one_row_packing(model)
    model.base_model.config._attn_implementation = "flash_attention_2"
    assert features.one_row_packing(model)
    model.base_model.config._attn_implementation = "sdpa"
    seen = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda ids, **kw: seen.append(tuple(ids.shape)) or forward(ids, **kw))
    monkeypatch.setattr(features, "one_row_packing", lambda m: True)
    examples = sized_examples([20, 9, 11, 6, 14], seed=5)
    check_packed_attention(model)
    with torch.no_grad():
        padded = batch_hidden(model, pad_batch(examples))
        packed = batch_hidden(model, pad_batch(examples, pack=True))
    assert seen[-2:] == [(5, 20), (1, 60)]  # packed: three rows of 20, end to end
    valid = pad_batch(examples)["attention_mask"].bool()
    torch.testing.assert_close(packed[valid], padded[valid], atol=1e-5, rtol=1e-4)


def test_a_model_that_lets_packed_examples_attend_to_each_other_is_refused(monkeypatch):
    import transformers.masking_utils as masking

    model = MedusaModel.from_base(tiny_model("llama", attn_implementation="sdpa"), num_heads=1)
    check_packed_attention(model)
    # as a transformers (or a model) that does not detect packed sequences from position ids would
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(ValueError, match=r"data.pack: llama with attention 'sdpa' does not keep packed examples "
                                         r"apart: .* set data.pack=false: this model \(or this transformers"):
        check_packed_attention(model)
    with pytest.raises(ValueError, match="data.pack"):
        tr.LiveFeatures(model, counting_examples(2), 3, None, 0, pack=True)


def test_the_check_runs_without_dropout_and_keeps_the_mode():
    from medusa_train.lora import add_lora

    base = tiny_model("llama", attn_implementation="sdpa")
    peft_model = add_lora(base, 4, 8, 0.5, ["q_proj", "v_proj"])
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # so that dropping LoRA inputs changes the hidden states
    model = MedusaModel.from_base(peft_model.get_base_model(), num_heads=1)
    for modes in ("train", "eval", "mixed"):
        model.train(modes != "eval")
        if modes == "mixed":
            model.base_model.model.layers[0].eval()
        before = {name: m.training for name, m in model.named_modules()}
        check_packed_attention(model)
        assert {name: m.training for name, m in model.named_modules()} == before


def test_feature_cache_from_packed_batches_equals_padded(tiny_dir, tmp_path, monkeypatch):
    import medusa_train.features as features

    model = MedusaModel.from_base(tiny_model("llama", attn_implementation="sdpa"), num_heads=1)
    # sorted by length, batches of 5: [20, 20, 9, 6, 5], [4, 4, 4, 3, 3], [2]; the first packs 3 rows
    examples = sized_examples([20, 6, 9, 5, 20, 4, 4, 3, 4, 3, 2])
    info = model_fingerprint(str(tiny_dir / "model"), "float32")
    padded = FeatureCache.load(build_feature_cache(model, examples, tmp_path / "a", info, topk=4, batch_size=5,
                                                   progress=False))
    rows = []

    def spy(batch_examples, pad_id=0, pack=False):
        batch = pad_batch(batch_examples, pad_id, pack)
        rows.append((len(batch["packed_ids"]) if pack else None, len(batch_examples)))
        return batch

    monkeypatch.setattr(features, "pad_batch", spy)
    packed = FeatureCache.load(build_feature_cache(model, examples, tmp_path / "b", info, topk=4, batch_size=5,
                                                   progress=False, pack=True))
    assert (3, 5) in rows  # (the probe's batches are there too)
    for name, tensor in padded.block.items():
        if tensor.is_floating_point():
            torch.testing.assert_close(packed.block[name], tensor, atol=1e-5, rtol=1e-4)
        else:
            assert torch.equal(packed.block[name], tensor), name


def test_resume_fingerprint_has_pack_only_when_set(tiny_dir, tmp_path):
    # checkpoints from before data.pack existed are unpacked runs: they resume as pack=false
    fingerprints = [tr.resume_fingerprint(config_from_dict(recipe(tiny_dir, tmp_path, data={"pack": pack})))
                    for pack in (False, True)]
    assert "pack" not in fingerprints[0]["data"] and fingerprints[1]["data"]["pack"] is True
    # a packed run's checkpoint resumed unpacked is refused, the setting named as it is (it said "now None")
    packed, unpacked = (config_from_dict(recipe(tiny_dir, tmp_path, data={"pack": pack})) for pack in (True, False))
    state = {"world_size": 1, "grad_accum": packed.training.grad_accum, "fingerprint": fingerprints[1]}
    expected, found = tr._resume_settings(unpacked, state, 1)
    assert (found["data.pack"], expected["data.pack"]) == (True, False)
    expected, found = tr._resume_settings(packed, state, 1)
    assert expected == found


def test_medusa2_loss_and_gradients_packed_equal_padded(tiny_dir, tmp_path):
    from medusa_infer.heads import MedusaHeads
    from medusa_train.lora import add_lora

    def task(pack: bool):
        config = config_from_dict(recipe(tiny_dir, tmp_path / "run", data={"pack": pack},
                                         training={"mode": "medusa2", "loss": "kl"},
                                         lora={"target_modules": ["q_proj", "v_proj"]}))
        base = tiny_model("llama", attn_implementation="sdpa")
        base.requires_grad_(False)
        peft_model = add_lora(base, 4, 8, 0.0, config.lora.target_modules)
        torch.manual_seed(1)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # a trained adapter: the student differs from the teacher
                torch.nn.init.normal_(p, std=0.2)
        heads = MedusaHeads(tr.heads_config(config, 32, 96, "llama", None), lm_head_weight=base.lm_head.weight)
        medusa = MedusaModel(peft_model.get_base_model(), heads)
        return tr.Medusa2Task(config, tr.JointModule(medusa, peft_model, 5), mixed_examples(9, seed=8), None)

    class Accelerator:  # what step_denominators asks of accelerate, on one process
        device = torch.device("cpu")
        num_processes = 1

        def reduce(self, tensor, reduction="sum"):
            return tensor

    results = []
    for pack in (False, True):
        t = task(pack)
        batch = t.prepare(torch.arange(9), Accelerator.device)
        loss, metrics = t.loss(t.module, batch, 0, tr.step_denominators(Accelerator(), [t.counts(batch)]))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in t.module.named_parameters() if p.requires_grad}
        results.append((loss.detach(), metrics, grads))
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = results
    assert metrics_a["base_kl"] > 0
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(metrics_b["base_kl"], metrics_a["base_kl"], atol=1e-6, rtol=1e-5)
    assert torch.equal(metrics_b["top1_total"], metrics_a["top1_total"])
    assert grads_a.keys() == grads_b.keys() and any("lora_A" in n for n in grads_a)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-5, rtol=1e-3, msg=name)


@pytest.mark.parametrize("mode", ["medusa1", "medusa2"])
def test_train_heads_with_packing_follows_the_padded_run(tiny_dir, tmp_path, mode, monkeypatch):
    import train_heads

    examples = tmp_path / "examples.jsonl"
    examples.write_text("".join(json.dumps(e) + "\n" for e in mixed_examples(40, seed=9)))
    forwards = []  # (rows run, examples) of every packed batch

    def spy(batch_examples, pad_id=0, pack=False):
        batch = pad_batch(batch_examples, pad_id, pack)
        if pack:
            forwards.append((len(batch["packed_ids"]), len(batch_examples)))
        return batch

    monkeypatch.setattr(tr, "pad_batch", spy)
    training = {"mode": mode, "batch_size": 4, "max_steps": 4, "loss": "ce"}
    logs = []
    for pack in (False, True):
        out = tmp_path / f"pack-{pack}"
        data = {"pack": pack, "tokenized": str(examples)}
        lora = {"lora": {"r": 4, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}} if mode == "medusa2" else {}
        values = recipe(tiny_dir, out, data=data, training=training, features={"enabled": False},
                        model={"name": str(tiny_dir / "model"), "attn_implementation": "sdpa"},
                        heads={"reduced_vocab_size": 30}, **lora)  # dropout draws its masks per layout
        train_heads.main(["--config", str(write_recipe(tmp_path / f"r-{pack}.yaml", values))])
        logs.append(train_log(out))
        assert json.loads((out / "heads" / "config.json").read_text())["training"]["recipe"]["data"]["pack"] is pack
    assert [r["step"] for r in logs[0]] == [r["step"] for r in logs[1]] == [1, 2, 3, 4]
    for padded, packed in zip(*logs):
        assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-4)
    # every training batch and the held-out evaluation ran packed, on fewer rows than examples
    assert len(forwards) > 4 and sum(rows for rows, _ in forwards) < sum(n for _, n in forwards)
