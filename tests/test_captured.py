"""Hidden states kept while distilling (medusa_train.captured) and the feature cache built from them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
import torch
import yaml

from medusa_infer.model import MedusaModel
from medusa_infer.models import load_base_model
from medusa_train.captured import CapturedHidden, KeptRows, hidden_dir, save_batch
from medusa_train.dataset import build_examples
from medusa_train.distill import DistillConfig, distill
from medusa_train.features import FeatureCache, build_feature_cache, model_fingerprint
from medusa_train.losses import IGNORE
# the tiny Llama with the SmolLM2 tokenizer (EOS scaled so that some answers end early, others
# at the token limit), its tokenizer, and one torch thread for this module
from test_distill import model_dir, one_thread, tokenizer  # noqa: F401

WORDS = "cat dog bird fish tree rock cloud river stone lamp book door".split()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    with path.open("w") as handle:
        for k in range(16):
            words = " ".join(WORDS[(k + j) % len(WORDS)] for j in range(1 + (k * 7) % 13))
            handle.write(json.dumps({"id": f"p:{k}", "source": "p", "prompt": f"Tell me about {words}."}) + "\n")
    return path


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, model_dir, prompts_file) -> Path:
    output = tmp_path_factory.mktemp("distilled") / "rows.jsonl"
    distill(DistillConfig(model=str(model_dir), prompts=str(prompts_file), output=str(output), n=16,
                          max_new_tokens=24, batch_size=5, progress=False, save_hidden=True))
    return output


def examples_of(rows_file: Path, tokenizer) -> list[dict]:
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    return build_examples(rows, tokenizer, max_length=1024)


def test_kept_states_are_the_forward_pass_states_of_the_decoded_tokens(distilled, model_dir):
    """Each row's states, decoded in batches with left padding and a KV cache, equal a plain
    forward pass over the row's own tokens at the positions they claim."""
    rows = [json.loads(line) for line in distilled.read_text().splitlines()]
    captured = CapturedHidden.load(hidden_dir(distilled), model_fingerprint(str(model_dir)))
    assert len(captured) == len(rows) == 16
    model = MedusaModel.from_base(load_base_model(str(model_dir)), num_heads=1)
    ended = []
    for prompt, entries in captured.entries.items():
        (sequence, kept), = entries
        states = kept.read()
        # one state per new token: the answer's, plus its end of sequence when it had one
        extra = len(states) - (len(sequence) - len(prompt))
        assert extra in (0, 1)
        ended.append("eos" if extra else "length")
        with torch.no_grad():
            hidden = model(sequence[None], logits_positions=slice(0, 0)).hidden_states[0]
        first = len(prompt) - 1
        torch.testing.assert_close(states, hidden[first : first + len(states)], atol=1e-5, rtol=1e-4)
    assert sorted(ended) == sorted(row["finish_reason"] for row in rows)
    assert set(ended) == {"eos", "length"}


