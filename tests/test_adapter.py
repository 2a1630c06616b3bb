"""Medusa-2 heads folders: ``MedusaModel.from_pretrained`` merges the LoRA adapter saved beside them."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from medusa_infer.checkpoint import ADAPTER_DIR
from medusa_infer.model import (
    MERGED_ADAPTER_ATTR,
    MERGED_ADAPTER_KEY,
    MedusaModel,
    adapter_digest,
    adapter_digests,
    merge_adapter,
)
from medusa_train import lora
from tiny import VOCAB, tiny_model

TARGETS = ["q_proj", "v_proj", "down_proj"]
R, ALPHA = 4, 8


@pytest.fixture(scope="module")
def heads_folder(tmp_path_factory) -> tuple[Path, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Heads for the tiny Llama with a trained-looking adapter (nonzero B) in ``adapter/``.

    Returns the folder and ``{module name: (A, B)}`` of the adapter's LoRA matrices.
    """
    folder = tmp_path_factory.mktemp("medusa2-heads")
    MedusaModel.from_base(tiny_model("llama"), num_heads=2).save_pretrained(folder)
    peft_model = get_peft_model(tiny_model("llama"), LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS))
    generator = torch.Generator().manual_seed(3)
    pairs = {}
    with torch.no_grad():
        for name, module in peft_model.get_base_model().named_modules():
            if hasattr(module, "lora_B"):
                module.lora_B["default"].weight.normal_(0, 0.2, generator=generator)
                pairs[name] = (module.lora_A["default"].weight.clone(), module.lora_B["default"].weight.clone())
    peft_model.save_pretrained(str(folder / ADAPTER_DIR))
    return folder, pairs


def merged_by_hand(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> LlamaForCausalLM:
    """The tiny Llama with ``W + alpha / r * B @ A`` written into each adapted linear layer."""
    model = tiny_model("llama")
    with torch.no_grad():
        for name, (a, b) in pairs.items():
            model.get_submodule(name).weight += ALPHA / R * b @ a
    return model


def logits(model: MedusaModel) -> torch.Tensor:
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


def test_adapter_is_merged_into_a_stock_model(heads_folder):
    folder, pairs = heads_folder
    assert len(pairs) == 3 * 2  # three target modules in each of the two layers
    model = MedusaModel.from_pretrained(folder, base_model=tiny_model("llama"))
    assert type(model.base_model) is LlamaForCausalLM
    assert not [name for name, _ in model.base_model.named_modules() if "lora" in name]
    assert model.merged_adapter == folder / ADAPTER_DIR
    expected = logits(MedusaModel.without_heads(merged_by_hand(pairs)))
    plain = logits(MedusaModel.without_heads(tiny_model("llama")))
    got = logits(model)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (got - plain).abs().max() > 1e-2, "the adapter should change the base model's logits"


def test_a_truncated_adapter_is_named_and_leaves_the_given_base_model_alone(heads_folder, tmp_path):
    """peft injected LoRA layers into the caller's model, then failed with a bare SafetensorError."""
    folder = tmp_path / "heads"
    shutil.copytree(heads_folder[0], folder)
    weights = folder / ADAPTER_DIR / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a download cut short
    base = tiny_model("llama")
    with pytest.raises(ValueError, match=r"adapter_model.safetensors could not be read .* the adapter is truncated"):
        MedusaModel.from_pretrained(folder, base_model=base)
    assert not [name for name, _ in base.named_modules() if "lora" in name]


def same_plain_model(base: LlamaForCausalLM) -> bool:
    """Whether ``base`` holds no LoRA layers and the weights of a fresh tiny Llama (as it was given)."""
    fresh = tiny_model("llama").state_dict()
    state = base.state_dict()
    return (not [name for name, _ in base.named_modules() if "lora" in name] and state.keys() == fresh.keys()
            and all(torch.equal(state[k], fresh[k]) for k in fresh))


@pytest.mark.parametrize("damage", ["keys", "rank", "weights"])
def test_an_adapter_that_does_not_fit_is_refused_and_leaves_the_given_base_model_alone(heads_folder, tmp_path,
                                                                                       damage):
    """Keys peft does not find (saved without its prefix) only warned: the layers without weights merged nothing
    and the heads ran unadapted; a rank other than the config's, or no weights file, failed with a bare error
    (about a Hub repo id for the latter) after LoRA layers were put into the caller's model."""
    folder = tmp_path / "heads"
    shutil.copytree(heads_folder[0], folder)
    adapter = folder / ADAPTER_DIR
    weights = adapter / "adapter_model.safetensors"
    if damage == "keys":
        save_file({k.removeprefix("base_model.model."): v for k, v in load_file(weights).items()}, weights)
    elif damage == "rank":
        settings = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps({**settings, "r": 2 * R}))
    else:
        weights.unlink()
    expected = {"keys": r"lacks 12 of the LoRA weights its config asks for on this model \(such as .*lora_A",
                "rank": r"could not be loaded onto this model \(.*size mismatch",
                "weights": r"holds no adapter weights \(adapter_model.safetensors or adapter_model.bin\)"}[damage]
    base = tiny_model("llama")
    with pytest.raises(ValueError, match=expected):
        MedusaModel.from_pretrained(folder, base_model=base)
    assert same_plain_model(base)
    assert not hasattr(base, MERGED_ADAPTER_ATTR)


