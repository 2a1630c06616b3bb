"""Every recipe parses and plans without downloading anything; overrides are typed and checked."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from medusa_train.distill import read_prompts
from medusa_train.train_config import (
    TrainConfig,
    config_from_dict,
    feature_settings,
    load_config,
    plan,
    read_yaml,
    save_config,
    valid_keys,
)

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
TRAINING_RECIPES = sorted(RECIPES.glob("*.yaml"))
ACCELERATE_CONFIGS = sorted((RECIPES / "accelerate").glob("*.yaml"))


def test_recipes_exist_for_every_gpu_model_and_mode():
    names = {p.stem for p in TRAINING_RECIPES}
    assert {"smollm2-135m", "smollm2-135m-large"} <= names
    for model in ("llama-3.1-8b-instruct", "qwen2.5-7b-instruct", "mistral-7b-instruct-v0.3", "vicuna-7b-v1.3"):
        assert {f"{model}-medusa1", f"{model}-medusa2"} <= names


@pytest.mark.parametrize("path", TRAINING_RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_and_plans_offline(path, monkeypatch, tmp_path):
    # Any attempt to fetch or load a model fails the test.
    import huggingface_hub
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("plan() must not download or load anything")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    config = load_config(path, [f"output_dir={tmp_path / 'run'}"])
    assert config.model.name and config.output_dir == str(tmp_path / "run")
    assert (config.training.mode == "medusa2") == path.stem.endswith("medusa2")
    for processes in (1, 8):
        result = plan(config, processes)
        assert result.total_steps >= 1 and result.examples > 0
        assert [s.name for s in result.stages][-2:] == ["train", "evaluate"]
        assert "features" in [s.name for s in result.stages] or not config.uses_feature_cache
        assert not any(s.done for s in result.stages if s.name in ("train", "evaluate"))
    # a run killed part way resumes from a checkpoint: at least one before the end, on the launch the
    # recipe is for (the GPU ones: recipes/accelerate/ddp.yaml's 8 processes)
    launch = 8 if config.training.mixed_precision == "bf16" else 1
    assert plan(config, launch).total_steps > config.training.save_every
    text = result.summary()
    assert "steps" in text and "evaluate" in text
    t = config.training
    if t.mode == "medusa2":  # the adapter's warm-up too, counted after the heads-only steps (one count was shown)
        adapter = int(t.warmup_ratio * (result.total_steps - t.stage1_steps))
        assert f"warm-up {result.warmup_steps} for the heads, {adapter} for the adapter" in text
    if not result.exact:  # before the data exist both counts are upper bounds, and the plan says so
        assert "train tokens     <= " in text and "steps            <= " in text
    saved = tmp_path / "again.yaml"
    save_config(config, saved)
    assert load_config(saved) == config  # a saved config reloads to the same run


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.stem)
def test_accelerate_configs_parse_and_name_existing_files(path):
    values = yaml.safe_load(path.read_text())
    assert values["distributed_type"] in ("MULTI_GPU", "FSDP", "DEEPSPEED")
    assert values["num_processes"] >= 2
    ds_file = values.get("deepspeed_config", {}).get("deepspeed_config_file")
    if ds_file:
        ds = json.loads((RECIPES.parent / ds_file).read_text())
        assert ds["zero_optimization"]["stage"] == (2 if "zero2" in path.stem else 3)


def test_cpu_ddp_config_starts_two_processes_on_the_cpu():
    values = yaml.safe_load((RECIPES / "accelerate" / "cpu-ddp-2proc.yaml").read_text())
    # MULTI_CPU with `accelerate launch` starts one process; MULTI_GPU + use_cpu starts two.
    assert values["distributed_type"] == "MULTI_GPU" and values["use_cpu"] is True
    assert values["num_processes"] == 2


def test_plan_warns_of_a_heads_warm_up_that_outlasts_the_joint_stage():
    settings = ["training.mode=medusa2", "training.max_steps=10", "training.stage1_steps=4"]
    long = plan(load_config(RECIPES / "smollm2-135m.yaml", [*settings, "training.heads_warmup_steps=12"]))
    assert long.warnings == ["training.heads_warmup_steps=12 outlasts the 6 joint steps: the heads' loss weight "
                             "reaches 0.1 by the last step, not training.heads_loss_weight=0.2; lower "
                             "heads_warmup_steps or train longer"]
    assert long.summary().splitlines()[-1] == "warning: " + long.warnings[0]
    for fits in ("training.heads_warmup_steps=6", "training.heads_weight_schedule=constant"):
        assert plan(load_config(RECIPES / "smollm2-135m.yaml", [*settings, "training.heads_warmup_steps=12", fits])
                    ).warnings == []
    assert "warning" not in plan(load_config(RECIPES / "smollm2-135m.yaml", settings[1:2])).summary()
    # a weight of 0 is reached whatever the warm-up
    assert plan(load_config(RECIPES / "smollm2-135m.yaml", [*settings, "training.heads_warmup_steps=12",
                                                            "training.heads_loss_weight=0"])).warnings == []


def test_overrides_are_typed_and_dotted():
    config = load_config(RECIPES / "smollm2-135m.yaml", [
        "training.lr=3e-4", "training.epochs=2", "heads.reduced_vocab_size=null", "log.wandb=true",
        "lora.target_modules=q_proj,v_proj", "data.per_source={gsm8k_train: 10}", "training.max_steps=5",
        "training.mode=medusa2",  # which reads lora (Medusa-1 refuses a lora setting)
    ])
    assert config.training.lr == 3e-4 and isinstance(config.training.lr, float)
    assert config.training.epochs == 2.0 and config.training.max_steps == 5
    assert config.heads.reduced_vocab_size is None and config.log.wandb is True
    assert config.lora.target_modules == ["q_proj", "v_proj"]
    assert config.data.per_source == {"gsm8k_train": 10}
    assert plan(config).total_steps == 5
    one = load_config(RECIPES / "smollm2-135m.yaml", ["data.per_source.alpaca=5"])  # an entry of the optional mapping
    assert one.data.per_source["alpaca"] == 5
    with pytest.raises(ValueError, match="model.name: expected a non-empty string, got None"):
        config_from_dict({"model": {"name": None}, "data": {"prompts": "p.jsonl"}})
    # integers past 2**53 keep every digit (they went through a float)
    assert load_config(None, ["data.prompts=p.jsonl", "data.n=9007199254740993"]).data.n == 9007199254740993
    # no quotas, written as null or {}: data.n keeps its default (it became "every prompt")
    for empty in ("null", "~", "{}"):
        assert load_config(None, ["data.prompts=p.jsonl", f"data.per_source={empty}"]).data.n == 300, empty


@pytest.mark.parametrize("override, message", [
    ("training.lrr=1", "unknown key 'training.lrr'"),
    ("trainng.lr=1", "unknown key 'trainng.lr'"),
    ("training.epochs=many", "training.epochs: expected a number"),
    ("heads.num_heads=2.5", "heads.num_heads: expected an integer"),
    ("training.mode=medusa3", "training.mode must be one of"),
    ("training.lr", "is not key=value"),
    ("training=1", "is a section"),
    ("output_dir=", "output_dir: expected a non-empty string, got ''"),
    ("training.mode=medusa2 training.loss=kl features.topk=0", "training.loss=kl trains on the model's top-k"),
    ("heads.next_token_input=false heads.path_input=true", "heads.path_input=true needs heads.next_token_input=true"),
    # heads with no parameter: Medusa-1 failed at its first backward, Medusa-2 saved lm_head copies as heads
    ("heads.num_layers=0 heads.projection=shared heads.next_token_input=false heads.path_input=false",
     "heads.num_layers=0 with heads.projection=shared leaves the heads nothing to train"),
    # these passed, then failed after distilling (the rows then recorded the bad seed, so were not reusable)
    ("training.seed=-1", "training.seed must be in [0, 2**32 - 1], got -1"),
    ("training.seed=4294967296", "training.seed must be in [0, 2**32 - 1], got 4294967296"),
    ("data.max_length=1", "data.max_length must be >= 2"),
    # YAML that does not parse names the key (a traceback named "<unicode string>")
    ("data.per_source={a:1", "data.per_source: '{a:1' is not valid YAML"),
    ("lora.target_modules=[q_proj", "lora.target_modules: '[q_proj' is not valid YAML"),
    # set, and never read by Medusa-1: a change refused a re-run of a finished run
    ("lora.r=64", "lora.r=64 applies to training.mode=medusa2 only"),
    ("lora.target_modules=no_such_module", "lora.target_modules=['no_such_module'] applies to training.mode=medusa2"),
    # a boolean for a text: "eval.push_to_hub=false" uploaded the heads to a repo named "false"
    ("eval.push_to_hub=false", "eval.push_to_hub: expected a text, got 'false', a boolean"),
    ("data.system_prompt=True", "data.system_prompt: expected a text, got 'True', a boolean"),
    ("eval.push_to_hub=off", "eval.push_to_hub='off' reads as a boolean, not a Hub repo id"),
    ("model.hub_id=no", "model.hub_id='no' reads as a boolean, not a Hub repo id"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        load_config(RECIPES / "smollm2-135m.yaml", override.split(" "))
    if "unknown key" in message:
        assert "training.lr" in str(err.value) and "heads.num_heads" in str(err.value)  # lists the valid keys


def test_recipe_files_overrides_and_paths_read_as_a_user_means_them(tmp_path, monkeypatch):
    """A recipe file that is no YAML is named; a mapping set whole by one override takes an entry from a later
    one; per_source {} means no quotas everywhere (distilling read it as no source: 0 prompts); a path
    starting with ~ is the home folder's, as model.name is."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: [x\n")
    with pytest.raises(ValueError, match=f"recipe {re.escape(str(bad))} is not valid YAML"):
        load_config(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="holds a list, not a mapping of sections"):
        load_config(bad)
    # a section given twice (a second `training:` appended): every setting of the first went back to its default
    shipped = (RECIPES / "smollm2-135m.yaml").read_text()
    assert "\ntraining:\n" in shipped
    bad.write_text(shipped + "training:\n  lr: 2.0e-3\n")
    with pytest.raises(ValueError, match=r"'training' appears twice in one mapping \(first on line \d+\).*merge"):
        load_config(bad)
    bad.write_text("data:\n  prompts: a.jsonl\n  prompts: b.jsonl\n")
    with pytest.raises(ValueError, match="'prompts' appears twice"):
        load_config(bad)
    bad.write_text("defaults: &d {lr: 0.1, epochs: 2}\ntraining:\n  <<: *d\n  lr: 0.2\n")  # YAML's merge: allowed
    assert read_yaml(bad.read_text())["training"] == {"lr": 0.2, "epochs": 2}
    # read as PyYAML reads them: a mapping merged in place and reached again through an alias (refused as holding
    # its merged key twice), a mapping that holds itself
    for text in ("a: &a {x: 1}\nc: {<<: &b {<<: *a, x: 2}, y: 1}\nd: *b\n", "a: &a {self: *a}\n"):
        assert repr(read_yaml(text)) == repr(yaml.safe_load(text))
    for section in ("[]", "0"):  # taken for the defaults in silence (`training:` alone still is)
        bad.write_text(f"data:\n  prompts: p.jsonl\ntraining: {section}\n")
        with pytest.raises(ValueError, match=r"training: expected a mapping, got (\[\]|0)"):
            load_config(bad)
    bad.write_text("data:\n  prompts: p.jsonl\ntraining:\n")
    assert load_config(bad).training.lr == load_config(None, ["data.prompts=p.jsonl"]).training.lr
    config = load_config(None, ["data.prompts=p.jsonl", "data.distill_options={backend: openai}",
                                "data.distill_options.endpoint=http://127.0.0.1:8000"])
    assert config.data.distill_options == {"backend": "openai", "endpoint": "http://127.0.0.1:8000"}
    with pytest.raises(ValueError, match=r"'data.distill_options' is not a mapping \(in the recipe or an earlier"):
        load_config(None, ["data.prompts=p.jsonl", "data.distill_options=[1]", "data.distill_options.endpoint=x"])
    for values in ({"data": {"prompts": "p.jsonl", "per_source": {}}}, {"data": {"prompts": "p.jsonl"}}):
        assert config_from_dict(values, ["data.per_source={}"]).data.per_source is None
        assert config_from_dict(values).data.per_source is None
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(None, ["data.prompts=~/p.jsonl", "output_dir=~/run", "features.dir=~/features",
                                "heads.init_from=~/heads"])
    assert (config.data.prompts, config.output_dir, config.features.dir, config.heads.init_from) == (
        str(tmp_path / "p.jsonl"), str(tmp_path / "run"), str(tmp_path / "features"), str(tmp_path / "heads"))
    from medusa_train.distill import DistillConfig  # distillation's file of ids to leave out too (not a file)

    (tmp_path / "ids.txt").write_text("q7\n")
    assert DistillConfig(prompts="p.jsonl", exclude_ids="~/ids.txt").exclude_ids == ["q7"]


