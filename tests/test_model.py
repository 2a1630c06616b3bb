"""MedusaModel on stock tiny models: exact logits, independent heads, checkpoints and clear errors."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast

from medusa_infer.checkpoint import accuracy_table, check_heads_target, foreign_config
from medusa_infer.config import MedusaConfig
from medusa_infer.heads import MedusaHeads, check_token_map
from medusa_infer.model import MedusaModel
from tiny import ARCHITECTURES, VOCAB, tiny_config, tiny_model

HEADS, LAYERS = 3, 2
TREE = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
# Projection variants: "reduced" is shared projection over a 40-token vocabulary.
VARIANTS = ("shared", "own", "reduced")


def base_model(arch: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A tiny model named as if it came from the Hub (from_config leaves ``name_or_path`` empty)."""
    model = tiny_model(arch).to(dtype)
    model.name_or_path = f"tiny-random/{arch}"
    return model


def token_map() -> torch.Tensor:
    """40 distinct, unsorted ids: a mix-up of columns and ids cannot go unnoticed."""
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))[:40]


def medusa(base: PreTrainedModel, variant: str = "shared", **kwargs) -> MedusaModel:
    projection = "shared" if variant == "reduced" else variant
    ids = token_map() if variant == "reduced" else None
    return MedusaModel.from_base(base, num_heads=HEADS, num_layers=LAYERS, projection=projection,
                                 token_map=ids, **kwargs)


@torch.no_grad()
def randomize(model: MedusaModel, seed: int = 0) -> MedusaModel:
    """Random values in every head parameter: zero-initialised blocks would hide mix-ups."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.heads.parameters():
        param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def input_ids(batch: int = 2, seq: int = 7) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def all_logits(model: MedusaModel, ids: torch.Tensor):
    out = model(ids, head_positions=None)
    return out.logits, out.head_logits


def assert_identical(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(found) == sorted(expected)
    for name, tensor in expected.items():
        assert found[name].dtype == tensor.dtype, name
        assert torch.equal(found[name], tensor), name


def front_matter(card: str) -> dict:
    assert card.startswith("---\n"), card[:80]
    return yaml.safe_load(card.split("---\n")[1])


# ----- logits


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_base_logits_are_the_plain_models(arch):
    base = base_model(arch)
    ids = input_ids()
    with torch.no_grad():
        expected = base(ids).logits
    logits, heads = all_logits(medusa(base), ids)
    assert torch.equal(logits, expected)
    assert heads.shape == (HEADS, *expected.shape)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_heads_start_as_the_base_models_next_token_logits(arch, variant):
    model = medusa(base_model(arch), variant)
    logits, heads = all_logits(model, input_ids())
    expected = logits[..., token_map()] if variant == "reduced" else logits
    assert heads.shape == (HEADS, *expected.shape)
    for k in range(HEADS):
        assert torch.equal(heads[k], expected), f"head {k}"


def test_reduced_vocabulary_maps_columns_to_token_ids():
    model = medusa(base_model("llama"), "reduced")
    columns = torch.tensor([[0, 5, 39]])
    assert torch.equal(model.heads.to_full_vocab(columns), token_map()[columns])


def test_reduced_projection_is_gathered_once_and_follows_lm_head():
    model = randomize(medusa(base_model("llama"), "reduced"))
    heads, lm_head = model.heads, model.lm_head
    with torch.no_grad():
        first, _ = heads.shared_projection(lm_head)
        assert heads.shared_projection(lm_head)[0] is first  # no second gather
        assert torch.equal(first, lm_head.weight[token_map()])
        ids = input_ids()
        before = all_logits(model, ids)[1]
        lm_head.weight.mul_(2.0)  # an in-place update: the gather is redone
        assert torch.equal(heads.shared_projection(lm_head)[0], lm_head.weight[token_map()])
        assert not torch.equal(all_logits(model, ids)[1], before)
        lm_head.weight = torch.nn.Parameter(torch.randn_like(lm_head.weight))  # a new tensor
        assert torch.equal(heads.shared_projection(lm_head)[0], lm_head.weight[token_map()])
    copy = __import__("copy").deepcopy(heads)
    assert "_shared_projection" not in copy.__dict__


def test_reduced_projection_passes_gradients_to_a_trainable_lm_head():
    model = medusa(base_model("llama"), "reduced")
    lm_head = model.lm_head
    lm_head.weight.requires_grad_(True)
    hidden = torch.randn(2, model.config.hidden_size)
    model.heads(hidden, lm_head).sum().backward()
    assert lm_head.weight.grad is not None
    rows = lm_head.weight.grad.abs().sum(-1) > 0
    assert rows.sum() == len(token_map()) and rows[token_map()].all()


# ----- independent parameters


@pytest.mark.parametrize("variant", ["shared", "own"])
def test_every_block_has_its_own_parameters(variant):
    model = medusa(base_model("llama"), variant)
    blocks = [block for head in model.heads.heads for block in head.blocks]
    assert len(blocks) == HEADS * LAYERS
    tensors = [t for block in blocks for t in (block.linear.weight, block.linear.bias)]
    assert len({t.data_ptr() for t in tensors}) == len(tensors)

    with torch.no_grad():
        blocks[0].linear.weight.fill_(1.0)
        blocks[0].linear.bias.fill_(1.0)
    assert all(torch.count_nonzero(t) == 0 for t in tensors[2:])


def test_own_projections_on_an_lm_head_with_a_bias_are_warned_about(caplog):
    """``own`` projections have no bias (the FasterDecoding layout's): on a base model whose lm_head has
    one (Phi, GPT-J) they start from its logits less the bias, said when they are made (it was silent)."""
    from test_architectures import CONFIGS, tiny

    base = tiny("phi", CONFIGS["phi"])
    with torch.no_grad():
        base.lm_head.bias.normal_()
    with caplog.at_level(logging.WARNING, logger="medusa_infer.heads"):
        MedusaModel.from_base(base, num_heads=2, projection="shared")
    assert "has a bias" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="medusa_infer.heads"):
        MedusaModel.from_base(base, num_heads=2, projection="own")
    assert "the base model's lm_head has a bias, and projection='own' heads have none" in caplog.text


def test_a_token_map_giving_an_id_twice_is_refused(tmp_path):
    """Two columns scoring one token (a hand-made map, or an edited checkpoint): refused when the heads are
    made and when they are loaded (duplicate siblings filled every tree, and one column never trained)."""
    twice = torch.tensor([7, 7, 7, 8, 9, 10])
    with pytest.raises(ValueError, match=r"token_map gives token ids \[7\] more than once"):
        MedusaModel.from_base(base_model("llama"), num_heads=2, token_map=twice)
    medusa(base_model("llama"), "reduced").save_pretrained(tmp_path / "heads")
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "heads" / "model.safetensors")
    state["token_map"][1] = state["token_map"][0]
    save_file(state, str(tmp_path / "heads" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="more than once"):
        MedusaModel.from_pretrained(tmp_path / "heads", base_model=base_model("llama"))


def test_a_token_map_with_ids_outside_the_vocabulary_names_them(tmp_path):
    medusa(base_model("llama"), "reduced").save_pretrained(tmp_path / "heads")
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "heads" / "model.safetensors")
    state["token_map"][0] = 500
    save_file(state, str(tmp_path / "heads" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"token_map holds token ids \[500\] outside the vocabulary \[0, \d+\)"):
        MedusaModel.from_pretrained(tmp_path / "heads", base_model=base_model("llama"))
    state["token_map"][0] = -3  # no vocabulary has it: a damaged file
    save_file(state, str(tmp_path / "heads" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"token_map holds negative token ids \[-3\]: the heads' weights file is damaged"):
        MedusaModel.from_pretrained(tmp_path / "heads", base_model=base_model("llama"))


def test_own_projections_are_copies_not_views_of_lm_head():
    model = medusa(base_model("llama"), "own")
    lm_weight = model.lm_head.weight
    projections = [head.proj.weight for head in model.heads.heads]
    ptrs = {p.data_ptr() for p in projections}
    assert len(ptrs) == HEADS and lm_weight.data_ptr() not in ptrs

    with torch.no_grad():
        projections[0].zero_()
    assert all(torch.equal(p, lm_weight) for p in projections[1:])
    assert torch.count_nonzero(lm_weight) > 0


@pytest.mark.parametrize("variant", ["shared", "reduced"])
def test_shared_heads_hold_no_copy_of_lm_head(variant, tmp_path):
    model = medusa(base_model("llama"), variant)
    hidden = model.config.hidden_size
    state = model.heads.state_dict()
    expected = {f"heads.{k}.blocks.{l}.linear.{p}" for k in range(HEADS) for l in range(LAYERS)
                for p in ("weight", "bias")}
    assert set(state) == expected | ({"token_map"} if variant == "reduced" else set())
    assert all(t.shape in ((hidden, hidden), (hidden,), (40,)) for t in state.values())
    lm_ptr = model.lm_head.weight.data_ptr()
    assert all(p.data_ptr() != lm_ptr for p in model.heads.parameters())

    model.save_pretrained(tmp_path)
    assert set(load_file(str(tmp_path / "model.safetensors"))) == set(state)


# ----- save_pretrained / from_pretrained


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_save_and_load_round_trip(tmp_path, arch, variant):
    model = randomize(medusa(base_model(arch), variant, tree=TREE))
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json", "model.safetensors"]

    loaded = MedusaModel.from_pretrained(tmp_path, base_model=model.base_model)
    assert loaded.base_model is model.base_model
    assert loaded.config == model.config
    assert_identical(loaded.heads.state_dict(), model.heads.state_dict())
    ids = input_ids()
    assert torch.equal(all_logits(loaded, ids)[1], all_logits(model, ids)[1])


def test_saving_the_same_heads_twice_writes_the_same_bytes(tmp_path):
    model = randomize(medusa(base_model("llama"), "reduced", tree=TREE))
    for run in range(8):  # safetensors once wrote its metadata map in random order
        model.save_pretrained(tmp_path / str(run))
    for name in ("config.json", "model.safetensors", "README.md"):
        assert len({(tmp_path / str(run) / name).read_bytes() for run in range(8)}) == 1, name


def test_round_trip_keeps_bfloat16(tmp_path):
    model = randomize(medusa(base_model("qwen3", torch.bfloat16), "own"))
    assert all(t.dtype == torch.bfloat16 for t in model.heads.state_dict().values())
    model.save_pretrained(tmp_path)
    loaded = MedusaModel.from_pretrained(tmp_path, base_model=model.base_model)
    assert_identical(loaded.heads.state_dict(), model.heads.state_dict())


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_config_json_describes_heads_and_base_model(tmp_path, arch):
    model = medusa(base_model(arch), "own", tree=TREE)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["base_model_name_or_path"] == f"tiny-random/{arch}"
    assert config["base_model_type"] == arch
    assert (config["hidden_size"], config["vocab_size"]) == (32, VOCAB)
    assert (config["num_heads"], config["num_layers"]) == (HEADS, LAYERS)
    assert config["projection"] == "own"
    assert config["tree"] == TREE


def test_model_card_front_matter_and_usage(tmp_path, monkeypatch, capsys):
    model = medusa(base_model("llama"))
    model.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    meta = front_matter(card)
    assert meta["base_model"] == "tiny-random/llama"
    assert meta["library_name"] == "medusa-forge"
    assert {"medusa", "speculative-decoding"} <= set(meta["tags"])
    assert "## Measured" not in card

    # The usage snippet runs as written, with the Hub replaced by this folder and the tiny model.
    usage = card.split("```python\n", 1)[1].split("```", 1)[0]
    assert "MedusaModel.from_pretrained(" in usage
    load = MedusaModel.from_pretrained
    tokenizer = word_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}w5 {{ m['content'] }} w6 {% endfor %}w7"
    rendered = []
    monkeypatch.setattr(MedusaModel, "from_pretrained", staticmethod(
        lambda *args, **kwargs: load(tmp_path, base_model=model.base_model, tokenizer=tokenizer)))
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda messages, **kw: rendered.append(messages) or (
        "w5 w8 w9 w6 w7"))
    exec(compile(usage.replace("max_new_tokens=64", "max_new_tokens=4"), "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()
    # a chat, as the heads were trained on (the raw text prompt= takes made SmolLM2 end its turn at once)
    assert rendered == [[{"role": "user", "content": "What is the capital of France?"}]]
    assert "skip_special_tokens=True" in usage
    # a base model whose tokenizer renders no chats (a base, not an instruct, model): text (messages= failed)
    plain = MedusaModel(model.base_model, model.heads, word_tokenizer())
    plain.save_pretrained(tmp_path / "plain")
    usage = (tmp_path / "plain" / "README.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
    assert "prompt=" in usage and "messages=" not in usage
    monkeypatch.setattr(MedusaModel, "from_pretrained", staticmethod(
        lambda *args, **kwargs: load(tmp_path / "plain", base_model=model.base_model, tokenizer=word_tokenizer())))
    exec(compile(usage.replace("max_new_tokens=64", "max_new_tokens=4"), "README.md", "exec"), {})

    model.save_pretrained(tmp_path / "named", base_model_id="org/real-base")
    assert front_matter((tmp_path / "named" / "README.md").read_text())["base_model"] == "org/real-base"


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary (``w4`` is token 4)."""
    words = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    backend = Tokenizer(WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")


def test_model_card_shows_measured_figures(tmp_path):
    model = medusa(base_model("llama"))
    model.config.head_accuracies = [[0.5 + 0.04 * j - 0.1 * k for j in range(10)] for k in range(HEADS)]
    model.config.acceptance = {"mean_accepted_tokens": 2.31, "tokens_per_step": 3.31}
    model.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()

    assert "| head | top-1 | top-3 | top-5 | top-10 |" in card
    assert "| 1 | 0.500 | 0.580 | 0.660 | 0.860 |" in card
    assert "| 3 | 0.300 | 0.380 | 0.460 | 0.660 |" in card
    assert "| mean_accepted_tokens | 2.31 |" in card
    assert "| tokens_per_step | 3.31 |" in card
    loaded = MedusaModel.from_pretrained(tmp_path, base_model=model.base_model)
    assert loaded.config.head_accuracies == model.config.head_accuracies
    assert loaded.config.acceptance == model.config.acceptance
    # free-form records edited by hand load, and saved again they stopped the save (AttributeError, TypeError)
    for training, acceptance in (({"heldout_head_accuracies": 0.5}, {"calibration_questions": "q.jsonl"}),
                                 ({"heldout_head_accuracies": [0.5, 0.4]}, {"calibration_questions": ["q"]}),
                                 ({}, {"calibration_questions": {"file": "q.jsonl", "ids": 3}})):
        loaded.config.training, loaded.config.acceptance = training, acceptance
        loaded.save_pretrained(tmp_path / "again")
        card = (tmp_path / "again" / "README.md").read_text()
        assert "Head accuracy on held-out data at the end of training" not in card and "Calibrated on" not in card


QA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}Q {{ m['content'] }} "
               "{% else %}A {{ m['content'] }}{{ eos_token }} {% endif %}{% endfor %}"
               "{% if add_generation_prompt %}A{% endif %}")