@pytest.mark.parametrize("layers, says", [(1, r"holds 6 LoRA weights this model has no place for \(such as .*layers"
                                              r"\.1\..*\): it was saved for another model \(of more layers"),
                                          (3, r"lacks 6 of the LoRA weights its config asks for on this model .* "
                                              r"saved for another model \(of fewer layers, say\) or is damaged")])
def test_an_adapter_for_another_number_of_layers_is_named_as_such(heads_folder, layers, says):
    """On a model of fewer layers the adapter's other weights were dropped without a word; on one of more, the
    error blamed the adapter's file."""
    from transformers import AutoModelForCausalLM

    from tiny import tiny_config

    config = tiny_config("llama")
    config.num_hidden_layers = layers
    base = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match=says):
        merge_adapter(base, heads_folder[0] / ADAPTER_DIR)
    assert not any("lora" in name for name, _ in base.named_parameters())


@pytest.mark.parametrize("kind", ["modules_to_save", "lora_bias", "unsupported_target"])
def test_a_refused_adapter_of_other_kinds_leaves_the_given_base_model_alone(tmp_path, kind):
    """peft's unload kept the trained copy of a modules_to_save module (half written by the refused load) and
    every parameter frozen; an adapter with lora_bias on layers without a bias failed midway through merging; one
    naming a module LoRA cannot adapt failed while peft wrapped the model, its earlier layers already replaced."""
    folder = tmp_path / "heads"
    MedusaModel.from_base(tiny_model("llama"), num_heads=2).save_pretrained(folder)
    options = {"modules_to_save": {"modules_to_save": ["model.norm"]}, "lora_bias": {"lora_bias": True},
               "unsupported_target": {}}[kind]
    peft_model = get_peft_model(tiny_model("llama"), LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS,
                                                                 **options))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.fill_(5.0)
    peft_model.save_pretrained(str(folder / ADAPTER_DIR))
    if kind == "modules_to_save":  # one LoRA weight left out: refused after the norm's copy was loaded
        weights = folder / ADAPTER_DIR / "adapter_model.safetensors"
        tensors = load_file(weights)
        del tensors[next(k for k in sorted(tensors) if "lora_B" in k)]
        save_file(tensors, weights)
    if kind == "unsupported_target":  # a norm, after the layers' projections (edited, or another peft's)
        settings = folder / ADAPTER_DIR / "adapter_config.json"
        values = json.loads(settings.read_text())
        settings.write_text(json.dumps({**values, "target_modules": [*values["target_modules"], "norm"]}))
    base = tiny_model("llama")
    with pytest.raises(ValueError, match={"modules_to_save": "lacks 1 of the LoRA weights",
                                          "lora_bias": "has lora_bias, and the layers it adapts have no bias",
                                          "unsupported_target": "is not supported"}[kind]):
        MedusaModel.from_pretrained(folder, base_model=base)
    assert same_plain_model(base)
    assert type(base.model.norm).__name__ == "LlamaRMSNorm"
    assert all(param.requires_grad for param in base.parameters())