def test_model_checks_take_the_names_the_loader_takes_and_the_model_it_loads(tmp_path, monkeypatch):
    """This project's sdpa_gqa and transformers' paged|<name> load, so --plan takes them; a folder named as
    the default model holding no model (a run's output folder) is not the model --plan checks against."""
    import train_heads

    for name in ("sdpa_gqa", "paged|sdpa", "eager", "kernels-community/flash-attn", None):
        train_heads.check_attn_implementation(name)
    with pytest.raises(ValueError, match="'flash_attention2' is none transformers knows"):
        train_heads.check_attn_implementation("flash_attention2")
    import torch

    if not torch.cuda.is_available():  # (known, yet it failed loading for features, after distilling)
        for name in ("flash_attention_2", "flash_attention_3", "paged|flash_attention_2"):
            with pytest.raises(ValueError, match=f"model.attn_implementation={re.escape(repr(name))} needs a GPU"):
                train_heads.check_attn_implementation(name)
    cached = tmp_path / "cache" / "smollm2"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    monkeypatch.setattr("medusa_infer.models.default_model_folder", lambda spec: cached)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m-instruct").mkdir()  # no model in it
    config = load_config(None, ["data.prompts=p.jsonl", "model.name=smollm2-135m-instruct"])
    assert train_heads._model_folder(config) == cached


@pytest.mark.parametrize("arguments, message", [
    (["model.attn_implementation=flash_attention2"], r"model.attn_implementation='flash_attention2' is none "
                                                     r"transformers knows"),
    (["training.loss=kl", "features.topk=200"], r"features.topk=200 is past the model's vocabulary of \d+ tokens"),
    (["heads.reduced_vocab_size=200"], r"heads.reduced_vocab_size=200 is past the model's vocabulary"),
    (["output_dir=/etc/passwd"], r"output_dir='/etc/passwd': /etc/passwd is a file, not a folder"),
    (["features.dir=/etc/passwd/feats"], r"features.dir='/etc/passwd/feats': /etc/passwd is a file"),
])
def test_settings_past_the_model_are_refused_by_plan(tmp_path, capsys, arguments, message):
    """They passed --plan and failed after distilling and feature extraction (topk in a traceback)."""
    import train_heads
    from tiny import VOCAB, tiny_model

    assert VOCAB < 200
    tiny_model("llama").save_pretrained(tmp_path / "model")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**run_recipe(tmp_path), "model": {"name": str(tmp_path / "model")}}))
    with pytest.raises(SystemExit) as exit_info:
        train_heads.main(["--config", str(recipe), "--plan", *arguments])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_unknown_recipe_key_is_an_error():
    with pytest.raises(ValueError, match="unknown key 'heads.num_head'"):
        config_from_dict({"heads": {"num_head": 3}, "data": {"prompts": "p.jsonl"}})