def test_heads_trained_on_a_recipes_chat_template_bring_it_to_the_tokenizer(tmp_path, caplog):
    """A tokenizer without a template (Vicuna's, a base model's) renders chats as the heads' training did."""
    from medusa_infer.decoding import encode_chat

    model = medusa(base_model("llama"))
    model.config.chat_template = QA_TEMPLATE
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["chat_template"] == QA_TEMPLATE
    assert "chat template in `config.json`" in (tmp_path / "README.md").read_text()
    tokenizer = word_tokenizer()
    with pytest.raises(ValueError, match="no chat template"):
        encode_chat(tokenizer, [{"role": "user", "content": "w5 w6"}])
    loaded = MedusaModel.from_pretrained(tmp_path, base_model=model.base_model, tokenizer=tokenizer)
    assert loaded.tokenizer is tokenizer and tokenizer.chat_template == QA_TEMPLATE
    assert encode_chat(loaded.tokenizer, [{"role": "user", "content": "w5 w6"}]) == ["<s>Q w5 w6 A"]
    loaded.export_medusa_layout(tmp_path / "layout")  # the layout keeps it under a key of ours: said, once
    assert caplog.text.count("other engines render chats with the tokenizer's template unless given this one") == 1
    assert MedusaModel.from_pretrained(tmp_path / "layout", base_model=model.base_model).config.chat_template \
        == QA_TEMPLATE
    MedusaModel.from_pretrained(tmp_path, base_model=model.base_model)  # no tokenizer to install it on: said
    assert "no tokenizer was given" in caplog.text
    # heads saved before the field hold the template only in their recipe record
    old = json.loads((tmp_path / "config.json").read_text())
    del old["chat_template"]
    old["training"] = {"recipe": {"model": {"chat_template": QA_TEMPLATE}}}
    (tmp_path / "config.json").write_text(json.dumps(old))
    tokenizer = word_tokenizer()
    assert MedusaModel.from_pretrained(tmp_path, base_model=model.base_model, tokenizer=tokenizer).config.chat_template
    assert tokenizer.chat_template == QA_TEMPLATE
    # heads trained on the tokenizer's own template leave it alone, and their config does not name the field
    model.config.chat_template = None
    model.save_pretrained(tmp_path / "own")
    assert "chat_template" not in json.loads((tmp_path / "own" / "config.json").read_text())
    other = word_tokenizer()
    other.chat_template = "{{ messages[0]['content'] }}"
    MedusaModel.from_pretrained(tmp_path / "own", base_model=model.base_model, tokenizer=other)
    assert other.chat_template == "{{ messages[0]['content'] }}"
    # heads trained on a recipe's template, set back to the tokenizer's own, stay so once saved
    loaded = MedusaModel.from_pretrained(tmp_path, base_model=model.base_model)
    loaded.config.chat_template = None
    loaded.save_pretrained(tmp_path / "reset")
    again = MedusaModel.from_pretrained(tmp_path / "reset", base_model=model.base_model, tokenizer=other)
    assert again.config.chat_template is None and other.chat_template == "{{ messages[0]['content'] }}"
    # one tokenizer for several heads: those on its own template took the template earlier heads installed
    MedusaModel.from_pretrained(tmp_path, base_model=model.base_model, tokenizer=other)
    assert other.chat_template == QA_TEMPLATE
    MedusaModel.from_pretrained(tmp_path / "own", base_model=model.base_model, tokenizer=other)
    assert other.chat_template == "{{ messages[0]['content'] }}"
    MedusaModel.from_pretrained(tmp_path, base_model=model.base_model, tokenizer=other)
    other.chat_template = "{{ 'by hand' }}"  # a template set since is the user's: kept
    MedusaModel.from_pretrained(tmp_path / "own", base_model=model.base_model, tokenizer=other)
    assert other.chat_template == "{{ 'by hand' }}"


def test_a_tokenizer_given_by_name_is_loaded_and_anything_else_refused(tmp_path):
    """tokenizer="name" was kept as it was, and the first prompt failed with "'str' object is not callable"; the
    heads and the base model swapped failed on a path type error naming neither."""
    from medusa_infer.decoding import generate

    model = medusa(base_model("llama"))
    word_tokenizer().save_pretrained(tmp_path / "tok")
    loaded = MedusaModel.from_base(model.base_model, tokenizer=str(tmp_path / "tok"), num_heads=2)
    assert callable(loaded.tokenizer) and loaded.tokenizer("w5 w6")["input_ids"]
    for bad in (5, ["w5"]):
        with pytest.raises(ValueError, match=f"tokenizer must be a tokenizer .*got a {type(bad).__name__}"):
            MedusaModel.from_base(model.base_model, tokenizer=bad, num_heads=2)
    # a tokenizer class or a function was taken, and the first generate failed naming neither
    for bad in (PreTrainedTokenizerFast, word_tokenizer):
        with pytest.raises(ValueError, match=f"tokenizer must be a tokenizer .*got a {type(bad).__name__}"):
            MedusaModel.from_base(model.base_model, tokenizer=bad, num_heads=2)
    with pytest.raises(ValueError, match="tokenizer must be a tokenizer .*got a str"):
        generate(model, prompt="w5", tokenizer="smollm2-135m-instruct", max_new_tokens=2)
    model.save_pretrained(tmp_path / "heads")
    with pytest.raises(TypeError, match=r"the heads must be a folder or a Hub repo id, got a LlamaForCausalLM: "
                                        r"MedusaModel.from_pretrained\(heads, base_model=model\)"):
        MedusaModel.from_pretrained(model.base_model, str(tmp_path / "heads"))


# ----- FasterDecoding layout


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@pytest.mark.parametrize(("projection", "version"), [("shared", "2"), ("own", "1")])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_faster_decoding_export_round_trip(tmp_path, arch, projection, version, fmt):
    model = randomize(medusa(base_model(arch), projection))
    model.export_medusa_layout(tmp_path, fmt=fmt, version=version)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["version"] == version
    assert written["base_model_name_or_path"] == f"tiny-random/{arch}"

    loaded = MedusaModel.from_pretrained(tmp_path, base_model=model.base_model)
    assert loaded.config.projection == projection
    assert loaded.config.base_model_type == arch
    assert_identical(loaded.heads.state_dict(), model.heads.state_dict())
    ids = input_ids()
    assert torch.equal(all_logits(loaded, ids)[1], all_logits(model, ids)[1])


def test_the_base_model_type_survives_the_layout(tmp_path):
    """Heads refused on a model of another type in our layout were accepted once exported and re-imported
    (the layout dropped the type, and the import took the given model's)."""
    model = medusa(base_model("llama"), "shared")
    model.export_medusa_layout(tmp_path / "fd")
    assert json.loads((tmp_path / "fd" / "config.json").read_text())["medusa_forge_base_model_type"] == "llama"
    with pytest.raises(ValueError, match="heads were trained for model type 'llama', this model is 'qwen2'"):
        MedusaModel.from_pretrained(tmp_path / "fd", base_model=base_model("qwen2"))
    config = json.loads((tmp_path / "fd" / "config.json").read_text())
    config["medusa_forge_base_model_type"] = ["llama"]
    (tmp_path / "fd" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: medusa_forge_base_model_type must be a model type such as "
                                         r"'llama', got \['llama'\]"):
        MedusaModel.from_pretrained(tmp_path / "fd", base_model=base_model("llama"))
    del config["medusa_forge_base_model_type"]  # another trainer's folder: the type of the model given
    (tmp_path / "fd" / "config.json").write_text(json.dumps(config))
    assert MedusaModel.from_pretrained(tmp_path / "fd", base_model=base_model("qwen2")).config.base_model_type == "qwen2"


def test_shared_heads_exported_as_version_1_give_the_same_logits(tmp_path):
    model = randomize(medusa(base_model("mistral"), "shared"))
    model.export_medusa_layout(tmp_path, version="1")
    loaded = MedusaModel.from_pretrained(tmp_path, base_model=model.base_model)
    # recognised as copies of the base lm_head: shared again, not a vocabulary projection per head
    assert loaded.config.projection == "shared"
    assert_identical(loaded.heads.state_dict(), model.heads.state_dict())
    ids = input_ids()
    assert torch.equal(all_logits(loaded, ids)[1], all_logits(model, ids)[1])


def test_version_1_of_shared_heads_refuses_a_base_lm_head_with_a_bias(tmp_path):
    model = randomize(medusa(base_model("mistral"), "shared"))
    model.lm_head.bias = torch.nn.Parameter(torch.randn(model.lm_head.weight.shape[0]))  # as Phi's lm_head has
    with pytest.raises(ValueError, match="lm_head has a bias, which version '1' of shared heads would drop"):
        model.export_medusa_layout(tmp_path / "v1", version="1")
    model.export_medusa_layout(tmp_path / "v2")  # version 2's readers use the base lm_head, bias included