def test_an_adapter_changed_since_the_merge_is_not_saved_beside_the_heads(heads_folder, tmp_path):
    """Another run wrote a new adapter where the merged one was: it was copied along with heads that go with the
    one merged (the saved folder decoded differently), without a word."""
    folder = tmp_path / "heads"
    shutil.copytree(heads_folder[0], folder)
    model = MedusaModel.from_pretrained(folder, base_model=tiny_model("llama"))
    weights = folder / ADAPTER_DIR / "adapter_model.safetensors"
    save_file({k: v * 2 for k, v in load_file(weights).items()}, weights)
    with pytest.raises(ValueError, match=r"adapter in .*adapter changed since it was merged into the base model"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_adapter_loaded_by_a_relative_path_is_saved_after_a_chdir(heads_folder, tmp_path, monkeypatch):
    shutil.copytree(heads_folder[0], tmp_path / "heads")
    monkeypatch.chdir(tmp_path)
    model = MedusaModel.from_pretrained("heads", base_model=tiny_model("llama"))
    monkeypatch.chdir(tmp_path / "heads")  # the adapter was taken for gone ("heads/adapter" from here)
    model.save_pretrained(tmp_path / "out")
    assert (tmp_path / "out" / ADAPTER_DIR / "adapter_model.safetensors").is_file()


def test_adapter_false_keeps_the_plain_base(heads_folder, tmp_path, caplog):
    folder, _ = heads_folder
    model = MedusaModel.from_pretrained(folder, base_model=tiny_model("llama"), adapter=False)
    assert model.merged_adapter is None
    torch.testing.assert_close(logits(model), logits(MedusaModel.without_heads(tiny_model("llama"))),
                               atol=0, rtol=0)
    model.save_pretrained(tmp_path / "copy")  # the heads alone: said (they went without a word)
    assert not (tmp_path / "copy" / ADAPTER_DIR).exists()
    assert "loaded with adapter=False from a folder holding their Medusa-2 adapter" in caplog.text
    caplog.clear()
    model.config.base_model_name_or_path = "tiny-random/llama"
    model.export_medusa_layout(tmp_path / "fd")  # nor does the FasterDecoding layout hold it: said too
    assert "which the layout written to" in caplog.text
    # pushed, the heads alone deleted the repo's adapter/ as stale, after a warning naming a temporary folder
    model.config.training = {"recipe": {"training": {"mode": "medusa2"}}}
    with pytest.raises(ValueError, match=r"Medusa-2 heads were loaded without their adapter; uploaded alone, they "
                                         r"would delete me/heads's adapter/ if it has one.*load them with "
                                         r"adapter=True \(their adapter is in .*adapter\)"):
        model.push_to_hub("me/heads")
    model.save_pretrained(tmp_path / "carded")  # the card says what its figures were measured with
    assert "trained with a Medusa-2 LoRA adapter" in (tmp_path / "carded" / "README.md").read_text()


def test_the_merged_base_model_saved_loads_the_heads_without_a_second_merge(heads_folder, tmp_path):
    """The merged weights other engines need: ``model.base_model.save_pretrained``. Loading the heads on
    that folder merges nothing again (their adapter was merged a second time, silently); other heads (these
    without their adapter, as the FasterDecoding layout carries them) load on it as on any base model."""
    folder, pairs = heads_folder
    model = MedusaModel.from_pretrained(folder, base_model=tiny_model("llama"))
    model.base_model.save_pretrained(tmp_path / "merged")
    again = MedusaModel.from_pretrained(folder, base_model=LlamaForCausalLM.from_pretrained(tmp_path / "merged"))
    torch.testing.assert_close(logits(again), logits(MedusaModel.without_heads(merged_by_hand(pairs))),
                               atol=1e-5, rtol=1e-5)
    assert again.merged_adapter == folder / ADAPTER_DIR
    # loaded by folder name, the folder needs the tokenizer too: without it, an error that says so (it was
    # transformers' own, naming a tokenizer backend)
    with pytest.raises(ValueError, match=r"merged holds no tokenizer .*tokenizer.save_pretrained\(DIR\)"):
        MedusaModel.from_pretrained(folder, base_model=str(tmp_path / "merged"))
    other = MedusaModel.from_pretrained(folder, base_model=LlamaForCausalLM.from_pretrained(tmp_path / "merged"),
                                        adapter=False)
    assert other.merged_adapter is None
    torch.testing.assert_close(logits(other), logits(again), atol=0, rtol=0)
    # heads that bring another adapter need the plain base model: merged on top, neither model
    second = tmp_path / "second"
    shutil.copytree(folder, second)
    config = json.loads((second / ADAPTER_DIR / "adapter_config.json").read_text())
    (second / ADAPTER_DIR / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 2 * ALPHA}))
    with pytest.raises(ValueError, match="saved with another Medusa-2 adapter merged into them"):
        MedusaModel.from_pretrained(second, base_model=LlamaForCausalLM.from_pretrained(tmp_path / "merged"))
    # peft's card edited, a hidden file beside: the same adapter (it was refused as another one)
    touched = tmp_path / "touched"
    shutil.copytree(folder, touched)
    (touched / ADAPTER_DIR / "README.md").write_text("# my notes\n")
    (touched / ADAPTER_DIR / ".DS_Store").write_bytes(b"\0")
    same = MedusaModel.from_pretrained(touched, base_model=LlamaForCausalLM.from_pretrained(tmp_path / "merged"))
    torch.testing.assert_close(logits(same), logits(again), atol=0, rtol=0)  # not merged a second time
    # a merged base saved by an earlier version, whose digest counted every file (README.md too): still this
    # adapter's (refused as another one when the digest changed)
    legacy = hashlib.sha256()
    for path in sorted(p for p in (folder / ADAPTER_DIR).iterdir() if p.is_file()):
        legacy.update(path.name.encode() + b"\0" + path.read_bytes())
    assert legacy.hexdigest() != adapter_digest(folder / ADAPTER_DIR)  # (peft writes a README.md)
    saved = json.loads((tmp_path / "merged" / "config.json").read_text())
    (tmp_path / "merged" / "config.json").write_text(json.dumps({**saved, MERGED_ADAPTER_KEY: legacy.hexdigest()}))
    old = MedusaModel.from_pretrained(folder, base_model=LlamaForCausalLM.from_pretrained(tmp_path / "merged"))
    torch.testing.assert_close(logits(old), logits(again), atol=0, rtol=0)
    # one saved before the base model's name was left out of the digest: still this adapter's
    (tmp_path / "merged" / "config.json").write_text(json.dumps({**saved, MERGED_ADAPTER_KEY: adapter_digests(
        folder / ADAPTER_DIR)[1]}))
    older = MedusaModel.from_pretrained(folder, base_model=LlamaForCausalLM.from_pretrained(tmp_path / "merged"))
    torch.testing.assert_close(logits(older), logits(again), atol=0, rtol=0)
    # the adapter renamed its base model since (a run evaluated again with model.hub_id set): the same adapter
    # (it was refused as another one merged into these weights)
    (tmp_path / "merged" / "config.json").write_text(json.dumps(saved))
    renamed = tmp_path / "renamed"
    shutil.copytree(folder, renamed)
    settings = json.loads((renamed / ADAPTER_DIR / "adapter_config.json").read_text())
    (renamed / ADAPTER_DIR / "adapter_config.json").write_text(json.dumps({**settings,
                                                                           "base_model_name_or_path": "me/tiny"}))
    assert adapter_digest(renamed / ADAPTER_DIR) == adapter_digest(folder / ADAPTER_DIR)
    moved = MedusaModel.from_pretrained(renamed, base_model=LlamaForCausalLM.from_pretrained(tmp_path / "merged"))
    torch.testing.assert_close(logits(moved), logits(again), atol=0, rtol=0)
    (renamed / ADAPTER_DIR / "adapter_config.json").write_text(json.dumps({**settings, "lora_alpha": 2 * ALPHA}))
    assert adapter_digest(renamed / ADAPTER_DIR) != adapter_digest(folder / ADAPTER_DIR)  # a setting that merges