def test_plan_says_the_ranks_a_reduced_head_vocabulary_caps_the_evaluation_at(tmp_path):
    """eval.top_k=50 on heads of a 20-token vocabulary measures ranks 1..20 (the heads' config holds 20 accuracies):
    the plan promised top-1..50."""
    values = {"output_dir": str(tmp_path / "run"), "data": {"prompts": "p.jsonl"}, "eval": {"top_k": 50},
              "heads": {"reduced_vocab_size": 20}}
    [evaluate] = [s for s in plan(config_from_dict(values)).stages if s.name == "evaluate"]
    assert evaluate.detail.startswith("top-1..20 accuracy") and "(eval.top_k=50: the heads' vocabulary holds 20" \
        in evaluate.detail
    [evaluate] = [s for s in plan(config_from_dict(values, ["eval.top_k=10"])).stages if s.name == "evaluate"]
    assert evaluate.detail.startswith("top-1..10 accuracy") and "eval.top_k" not in evaluate.detail


def test_plan_counts_existing_data_and_features(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": "p", "response": "r"}) + "\n" for i in range(50)))
    config = config_from_dict({"output_dir": str(tmp_path / "run"), "data": {"rows": str(rows), "heldout_fraction": 0.1},
                               "training": {"batch_tokens": 100}})
    before = plan(config)
    assert before.examples == 50 and before.train_examples == 45 and before.stages[0].done
    # the steps are a bound until the features are counted: the train stage's line said so as the summary did
    [train] = [s for s in before.stages if s.name == "train"]
    assert not before.exact and train.detail.startswith(f"medusa1, <= {before.total_steps} steps")
    assert [line for line in before.summary().splitlines() if line.split()[:1] == ["steps"]][0].split()[1] == "<="
    # given rows are read as they are: not the recipe's model answering with its token limit
    assert before.stages[0].detail == "rows given (data.rows), read as they are"
    features = tmp_path / "run" / "features"
    (features / "abc").mkdir(parents=True)
    (features / "abc" / "manifest.json").write_text(json.dumps({"num_rows": 1000}))
    (features / "index.json").write_text(json.dumps({"train": "abc", "heldout": "def"}))
    assert [s.done for s in plan(config).stages if s.name == "features"] == [False]  # no record of its settings
    (features / "index.json").write_text(json.dumps({"train": "abc", "heldout": "def",
                                                     "settings": feature_settings(config)}))
    after = plan(config)
    assert after.train_units == 1000 and after.steps_per_epoch == 10
    assert after.exact and [s.detail for s in after.stages if s.name == "train"][0].startswith(
        f"medusa1, {after.total_steps} steps")  # (the cache's positions: exact, said "<=")
    [steps] = [line for line in after.summary().splitlines() if line.split()[:1] == ["steps"]]
    assert "<=" not in steps
    assert [s.done for s in after.stages if s.name == "features"] == [True]
    # rows still to distil make other examples: the cache is another run's
    assert [s.done for s in plan(config, distill_pending=3).stages if s.name == "features"] == [False]
    assert "<= " in plan(config, distill_pending=3).summary().split("train tokens")[1].splitlines()[0]
    # another split holds other training examples: the plan gave this one's positions as exact (and a batch
    # they filled was refused once the features were extracted)
    for change in ({"data": {**config.to_dict()["data"], "heldout_fraction": 0.5}},
                   {"training": {**config.to_dict()["training"], "seed": 7}}):
        split = plan(config_from_dict({**config.to_dict(), **change}))
        assert [s.done for s in split.stages if s.name == "features"] == [False] and not split.exact
    # an index written before the split was recorded is taken as this split's, as it was then (the run reuses the
    # cache by its examples' hash, and writes the index again)
    older = {k: v for k, v in feature_settings(config).items() if k not in ("seed", "heldout_fraction")}
    (features / "index.json").write_text(json.dumps({"train": "abc", "heldout": "def", "settings": older}))
    assert plan(config).exact and [s.done for s in plan(config).stages if s.name == "features"] == [True]
    (features / "index.json").write_text(json.dumps({"train": "abc", "heldout": "def",
                                                     "settings": feature_settings(config)}))
    # loss ce reads no soft labels: a kl run's caches serve it, as the run reuses them (the plan said to extract)
    kl = config_from_dict({**config.to_dict(), "training": {**config.to_dict()["training"], "loss": "kl"}})
    assert config.soft_label_topk == 0 and kl.soft_label_topk > 0
    (features / "index.json").write_text(json.dumps({"train": "abc", "heldout": "def",
                                                     "settings": feature_settings(kl)}))
    assert [s.done for s in plan(config).stages if s.name == "features"] == [True] and plan(config).exact
    (features / "index.json").write_text(json.dumps({"train": "abc", "heldout": "def",
                                                     "settings": feature_settings(config)}))
    rows.write_text(rows.read_text() + json.dumps({"id": 50, "prompt": "p", "response": "r"}) + "\n")
    assert [s.done for s in plan(config).stages if s.name == "features"] == [False]  # the rows changed
    # another max_length makes other examples, so other features: the plan said done, and counted these
    other = config_from_dict({**config.to_dict(), "data": {**config.to_dict()["data"], "max_length": 64}})
    assert [s.done for s in plan(other).stages if s.name == "features"] == [False]
    assert plan(other).train_units != 1000


def test_plan_gives_the_steps_an_epoch_takes_when_accumulation_runs_across_epochs(tmp_path):
    """Optimizer steps run on across epochs: 15 micro-batches an epoch at accumulation 2 are 7.5 steps an epoch
    (the run's 15 steps in 2 epochs), which the plan printed as 7."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": "p", "response": "r"}) + "\n" for i in range(50)))
    config = config_from_dict({"output_dir": str(tmp_path / "run"), "data": {"rows": str(rows), "heldout_fraction": 0.1},
                               "features": {"enabled": False},
                               "training": {"batch_size": 3, "grad_accum": 2, "epochs": 2}})
    planned = plan(config)
    assert (planned.micro_steps_per_epoch, planned.total_steps) == (15, 15)
    [steps] = [line for line in planned.summary().splitlines() if line.split()[:1] == ["steps"]]
    assert "15 (7.5 per epoch," in steps


def test_plan_says_done_for_a_tokenised_dataset_of_these_settings_only(tmp_path, capsys):
    import train_heads

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": f"q{i}" + " word" * (1500 if i >= 15 else 0),
                                        "response": "an answer"}) + "\n" for i in range(20)))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "run"), "model": {"name": "smollm2-135m-instruct"},
                                      "data": {"rows": str(rows), "heldout_fraction": 0.2}}))
    config = load_config(recipe)
    assert plan(config).examples == 20  # (rows, before the build)

    from test_dataset import OneProcess

    train_heads.stage_data(config, OneProcess(), 0)
    assert [s.done for s in plan(config).stages if s.name == "dataset"] == [True]
    # the examples the build kept: five prompts fill data.max_length (the plan counted rows, and its steps)
    assert (plan(config).examples, plan(config).train_examples) == (15, 12)
    sequences = plan(load_config(recipe, ["features.enabled=false", "training.batch_size=4"]))
    assert sequences.exact and sequences.steps_per_epoch == 3  # 12 training sequences
    for change in ("data.max_length=64", "data.system_prompt=Be brief."):
        assert [s.done for s in plan(load_config(recipe, [change])).stages if s.name == "dataset"] == [False]
    assert [s.done for s in plan(config, distill_pending=5).stages if s.name == "dataset"] == [False]  # more rows
    # a cache of an earlier release (no record) is recorded when the run reuses it
    from medusa_train.dataset import BUILD_STATS_NAME

    [stats] = (tmp_path / "run" / "data").glob(f"tokenized-*/{BUILD_STATS_NAME}")
    stats.unlink()
    assert [s.done for s in plan(config).stages if s.name == "dataset"] == [False]
    train_heads.stage_data(config, OneProcess(), 0, record=False)  # --heldout-only's read: records nothing
    assert not stats.exists()
    train_heads.stage_data(config, OneProcess(), 0)
    assert [s.done for s in plan(config).stages if s.name == "dataset"] == [True]
    # a cache of an earlier format (built again by the run): the plan said done
    saved = json.loads(stats.read_text())
    stats.write_text(json.dumps({**saved, "format": saved["format"] - 1}))
    assert [s.done for s in plan(config).stages if s.name == "dataset"] == [False]
    stats.write_text(json.dumps(saved))
    # other rows under the same path: other examples
    rows.write_text(rows.read_text().replace("an answer", "another answer"))
    assert [s.done for s in plan(config).stages if s.name == "dataset"] == [False]


def test_the_plan_splits_ready_examples_by_prompt_id_as_the_run_does(tmp_path):
    """Ready examples answering one prompt several times: the run holds one prompt's answers out together, and
    the plan counted the split per example (Medusa-2's steps are counted in sequences: 28 planned, 37 run)."""
    from medusa_train.train_config import tokenized_split

    ready = tmp_path / "ready.jsonl"
    ids = ["p0"] * 31 + [f"p{i}" for i in range(1, 10)]
    ready.write_text("".join(json.dumps({"id": i, "input_ids": list(range(12)), "labels": [-100] * 4
                                         + list(range(4, 12))}) + "\n" for i in ids))
    for mode in ("medusa1", "medusa2"):
        config = config_from_dict({"output_dir": str(tmp_path / "run"), "heads": {"num_heads": 3},
                                   "data": {"tokenized": str(ready), "heldout_fraction": 0.3},
                                   "training": {"mode": mode, "batch_tokens": 16, "batch_size": 2,
                                                **({"stage1_steps": 0} if mode == "medusa2" else {})}})
        train, heldout = tokenized_split(config)
        laid = plan(config)
        assert (laid.train_examples, laid.heldout_examples) == (len(train), len(heldout)), mode
        assert not {e["id"] for e in train} & {e["id"] for e in heldout}


def test_plan_bounds_ready_examples_by_their_length_and_counts_them_as_kept(tmp_path):
    """data.tokenized: the estimate took data.max_new_tokens per example (their length is max_length's), so
    a plan refused long examples that fill a batch; it counted examples max_length leaves unlabelled, and
    called its token estimate exact. Then it bounded the positions by all examples' labels, held-out ones
    included: a batch they filled and the training split's positions did not was refused after the features
    stage. Now it counts the positions the feature cache keeps for the training split the run draws."""
    ready = tmp_path / "ready.jsonl"
    long = [{"input_ids": list(range(600)), "labels": [-100] * 10 + list(range(10, 600))} for _ in range(4)]
    prompt_only = {"input_ids": list(range(40)), "labels": [-100] * 30 + list(range(30, 40))}
    ready.write_text("".join(json.dumps(e) + "\n" for e in long + [prompt_only]))
    config = config_from_dict({"output_dir": str(tmp_path / "run"),
                               "data": {"tokenized": str(ready), "heldout_fraction": 0.25, "max_length": 700},
                               "training": {"batch_tokens": 1024}})
    laid = plan(config)  # 4 train examples of 590 and 10 labelled tokens: a batch of 1024 is filled
    from medusa_train.train_config import split_indices

    assert split_indices(5, 0.25, config.training.seed) == ([0, 1, 3, 4], [2])  # a long example held out
    # head 1 learns where the next two tokens are the answer's: 589 positions of 590 labels, 9 of 10
    assert laid.examples == 5 and laid.est_train_tokens == 3 * 589 + 9
    assert laid.tokens_exact and "<= " not in laid.summary().split("train tokens")[1].splitlines()[0]
    with pytest.raises(ValueError, match=r"1776 training positions do not fill one micro-batch of 2000"):
        plan(config_from_dict({**config.to_dict(), "training": {"batch_tokens": 2000}}))  # 2370 labels in all
    cut = plan(config_from_dict({**config.to_dict(), "data": {**config.to_dict()["data"], "max_length": 30},
                                 "training": {"batch_tokens": 16}}))
    assert cut.examples == 4  # the prompt-only example keeps no label at 30 tokens: dropped, as the run drops it
    # rows this run does not distil are bounded by max_length too
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": "p", "response": "r"}) + "\n" for i in range(8)))
    given = plan(config_from_dict({"output_dir": str(tmp_path / "run2"), "training": {"batch_tokens": 100},
                                   "data": {"rows": str(rows), "heldout_fraction": 0.25, "max_length": 300,
                                            "max_new_tokens": 64}}))
    assert given.est_train_tokens == 6 * 300


def test_every_valid_key_has_a_default():
    keys = valid_keys()
    assert "training.mode" in keys and "lora.r" in keys and "eval.tree_size" in keys
    assert isinstance(TrainConfig().training.lr, float)



ROOT = RECIPES.parent
SHARED_PROMPTS = ROOT.parent / "shared" / "data" / "train_prompts.jsonl"
# sources whose licence allows redistribution (data/README.md); only these are shipped
REDISTRIBUTABLE = {"gsm8k_train", "gpteacher_codegen", "gpteacher_roleplay", "dolly_open_qa", "self_instruct_seed",
                   "oasst_prompt_lottery", "oasst_en_100", "oasst_seed"}
LARGE_QUOTAS = {s: 1000 for s in ("gsm8k_train", "gpteacher_codegen", "gpteacher_roleplay", "dolly_open_qa")}


@pytest.fixture(scope="module")
def prompt_set():
    """scripts/make_prompt_set.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_prompt_set", ROOT / "scripts" / "make_prompt_set.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["smollm2-135m", "smollm2-135m-large"])
def test_default_recipes_read_shipped_redistributable_prompts(name, prompt_set):
    config = load_config(RECIPES / f"{name}.yaml")
    rows = read_prompts(ROOT / config.data.prompts)
    assert len({r["id"] for r in rows}) == len(rows) >= config.data.n  # enough distinct prompts for data.n
    assert {r["source"] for r in rows} <= REDISTRIBUTABLE


def test_larger_prompt_set_is_made_by_its_command(prompt_set):
    """data/train_prompts_large.jsonl is what the command in data/README.md makes from the 25k set."""
    if not SHARED_PROMPTS.is_file():
        pytest.skip(f"needs the 25k-prompt set it was sampled from, {SHARED_PROMPTS}")
    quick = read_prompts(ROOT / "data" / "train_prompts.jsonl")
    large = read_prompts(ROOT / "data" / "train_prompts_large.jsonl")
    assert prompt_set.build(read_prompts(SHARED_PROMPTS), quick, LARGE_QUOTAS, seed=0) == large


def test_prompt_set_builder_keeps_included_rows_and_meets_quotas(prompt_set):
    large = read_prompts(ROOT / "data" / "train_prompts_large.jsonl")
    quick = read_prompts(ROOT / "data" / "train_prompts.jsonl")
    assert {r["id"] for r in quick} <= {r["id"] for r in large}
    included = [r for r in large if r["source"] == "oasst_seed"][:2]
    built = prompt_set.build(large, included, {"gsm8k_train": 3, "oasst_seed": 5}, seed=0)
    assert [r["source"] for r in built].count("gsm8k_train") == 3 and len(built) == 8
    assert all(r in built for r in included)  # kept, and counted towards their source's quota
    assert [r["id"] for r in built] == [r["id"] for r in large if r in built]  # in the source's order
    other_seed = prompt_set.build(large, [], {"gsm8k_train": 3}, seed=1)
    assert other_seed != prompt_set.build(large, [], {"gsm8k_train": 3}, seed=0)
    with pytest.raises(ValueError, match="fewer than its quota"):
        prompt_set.build(large, [], {"oasst_seed": 10_000}, seed=0)
    with pytest.raises(ValueError, match="not in the source rows: .'nope'."):
        prompt_set.build(large, [], {"nope": 1}, seed=0)
    with pytest.raises(ValueError, match="1 included rows are not in the source rows"):
        prompt_set.build(large[:10], [large[-1]], {}, seed=0)


# ---------------------------------------------------------------------------------------------
# Distillation settings a recipe gives, and rows a run finds already there


def write_prompts(path: Path, n: int) -> Path:
    sources = ("alpha", "beta")
    path.write_text("".join(json.dumps({"id": f"p{i}", "source": sources[i % 2], "prompt": f"question {i}"}) + "\n"
                            for i in range(n)))
    return path


def run_recipe(tmp_path: Path, **data) -> dict:
    return {"output_dir": str(tmp_path / "run"), "training": {"batch_tokens": 16},
            "data": {"prompts": str(write_prompts(tmp_path / "prompts.jsonl", 20)), "n": 10, "max_new_tokens": 32,
                     "distill_options": {"max_prompt_tokens": None},  # no tokenizer needed to count what is left
                     **data}}


def write_rows(config: TrainConfig, ids: list[str], **changes) -> Path:
    from medusa_train.distill import recipe_config
    from medusa_train.train_config import rows_path

    made = recipe_config(config)
    record = {**made.generation_record(), **changes.get("generation", {})}
    path = rows_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = changes.get("model", made.model)
    texts = {str(p["id"]): p["prompt"] for p in map(json.loads, Path(config.data.prompts).read_text().splitlines())}
    path.write_text("".join(json.dumps({"id": i, "prompt": texts[i], "response": "a", "model": model,
                                        "generation": record}) + "\n" for i in ids))
    return path


def plan_output(capsys, tmp_path: Path, values: dict, *overrides: str) -> str:
    import train_heads

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(values))
    assert train_heads.main(["--config", str(recipe), "--plan", *overrides]) == 0
    return capsys.readouterr().out


def test_rows_of_another_model_or_settings_are_refused_before_anything_runs(tmp_path, capsys):
    import train_heads
    from medusa_train.distill import sample_prompts

    values = run_recipe(tmp_path)
    config = config_from_dict(values)
    ids = [p["id"] for p in sample_prompts(config.data.prompts, 10)]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(values))
    for changes, named in (({"model": "gemma3-270m"}, "made with model 'gemma3-270m' (now "),
                           ({"generation": {"max_new_tokens": 512}},
                            "made with max_new_tokens 512 (now 32; data.max_new_tokens in a recipe)")):
        write_rows(config, ids, **changes)
        with pytest.raises(SystemExit) as exit_info:
            train_heads.main(["--config", str(recipe), "--plan"])
        assert exit_info.value.code == 2
        message = capsys.readouterr().err
        assert "already holds row" in message and named in message and "Use another output path" in message
    # a run killed before its merge leaves its answers in shards only: they were checked only inside the
    # distillation, after config.yaml had been rewritten with the new settings
    from medusa_train.distill import shard_path

    path = write_rows(config, ids, generation={"max_new_tokens": 512})
    path.rename(shard_path(path, 0))
    with pytest.raises(SystemExit):
        train_heads.main(["--config", str(recipe), "--plan"])
    assert "already holds row" in capsys.readouterr().err


def test_plan_says_a_run_with_part_of_its_rows_resumes_distilling(tmp_path, capsys):
    from medusa_train.distill import sample_prompts

    values = run_recipe(tmp_path)
    config = config_from_dict(values)
    ids = [p["id"] for p in sample_prompts(config.data.prompts, 10)]
    write_rows(config, ids[:4])
    out = plan_output(capsys, tmp_path, values)
    assert "[todo] distill" in out and "answers 6 more prompts (resuming)" in out and re.search(r"examples\s+10 ", out)
    write_rows(config, ids)
    out = plan_output(capsys, tmp_path, values)
    assert "[done] distill" in out and re.search(r"examples\s+10 ", out)
    # a larger sample resumes: the rows answer 10 of its 16 prompts
    out = plan_output(capsys, tmp_path, values, "data.n=16")
    assert "answers 6 more prompts (resuming)" in out and re.search(r"examples\s+16 ", out)


def test_given_rows_file_is_read_as_it_is(tmp_path, capsys):
    values = run_recipe(tmp_path)
    rows = tmp_path / "elsewhere.jsonl"
    rows.write_text("".join(json.dumps({"id": f"x{i}", "prompt": "q", "response": "a", "model": "other"}) + "\n"
                            for i in range(7)))
    out = plan_output(capsys, tmp_path, values, f"data.rows={rows}")
    assert "[done] distill" in out and re.search(r"examples\s+7 ", out)


def test_given_rows_distilled_with_another_system_prompt_or_template_are_refused(tmp_path, capsys):
    """Rows given as data.rows were built under the recipe's system prompt whatever they were answered under (the
    heads learned answers to a prompt the model was never shown), without a word."""
    import train_heads

    values = run_recipe(tmp_path)
    rows = tmp_path / "elsewhere.jsonl"
    for generation, named in (({"system_prompt": "Always answer in French.", "chat_template": None},
                               r"row 'x0' was distilled with system prompt 'Always answer in French.'.*"
                               r"set data.system_prompt to it"),
                              ({"system_prompt": None, "chat_template": "sha256:0123456789abcdef"},
                               r"row 'x0' was distilled with chat template sha256:0123456789abcdef.*"
                               r"set model.chat_template to that template")):
        rows.write_text("".join(json.dumps({"id": f"x{i}", "prompt": "q", "response": "a", "generation": generation})
                                + "\n" for i in range(7)))
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(yaml.safe_dump(values))
        with pytest.raises(SystemExit):
            train_heads.main(["--config", str(recipe), "--plan", f"data.rows={rows}"])
        assert re.search(named, capsys.readouterr().err)
    rows.write_text("".join(json.dumps({"id": f"x{i}", "prompt": "q", "response": "a", "generation": {
        "system_prompt": None, "chat_template": None}}) + "\n" for i in range(7)))  # as the recipe renders them
    assert "[done] distill" in plan_output(capsys, tmp_path, values, f"data.rows={rows}")


@pytest.mark.parametrize("options, message", [
    ({"backnd": "openai"}, r"unknown data.distill_options \['backnd'\]; known: \[.*'backend'"),
    ({"max_new_tokens": 512},
     r"may not set \['max_new_tokens'\]: the recipe sets max_new_tokens by data.max_new_tokens"),
    ({"chat_template": "x"}, r"chat_template by model.chat_template"),
    ({"backend": "openai"}, r"backend 'openai' needs endpoint"),
    ({"concurrency": "many"}, r"data.distill_options.concurrency: expected an integer"),
    # the plan and features/index.json said the hidden states kept while distilling were read, and none were kept
    ({"save_hidden": False}, r"may not set \['save_hidden'\]: the recipe sets save_hidden by features.from_distil"),
])
@pytest.mark.parametrize("distils", [True, False], ids=["distilling", "tokenized"])
def test_distill_options_are_checked_when_the_recipe_loads(tmp_path, capsys, options, message, distils):
    """Also where the run distils nothing (data.tokenized): a misspelt option passed, and backend=bogus turned
    the plan's features stage from done to to-do."""
    import train_heads

    values = run_recipe(tmp_path, distill_options=options)
    if not distils:
        examples = tmp_path / "examples.jsonl"
        examples.write_text(json.dumps({"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}) + "\n")
        values["data"] = {"tokenized": str(examples), "distill_options": options}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(values))
    with pytest.raises(SystemExit):
        train_heads.main(["--config", str(recipe), "--plan"])
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("arguments, message", [
    (["data.n=1"], r"1 example\(s\) cannot be split into training and held-out data"),
    (["data.prompts=/no/such/prompts.jsonl"], r"data.prompts: /no/such/prompts.jsonl is not a file"),
    (["model.name=./no/such/model"], r"'./no/such/model' is not a model folder"),
    (["model.name=smolm2"], r"Unknown model name 'smolm2'"),
    (["training.batch_tokens=100000"], r"do not fill one micro-batch of 100000"),
    (["--push-to-hub", "me/heads"], r"uploading to me/heads needs the Hub, but HF_HUB_OFFLINE is set"),
    (["--push-to-hub", "me/my heads"], r"--push-to-hub 'me/my heads' is no Hub repo id"),
    (["data.prompts=null", "data.rows=/no/such/rows.jsonl"], r"data.rows: /no/such/rows.jsonl is not a file"),
    (["heads.init_from=/no/such/heads"], r"heads.init_from=/no/such/heads has no config.json"),
    (["--private"], r"--private \(eval.private\) makes the uploaded repo private, and nothing is uploaded"),
    (["--heldout-only"], r"--plan and --heldout-only each print something and exit: give one"),
])
def test_what_a_run_cannot_do_is_refused_by_plan(tmp_path, capsys, arguments, message):
    import train_heads

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(run_recipe(tmp_path)))
    with pytest.raises(SystemExit) as exit_info:
        train_heads.main(["--config", str(recipe), "--plan", *arguments])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_heads_folder_as_the_model_is_refused_by_plan(tmp_path, capsys):
    """transformers' "Unrecognized model ... Should have a `model_type` key" named neither the heads nor the fix."""
    import train_heads

    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({"num_heads": 2, "hidden_size": 8, "base_model_name_or_path": "x"}))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(run_recipe(tmp_path)))
    with pytest.raises(SystemExit) as exit_info:
        train_heads.main(["--config", str(recipe), "--plan", f"model.name={heads}"])
    assert exit_info.value.code == 2
    assert f"{heads} is a Medusa heads folder (its config.json has no model_type), not a base model: pass the base " \
           "model's folder" in capsys.readouterr().err


