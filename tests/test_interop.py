"""Import and export of the FasterDecoding/Medusa layout: bit-identical round trips and strict errors."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from medusa_infer.config import MedusaConfig
from medusa_infer.heads import MedusaHeads
from medusa_infer.interop import TOP_K_KEY, is_medusa_layout, read_medusa_layout, write_medusa_layout
from medusa_infer.trees import validate_tree

HIDDEN, VOCAB, HEADS, LAYERS = 16, 50, 3, 2
BASE = "tiny/base-model"


def tiny_config(projection: str, **overrides) -> MedusaConfig:
    fields = dict(num_heads=HEADS, num_layers=LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB,
                  projection=projection, base_model_name_or_path=BASE)
    return MedusaConfig(**{**fields, **overrides})


def random_state(config: MedusaConfig, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Our state dict for ``config`` with random values (zero-initialised blocks would hide mix-ups)."""
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=generator).to(dtype) if t.is_floating_point() else t
            for name, t in MedusaHeads(config).state_dict().items()}


def fd_tensors(projections: bool, dtype: torch.dtype = torch.float32, seed: int = 1) -> dict[str, torch.Tensor]:
    """Tensors as FasterDecoding names them: ``{head}.{layer}.linear.*`` and ``{head}.{LAYERS}.weight``."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for k in range(HEADS):
        for l in range(LAYERS):
            tensors[f"{k}.{l}.linear.weight"] = torch.randn(HIDDEN, HIDDEN, generator=generator).to(dtype)
            tensors[f"{k}.{l}.linear.bias"] = torch.randn(HIDDEN, generator=generator).to(dtype)
        if projections:
            tensors[f"{k}.{LAYERS}.weight"] = torch.randn(VOCAB, HIDDEN, generator=generator).to(dtype)
    return tensors


def make_fd_folder(path: Path, tensors: dict[str, torch.Tensor], fmt: str = "safetensors", **config) -> Path:
    """A folder as FasterDecoding's trainer leaves it: its config keys, and the heads' weights file."""
    path.mkdir(parents=True, exist_ok=True)
    data = {"base_model_name_or_path": BASE, "medusa_num_heads": HEADS, "medusa_num_layers": LAYERS,
            "transformers_version": "4.38.1", **config}
    (path / "config.json").write_text(json.dumps(data))
    if fmt == "safetensors":
        save_file(tensors, str(path / "medusa_lm_head.safetensors"))
    else:
        torch.save(tensors, path / "medusa_lm_head.pt")
    return path


def load_fd_weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / "medusa_lm_head.safetensors").exists():
        return load_file(str(path / "medusa_lm_head.safetensors"))
    return torch.load(path / "medusa_lm_head.pt", map_location="cpu", weights_only=True)


def assert_identical(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(found) == sorted(expected)
    for name, tensor in expected.items():
        assert found[name].dtype == tensor.dtype, name
        assert torch.equal(found[name], tensor), name


# ----- ours -> FasterDecoding -> ours


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("projection", ["own", "shared"])
def test_ours_round_trip_in_natural_version(tmp_path, fmt, dtype, projection):
    config = tiny_config(projection)
    state = random_state(config, dtype)
    write_medusa_layout(config, state, tmp_path, fmt=fmt)

    written = json.loads((tmp_path / "config.json").read_text())
    assert written["version"] == ("1" if projection == "own" else "2")
    assert (written["medusa_num_heads"], written["medusa_num_layers"]) == (HEADS, LAYERS)
    assert written["base_model_name_or_path"] == BASE
    assert "architectures" not in written and "model_type" not in written  # TGI would take another path
    raw = load_fd_weights(tmp_path)
    assert all(t.is_contiguous() for t in raw.values())
    assert ("0.2.weight" in raw) == (projection == "own")

    read_config, read_state = read_medusa_layout(tmp_path)
    assert (read_config.num_heads, read_config.num_layers) == (HEADS, LAYERS)
    assert (read_config.hidden_size, read_config.vocab_size) == (HIDDEN, VOCAB)
    assert read_config.projection == projection
    assert read_config.base_model_name_or_path == BASE
    assert_identical(read_state, state)
    MedusaHeads(read_config).load_state_dict(read_state)


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_shared_heads_as_version_1_carry_lm_head_copies(tmp_path, fmt):
    config = tiny_config("shared")
    state = random_state(config, torch.bfloat16)
    lm_head = torch.randn(VOCAB, HIDDEN).to(torch.bfloat16)
    write_medusa_layout(config, state, tmp_path, lm_head_weight=lm_head, fmt=fmt, version="1")

    assert json.loads((tmp_path / "config.json").read_text())["version"] == "1"
    read_config, read_state = read_medusa_layout(tmp_path)
    assert read_config.projection == "own"
    projections = {f"heads.{k}.proj.weight": lm_head for k in range(HEADS)}
    assert_identical(read_state, {**state, **projections})


def test_version_1_copies_of_the_base_lm_head_are_read_as_shared_heads(tmp_path):
    config = tiny_config("shared")
    state = random_state(config, torch.bfloat16)
    lm_head = torch.randn(VOCAB, HIDDEN).to(torch.bfloat16)
    write_medusa_layout(config, state, tmp_path, lm_head_weight=lm_head, version="1")

    read_config, read_state = read_medusa_layout(tmp_path, lm_head_weight=lm_head.clone())
    assert read_config.projection == "shared"
    assert_identical(read_state, state)
    MedusaHeads(read_config).load_state_dict(read_state)
    # not the base's lm_head (another weight, one the copies round, a bias it adds): own projections
    rounded = lm_head.float() + 1e-3 * torch.rand(VOCAB, HIDDEN)  # bfloat16 copies of it are not exact
    other = rounded + 0.1  # a weight the copies are not a rounding of
    for weight, bias in [(lm_head + 1, None), (other, None), (lm_head, torch.ones(VOCAB))]:
        assert read_medusa_layout(tmp_path, lm_head_weight=weight, lm_head_bias=bias)[0].projection == "own"
    # a float32 model's copies exported from its bfloat16 load, read onto its float32 load: the weight rounds to
    # them (from a review: own heads, a vocabulary projection per head more, 328 MiB on SmolLM2, without a word)
    near = lm_head.float() * (1 + 1e-4 * torch.rand(VOCAB, HIDDEN))  # within half a bfloat16 step: rounds to lm_head
    assert torch.equal(near.to(torch.bfloat16), lm_head)
    assert read_medusa_layout(tmp_path, lm_head_weight=near)[0].projection == "shared"
    assert read_medusa_layout(tmp_path, lm_head_weight=lm_head, lm_head_bias=torch.zeros(VOCAB))[0].projection == "shared"
    # the same numbers in float32 (the bfloat16 model's weights loaded in float32, as a base named by its id is)
    assert read_medusa_layout(tmp_path, lm_head_weight=lm_head.float())[0].projection == "shared"
    # a float32 model's copies read onto its bfloat16 load round to that lm_head: copies too (they came back as
    # own heads, a vocabulary projection per head more for the same logits)
    write_medusa_layout(config, {k: v.float() for k, v in state.items()}, tmp_path / "f32", lm_head_weight=rounded,
                        version="1")
    assert read_medusa_layout(tmp_path / "f32", lm_head_weight=rounded.to(torch.bfloat16))[0].projection == "shared"
    assert read_medusa_layout(tmp_path / "f32", lm_head_weight=lm_head + 1)[0].projection == "own"


def test_export_writes_independent_tensors_from_views(tmp_path):
    config = tiny_config("own")
    state = random_state(config)
    state["heads.0.blocks.0.linear.weight"] = torch.randn(HIDDEN, HIDDEN).t()  # a non-contiguous view
    write_medusa_layout(config, state, tmp_path)
    assert_identical(read_medusa_layout(tmp_path)[1], state)


# ----- FasterDecoding -> ours -> FasterDecoding


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@pytest.mark.parametrize("projections", [True, False])
def test_fd_round_trip(tmp_path, fmt, projections):
    tensors = fd_tensors(projections, torch.float16)
    extra = {} if projections else {"version": "2"}
    source = make_fd_folder(tmp_path / "fd", tensors, fmt, **extra)
    assert is_medusa_layout(source)

    config, state = read_medusa_layout(source, vocab_size=None if projections else VOCAB)
    assert config.projection == ("own" if projections else "shared")
    assert (config.hidden_size, config.vocab_size) == (HIDDEN, VOCAB)
    MedusaHeads(config).load_state_dict(state)

    write_medusa_layout(config, state, tmp_path / "again", fmt=fmt)
    assert_identical(load_fd_weights(tmp_path / "again"), tensors)


def test_fd_pt_with_one_block_shared_across_layers(tmp_path):
    """FasterDecoding builds heads from ``[ResBlock(h)] * n``: every layer of a head is one module."""
    tensors = fd_tensors(projections=True)
    for k in range(HEADS):
        for part in ("weight", "bias"):
            tensors[f"{k}.1.linear.{part}"] = tensors[f"{k}.0.linear.{part}"]  # same storage, as torch.save keeps it
    config, state = read_medusa_layout(make_fd_folder(tmp_path / "fd", tensors, "pt"))
    write_medusa_layout(config, state, tmp_path / "again")  # safetensors refuses shared storage unless copied
    assert_identical(load_fd_weights(tmp_path / "again"), tensors)


def test_imported_heads_compute_what_fasterdecoding_computes(tmp_path):
    tensors = fd_tensors(projections=True)
    config, state = read_medusa_layout(make_fd_folder(tmp_path, tensors))
    heads = MedusaHeads(config)
    heads.load_state_dict(state)
    hidden = torch.randn(2, 5, HIDDEN)
    expected = []
    for k in range(HEADS):
        x = hidden
        for l in range(LAYERS):  # nn.Sequential(ResBlock, ..., Linear)
            x = x + F.silu(F.linear(x, tensors[f"{k}.{l}.linear.weight"], tensors[f"{k}.{l}.linear.bias"]))
        expected.append(F.linear(x, tensors[f"{k}.{LAYERS}.weight"]))
    torch.testing.assert_close(heads(hidden, lm_head=torch.nn.Identity()), torch.stack(expected))


def test_shared_fd_folder_needs_the_vocab_size_from_somewhere(tmp_path):
    source = make_fd_folder(tmp_path, fd_tensors(projections=False), version="2")
    with pytest.raises(ValueError, match="pass vocab_size="):
        read_medusa_layout(source)
    assert read_medusa_layout(source, vocab_size=VOCAB)[0].vocab_size == VOCAB


def test_sizes_that_disagree_are_refused(tmp_path):
    source = make_fd_folder(tmp_path, fd_tensors(projections=True), hidden_size=HIDDEN, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="hidden_size disagrees.*the tensors: 16.*the hidden_size argument: 576"):
        read_medusa_layout(source, hidden_size=576)
    make_fd_folder(tmp_path, fd_tensors(projections=True), vocab_size=32000)
    with pytest.raises(ValueError, match="vocab_size disagrees.*config.json: 32000"):
        read_medusa_layout(source)


def test_is_medusa_layout(tmp_path):
    assert not is_medusa_layout(tmp_path / "absent")
    assert not is_medusa_layout(tmp_path)
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "config.json").write_text(json.dumps(tiny_config("own").to_dict()))
    save_file(fd_tensors(projections=True), str(ours / "medusa_lm_head.safetensors"))
    assert not is_medusa_layout(ours)
    (ours / "config.json").write_text("{not json")  # beside this layout's weights: read as one, which names the
    assert is_medusa_layout(ours)  # JSON error (test_an_unreadable_config_beside_the_layouts_weights_is_named)
    (ours / "medusa_lm_head.safetensors").unlink()
    assert not is_medusa_layout(ours)
    assert is_medusa_layout(make_fd_folder(tmp_path / "pt", fd_tensors(projections=True), "pt"))


# ----- strict import errors


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_missing_tensor_is_named(tmp_path, fmt):
    tensors = fd_tensors(projections=True)
    del tensors["1.1.linear.bias"]
    with pytest.raises(ValueError, match=r"missing tensors \['1.1.linear.bias'\]"):
        read_medusa_layout(make_fd_folder(tmp_path, tensors, fmt))


def test_head_missing_a_layer_is_named(tmp_path):
    tensors = fd_tensors(projections=True)
    del tensors["2.1.linear.weight"], tensors["2.1.linear.bias"]
    with pytest.raises(ValueError, match=r"missing tensors \['2.1.linear.bias', '2.1.linear.weight'\]"):
        read_medusa_layout(make_fd_folder(tmp_path, tensors))


def test_head_missing_its_projection_is_named(tmp_path):
    tensors = fd_tensors(projections=True)
    del tensors["1.2.weight"]
    with pytest.raises(ValueError, match=r"missing tensors \['1.2.weight'\]"):
        read_medusa_layout(make_fd_folder(tmp_path, tensors))


def test_unexpected_tensor_is_named(tmp_path):
    tensors = {**fd_tensors(projections=True), "lm_head.weight": torch.zeros(VOCAB, HIDDEN)}
    with pytest.raises(ValueError, match=r"holds tensors the FasterDecoding layout does not name, such as "
                                         r"\['lm_head.weight'\] \(1 in all"):
        read_medusa_layout(make_fd_folder(tmp_path, tensors))
    # a prefix another tool added: named as such (the sizes read from nothing were: "nothing ... tells the heads'
    # hidden_size")
    prefixed = {f"medusa_head.{name}": t for name, t in fd_tensors(projections=False).items()}
    with pytest.raises(ValueError, match=r"such as \['medusa_head.0.0.linear.bias', .*strip a prefix"):
        read_medusa_layout(make_fd_folder(tmp_path / "prefixed", prefixed))


def test_mis_shaped_tensor_is_named(tmp_path):
    tensors = {**fd_tensors(projections=True), "0.0.linear.bias": torch.zeros(HIDDEN + 1)}
    with pytest.raises(ValueError, match=r"0.0.linear.bias: checkpoint \(17,\), heads \(16,\)"):
        read_medusa_layout(make_fd_folder(tmp_path, tensors))


def test_more_heads_than_the_config_says_are_refused(tmp_path):
    source = make_fd_folder(tmp_path, fd_tensors(projections=True), medusa_num_heads=2)
    with pytest.raises(ValueError, match=r"holds heads \[0, 1, 2\].*medusa_num_heads=2.*set medusa_num_heads to 3"):
        read_medusa_layout(source)


@pytest.mark.parametrize("projections", [True, False])
@pytest.mark.parametrize("stated", [LAYERS - 1, LAYERS + 1])
def test_another_layer_count_than_the_config_says_is_named(tmp_path, projections, stated):
    source = make_fd_folder(tmp_path, fd_tensors(projections), medusa_num_layers=stated,
                            **({} if projections else {"version": "2"}))
    with pytest.raises(ValueError, match=rf"heads of {LAYERS} ResBlock layers.*medusa_num_layers={stated}.*"
                                         rf"set medusa_num_layers to {LAYERS}"):
        read_medusa_layout(source, hidden_size=HIDDEN, vocab_size=VOCAB)


def test_non_float_tensor_is_refused(tmp_path):
    tensors = {**fd_tensors(projections=True), "0.0.linear.bias": torch.zeros(HIDDEN, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"not named float tensors: \['0.0.linear.bias'\]"):
        read_medusa_layout(make_fd_folder(tmp_path, tensors))


def test_truncated_safetensors_names_the_file(tmp_path):
    source = make_fd_folder(tmp_path, fd_tensors(projections=True))
    weights = source / "medusa_lm_head.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"medusa_lm_head.safetensors could not be read.*re-download"):
        read_medusa_layout(source)


def test_truncated_pt_names_the_file(tmp_path):
    source = make_fd_folder(tmp_path, fd_tensors(projections=True), "pt")
    weights = source / "medusa_lm_head.pt"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"medusa_lm_head.pt could not be read.*re-download"):
        read_medusa_layout(source)


@dataclasses.dataclass
class NotATensor:
    payload: str = "anything a pickle can carry"


def test_pt_with_pickled_objects_is_refused_by_weights_only(tmp_path):
    tensors = {**fd_tensors(projections=True), "0.0.linear.bias": NotATensor()}
    source = make_fd_folder(tmp_path, tensors, "pt")
    refused = r"medusa_lm_head.pt holds objects other than tensors.*weights_only=True"
    with pytest.raises(ValueError, match=refused) as info:
        read_medusa_layout(source)
    assert "Weights only load failed" in str(info.value.__cause__)


def test_config_without_medusa_keys_is_refused(tmp_path):
    source = make_fd_folder(tmp_path, fd_tensors(projections=True))
    (source / "config.json").write_text(json.dumps({"medusa_num_heads": HEADS}))
    with pytest.raises(ValueError, match="no integer 'medusa_num_layers'"):
        read_medusa_layout(source)


@pytest.mark.parametrize("key, value", [("medusa_num_layers", True), ("hidden_size", "16"), ("vocab_size", 32.0)])
def test_config_sizes_that_are_no_integers_are_refused_by_name(tmp_path, key, value):
    """A string hidden_size was compared with the tensors' size and reported as "disagrees ... the tensors: 16,
    config.json: 16"; a boolean medusa_num_layers passed as 1 and failed later asking for vocab_size=."""
    source = make_fd_folder(tmp_path, fd_tensors(projections=True), **{key: value})
    with pytest.raises(ValueError, match=rf"config.json.*(no integer '{key}' \(got|{key} must be an integer, got) "
                                         rf"{re.escape(repr(value))}"):
        read_medusa_layout(source)