def test_the_trained_weights_check_leaves_the_merged_export_alone_and_names_the_adapters_effect(
        heads_folder, tmp_path, caplog):
    """Heads whose training recorded the plain base's weights: loaded on their own merged export (the README's way
    to it), they warned that they were trained on other weights; on other weights, the warning said the output
    was still that model's, which the adapter merged into them changes."""
    from medusa_infer.models import weights_identity

    folder = tmp_path / "heads"
    shutil.copytree(heads_folder[0], folder)
    tiny_model("llama").save_pretrained(tmp_path / "plain")
    tiny_model("llama", seed=5).save_pretrained(tmp_path / "other")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "training": {
        "recipe": {"model": {"name": str(tmp_path / "plain")}, "training": {"mode": "medusa2"}},
        "settings": {"model_weights": weights_identity(str(tmp_path / "plain"))}}}))
    with caplog.at_level("WARNING", logger="medusa_infer.model"):
        model = MedusaModel.from_pretrained(folder, base_model=LlamaForCausalLM.from_pretrained(tmp_path / "plain"))
        model.base_model.save_pretrained(tmp_path / "merged")
        MedusaModel.from_pretrained(folder, base_model=LlamaForCausalLM.from_pretrained(tmp_path / "merged"))
        MedusaModel.from_pretrained(folder, base_model=LlamaForCausalLM.from_pretrained(tmp_path / "merged"),
                                    adapter=False)  # (their own adapter merged there, though not taken)
    assert "whose files differ" not in caplog.text
    with caplog.at_level("WARNING", logger="medusa_infer.model"):
        MedusaModel.from_pretrained(folder, base_model=LlamaForCausalLM.from_pretrained(tmp_path / "other"))
    assert f"trained on weights ({tmp_path / 'plain'}) whose files differ from those of {tmp_path / 'other'}" \
        in caplog.text
    assert "their Medusa-2 adapter, merged into these, gives neither model's output" in caplog.text
    assert "still this model's own" not in caplog.text
    # heads bringing no adapter, on the merged export of this one: other weights than theirs (it was said nowhere)
    caplog.clear()
    plain = tmp_path / "plain-heads"
    shutil.copytree(folder, plain, ignore=shutil.ignore_patterns(ADAPTER_DIR))
    config = json.loads((plain / "config.json").read_text())
    config["training"]["recipe"]["training"]["mode"] = "medusa1"
    (plain / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="medusa_infer.model"):
        MedusaModel.from_pretrained(plain, base_model=LlamaForCausalLM.from_pretrained(tmp_path / "merged"))
    assert f"whose files differ from those of {tmp_path / 'merged'}" in caplog.text
    assert "(the output is still this model's own)" in caplog.text