def test_upload_without_a_hub_login_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    import train_heads
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(run_recipe(tmp_path)))
    with pytest.raises(SystemExit):
        train_heads.main(["--config", str(recipe), "--push-to-hub", "me/heads"])
    assert "uploading to me/heads needs a Hub login" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_distill_options_take_dotted_overrides_converted_to_their_types(tmp_path):
    from medusa_train.distill import recipe_config

    config = config_from_dict(run_recipe(tmp_path), ["data.distill_options.backend=openai",
                                                     "data.distill_options.endpoint=http://127.0.0.1:8000",
                                                     "data.distill_options.concurrency=32"])
    made = recipe_config(config)
    assert (made.backend, made.endpoint, made.concurrency) == ("openai", "http://127.0.0.1:8000", 32)
    assert made.max_new_tokens == 32 and made.n == 10 and made.save_hidden is False
    # a string the recipe quotes stays that string (it was parsed as YAML a second time: '0123' became 83)
    quoted = yaml.safe_load(yaml.safe_dump(run_recipe(tmp_path, distill_options={
        "backend": "openai", "endpoint": "http://127.0.0.1:8000", "endpoint_model": "0123", "api_key_env": "yes"})))
    made = recipe_config(config_from_dict(quoted))
    assert (made.endpoint_model, made.api_key_env) == ("0123", "yes")
    # a list of ids on the command line (it was read as a file's name, then refused as no file)
    listed = recipe_config(config_from_dict(run_recipe(tmp_path), ["data.distill_options.exclude_ids=[a:0, 7]"]))
    assert listed.exclude_ids == ["a:0", "7"]