def test_heads_folders_of_the_two_layouts_are_not_written_over(tmp_path):
    model = medusa(base_model("llama"), "own")
    model.save_pretrained(tmp_path / "ours")
    with pytest.raises(ValueError, match="holds heads saved with save_pretrained"):
        model.export_medusa_layout(tmp_path / "ours")
    model.export_medusa_layout(tmp_path / "fd")
    with pytest.raises(ValueError, match="holds heads in the FasterDecoding layout"):
        model.save_pretrained(tmp_path / "fd")
    assert MedusaModel.from_pretrained(tmp_path / "ours", base_model=model.base_model).config.tree == model.config.tree


def test_heads_are_not_written_over_a_models_config(tmp_path, monkeypatch):
    """A sharded base model's folder (no model.safetensors) passed every check: its config.json was replaced by the
    heads' and the model no longer loaded; save_pretrained wrote over a single-file model's weights too."""
    model = medusa(base_model("llama"), "own")
    for folder in ("sharded", "single"):
        model.base_model.save_pretrained(tmp_path / folder, max_shard_size="20KB" if folder == "sharded" else "5GB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    before = {f.name: f.read_bytes() for f in (tmp_path / "single").iterdir()}
    # and FasterDecoding's Medusa-2 releases: a whole model whose config has the heads' keys as well (an export
    # took it for its own layout's)
    model.base_model.save_pretrained(tmp_path / "release", max_shard_size="20KB")
    release = json.loads((tmp_path / "release" / "config.json").read_text())
    (tmp_path / "release" / "config.json").write_text(json.dumps({**release, "medusa_num_heads": 3,
                                                                  "medusa_num_layers": 1}))
    (tmp_path / "unsharded").mkdir()
    (tmp_path / "unsharded" / "config.json").write_text(json.dumps({**release, "medusa_num_heads": 3,
                                                                    "medusa_num_layers": 1}))
    held = {"sharded": r"a model's weights \(model-00001-of-\d+.safetensors\) and their config.json",
            "single": r"a model's config.json \(model_type 'llama'\)",
            "release": r"a model's weights \(model-00001-of-\d+.safetensors\) and their config.json",
            "unsharded": r"a model's config.json \(model_type 'llama'\)"}
    for folder, what in held.items():
        with pytest.raises(ValueError, match=rf"{folder} holds {what}, which writing this layout there would "
                                             "replace: export into another folder"):
            model.export_medusa_layout(tmp_path / folder)
        with pytest.raises(ValueError, match=rf"{folder} holds {what}, which saving heads there would replace: "
                                             "save into another folder"):
            model.save_pretrained(tmp_path / folder)
        if folder != "unsharded":
            AutoModelForCausalLM.from_pretrained(tmp_path / folder)  # still the model
    assert {f.name: f.read_bytes() for f in (tmp_path / "single").iterdir()} == before
    model.export_medusa_layout(tmp_path / "fd")
    model.export_medusa_layout(tmp_path / "fd")  # its own layout's config.json is written over
    model.save_pretrained(tmp_path / "ours")
    model.save_pretrained(tmp_path / "ours")
    (tmp_path / "fd2").mkdir()
    (tmp_path / "fd2" / "config.json").write_text('{"medusa_num_heads": 3, "medusa_num_layers": 1}')
    with pytest.raises(ValueError, match="holds heads in the FasterDecoding layout \\(their config.json\\)"):
        model.save_pretrained(tmp_path / "fd2")
    (tmp_path / "a-file").write_text("")
    for target in (tmp_path / "a-file", tmp_path / "a-file" / "heads"):  # (below it: "cannot be written")
        with pytest.raises(ValueError, match="a-file is a file, not a folder"):
            model.save_pretrained(target)
    from medusa_infer import checkpoint

    with monkeypatch.context() as patch:  # a folder this user cannot write (root may write anywhere: simulated)
        patch.setattr(checkpoint.os, "access", lambda path, mode: False)
        with pytest.raises(ValueError, match="ours cannot be written by this user: save the heads into another"):
            model.save_pretrained(tmp_path / "ours")
    # a write that fails leaves no partial files (a copy of the weights stayed), and the heads there as they were:
    # other heads' (other weights and tree), whose card fails to be written, leave every byte of them
    before = {p.name: p.read_bytes() for p in (tmp_path / "ours").iterdir()}
    other = MedusaModel.from_base(model.base_model, num_heads=model.config.num_heads, tree=[[0], [1]])
    (tmp_path / "ours" / "README.md.partial").mkdir()
    with pytest.raises(IsADirectoryError):
        other.save_pretrained(tmp_path / "ours")
    (tmp_path / "ours" / "README.md.partial").rmdir()
    assert {p.name: p.read_bytes() for p in (tmp_path / "ours").iterdir()} == before
    (tmp_path / "ours" / "config.json").write_text("{ damaged")  # said how to save over it
    with pytest.raises(ValueError, match=r"cannot read \(JSONDecodeError; if it is these heads' own, damaged, "
                                         r"delete it and save again\)"):
        model.save_pretrained(tmp_path / "ours")


def test_paths_with_a_tilde_and_relative_base_folders_load_from_anywhere(tmp_path, monkeypatch):
    """Saving took "~/heads" literally (a folder named ~ in the working directory) where loading expands it; a base
    model from a relative folder was recorded as given, which named nothing from another working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    from medusa_infer.serving.testing import word_tokenizer

    base_model("llama").save_pretrained(tmp_path / "base")
    word_tokenizer().save_pretrained(tmp_path / "base")
    model = MedusaModel.from_base("base", num_heads=HEADS)
    assert model.config.base_model_name_or_path == str(tmp_path / "base")
    (tmp_path / "smollm2-135m-instruct").mkdir()  # a folder named like a default model hides it nowhere
    named = base_model("llama")
    named.name_or_path = "smollm2-135m-instruct"
    assert MedusaModel.from_base(named, num_heads=HEADS).config.base_model_name_or_path == "smollm2-135m-instruct"
    model.save_pretrained("~/heads")
    model.export_medusa_layout("~/fd")
    assert not (tmp_path / "~").exists()
    monkeypatch.chdir(tmp_path / "home")
    for folder in ("~/heads", "~/fd"):
        assert MedusaModel.from_pretrained(folder).config.base_model_name_or_path == str(
            tmp_path / "base")


def test_heads_changed_against_their_config_are_not_saved(tmp_path):
    model = medusa(base_model("llama"), "own")
    model.heads.heads = model.heads.heads[:2]  # saved, the folder failed to load (missing tensors)
    with pytest.raises(ValueError, match=r"self.heads does not fit .*heads.2.*Saved so, they would not load: nothing "
                                         r"was written"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_config_that_is_not_text_is_named(tmp_path):
    medusa(base_model("llama")).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON \(.*utf-8"):
        MedusaModel.from_pretrained(tmp_path, base_model=base_model("llama"))


def test_export_writes_the_full_precision_heads_state_given(tmp_path):
    """Float32 heads on a bfloat16 model were exported rounded to bfloat16, with no way around it (save_pretrained
    had heads_state)."""
    model = randomize(medusa(base_model("llama"), "own"))
    full = {k: v.clone() for k, v in model.heads.state_dict().items()}
    model = MedusaModel.from_base(model.base_model.to(torch.bfloat16), num_heads=HEADS, num_layers=LAYERS,
                                  projection="own")
    model.heads.load_state_dict(full)
    model.export_medusa_layout(tmp_path / "rounded")
    model.export_medusa_layout(tmp_path / "full", heads_state=full)
    assert_identical(MedusaModel.from_pretrained(tmp_path / "full", base_model=base_model("llama")).heads.state_dict(),
                     full)
    rounded = MedusaModel.from_pretrained(tmp_path / "rounded", base_model=base_model("llama")).heads.state_dict()
    assert not all(torch.equal(rounded[k], v) for k, v in full.items())
    with pytest.raises(ValueError, match="heads_state"):
        model.export_medusa_layout(tmp_path / "bad", heads_state={})


def test_export_defaults_to_the_projections_natural_version(tmp_path):
    for projection, version in (("shared", "2"), ("own", "1")):
        out = medusa(base_model("llama"), projection).export_medusa_layout(tmp_path / projection)
        assert json.loads((out / "config.json").read_text())["version"] == version


def test_export_of_heads_on_a_default_model_re_imports_offline_with_its_weights(tmp_path, monkeypatch):
    """Heads on a default model (its GGUF file's weights, dequantized) name its Hub repository for other
    engines and medusa-forge's name for it beside, so re-imported offline they get the weights they were
    trained on."""
    import dataclasses

    from medusa_infer import models
    from medusa_infer.interop import BASE_MODEL_KEY

    name = "tiny-default"
    default = dataclasses.replace(models.DEFAULT_MODELS["smollm2-135m-instruct"], name=name, hub_id="example/tiny")
    monkeypatch.setitem(models.DEFAULT_MODELS, name, default)
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    converted = tmp_path / "cache" / "models" / name  # as fetch_default_model leaves it
    base_model("llama").save_pretrained(converted)
    word_tokenizer().save_pretrained(converted)
    (converted / models.SOURCE_NAME).write_text(json.dumps({"gguf_sha256": default.sha256}))
    model = randomize(MedusaModel.from_base(name, num_heads=HEADS, num_layers=LAYERS))
    model.export_medusa_layout(tmp_path / "fd")
    written = json.loads((tmp_path / "fd" / "config.json").read_text())
    assert (written["base_model_name_or_path"], written[BASE_MODEL_KEY]) == ("example/tiny", name)
    assert "dequantized" in written["medusa_forge_note"]

    loaded = MedusaModel.from_pretrained(tmp_path / "fd")  # offline (conftest): the Hub id would fail
    assert loaded.config.base_model_name_or_path == name
    assert_identical(loaded.heads.state_dict(), model.heads.state_dict())
    assert_identical(loaded.base_model.state_dict(), model.base_model.state_dict())
    loaded.save_pretrained(tmp_path / "ours")
    assert "imported with [medusa-forge]" in (tmp_path / "ours" / "README.md").read_text()
    assert MedusaModel.from_pretrained(tmp_path / "ours").config.base_model_name_or_path == name


def test_faster_decoding_folder_without_weights_names_the_layouts_files(tmp_path):
    model = medusa(base_model("llama"), "own")
    model.export_medusa_layout(tmp_path)
    (tmp_path / "medusa_lm_head.safetensors").unlink()
    with pytest.raises(ValueError, match="neither medusa_lm_head.safetensors nor medusa_lm_head.pt"):
        MedusaModel.from_pretrained(tmp_path, base_model=model.base_model)


@pytest.mark.parametrize("missing", ["./runs/nope/heads", "runs/nope/heads", "~/no-such-heads-folder", "/no/heads"])
def test_a_missing_heads_folder_is_named_not_taken_for_a_hub_id(missing, tmp_path, monkeypatch):
    import huggingface_hub

    fetched = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, revision=None, **kw: fetched.append(repo_id) or str(tmp_path))
    with pytest.raises(ValueError, match="no such heads folder"):
        MedusaModel.from_pretrained(missing)
    with pytest.raises(ValueError, match="no such heads folder"):
        MedusaModel.from_pretrained(Path("nope"))  # a path object is never a Hub id
    assert fetched == []
    medusa(base_model("llama")).save_pretrained(tmp_path)
    MedusaModel.from_pretrained("owner/name", base_model=base_model("llama"))  # a Hub id still is one
    assert fetched == ["owner/name"]


def test_model_card_tells_trained_untrained_and_estimated_figures_apart(tmp_path):
    model = medusa(base_model("llama"))
    model.save_pretrained(tmp_path / "fresh")
    card = (tmp_path / "fresh" / "README.md").read_text()
    assert "not trained" in card and "trained with" not in card
    model.config.training = {"steps": 100}
    model.config.acceptance = {"head_accuracies_measured_on": "greedy answers to 2 questions from q.jsonl",
                               "heldout_positions": [10, 10, 10], "calibrated_tree_nodes": 8,
                               "calibrated_expected_tau": 2.1, "calibrated_expected_speedup": 1.7,
                               "measured_tau": 1.9}
    model.config.head_accuracies = [[0.5, 0.7], [0.3, 0.4], [0.2, 0.3]]
    model.save_pretrained(tmp_path / "trained")
    card = (tmp_path / "trained" / "README.md").read_text()
    assert "trained with [medusa-forge]" in card and "not trained" not in card
    measured = card.split("## Measured acceptance", 1)[1].split("## ", 1)[0]
    assert "| measured_tau | 1.9 |" in measured and "expected" not in measured and "calibrated" not in measured
    # a count of positions is no acceptance figure: it was the only row under "Measured acceptance" after training
    assert "heldout_positions" not in measured
    accuracy = card.split("## Measured head accuracy", 1)[1].split("## ", 1)[0]
    assert "Held-out positions per head: [10, 10, 10]." in accuracy
    estimated = card.split("## Expected acceptance (estimated", 1)[1].split("## ", 1)[0]
    assert "| calibrated_expected_tau | 2.1 |" in estimated and "| calibrated_expected_speedup | 1.7 |" in estimated
    assert "measured on" not in estimated  # no profile: no device to name
    model.config.cost_profile = {"sizes": [1, 2], "seconds": [1.0, 1.2], "device": "cpu float32", "context": 64}
    model.save_pretrained(tmp_path / "trained")  # a CPU's estimated speedup read as any device's
    card = (tmp_path / "trained" / "README.md").read_text()
    estimated = card.split("## Expected acceptance (estimated", 1)[1].split("## ", 1)[0]
    assert "The cost model was measured on cpu float32, 64 cached tokens before each forward:" in estimated
    model.config.cost_profile["longer"] = {"sizes": [1, 2], "seconds": [1.1, 1.5], "device": "cpu float32",
                                           "context": 512}
    model.save_pretrained(tmp_path / "trained")
    card = (tmp_path / "trained" / "README.md").read_text()
    assert ("The cost model was measured on cpu float32, 64 cached tokens before each forward (also 512, by which "
            "decoding prices steps over longer contexts; the estimates are at the first): speedups") in card
    model.config.cost_profile = None
    model.config.training = {"heldout_head_accuracies": [[0.5]]}  # calibration's record, not training's
    model.save_pretrained(tmp_path / "calibrated")
    assert "not trained" in (tmp_path / "calibrated" / "README.md").read_text()
    # calibrated: training's held-out count stays, and is not shown as the calibration's
    model.config.acceptance["calibration_questions"] = {"file": "q.jsonl", "ids": [1, 2]}
    model.save_pretrained(tmp_path / "calibrated")
    card = (tmp_path / "calibrated" / "README.md").read_text()
    model.config.training = {"heldout_head_accuracies": [[0.6, 0.8], [0.4, 0.5], [0.3, 0.4]]}
    model.save_pretrained(tmp_path / "calibrated")
    card = (tmp_path / "calibrated" / "README.md").read_text()
    trained = card.split("## Head accuracy on held-out data at the end of training", 1)[1].split("## ", 1)[0]
    assert "Held-out positions per head: [10, 10, 10]." in trained
    assert card.count("Held-out positions per head") == 1  # not beside the calibration's table
    # an earlier release's calibration kept training's tree's figure, shown beside those of the tree that replaced it
    model.config.acceptance["expected_tokens_per_step_fitted_tree"] = 1.83
    model.save_pretrained(tmp_path / "calibrated")
    assert "expected_tokens_per_step_fitted_tree" not in (tmp_path / "calibrated" / "README.md").read_text()
    model.config.acceptance = {"expected_tokens_per_step_fitted_tree": 1.83}  # training's own: shown
    model.save_pretrained(tmp_path / "trained")
    assert "| expected_tokens_per_step_fitted_tree | 1.83 |" in (tmp_path / "trained" / "README.md").read_text()


# ----- errors


def modified_model(arch: str, **changes) -> PreTrainedModel:
    """A tiny model of ``arch`` with some config values changed."""
    torch.manual_seed(0)
    config = tiny_config(arch)
    for name, value in changes.items():
        setattr(config, name, value)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.name_or_path = f"tiny-random/{arch}-modified"
    return model


@pytest.mark.parametrize(("source", "target", "message"), [
    (lambda: modified_model("llama", hidden_size=48), lambda: base_model("llama"),
     r"hidden size 48, this model has 32"),
    (lambda: modified_model("qwen2", vocab_size=128), lambda: base_model("qwen2"),
     r"vocabulary of 128 tokens, this model has 96"),
    (lambda: base_model("llama"), lambda: base_model("qwen2"),
     r"model type 'llama', this model is 'qwen2'"),
], ids=["hidden_size", "vocab_size", "model_type"])
def test_heads_for_another_base_model_are_refused(tmp_path, source, target, message):
    medusa(source(), "own").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        MedusaModel.from_pretrained(tmp_path, base_model=target())
    # with their datastore (of their own model's tokenizer): the store was blamed, and its removal advised
    from medusa_infer.datastore import DATASTORE_NAME, Datastore
    from medusa_infer.serving.testing import word_tokenizer

    Datastore(torch.tensor([3, 4, 5]), tokenizer="another model's").save(tmp_path / DATASTORE_NAME)
    with pytest.raises(ValueError, match=message):
        MedusaModel.from_pretrained(tmp_path, base_model=target(), tokenizer=word_tokenizer())
    # heads that name no base model: said so (it read "trained for (None)"; for another model type too)
    from medusa_infer.config import MedusaConfig
    from medusa_infer.model import check_compatible

    config = MedusaConfig.load(tmp_path / "config.json")
    config.base_model_name_or_path = None
    with pytest.raises(ValueError, match=r"the base model they were trained for \(their config names none\)"):
        check_compatible(config, target())


def test_heads_for_another_hidden_size_are_refused_from_faster_decoding_layout(tmp_path):
    medusa(modified_model("llama", hidden_size=48), "own").export_medusa_layout(tmp_path)
    with pytest.raises(ValueError, match=r"hidden_size disagrees.*the tensors: 48.*the base model \(.*llama\): 32"):
        MedusaModel.from_pretrained(tmp_path, base_model=base_model("llama"))


def edit_weights(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


@pytest.fixture
def saved(tmp_path) -> tuple[Path, PreTrainedModel]:
    model = medusa(base_model("llama"))
    model.save_pretrained(tmp_path)
    return tmp_path, model.base_model


def test_heads_loaded_onto_other_weights_than_they_were_trained_on_say_so(tmp_path, caplog, monkeypatch):
    """A recipe's model.hub_id naming the model a fine-tune came from: the heads' config named it, and it loaded
    (drafts of the fine-tune's heads, seldom accepted) without a word. The weights training recorded are
    compared with the ones loaded; a base model named by the config that cannot be loaded is named with the fix."""
    from medusa_infer.models import weights_identity

    from tiny import metaspace_tokenizer

    for seed, folder in ((0, "tuned"), (1, "parent")):
        tiny_model("llama", seed=seed).save_pretrained(tmp_path / folder)
    words = metaspace_tokenizer()
    model = medusa(base_model("llama"))
    model.config.base_model_name_or_path = str(tmp_path / "parent")  # (what hub_id wrote)
    model.config.training = {"recipe": {"model": {"name": str(tmp_path / "tuned")}},
                             "settings": {"model_weights": weights_identity(str(tmp_path / "tuned"))}}
    model.save_pretrained(tmp_path / "heads")
    with caplog.at_level("WARNING", logger="medusa_infer.model"):
        MedusaModel.from_pretrained(tmp_path / "heads", tokenizer=words)
    assert f"the heads in {tmp_path / 'heads'} were trained on weights ({tmp_path / 'tuned'}) whose files differ " \
           f"from those of {tmp_path / 'parent'}" in caplog.text
    assert "give the model they were trained on" in caplog.text
    assert "A copy of the same weights saved otherwise (in other shards, say) differs too" in caplog.text
    for given in (str(tmp_path / "tuned"), AutoModelForCausalLM.from_pretrained(tmp_path / "tuned")):
        caplog.clear()
        with caplog.at_level("WARNING", logger="medusa_infer.model"):
            MedusaModel.from_pretrained(tmp_path / "heads", base_model=given, tokenizer=words)
        assert "whose files differ" not in caplog.text
    # named by the config and not to be had (offline, never downloaded): the error named neither it nor the fix
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    (tmp_path / "heads" / "config.json").write_text(json.dumps({**config, "base_model_name_or_path": "no-org/none"}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match=r"the base model 'no-org/none' that .*config.json names could not be loaded: "
                                      r"(.|\n)*\n\(where it cannot be had here, give the base model the heads were "
                                      r"trained on: base_model=") as err:
        MedusaModel.from_pretrained(tmp_path / "heads", tokenizer=words)
    assert str(err.value.__cause__) in str(err.value)  # whole: a gated repo's access link, a login hint, kept
    # given by the caller, not the config: transformers' "couldn't connect ... cached files" named neither
    for load in (lambda: MedusaModel.without_heads("no-org/none", tokenizer=words),
                 lambda: MedusaModel.from_pretrained(tmp_path / "heads", base_model="no-org/none")):
        with pytest.raises(OSError, match=r"the base model 'no-org/none' could not be loaded: (.|\n)*\n\(a Hub id is "
                                          r"read from the cache offline: download it once online; or give a local "
                                          r"folder"):
            load()


def test_an_empty_model_name_is_refused_not_read_as_the_working_folder(tmp_path, monkeypatch):
    """An unset variable's "": the base model and the tokenizer loaded from the working folder, or (from_pretrained's
    base_model="") from the one the heads' config named, without a word."""
    tiny_model("llama").save_pretrained(tmp_path / "base")
    word_tokenizer().save_pretrained(tmp_path / "base")
    model = medusa(base_model("llama"))
    model.config.base_model_name_or_path = str(tmp_path / "base")
    model.save_pretrained(tmp_path / "heads")
    model.export_medusa_layout(tmp_path / "exported")
    monkeypatch.chdir(tmp_path / "base")  # a model folder: "" loaded it
    empty = "the model name is an empty string \\(''\\): give a model folder"
    for load in (lambda: MedusaModel.without_heads(""), lambda: MedusaModel.from_base("", num_heads=2),
                 lambda: MedusaModel.from_pretrained(tmp_path / "heads", base_model=""),
                 lambda: MedusaModel.from_pretrained(tmp_path / "exported", base_model="")):
        with pytest.raises(ValueError, match=empty):
            load()
    with pytest.raises(ValueError, match=empty):
        MedusaModel.from_base(model.base_model, tokenizer="", num_heads=2)
    with pytest.raises(ValueError, match=empty):
        MedusaModel.from_pretrained(tmp_path / "heads", tokenizer="")


def test_a_revision_is_refused_with_a_local_heads_folder(saved, tmp_path, monkeypatch):
    """revision= was dropped without a word where the heads were a folder here (one shadowing the repo meant); a
    repo not cached at that revision, offline, failed naming neither the revision nor the fix."""
    directory, base = saved
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match="no-org/heads is no local folder, and fetching it as a Hub repo at revision "
                                         "'v2' failed \\(where the Hub cannot be reached, a repo is read from the "
                                         "cache: download it once online, with that revision\\)"):
        MedusaModel.from_pretrained("no-org/heads", base_model=base, revision="v2")
    with pytest.raises(ValueError, match=f"revision='v2' picks a version of a Hub repo, and {directory} is a local "
                                         "folder: drop revision="):
        MedusaModel.from_pretrained(directory, base_model=base, revision="v2")
    assert MedusaModel.from_pretrained(directory, base_model=base).config.num_heads == HEADS


def test_the_adapter_and_datastore_flags_must_be_booleans(saved):
    """adapter="false" merged the adapter (any truthy value did)."""
    directory, base = saved
    for flag in ("adapter", "datastore"):
        for bad in ("false", 0, None):
            with pytest.raises(ValueError, match=f"{flag} must be True or False, got {bad!r}"):
                MedusaModel.from_pretrained(directory, base_model=base, **{flag: bad})


def test_medusa2_heads_copied_without_their_adapter_are_named_when_loaded(saved, caplog):
    """A Medusa-2 run's heads read the adapted backbone: a folder copied without adapter/ loaded on the plain
    base model without a word (base logits off by up to 4.4 on a tiny run)."""
    directory, base = saved
    MedusaModel.from_pretrained(directory, base_model=base)
    assert "trained with a Medusa-2 adapter" not in caplog.text
    config = json.loads((directory / "config.json").read_text())
    config["training"] = {"recipe": {"training": {"mode": "medusa2"}}}
    (directory / "config.json").write_text(json.dumps(config))
    MedusaModel.from_pretrained(directory, base_model=base)
    assert re.search(r"were trained with a Medusa-2 adapter .* and the folder holds none \(adapter/\)", caplog.text)
    caplog.clear()
    MedusaModel.from_pretrained(directory, base_model=base, adapter=False)  # asked for the heads alone
    assert "trained with a Medusa-2 adapter" not in caplog.text


def test_missing_tensor_is_named(saved):
    directory, base = saved
    edit_weights(directory, lambda t: t.pop("heads.2.blocks.1.linear.bias"))
    message = re.escape(str(directory)) + r".*missing tensors \['heads\.2\.blocks\.1\.linear\.bias'\]"
    with pytest.raises(ValueError, match=message):
        MedusaModel.from_pretrained(directory, base_model=base)


def test_unexpected_tensor_is_named(saved):
    directory, base = saved
    edit_weights(directory, lambda t: t.update({"heads.3.blocks.0.linear.bias": torch.zeros(32)}))
    with pytest.raises(ValueError, match=r"unexpected tensors \['heads\.3\.blocks\.0\.linear\.bias'\]"):
        MedusaModel.from_pretrained(directory, base_model=base)


def test_misshaped_tensor_is_named(saved):
    directory, base = saved
    edit_weights(directory, lambda t: t.update({"heads.0.blocks.0.linear.weight": torch.zeros(32, 16)}))
    message = r"heads\.0\.blocks\.0\.linear\.weight: checkpoint \(32, 16\), heads \(32, 32\)"
    with pytest.raises(ValueError, match=message):
        MedusaModel.from_pretrained(directory, base_model=base)


def test_weights_of_the_wrong_type_are_named(saved):
    """A token map of floats was cut to integers and integer weights loaded, without a word."""
    directory, base = saved
    integers = torch.zeros(32, 32, dtype=torch.int8)
    edit_weights(directory, lambda t: t.update({"heads.0.blocks.0.linear.weight": integers}))
    with pytest.raises(ValueError, match=r"heads\.0\.blocks\.0\.linear\.weight: int8, where weights are floating"):
        MedusaModel.from_pretrained(directory, base_model=base)
    reduced = MedusaModel.from_base(base_model("llama"), num_heads=2, token_map=torch.arange(3, 40))
    reduced.save_pretrained(directory / "reduced")
    edit_weights(directory / "reduced", lambda t: t.update({"token_map": t["token_map"].float() + 0.7}))
    with pytest.raises(ValueError, match=r"token_map: float32, where token ids are integers"):
        MedusaModel.from_pretrained(directory / "reduced", base_model=base_model("llama"))


def test_a_heads_folder_that_is_no_path_is_named(saved):
    """From a review: save_pretrained(123) failed in pathlib, naming neither the argument nor the fix."""
    directory, base = saved
    with pytest.raises(ValueError, match="the heads folder must be a path .*got int: 123"):
        MedusaModel.from_pretrained(directory, base_model=base).save_pretrained(123)


def test_heads_holding_nan_are_neither_saved_nor_loaded(saved):
    """From a review: heads trained while float16 overflowed were saved NaN, then loaded and run at tau 1.0 without
    a word."""
    from medusa_infer.checkpoint import save_heads

    directory, base = saved
    model = MedusaModel.from_pretrained(directory, base_model=base)
    with torch.no_grad():
        model.heads.heads[1].blocks[0].linear.weight[0, 0] = float("nan")
    before = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    with pytest.raises(ValueError, match=r"tensors holding NaN or infinity: \['heads\.1\.blocks\.0\.linear\.weight'\]"
                                         r"; these heads were trained while the numbers overflowed"):
        model.save_pretrained(directory)
    with pytest.raises(ValueError, match="tensors holding NaN or infinity"):
        save_heads(directory, model.config, model.heads.state_dict())
    assert {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()} == before
    edit_weights(directory, lambda t: t.update({"heads.0.blocks.0.linear.bias": torch.full((32,), float("inf"))}))
    with pytest.raises(ValueError, match=r"tensors holding NaN or infinity: \['heads\.0\.blocks\.0\.linear\.bias'\]"):
        MedusaModel.from_pretrained(directory, base_model=base)


def test_a_save_that_fails_writes_nothing(saved, tmp_path):
    """The config was written before the tensors and the card were made: a heads_state of numpy arrays
    failed after a new config.json sat beside the old weights."""
    directory, base = saved
    model = MedusaModel.from_pretrained(directory, base_model=base)
    before = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    model.config.top_k = 4
    with pytest.raises(ValueError, match="not a tensor"):
        model.save_pretrained(directory, heads_state={k: v.numpy() for k, v in model.heads.state_dict().items()})
    assert {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()} == before
    # settings changed after the config was made, that the folder would fail to load with: refused before writing
    model.config.top_k = 10
    model.config.tree = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="heads config tree: path .* has depth 4 but there are only 3 heads"):
        model.save_pretrained(directory)
    assert {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()} == before
    model.config.tree = None
    # a calibration record without its ids (hand-edited) was a KeyError after the weights were written
    model.config.acceptance = {"calibration_questions": {"file": "q.jsonl"}}
    model.save_pretrained(tmp_path / "again")
    assert "Calibrated on 0 questions of `q.jsonl`" in (tmp_path / "again" / "README.md").read_text()
    assert not list((tmp_path / "again").glob("*.partial"))