def test_saving_keeps_the_merged_adapter_beside_the_heads(heads_folder, tmp_path):
    folder, _ = heads_folder
    model = MedusaModel.from_pretrained(folder, base_model=tiny_model("llama"))
    model.save_pretrained(tmp_path / "out")
    saved = sorted(p.name for p in (tmp_path / "out" / ADAPTER_DIR).iterdir())
    assert saved == sorted(p.name for p in (folder / ADAPTER_DIR).iterdir())
    model.save_pretrained(folder)  # saving over the folder it came from keeps the adapter intact
    again = MedusaModel.from_pretrained(tmp_path / "out", base_model=tiny_model("llama"))
    x = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(again.base_model(x).logits, model.base_model(x).logits)


def test_saving_after_the_adapter_folder_is_gone_writes_nothing(heads_folder, tmp_path):
    """The adapter merged at load time deleted before saving: refused before anything is written (the
    heads were written, then the copy failed, leaving heads that load on the base model unadapted)."""
    folder, _ = heads_folder
    copied = tmp_path / "copy"
    shutil.copytree(folder, copied)
    model = MedusaModel.from_pretrained(copied, base_model=tiny_model("llama"))
    shutil.rmtree(copied)
    with pytest.raises(ValueError, match=r"adapter merged into the base model at load time .* is gone"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_peft_wrapper_as_the_base_model_is_refused_by_name():
    """A PeftModel given as the base model: named, with the ways to pass it (it was refused as an LM head
    with a transform, and before that crashed on the wrapper's outputs)."""
    wrapped = get_peft_model(tiny_model("llama"), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    for build in (lambda: MedusaModel(wrapped, None), lambda: MedusaModel.from_base(wrapped, num_heads=2),
                  lambda: MedusaModel.without_heads(wrapped)):  # the constructors took its repr as a path
        with pytest.raises(NotImplementedError, match=r"PeftModel is a peft wrapper: pass the model it wraps"):
            build()
    with pytest.raises(ValueError, match=r"base_model is a Linear, not a transformers PreTrainedModel"):
        MedusaModel.without_heads(torch.nn.Linear(2, 2))


def test_faster_decoding_export_warns_that_the_adapter_is_left_out(heads_folder, tmp_path, caplog):
    folder, _ = heads_folder
    model = MedusaModel.from_pretrained(folder, base_model=tiny_model("llama"))
    model.config.base_model_name_or_path = "org/tiny-llama"
    with caplog.at_level(logging.WARNING, logger="medusa_infer.model"):
        model.export_medusa_layout(tmp_path / "fd")
    assert "not included" in caplog.text


def test_faster_decoding_export_of_medusa2_heads_keeps_their_mode(heads_folder, tmp_path, caplog):
    """The layout has no adapter: exported Medusa-2 heads read back as Medusa-1 heads, loaded on the plain base
    model without a word (and, saved again, passed heads.init_from's Medusa-2 check)."""
    folder, _ = heads_folder
    copy = tmp_path / "heads"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config["training"] = {"recipe": {"training": {"mode": "medusa2"}}}
    (copy / "config.json").write_text(json.dumps(config))
    model = MedusaModel.from_pretrained(copy, base_model=tiny_model("llama"))
    model.config.base_model_name_or_path = "org/tiny-llama"
    model.export_medusa_layout(tmp_path / "fd")
    assert json.loads((tmp_path / "fd" / "config.json").read_text())["medusa_forge_training_mode"] == "medusa2"
    caplog.clear()
    plain = MedusaModel.from_pretrained(tmp_path / "fd", base_model=tiny_model("llama"))
    assert plain.config.trained_with_adapter
    assert "were trained with a Medusa-2 adapter" in caplog.text
    plain.save_pretrained(tmp_path / "resaved")
    assert json.loads((tmp_path / "resaved" / "config.json").read_text())["training"]["recipe"] == {
        "training": {"mode": "medusa2"}}
    # exported again from the plain base model, the heads name their adapter still (the new export named none,
    # and loaded beside any other adapter)
    plain.export_medusa_layout(tmp_path / "fd-again")
    named = json.loads((tmp_path / "fd" / "config.json").read_text())["medusa_forge_adapter_digest"]
    assert json.loads((tmp_path / "fd-again" / "config.json").read_text())["medusa_forge_adapter_digest"] == named
    model.base_model.save_pretrained(tmp_path / "merged")  # records the adapter merged into its weights
    caplog.clear()
    MedusaModel.from_pretrained(tmp_path / "fd", base_model=LlamaForCausalLM.from_pretrained(tmp_path / "merged"))
    assert "were trained with a Medusa-2 adapter" not in caplog.text
    # ... as onto the very object the adapter was merged into (refused: "needs the plain base model")
    again = MedusaModel.from_pretrained(tmp_path / "fd", base_model=model.base_model)
    assert again.base_model is model.base_model and "were trained with a Medusa-2 adapter" not in caplog.text
    # ... and not onto one with another adapter merged (loaded without a word): the export names its adapter
    other = tmp_path / "other"
    shutil.copytree(copy, other)
    settings = other / ADAPTER_DIR / "adapter_config.json"
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "lora_dropout": 0.5}))  # another adapter's
    # files (here, the same weights; a file written otherwise, its base model named otherwise, is the same adapter)
    elsewhere = MedusaModel.from_pretrained(other, base_model=tiny_model("llama")).base_model
    with pytest.raises(ValueError, match=r"were trained with the Medusa-2 adapter \w{12} \(config.json's "
                                         r"medusa_forge_adapter_digest\), and base_model has another merged"):
        MedusaModel.from_pretrained(tmp_path / "fd", base_model=elsewhere)
    # saved in our layout, the heads keep their adapter's name (training.adapter_digest) and are checked by it
    again.save_pretrained(tmp_path / "resaved-ours")
    assert not (tmp_path / "resaved-ours" / ADAPTER_DIR).exists()
    with pytest.raises(ValueError, match=r"were trained with the Medusa-2 adapter \w{12} \(config.json's "
                                         r"training.adapter_digest\), and base_model has another merged"):
        MedusaModel.from_pretrained(tmp_path / "resaved-ours", base_model=elsewhere)
    # our layout holds the adapter: a Medusa-2 folder without it and without that name is refused on an adapted
    # base object, as before (the export's rule took it, with a warning about a key our layout never writes)
    unnamed = json.loads((tmp_path / "resaved-ours" / "config.json").read_text())
    del unnamed["training"]["adapter_digest"]
    (tmp_path / "resaved-ours" / "config.json").write_text(json.dumps(unnamed))
    with pytest.raises(ValueError, match=r"already has the adapter .*\(no adapter\) needs the plain base"):
        MedusaModel.from_pretrained(tmp_path / "resaved-ours", base_model=elsewhere)
    # heads imported from the export and saved in our layout keep the adapter's name: refused on a saved base
    # with another adapter merged (loaded without a word), loaded on their own
    plain.save_pretrained(tmp_path / "converted")
    elsewhere.save_pretrained(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"were trained with the Medusa-2 adapter \w{12} \(config.json's "
                                         r"training.adapter_digest\), and base_model has another merged"):
        MedusaModel.from_pretrained(tmp_path / "converted", base_model=LlamaForCausalLM.from_pretrained(
            tmp_path / "elsewhere"))
    converted = MedusaModel.from_pretrained(tmp_path / "converted", base_model=LlamaForCausalLM.from_pretrained(
        tmp_path / "merged"))
    torch.testing.assert_close(logits(converted), logits(model), atol=1e-5, rtol=1e-5)
    exported = json.loads((tmp_path / "fd" / "config.json").read_text())
    del exported["medusa_forge_adapter_digest"]  # (an export that does not name it: said)
    (tmp_path / "fd" / "config.json").write_text(json.dumps(exported))
    caplog.clear()
    MedusaModel.from_pretrained(tmp_path / "fd", base_model=elsewhere)
    assert "could not be checked to be theirs" in caplog.text
    plain_fd = tmp_path / "plain-fd"  # heads trained without an adapter still need the plain base model
    fresh = MedusaModel.from_base(tiny_model("llama"), num_heads=2, base_model_name_or_path="org/tiny-llama")
    fresh.export_medusa_layout(plain_fd)
    with pytest.raises(ValueError, match=r"already has the adapter .*\(no adapter\) needs the plain base"):
        MedusaModel.from_pretrained(plain_fd, base_model=model.base_model)
    fd1 = MedusaModel.from_base(tiny_model("llama"), num_heads=2)
    fd1.config.base_model_name_or_path = "org/tiny-llama"
    fd1.export_medusa_layout(tmp_path / "fd1")
    assert "medusa_forge_training_mode" not in json.loads((tmp_path / "fd1" / "config.json").read_text())
    assert not MedusaModel.from_pretrained(tmp_path / "fd1", base_model=tiny_model("llama")).config.trained_with_adapter