def test_a_training_mode_other_than_medusa_forge_writes_is_refused(tmp_path):
    source = make_fd_folder(tmp_path, fd_tensors(projections=True), medusa_forge_training_mode="lora")
    with pytest.raises(ValueError, match=r"config.json: medusa_forge_training_mode must be 'medusa1' or 'medusa2', "
                                         r"got 'lora'"):
        read_medusa_layout(source)


def test_the_chat_template_the_heads_were_trained_on_survives_the_layout(tmp_path, caplog):
    """The layout has no place for a recipe's chat template (``MedusaConfig.chat_template``): it was
    dropped, and re-imported heads rendered chats with the tokenizer's own template without a word."""
    template = "{% for m in messages %}USER: {{ m['content'] }} ASSISTANT:{% endfor %}"
    config = tiny_config("own", chat_template=template)
    with caplog.at_level("WARNING", logger="medusa_infer.interop"):
        write_medusa_layout(config, random_state(config), tmp_path)
    assert "other engines render chats with the tokenizer's template" in caplog.text
    assert json.loads((tmp_path / "config.json").read_text())["medusa_forge_chat_template"] == template
    assert read_medusa_layout(tmp_path)[0].chat_template == template

    plain = tiny_config("own", chat_template="")  # none, as from_pretrained reads it (its import refused "")
    write_medusa_layout(plain, random_state(plain), tmp_path / "plain")
    assert "medusa_forge_chat_template" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    assert read_medusa_layout(tmp_path / "plain")[0].chat_template is None

    source = make_fd_folder(tmp_path / "bad", fd_tensors(projections=True), medusa_forge_chat_template=["x"])
    with pytest.raises(ValueError, match=r"medusa_forge_chat_template must be a jinja chat template \(a string\), "
                                         r"got \['x'\]"):
        read_medusa_layout(source)