def test_a_yaml_boolean_for_a_text_setting_is_refused():
    """`push_to_hub: false` in a recipe (meaning: do not upload) became the text "False", and the heads were
    uploaded to a repo of that name; `system_prompt: false` distilled with the system prompt "False"."""
    for section, key in (("eval", "push_to_hub"), ("data", "system_prompt"), ("model", "chat_template")):
        values = {"data": {"prompts": "p.jsonl"}}
        values.setdefault(section, {})[key] = False
        with pytest.raises(ValueError, match=re.escape(f"{section}.{key}: expected a text, got False, a boolean")):
            config_from_dict(values)


def test_per_source_quotas_without_n_are_taken_whole(tmp_path):
    values = run_recipe(tmp_path)
    del values["data"]["n"]
    values["data"]["per_source"] = {"alpha": 6, "beta": 7}
    config = config_from_dict(values)
    assert config.data.n is None and plan(config).examples == 13
    assert config_from_dict(values, ["data.n=13"]).data.n == 13
    with pytest.raises(ValueError, match=r"data.n=12 would cut data.per_source's quotas \(13 prompts in all\)"):
        config_from_dict(values, ["data.n=12"])
    with pytest.raises(ValueError, match=r"quotas must be >= 1, got \{'beta': 0\}"):
        config_from_dict(values, ["data.per_source={alpha: 6, beta: 0}"])