def test_training_uses_the_same_adapter_folder_name():
    assert lora.ADAPTER_DIR == ADAPTER_DIR


def test_add_lora_names_each_target_that_matches_nothing_and_takes_dotted_suffixes():
    with pytest.raises(ValueError, match=r"lora.target_modules \['v_prj'\] match no module of LlamaForCausalLM; "
                                         r"its linear layers are named \[.*'v_proj'"):
        lora.add_lora(tiny_model("llama"), 4, 8, 0.0, ["q_proj", "v_prj"])
    adapted = lora.add_lora(tiny_model("llama"), 4, 8, 0.0, ["self_attn.q_proj"])
    names = [n for n, m in adapted.named_modules() if hasattr(m, "lora_A") and n.endswith("q_proj")]
    assert names and not any(n.endswith("k_proj") for n, m in adapted.named_modules() if hasattr(m, "lora_A"))
    # GPT-2's projections are Conv1D layers: the list named lm_head alone, which the next check refused (suggesting
    # Llama's q_proj,k_proj,v_proj,o_proj); the embeddings the heads read are no target to offer
    with pytest.raises(ValueError, match=r"match no module of GPT2LMHeadModel; its linear layers are named "
                                         r"\['c_attn', 'c_fc', 'c_proj'\]$"):
        lora.check_lora_targets(tiny_model("gpt2"), ["q_proj", "v_proj"])
    with pytest.raises(ValueError, match=r"leave them out, e.g. lora.target_modules=\[c_attn,c_fc,c_proj\]$"):
        lora.check_lora_targets(tiny_model("gpt2"), ["c_attn", "lm_head"])