# ----- export errors


def test_reduced_vocabulary_export_is_refused(tmp_path):
    config = tiny_config("own", reduced_vocab_size=20)
    with pytest.raises(ValueError, match="reduced vocabulary.*save_pretrained"):
        write_medusa_layout(config, random_state(config), tmp_path)
    assert not (tmp_path / "config.json").exists()
    # what the recipes train (a reduced vocabulary, reading the next token and the path): all named at once
    config = tiny_config("own", reduced_vocab_size=20, next_token_input=True, path_input=True)
    with pytest.raises(ValueError, match=r"a reduced vocabulary \(20 of .*and the token at t \+ 1 as an input "
                                         r"\(next_token_input=True and path_input=True"):
        write_medusa_layout(config, random_state(config), tmp_path)


def test_version_and_lm_head_arguments_must_fit_the_projection(tmp_path):
    own, shared = tiny_config("own"), tiny_config("shared")
    lm_head = torch.randn(VOCAB, HIDDEN)
    with pytest.raises(ValueError, match="only be written as version '1'"):
        write_medusa_layout(own, random_state(own), tmp_path, version="2")
    with pytest.raises(ValueError, match="pass lm_head_weight"):
        write_medusa_layout(shared, random_state(shared), tmp_path, version="1")
    with pytest.raises(ValueError, match="lm_head_weight is only used"):
        write_medusa_layout(shared, random_state(shared), tmp_path, lm_head_weight=lm_head)
    with pytest.raises(ValueError, match=r"lm_head_weight has shape \(16, 50\)"):
        write_medusa_layout(shared, random_state(shared), tmp_path, lm_head_weight=lm_head.t(), version="1")