def test_a_save_that_fails_leaves_no_heads_beside_another_saves_datastore_or_rename(tmp_path, monkeypatch):
    """The datastore was saved (and a stale one removed) after the new heads were in place: a full disk there left
    the new heads beside the old heads' store, which loaded without a word; a rename that failed left the new
    weights beside the old config.json. Now a save that fails leaves the folder's files as they were."""
    import shutil

    from medusa_infer import checkpoint
    from medusa_infer.datastore import Datastore

    base = tiny_model("llama")
    first = MedusaModel.from_base(base, num_heads=2)
    first.datastore = Datastore.from_sequences([[5, 6, 7, 8, 9, 10]])
    folder = tmp_path / "heads"
    first.save_pretrained(folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    torch.manual_seed(3)
    second = MedusaModel.from_base(base, num_heads=2, tree=[[0], [1], [0, 0]])
    second.datastore = Datastore.from_sequences([[11, 12, 13, 14]])

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(Datastore, "save", full_disk)
        with pytest.raises(OSError, match="No space left"):
            second.save_pretrained(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    plain = MedusaModel.from_base(base, num_heads=2, tree=[[0]])  # no store: the folder's goes with a save, and
    (folder / "README.md.partial").mkdir()  # stays with one that fails
    with pytest.raises(IsADirectoryError):
        plain.save_pretrained(folder)
    (folder / "README.md.partial").rmdir()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    replace, calls = checkpoint.os.replace, []

    def cut(*args):  # the second rename (config.json, after the weights) fails
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        replace(*args)

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint.os, "replace", cut)
        with pytest.raises(KeyboardInterrupt):
            second.save_pretrained(folder)
    assert not list(folder.glob("*.partial"))  # (the weights, moved in, are the new ones: config.json the old)
    second.save_pretrained(folder)  # saved again, whole
    loaded = MedusaModel.from_pretrained(folder, base_model=base)
    assert loaded.config.tree == [[0], [1], [0, 0]] and loaded.datastore.tokens.tolist()[:4] == [11, 12, 13, 14]
    shutil.rmtree(folder)


def test_a_failed_adapter_copy_or_a_refused_save_leaves_the_folders_as_they_were(tmp_path, monkeypatch):
    """The adapter copied beside its place was removed on a failure only once it was whole: a copy cut short by a
    full disk stayed (adapter.partial/); a save its own checks refused left the new folder made, empty."""
    import shutil

    from peft import LoraConfig, get_peft_model

    from medusa_infer.checkpoint import ADAPTER_DIR

    source = tmp_path / "medusa2"
    MedusaModel.from_base(tiny_model("llama"), num_heads=2).save_pretrained(source)
    get_peft_model(tiny_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])) \
        .save_pretrained(str(source / ADAPTER_DIR))
    model = MedusaModel.from_pretrained(source, base_model=tiny_model("llama"))
    target = tmp_path / "out"
    MedusaModel.from_base(tiny_model("llama"), num_heads=2, tree=[[0]]).save_pretrained(target)
    before = {str(p.relative_to(target)): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    real, copied = shutil.copy2, []

    def full_disk(src, dst, **kwargs):  # the adapter's second file finds the disk full
        if copied:
            raise OSError(28, "No space left on device")
        copied.append(src)
        return real(src, dst, **kwargs)

    copytree = shutil.copytree
    with monkeypatch.context() as patch:
        patch.setattr(shutil, "copytree", lambda src, dst, **kw: copytree(src, dst, copy_function=full_disk, **kw))
        with pytest.raises(OSError, match="No space left"):
            model.save_pretrained(target)
    assert {str(p.relative_to(target)): p.read_bytes() for p in target.rglob("*") if p.is_file()} == before
    refused = MedusaModel.from_base(tiny_model("llama"), num_heads=2)
    refused.config.tree = [[0], [0, 0], [0, 0, 0]]  # deeper than the heads: refused by the save's checks
    with pytest.raises(ValueError, match="has depth 3 but there are only 2 heads"):
        refused.save_pretrained(tmp_path / "new" / "heads")
    assert not (tmp_path / "new").exists()


def test_heads_files_are_utf8_and_their_keys_and_folder_checked(tmp_path, monkeypatch):
    """README.md and config.json were written in the locale's encoding (an ASCII locale failed the save of a
    data source named in French); a config.json without num_layers, vocab_size or projection was blamed on the
    weights or the base model ("trained for a vocabulary of 0 tokens"); an integer key in acceptance failed the
    save with a bare TypeError; an empty folder name saved into (and loaded from) the working directory."""
    import os
    import subprocess
    import sys

    base = tiny_model("llama")
    model = MedusaModel.from_base(base, num_heads=2)
    model.config.training = {"data_sources": {"données_été.jsonl": 10}}
    folder = tmp_path / "heads"
    script = ("import sys, torch; sys.path.insert(0, 'tests'); from tiny import tiny_model; "
              "from medusa_infer.model import MedusaModel; m = MedusaModel.from_base(tiny_model('llama'), num_heads=2); "
              "m.config.training = {'data_sources': {'donn\\u00e9es_\\u00e9t\\u00e9.jsonl': 10}}; "
              f"m.save_pretrained({str(folder)!r})")
    ascii_locale = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
                    "PYTHONIOENCODING": "ascii"}
    done = subprocess.run([sys.executable, "-c", script], env=ascii_locale, capture_output=True, text=True,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "données_été.jsonl" in (folder / "README.md").read_text(encoding="utf-8")
    saved = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    for key in ("num_layers", "vocab_size", "projection"):
        (folder / "config.json").write_text(json.dumps({k: v for k, v in saved.items() if k != key}))
        with pytest.raises(ValueError, match=f"config.json has no {key}, which every saved heads config holds"):
            MedusaModel.from_pretrained(folder, base_model=base)
    with pytest.raises(ValueError, match="heads config acceptance keys must be strings \\(JSON's\\), got 3"):
        MedusaConfig(num_heads=1, hidden_size=8, acceptance={3: 1.0})
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="the heads folder is an empty string"):
        model.save_pretrained("")
    with pytest.raises(ValueError, match="the heads folder is an empty string"):
        MedusaModel.from_pretrained("", base_model=base)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads"]