def test_a_base_model_object_takes_its_adapter_once(heads_folder, tmp_path):
    folder, pairs = heads_folder
    base = tiny_model("llama")
    first = MedusaModel.from_pretrained(folder, base_model=base)
    again = MedusaModel.from_pretrained(folder, base_model=base)  # e.g. to try another tree: merged once
    expected = logits(MedusaModel.without_heads(merged_by_hand(pairs)))
    torch.testing.assert_close(logits(again), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits(first), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"already has the adapter in .* merged.*adapter=False needs the plain base"):
        MedusaModel.from_pretrained(folder, base_model=base, adapter=False)
    plain = tmp_path / "plain"
    MedusaModel.from_base(tiny_model("llama"), num_heads=2).save_pretrained(plain)
    with pytest.raises(ValueError, match=r"already has the adapter .*\(no adapter\) needs the plain base"):
        MedusaModel.from_pretrained(plain, base_model=base)


def test_lora_on_the_embeddings_the_heads_read_is_refused(heads_folder, tmp_path):
    with pytest.raises(ValueError, match=r"select \['lm_head'\], the embeddings the heads read directly"):
        lora.add_lora(tiny_model("llama"), 4, 8, 0.0, ["q_proj", "lm_head"])
    with pytest.raises(ValueError, match=r"select \['model.embed_tokens'\]"):
        lora.add_lora(tiny_model("llama"), 4, 8, 0.0, ["embed_tokens"])
    folder, _ = heads_folder  # an adapter trained elsewhere on lm_head is refused on loading
    other = tmp_path / "lm-head-adapter"
    MedusaModel.from_base(tiny_model("llama"), num_heads=2).save_pretrained(other)
    get_peft_model(tiny_model("llama"), LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["q_proj", "lm_head"])
                   ).save_pretrained(str(other / ADAPTER_DIR))
    with pytest.raises(ValueError, match=r"adapts \['lm_head'\], the embeddings the heads read directly"):
        MedusaModel.from_pretrained(other, base_model=tiny_model("llama"))
    # a trained copy of lm_head saved with the adapter (modules_to_save) was merged over the model's, silently
    shutil.rmtree(other / ADAPTER_DIR)
    saving = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["q_proj"], modules_to_save=["lm_head"])
    get_peft_model(tiny_model("llama"), saving).save_pretrained(str(other / ADAPTER_DIR))
    base = tiny_model("llama")
    before = {k: v.clone() for k, v in base.state_dict().items()}
    with pytest.raises(ValueError, match=r"replaces \['lm_head'\] \(its modules_to_save\), the embeddings the heads "
                                         r"read directly"):
        MedusaModel.from_pretrained(other, base_model=base)
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in before.items())
    (other / ADAPTER_DIR / "adapter_config.json").write_text("{not json")  # (a bare parse error, naming no file)
    with pytest.raises(ValueError, match=r"adapter_config.json is not valid JSON .*: the adapter is damaged"):
        MedusaModel.from_pretrained(other, base_model=tiny_model("llama"))