def test_export_checks_the_state_dict(tmp_path):
    config = tiny_config("own")
    state = random_state(config)
    del state["heads.2.proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensors \['heads.2.proj.weight'\]"):
        write_medusa_layout(config, state, tmp_path)


def test_export_needs_the_base_model_name(tmp_path):
    config = tiny_config("own", base_model_name_or_path=None)
    with pytest.raises(ValueError, match="base_model_name_or_path"):
        write_medusa_layout(config, random_state(config), tmp_path)


def test_export_refuses_a_folder_holding_the_other_weights_file(tmp_path):
    config = tiny_config("own")
    write_medusa_layout(config, random_state(config), tmp_path, fmt="pt")
    with pytest.raises(ValueError, match="medusa_lm_head.pt already exists"):
        write_medusa_layout(config, random_state(config), tmp_path, fmt="safetensors")


def test_export_of_several_blocks_per_head_warns_about_the_reference_loader(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="medusa_infer.interop"):
        config = tiny_config("own")
        write_medusa_layout(config, random_state(config), tmp_path / "two")
    assert "reads only the last block" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="medusa_infer.interop"):
        config = tiny_config("own", num_layers=1)
        write_medusa_layout(config, random_state(config), tmp_path / "one")
    assert "reads only the last block" not in caplog.text
    assert "leave the weights file empty" not in caplog.text
    # no blocks in version 2: an empty weights file that no engine reads (it went without a word)
    with caplog.at_level("WARNING", logger="medusa_infer.interop"):
        config = tiny_config("shared", num_layers=0)
        write_medusa_layout(config, random_state(config), tmp_path / "none")
    assert "version '2' leave the weights file empty" in caplog.text