def test_a_hand_edited_tree_with_duplicates_is_kept_normalised(saved, tmp_path):
    """config.json's tree with a path twice: decoding dropped the copy, but it was saved again, and exported as
    medusa_choices, where an engine that takes the list as it is counts nodes twice."""
    directory, base = saved
    path = directory / "config.json"
    original = path.read_text()
    try:
        path.write_text(json.dumps({**json.loads(original), "tree": [[0, 0], [0], [0], [1], [0, 0]]}))
        model = MedusaModel.from_pretrained(directory, base_model=base)
    finally:
        path.write_text(original)
    assert model.config.tree == [[0], [1], [0, 0]]
    model.save_pretrained(tmp_path / "ours")
    model.export_medusa_layout(tmp_path / "theirs")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["tree"] == [[0], [1], [0, 0]]
    assert json.loads((tmp_path / "theirs" / "config.json").read_text())["medusa_choices"] == [[0], [1], [0, 0]]


def test_truncated_weights_file_is_reported(saved):
    directory, base = saved
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors could not be read.*truncated or corrupted"):
        MedusaModel.from_pretrained(directory, base_model=base)


@pytest.mark.parametrize("edit, message", [
    (lambda c: None, "a heads config is a JSON object of settings, got NoneType"),
    (lambda c: [], "a heads config is a JSON object of settings, got list"),
    (lambda c: {**c, "num_heads": "3"}, "heads config num_heads must be int, got '3'"),
    (lambda c: {**c, "training": None}, "heads config training must be dict, got None"),
    (lambda c: {**c, "next_token_input": "yes"}, "heads config next_token_input must be bool"),
    (lambda c: {**c, "tree": [0, 1, 2]}, r"heads config tree must be null or a list of rank paths"),
    (lambda c: {**c, "tree": [[0], None]}, r"heads config tree must be null or a list of rank paths"),
    (lambda c: {**c, "head_accuracies": [0.5, 0.7]}, "heads config head_accuracies must be null or a list of each"),
    (lambda c: {**c, "head_accuracies": [0.5, 0.7], "format_version": 1, "cost_profile": {"seconds": [1.0]}},
     "heads config head_accuracies must be null or a list of each"),  # converted from per-rank ones first
    (lambda c: {**c, "path_accuracies": [[[0], 0.5, 1]]}, r"heads config path_accuracies must be null or a list of \[rank"),
    (lambda c: {**c, "head_accuracies": [[0.5, 0.6], [0.3]]}, r"head_accuracies rows have lengths \[2, 1\]"),
    (lambda c: {**c, "format_version": "2"}, "heads config format_version must be an integer .*, got '2'"),
    (lambda c: {**c, "format_version": None}, "heads config format_version must be an integer .*, got None"),
    (lambda c: {**c, "hidden_size": -32}, "heads config hidden_size must be >= 0, got -32"),
    (lambda c: {**c, "reduced_vocab_size": True}, "heads config reduced_vocab_size must be int or null, got True"),
    (lambda c: {**c, "acceptance": [1, 2]}, r"heads config acceptance must be dict or null, got \[1, 2\]"),
    (lambda c: {**c, "chat_template": 5}, "heads config chat_template must be str or null, got 5"),
    (lambda c: {**c, "base_model_name_or_path": 5}, "heads config base_model_name_or_path must be str or null"),
    # a training record that is no mapping crashed the load with an AttributeError (reading its recipe)
    (lambda c: {**c, "training": ["run 1"]}, r"heads config training must be dict .*, got \['run 1'\]"),
    # loaded, then failed at the first generate (a path the user never gave) or exported as they were
    (lambda c: {**c, "tree": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]},
     r"heads config tree: path \(0, 0, 0, 0\) has depth 4 but there are only 3 heads.*config.json's tree"),
    (lambda c: {**c, "tree": [[0], [12]]}, r"heads config tree: path \(12,\) has rank 12 outside \[0, 10\)"),
    (lambda c: {**c, "tree": [[0], [1, 0], [1]][:2]}, r"heads config tree: .*parent"),
    (lambda c: {**c, "head_accuracies": [[0.5]] * 5}, "head_accuracies has 5 rows for 3 heads"),
    (lambda c: {**c, "head_accuracies": [[float("nan")]] * 3}, r"head_accuracies must hold accuracies in \[0, 1\]"),
    (lambda c: {**c, "path_accuracies": [[[0], 5.0]]}, r"path_accuracies entry \[\[0\], 5.0\]"),
    (lambda c: {**c, "path_accuracies": [[[0, 0, 0, 0], 0.1]]}, r"path_accuracies entry .*a path of 1 to 3 ranks"),
    # no table a calibration could measure: named at the first generate, not as the config's
    (lambda c: {**c, "path_accuracies": [[[0], 0.5], [[0, 0], 0.6]]}, r"heads config path_accuracies: path prob"),
    (lambda c: {**c, "path_accuracies": [[[0], 0.9], [[1], 0.9]]}, r"heads config path_accuracies: the paths under"),
    (lambda c: {**c, "cost_profile": {"sizes": [1, 2]}}, r"heads config cost_profile .* is not a cost profile"),
    (lambda c: {**c, "format_version": 0}, r"heads config format_version must be an integer >= 1 .*, got 0"),
    (lambda c: {**c, "format_version": 1, "head_accuracies": [[0.5, 0.6]] * 3, "cost_profile": {"sizes": [1],
     "seconds": [1.0]}}, r"head_accuracies must hold accuracies in \[0, 1\]"),  # summed: 1.1, not rounding
    # a newer release's config: told to upgrade (it was told its heads came from vLLM or EAGLE)
    (lambda c: {**c, "format_version": 3, "draft_temperature": 0.5}, "is newer than this medusa-forge supports"),
    (lambda c: {**c, "draft_temperature": 0.5}, r"unknown keys \['draft_temperature'\].*newer medusa-forge"),
    # a misspelt key: it was told to upgrade, and top_k kept its default
    (lambda c: {**c, "topk": 5}, r"unknown keys \['topk'\] in a medusa-forge heads config \('topk': did you mean "
                                 r"'top_k'\?\); .*Misspelt, or written by a newer"),
    # read as their defaults, and blamed on the weights (missing tensors, shapes (0, 0))
    (lambda c: {k: v for k, v in c.items() if k != "num_heads"}, "has no num_heads, which every saved heads config"),
    (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "has no hidden_size, which every saved heads"),
])
def test_a_config_of_the_wrong_shape_is_named(saved, edit, message):
    """Valid JSON that is no heads config: a ValueError naming the value (TypeError or AttributeError
    tracebacks, or loaded heads that failed when saved again)."""
    directory, base = saved
    path = directory / "config.json"
    original = path.read_text()
    try:
        path.write_text(json.dumps(edit(json.loads(original))))
        with pytest.raises(ValueError, match=message):
            MedusaModel.from_pretrained(directory, base_model=base)
    finally:
        path.write_text(original)