@pytest.mark.parametrize("override, message", [
    ("training.weight_decay=nan", "training.weight_decay: expected a finite number, got 'nan'"),
    ("training.max_grad_norm=nan", "training.max_grad_norm: expected a finite number"),
    ("training.epochs=inf", "training.epochs: expected a finite number, got 'inf'"),
    ("data.n=0", "data.n must be >= 1 (prompts to distil) or null (all of them), got 0"),
    ("data.n=-5", "data.n must be >= 1"),
    ("training.heads_lr=0.01", "training.heads_lr=0.01 applies to training.mode=medusa2 only"),  # it was ignored
    # also ignored, yet part of the run's settings: changing one refused a rerun that would train the same heads
    ("training.kl_weight=0.5", "training.kl_weight=0.5 applies to training.mode=medusa2 only"),
    ("training.gradient_checkpointing=true", "training.gradient_checkpointing=True applies to training.mode=medusa2"),
    ("training.heads_weight_schedule=sine", "training.heads_weight_schedule='sine' applies to training.mode=medusa2"),
    # these failed only once training started (after distillation), or trained an adapter scaled by 0
    ("lora.alpha=0", "lora.alpha must be >= 1, got 0"), ("lora.dropout=1.5", "lora.dropout must be in [0, 1), got 1.5"),
])
def test_non_finite_numbers_and_empty_samples_are_refused(override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(RECIPES / "smollm2-135m.yaml", override.split())


def test_mixed_precision_no_unquoted(tmp_path):
    """YAML reads an unquoted ``no`` as false: the documented value was refused, and so was null."""
    assert load_config(RECIPES / "smollm2-135m.yaml", ["training.mixed_precision=no"]).training.mixed_precision == "no"
    recipe = tmp_path / "r.yaml"
    recipe.write_text((RECIPES / "smollm2-135m.yaml").read_text() + "\n")
    values = yaml.safe_load(recipe.read_text())
    values["training"]["mixed_precision"] = False  # what `mixed_precision: no` reads as
    assert config_from_dict(values).training.mixed_precision == "no"


def test_resume_fingerprint_covers_what_the_features_were_made_from():
    from medusa_train.trainer import resume_fingerprint

    base = load_config(RECIPES / "smollm2-135m.yaml")
    for override in ("features.dtype=bfloat16", "features.from_distillation=false", "features.shard_examples=64"):
        assert resume_fingerprint(load_config(RECIPES / "smollm2-135m.yaml", [override])) != resume_fingerprint(base)


def test_a_checkpoint_from_before_shard_examples_was_recorded_resumes_with_its_own_setting(monkeypatch):
    """The setting read as the default where a checkpoint does not record it: one written with 64 shards'
    worth of examples was refused by its own recipe ("was 256, now 64"); the feature cache's hash decides."""
    import medusa_train.trainer as tr

    monkeypatch.setattr(tr, "weights_identity", lambda name: None)
    config = load_config(RECIPES / "smollm2-135m.yaml", ["features.shard_examples=64"])
    fingerprint = tr.resume_fingerprint(config, None)
    state = {"world_size": 1, "grad_accum": config.training.grad_accum, "fingerprint": fingerprint}
    expected, found = tr._resume_settings(config, state, 1)
    assert expected["features.shard_examples"] == found["features.shard_examples"] == 64
    del fingerprint["features"]["shard_examples"]  # as written before the key was
    expected, found = tr._resume_settings(config, state, 1)
    assert expected == found


def test_plan_shows_the_accumulation_and_is_printed_once_per_launch(tmp_path, capsys, monkeypatch):
    values = run_recipe(tmp_path)
    out = plan_output(capsys, tmp_path, values, "training.grad_accum=3")
    assert re.search(r"x 1 process\(es\) x 3 accumulation = ", out)
    monkeypatch.setenv("RANK", "1")  # another process of an accelerate launch: the first one prints it
    assert plan_output(capsys, tmp_path, values) == ""


def test_the_last_epoch_lends_no_micro_batches_to_a_step_it_does_not_fill(tmp_path):
    """12 micro-batches an epoch, 8 a step: one epoch is one step (the second one took 4 micro-batches of a
    second epoch, so `epochs: 1` trained 64 examples of 51, 15 of them twice)."""
    from medusa_train.train_config import step_counts

    def steps(units, **training):
        config = config_from_dict({"output_dir": str(tmp_path), "data": {"rows": str(tmp_path / "rows.jsonl")},
                                   "training": {"batch_tokens": 4, **training}})
        return step_counts(config, units, 1)[2]

    assert steps(51, epochs=1, grad_accum=8) == 1
    assert steps(51, epochs=2, grad_accum=8) == 3  # 24 micro-batches: the third step crosses the epochs
    assert steps(48, epochs=1, grad_accum=4) == 3
    assert steps(400, epochs=0.29, grad_accum=1) == 29  # 0.29 x 100 is 28.999... as a float
    assert steps(51, epochs=1, grad_accum=8, max_steps=5) == 5
    with pytest.raises(ValueError, match=r"0 optimizer steps \(1 epoch\(s\) of 3 micro-batches, grad_accum 4"):
        steps(12, epochs=1, grad_accum=4)


@pytest.mark.parametrize("targets, message", [
    ("[q_proj,lm_head]", r"select \['lm_head'\], the embeddings the heads read directly"),
    ("[q_proj,v_prj]", r"\['v_prj'\] match no module of LlamaForCausalLM"),
    ("[q_proj,mlp]", r"select \['model.layers.0.mlp \(LlamaMLP\)'.*which LoRA cannot adapt"),
    ("[input_layernorm]", r"\(LlamaRMSNorm\)'.*which LoRA cannot adapt"),
])
def test_lora_targets_are_checked_by_plan_on_a_model_folder(tmp_path, capsys, targets, message):
    import train_heads
    from tiny import tiny_model

    tiny_model("llama").save_pretrained(tmp_path / "model")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(run_recipe(tmp_path)))
    arguments = [f"model.name={tmp_path / 'model'}", "training.mode=medusa2", f"lora.target_modules={targets}"]
    assert train_heads.main(["--config", str(recipe), "--plan", *arguments[:2]]) == 0
    with pytest.raises(SystemExit) as exit_info:
        train_heads.main(["--config", str(recipe), "--plan", *arguments])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_script_errors_end_with_the_message_of_a_bad_input_and_keep_a_bugs_traceback():
    import train_heads

    with pytest.raises(SystemExit, match="train_heads.py: error: 3 rows are too few"):
        with train_heads.script_errors():
            raise ValueError(
                "3 rows are too few")  # a statement over several lines, as most of ours are
    for damaged in ('{"step": 3, "lo', "", b"\xff".decode):  # a file cut or corrupted: the message alone
        with pytest.raises(SystemExit, match="train_heads.py: error: "):
            with train_heads.script_errors():
                json.loads(damaged) if isinstance(damaged, str) else damaged()
    with pytest.raises(ValueError, match="not enough values to unpack"):  # not a SystemExit
        with train_heads.script_errors():
            vocab, hidden = torch.Size([0])