def test_states_cover_an_example_only_where_its_tokens_agree():
    prompt, answer = [5, 6, 7, 8], [10, 11, 12, 13, 14]
    sequence = torch.tensor(prompt + answer)
    states = torch.arange(6, dtype=torch.float32)[:, None].expand(6, 3).clone()  # answer + end of sequence
    captured = CapturedHidden({tuple(prompt): [(sequence, states)]})
    # the template adds the end of turn (2, labelled) and a newline (unlabelled) after the answer
    ids = prompt + answer + [2, 9]
    labels = [IGNORE] * 4 + answer + [2, IGNORE]
    first, found = captured.states_for(ids, labels)
    # rows run from the last prompt token to two before the last label: positions 3..8
    assert first == 3 and found[:, 0].tolist() == [0, 1, 2, 3, 4, 5]
    # tokenised again differently inside the answer: the states after the change are not this
    # example's, so the example is left to the forward pass
    changed = ids[:6] + [99] + ids[7:]
    assert captured.states_for(changed, labels) is None
    # the boundary: the last soft row (t = 8, whose target is the end of turn at 9) reads tokens
    # 0..8, so a change at 9 leaves every row covered and a change at 8 does not (the forward pass
    # then gives that soft row, which the kept states would have lost)
    first, found = captured.states_for(ids[:9] + [99] + ids[10:], labels)
    assert first == 3 and found[:, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert captured.states_for(ids[:8] + [99] + ids[9:], labels) is None
    # another prompt, or too short an answer, finds nothing
    assert captured.states_for([5, 6, 7, 0] + ids[4:], labels) is None
    assert captured.states_for(prompt + [10, 2], [IGNORE] * 4 + [10, 2]) is None
    # an answer cut by the token limit (no end of turn decoded, none labelled): its last soft row needs
    # the state at the last answer token but one, which is there
    cut = CapturedHidden({tuple(prompt): [(sequence, states[:5])]})
    first, found = cut.states_for(prompt + answer, [IGNORE] * 4 + answer)
    assert first == 3 and len(found) == 5
    assert cut.states_for(ids, labels) is None  # an end of turn labelled after it needs one state more


def test_save_batch_checks_its_rows(tmp_path, caplog):
    model = {"name": "m", "content": "abc"}
    for ended, count in ((True, 2), (True, 4), (False, 3), (False, 1)):
        with pytest.raises(ValueError, match="hidden states for 2 answer tokens"):
            save_batch(tmp_path, ["a"], [[1, 2]], [[3, 4]], [ended], [torch.zeros(count, 3)], model)
    with pytest.raises(ValueError, match="one entry per row"):
        save_batch(tmp_path, ["a", "b"], [[1, 2]], [[3, 4]], [False], [torch.zeros(2, 3)], model)
    save_batch(tmp_path, ["a"], [[1, 2]], [[3, 4]], [True], [torch.zeros(3, 3)], model)
    save_batch(tmp_path, ["b"], [[1, 5]], [[3, 4]], [False], [torch.zeros(2, 3)], model)
    assert len(CapturedHidden.load(tmp_path, model)) == 2
    # the same name with other weights (a folder trained again, or written again since) is left out,
    # said: its examples run through the backbone
    with caplog.at_level("WARNING", logger="medusa_train.captured"):
        assert len(CapturedHidden.load(tmp_path, {"name": "m", "content": "def"})) == 0
    assert "2 of the hidden-state files" in caplog.text and "left out" in caplog.text
    # a file written before states carried a fingerprint records the bare model name
    older = tmp_path / "older"
    save_batch(older, ["a"], [[1, 2]], [[3, 4]], [False], [torch.zeros(2, 3)], model)
    path = next(older.glob("batch-*.safetensors"))
    save_file(load_file(str(path)), str(path), metadata={"model": "m"})
    caplog.clear()
    with caplog.at_level("WARNING", logger="medusa_train.captured"):
        assert len(CapturedHidden.load(older, model)) == 0
    assert "1 of the hidden-state files" in caplog.text and ": m)" in caplog.text
    # a file cut short or emptied (a power loss before its write reached the disk) stopped the features stage
    # with a bare SafetensorError: left out, said, its examples run through the backbone
    whole = next(tmp_path.glob("batch-*.safetensors"))
    for damage in (b"", whole.read_bytes()[:-8]):
        damaged = tmp_path / "damaged"
        damaged.mkdir(exist_ok=True)
        (damaged / whole.name).write_bytes(damage)
        save_batch(damaged, ["c"], [[1, 6]], [[3, 4]], [False], [torch.zeros(2, 3)], model)
        caplog.clear()
        with caplog.at_level("WARNING", logger="medusa_train.captured"):
            assert len(CapturedHidden.load(damaged, model)) == 1
        assert f"hidden-state file {damaged / whole.name} cannot be read" in caplog.text
        shutil.rmtree(damaged)


def test_loaded_states_stay_in_their_files_until_an_example_takes_them(tmp_path):
    model = {"name": "m", "content": "abc"}
    states = [torch.randn(3, 4), torch.randn(2, 4)]
    save_batch(tmp_path, ["a", "b"], [[1, 2], [1, 5]], [[3, 4], [6, 7]], [True, False], states, model)
    captured = CapturedHidden.load(tmp_path, model)
    kept = {key: found for key, [(_, found)] in captured.entries.items()}
    assert all(isinstance(found, KeptRows) for found in kept.values())
    torch.testing.assert_close(kept[1, 2].read(), states[0], rtol=0, atol=0)
    torch.testing.assert_close(kept[1, 5].read(1), states[1][:1], rtol=0, atol=0)
    assert len(kept[1, 2]) == 3 and kept[1, 5].read(9).shape == (2, 4)
    # prompt [1, 2], answer [3, 4] and its end of sequence: rows from the last prompt token on
    first, found = captured.states_for([1, 2, 3, 4, 0], [IGNORE, IGNORE, 3, 4, 0])
    assert first == 1
    torch.testing.assert_close(found, states[0][: len(found)], rtol=0, atol=0)


def test_save_hidden_needs_the_local_backend(prompts_file):
    with pytest.raises(ValueError, match="save_hidden needs the local backend"):
        DistillConfig(prompts=str(prompts_file), backend="openai", endpoint="http://127.0.0.1:1", save_hidden=True)


def test_feature_cache_from_kept_states_equals_the_forward_pass(distilled, model_dir, tokenizer, tmp_path):
    """Every covered example gives the forward pass's rows, position for position, with the same
    targets and, up to float rounding, the same states; examples the states do not cover are run
    through the backbone."""
    examples = examples_of(distilled, tokenizer)
    captured = CapturedHidden.load(hidden_dir(distilled), model_fingerprint(str(model_dir)))
    # an example tokenised differently from what was decoded: left to the forward pass
    tampered = dict(examples[0], input_ids=list(examples[0]["input_ids"]))
    answer = tampered["labels"].index(next(v for v in tampered["labels"] if v != IGNORE))
    tampered["input_ids"][answer + 1] = (tampered["input_ids"][answer + 1] + 1) % len(tokenizer)
    examples = [tampered] + examples[1:]
    model = MedusaModel.from_base(load_base_model(str(model_dir)), num_heads=1)
    info = model_fingerprint(str(model_dir))
    kept = FeatureCache.load(build_feature_cache(model, examples, tmp_path / "kept", info, topk=4, batch_size=3,
                                                 progress=False, captured=captured))
    plain = FeatureCache.load(build_feature_cache(model, examples, tmp_path / "plain", info, topk=4, batch_size=3,
                                                  progress=False))
    covered = kept.manifest["captured_examples"]
    assert 0 < covered < len(examples), covered
    assert kept.folder.name != plain.folder.name  # the key tells the two sources apart

    def by_example(cache: FeatureCache) -> dict[int, dict[str, torch.Tensor]]:
        block, out = cache.block, {}
        for local, index in enumerate(block["example_index"].tolist()):
            rows = block["row_example"] == local
            soft = block["soft_example"] == local
            span = slice(block["label_start"][local], block["label_start"][local] + block["label_length"][local])
            out[index] = {"position": block["row_position"][rows],
                          "next": block["tokens"][span][block["row_position"][rows] + 1],
                          "hidden": block["hidden"][rows], "soft_position": block["soft_position"][soft],
                          "soft_ids": block["soft_ids"][soft], "labels": block["labels"][span]}
        return out

    mine, theirs = by_example(kept), by_example(plain)
    assert set(mine) == set(theirs) == set(range(len(examples)))
    from_states = []
    for index, ours in mine.items():
        reference = theirs[index]
        assert torch.equal(ours["labels"], reference["labels"])
        # the same rows from either source: from the last prompt token, where decoding first runs
        # the heads, to two before the answer's last token
        first_answer = int((reference["labels"] != IGNORE).nonzero()[0])
        assert reference["position"][:1].tolist() in ([first_answer - 1], [])  # [] for a one-token answer
        assert torch.equal(ours["position"], reference["position"])
        assert torch.equal(ours["next"], reference["next"])
        if captured.states_for(examples[index]["input_ids"], examples[index]["labels"]) is None:
            # run through the backbone, padded beside other examples than in the plain build (only the uncovered
            # ones are batched there): a row's float32 rounding follows its batch's width (1e-6 apart on a CPU)
            torch.testing.assert_close(ours["hidden"], reference["hidden"], atol=1e-5, rtol=1e-4)
            continue
        from_states.append(index)
        torch.testing.assert_close(ours["hidden"], reference["hidden"], atol=1e-5, rtol=1e-4)
        # every soft row (kept states serve an example only when they cover its last soft row)
        assert torch.equal(ours["soft_position"], reference["soft_position"])
        # the top candidate (ties aside, which random tiny logits do not have)
        assert torch.equal(ours["soft_ids"][:, 0], theirs[index]["soft_ids"][: len(ours["soft_position"]), 0])
    assert len(from_states) == covered and 0 not in from_states


def test_train_heads_keeps_the_distillations_states_for_its_features(model_dir, prompts_file, tmp_path):
    import train_heads

    out = tmp_path / "run"
    recipe = {
        "output_dir": str(out),
        "model": {"name": str(model_dir)},
        "data": {"prompts": str(prompts_file), "n": 16, "max_new_tokens": 24, "distill_batch_size": 8,
                 "heldout_fraction": 0.25},
        "heads": {"num_heads": 2, "num_layers": 1, "projection": "shared"},
        "training": {"lr": 0.01, "epochs": 1, "batch_tokens": 16, "warmup_ratio": 0.0},
        "log": {"every": 1, "progress": False},
        "eval": {"tree_size": 4},
    }
    config = tmp_path / "r.yaml"
    config.write_text(yaml.safe_dump(recipe))
    assert train_heads.main(["--config", str(config)]) == 0
    assert any(hidden_dir(out / "data" / "distilled.jsonl").glob("batch-*.safetensors"))
    # the card names where the prompts came from, whose terms the heads carry (it named only the prompts file)
    assert json.loads((out / "heads" / "config.json").read_text())["training"]["data_sources"] == {"p": 16}
    assert "on 16 rows of conversations, whose prompts came from these sources" in (
        out / "heads" / "README.md").read_text() and "| p | 16 |" in (out / "heads" / "README.md").read_text()
    index = json.loads((out / "features" / "index.json").read_text())
    for split in ("train", "heldout"):
        manifest = json.loads((out / "features" / index[split] / "manifest.json").read_text())
        assert manifest["captured_examples"] > 0, (split, manifest)
    assert (out / "heads" / "config.json").is_file()
    # turned off, the distillation keeps nothing and the features come from the backbone
    off = dict(recipe, output_dir=str(tmp_path / "off"), features={"from_distillation": False})
    config.write_text(yaml.safe_dump(off))
    assert train_heads.main(["--config", str(config)]) == 0
    assert not hidden_dir(tmp_path / "off" / "data" / "distilled.jsonl").exists()
    index = json.loads((tmp_path / "off" / "features" / "index.json").read_text())
    manifest = json.loads((tmp_path / "off" / "features" / index["train"] / "manifest.json").read_text())
    assert manifest["captured_examples"] == 0
    # a bfloat16 backbone's cache took the float32 distillation's states for most examples (off by up to 0.05)
    from medusa_train.train_config import config_from_dict

    bf16 = config_from_dict(dict(recipe, model={"name": str(model_dir), "dtype": "bfloat16"}))
    assert train_heads.captured_folder(bf16) is None and not bf16.keeps_distillation_hidden
    assert train_heads.captured_folder(config_from_dict(recipe)) == hidden_dir(out / "data" / "distilled.jsonl")


def test_kept_states_record_the_fingerprint_they_are_given(model_dir, prompts_file, tmp_path):
    """Every process of a launch records the main process's fingerprint (distill() hands it round):
    nodes may hold copies of the model written at other times, whose own fingerprints differ."""
    from medusa_train.distill import distill_shard, sample_prompts

    output = tmp_path / "rows.jsonl"
    config = DistillConfig(model=str(model_dir), prompts=str(prompts_file), output=str(output), n=2,
                           max_new_tokens=4, batch_size=2, progress=False, save_hidden=True)
    main = {"name": str(model_dir), "content": "the main process's"}
    distill_shard(config, sample_prompts(prompts_file, 2), fingerprint=main)
    assert len(CapturedHidden.load(hidden_dir(output), main)) == 2