def test_a_config_is_written_as_strict_json(tmp_path, caplog):
    """NaN was written as NaN, which strict JSON readers refuse: in a record (a diverged run's last loss) it is
    written as null, and said (refused, the run's heads were lost at its end); a nested integer key came back a
    string; a value JSON has no form for failed with a TypeError naming no field."""
    import numpy as np

    model = medusa(base_model("llama"))
    model.config.training = {"final_train_record": {"step": 9, "loss": float("nan"), "head_top1": [0.5, float("inf")]}}
    model.config.acceptance = {"tau": float("nan")}
    with caplog.at_level("WARNING", logger="medusa_infer.config"):
        model.save_pretrained(tmp_path / "heads")
    assert "heads config acceptance.tau, training.final_train_record.loss, training.final_train_record.head_top1[1] " \
           "are not a finite number, written as null" in caplog.text
    json.loads((tmp_path / "heads" / "config.json").read_text(), parse_constant=pytest.fail)  # (strict: no NaN)
    again = MedusaConfig.load(tmp_path / "heads" / "config.json")
    assert again.training["final_train_record"] == {"step": 9, "loss": None, "head_top1": [0.5, None]}
    assert again.acceptance == {"tau": None}
    card = (tmp_path / "heads" / "README.md").read_text()  # (as config.json holds it: it showed NaN and inf)
    assert not re.search(r"\b(NaN|inf)\b", card) and '"loss": null' in card
    model.config.training = {"final_train_record": {"accuracy": np.float32(0.5)}}
    with pytest.raises(ValueError, match="heads config training.final_train_record.accuracy is a float32 "
                                         "\\(np.float32\\(0.5\\)\\), which JSON has no form for"):
        model.save_pretrained(tmp_path / "other")
    assert not (tmp_path / "other").exists()
    with pytest.raises(ValueError, match="heads config training keys must be strings \\(JSON's\\), got 1"):
        MedusaConfig(num_heads=2, training={"counts": [{1: 2}]})


def test_a_free_form_training_record_saves_and_loads(tmp_path):
    """The training record is free-form: a recipe given as a path (not the recipe itself) made saving fail
    with an AttributeError, reading the recipe's template, and nothing was written."""
    model = medusa(base_model("llama"))
    model.config.training = {"recipe": "configs/medusa1.yaml", "steps": 5}
    model.save_pretrained(tmp_path / "heads")
    again = MedusaModel.from_pretrained(tmp_path / "heads", base_model=base_model("llama"))
    assert again.config.training == {"recipe": "configs/medusa1.yaml", "steps": 5}
    model.config.training = {"recipe": {"model": "smollm2"}}
    model.save_pretrained(tmp_path / "heads")
    assert MedusaModel.from_pretrained(tmp_path / "heads", base_model=base_model("llama")).config.chat_template is None


def test_from_base_names_the_settings_it_takes_from_the_base_model():
    """from_base(reduced_vocab_size=10), the config field's name, was a raw TypeError ("got multiple values")."""
    with pytest.raises(ValueError, match="from_base sets reduced_vocab_size itself .*pass token_map="):
        MedusaModel.from_base(base_model("llama"), num_heads=2, reduced_vocab_size=10)
    with pytest.raises(ValueError, match="from_base sets hidden_size, vocab_size itself"):
        MedusaModel.from_base(base_model("llama"), num_heads=2, hidden_size=8, vocab_size=8)


def test_logits_processors_a_generation_config_asks_for_are_named_when_loaded(caplog):
    """Decoding here is plain greedy: a repetition penalty in the model's generation_config (as
    Qwen2.5-Instruct ships) makes model.generate give other text, and loading says so."""
    from medusa_infer.model import processor_settings

    base = base_model("llama")
    assert processor_settings(base) == {}
    MedusaModel.without_heads(base)
    assert "does not apply" not in caplog.text
    base.generation_config.repetition_penalty, base.generation_config.no_repeat_ngram_size = 1.05, 0
    assert processor_settings(base) == {"repetition_penalty": 1.05}
    MedusaModel.without_heads(base)
    assert "LlamaForCausalLM's generation_config sets repetition_penalty=1.05, which medusa-forge does not apply" \
        in caplog.text
    # a forced token id 0 is a token transformers forces (any but None), not a neutral value
    base.generation_config.repetition_penalty, base.generation_config.forced_eos_token_id = 1.0, 0
    assert processor_settings(base) == {"forced_eos_token_id": 0}