def test_heads_without_an_adapter_are_not_saved_over_one(heads_folder, tmp_path):
    """Saving adapter-less heads into a Medusa-2 folder would leave its adapter to be merged under
    them by the next from_pretrained: refused, and the folder left as it was."""
    folder, _ = heads_folder
    target = tmp_path / "medusa2"
    MedusaModel.from_pretrained(folder, base_model=tiny_model("llama")).save_pretrained(target)
    weights = (target / "model.safetensors").read_bytes()
    plain = MedusaModel.from_base(tiny_model("llama"), num_heads=3)
    with pytest.raises(ValueError, match=r"medusa2/adapter holds a Medusa-2 adapter and these heads have none merged"):
        plain.save_pretrained(target)
    assert (target / "model.safetensors").read_bytes() == weights
    adapted = MedusaModel.from_pretrained(folder, base_model=tiny_model("llama"), adapter=False)
    with pytest.raises(ValueError, match="save into another folder"):  # its own folder too: loaded without it
        adapted.save_pretrained(folder)


def test_heads_for_another_model_leave_the_given_base_model_unmerged(heads_folder):
    """A vocabulary mismatch is found before the adapter is merged into a base model given as an object."""
    folder, _ = heads_folder
    other = tiny_model("llama", vocab_size=VOCAB + 8)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match=f"vocabulary of {VOCAB} tokens, this model has {VOCAB + 8}"):
        MedusaModel.from_pretrained(folder, base_model=other)
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in before.items())
    assert getattr(other, MERGED_ADAPTER_ATTR, None) is None


def test_a_refused_datastore_leaves_the_given_base_model_and_tokenizer_as_they_were(heads_folder, tmp_path):
    """Every check comes before anything changes: a datastore of another tokenizer (a token id past the
    vocabulary) was refused after the adapter had been merged into the given base model, which a later
    load with ``adapter=False`` then refused; the heads' chat template was installed on the given tokenizer
    before the heads were checked at all."""
    from medusa_infer.datastore import DATASTORE_NAME, Datastore
    from medusa_infer.serving.testing import word_tokenizer

    folder, _ = heads_folder
    copied = tmp_path / "copy"
    shutil.copytree(folder, copied)
    config = json.loads((copied / "config.json").read_text())
    (copied / "config.json").write_text(json.dumps({**config, "chat_template": "{{ 'HEADS TEMPLATE' }}"}))
    Datastore.from_sequences([[5, 6, 7, VOCAB + 3]]).save(copied / DATASTORE_NAME)
    base, tokenizer = tiny_model("llama"), word_tokenizer()
    template = tokenizer.chat_template
    before = {k: v.clone() for k, v in base.state_dict().items()}
    with pytest.raises(ValueError, match=f"holds token id {VOCAB + 3}, outside this model's vocabulary"):
        MedusaModel.from_pretrained(copied, base_model=base, tokenizer=tokenizer)
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in before.items())
    assert getattr(base, MERGED_ADAPTER_ATTR, None) is None
    assert tokenizer.chat_template == template
    assert MedusaModel.from_pretrained(folder, base_model=base, adapter=False).merged_adapter is None
    # refused for another vocabulary: the tokenizer keeps its template too
    with pytest.raises(ValueError, match="vocabulary of"):
        MedusaModel.from_pretrained(copied, base_model=tiny_model("llama", vocab_size=VOCAB + 8),
                                    tokenizer=tokenizer)
    assert tokenizer.chat_template == template
    # a load that succeeds installs it
    (copied / DATASTORE_NAME).unlink()
    MedusaModel.from_pretrained(copied, base_model=tiny_model("llama"), tokenizer=tokenizer)
    assert tokenizer.chat_template == "{{ 'HEADS TEMPLATE' }}"