TEMPLATED_RECIPES = [p for p in TRAINING_RECIPES if (yaml.safe_load(p.read_text())["model"] or {}).get("chat_template")]


def _render(path: Path, messages: list[dict], **extra) -> str:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = yaml.safe_load(path.read_text())["model"]["chat_template"]
    return _compile_jinja_template(template).render(messages=messages, bos_token="<s>", eos_token="</s>", **extra)


def test_the_recipes_that_give_a_chat_template_are_found():
    assert {p.stem for p in TEMPLATED_RECIPES} >= {"gemma3-270m", "vicuna-7b-v1.3-medusa1", "vicuna-7b-v1.3-medusa2"}


@pytest.mark.parametrize("path", TEMPLATED_RECIPES, ids=lambda p: p.stem)
def test_a_recipes_chat_template_writes_the_bos_its_model_was_trained_with(path):
    """Text rendered by a chat template is tokenised without special tokens (the template writes its own
    BOS, ``dataset.encode_rendered``), so a recipe's template must begin with the model's BOS."""
    assert _render(path, [{"role": "user", "content": "Hi"}], add_generation_prompt=True).startswith("<s>")


@pytest.mark.parametrize("path", [p for p in TEMPLATED_RECIPES if p.stem.startswith("vicuna")], ids=lambda p: p.stem)
def test_vicuna_recipes_render_fastchats_v1_1_conversation(path):
    """FastChat's vicuna_v1.1: ``system + " "``, then ``role + ": " + message`` closed by " " after a user
    turn and "</s>" after an assistant one, and "ASSISTANT:" to prompt; its tokenizer adds BOS."""
    system = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
              "helpful, detailed, and polite answers to the user's questions.")
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "2+2?"}]
    assert _render(path, turns, add_generation_prompt=True) == (
        f"<s>{system} USER: Hi ASSISTANT: Hello!</s>USER: 2+2? ASSISTANT:")
    assert _render(path, [{"role": "system", "content": "Be brief."}, *turns[:2]]) == (
        "<s>Be brief. USER: Hi ASSISTANT: Hello!</s>")


def test_a_medusa2_recipe_without_lora_targets_is_refused_when_it_loads():
    with pytest.raises(ValueError, match=r"lora.target_modules is empty: Medusa-2 adapts those modules"):
        load_config(RECIPES / "smollm2-135m.yaml", ["training.mode=medusa2", "lora.target_modules=[]"])


def test_overrides_go_before_and_after_the_flags(tmp_path, capsys):
    import train_heads

    out = tmp_path / "run"
    assert train_heads.main(["--config", str(RECIPES / "smollm2-135m.yaml"), f"output_dir={out}", "--plan",
                             "data.n=40"]) == 0
    printed = capsys.readouterr().out
    assert "answers 40 prompts" in printed and str(out) in printed


def test_a_logger_whose_package_is_missing_is_refused_by_plan(tmp_path, capsys, monkeypatch):
    """accelerate leaves out a tracker whose package is missing with a debug message only: the GPU
    recipes' log.tensorboard would log nowhere."""
    import accelerate.utils

    import train_heads

    monkeypatch.setattr(accelerate.utils, "is_tensorboard_available", lambda: False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(run_recipe(tmp_path)))
    assert train_heads.main(["--config", str(recipe), "--plan"]) == 0
    with pytest.raises(SystemExit) as exit_info:
        train_heads.main(["--config", str(recipe), "--plan", "log.tensorboard=true"])
    assert exit_info.value.code == 2
    assert "log.tensorboard=true logs through the tensorboard package, which is not installed" in \
        capsys.readouterr().err


def test_heads_count_as_evaluated_beside_the_final_heads_they_came_from_only(tmp_path):
    """heads/ without a record of its examples beside a final with one is an earlier release's heads of an
    earlier training (heads copy their final's record): it was kept."""
    from medusa_train.train_config import heads_from_final, run_paths

    paths = run_paths(config_from_dict({"output_dir": str(tmp_path / "run"), "data": {"prompts": "p.jsonl"}}))
    for folder in (paths.final, paths.heads):
        folder.mkdir(parents=True)

    def write(final, heads):
        for folder, training in ((paths.final, final), (paths.heads, heads)):
            (folder / "config.json").write_text(json.dumps({"training": training}))

    for final, heads, evaluated in (({"train_examples_sha256": "a"}, {"train_examples_sha256": "a"}, True),
                                    ({"train_examples_sha256": "b"}, {"train_examples_sha256": "a"}, False),
                                    ({"train_examples_sha256": "a"}, {}, False),
                                    ({}, {}, True)):  # both from before the record
        write(final, heads)
        assert heads_from_final(paths) == evaluated, (final, heads)
    (paths.heads / "config.json").write_text("{")
    assert not heads_from_final(paths)


def test_plan_counts_the_prompts_the_run_samples_and_names_a_source_not_in_the_file(tmp_path, capsys):
    """The plan counted data.n examples whatever the quotas or the prompts file held (1600 where the run
    would answer one prompt), so its checks passed (a split with nothing held out, batches the data could
    not fill) and the run failed after distilling; a misspelled source in the quotas passed it too."""
    import train_heads

    values = run_recipe(tmp_path)  # 20 prompts, 10 of each source
    out = plan_output(capsys, tmp_path, values, "data.n=100", "data.per_source={alpha: 3, beta: 4}")
    assert re.search(r"examples\s+7 \(", out), out
    out = plan_output(capsys, tmp_path, values, "data.n=100", "data.per_source=null")
    assert re.search(r"examples\s+20 \(", out), out
    out = plan_output(capsys, tmp_path, values, "data.n=5", "data.distill_options.exclude_ids=[p0, p1]")
    assert re.search(r"examples\s+5 \(", out), out
    recipe = tmp_path / "recipe.yaml"
    for overrides, message in ((["data.per_source={alpah: 3}"], "per_source names sources not in"),
                               (["data.per_source={alpha: 1}"], r"1 example\(s\) cannot be split")):
        with pytest.raises(SystemExit) as exit_info:
            train_heads.main(["--config", str(recipe), "--plan", *overrides])
        assert exit_info.value.code == 2 and re.search(message, capsys.readouterr().err), overrides