def test_sampling_defaults_a_generation_config_sets_are_named_and_a_later_change_too(caplog, monkeypatch):
    """model.generate samples at the temperature, top_k and top_p of a model's generation config (Qwen2.5's
    0.7 / 20 / 0.8); generate() here takes what it is given: loading said nothing of them, nor of a
    repetition penalty set on the generation config after loading."""
    from medusa_infer.model import sampling_settings

    base = base_model("llama")
    assert sampling_settings(base) == {}
    config = base.generation_config
    config.do_sample, config.temperature, config.top_k, config.top_p, config.min_p = True, 0.7, 20, 0.8, 0.2
    assert sampling_settings(base) == {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
                                       "min_p": 0.2}
    model = MedusaModel.without_heads(base)
    assert ("LlamaForCausalLM's generation_config sets do_sample=True, temperature=0.7, top_k=20, top_p=0.8, "
            "min_p=0.2, which medusa-forge does not take from it (model.generate does)") in caplog.text
    assert "min_p has no counterpart here" in caplog.text
    # what each entry point samples with instead, the server's OpenAI defaults too (it named generate()'s alone,
    # and a server sampled at 1 where its log said greedy)
    assert "medusa-serve samples a request at the temperature and top_p it sends (OpenAI's 1 and 1" in caplog.text
    assert "distillation (medusa_train.distill) greedily unless given --do-sample" in caplog.text
    caplog.clear()
    model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2)
    assert caplog.text == ""  # said once
    config.repetition_penalty = 3.0
    model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2)
    assert "sets repetition_penalty=3.0, which medusa-forge does not apply" in caplog.text
    # ... also through decoding.generate, the function the README shows (only MedusaModel.generate looked again)
    from medusa_infer.decoding import generate

    caplog.clear()
    config.repetition_penalty = 2.0
    generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=2)
    assert "sets repetition_penalty=2.0, which medusa-forge does not apply" in caplog.text
    # a length or a beam search set there, which model.generate takes and this does not (silent: other text)
    caplog.clear()
    config.num_beams, config.max_new_tokens = 3, 5
    generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=2)
    assert ("sets num_beams=3, max_new_tokens=5, which medusa-forge does not take from it (model.generate does): "
            "each prompt gets one sequence (no beam search)") in caplog.text
    assert "the --max-new-tokens of medusa-generate, medusa-bench and medusa_train.distill, a request's max_tokens " \
        "in medusa-serve" in caplog.text
    # a max_length (prompt included, as Llama-2's configs set 4096) too: it was left out without a word
    caplog.clear()
    config.num_beams, config.max_new_tokens, config.max_length = 1, None, 6
    generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=2)
    assert "sets max_length=6, which medusa-forge does not take from it" in caplog.text
    # the default of the installed release says nothing: None in 5.25, 20 in releases whose every config held it
    import medusa_infer.model as model_module

    class Releases20(GenerationConfig):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.max_length = kwargs.get("max_length", 20)

    for default, release in ((GenerationConfig().max_length, GenerationConfig), (20, Releases20)):
        monkeypatch.setattr(model_module, "GenerationConfig", release)
        caplog.clear()
        config.max_length = default
        generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=2)
        assert caplog.text == "", default


def test_unknown_config_key_is_named(saved):
    directory, base = saved
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "medusa_choices": [[0]]}))
    with pytest.raises(ValueError, match=r"unknown keys \['medusa_choices'\].*known keys: \[.*'num_heads'"):
        MedusaModel.from_pretrained(directory, base_model=base)


def test_a_fasterdecoding_weights_file_without_its_config_is_named(saved, tmp_path):
    directory, base = saved
    layout = tmp_path / "fd"
    layout.mkdir()
    (layout / "medusa_lm_head.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"config\.json is missing.*holds medusa_lm_head\.safetensors of the "
                                         r"FasterDecoding layout, whose config\.json"):
        MedusaModel.from_pretrained(layout, base_model=base)


def test_version_1_calibrated_accuracies_are_read_as_cumulative(saved):
    """Calibration under format 1 stored per-rank accuracies; training always stored cumulative."""
    directory, base = saved
    path = directory / "config.json"
    old = {**json.loads(path.read_text()), "format_version": 1, "cost_profile": {"sizes": [1], "seconds": [0.1]},
           "head_accuracies": [[0.3, 0.1, 0.05]] * HEADS}
    path.write_text(json.dumps(old))
    config = MedusaModel.from_pretrained(directory, base_model=base).config
    assert config.format_version == 2
    assert config.head_accuracies[0] == pytest.approx([0.3, 0.4, 0.45])
    assert config.acceptance_model()[0] == pytest.approx([0.3, 0.1, 0.05])
    # parts rounded to 5 digits summing past 1 where the truth is 1 (refused as above 1)
    path.write_text(json.dumps({**old, "head_accuracies": [[0.16667] * 6] * HEADS, "top_k": 6}))
    assert MedusaModel.from_pretrained(directory, base_model=base).config.head_accuracies[0][-1] == 1.0
    path.write_text(json.dumps({**old, "format_version": 2}))  # the same numbers under format 2 are refused
    with pytest.raises(ValueError, match=r"head_accuracies\[0\] = \[0.3, 0.1, 0.05\] must be cumulative"):
        MedusaModel.from_pretrained(directory, base_model=base)


def test_missing_weights_file_is_reported(saved):
    directory, base = saved
    (directory / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model\.safetensors is missing"):
        MedusaModel.from_pretrained(directory, base_model=base)


def test_a_token_map_of_booleans_is_refused():
    """Bools are no token ids (a map of them loaded as ids 0 and 1)."""
    from medusa_infer.checkpoint import check_state_dict

    expected = {"token_map": torch.arange(4)}
    with pytest.raises(ValueError, match="token_map: bool, where token ids are integers"):
        check_state_dict(expected, {"token_map": torch.tensor([True, False, True, True])}, "x")
    # given to from_base: floats were cut to integers (3.9 to 3) without a word, a mask read as ids 0 and 1
    base = base_model("llama")
    with pytest.raises(ValueError, match="token_map must hold integer token ids, got dtype torch.float32"):
        MedusaModel.from_base(base, num_heads=2, token_map=torch.tensor([3.9, 10.2]))
    with pytest.raises(ValueError, match=r"dtype torch.bool \(a mask of the ids to keep: mask.nonzero"):
        MedusaModel.from_base(base, num_heads=2, token_map=torch.arange(base.config.vocab_size) < 40)
    assert MedusaModel.from_base(base, num_heads=2, token_map=[3, 10]).heads.token_map.tolist() == [3, 10]


def test_a_training_runs_folder_given_for_its_heads_is_named(tmp_path):
    model = medusa(base_model("llama"))
    run = tmp_path / "run"
    model.save_pretrained(run / "heads")
    base = model.base_model
    with pytest.raises(ValueError, match=rf"config\.json is missing: .* a training run's folder\? its heads are in "
                                         rf"{run / 'heads'}$"):
        MedusaModel.from_pretrained(run, base_model=base)


def test_a_model_without_heads_cannot_be_saved(tmp_path):
    model = MedusaModel.without_heads(base_model("llama"))
    with pytest.raises(ValueError, match="has no heads"):
        model.save_pretrained(tmp_path / "heads")
    assert not (tmp_path / "heads").exists()


def test_reduced_projection_gathered_in_inference_mode_still_trains():
    """Evaluation under inference_mode, then training with a frozen lm_head (Medusa-2 style)."""
    model = medusa(base_model("llama"), "reduced")
    model.lm_head.weight.requires_grad_(False)
    hidden = torch.randn(2, model.config.hidden_size)
    with torch.inference_mode():
        model.heads(hidden, model.lm_head)
    model.heads(hidden.requires_grad_(), model.lm_head).sum().backward()
    assert hidden.grad is not None


def test_reduced_vocabulary_heads_loaded_in_inference_mode_generate(tmp_path):
    """Heads loaded inside ``torch.inference_mode()`` hold an inference-tensor ``token_map`` (no version
    counter): generating with them, in inference mode or not, works (it raised at every call)."""
    medusa(base_model("llama"), "reduced").save_pretrained(tmp_path / "heads")
    with torch.inference_mode():
        model = MedusaModel.from_pretrained(tmp_path / "heads", base_model=base_model("llama"))
    assert model.heads.token_map.is_inference()
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = model.generate(ids, max_new_tokens=6, eos_token_id=[]).new_tokens
    with torch.inference_mode():
        assert model.generate(ids, max_new_tokens=6, eos_token_id=[]).new_tokens == plain


def test_model_card_names_the_hub_id_of_a_default_models_short_name(tmp_path):
    """save_heads, as training's evaluation calls it, writes the default model's Hub repository, not
    the short name it is loaded by."""
    from medusa_infer.checkpoint import save_heads
    from medusa_infer.models import DEFAULT_MODELS

    model = medusa(base_model("llama"))
    name = "smollm2-135m-instruct"
    config = model.config.__class__(**{**model.config.to_dict(), "base_model_name_or_path": name})
    save_heads(tmp_path, config, model.heads.state_dict())
    assert front_matter((tmp_path / "README.md").read_text())["base_model"] == DEFAULT_MODELS[name].hub_id


@pytest.mark.parametrize("name", ["my heads", "owner/heads--v1"])
def test_a_missing_folder_that_cannot_be_a_hub_id_is_named_as_a_folder(name):
    with pytest.raises(ValueError, match=f"no such heads folder: {name} .* cannot be a Hub repo id either"):
        MedusaModel.from_pretrained(name)


@pytest.mark.parametrize("build", ["from_base", "without_heads", "from_pretrained"])
def test_a_base_model_built_from_a_config_decodes_in_eval_mode(build, tmp_path):
    """from_config gives a model in training mode: with dropout in its config, greedy decoding gave other
    tokens on every call."""
    config = tiny_config("llama")
    config.attention_dropout = 0.5
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    assert base.training
    if build == "from_pretrained":
        MedusaModel.from_base(tiny_model("llama"), num_heads=2).save_pretrained(tmp_path / "heads")
        model = MedusaModel.from_pretrained(tmp_path / "heads", base_model=base)
    else:
        model = getattr(MedusaModel, build)(base, **({"num_heads": 2} if build == "from_base" else {}))
    assert not base.training
    prompt = torch.tensor([[3, 5, 7, 9, 11]])
    runs = [model.generate(prompt, max_new_tokens=12, eos_token_id=[]).new_tokens for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_a_tree_past_the_heads_reduced_vocabulary_is_refused_by_name():
    """Heads scoring 5 tokens (a token map) and a tree taking rank 7: torch's topk failed mid-decoding."""
    model = MedusaModel.from_base(tiny_model("llama"), num_heads=2, token_map=torch.arange(7, 12))
    prompt = torch.tensor([[3, 5, 7]])
    with pytest.raises(ValueError, match=r"the tree takes rank 7 of a head, but the heads score 5 tokens"):
        model.generate(prompt, max_new_tokens=4, eos_token_id=[], tree=[[0], [7]])
    assert len(model.generate(prompt, max_new_tokens=4, eos_token_id=[], tree=[[0], [4]]).new_tokens[0]) == 4
    # no tree given: the default is one that fits the 3 tokens 4 heads score (it failed, ranking past them)
    narrow = MedusaModel.from_base(tiny_model("llama"), num_heads=4, token_map=torch.arange(10, 13))
    plain = narrow.generate(prompt, max_new_tokens=6, eos_token_id=[], tree=[]).new_tokens[0]
    assert narrow.generate(prompt, max_new_tokens=6, eos_token_id=[]).new_tokens[0] == plain


@torch.no_grad()
def test_positions_given_as_tensors_pick_those_positions():
    """``logits_positions`` / ``head_positions`` as ``[p]`` (shared by every row) or ``[batch, p]`` (per row)
    give the logits at exactly those positions, as the full output holds them (only slices are used inside
    the project, so nothing else exercises these forms)."""
    model = MedusaModel.from_base(tiny_model("llama"), num_heads=2)
    generator = torch.Generator().manual_seed(0)
    for p in model.heads.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    ids = torch.randint(3, VOCAB, (2, 7), generator=generator)
    full = model(ids, head_positions=None)
    shared = torch.tensor([1, 4, 6])
    out = model(ids, logits_positions=shared, head_positions=shared)
    torch.testing.assert_close(out.logits, full.logits[:, shared])
    torch.testing.assert_close(out.head_logits, full.head_logits[:, :, shared])
    per_row = torch.tensor([[0, 5], [6, 2]])
    out = model(ids, logits_positions=per_row, head_positions=per_row)
    for row in range(2):
        torch.testing.assert_close(out.logits[row], full.logits[row, per_row[row]])
        torch.testing.assert_close(out.head_logits[:, row], full.head_logits[:, row, per_row[row]])


def randomise_heads(model: MedusaModel, seed: int = 1) -> torch.Generator:
    """Give ``model``'s heads random weights (fresh heads copy the lm_head's rows); the generator, to draw on."""
    generator = torch.Generator().manual_seed(seed)
    for p in model.heads.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return generator


@torch.no_grad()
def test_default_path_of_reduced_vocabulary_heads_is_made_of_token_ids():
    """Path-reading heads over a reduced vocabulary (token_map): the default greedy path feeds each head the
    previous head's top choice as a token id (to_full_vocab), not as its column in the reduced vocabulary,
    exactly as an explicit path of those ids does (the documented default; decoding passes its own paths)."""
    token_map = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))[:40]
    model = MedusaModel.from_base(tiny_model("llama"), num_heads=3, token_map=token_map,
                                  next_token_input=True, path_input=True)
    generator = randomise_heads(model)
    hidden = torch.randn(6, model.config.hidden_size, generator=generator)
    nxt = torch.randint(3, VOCAB, (6,), generator=generator)
    chained = model.head_logits(hidden, nxt)
    first = model.heads.to_full_vocab(chained[0].argmax(-1))
    second = model.heads.to_full_vocab(chained[1].argmax(-1))
    explicit = model.head_logits(hidden, nxt, path_tokens=torch.stack([first, second], 1))
    torch.testing.assert_close(chained, explicit)