def test_the_heads_tree_travels_as_medusa_choices(tmp_path):
    """The layout keeps the heads' (fitted) tree as ``medusa_choices``, the format TensorRT-LLM takes,
    and reading it back restores the tree; a malformed one is named."""
    config = tiny_config("own")
    config.tree = [[0], [1], [0, 0], [0, 1], [2]]
    write_medusa_layout(config, random_state(config, torch.float32), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["medusa_choices"] == config.tree
    assert read_medusa_layout(tmp_path)[0].tree == [[0], [1], [2], [0, 0], [0, 1]]
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "medusa_choices": [[0], [1, 0]]}))
    with pytest.raises(ValueError, match=r"config.json: medusa_choices is not a tree .*no parent \(1,\)"):
        read_medusa_layout(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**data, "medusa_choices": [[-2], [-1]]}))
    with pytest.raises(ValueError, match=r"medusa_choices is not a tree .*path \(-2,\) has rank -2 outside"):
        read_medusa_layout(tmp_path)  # (it named top_k 0)
    del data["medusa_choices"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert read_medusa_layout(tmp_path)[0].tree is None


@pytest.mark.parametrize("tree, top_k", [([], 10), ([[0], [12], [0, 0]], 13)])
def test_an_empty_tree_and_ranks_past_ten_survive_the_round_trip(tmp_path, tree, top_k):
    """A calibrated empty tree (plain decoding measured fastest) is written and read back, not dropped
    for a default tree; the heads' top_k is kept in a key of ours; a folder without it (FasterDecoding's
    own, which has no top_k) reads a tree with ranks past the default top_k (10) with a top_k that covers
    them (decoding refused the imported tree)."""
    config = tiny_config("own", tree=tree, top_k=16)
    write_medusa_layout(config, random_state(config, torch.float32), tmp_path)
    back = read_medusa_layout(tmp_path)[0]
    assert back.tree == tree and back.top_k == 16
    data = json.loads((tmp_path / "config.json").read_text())
    del data[TOP_K_KEY]
    (tmp_path / "config.json").write_text(json.dumps(data))
    back = read_medusa_layout(tmp_path)[0]
    assert back.tree == tree and back.top_k == top_k
    if tree:
        validate_tree(back.tree, back.num_heads, back.top_k)


def test_heads_without_a_tree_keep_their_top_k_and_so_their_default_tree(tmp_path):
    """Heads with no tree of their own decode with the first default tree their top_k allows: exported
    and read back, they came back with top_k 10 (the layout had no place for it), so another tree."""
    config = tiny_config("own", tree=None, top_k=4)
    write_medusa_layout(config, random_state(config, torch.float32), tmp_path)
    assert read_medusa_layout(tmp_path)[0].top_k == 4
    data = json.loads((tmp_path / "config.json").read_text())
    for bad in (0, "4", True):
        (tmp_path / "config.json").write_text(json.dumps({**data, TOP_K_KEY: bad}))
        with pytest.raises(ValueError, match=f"{TOP_K_KEY} must be a positive integer, got {bad!r}"):
            read_medusa_layout(tmp_path)


def test_own_projections_are_kept_when_only_some_copy_the_base_lm_head(tmp_path):
    """Only heads whose EVERY projection copies lm_head are shared ones: one trained head beside copies stays own."""
    tensors = fd_tensors(projections=True)
    lm_head = torch.randn(VOCAB, HIDDEN)
    tensors[f"0.{LAYERS}.weight"] = lm_head.clone()  # head 0 copies the base lm_head, heads 1.. are trained
    make_fd_folder(tmp_path, tensors, vocab_size=VOCAB, hidden_size=HIDDEN)  # as our exports write it
    config, state = read_medusa_layout(tmp_path, lm_head_weight=lm_head)
    assert config.projection == "own"
    for k in range(HEADS):
        assert torch.equal(state[f"heads.{k}.proj.weight"], tensors[f"{k}.{LAYERS}.weight"])


def test_version_1_of_shared_heads_is_refused_for_an_lm_head_with_a_bias(tmp_path):
    """The layout's per-head projections have no bias: writing copies of a biased lm_head would drop it."""
    config = tiny_config("shared")
    lm_head = torch.randn(VOCAB, HIDDEN)
    with pytest.raises(ValueError, match="has a bias, which version '1' of shared heads would drop"):
        write_medusa_layout(config, random_state(config), tmp_path / "fd", lm_head_weight=lm_head, version="1",
                            lm_head_bias=torch.ones(VOCAB))
    assert not (tmp_path / "fd").exists()
    # a zero bias is no bias: written
    write_medusa_layout(config, random_state(config), tmp_path / "ok", lm_head_weight=lm_head, version="1",
                        lm_head_bias=torch.zeros(VOCAB))


def test_safetensors_is_read_before_pt_when_a_folder_holds_both(tmp_path):
    """As documented (and as TGI reads it): medusa_lm_head.safetensors first, else .pt."""
    chosen, other = fd_tensors(projections=True, seed=1), fd_tensors(projections=True, seed=2)
    make_fd_folder(tmp_path, chosen, fmt="safetensors")
    torch.save(other, tmp_path / "medusa_lm_head.pt")
    _, state = read_medusa_layout(tmp_path)
    for k in range(HEADS):
        assert torch.equal(state[f"heads.{k}.proj.weight"], chosen[f"{k}.{LAYERS}.weight"])
        assert torch.equal(state[f"heads.{k}.blocks.0.linear.weight"], chosen[f"{k}.0.linear.weight"])


@pytest.mark.parametrize("raw", [b"\xef\xbb\xbf{}", b'{"medusa_num_heads": 3, "name": "caf\xe9"}', b'{"medusa_num',
                                 b"[1, 2]"])
def test_an_unreadable_config_beside_the_layouts_weights_is_named(tmp_path, raw):
    """A config.json saved with a BOM (Notepad), in latin-1, cut, or holding no object, beside this layout's
    weights: the folder was taken for no FasterDecoding folder, and the load said its config.json was missing."""
    from medusa_infer.model import MedusaModel

    folder = make_fd_folder(tmp_path / "fd", fd_tensors(projections=True))
    (folder / "config.json").write_bytes(raw)
    assert is_medusa_layout(folder)
    said = (r"config.json (is not valid JSON \((Unexpected UTF-8 BOM|'utf-8' codec|Unterminated)|"
            r"holds a list, not a JSON)")
    with pytest.raises(ValueError, match=said):
        read_medusa_layout(folder)
    with pytest.raises(ValueError, match=said):
        MedusaModel.from_pretrained(folder, base_model="unused")


@pytest.mark.parametrize("content", [b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 12\n",
                                     b"<!DOCTYPE html><html>Not Found</html>", bytes(range(7, 200))])
@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_weights_that_are_no_torch_file_are_named(tmp_path, content, fmt):
    """A Git LFS pointer (a clone without git-lfs), an error page, random bytes as medusa_lm_head.pt: called a pickle
    of objects that could run code; a pointer is named as one."""
    folder = make_fd_folder(tmp_path / "fd", fd_tensors(projections=True), fmt)
    (folder / f"medusa_lm_head.{fmt}").write_bytes(content)
    said = (r"is a Git LFS pointer, not the weights .*git lfs pull" if content.startswith(b"version")
            else r"could not be read .*: the file is truncated or corrupted; re-download it")
    with pytest.raises(ValueError, match=said):
        read_medusa_layout(folder)


def test_an_export_that_fails_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    """The config.json was written first, then the weights over the earlier export's: a full disk left a config of
    5 heads beside weights of 3 (and the load blamed an understated medusa_num_heads)."""
    from medusa_infer import interop

    write_medusa_layout(tiny_config("shared"), random_state(tiny_config("shared")), tmp_path / "fd")
    before = {p.name: p.read_bytes() for p in (tmp_path / "fd").iterdir()}
    bigger = tiny_config("shared", num_heads=5)

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(interop, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_medusa_layout(bigger, random_state(bigger), tmp_path / "fd")
    assert {p.name: p.read_bytes() for p in (tmp_path / "fd").iterdir()} == before


def test_export_into_a_file_is_refused_by_name(tmp_path):
    (tmp_path / "afile").write_text("x")
    for target in (tmp_path / "afile", tmp_path / "afile" / "fd"):
        with pytest.raises(ValueError, match=r"afile is a file, not a folder: export the heads into a folder"):
            write_medusa_layout(tiny_config("shared"), random_state(tiny_config("shared")), target)


def test_a_bad_value_in_a_heads_config_names_the_file(tmp_path):
    config = tiny_config("own").to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**config, "projection": "mine"}))
    with pytest.raises(ValueError, match=r"config.json: projection must be one of .*'mine'.*; fix it there, or "
                                         r"re-save or re-export the heads"):
        MedusaConfig.load(tmp_path / "config.json")