@pytest.mark.parametrize("override, message", [
    # head k weighs head_decay**k: at 0 every head past the first had a weight of 0, trained on nothing, in silence
    ("training.head_decay=0", "training.head_decay must be in (0, 1], got 0"),
    # a warm-up over the whole run: the learning rate rose to its last step and never decayed
    ("training.warmup_ratio=1", "training.warmup_ratio must be in [0, 1), got 1"),
    ("heads.reduced_vocab_size=1", "heads.reduced_vocab_size must be >= 2 or null, got 1"),
    # read by Medusa-2 only, and part of the run's settings (a change refused a re-run of a run it never changed)
    ("training.stage1_steps=2", "training.stage1_steps applies to training.mode=medusa2 only"),
    # refused later as "0 optimizer steps ... raise training.epochs", naming a setting max_steps overrides
    ("training.max_steps=0", "training.max_steps must be >= 1 or null, got 0"),
])
def test_bad_training_values_at_their_bounds_are_refused(override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(RECIPES / "smollm2-135m.yaml", [override])


def test_a_date_like_value_stays_text_and_bytes_that_are_not_utf8_are_named(tmp_path):
    """`output_dir: 2024-06-01` (a run folder named by its date) was a datetime.date, and the recipe a TypeError
    traceback; a recipe saved in Latin-1 was a bare codec error naming neither file nor line."""
    recipe = tmp_path / "dated.yaml"
    recipe.write_text("output_dir: 2024-06-01\ndata:\n  prompts: p.jsonl\n")
    assert load_config(recipe).output_dir == "2024-06-01"
    assert load_config(None, ["data.prompts=p.jsonl", "output_dir=2024-06-01"]).output_dir == "2024-06-01"
    recipe.write_text("data:\n  prompts: p.jsonl\nmodel:\n  name: x\noutput_dir: !!timestamp 2024-06-01\n")
    with pytest.raises(ValueError, match="the recipe's output_dir holds a value no setting takes .*date"):
        load_config(recipe)
    recipe.write_bytes("data:\n  prompts: p.jsonl  # caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape(f"recipe {recipe}:2 is not UTF-8 text") + ".*save it as UTF-8"):
        load_config(recipe)


def _ready_file(tmp_path, examples):
    ready = tmp_path / "ready.jsonl"
    ready.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return ready


def test_plan_bounds_sequences_by_the_training_splits_labels(tmp_path):
    """features off: the token estimate is the training split's labelled tokens, not all examples' (M4)."""
    long = [{"input_ids": list(range(600)), "labels": [-100] * 10 + list(range(10, 600))} for _ in range(4)]
    prompt_only = {"input_ids": list(range(40)), "labels": [-100] * 30 + list(range(30, 40))}
    ready = _ready_file(tmp_path, long + [prompt_only])
    config = config_from_dict({"output_dir": str(tmp_path / "run"), "features": {"enabled": False},
                               "data": {"tokenized": str(ready), "heldout_fraction": 0.25, "max_length": 700},
                               "training": {"batch_size": 1}})
    # split_indices(5, 0.25, seed) holds out example 2 (a long one): 3 x 590 + 10 labels train
    assert plan(config).est_train_tokens == 3 * 590 + 10


def test_plan_refuses_a_training_split_with_no_head_position(tmp_path):
    """Answers of one token give the heads no position: the plan refuses as the run would, naming why (M6)."""
    one = {"input_ids": list(range(20)), "labels": [-100] * 19 + [19]}
    ready = _ready_file(tmp_path, [one] * 4)
    config = config_from_dict({"output_dir": str(tmp_path / "run"),
                               "data": {"tokenized": str(ready), "heldout_fraction": 0.25, "max_length": 64},
                               "training": {"batch_tokens": 1}})
    with pytest.raises(ValueError, match="none of the 3 training examples has two answer tokens"):
        plan(config)


def test_left_out_names_a_single_position(tmp_path):
    """One position past the last micro-batch is left out too, and said (M1)."""
    from medusa_train.train_config import left_out

    config = config_from_dict({"output_dir": str(tmp_path / "run"), "data": {"prompts": str(tmp_path / "p.jsonl")},
                               "training": {"batch_tokens": 100, "epochs": 1}})
    assert left_out(config, 1001, 1).startswith("each epoch leaves out 1 of its 1001 positions")


def test_scripts_load_the_base_model_an_export_names(tmp_path, capsys):
    """Five scripts read config.json's base_model_name_or_path, which in an export of a default model's heads is
    the original Hub id, not the GGUF-derived model medusa-forge loads (medusa_forge_base_model): offline they
    failed, online they would have measured the heads on other weights. bench_datastore took methods that never
    search its datastore, and reported their noise as its effect."""
    import importlib.util
    import subprocess
    import sys

    from medusa_infer.model import MedusaModel
    from tiny import tiny_model

    model = MedusaModel.from_base(tiny_model("llama"), num_heads=2)
    model.config.base_model_name_or_path = "smollm2-135m-instruct"
    folder = model.export_medusa_layout(tmp_path / "fd")
    assert json.loads((folder / "config.json").read_text())["base_model_name_or_path"] != "smollm2-135m-instruct"
    script = (ROOT / "scripts" / "gpu_bench.sh").read_text()
    line = next(line for line in script.splitlines() if line.startswith("MODEL=${MODEL:-$("))
    command = line.removeprefix("MODEL=${MODEL:-$(").rstrip("\\ ") + f' "{folder}"'
    named = subprocess.run(["bash", "-c", command.replace('"$PYTHON"', sys.executable)], capture_output=True,
                           text=True, timeout=120)
    assert named.stdout.strip() == "smollm2-135m-instruct", named.stderr[-1000:]
    for name in ("bf16_divergence", "gpu_sdpa_probe", "datastore_confidence", "heads_by_category"):
        assert "base_model_name(" in (ROOT / "scripts" / f"{name}.py").read_text(), name
    spec = importlib.util.spec_from_file_location("bench_datastore", ROOT / "scripts" / "bench_datastore.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit):
        module.main(["--heads", str(folder), "--methods", "hf,lookup"])
    assert "--methods hf never search the datastore" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.main(["--heads", str(tmp_path / "none")])
    assert f"{tmp_path / 'none'}" in capsys.readouterr().err  # (named, not a traceback)


def test_scripts_name_bad_arguments_not_a_traceback(prompt_set, tmp_path, capsys):
    """make_prompt_set's missing --source was a FileNotFoundError traceback; bench_fallback's --ids of no number a
    ValueError once the model was loaded."""
    import subprocess
    import sys

    with pytest.raises(SystemExit):
        prompt_set.main(["--source", str(tmp_path / "none.jsonl"), "--quota", "a=1", "--output", str(tmp_path / "o")])
    assert f"error: [Errno 2] No such file or directory: '{tmp_path / 'none.jsonl'}'" in capsys.readouterr().err
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_fallback.py"), "--heads", str(tmp_path),
                           "--ids", "82,x"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--ids takes comma-separated whole numbers (question ids), got '82,x'" in \
        done.stderr, done.stderr[-1000:]
    for argv, said in ((["bench_distill.py", "--n", "0"], "--n must be at least 1, got 0"),
                       (["bench_attention.py", "--contexts", "2", "--sizes", "3"],
                        "--sizes must be at least 1 and at most the smallest of --contexts (2)"),
                       (["bench_packing.py", "--rows", "x", "--batches", "0"], "--batches must be at least 1, got 0"),
                       (["bench_fallback.py", "--heads", "h", "--methods", "adaptive,nope"],
                        "--methods: unknown nope; choose from ar, adaptive, one-context, learned, fixed")):
        done = subprocess.run([sys.executable, str(ROOT / "scripts" / argv[0]), *argv[1:]], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and said in done.stderr, (argv, done.stderr[-1000:])