@torch.no_grad()
def test_heads_from_start_on_the_default_path_are_those_heads_alone():
    """``start`` with the default (greedy) path: heads start .. first - 1, the ones before run only to make
    the path, and are not returned (``[first - start, ...]``)."""
    model = MedusaModel.from_base(tiny_model("llama"), num_heads=3, next_token_input=True, path_input=True)
    generator = randomise_heads(model)
    hidden = torch.randn(4, model.config.hidden_size, generator=generator)
    nxt = torch.randint(3, VOCAB, (4,), generator=generator)
    every = model.head_logits(hidden, nxt)
    tail = model.head_logits(hidden, nxt, first=3, start=1)
    assert tail.shape[0] == 2
    torch.testing.assert_close(tail, every[1:])


def test_multiplicative_processor_settings_at_one_are_neutral():
    """repetition_penalty, encoder_repetition_penalty and guidance_scale multiply (or scale) logits: 1.0 changes
    nothing, so a generation config setting them to 1.0 is not reported as a processor decoding leaves out."""
    from medusa_infer.model import processor_settings

    base = tiny_model("llama")
    config = base.generation_config
    config.repetition_penalty = config.encoder_repetition_penalty = config.guidance_scale = 1.0
    config.no_repeat_ngram_size = 0
    assert processor_settings(base) == {}
    config.guidance_scale = 1.5
    assert processor_settings(base) == {"guidance_scale": 1.5}


HEADS_CONFIG = {"num_heads": 3, "hidden_size": 32, "vocab_size": 96}


@pytest.mark.parametrize("edit, message", [
    ({"num_heads": 0}, r"num_heads must be >= 1, got 0"),                                   # C1
    ({"num_layers": -1}, r"num_layers must be >= 0, got -1"),                               # C2
    ({"reduced_vocab_size": 97}, r"reduced_vocab_size must be in \(0, vocab_size=96\], got 97"),  # C3
    ({"top_k": 0}, r"top_k must be >= 1, got 0"),                                           # C4
    ({"head_accuracies": [[0.5, 0.45]]}, r"head_accuracies\[0\] = \[0.5, 0.45\] must be cumulative"),  # C5
    ({"head_accuracies": [[0.5]] * 4}, r"head_accuracies has 4 rows for 3 heads"),           # C6
    ({"path_accuracies": [[[0, 0, 0, 0], 0.1]]}, r"path_accuracies entry .*a path of 1 to 3 ranks"),  # C7
    ({"num_heads": 2, "path_input": True}, r"path_input=True needs next_token_input=True"),  # C15
])
def test_heads_config_bounds_are_checked_at_their_edge(edit, message):
    with pytest.raises(ValueError, match=message):
        MedusaConfig.from_dict({**HEADS_CONFIG, **edit})


def test_heads_config_bounds_accept_their_edge():
    MedusaConfig.from_dict({**HEADS_CONFIG, "num_layers": 0, "top_k": 1, "reduced_vocab_size": 96,
                            "head_accuracies": [[0.5, 0.5]] * 3,
                            "path_accuracies": [[[0], 0.5], [[0, 0], 0.3], [[0, 0, 0], 0.1]]})
    MedusaConfig.from_dict({**HEADS_CONFIG, "num_heads": 1})


def test_token_map_ids_are_checked_at_the_vocabularys_edges():
    config = MedusaConfig(num_heads=1, hidden_size=8, vocab_size=10, reduced_vocab_size=3)
    check_token_map(torch.tensor([0, 1, 9]), config)  # the first and the last id of the vocabulary
    with pytest.raises(ValueError, match=r"token_map holds negative token ids \[-1\]"):  # H2
        check_token_map(torch.tensor([-1, 1, 2]), config)
    with pytest.raises(ValueError, match=r"token_map holds token ids \[10\] outside the vocabulary \[0, 10\)"):  # H3
        check_token_map(torch.tensor([0, 1, 10]), config)
    with pytest.raises(ValueError, match=r"token_map has shape \(4,\), expected \(3,\)"):  # H11
        check_token_map(torch.tensor([0, 1, 2, 3]), config)


def test_own_projections_warn_of_a_non_zero_lm_head_bias_only(caplog):  # H4
    config = MedusaConfig(num_heads=1, hidden_size=8, vocab_size=10, projection="own")
    with caplog.at_level(logging.WARNING, logger="medusa_infer.heads"):
        MedusaHeads(config, torch.randn(10, 8), lm_head_bias=torch.zeros(10))
    assert "has a bias" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="medusa_infer.heads"):
        MedusaHeads(config, torch.randn(10, 8), lm_head_bias=torch.full((10,), 0.5))
    assert "the base model's lm_head has a bias" in caplog.text


def test_heads_cast_to_bfloat16_take_float32_hidden_states():  # H5
    """DeepSpeed casts the heads' module, not their inputs: float32 hidden states into bfloat16 heads."""
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(num_heads=2, hidden_size=8, vocab_size=10))
    for block in (h.blocks[0] for h in heads.heads):
        torch.nn.init.normal_(block.linear.weight)
    lm_head = torch.nn.Linear(8, 10, bias=False)
    hidden = torch.randn(3, 8)
    expected = heads(hidden, lm_head)
    found = heads.to(torch.bfloat16)(hidden, lm_head)
    assert found.shape == (2, 3, 10)
    torch.testing.assert_close(found, expected, atol=0.1, rtol=0.05)


def test_reduced_projection_passes_gradients_to_a_trainable_lm_head_bias():  # H8
    """A frozen lm_head weight and a trainable bias (Phi's lm_head has one): the gathered bias is not a detached
    copy."""
    config = MedusaConfig(num_heads=1, hidden_size=8, vocab_size=10, reduced_vocab_size=4)
    heads = MedusaHeads(config, token_map=torch.tensor([1, 3, 5, 7]))
    lm_head = torch.nn.Linear(8, 10)
    lm_head.weight.requires_grad_(False)
    heads(torch.randn(2, 8), lm_head).sum().backward()
    assert lm_head.bias.grad is not None
    assert torch.equal(lm_head.bias.grad != 0, torch.isin(torch.arange(10), heads.token_map))


def test_a_model_config_with_heads_keys_is_a_models_config(tmp_path):
    """A whole model's config.json (architectures, or model_type) holding keys of heads configs too: never heads'."""
    cases = [  # (config.json, the layout a save would write)
        ({"architectures": ["LlamaForCausalLM"], "num_heads": 4}, "medusa-forge"),  # K2
        ({"model_type": "llama", "medusa_num_heads": 5, "medusa_num_layers": 1}, "FasterDecoding"),  # K3: Medusa-2
    ]
    for config, layout in cases:
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert foreign_config(tmp_path, layout).startswith("a model's config.json"), config


def test_the_cards_accuracy_table_shows_every_rank_some_row_holds():  # K8
    """Training's held-out table is free-form (rows of several lengths): the columns follow the longest row."""
    lines = accuracy_table("Head accuracy", [[0.5, 0.6, 0.7], [0.4]])
    assert lines[2] == "| head | top-1 | top-3 |"
    assert lines[4] == "| 1 | 0.500 | 0.700 |" and lines[5] == "| 2 | 0.400 |  |"


def test_heads_are_not_saved_beside_faster_decoding_weights_without_their_config(tmp_path):  # K15
    """A FasterDecoding folder whose config.json is missing still holds their weights: our heads go elsewhere."""
    import pytest

    for name in ("medusa_lm_head.safetensors", "medusa_lm_head.pt"):
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_bytes(b"weights")
        with pytest.raises(ValueError, match=rf"holds heads in the FasterDecoding layout \({name}\)"):
            check_heads_target(folder)


def test_a_config_tree_past_the_reduced_vocabulary_is_named_as_the_configs():
    """config.json's tree takes rank 7 of heads scoring 5 tokens: refused when the config is read (it loaded, and
    the first generate said "use a tree whose ranks are below 5" of a tree nobody passed)."""
    with pytest.raises(ValueError, match=r"heads config tree: path \(7,\) takes rank 7, and the heads score 5 "
                                         r"tokens \(reduced_vocab_size\): use ranks below 5"):
        MedusaConfig.from_dict({"num_heads": 2, "hidden_size": 32, "vocab_size": 96, "reduced_vocab_size": 5,
                                "tree": [[0], [7], [0, 0]]})
    with pytest.raises(ValueError, match=r"the heads score 6 tokens \(vocab_size\): use ranks below 6"):
        MedusaConfig.from_dict({"num_heads": 2, "hidden_size": 32, "vocab_size": 6, "tree": [[0], [7]]})
    # a vocabulary not known yet (vocab_size 0, filled in from the base model): nothing to check against
    assert MedusaConfig(num_heads=2, tree=[[0], [7], [0, 0]]).tree == [[0], [7], [0, 0]]


def test_heads_a_config_json_overstates_are_refused_before_they_are_built(saved, monkeypatch):
    """A config.json saying more heads than its weights hold built every head before comparing (800 MB for 20000
    tiny ones; tens of GB for 50 of a 7B model's with projection own): the comparison is made on the meta device."""
    import medusa_infer.model as model_module

    directory, base = saved
    path = directory / "config.json"
    original = path.read_text()
    built = []
    real = model_module.MedusaHeads
    monkeypatch.setattr(model_module, "MedusaHeads",
                        lambda config: (built.append(torch.get_default_device().type), real(config))[1])
    try:
        path.write_text(json.dumps({**json.loads(original), "num_heads": 60}))
        with pytest.raises(ValueError, match=r"does not fit the heads its config describes: missing tensors "
                                             r"\['heads\.3\.blocks\.0\.linear\.bias', .*\] and 220 more \(228 in all\)"
                           ) as caught:
            MedusaModel.from_pretrained(directory, base_model=base)
        assert built == ["meta"] and len(str(caught.value)) < 1000  # (all 228 names were listed)
    finally:
        path.write_text(original)
    MedusaModel.from_pretrained(directory, base_model=base)
    assert built[1:] == ["meta", "cpu"]