def test_a_git_lfs_pointer_in_our_layout_is_named(tmp_path):
    from medusa_infer.checkpoint import load_heads_state, save_heads

    save_heads(tmp_path / "heads", tiny_config("own"), random_state(tiny_config("own")))
    (tmp_path / "heads" / "model.safetensors").write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ValueError, match=r"model.safetensors is a Git LFS pointer, not the weights"):
        load_heads_state(tmp_path / "heads")


def test_an_old_releases_bare_pickle_reads(tmp_path):
    """torch.save's legacy format (a bare pickle, no zip archive) is a torch file: read, not refused (M19)."""
    tensors = fd_tensors(projections=True)
    folder = make_fd_folder(tmp_path / "fd", tensors, "pt")
    torch.save(tensors, folder / "medusa_lm_head.pt", _use_new_zipfile_serialization=False)
    assert (folder / "medusa_lm_head.pt").read_bytes()[:1] == b"\x80"
    config, state = read_medusa_layout(folder)
    assert config.num_heads == HEADS


def test_a_failed_torch_save_names_its_file_and_leaves_no_partial_file(tmp_path):
    """The FasterDecoding export's .pt weights go through torch.save, whose failed write (a full disk) is a bare
    RuntimeError naming no file ("PytorchStreamWriter failed writing file data/0: file write failed")."""
    from medusa_infer.checkpoint import write_in_place

    (tmp_path / "medusa_lm_head.pt").write_bytes(b"the earlier export")

    def cut_short(path):
        path.write_bytes(b"half")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed\nframe #0: c10::ThrowEnforceNotMet")

    with pytest.raises(OSError, match=r"medusa_lm_head\.pt\.partial could not be written: \[enforce fail") as raised:
        write_in_place(tmp_path, [("medusa_lm_head.pt", cut_short)])
    assert "frame #0" not in str(raised.value)
    assert [p.name for p in tmp_path.iterdir()] == ["medusa_lm_head.pt"]
    assert (tmp_path / "medusa_lm_head.pt").read_bytes() == b"the earlier export"
    with pytest.raises(RuntimeError, match="a bug"):  # any other error as it is
        write_in_place(tmp_path, [("medusa_lm_head.pt", lambda path: (_ for _ in ()).throw(RuntimeError("a bug")))])
