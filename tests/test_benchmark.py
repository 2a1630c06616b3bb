"""medusa-bench on a tiny model: the protocol, the report's fields, calibration and the CLI."""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from medusa_infer.checkpoint import model_card
from medusa_infer.cpu_kernels import kernel_plans, use_cpu_kernels
from medusa_infer.trees import greedy_tree
from medusa_infer.model import MedusaModel
from medusa_infer.serving.testing import word_tokenizer
from medusa_train import benchmark as bench
from medusa_train.evaluate import walked_tokens_per_step
from tiny import sanitizes_control_tokens
from medusa_train.benchmark import (
    benchmark,
    calibrate,
    head_topk_accuracy,
    interleave_categories,
    load_questions,
    main,
    parse_args,
    report_markdown,
)

QUESTIONS = [
    {"id": 1, "category": "writing", "turns": ["the cat sat on the mat", "and the dog ran"]},
    {"id": 2, "category": "writing", "turns": ["one two three four"]},
    {"id": 3, "category": "qa", "turns": ["is the sun big"]},
    {"id": 4, "category": "qa", "turns": ["see the red house"]},
    {"id": 5, "category": "math", "turns": ["one and two"]},
]


@pytest.fixture(scope="module")
def model() -> MedusaModel:
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2)
    base = AutoModelForCausalLM.from_config(config).eval()
    base.name_or_path = "tiny-llama"
    medusa = MedusaModel.from_base(base, num_heads=4, tokenizer=tokenizer)
    for p in medusa.heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return medusa


def args(**overrides) -> argparse.Namespace:
    """``medusa-bench``'s own parsed defaults with these tests' tiny settings, then ``overrides``."""
    values = vars(parse_args([
        "--questions", "q.jsonl", "--model", "tiny", "--heads", "tiny-heads", "--tree", "tree-8",
        "--methods", "hf,hf-lookup,ar,medusa,medusa-lossless,lookup", "--max-new-tokens", "8",
        "--lookup-tokens", "4",
    ]))
    values["calibrate_context"] = 16  # the tiny model's (the command line takes it with --calibrate only)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_questions_are_balanced_across_categories(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    chosen = load_questions(path, limit=3)
    assert sorted(q["category"] for q in chosen) == ["math", "qa", "writing"]
    assert [q["id"] for q in load_questions(path, exclude_ids=[2, 3])] == [1, 4, 5]
    path.write_text('{"id": 1, "turns": []}\n')
    with pytest.raises(ValueError, match="needs id, category and a non-empty turns"):
        load_questions(path)


@pytest.mark.parametrize("line, message", [
    ('{"id": 7, "category": "qa", "turns": ["hi"],}', "not valid JSON"),
    ('{"id": 7, "category": "qa", "turns": "hi"}', "turns must be a non-empty list of strings, got 'hi'"),
    ('{"id": 7, "category": "qa", "turns": []}', "turns must be a non-empty list of strings, got []"),
    ('{"id": 7, "category": "qa", "turns": ["hi", 3]}', "turns must be a non-empty list of strings"),
    ('{"id": 7, "category": ["qa"], "turns": ["hi"]}', "category must be a string, got ['qa']"),
    ('{"id": [7], "category": "qa", "turns": ["hi"]}', "id must be a string or an integer, got [7]"),
    ('["hi"]', "a question is a JSON object, got list"),
    # a TypeError from the tokenizer once the model had loaded
    ('{"id": 7, "category": "qa", "turns": ["hi", "caf\\udce9 au lait"]}', "turn 2 holds a lone surrogate"),
    ('{"id": 7, "category": "\\ud83d", "turns": ["hi"]}', "category holds a lone surrogate"),
    # questions are left out by id: calibrating on one left out both (and --exclude-ids said 1 and dropped 2)
    ('{"id": "1", "category": "qa", "turns": ["hi"]}', "id '1' is line 1's too; give each question an id of its own"),
])
def test_bad_questions_are_refused_at_load_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(QUESTIONS[0]) + "\n\n" + line + "\n")
    with pytest.raises(ValueError) as caught:
        load_questions(path)
    assert str(caught.value).startswith(f"{path}:3: {message}")


def test_questions_that_are_not_utf8_are_refused_naming_file_and_line(tmp_path):
    """The codec's own message ("'utf-8' codec can't decode byte 0xe9 ...") named neither the file nor the line."""
    path = tmp_path / "q.jsonl"
    first, latin1 = (json.dumps(QUESTIONS[0]) + "\n").encode(), b'{"id": 7, "category": "qa", "turns": ["caf\xe9"]}\n'
    path.write_bytes(first + latin1)
    with pytest.raises(ValueError) as caught:
        load_questions(path)
    at = len(first) + latin1.index(b"\xe9")
    assert str(caught.value) == f"{path}:2 is not UTF-8 text (invalid continuation byte at byte {at}): save it as UTF-8"


def test_report_has_every_field_per_method_and_category(model):
    report = benchmark(model, QUESTIONS, args())
    methods = report["methods"]
    assert list(methods) == ["hf", "hf-lookup", "ar", "medusa", "medusa-lossless", "lookup"]
    for name, row in methods.items():
        assert set(row) >= {"tau", "tokens_per_s", "speedup", "exact", "ttft_s", "tpot_s", "peak_mem_mb"}
        assert row["tokens_per_s"] > 0 and row["peak_mem_mb"] > 0
    assert methods["hf"]["speedup"] == 1.0 and methods["hf"]["tau"] == 1.0
    for greedy in ("hf", "hf-lookup", "medusa", "lookup"):
        assert methods[greedy]["exact"] is True, greedy  # identical to our autoregressive loop
    assert methods["medusa-lossless"]["exact"] is None
    assert methods["medusa"]["tau"] > 1.0
    assert set(report["categories"]) == {"writing", "qa", "math"}
    assert report["settings"]["turns"] == 6
    assert "| medusa |" in report_markdown(report)
    assert report["settings"]["cpu"]  # the hardware the figures were measured on
    # what a second run needs (the seed, the questions drawn, the versions were not recorded) and the
    # measurements per question (only totals were: no spread could be told)
    settings = report["settings"]
    assert settings["question_ids"] == [q["id"] for q in QUESTIONS] and settings["seed"] == 0
    assert set(settings["versions"]) == {"torch", "transformers", "medusa_forge", "commit"}
    assert settings["versions"]["torch"]
    assert settings["category_speed"] == "measured"
    groups = report["groups"]
    assert [g["questions"] for g in groups] == [[q["id"]] for q in QUESTIONS]
    for method, row in methods.items():
        assert sum(g["tokens"][method] for g in groups) == row["tokens"]
        assert sum(g["seconds"][method] for g in groups) == pytest.approx(row["seconds"], abs=0.01)
        # five groups: a bootstrap interval of them would cover the truth far less often than it says
        assert "speedup_ci95" not in row
    assert "No interval for the speedups: 5 groups of questions, fewer than the 25" in report_markdown(report)


def test_methods_take_turns_meeting_each_question_first_and_intervals_need_enough_groups(model, monkeypatch):
    """The baseline always ran first on every question, paying whatever meeting a question first costs, which
    pushed every speedup one way; a 95% interval was given from 2 groups up (covering the truth half the time).
    (Here from 10, to keep the run short: MIN_INTERVAL_GROUPS is 25.)"""
    from medusa_train import benchmark as bench

    monkeypatch.setattr(bench, "MIN_INTERVAL_GROUPS", 10)
    calls = []
    real = bench.Runner.run_batch

    def spy(self, method, conversations, **options):
        if "max_new_tokens" not in options and len(conversations[0]) == 1:  # (not the warm-up's) a first turn
            calls.append(method)
        return real(self, method, conversations, **options)

    monkeypatch.setattr(bench.Runner, "run_batch", spy)
    questions = [{**q, "id": 10 * round + q["id"]} for round in range(2) for q in QUESTIONS]  # 10 questions
    report = benchmark(model, questions, args(methods=["hf", "ar", "medusa"]))
    orders = [calls[i : i + 3] for i in range(0, len(calls), 3)]  # per question, the methods as they met it
    assert len(orders) == 10 and all(sorted(order) == ["ar", "hf", "medusa"] for order in orders)
    assert [order[0] for order in orders] == ["hf", "ar", "medusa"] * 3 + ["hf"]
    assert report["settings"]["method_order"] == "rotated per group"
    for method, row in report["methods"].items():
        assert row["exact"] is True  # answers kept in order whichever method went first
        low, high = row["speedup_ci95"]
        assert low <= high and (method != "hf" or low == high == 1.0)
    assert "In brackets after a speedup: its 95% bootstrap interval" in report_markdown(report)


def test_speedup_intervals_resample_question_groups_paired():
    from medusa_train.benchmark import speedup_intervals

    steady = [{"tokens": {"hf": 10, "x": 10}, "seconds": {"hf": 1.0, "x": 0.5}} for _ in range(26)]
    assert speedup_intervals(steady, ["hf", "x"]) == {"hf": [1.0, 1.0], "x": [2.0, 2.0]}
    # x is twice as fast on half the questions and as fast on the others: the interval spans the mix
    mixed = steady[:13] + [{"tokens": {"hf": 10, "x": 10}, "seconds": {"hf": 1.0, "x": 1.0}} for _ in range(13)]
    low, high = speedup_intervals(mixed, ["hf", "x"])["x"]
    assert 1.0 < low < 4 / 3 < high < 2.0
    # from 25 groups: 10 to 15 covered the truth 89-90% of the time (and were called 95% intervals)
    assert speedup_intervals(steady[:24], ["hf", "x"]) == {} and speedup_intervals(steady, ["x"]) == {}
    assert speedup_intervals(steady[:25], ["hf", "x"])["x"] == [2.0, 2.0]
    assert speedup_intervals(steady[:2], ["hf", "x"], min_groups=2)["x"] == [2.0, 2.0]
    assert speedup_intervals(steady[:1], ["hf", "x"], min_groups=1) == {}
    # a question whose hf answer was empty (EOS first): draws of it alone have no speedup, and their NaN left
    # the sorted draws unordered (an interval [1.484, 1.359], or NaN, which is no JSON)
    empty = {"tokens": {"hf": 0, "x": 3}, "seconds": {"hf": 0.02, "x": 0.02}}
    for groups in ([empty, *mixed[:2]], [empty, steady[0]], [empty, empty]):
        interval = speedup_intervals(groups, ["hf", "x"], min_groups=2)
        assert all(low <= high and low == low for low, high in interval.values()), interval
        json.dumps(interval, allow_nan=False)
    assert speedup_intervals([empty, empty], ["hf", "x"], min_groups=2) == {}


def test_the_report_names_the_commit_of_its_own_checkout_only(tmp_path, monkeypatch):
    """Installed into a folder inside another git repository, the report named that repository's commit."""
    import shutil
    import subprocess

    from medusa_train import benchmark as module

    versions = module.software_versions()
    assert versions["torch"] == torch.__version__ and "medusa_forge" in versions
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=Path(module.__file__).parents[1],
                          capture_output=True, text=True).stdout.strip()
    if head:  # run from a checkout (CI's clone): its commit, marked where files differ from it
        assert versions["commit"].startswith(head)
    other = tmp_path / "project"
    (other / "lib").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(other)], check=True)
    shutil.copytree(Path(module.__file__).parent, other / "lib" / "medusa_train")
    monkeypatch.setattr(module, "__file__", str(other / "lib" / "medusa_train" / "benchmark.py"))
    assert module.software_versions()["commit"] is None


def test_report_names_the_linear_kernels_each_weight_shape_took(model):
    base = copy.deepcopy(model.base_model)
    if not use_cpu_kernels(base, "tuned"):
        pytest.skip("this PyTorch build has no working oneDNN linear kernel")
    report = benchmark(MedusaModel(base, copy.deepcopy(model.heads), model.tokenizer), QUESTIONS[:1],
                       args(methods=["ar"]))
    settings = report["settings"]
    assert settings["linear_kernels"] == "tuned"
    assert settings["kernel_plans"] == {shape: plan.to_dict() for shape, plan in kernel_plans(base).items()}
    assert "32x32" in settings["kernel_plans"] and "measured per weight shape" in report_markdown(report)


def test_calibration_measures_accuracy_and_cost_and_fits_a_tree(model):
    model.config.head_accuracies = heldout = [[0.5] * model.config.top_k] * 4  # as training leaves them
    model.config.path_accuracies = heldout_paths = [[[0], 0.5], [[0, 0], 0.5]]
    model.config.acceptance = {"expected_tokens_per_step_fitted_tree": 1.75, "heldout_positions": [9, 8, 7, 6]}
    result = calibrate(model, QUESTIONS[:2], args())
    config = model.config
    # the training tree's expectation goes with that tree; the held-out counts stay beside training's accuracies
    assert "expected_tokens_per_step_fitted_tree" not in config.acceptance
    assert config.acceptance["heldout_positions"] == [9, 8, 7, 6]
    card = model_card(config)
    assert "## Head accuracy on held-out data at the end of training" in card and "| 1 | 0.500 |" in card
    assert "## Measured head accuracy (greedy answers to 2 questions from q.jsonl)" in card
    # what the figures were measured on is said in words, not listed among them
    assert "Calibrated on 2 questions of `q.jsonl`, which `medusa-bench` leaves out" in card
    assert "calibration_questions" not in card and "| head_accuracies_measured_on |" not in card
    assert config.training["heldout_head_accuracies"] == heldout and config.head_accuracies != heldout
    assert config.training["heldout_path_accuracies"] == heldout_paths and config.path_accuracies != heldout_paths
    assert config.acceptance["head_accuracies_measured_on"] == "greedy answers to 2 questions from q.jsonl"
    assert config.acceptance["calibrated_tree_nodes"] == result["tree_nodes"]
    assert len(config.head_accuracies) == 4 and len(config.head_accuracies[0]) == config.top_k
    assert all(0 <= a <= b <= 1 for row in config.head_accuracies for a, b in zip(row, row[1:]))  # cumulative
    assert config.cost_profile["sizes"][0] == 1
    # forwards over a long context too, as far as the tiny model attends (256 positions) less the largest size timed
    assert config.cost_profile["longer"]["context"] == 256 - 64 and config.cost_profile["context"] == 16
    head_seconds = config.cost_profile["head_seconds"]  # running the first d heads, d = 1..4
    assert len(head_seconds) == 4 and all(t > 0 for t in head_seconds)
    assert result["table"][0]["nodes"] == 0
    assert config.tree is not None and len(config.tree) == result["tree_nodes"]  # empty: plain decoding
    # the tree is fitted to the joint path accuracies stored beside the per-head ones
    paths = config.acceptance_model()
    assert paths == {tuple(p): a for p, a in config.path_accuracies} and paths
    assert max(paths.values()) == max(a for p, a in paths.items() if len(p) == 1)
    sequences = bench.first_turn_answers(model, QUESTIONS[:2], 8)
    walked = head_topk_accuracy(model, sequences, top_k=config.top_k)
    for row in result["table"][1:]:  # each size's best tree within the first row["depth"] heads, decoding's tau
        tree = greedy_tree({p: a for p, a in paths.items() if len(p) <= row["depth"]}, row["nodes"])
        assert row["tau"] == pytest.approx(walked_tokens_per_step(tree, walked), abs=1e-4)

    # a second calibration of heads no training measured: the first one's figures are no training record
    del config.training["heldout_head_accuracies"], config.training["heldout_path_accuracies"]
    first = config.head_accuracies
    calibrate(model, QUESTIONS[2:4], args())
    assert "heldout_head_accuracies" not in config.training and "heldout_path_accuracies" not in config.training
    assert "end of training" not in model_card(config) and config.head_accuracies is not first

    calibrate(model, QUESTIONS[:1], args(calibrate_long_context=0))  # none asked for
    assert "longer" not in config.cost_profile
    calibrate(model, QUESTIONS[:1], args(calibrate_long_context=100))
    assert config.cost_profile["longer"]["context"] == 100
    with pytest.raises(ValueError, match=r"needs 250 \+ 64 positions, but the model attends over 256: measure over a "
                                         r"context between 1 and 192 \(medusa-bench --calibrate-long-context, or 0 "
                                         r"for none\)"):
        calibrate(model, QUESTIONS[:1], args(calibrate_long_context=250))


def test_calibrated_expected_tau_is_greedy_decodings_over_the_calibration_answers(model):
    """The expected tau calibration stores (and its speedup) is decoding's with the fitted tree over the answers it
    measured: the average over every position, which it reported, ran high (1.4274 against 1.3605 decoded)."""
    from medusa_infer.decoding import encode_chat, generate

    model = MedusaModel(model.base_model, copy.deepcopy(model.heads), model.tokenizer)
    questions = [{"id": i, "category": "c", "turns": [text]} for i, text in enumerate(
        ["the cat sat on the mat", "and the dog ran", "one two three four", "is the sun big", "see the red house",
         "one and two"])]
    from medusa_infer import tree_fit

    with pytest.MonkeyPatch.context() as patch:  # a fixed cost profile: the fitted tree must not depend on the load
        patch.setattr(tree_fit, "measure_verify_cost", lambda model, context=0, **kwargs: tree_fit.CostProfile(
            sizes=[1, 2, 8, 64], seconds=[1.0, 1.04, 1.1, 1.3], device="fake", context=context))
        patch.setattr(bench, "measure_head_seconds", lambda model, repeats=20: [])
        result = calibrate(model, questions, args(max_new_tokens=40))
    tree = [tuple(path) for path in model.config.tree]
    assert len(tree) > 4  # (a tree that accepts something)
    tokens = steps = 0
    for question in questions:
        text = encode_chat(model.tokenizer, [{"role": "user", "content": question["turns"][0]}])[0]
        ids = model.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        metrics = generate(model, ids, max_new_tokens=40, tree=tree, adaptive=False).metrics
        tokens, steps = tokens + metrics.step_tokens, steps + metrics.steps
    assert result["expected_tau"] == pytest.approx(tokens / steps, abs=1e-9) != 1.0
    assert model.config.acceptance["calibrated_expected_tau"] == round(tokens / steps, 4)
    chosen = next(row for row in result["table"] if row["nodes"] == len(tree))  # the speedup: over its cost
    assert result["expected_speedup"] == pytest.approx(tokens / steps / chosen["cost_ratio"], rel=1e-3)
    assert chosen["tau"] == round(result["expected_tau"], 4)  # the table's figures are the walked ones
    # trees are ranked by the walked figure: with t(n) 1.44 t(1), the average over positions kept a 43-node tree
    # whose walked speedup was 0.97 (plain decoding, at 1.0, is faster)
    from medusa_infer import tree_fit

    model = MedusaModel(model.base_model, copy.deepcopy(model.heads), model.tokenizer)
    torch.manual_seed(0)
    for param in model.heads.parameters():
        torch.nn.init.normal_(param, std=0.3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tree_fit, "measure_verify_cost", lambda model, context=0, **kwargs: tree_fit.CostProfile(
            sizes=[1, 2, 64], seconds=[1.0, 1.44, 1.441], device="fake", context=context))
        patch.setattr(bench, "measure_head_seconds", lambda model, repeats=20: [])
        result = calibrate(model, questions, args(max_new_tokens=40))
    assert result["expected_speedup"] >= 1.0 and all(row["speedup"] <= result["expected_speedup"]
                                                     for row in result["table"])


def test_a_system_prompt_opens_every_conversation_calibrations_too(model, monkeypatch):
    """Heads trained with a recipe's data.system_prompt were only ever measured without it: --system-prompt opens
    the benchmark's, the warm-up's, the context check's and calibration's conversations, and is recorded; the
    card of heads trained with one names it."""
    from medusa_infer import chat

    rendered: list[list[dict]] = []
    real = chat.encode_chat  # (every chat the benchmark encodes is rendered by it: chat.chat_prompt_ids)
    monkeypatch.setattr(chat, "encode_chat", lambda tokenizer, chats, *a, **k: (
        rendered.extend([chats] if isinstance(chats[0], dict) else chats), real(tokenizer, chats, *a, **k))[1])
    model = MedusaModel(model.base_model, copy.deepcopy(model.heads), model.tokenizer)
    calibrate(model, QUESTIONS[:1], args(system_prompt="be brief"))
    report = benchmark(model, QUESTIONS[:2], args(methods=["hf", "ar"], system_prompt="be brief"))
    assert rendered and all(chat[0] == {"role": "system", "content": "be brief"} for chat in rendered)
    assert sum(chat[1]["content"] == QUESTIONS[1]["turns"][0] for chat in rendered) >= 3  # fit, hf, ar
    assert report["settings"]["system_prompt"] == "be brief"
    assert model.config.acceptance["head_accuracies_measured_on"].endswith(", opened by the system prompt 'be brief'")
    rendered.clear()
    benchmark(model, QUESTIONS[:1], args(methods=["ar"]))
    assert rendered and all(chat[0]["role"] == "user" for chat in rendered)  # none by default
    model.config.training = {"recipe": {"data": {"system_prompt": 'say "hi"'}}}
    assert 'opened by the system prompt "say \\"hi\\"" (`data.system_prompt`)' in model_card(model.config)
    model.config.training["recipe"]["data"]["tokenized"] = "examples.jsonl"  # ready examples: the setting unread
    assert "trained on conversations opened by the system prompt" not in model_card(model.config)


def test_a_system_prompt_the_template_refuses_and_a_first_group_failure_are_named(model, tmp_path, monkeypatch,
                                                                                  capsys):
    """A chat template that refuses a system role (Gemma's) ended the run in a jinja2 traceback; a method failing
    in the first group was named nowhere, and one failing later left no traceback of a bug."""
    heads, questions = cli_files(model, tmp_path, monkeypatch)
    questions = questions.rename(tmp_path / "named.jsonl")  # (none left out as the heads' calibration questions)
    common = ["--heads", str(heads), "--questions", str(questions), "--max-new-tokens", "4", "--device", "cpu",
              "--methods", "hf,ar", "--output", str(tmp_path / "out")]
    template = model.tokenizer.chat_template
    monkeypatch.setattr(model.tokenizer, "chat_template", "{% for m in messages %}{% if m['role'] == 'system' %}"
                        "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }} {% endfor %}")
    assert main(common + ["--system-prompt", "be brief"]) == 2
    assert "--system-prompt: the chat template refuses a system message (System role not supported): " \
           "leave --system-prompt out" in capsys.readouterr().err
    # one that wants a system message first, and a tokenizer with no template (advice for library callers)
    monkeypatch.setattr(model.tokenizer, "chat_template", "{% if messages[0]['role'] != 'system' %}{{ raise_exception("
                        "'a system message must come first') }}{% endif %}{% for m in messages %}{{ m['content'] }} "
                        "{% endfor %}")
    assert main(common) == 2
    assert "the chat template wants a system message first (a system message must come first): give " \
           "--system-prompt" in capsys.readouterr().err
    monkeypatch.setattr(model.tokenizer, "chat_template", None)
    assert main(common) == 2
    err = capsys.readouterr().err
    assert "medusa-bench asks its questions in the chat template, and tiny-llama's tokenizer has none" in err
    assert "prompt=" not in err
    monkeypatch.setattr(model.tokenizer, "chat_template", template)
    real = bench.Runner.run_batch

    def run_batch(self, method, conversations, **kwargs):
        if method == "ar" and kwargs.get("max_new_tokens") is None:
            if conversations[0][0]["content"] == QUESTIONS[0]["turns"][0]:
                raise ValueError("shape mismatch in tree verify")
            if conversations[0][0]["content"] == QUESTIONS[2]["turns"][0]:
                None + 1  # a bug, in a later group
        return real(self, method, conversations, **kwargs)

    monkeypatch.setattr(bench.Runner, "run_batch", run_batch)
    assert main(common) == 2
    assert "medusa-bench: error: method ar: shape mismatch in tree verify" in capsys.readouterr().err
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS[1:] + QUESTIONS[:1]) + "\n")
    assert main(common) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "None + 1" in err
    assert "failed (method ar on question(s) 3: TypeError: unsupported operand" in err

    def fails_always(self, method, conversations, **kwargs):  # (warm-up included: it failed there, unnamed)
        if method == "ar":
            raise ValueError("shape mismatch in tree verify")
        return real(self, method, conversations, **kwargs)

    monkeypatch.setattr(bench.Runner, "run_batch", fails_always)
    assert main(common) == 2
    assert "medusa-bench: error: method ar: shape mismatch in tree verify" in capsys.readouterr().err


def test_flags_the_heads_do_not_use_and_unknown_excluded_ids_are_refused(model, tmp_path, monkeypatch, capsys):
    """A datastore that does not load stopped methods that never search it (and --no-datastore was refused for
    them); --lookup-max-tokens and --step-costs profile on heads with no cost profile were recorded as if they had
    applied; an --exclude-ids id no question has left the one meant in, the report saying it was left out."""
    monkeypatch.setattr(model.config, "cost_profile", None)  # uncalibrated heads (an earlier test may calibrate)
    monkeypatch.setattr(model.config, "head_accuracies", None)
    heads, questions = cli_files(model, tmp_path, monkeypatch)
    questions = questions.rename(tmp_path / "named.jsonl")
    (heads / "datastore.safetensors").write_bytes(b"cut short")
    common = ["--heads", str(heads), "--questions", str(questions), "--limit", "1", "--max-new-tokens", "3",
              "--output", str(tmp_path / "out")]
    assert main([*common, "--methods", "hf,medusa"]) == 0
    assert json.loads((tmp_path / "out" / "report.json").read_text())["settings"]["datastore_tokens"] == 0
    assert main([*common, "--methods", "hf,lookup"]) == 2
    assert "is not a readable datastore" in capsys.readouterr().err
    assert main([*common, "--methods", "hf,lookup", "--no-datastore"]) == 0
    (heads / "datastore.safetensors").unlink()
    for flags, message in (
            (["--methods", "hf,lookup", "--lookup-max-tokens", "1"],
             "--lookup-max-tokens bounds the drafts a cost profile chooses, and the heads in .* carry no cost profile"),
            (["--methods", "hf,medusa", "--step-costs", "profile"],
             "--step-costs profile sets what the adaptive fallback learns, and no fallback runs on these heads"),
            (["--methods", "hf,ar", "--exclude-ids", f"{QUESTIONS[0]['id']},8l"],
             "--exclude-ids names 8l, which no question of .*named.jsonl has")):
        assert main([*common, *flags]) == 2, flags
        assert re.search(message, capsys.readouterr().err), flags


def test_questions_whose_text_holds_line_separators_are_read(tmp_path):
    """JSON keeps U+2028, U+2029 and U+0085 unescaped in strings (ensure_ascii=False writes them so): the lines
    were split there, and such a question refused as invalid JSON."""
    path = tmp_path / "q.jsonl"
    text = "a\u2028b\u2029c\x85d"
    path.write_text("".join(json.dumps({"id": i, "category": "w", "turns": [text]}, ensure_ascii=False) + "\r\n"
                            for i in (1, 2)), encoding="utf-8")
    assert [q["turns"] for q in bench.read_questions(path)] == [[text], [text]]


def test_spec_bench_own_question_file_names_its_ids_question_id(tmp_path):
    """Spec-Bench's data/spec_bench/question.jsonl (and MT-Bench's) name a question's id question_id: the file was
    refused as "missing ['id']"."""
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Compose a post.", "Again."]})
                    + "\n" + json.dumps({"question_id": 82, "category": "math", "turns": ["2 + 2?"]}) + "\n")
    assert bench.read_questions(path) == [{"id": 81, "category": "writing", "turns": ["Compose a post.", "Again."]},
                                          {"id": 82, "category": "math", "turns": ["2 + 2?"]}]
    assert [q["id"] for q in bench.load_questions(path, exclude_ids=[81])] == [82]


def test_calibration_that_finds_plain_decoding_fastest_keeps_it_through_saving(model, monkeypatch, tmp_path):
    """A calibrated empty tree means plain decoding; it must not read back as "no tree stored",
    which would decode with a default preset, the opposite of what calibration measured. (With a
    tree the fit found worth growing to, the fallback starts plainly and may grow one:
    tests/test_adaptive.py; here the fit found none.)"""
    from medusa_infer import decoding, tree_fit
    from medusa_infer.decoding import generate, resolve_tree

    def plain_is_fastest(paths, cost, *rest, **kwargs):
        return tree_fit.FittedTree([], 1.0, 1.0, [{"nodes": 0, "tau": 1.0, "cost_ratio": 1.0, "speedup": 1.0}])

    heads = copy.deepcopy(model.heads)
    calibrated = MedusaModel(model.base_model, heads, model.tokenizer)
    monkeypatch.setattr(tree_fit, "fit_tree", plain_is_fastest)
    monkeypatch.setattr(decoding, "fit_tree", plain_is_fastest)  # the fallback's fit, the same one
    result = calibrate(calibrated, QUESTIONS[:1], args())
    assert result["tree_nodes"] == 0 and calibrated.config.tree == []
    calibrated.save_pretrained(tmp_path)
    loaded = MedusaModel.from_pretrained(tmp_path, base_model=model.base_model, tokenizer=model.tokenizer)
    assert loaded.config.tree == [] and resolve_tree(loaded, None) == []
    out = generate(loaded, prompt="the cat sat", max_new_tokens=6, eos_token_id=[])
    assert out.metrics.tau == 1.0 and out.metrics.mean_tree_size == 1.0 and out.metrics.steps == 5


def test_head_accuracy_counts_the_token_d_plus_2_ahead(model):
    """A head that copies its input hidden state is the base head: rank it against the sequence
    the base model generates itself, where head 0's top-1 is right exactly when the token after
    next equals the next token's argmax one position later."""
    seq = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    measured = head_topk_accuracy(model, [(seq, 2)], top_k=10)
    acc = measured.topk()
    assert len(acc) == 4 and all(len(row) == 10 for row in acc)
    assert all(0.0 <= a <= b <= 1.0 for row in acc for a, b in zip(row, row[1:]))  # cumulative
    assert measured.ranks.shape == (len(seq) - 1 - 2, 4)  # positions 1..4 (head 0 has a target)
    for d in range(4):  # the ranks and the accuracies count the same hits
        scored = measured.ranks[: int(measured.totals[d]), d]
        assert acc[d][-1] == pytest.approx(float((scored >= 0).double().mean()), abs=1e-5)
    identity = MedusaModel.from_base(model.base_model, num_heads=1, tokenizer=model.tokenizer)
    with torch.no_grad():
        greedy = model.base_model.generate(seq[None], max_new_tokens=12, do_sample=False, eos_token_id=None,
                                           pad_token_id=0)[0]
    acc = head_topk_accuracy(identity, [(greedy, len(seq))], top_k=1).topk()
    logits = model.base_model(greedy[None]).logits[0].argmax(-1)
    positions = range(len(seq) - 1, len(greedy) - 2)
    expected = sum(int(logits[t] == greedy[t + 2]) for t in positions) / len(positions)
    assert acc[0][0] == pytest.approx(expected)


def cli_files(model, tmp_path, monkeypatch):
    """The tiny model's heads and the questions as files, and model loading pointed at the tiny model."""
    heads = tmp_path / "heads"
    model.save_pretrained(heads)
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    import medusa_infer.models as models

    monkeypatch.setattr(models, "load_base_model", lambda name, **kw: model.base_model)
    monkeypatch.setattr(models, "load_tokenizer", lambda name, **kw: model.tokenizer)
    return heads, questions


def test_cli_writes_the_report_files(model, tmp_path, monkeypatch):
    heads, questions = cli_files(model, tmp_path, monkeypatch)
    out = tmp_path / "bench"
    assert main(["--heads", str(heads), "--questions", str(questions), "--limit", "3", "--max-new-tokens", "6",
                 "--methods", "hf,ar,medusa", "--tree", "tree-8", "--output", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report["methods"]) == {"hf", "ar", "medusa"}
    assert (out / "report.md").read_text().startswith("# medusa-bench")
    assert (out / "report.png").stat().st_size > 1000


def test_an_interrupted_report_leaves_no_earlier_plot_and_ctrl_c_says_one_line(model, tmp_path, monkeypatch,
                                                                                 capsys):
    """Stopped between its report.json and its plot, a run left the earlier run's report.png (of other questions)
    beside the new report; Ctrl-C ended medusa-bench with a traceback."""
    heads, questions = cli_files(model, tmp_path, monkeypatch)
    out = tmp_path / "bench"
    out.mkdir()
    (out / "report.png").write_bytes(b"an earlier run's plot")
    (out / "report.md").write_text("an earlier run's table")

    def interrupted(report, path):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "report_png", interrupted)
    capsys.readouterr()
    try:
        assert main(["--heads", str(heads), "--questions", str(questions), "--limit", "1", "--max-new-tokens", "3",
                     "--methods", "hf,ar", "--output", str(out)]) == 130
    except KeyboardInterrupt:  # (escaping, it would stop the whole test session)
        pytest.fail("Ctrl-C escaped main() as a traceback")
    err = capsys.readouterr().err
    assert "medusa-bench: interrupted" in err and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]
    assert json.loads((out / "report.json").read_text())["settings"]["questions_answered"] == 1


def test_settings_no_method_ran_with_are_recorded_as_none_and_an_unmeasured_tau_draws_no_bar(model, tmp_path,
                                                                                            monkeypatch):
    """hf and ar alone recorded the heads' tree, the speculation gate and lookup_max_tokens as if they had applied;
    the plot drew a tau no step measured (every turn ending at its first token: null in report.json, - in the
    table) as a bar at 0, below plain decoding's 1."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    heads, questions = cli_files(model, tmp_path, monkeypatch)
    heights = []
    bar = Axes.bar

    def recorded(self, xs, values, *args, **kwargs):
        heights.append(list(values))
        return bar(self, xs, values, *args, **kwargs)

    monkeypatch.setattr(Axes, "bar", recorded)
    out = tmp_path / "bench"
    assert main(["--heads", str(heads), "--questions", str(questions), "--limit", "1", "--max-new-tokens", "1",
                 "--methods", "hf,ar", "--output", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    settings = report["settings"]
    assert settings["tree"] is None and settings["speculation_gate"] is None and settings["lookup_max_tokens"] is None
    assert report["methods"]["ar"]["tau"] is None
    tau_bars = heights[1::2]  # (per method: its tokens/s, then its tau)
    assert tau_bars and all(math.isnan(h) for row in tau_bars for h in row)
    assert main(["--heads", str(heads), "--questions", str(questions), "--limit", "1", "--max-new-tokens", "3",
                 "--methods", "hf,medusa", "--output", str(out)]) == 0
    assert json.loads((out / "report.json").read_text())["settings"]["tree"]  # (medusa ran on it)


def test_an_output_folder_that_cannot_be_written_is_refused_before_any_question(model, tmp_path, monkeypatch,
                                                                                capsys):
    """A read-only --output failed once every question was answered (hours, on a large model), naming
    calibration.json, a file the run never wrote."""
    import errno
    import tempfile

    heads, questions = cli_files(model, tmp_path, monkeypatch)
    answered = []
    monkeypatch.setattr(bench, "benchmark", lambda *a, **k: answered.append(1))

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    capsys.readouterr()
    assert main(["--heads", str(heads), "--questions", str(questions), "--limit", "1", "--max-new-tokens", "3",
                 "--methods", "hf,ar", "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert answered == [] and "Traceback" not in err
    assert f"--output {tmp_path / 'out'}: no file can be written there (Read-only file system)" in err


def test_a_report_that_cannot_be_written_names_its_file_and_leaves_its_table(model, tmp_path, monkeypatch, capsys):
    """A full disk ended the run with "[Errno 27] File too large", naming no file, before the table was printed
    (every answer lost), and left report.json.partial."""
    import errno

    heads, questions = cli_files(model, tmp_path, monkeypatch)
    out = tmp_path / "bench"
    write_text = Path.write_text

    def full_disk(self, *args, **kwargs):
        if self.name == "report.json.partial":
            write_text(self, "{\"half")
            raise OSError(errno.EFBIG, "File too large")
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    capsys.readouterr()
    assert main(["--heads", str(heads), "--questions", str(questions), "--limit", "1", "--max-new-tokens", "3",
                 "--methods", "hf,ar", "--output", str(out)]) == 2
    captured = capsys.readouterr()
    assert "| ar |" in captured.out  # the table
    assert f"medusa-bench: error: {out / 'report.json'} could not be written (File too large): the disk may be full" \
        in captured.err and "Traceback" not in captured.err
    assert list(out.iterdir()) == []


def test_cli_names_an_unsupported_model_without_a_traceback(model, tmp_path, monkeypatch, capsys):
    """check_supported's NotImplementedError (ALiBi, no KV cache, ...) escaped as a traceback, status 1."""
    def unsupported(args, started):
        raise NotImplementedError("BloomForCausalLM (bloom) adds ALiBi")

    heads, questions = cli_files(model, tmp_path, monkeypatch)
    monkeypatch.setattr(bench, "run", unsupported)
    assert main(["--heads", str(heads), "--questions", str(questions), "--methods", "ar",
                 "--output", str(tmp_path / "out")]) == 2
    assert "medusa-bench: error: BloomForCausalLM (bloom) adds ALiBi" in capsys.readouterr().err


def test_cli_without_matplotlib_prints_the_table_and_names_the_plot_extra(model, tmp_path, monkeypatch, capsys):
    """matplotlib is the ``plot`` extra's: a base install's benchmark ended in ModuleNotFoundError after
    running every question, before printing its table."""
    import sys

    heads, questions = cli_files(model, tmp_path, monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it raises ImportError
    out = tmp_path / "bench"
    out.mkdir()
    (out / "report.png").write_bytes(b"an earlier run's plot")  # removed: it would pass for this run's
    assert main(["--heads", str(heads), "--questions", str(questions), "--limit", "1", "--max-new-tokens", "4",
                 "--methods", "ar", "--output", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith("# medusa-bench")
    assert "not drawn: it needs matplotlib: pip install 'medusa-forge[plot]'" in printed.err
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]


def test_heads_from_the_hub_name_their_base_model(model, tmp_path, monkeypatch):
    """``--heads owner/repo`` without ``--model``: the repo is fetched as MedusaModel.from_pretrained
    fetches it (a stand-in for the Hub here) and its config names the base model."""
    heads, questions = cli_files(model, tmp_path, monkeypatch)
    import huggingface_hub

    fetched = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, revision=None, **kw: fetched.append(repo_id) or str(heads))
    out = tmp_path / "hub"
    assert main(["--heads", "someone/tiny-heads", "--questions", str(questions), "--limit", "1",
                 "--max-new-tokens", "4", "--methods", "hf,medusa", "--output", str(out)]) == 0
    assert fetched == ["someone/tiny-heads"]
    assert json.loads((out / "report.json").read_text())["settings"]["heads"] == "someone/tiny-heads"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods", "ar,draft"], "--methods with draft needs --draft-model"),
        (["--methods", "hf,hf-assisted"], "--methods with hf-assisted needs --draft-model"),
        (["--methods", "ar", "--calibrate"], "--calibrate measures the heads and fits their tree: give --heads"),
        (["--methods", "ar", "--heads", "someone/tiny-heads", "--calibrate"],
         "--heads someone/tiny-heads is no local folder (a Hub repo?): add --calibrated-heads DIR"),
        (["--methods", "lookup", "--lookup-tokens", "0"], "--lookup-tokens must be at least 1, got 0"),
        (["--methods", "hf,ar", "--lookup-tokens", "6"], "--methods has none of them"),
        (["--methods", "hf,ar", "--heads", "h", "--tree", "chain-2"], "--tree shapes the medusa methods' candidates, "
                                                                      "and --methods has none of them"),
        (["--methods", "ar", "--limit", "0"], "--limit must be at least 1, got 0"),
        (["--methods", "ar", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
        (["--methods", ""], "--methods is empty; choose from"),
        (["--methods", " , "], "--methods is empty; choose from"),
        (["--methods", "ar,hf,ar"], "--methods names ar more than once"),
        (["--methods", "ar", "--calibrated-heads", "out"], "--calibrated-heads is where --calibrate saves the heads"),
        (["--methods", "medusa", "--heads", "h", "--tree", "[1, 2]"], "--tree '[1, 2]' is no tree"),
        (["--methods", "medusa", "--heads", "h", "--tree", "[[0], [0,"], "--tree '[[0], [0,' is no tree"),
        (["--methods", "ar", "--threads", "-1"], "--threads must be at least 1, got -1"),
        (["--methods", "ar", "--device", "gpu"], "--device 'gpu' is no torch device"),
        (["--methods", "ar", "--heads", "h", "--calibrate", "--calibrated-heads", "out", "--calibrate-context", "0"],
         "--calibrate-context must be at least 1, got 0"),
        (["--methods", "ar", "--heads", "h", "--calibrate", "--calibrated-heads", "out", "--calibrate-questions", "0"],
         "--calibrate-questions must be at least 1, got 0"),
        (["--methods", "ar", "--heads", "h", "--calibrate", "--calibrated-heads", "out", "--calibrate-long-context",
          "-1"], "--calibrate-long-context must be at least 0, got -1"),
        (["--methods", "ar", "--heads", "h", "--calibrate", "--calibrated-heads", "out", "--calibrate-long-context",
          "256"], "--calibrate-long-context 256 must exceed --calibrate-context 256, or be 0"),
        (["--methods", "ar", "--heads", "h", "--calibrate-long-context", "1024"],
         "--calibrate-long-context sets the calibration: add --calibrate"),
        # these were found only after loading the model, or not at all (a NaN budget was no budget, in
        # report.json as NaN, which is no JSON)
        (["--methods", "medusa-lossless", "--heads", "h", "--temperature", "-1"],
         "--temperature must be a finite number > 0"),
        (["--methods", "medusa-lossless", "--heads", "h", "--temperature", "nan"],
         "--temperature must be a finite number > 0"),
        # settings no method run reads (accepted, and recorded in the report as if they had applied)
        (["--methods", "ar,lookup", "--draft-model", "no/such-draft"],
         "--draft-model is read by hf-assisted, draft, and --methods has none of them"),
        (["--methods", "ar,hf-lookup", "--no-datastore"], "--no-datastore is read by lookup, medusa-lookup, and"),
        (["--methods", "ar,lookup", "--no-datastore"], "--no-datastore leaves out the datastore of a heads folder "
                                                       "(its datastore.safetensors), and no --heads is given"),
        (["--methods", "ar", "--lookup-max-tokens", "7"], "--lookup-max-tokens is read by lookup, medusa-lookup"),
        (["--methods", "lookup", "--lookup-max-tokens", "7"], "--lookup-max-tokens bounds the drafts a cost profile "
                                                               "chooses, which calibrated --heads carry, and no"),
        (["--methods", "ar,lookup", "--step-costs", "profile"], "--step-costs profile sets what the adaptive fallback "
                                                                "of medusa and medusa-lookup learns, and --methods"),
        (["--methods", "medusa", "--heads", "h", "--no-fallback", "--step-costs", "profile"],
         "and --no-fallback turns it off: drop it"),
        (["--methods", "ar,lookup", "--temperature", "0.3"],
         "--temperature is read by medusa-typical, medusa-lossless, and --methods has none of them"),
        (["--methods", "ar", "--calibrate-questions", "5"], "--calibrate-questions sets the calibration: add "
                                                            "--calibrate or drop --calibrate-questions"),
        (["--methods", "ar", "--time-budget", "nan"], "--time-budget must be a number of seconds > 0, got nan"),
        (["--methods", "ar", "--time-budget", "-5"], "--time-budget must be a number of seconds > 0, got -5"),
        (["--methods", "medusa", "--heads", "h", "--calibrate", "--calibrated-heads", "out", "--tree", "fitted-x"],
         "--tree 'fitted-x': a fitted tree is fitted-N, N >= 1 nodes"),
        # an OverflowError traceback warming up, a ValueError one from torch.set_num_threads
        (["--methods", "ar", "--batch-size", "99999999999999999999"], "--batch-size must be at most 4096 (rows "
                                                                        "decoded as one batch), got 9999"),
        (["--methods", "ar", "--threads", "99999999999999999999"], "--threads must be at most 4096, got 9999"),
        # empty names read as not given: the report written into the working folder, the default model loaded
        (["--methods", "ar", "--output", ""], "--output is empty (''): name a folder for the report, or leave "
                                              "--output out for runs/bench"),
        (["--methods", "ar", "--model", ""], "--model is empty (''): name the base model"),
        (["--methods", "medusa", "--heads", ""], "--heads is empty ('')"),
    ],
)
def test_bad_arguments_are_refused_before_loading_anything(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (no "h" or "out" folder of the repository's own)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--questions", "q.jsonl"] + argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_hub_heads_are_calibrated_into_a_folder_of_their_own():
    args = parse_args(["--questions", "q.jsonl", "--methods", "ar", "--heads", "someone/tiny-heads", "--calibrate",
                       "--calibrated-heads", "calibrated"])
    assert args.calibrated_heads == "calibrated"


def test_errors_found_while_loading_are_reported_without_a_traceback(tmp_path, capsys):
    from medusa_train.benchmark import main

    questions = tmp_path / "q.jsonl"
    questions.write_text('{"id": 1, "category": "writing", "turns": ["hi"]}\n')
    code = main(["--questions", str(questions), "--heads", str(tmp_path / "no-such-heads"), "--methods", "medusa",
                 "--output", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("medusa-bench: error: no such heads folder") and "Traceback" not in err
    # a questions file that is not there is said before the model loads
    code = main(["--questions", str(tmp_path / "no-such.jsonl"), "--heads", str(tmp_path / "no-such-heads"),
                 "--methods", "medusa", "--output", str(tmp_path / "out")])
    assert code == 2
    assert capsys.readouterr().err.startswith(f"medusa-bench: error: --questions {tmp_path / 'no-such.jsonl'} is not a file")


def test_calibration_leaves_out_a_question_too_long_for_the_context(model, tmp_path, monkeypatch, capsys):
    """The benchmark leaves such questions out; calibration stopped the run on one. Where none is left to benchmark,
    the run stops before calibrating: it had rewritten the heads' folder first (the calibration's questions
    named in it, which later runs left out), then stopped."""
    heads, questions = cli_files(model, tmp_path, monkeypatch)
    with questions.open("a") as handle:
        handle.write(json.dumps({"id": 99, "category": "writing", "turns": ["the cat sat " * 100]}) + "\n")
    before = {p.name: p.read_bytes() for p in heads.iterdir()}
    given = ["--heads", str(heads), "--questions", str(questions), "--methods", "ar", "--calibrate",
             "--calibrate-context", "16", "--max-new-tokens", "4", "--output", str(tmp_path / "out")]
    code = main([*given, "--calibrate-questions", "8", "--exclude-ids", "1,2"])  # 99 alone left to benchmark
    err = capsys.readouterr().err
    assert "leaving out 1 calibration questions whose first turn and 4 new tokens may not fit" in err, err
    assert code == 2 and "no question fits the model's context" in err and "calibrated:" not in err
    assert {p.name: p.read_bytes() for p in heads.iterdir()} == before
    assert not (tmp_path / "out" / "calibration.json").exists()
    code = main([*given, "--calibrate-questions", "4", "--exclude-ids", "1"])  # calibrates on 2, 3, 5 (and 99)
    err = capsys.readouterr().err
    assert "leaving out 1 calibration questions whose first turn and 4 new tokens may not fit" in err, err
    assert code == 0 and "calibrated: tree of" in err, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["settings"]["questions_answered"] == 1 and report["settings"]["turns"] == 1


def test_no_question_left_to_benchmark_is_an_error_not_an_empty_report(model, tmp_path, monkeypatch, capsys):
    heads, questions = cli_files(model, tmp_path, monkeypatch)
    code = main(["--heads", str(heads), "--questions", str(questions), "--methods", "ar", "--exclude-ids",
                 "1,2,3,4,5", "--output", str(tmp_path / "out")])
    assert code == 2 and "no question of" in capsys.readouterr().err
    assert not (tmp_path / "out" / "report.json").exists()
    # ids as written: "01" is no question here ("01" had been read as 1), and an id no question has is refused
    code = main(["--heads", str(heads), "--questions", str(questions), "--methods", "ar", "--exclude-ids",
                 "01,02,03,04,05", "--limit", "1", "--max-new-tokens", "2", "--output", str(tmp_path / "out")])
    assert code == 2 and "--exclude-ids names 01, 02, 03, 04, 05, which no question" in capsys.readouterr().err


def test_questions_and_calibration_are_checked_before_the_work_they_would_waste(model, tmp_path, monkeypatch,
                                                                               capsys):
    """--calibrate taking every question rewrote the heads' folder, then stopped with nothing to benchmark; an
    empty file was blamed on --exclude-ids, no calibration question on --max-new-tokens; a bad row was named
    only after the model loaded (minutes for a 7B one)."""
    import medusa_infer.models as models

    heads, questions = cli_files(model, tmp_path, monkeypatch)
    before = {p.name: p.read_bytes() for p in heads.iterdir()}
    out = tmp_path / "out"
    base = ["--heads", str(heads), "--methods", "ar,medusa", "--max-new-tokens", "2", "--output", str(out)]
    for extra, says in ((["--calibrate", "--calibrate-questions", "5"],
                         "is left to benchmark after the calibration's questions; exclude fewer, or give more "
                         "questions (or fewer --calibrate-questions)"),
                        (["--calibrate", "--exclude-ids", "1,2,3,4,5"], "is left to calibrate on after --exclude-ids")):
        assert main([*base, "--questions", str(questions), *extra]) == 2
        assert says in capsys.readouterr().err
        assert {p.name: p.read_bytes() for p in heads.iterdir()} == before
        assert not (out / "calibration.json").exists()
    tiny = models.load_base_model

    def no_draft(name, **kw):
        if name == "no-such-draft":
            raise ValueError("no-such-draft is not a model folder or Hub repo")
        return tiny(name, **kw)

    monkeypatch.setattr(models, "load_base_model", no_draft)  # a draft model that does not load: before calibrating
    assert main([*base[:2], "--methods", "ar,draft", "--draft-model", "no-such-draft", *base[4:], "--questions",
                 str(questions), "--calibrate", "--calibrate-questions", "2", "--calibrate-context", "16"]) == 2
    assert "no-such-draft is not a model folder" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in heads.iterdir()} == before and not (out / "calibration.json").exists()
    monkeypatch.setattr(models, "load_base_model", tiny)
    # a fitted tree larger than the paths calibration measures: refused after calibrating, before the save (the
    # heads were rewritten, then the run failed); a folder save_pretrained refuses: before the answers
    calibrating = [*base, "--questions", str(questions), "--calibrate", "--calibrate-questions", "2",
                   "--calibrate-context", "16"]
    assert main([*calibrating, "--tree", "fitted-4096"]) == 2
    assert "ask for fitted-" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in heads.iterdir()} == before and not (out / "calibration.json").exists()
    model.base_model.save_pretrained(tmp_path / "a-model")
    from medusa_train import benchmark as bench

    with monkeypatch.context() as patch:
        patch.setattr(bench, "calibrate", lambda *a, **k: pytest.fail("calibrated for a folder it cannot save into"))
        assert main([*calibrating, "--calibrated-heads", str(tmp_path / "a-model")]) == 2
    assert "holds a model's config.json (model_type 'llama')" in capsys.readouterr().err
    (tmp_path / "a-model" / "config.json").unlink()
    (tmp_path / "a-model" / "adapter").mkdir()  # save_pretrained's own refusal: before the answers too
    with monkeypatch.context() as patch:
        patch.setattr(bench, "calibrate", lambda *a, **k: pytest.fail("calibrated for a folder it cannot save into"))
        assert main([*calibrating, "--calibrated-heads", str(tmp_path / "a-model")]) == 2
    assert "holds a Medusa-2 adapter and these heads have none merged" in capsys.readouterr().err
    (out / "calibration.json").write_text("{}")  # an earlier run's: it stays while no run writes a report there
    assert main([*base, "--questions", str(questions), "--exclude-ids", "1,2,3,4,5"]) == 2
    assert (out / "calibration.json").exists()
    capsys.readouterr()
    assert main([*base, "--questions", str(questions), "--limit", "1"]) == 0  # beside a report of a run that
    assert not (out / "calibration.json").exists()  # calibrated not
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main([*base, "--questions", str(empty)]) == 2
    assert "empty.jsonl holds no question" in capsys.readouterr().err
    monkeypatch.setattr(models, "load_base_model", lambda name, **kw: pytest.fail("loaded before the rows were read"))
    empty.write_text('{"id": 1}\n')
    assert main([*base, "--questions", str(empty)]) == 2
    assert "empty.jsonl:1: " in capsys.readouterr().err


def test_recalibrating_heads_an_earlier_release_calibrated_keeps_no_training_record(model, tmp_path, monkeypatch):
    """Calibrations before the head_accuracies_measured_on marker were taken for training's figures: recalibrated,
    their accuracies were filed as training's held-out ones, and the card showed them so."""
    heads, questions = cli_files(model, tmp_path, monkeypatch)
    config = json.loads((heads / "config.json").read_text())
    config.update(head_accuracies=[[0.31, 0.36], [0.2, 0.3]], acceptance={"mean_accepted_tokens": 1.3},
                  cost_profile={"sizes": [1, 2], "seconds": [0.01, 0.012], "head_overhead": 0.1})
    (heads / "config.json").write_text(json.dumps(config))
    assert main(["--heads", str(heads), "--questions", str(questions), "--methods", "ar", "--max-new-tokens", "2",
                 "--calibrate", "--calibrate-questions", "2", "--calibrate-context", "16",
                 "--output", str(tmp_path / "out")]) == 0
    saved = json.loads((heads / "config.json").read_text())
    assert "heldout_head_accuracies" not in saved["training"]
    assert "at the end of training" not in (heads / "README.md").read_text()


@pytest.mark.parametrize("given, expected", [(None, {"hf-lookup": 10, "lookup": 4, "medusa-lookup": 4}),
                                             (7, {"hf-lookup": 7, "lookup": 7, "medusa-lookup": 7})])
def test_lookup_tokens_sets_every_lookup_method(model, monkeypatch, given, expected):
    """One meaning for --lookup-tokens: the draft length of hf-lookup, lookup and medusa-lookup
    alike; not given, each keeps the protocol's length (10 for hf-lookup, 4 for ours)."""
    import medusa_infer.proposers as proposers
    from medusa_infer.proposers.lookup import LookupProposer

    seen: dict[str, int] = {}
    build, hf_generate = proposers.build_proposer, model.base_model.generate

    def spy_build(method, target, options=None):
        proposer = build(method, target, options)
        if isinstance(proposer, LookupProposer):
            seen["lookup"] = proposer.num_tokens
        elif method == "medusa":
            seen["medusa-lookup"] = proposer.lookup_tokens
        return proposer

    def spy_generate(*a, **kw):
        seen["hf-lookup"] = kw["prompt_lookup_num_tokens"]
        return hf_generate(*a, **kw)

    monkeypatch.setattr(proposers, "build_proposer", spy_build)
    monkeypatch.setattr(model.base_model, "generate", spy_generate)
    runner = bench.Runner(model, args(lookup_tokens=given, max_new_tokens=3))
    for method in expected:
        runner.run(method, [{"role": "user", "content": QUESTIONS[0]["turns"][0]}])
    assert seen == expected


RUN_BATCH = bench.Runner.run_batch


def answers_by_turn(monkeypatch, model, batch_size: int, methods: list[str], **overrides) -> tuple[dict, dict]:
    """The report and each method's answer to each (question, turn), recorded as the runner gives them."""
    answers: dict[tuple[str, str, int], list[int]] = {}

    def record(self, method, conversations, **options):
        turns = RUN_BATCH(self, method, conversations, **options)
        if options:  # the untimed warm-up's short answers
            return turns
        for messages, turn in zip(conversations, turns):
            answers[method, messages[0]["content"], len(messages) // 2] = turn.tokens  # turn index from 0
        return turns

    monkeypatch.setattr(bench.Runner, "run_batch", record)
    report = benchmark(model, QUESTIONS, args(methods=methods, batch_size=batch_size, **overrides))
    return report, answers


def test_batch_2_answers_every_question_as_batch_1(model, monkeypatch):
    """Questions 1 and 2 share a batch for their first turns, then question 1's second turn runs
    alone; question 5 is a batch of one. Greedy answers do not depend on the batch."""
    for name in ("head_accuracies", "cost_profile"):  # calibrated by an earlier test: not adaptive here
        monkeypatch.setattr(model.config, name, None)
    methods = ["hf", "ar", "medusa", "lookup"]
    single, one = answers_by_turn(monkeypatch, model, 1, methods)
    # every step speculates, so a row takes the same steps as alone (the tau check below)
    batched, two = answers_by_turn(monkeypatch, model, 2, methods, speculation_gate="off")
    _, gated = answers_by_turn(monkeypatch, model, 2, methods)  # plain steps where speculation measures slower
    assert len(one) == len(two) == len(gated) == 6 * len(methods)
    assert two == one and gated == one
    assert batched["settings"]["batch_size"] == 2 and single["settings"]["batch_size"] == 1
    assert batched["settings"]["turns"] == 6
    for method in methods:
        row = batched["methods"][method]
        assert row["tokens"] == single["methods"][method]["tokens"]
        assert row["tokens_per_s"] > 0 and row["ttft_s"] > 0 and row["tpot_s"] > 0
        if method != "ar":
            assert row["exact"] is True, method
    # tau per row: plain decoding stays 1.0 in a batch, and Medusa's matches batch 1 (same steps per row)
    assert batched["methods"]["ar"]["tau"] == batched["methods"]["hf"]["tau"] == 1.0
    assert batched["methods"]["medusa"]["tau"] == single["methods"]["medusa"]["tau"] > 1.0
    assert "batch size 2" in report_markdown(batched) and "batch size" not in report_markdown(single)
    # a category's speedup at batch 2 is its batches' time shared out by tokens: said so (it read as measured)
    assert batched["settings"]["category_speed"].startswith("apportioned")
    assert "these speedups are apportioned, not measured per category" in report_markdown(batched)
    assert "apportioned" not in report_markdown(single)
    assert [g["questions"] for g in batched["groups"]] == [[q["id"] for q in QUESTIONS[i:i + 2]]
                                                           for i in range(0, len(QUESTIONS), 2)]


def test_a_pad_token_the_model_has_no_embedding_for_pads_nothing_in_the_benchmark(model, monkeypatch):
    """A pad token added to a tokenizer whose model was not resized: every batch of mixed prompt lengths failed,
    ours and generate's (whose finished rows are fed the pad id); padding is masked, any id the model embeds
    serves."""
    tokenizer = copy.deepcopy(model.tokenizer)
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    assert tokenizer.pad_token_id == model.base_model.get_input_embeddings().weight.shape[0]
    monkeypatch.setattr(model, "tokenizer", tokenizer)
    for config in (model.base_model.generation_config, model.base_model.config):
        monkeypatch.setattr(config, "pad_token_id", None)
    chats = [[{"role": "user", "content": q["turns"][0]}] for q in QUESTIONS[:3]]
    runner = bench.Runner(model, args(methods=["hf", "ar"], max_new_tokens=6))
    assert [t.tokens for t in runner.run_batch("hf", chats)] == [t.tokens for t in runner.run_batch("ar", chats)]


@sanitizes_control_tokens
def test_a_question_writing_a_control_token_is_benchmarked_as_generate_and_the_server_read_it(model, monkeypatch):
    """From a review: the server and generate(messages=) read a control token written in a message as its text, the
    benchmark as the token, so it measured other prompts than the ones served."""
    import medusa_infer.decoding as decoding
    from medusa_infer.chat import chat_prompt_ids

    tokenizer = copy.deepcopy(model.tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    monkeypatch.setattr(model, "tokenizer", tokenizer)
    padded, real = [], decoding.left_pad
    monkeypatch.setattr(decoding, "left_pad", lambda rows, pad: (padded.append(rows), real(rows, pad))[1])
    chats = [[{"role": "user", "content": "the cat <|end|> sat"}], [{"role": "user", "content": "the cat"}]]
    bench.Runner(model, args(methods=["ar"], max_new_tokens=2)).run_batch("ar", chats)
    assert padded[0] == chat_prompt_ids(tokenizer, chats)
    assert tokenizer.convert_tokens_to_ids("<|end|>") not in padded[0][0]


def test_batch_seconds_are_counted_once(model, monkeypatch):
    """A batch's wall time goes to its rows in proportion to their tokens, summing to the call's time."""
    runner = bench.Runner(model, args(methods=["ar"], max_new_tokens=6))
    chats = [[{"role": "user", "content": q["turns"][0]}] for q in QUESTIONS[:3]]
    turns = runner.run_batch("ar", chats)
    assert len(turns) == 3
    call = turns[0].call_s
    assert all(t.call_s == call and t.ttft_s == turns[0].ttft_s for t in turns)
    assert sum(t.seconds for t in turns) == pytest.approx(call)
    assert [t.steps for t in turns] == [len(t.tokens) - 1 for t in turns]
    assert all(len(t.tokens) <= 2 for t in runner.run_batch("ar", chats, max_new_tokens=2))


def test_warm_up_runs_each_method_once_at_the_batch_size(model, monkeypatch):
    calls = []
    monkeypatch.setattr(bench.Runner, "run_batch", lambda self, method, chats, max_new_tokens=None:
                        calls.append((method, len(chats), max_new_tokens)))
    import medusa_infer.cpu_kernels as cpu_kernels

    packed = []
    monkeypatch.setattr(cpu_kernels, "pack_planned", lambda m: packed.append(m) or 0)
    bench.warm_up(bench.Runner(model, args()), ["hf", "medusa"], QUESTIONS, 3)
    assert calls == [("hf", 3, 8), ("medusa", 3, 8)]
    assert packed == [model]  # every packed copy first: one short answer meets few of the methods' row counts
    bench.warm_up(bench.Runner(model, args()), ["hf", "ar"], QUESTIONS, 3)
    assert packed == [model, model]  # plain decoding too: another prompt's length may take another kernel


@pytest.mark.parametrize("method", ["hf-lookup", "hf-assisted"])
def test_methods_that_cannot_batch_fail_early(model, method, capsys, monkeypatch):
    monkeypatch.setattr(bench.Runner, "run_batch", lambda *a: pytest.fail("ran before checking the batch size"))
    with pytest.raises(ValueError, match=f"{method} cannot run at --batch-size 2.*--batch-size 1"):
        benchmark(model, QUESTIONS, args(methods=["hf", method], batch_size=2, draft_model="tiny"))
    with pytest.raises(SystemExit):
        main(["--questions", "q.jsonl", "--methods", f"ar,{method}", "--batch-size", "2"])
    error = capsys.readouterr().err
    assert method in error and "drop" in error and "--batch-size 1" in error
    with pytest.raises(SystemExit):
        main(["--questions", "q.jsonl", "--methods", "ar", "--batch-size", "0"])


def test_rows_that_stop_early_keep_their_own_answers(model, monkeypatch):
    """With the pad token among the EOS ids (as when a tokenizer pads with its EOS), a row that
    stops before the others ends at its EOS, in Hugging Face's padded output as in ours."""
    for name in ("head_accuracies", "cost_profile"):
        monkeypatch.setattr(model.config, name, None)
    key = QUESTIONS[0]["turns"][0], 0  # question 1's first turn, batched with question 2's
    _, plain = answers_by_turn(monkeypatch, model, 1, ["ar"])
    first = plain[("ar",) + key]
    cut = next(i for i in range(2, len(first)) if first[i] not in first[:i])  # now its last token
    pad = model.tokenizer.pad_token_id
    monkeypatch.setattr(model.base_model.generation_config, "eos_token_id", [2, first[cut], pad])
    methods = ["hf", "ar", "medusa"]
    _, one = answers_by_turn(monkeypatch, model, 1, methods)
    report, two = answers_by_turn(monkeypatch, model, 2, methods)
    assert one[("ar",) + key] == first[: cut + 1]
    assert len(two["ar", QUESTIONS[1]["turns"][0], 0]) > cut + 1  # its batch mate goes on
    assert two == one
    assert all(report["methods"][m]["exact"] for m in ("hf", "medusa"))


def test_categories_mixed_in_a_batch_count_each_row_in_its_own(model):
    """At batch size 2, a batch of a writing and a qa question filed both answers under the first row's category
    (the test questions shared one category in each batch); with hf and ar both run, ar's answers are the
    reference exact compares with."""
    questions = [{"id": 1, "category": "writing", "turns": ["the cat sat on the mat"]},
                 {"id": 2, "category": "qa", "turns": ["is the sun big"]}]
    report = benchmark(model, questions, args(methods=["hf", "ar"], batch_size=2))
    turns = {category: figures["ar"]["turns"] for category, figures in report["categories"].items()}
    assert turns == {"qa": 1, "writing": 1}
    assert report["settings"]["exact_reference"] == "ar"


def test_time_budget_stops_between_groups_and_keeps_categories_even(model):
    report = benchmark(model, QUESTIONS, args(methods=["ar"], time_budget=0.0))
    s = report["settings"]
    assert s["questions_answered"] == 1 and s["turns"] == 2  # the first group always runs
    assert "Time budget 0 s: 1 questions answered." in report_markdown(report)
    assert [q["id"] for q in interleave_categories(QUESTIONS)] == [1, 3, 5, 2, 4]
    assert interleave_categories([]) == []
    full = benchmark(model, QUESTIONS, args(methods=["ar"], time_budget=1e9))["settings"]
    assert full["questions_answered"] == 5 and full["turns"] == 6


def test_a_method_failing_midway_keeps_the_groups_measured_before_it(model, tmp_path, monkeypatch, capsys):
    """A method failing on a later question (out of memory on a long turn) lost every measurement, and the CLI
    wrote no report; the report now holds the groups measured in full (not the failing group's other answers),
    names the error, and the command fails. An empty question list is named as such (it said to lower
    --max-new-tokens)."""
    with pytest.raises(ValueError, match="^no questions to benchmark$"):
        benchmark(model, [], args(methods=["ar"]))
    real = bench.Runner.run_batch

    def run_batch(self, method, conversations, **kwargs):
        if method == "ar" and conversations[0][0]["content"] == QUESTIONS[2]["turns"][0]:
            raise RuntimeError("CUDA out of memory (simulated)\nmore")
        return real(self, method, conversations, **kwargs)

    monkeypatch.setattr(bench.Runner, "run_batch", run_batch)
    report = benchmark(model, QUESTIONS, args(methods=["hf", "ar"]))
    s = report["settings"]
    # which method failed on which question (only stderr said)
    assert s["stopped_by"] == "method ar on question(s) 3: RuntimeError: CUDA out of memory (simulated)"
    assert s["questions_answered"] == 2
    assert s["question_ids"] == [1, 2] and s["turns"] == 3 and len(report["groups"]) == 2
    for method in ("hf", "ar"):  # hf answered question 3 before ar failed on it: not counted
        assert report["methods"][method]["tokens"] == sum(g["tokens"][method] for g in report["groups"])
        assert report["methods"][method]["turns"] == 3
    assert report["methods"]["ar"]["exact"] is True
    assert "Stopped by an error (method ar on question(s) 3: RuntimeError: CUDA out of memory (simulated)) after 2 " \
           "questions" in report_markdown(report)
    assert "failed (method ar on question(s) 3: RuntimeError: CUDA out of memory (simulated)): stopping after 2 of 5 " \
           "questions" in capsys.readouterr().err
    heads, questions = cli_files(model, tmp_path, monkeypatch)
    questions = questions.rename(tmp_path / "fail.jsonl")  # (none left out as the heads' calibration questions)
    assert main(["--heads", str(heads), "--questions", str(questions), "--max-new-tokens", "4", "--device", "cpu",
                 "--methods", "hf,ar", "--output", str(tmp_path / "out")]) == 1
    assert json.loads((tmp_path / "out" / "report.json").read_text())["settings"]["questions_answered"] == 2
    assert "the benchmark stopped early (method ar on question(s) 3: RuntimeError: CUDA out of memory (simulated)); " \
           "the report holds the 2" in \
        capsys.readouterr().err
    monkeypatch.setattr(bench.Runner, "run_batch", lambda self, method, conversations, **kwargs: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # in the first group: nothing measured to report
        benchmark(model, QUESTIONS, args(methods=["ar"]))


def test_cli_calibrates_then_benchmarks_in_batches(model, tmp_path, monkeypatch, capsys):
    """The flow of scripts/gpu_bench.sh: calibrate the heads with the batch-1 run, then a batched run
    on the same questions, leaving out the ones calibration used (named in calibration.json)."""
    heads, questions = cli_files(model, tmp_path, monkeypatch)
    common = ["--heads", str(heads), "--questions", str(questions), "--max-new-tokens", "6", "--device", "cpu",
              "--dtype", "float32", "--methods", "hf,ar,medusa"]
    assert main(common + ["--calibrate", "--calibrate-questions", "2", "--calibrate-context", "16",
                          "--output", str(tmp_path / "b1")]) == 0
    used = json.loads((tmp_path / "b1" / "calibration.json").read_text())["question_ids"]
    assert len(used) == 2 and "cost_profile" in json.loads((heads / "config.json").read_text())
    first = json.loads((tmp_path / "b1" / "report.json").read_text())["settings"]
    assert first["batch_size"] == 1 and first["questions_answered"] == 3
    assert first["left_out_ids"] == {"exclude_ids": [], "calibration": used, "calibrated_here": True}
    assert f"but the 2 the heads were calibrated on in this run ({', '.join(map(str, used))})" in \
        (tmp_path / "b1" / "report.md").read_text()
    assert json.loads((heads / "config.json").read_text())["acceptance"]["calibration_questions"] == {
        "file": questions.name, "ids": used}
    # the heads remember them: a later run on that file leaves them out without being told
    for extra in (["--exclude-ids", ",".join(map(str, used))], []):
        assert main(common + ["--batch-size", "2", "--time-budget", "600", *extra,
                              "--output", str(tmp_path / "b2")]) == 0
        report = json.loads((tmp_path / "b2" / "report.json").read_text())
        assert report["settings"]["batch_size"] == 2 and report["settings"]["questions_answered"] == 3
        assert report["settings"]["turns"] == first["turns"]
        # the questions left out before the draw are recorded (a later --limit and --seed drew from all of them)
        assert report["settings"]["left_out_ids"] == {"exclude_ids": [str(i) for i in used] if extra else [],
                                                      "calibration": used, "calibrated_here": False}
        assert "Drawn from the file's questions but " in (tmp_path / "b2" / "report.md").read_text()
        assert report["methods"]["medusa"]["exact"] is True
        assert "batch size 2" in (tmp_path / "b2" / "report.md").read_text()
    assert "leaving out the 2 questions of" in capsys.readouterr().err
    # another questions file (by name) keeps all its questions
    other = questions.with_name("other.jsonl")
    other.write_text(questions.read_text())
    assert main(common[:2] + ["--questions", str(other)] + common[4:] + ["--output", str(tmp_path / "b3")]) == 0
    assert json.loads((tmp_path / "b3" / "report.json").read_text())["settings"]["questions_answered"] == 5


def test_cli_calibrates_on_questions_from_a_pipe(model, tmp_path, monkeypatch):
    """--questions may be a pipe: calibration and the benchmark pick from one reading (the second read of
    the pipe found nothing, and the run failed as if every question had been excluded)."""
    import os
    import threading

    heads, questions = cli_files(model, tmp_path, monkeypatch)
    read, write = os.pipe()
    text = questions.read_bytes()
    threading.Thread(target=lambda: (os.write(write, text), os.close(write)), daemon=True).start()
    assert main(["--heads", str(heads), "--questions", f"/dev/fd/{read}", "--max-new-tokens", "4", "--device", "cpu",
                 "--methods", "hf,ar", "--calibrate", "--calibrate-questions", "2", "--calibrate-context", "16",
                 "--output", str(tmp_path / "out")]) == 0
    settings = json.loads((tmp_path / "out" / "report.json").read_text())["settings"]
    assert settings["questions_answered"] == 3 and settings["tau_definition"] == bench.TAU_DEFINITION
    # a pipe's name ("63" of every <(...)) names no questions: none are recorded, and none left out later
    acceptance = json.loads((heads / "config.json").read_text())["acceptance"]
    assert acceptance["calibration_questions"]["file"] is None
    assert acceptance["head_accuracies_measured_on"] == "greedy answers to 2 questions read from a pipe"  # "from 3"
    card = (heads / "README.md").read_text()
    assert "Calibrated on 2 questions read from a pipe." in card and f"questions from {read})" not in card
    before = model.config.acceptance
    try:
        model.config.acceptance = {"calibration_questions": {"file": str(read), "ids": [1, 2]}}  # an older record
        assert bench.calibration_question_ids(model, f"/dev/fd/{read}") == []
        for edited in ("q.jsonl", {"file": "q.jsonl", "ids": 3}):  # by hand: an AttributeError, a TypeError
            model.config.acceptance = {"calibration_questions": edited}
            with pytest.raises(ValueError, match="calibration_questions is .* fix or remove it in their config.json"):
                bench.calibration_question_ids(model, "q.jsonl")
    finally:
        model.config.acceptance = before
        os.close(read)


def test_calibrating_faster_decoding_heads_leaves_their_folder_to_other_engines(model, tmp_path, monkeypatch,
                                                                                 capsys):
    _, questions = cli_files(model, tmp_path, monkeypatch)
    fd = model.export_medusa_layout(tmp_path / "fd")
    before = {path.name: path.read_bytes() for path in fd.iterdir()}
    common = ["--heads", str(fd), "--questions", str(questions), "--max-new-tokens", "6", "--methods", "ar,medusa",
              "--limit", "1", "--calibrate", "--calibrate-questions", "2", "--calibrate-context", "16"]
    with pytest.raises(SystemExit):
        parse_args(common)
    err = capsys.readouterr().err
    assert "is in the FasterDecoding layout (medusa_lm_head.*)" in err and "add --calibrated-heads DIR" in err
    with pytest.raises(SystemExit):
        parse_args(common + ["--calibrated-heads", str(fd)])  # nor by naming it twice
    assert main(common + ["--calibrated-heads", str(tmp_path / "calibrated"), "--output", str(tmp_path / "b")]) == 0
    assert {path.name: path.read_bytes() for path in fd.iterdir()} == before
    assert "cost_profile" in json.loads((tmp_path / "calibrated" / "config.json").read_text())
    # TensorRT-LLM's version 1 writes shared heads' projection as copies of the lm_head: loaded as shared heads
    # again, and stored as such (read without the lm_head, the stored ones had projections of their own, which
    # the save refused after the whole calibration)
    assert model.config.projection == "shared"
    fd1 = model.export_medusa_layout(tmp_path / "fd1", version="1")
    common[1] = str(fd1)
    assert main(common + ["--calibrated-heads", str(tmp_path / "calibrated1"), "--output", str(tmp_path / "c")]) == 0
    assert json.loads((tmp_path / "calibrated1" / "config.json").read_text())["projection"] == "shared"


def test_the_hf_baseline_decodes_plain_greedy_whatever_the_models_generation_config(model):
    """A generation_config.json with a repetition penalty and banned tokens (Qwen2.5-Instruct ships a
    penalty): `generate` applied them, so the baseline was not plain decoding (hf not exact, and the
    speedup measured against other text). The model's config is left as it was."""
    config = model.base_model.generation_config
    before = config.repetition_penalty, config.no_repeat_ngram_size, config.num_beams
    # num_beams=2: another search (it failed: beam search takes no streamer); contrastive and DoLa the same
    config.repetition_penalty, config.no_repeat_ngram_size, config.num_beams = 1.3, 2, 2
    try:
        report = benchmark(model, QUESTIONS[:2], args(methods=["hf", "ar"]))
        assert report["methods"]["hf"]["exact"] is True
        assert (config.repetition_penalty, config.no_repeat_ngram_size, config.num_beams) == (1.3, 2, 2)
        assert model.base_model.generation_config is config
    finally:
        config.repetition_penalty, config.no_repeat_ngram_size, config.num_beams = before


def test_questions_that_could_outgrow_the_context_are_left_out_before_any_method_runs(model):
    """A question whose prompt fills the tiny model's 256 positions: left out, named, and the others
    benchmarked (the run failed at `ar`, after `hf` had answered it, and wrote no report; near the end
    of the context our methods stopped where `generate` went on)."""
    long = {"id": "long", "category": "coding", "turns": [" ".join(["the"] * 300)]}
    report = benchmark(model, [long, *QUESTIONS[:2]], args(methods=["hf", "ar", "medusa"]))
    assert report["settings"]["questions_left_out_for_context"] == ["long"]
    assert report["settings"]["questions_answered"] == 2
    assert all(r["exact"] for r in report["methods"].values())
    assert "Left out, as their turns could outgrow the model's context: questions long." in report_markdown(report)
    with pytest.raises(ValueError, match="no question fits the model's context of 256 tokens"):
        benchmark(model, [long], args(methods=["hf", "ar"]))


def test_hf_assisted_drafts_plain_greedy_whatever_the_assistants_generation_config(model):
    """The assistant's own generation_config (here: suppressed tokens) shaped its drafts, so the baseline
    drafted worse than plain greedy drafting would: with an assistant identical to the target, every
    draft is accepted and hf-assisted takes as few target forwards as without those settings."""
    import copy

    runner = bench.Runner.__new__(bench.Runner)
    runner.model, runner.tokenizer, runner.args = model, model.tokenizer, args(methods=["hf-assisted"])
    runner.assistant = copy.deepcopy(model.base_model)
    ids, mask = torch.tensor([[5, 6, 7, 8, 9]]), torch.ones(1, 5, dtype=torch.long)
    plain = runner._run_hf("hf-assisted", ids, mask, 24)
    runner.assistant.generation_config.suppress_tokens = list(range(3, len(model.tokenizer) - 3))
    shaped = runner._run_hf("hf-assisted", ids, mask, 24)
    assert shaped[0] == plain[0] and shaped[1] == plain[1]  # the same answer in as many target forwards


def test_assisted_generation_and_grafted_lookup_run_and_stay_exact(model, tmp_path):
    draft = AutoModelForCausalLM.from_config(model.base_model.config).eval()  # another random model, same vocabulary
    draft.save_pretrained(tmp_path / "draft")
    report = benchmark(model, QUESTIONS[:3], args(methods=["hf", "hf-assisted", "ar", "medusa-lookup", "draft"],
                                                  draft_model=str(tmp_path / "draft")))
    methods = report["methods"]
    for name in ("hf-assisted", "medusa-lookup", "draft"):
        assert methods[name]["exact"] is True, name
        assert methods[name]["tokens_per_s"] > 0


def test_a_draft_model_of_the_same_tokenizer_with_a_padded_lm_head_is_benchmarked(model, tmp_path):
    """Qwen2.5-0.5B for Qwen2.5-7B: one tokenizer, LM heads of other sizes. ``generate`` takes the pair only
    with both tokenizers, and the draft proposer only drafts the target's tokens."""
    config = copy.deepcopy(model.base_model.config)
    config.vocab_size += 16
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path / "draft")
    model.tokenizer.save_pretrained(tmp_path / "draft")
    report = benchmark(model, QUESTIONS[:2], args(methods=["hf", "hf-assisted", "ar", "draft"],
                                                  draft_model=str(tmp_path / "draft")))
    assert report["methods"]["hf-assisted"]["exact"] is True and report["methods"]["draft"]["exact"] is True


def test_a_draft_model_with_another_tokenizer_is_refused_before_the_benchmark(model, tmp_path):
    """--draft-model's tokenizer is compared with the target's once, when the runner starts (the proposers
    get the bare model: a same-size vocabulary of other tokens ran, accepting almost nothing)."""
    from medusa_infer.serving.testing import WORDS

    draft = AutoModelForCausalLM.from_config(model.base_model.config).eval()
    draft.save_pretrained(tmp_path / "draft")
    word_tokenizer(list(reversed(WORDS))).save_pretrained(tmp_path / "draft")
    with pytest.raises(ValueError, match="has a different tokenizer from target"):
        bench.Runner(model, args(methods=["ar", "draft"], draft_model=str(tmp_path / "draft")))
    model.tokenizer.save_pretrained(tmp_path / "draft")
    bench.Runner(model, args(methods=["ar", "draft"], draft_model=str(tmp_path / "draft")))


def test_hugging_face_generate_runs_on_our_decoding_attention_kernels(model, monkeypatch):
    """The baseline is timed on the attention kernels our methods use (attention_kernels): every
    attention call of ``generate`` happens inside the same choice."""
    state = {"inside": 0, "attention": 0, "outside": 0}

    @contextlib.contextmanager
    def spy(device):
        assert torch.device(device) == model.device
        state["inside"] += 1
        try:
            yield
        finally:
            state["inside"] -= 1

    monkeypatch.setattr(bench, "decoding_attention", spy)
    monkeypatch.setattr("medusa_infer.model.decoding_attention", spy)

    def hook(module, args):
        state["attention"] += 1
        state["outside"] += state["inside"] == 0

    handles = [m.register_forward_pre_hook(hook) for name, m in model.base_model.named_modules()
               if name.endswith("self_attn")]
    try:
        report = benchmark(model, QUESTIONS[:2], args(methods=["hf", "hf-lookup"]))
    finally:
        for handle in handles:
            handle.remove()
    assert report["methods"]["hf"]["tokens_per_s"] > 0
    assert state["attention"] > 0 and state["outside"] == 0


def test_exact_counts_identical_turns_per_method_and_category(model, monkeypatch):
    """A method whose answers differ from ar's in one category: exact is False for the method and
    that category only, and the report counts the turns that stayed identical."""
    import dataclasses

    def differ_on_qa(self, method, conversations, **options):
        turns = RUN_BATCH(self, method, conversations, **options)
        if method != "medusa":
            return turns
        qa = {q["turns"][0] for q in QUESTIONS if q["category"] == "qa"}
        return [dataclasses.replace(t, tokens=t.tokens + [3]) if c[0]["content"] in qa else t
                for c, t in zip(conversations, turns)]

    monkeypatch.setattr(bench.Runner, "run_batch", differ_on_qa)
    for batch_size in (1, 3):  # batches of 3 mix the categories within one batch
        report = benchmark(model, QUESTIONS, args(methods=["hf", "ar", "medusa"], batch_size=batch_size))
        medusa = report["methods"]["medusa"]
        assert (medusa["exact"], medusa["identical_turns"], medusa["turns"]) == (False, 4, 6), batch_size
        assert report["methods"]["hf"]["exact"] is True and report["methods"]["ar"]["exact"] is True
        assert report["categories"]["qa"]["medusa"]["exact"] is False
        assert report["categories"]["qa"]["medusa"]["identical_turns"] == 0
        for category in ("writing", "math"):
            assert report["categories"][category]["medusa"]["exact"] is True, (batch_size, category)
        assert "| NO (4/6 turns) |" in report_markdown(report)
    report["settings"]["dtype"] = "bfloat16"
    assert "greedy outputs can part where two tokens nearly tie" in report_markdown(report)


def test_medusa_methods_learn_step_costs_across_questions(model, monkeypatch):
    """At batch 1 each medusa method keeps one StepCosts across the questions (the report's
    ``step_costs`` and a table in report.md); ``--step-costs profile`` keeps none."""
    import itertools

    from medusa_infer.tree_fit import CostProfile
    from medusa_infer.trees import REFERENCE_HEAD_ACCURACY

    monkeypatch.setattr(model.config, "head_accuracies",
                        [list(itertools.accumulate(row)) for row in REFERENCE_HEAD_ACCURACY])
    monkeypatch.setattr(model.config, "cost_profile",
                        CostProfile([1, 2, 4, 8, 16], [1.0, 1.1, 1.3, 1.6, 2.2], "cpu-like").to_dict())
    report = benchmark(model, QUESTIONS, args(methods=["hf", "ar", "medusa", "medusa-lookup"], max_new_tokens=40))
    learned = report["step_costs"]
    assert set(learned) == {"medusa", "medusa-lookup"} and report["settings"]["step_costs"] == "learned"
    assert sum(pair["samples"] for pair in learned["medusa"].values()) >= 3
    assert all(report["methods"][m]["exact"] is True for m in ("medusa", "medusa-lookup"))
    assert "Cost ratios the adaptive fallback measured" in report_markdown(report)
    off = benchmark(model, QUESTIONS[:2], args(methods=["hf", "medusa"], step_costs="profile"))
    assert off["step_costs"] == {} and off["settings"]["step_costs"] == "profile"
    assert "Cost ratios" not in report_markdown(off)


def test_the_report_says_no_fallback_ran_on_heads_without_a_calibration(model, monkeypatch):
    """Heads without measured accuracies and a cost profile run no fallback: the report's settings said
    fallback: true and step_costs: learned (docs/tau40-xl-s52/report.json), as the flag's default."""
    monkeypatch.setattr(model.config, "cost_profile", None)  # (the module's model may have been calibrated)
    report = benchmark(model, QUESTIONS[:1], args(methods=["hf", "medusa"]))
    assert report["settings"]["fallback"] is False and report["settings"]["step_costs"] is None
    assert report["step_costs"] == {}
    plain = benchmark(model, QUESTIONS[:1], args(methods=["hf", "ar"]))  # no medusa method: nothing to fall back from
    assert plain["settings"]["fallback"] is False


def test_no_fallback_keeps_every_medusa_method_on_the_tree_asked_for(model, monkeypatch):
    """``--no-fallback``: on calibrated heads, whose fallback would otherwise adapt the tree, no
    medusa method gets a fallback controller, and each decodes on the tree ``--tree`` names
    (``fitted-N``: N nodes, recorded as paths in the report); without it every one of them gets a
    controller. Without a medusa method the flag is refused."""
    import itertools

    from medusa_infer import decoding
    from medusa_infer.tree_fit import CostProfile
    from medusa_infer.trees import REFERENCE_HEAD_ACCURACY

    monkeypatch.setattr(model.config, "head_accuracies",
                        [list(itertools.accumulate(row)) for row in REFERENCE_HEAD_ACCURACY])
    monkeypatch.setattr(model.config, "path_accuracies", None)  # an earlier test's calibration may have set them
    monkeypatch.setattr(model.config, "cost_profile",
                        CostProfile([1, 2, 4, 8, 16], [1.0, 1.1, 1.3, 1.6, 2.2], "cpu-like").to_dict())
    made = []
    real = decoding.make_controller

    def spy(model_, paths, *rest):
        made.append((len(paths), real(model_, paths, *rest)))
        return made[-1][1]

    monkeypatch.setattr(decoding, "make_controller", spy)
    methods = ["hf", "ar", "medusa", "medusa-lookup", "medusa-lossless", "medusa-typical"]
    given = ["--questions", "q.jsonl", "--heads", "h", "--methods", "medusa", "--no-fallback"]
    assert parse_args(given).fallback is False
    with pytest.raises(SystemExit):
        parse_args(["--questions", "q.jsonl", "--methods", "ar,lookup", "--no-fallback"])
    off = benchmark(model, QUESTIONS[:2], args(methods=methods, tree="fitted-12", fallback=False))
    assert off["settings"]["fallback"] is False and off["step_costs"] == {}
    assert len(off["settings"]["tree"]) == 12 and off["settings"]["tree"][0] == [0]
    # four medusa methods, each on three turns and the untimed warm-up's one
    assert len(made) == 4 * (3 + 1) and all(nodes == 12 and control is None for nodes, control in made)
    assert all(off["methods"][m]["exact"] is True for m in ("medusa", "medusa-lookup"))
    made.clear()
    on = benchmark(model, QUESTIONS[:2], args(methods=methods, tree="fitted-12"))
    assert on["settings"]["fallback"] is True
    assert len(made) == 4 * (3 + 1) and all(control is not None for _, control in made)


def test_heads_by_category_splits_calibrations_measure_and_counts_the_head_vocabulary(model, tmp_path, capsys):
    """scripts/heads_by_category.py: per category the heads' top-1 on the model's own answers to the
    first turns, merged into an "all" row equal to measuring every answer at once, the share of the
    proposable answer tokens (all but the first) that a reduced head vocabulary holds, a category with
    nothing to score shown as such, and Medusa-2 folders refused."""
    import importlib.util
    from pathlib import Path

    from medusa_infer.decoding import encode_chat

    path = Path(__file__).resolve().parents[1] / "scripts" / "heads_by_category.py"
    spec = importlib.util.spec_from_file_location("heads_by_category", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    answers = bench.first_turn_answers(model, QUESTIONS, 8)
    categories = [q["category"] for q in QUESTIONS]
    first_turn = encode_chat(model.tokenizer, [{"role": "user", "content": QUESTIONS[0]["turns"][0]}])[0]
    prompt = model.tokenizer(first_turn, add_special_tokens=False)["input_ids"]
    assert answers[0][0][: answers[0][1]].tolist() == prompt  # the second turn is left out
    assert all(len(seq) > start + 1 for seq, start in answers)
    rows = script.accuracy_by_category(model, categories, answers)
    assert set(rows) == {"writing", "qa", "math", "all"}
    whole = head_topk_accuracy(model, answers, top_k=1)
    assert rows["all"]["top1"] == [round(row[0], 3) for row in whole.topk()]
    assert rows["all"]["scored"] == whole.totals.tolist()
    qa = head_topk_accuracy(model, answers[2:4], top_k=1)
    assert rows["qa"]["top1"] == [round(row[0], 3) for row in qa.topk()] != rows["all"]["top1"]
    assert rows["all"]["tokens"] == sum(len(seq) - start - 1 for seq, start in answers)
    assert rows["math"]["tokens"] == len(answers[4][0]) - answers[4][1] - 1
    assert all(row["in_head_vocab"] == 1.0 for row in rows.values())  # full vocabulary

    generated = torch.cat([seq[start + 1:] for seq, start in answers])
    seen = set(generated.tolist())
    kept = generated.unique()[: max(1, len(seen) // 2)]
    others = torch.tensor([t for t in range(len(model.tokenizer)) if t not in seen][:8])
    reduced = MedusaModel.from_base(model.base_model, num_heads=2, tokenizer=model.tokenizer,
                                    token_map=torch.cat([kept, others]))
    rows = script.accuracy_by_category(reduced, categories, answers)
    expected = float(torch.isin(generated, kept).double().mean())
    assert 0 < expected < 1 and rows["all"]["in_head_vocab"] == round(expected, 3)
    with pytest.raises(ValueError, match="one per answer"):
        script.accuracy_by_category(model, categories[:2], answers)
    # a category whose answers are one token long has nothing a head proposes
    short = [(seq[: start + 1], start) for seq, start in answers]
    rows = script.accuracy_by_category(model, categories, answers[:4] + short[4:])
    assert rows["math"] == {"top1": [None] * model.config.num_heads, "scored": [0] * model.config.num_heads,
                            "in_head_vocab": None, "tokens": 0}
    assert "| math | - |" in script.table({"heads": rows}) and "| qa | 0." in script.table({"heads": rows})
    with pytest.raises(ValueError, match="raise --max-new-tokens"):
        script.accuracy_by_category(model, categories, short)

    model.save_pretrained(tmp_path / "plain")
    model.save_pretrained(tmp_path / "medusa2")
    (tmp_path / "medusa2" / "adapter").mkdir()
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    with pytest.raises(SystemExit):
        script.main(["--heads", str(tmp_path / "plain"), str(tmp_path / "medusa2"), "--questions", str(questions)])
    assert f"{tmp_path / 'medusa2'} holds a LoRA adapter" in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["ours", "fasterdecoding"])
def test_calibration_in_bfloat16_keeps_the_stored_float32_weights(model, tmp_path, monkeypatch, layout):
    """``--calibrate --dtype bfloat16`` saves the fitted tree into the heads folder; the weights are
    written back as they were stored, not as the bfloat16 copies the calibration computed with. Heads
    in the FasterDecoding layout too (saved with --calibrated-heads: they were rounded to bfloat16)."""
    import copy

    from safetensors.torch import load_file

    heads, questions = cli_files(model, tmp_path, monkeypatch)
    import medusa_infer.models as models

    bf16 = copy.deepcopy(model.base_model).to(torch.bfloat16)
    monkeypatch.setattr(models, "load_base_model", lambda name, **kw: bf16)
    before = load_file(heads / "model.safetensors")
    source, saved = heads, heads
    if layout == "fasterdecoding":
        source, saved = model.export_medusa_layout(tmp_path / "fd"), tmp_path / "calibrated"
    assert main(["--heads", str(source), "--questions", str(questions), "--limit", "1", "--max-new-tokens", "4",
                 "--methods", "ar", "--calibrate", "--calibrate-questions", "1", "--calibrate-context", "16",
                 "--dtype", "bfloat16", "--output", str(tmp_path / "out")]
                + (["--calibrated-heads", str(saved)] if saved != heads else [])) == 0
    after = load_file(saved / "model.safetensors")
    assert "calibrated_tree_nodes" in json.loads((saved / "config.json").read_text())["acceptance"]
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert {t.dtype for t in after.values() if t.is_floating_point()} == {torch.float32}


def test_tau_is_tokens_per_decoding_step_as_generation_metrics_count_them(model, monkeypatch):
    """The report's tau is the issue's, Spec-Bench's and vLLM's (and GenerationMetrics.tau): tokens per decoding
    step, the bonus token counted and the prefill's token no step's. It was tokens per target forward, the
    prefill counted as a step: lower by steps / (steps + 1), so below what generate() printed for the same
    answers. Hugging Face's assisted methods verify drafts in their first forward: its tokens past the
    first count as a step's."""
    from medusa_infer.decoding import GenerationStream

    seen = []
    result = GenerationStream.result

    def recorded(self):
        out = result(self)
        seen.append(out.metrics)
        return out

    monkeypatch.setattr(GenerationStream, "result", recorded)
    # the speculation gate and the adaptive fallback off: both measure step times, and on a busy machine
    # may decode these turns plainly (the fallback did so in a full suite, once earlier tests left the
    # model's heads with a cost profile)
    report = benchmark(model, QUESTIONS, args(methods=["medusa"], speculation_gate="off", fallback=False))
    calls = [m for m in seen if m.steps][1:]  # after the untimed warm-up
    expected = sum(m.step_tokens for m in calls) / sum(m.steps for m in calls)
    assert report["methods"]["medusa"]["tau"] == pytest.approx(expected, abs=1e-3) and expected > 1.0
    # by hand: a 40-token answer in 13 steps is 3 a step; plain decoding 1; assisted generation that verified
    # drafts in its first forward (4 tokens of it, then 6 in 2 steps), and one answered by that forward alone
    totals = bench.MethodTotals()
    totals.add(bench.Turn(list(range(40)), 0.1, 13, 0.01, 0.0, 0.1, 13))
    assert totals.summary(None)["tau"] == 3.0
    plain = bench.MethodTotals()
    plain.add(bench.Turn(list(range(10)), 0.1, 9, 0.01, 0.0, 0.1, 9))
    assert plain.summary(None)["tau"] == 1.0
    assisted = bench.MethodTotals()
    assisted.add(bench.Turn(list(range(1)), 0.1, 0, 0.01, 0.0, 0.1, 0))
    assert assisted.summary(None)["tau"] is None  # no decoding step (it read 1.0)
    assisted.add(bench.Turn(list(range(4)), 0.1, 0, 0.01, 0.0, 0.1, 0, first_tokens=4))
    assert assisted.summary(None)["tau"] == 3.0  # the first forward verified drafts: a step of 3 tokens
    assisted = bench.MethodTotals()  # 3 tokens from the first forward, then 21 in 21 steps: 23 in 22 steps
    assisted.add(bench.Turn(list(range(24)), 0.1, 21, 0.01, 0.0, 0.1, 21, first_tokens=3))
    assert assisted.summary(None)["tau"] == round(23 / 22, 3)  # it read 1.0: those 2 tokens were nobody's
    assert bench._tau(None) == "-" and bench._tau(2.345) == "2.35"  # report.md's cell
    timer = bench._FirstTokenTimer()
    timer.put(torch.tensor([[1, 2, 3]]))  # the prompt
    timer.put(torch.tensor([[4, 5, 6]]))  # the first forward's tokens
    assert timer.first_tokens == 3


def test_a_row_that_stopped_at_its_first_token_adds_no_decoding_time():
    """TPOT is a row's decoding seconds over its later tokens: a row with none adds none."""
    totals = bench.MethodTotals()
    totals.add(bench.Turn([7], 0.03, 1, 0.0024, 0.0, 0.0552, 39))
    totals.add(bench.Turn(list(range(40)), 0.03, 39, 0.0024, 0.0, 0.0552, 39))
    assert totals.summary(None)["tpot_s"] == pytest.approx((0.0552 - 0.0024) / 39, abs=1e-5)


def test_an_assisted_first_forwards_tokens_are_not_in_tpot():
    """Hugging Face's assisted methods may take several tokens from their first forward, in the TTFT's time: they
    were counted among TPOT's later tokens (their time not), down to a TPOT of 0 for an answer the first forward
    gave whole."""
    whole = bench.MethodTotals()
    whole.add(bench.Turn([77, 10], 0.0066, 0, 0.0065, 0.0, 0.0066, 0, first_tokens=2))
    assert whole.summary(None)["tpot_s"] is None  # no later token: no TPOT (it read 0.0)
    assisted = bench.MethodTotals()  # 3 tokens from the first forward, then 21 in 21 steps of 0.01 s
    assisted.add(bench.Turn(list(range(24)), 0.3, 21, 0.09, 0.0, 0.09 + 21 * 0.01, 21, first_tokens=3))
    assert assisted.summary(None)["tpot_s"] == pytest.approx(0.01)  # it read 0.21 s / 23 tokens


def test_a_row_finishing_early_in_a_batch_is_charged_its_own_steps():
    """Batched rows of 2 and 40 tokens: each row's TPOT is about one step's time (the batch's decoding
    seconds in proportion to the steps it was decoding in); the short row was charged the whole batch's."""
    step = 0.001
    short, long = bench.MethodTotals(), bench.MethodTotals()
    short.add(bench.Turn([5, 6], 0.01, 1, 0.002, 0.0, 0.002 + 39 * step, 39))
    long.add(bench.Turn(list(range(40)), 0.03, 39, 0.002, 0.0, 0.002 + 39 * step, 39))
    assert short.summary(None)["tpot_s"] == pytest.approx(step) == long.summary(None)["tpot_s"]


def test_excluded_ids_match_numbers_and_strings_alike(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"id": i, "category": "qa", "turns": ["hi"]}) + "\n" for i in ("81", 82, "q3")))
    for exclude in ([81, "q3"], ["81", "82"], ["82"]):
        kept = [str(q["id"]) for q in load_questions(path, exclude_ids=exclude)]
        assert not set(kept) & {str(x) for x in exclude} and len(kept) == 3 - len(exclude)


def test_heads_never_right_calibrate_to_plain_decoding_and_profiles_never_beat_one_token():
    from medusa_infer.tree_fit import CostProfile, fit_tree

    profile = CostProfile([1, 2, 4], [1.0, 0.984, 1.2], "an old profile with a noisy dip")
    assert profile.ratio(2) == 1.0 and profile.ratio(3) > 1.0
    fitted = fit_tree({}, profile)
    assert (fitted.paths, fitted.expected_speedup) == ([], 1.0)
    one_node = fit_tree({(0,): 0.99}, profile)
    assert one_node.expected_speedup <= one_node.expected_tau  # no speedup above tau


def test_hugging_face_answers_keep_the_tokens_the_model_wrote_that_equal_the_pad_id():
    """Only what follows a row's first EOS is padding; tokens equal to the pad id before it (or in a row
    that reached the token limit) are the model's, counted and compared as such."""
    pad, eos = 0, [2]
    assert bench.hf_answer([77, 10, 0, 9, 0], eos) == [77, 10, 0, 9, 0]
    assert bench.hf_answer([5, 0, 2, 0, 0], eos) == [5, 0, 2]
    assert bench.hf_answer([0, 0], eos) == [pad, pad]
    assert bench.hf_answer([5, 2, 2, 2], [2, 7]) == [5, 2]  # padded with an EOS


def test_our_methods_time_their_set_up_as_generate_does(model, monkeypatch):
    """Building the proposer, trees and caches happens inside the timed call, as generate's set-up does for
    the baseline: it counts in seconds and in the time to the first token."""
    from medusa_infer import decoding

    real_stream = decoding.stream
    clock = {"offset": 0.0}

    class Clock:  # the benchmark's clock, 0.2 s later once the stream is built
        @staticmethod
        def perf_counter() -> float:
            return time.perf_counter() + clock["offset"]

    def slow_stream(*args, **kwargs):
        clock["offset"] += 0.2
        return real_stream(*args, **kwargs)

    monkeypatch.setattr(bench, "time", Clock)
    monkeypatch.setattr(decoding, "stream", slow_stream)
    runner = bench.Runner(model, args(methods=["ar", "medusa"], max_new_tokens=4))
    for method in ("ar", "medusa"):
        turn = runner.run_batch(method, [[{"role": "user", "content": "the cat sat"}]])[0]
        assert turn.ttft_s >= 0.2 and turn.call_s >= 0.2, (method, turn)


@pytest.mark.parametrize("high_water_mark", [True, False])
def test_peak_memory_sees_a_peak_that_is_gone_by_the_end(monkeypatch, high_water_mark):
    """Memory taken and given back inside the block counts (the kernel's high-water mark), and where that
    cannot be read, memory still held at the end does: the KV cache is largest at the end of a call, and a
    short call may end between two samples."""
    if not high_water_mark:  # the sampling fallback: no /proc/self/clear_refs
        monkeypatch.setattr(bench, "_reset_high_water_mark", lambda: False)
    with bench._PeakMemory(torch.device("cpu")) as before:
        pass
    with bench._PeakMemory(torch.device("cpu")) as peak:
        block = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MB, written
        if high_water_mark:
            del block  # gone before the end: only the high-water mark still knows
    assert peak.peak >= before.peak + 200, (before.peak, peak.peak)  # the sampling takes one last look


def test_a_calibration_context_past_the_models_is_refused_before_the_answers(model, tmp_path, monkeypatch, capsys):
    """--calibrate-context was checked only to be positive: past the model's context (256 positions
    here) the cost measurement failed (gpt2: a bare IndexError) after every calibration answer."""
    heads, questions = cli_files(model, tmp_path, monkeypatch)
    monkeypatch.setattr(bench, "first_turn_answers", lambda *a: pytest.fail("answered before the check"))
    assert main(["--heads", str(heads), "--questions", str(questions), "--max-new-tokens", "4", "--methods", "ar",
                 "--calibrate", "--calibrate-questions", "1", "--calibrate-context", "250",
                 "--output", str(tmp_path / "out")]) == 2
    assert "needs 250 + 64 positions, but the model attends over 256" in capsys.readouterr().err


def test_timing_the_heads_leaves_the_global_random_state_alone(model):
    """Calibration runs before the sampled methods, which a --seed seeds through the global generator."""
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    assert len(bench.measure_head_seconds(model, repeats=1)) == model.config.num_heads
    assert torch.equal(torch.rand(4), expected)


def test_hf_methods_stop_at_the_end_tokens_ours_stop_at(model):
    """A fine-tune naming its end-of-turn token in its config only (the generation config keeps </s>):
    generate stopped at the generation config's ids alone, answered on past it, and the report called
    hf inexact and compared its speed on longer answers."""
    messages = [{"role": "user", "content": QUESTIONS[0]["turns"][0]}]
    first = bench.Runner(model, args(methods=["ar"], max_new_tokens=12)).run("ar", messages).tokens
    end = next(t for i, t in enumerate(first[2:], 2) if t not in first[:i] and t != 2)
    model.base_model.config.eos_token_id = [2, end]
    try:
        runner = bench.Runner(model, args(methods=["hf", "hf-lookup", "ar"], max_new_tokens=12))
        answers = {m: runner.run(m, messages).tokens for m in ("hf", "hf-lookup", "ar")}
        assert answers["ar"][-1] == end and answers["hf"] == answers["hf-lookup"] == answers["ar"], answers
    finally:
        model.base_model.config.eos_token_id = 2


def test_report_md_keeps_three_significant_digits_of_small_times():
    """TTFT and TPOT under a millisecond (a GPU's) all read 0.000 in report.md."""
    assert [bench._fmt(x) for x in (0.00036, 0.0152, 0.4, 1.623, 12.34, None, True)] == \
        ["0.00036", "0.0152", "0.400", "1.623", "12.3", "-", "yes"]


def test_retau_recovers_a_stored_reports_steps_and_gives_tokens_per_step():
    """scripts/retau.py: a report from before tau was per decoding step keeps tokens, turns and the tau per
    target forward (3 decimals); the steps consistent with them give today's tau, a range where several
    are, and nothing for Hugging Face's assisted methods, whose first forward's tokens it did not keep."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "retau.py"
    spec = importlib.util.spec_from_file_location("retau", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    tokens, turns, steps = 3731, 65, 1199
    old = round(tokens / (steps + turns), 3)
    assert list(script.steps_range(tokens, turns, old)) == [steps]
    per_step = f"{(tokens - turns) / steps:.3f}"
    assert script.retau("medusa-lookup", {"tokens": tokens, "turns": turns, "tau": old}, 0) == per_step
    # reports before commit f8ca5fd keep the run's turns only (every method's): it failed with a KeyError
    assert script.retau("medusa-lookup", {"tokens": tokens, "tau": old}, turns) == per_step
    wide = script.retau("medusa", {"tokens": 15252, "turns": 130, "tau": 2.136}, 130)
    assert ".." in wide and all(2.15 < float(x) < 2.16 for x in wide.split(".."))
    assert script.retau("hf-lookup", {"tokens": tokens, "turns": turns, "tau": 1.8}, turns) == "n/a"
    assert script.retau("ar", {"tokens": tokens, "turns": turns, "tau": 1.0}, turns) == "1.00"
    assert script.retau("ar", {"tokens": turns, "turns": turns, "tau": 1.0}, turns) == "-"  # no step: it said 1.00
    script.main([str(p) for p in sorted((path.parents[1] / "docs").rglob("report.json"))])  # every stored one
    with pytest.raises(SystemExit) as exit_info:  # a traceback, naming neither the file nor the fix
        script.main([str(path.parent / "no-such-report.json")])
    assert exit_info.value.code == 2


def test_retau_leaves_reports_that_record_their_tau_definition_alone(tmp_path, capsys):
    """A report written under today's definition was converted again (tau lowered twice), and a method with
    no tau (None: every turn ended in its first forward) failed the script with a TypeError."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "retau.py"
    spec = importlib.util.spec_from_file_location("retau", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = {"medusa": {"tokens": 300, "turns": 3, "tau": 2.5}, "hf-lookup": {"tokens": 9, "turns": 3, "tau": None}}
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    new.write_text(json.dumps({"settings": {"turns": 3, "tau_definition": bench.TAU_DEFINITION}, "methods": rows}))
    old.write_text(json.dumps({"settings": {"turns": 3}, "methods": rows}))
    script.main([str(new), str(old)])
    out = capsys.readouterr().out
    assert f"its tau is already {bench.TAU_DEFINITION}" in out
    assert "| hf-lookup | 9 | 3 | - | - |" in out
    # the stored report made after the definition changed, before reports recorded it: left alone too
    script.main([str(Path(__file__).resolve().parents[1] / "docs" / "demo-ec1ff2d" / "report.json")])
    assert "already tokens per decoding step" in capsys.readouterr().out
    # neither the method nor the run kept its turns: a KeyError before, now the row says it cannot be converted
    old.write_text(json.dumps({"settings": {}, "methods": {"medusa": {"tokens": 300, "tau": 2.5}}}))
    script.main([str(old)])
    assert "| medusa | 300 | ? | 2.5 | ? (the report keeps no turns) |" in capsys.readouterr().out


def test_a_methods_peak_memory_does_not_count_what_an_earlier_one_freed():
    """The CPU peak is the process's resident high-water mark, reset before each call: memory an earlier
    method freed but the process still held (garbage in reference cycles, the C heap's free pages) was
    charged to every method measured after it (200 MB of `medusa-lookup`'s to `ar` on the default model)."""
    import gc

    if not bench._reset_high_water_mark():
        pytest.skip("no resettable high-water mark here (not Linux)")
    enabled = gc.isenabled()
    gc.disable()  # the garbage stays until collected
    try:
        with bench._PeakMemory(torch.device("cpu")) as first:
            held: list = [bytearray(100_000) for _ in range(2000)]  # 200 MB in 100 kB blocks, on the C heap
            held.append(held)  # a cycle: freed by the collector alone
        del held
        with bench._PeakMemory(torch.device("cpu")) as second:
            pass
    finally:
        if enabled:
            gc.enable()
    assert second.peak < first.peak - 150, (first.peak, second.peak)


def test_the_plot_keeps_the_overall_figures_beside_a_category_named_all(model):
    """The plot's groups were a dict keyed by "all" for the overall figures, then by category: a category
    named "all" replaced them, and its bars were drawn twice."""
    questions = [dict(q, category="all" if q["category"] == "qa" else q["category"]) for q in QUESTIONS[:4]]
    report = benchmark(model, questions, args(methods=["ar", "lookup"]))
    groups = bench.plot_groups(report)
    assert [label for label, _ in groups] == ["all", "category all", "writing"]
    assert groups[0][1] is report["methods"] and groups[1][1] is report["categories"]["all"]
    assert groups[0][1]["lookup"]["tokens"] != groups[1][1]["lookup"]["tokens"]


def test_the_report_names_what_exact_and_speedup_are_measured_against(model):
    """Without `ar` the answers are compared with `hf`'s, without `hf` no speedup is measured: the report
    said neither (its table's column read "speedup vs hf" all the same)."""
    without_hf = benchmark(model, QUESTIONS[:2], args(methods=["ar", "lookup"]))
    assert without_hf["settings"]["exact_reference"] == "ar" and without_hf["settings"]["speedup_baseline"] is None
    assert without_hf["methods"]["lookup"]["speedup"] is None and without_hf["methods"]["lookup"]["exact"] is True
    text = report_markdown(without_hf)
    assert "| method | tokens/s | speedup (no hf run) |" in text and "speedup: not measured (hf" in text
    assert "exact: greedy answers identical to ar's, turn by turn" in text
    with_hf = benchmark(model, QUESTIONS[:2], args(methods=["hf", "lookup", "medusa-lossless"]))
    assert with_hf["settings"]["exact_reference"] == "hf" and with_hf["settings"]["speedup_baseline"] == "hf"
    assert "| method | tokens/s | speedup vs hf |" in report_markdown(with_hf)
    neither = benchmark(model, QUESTIONS[:1], args(methods=["lookup"]))
    assert neither["settings"]["exact_reference"] is None and neither["methods"]["lookup"]["exact"] is None
    assert "exact: not measured (neither ar nor hf ran" in report_markdown(neither)


def test_the_warm_up_decodes_no_further_than_the_questions_were_checked_to_fit():
    """The untimed warm-up decoded 8 new tokens whatever --max-new-tokens: a question that fits the context
    with 2 did not with 8, and `generate` on a model of learned positions (GPT-2) failed with an IndexError."""
    from transformers import GPT2Config

    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base = AutoModelForCausalLM.from_config(config).eval()
    base.name_or_path = "tiny-gpt2"
    model = MedusaModel.from_base(base, num_heads=4, tokenizer=tokenizer)
    from medusa_infer.decoding import encode_chat

    words = "the cat sat on the mat and the dog ran".split()
    turn = next(t for t in (" ".join((words * 10)[:n]) for n in range(10, 80))
                if len(tokenizer(encode_chat(tokenizer, [[{"role": "user", "content": t}]])[0],
                                 add_special_tokens=False)["input_ids"]) == 62)
    report = benchmark(model, [{"id": 1, "category": "writing", "turns": [turn]}],
                       args(methods=["hf", "ar"], max_new_tokens=2, heads=None, tree=None))
    assert report["settings"]["questions_answered"] == 1 and report["methods"]["hf"]["exact"] is True


def test_the_output_and_questions_take_a_leading_tilde_as_the_home_folder(tmp_path, monkeypatch):
    """--output=~/bench (no shell expands ~ after "=") wrote into a folder named ~ in the working folder."""
    monkeypatch.setenv("HOME", str(tmp_path))
    args = parse_args(["--questions=~/q.jsonl", "--methods", "ar", "--output=~/bench"])
    assert (args.questions, args.output) == (str(tmp_path / "q.jsonl"), str(tmp_path / "bench"))


def test_an_output_that_is_a_file_is_refused_by_its_flag(tmp_path, capsys):
    """It failed after loading the model, as "[Errno 17] File exists", naming no flag."""
    taken = tmp_path / "report"
    taken.write_text("a file")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--questions", "q.jsonl", "--methods", "ar", "--output", str(taken)])
    assert exit_info.value.code == 2
    assert f"--output {taken} is a file: give a folder" in capsys.readouterr().err


def test_bench_datastore_names_heads_that_name_no_base_model(tmp_path, capsys):
    """scripts/bench_datastore.py read config.json's base_model_name_or_path raw: heads naming none ended in a
    TypeError traceback (and a FasterDecoding export's exported name was not the one read)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_datastore.py"
    spec = importlib.util.spec_from_file_location("bench_datastore", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    (tmp_path / "config.json").write_text(json.dumps({"num_heads": 4}))
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--heads", str(tmp_path)])
    assert exit_info.value.code == 2 and "names no base model" in capsys.readouterr().err


def test_a_batchs_seconds_are_shared_among_its_rows_by_their_tokens(model, monkeypatch):
    """At batch size > 1 a row's seconds (what its category's speed divides by) are the batch's seconds in
    proportion to its tokens: a row of 3 tokens beside one of 1 is charged 3/4 of them, not half."""
    runner = bench.Runner(model, args(methods=["ar"]))
    monkeypatch.setattr(runner, "_run_ours", lambda method, ids, mask, limit: ([[5, 6, 7], [8]], [2, 0], 0.5, 4.0))
    turns = runner.run_batch("ar", [[{"role": "user", "content": "one two"}], [{"role": "user", "content": "three"}]])
    assert [t.seconds for t in turns] == pytest.approx([3.0, 1.0])
    assert [t.call_s for t in turns] == [4.0, 4.0] and [t.call_steps for t in turns] == [2, 2]


def test_head_seconds_never_fall_with_depth(model, monkeypatch):
    """A deeper tree runs more heads: its measured seconds are never below a shallower one's, even where a
    noisy machine timed the deeper heads faster (a running maximum over the medians)."""
    durations = [0.4, 0.1, 0.3, 0.2]  # depth 2 measures faster than depth 1, depth 4 than depth 3
    assert model.config.num_heads == len(durations)
    clock = {"t": 0.0}
    head_logits = model.head_logits

    def timed(*a, first=None, **k):  # the clock moves by this depth's duration while its heads run
        clock["t"] += durations[first - 1]
        return head_logits(*a, first=first, **k)

    monkeypatch.setattr(model, "head_logits", timed)
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: clock["t"]))  # benchmark's clock only
    seconds = bench.measure_head_seconds(model, repeats=3)
    assert seconds == pytest.approx([0.4, 0.4, 0.4, 0.4])


def test_a_batchs_decoding_steps_are_its_longest_rows(model, monkeypatch):
    """call_steps (what a row's share of the decoding seconds divides by) is the most steps of any row, whichever
    row that is: a row finishing early is charged its own steps' share, not all the decoding time."""
    runner = bench.Runner(model, args(methods=["ar"]))
    monkeypatch.setattr(runner, "_run_ours", lambda method, ids, mask, limit: ([[8], [5, 6, 7]], [0, 2], 0.5, 4.0))
    turns = runner.run_batch("ar", [[{"role": "user", "content": "three"}], [{"role": "user", "content": "one two"}]])
    assert [t.call_steps for t in turns] == [2, 2] and [t.seconds for t in turns] == pytest.approx([1.0, 3.0])


def test_hugging_face_batches_take_one_step_per_token_after_the_first(model):
    """generate at batch size > 1 decodes plainly: a row's steps are its tokens after the prefill's, so its tau
    is 1.0 as the module's docstring says."""
    runner = bench.Runner(model, args(methods=["hf"], batch_size=2))
    turns = runner.run_batch("hf", [[{"role": "user", "content": "the cat sat"}], [{"role": "user", "content": "one"}]])
    assert all(t.steps == len(t.tokens) - 1 for t in turns)
    totals = bench.MethodTotals()
    for t in turns:
        totals.add(t)
    assert totals.summary(None)["tau"] == 1.0


def test_category_speedups_divide_by_the_categorys_own_hf_speed(model):
    """A category's speedup is its tokens/s over hf's tokens/s on that category's questions (paired), not over
    hf's overall speed: hf itself scores 1.0 in every category."""
    report = benchmark(model, QUESTIONS, args(methods=["hf", "ar"], max_new_tokens=6))
    assert set(report["categories"]) == {q["category"] for q in QUESTIONS}  # (an empty report passed the loop)
    for category, rows in report["categories"].items():
        assert rows["hf"]["speedup"] == 1.0, category
        # the speedup is rounded to 3 decimals: 5e-4 off at most, more than rel=2e-3 of a speedup below 0.25 (a
        # category whose ar turn a busy machine slowed)
        assert rows["ar"]["speedup"] == pytest.approx(rows["ar"]["tokens_per_s"] / rows["hf"]["tokens_per_s"],
                                                      rel=2e-3, abs=6e-4), category


def test_speedup_intervals_draw_again_where_a_draw_is_undefined():
    """Draws whose hf speed is undefined (every group drawn had no hf token) are drawn again, up to twice the
    samples: with 8 of 10 groups empty, 1 - 0.8**10 = 89% of draws are defined, enough for an interval."""
    groups = [{"tokens": {"hf": 0 if i < 8 else 10, "ar": 10}, "seconds": {"hf": 1.0, "ar": 0.5}} for i in range(10)]
    intervals = bench.speedup_intervals(groups, ["hf", "ar"], samples=200, min_groups=10)
    assert set(intervals) == {"hf", "ar"} and intervals["hf"] == [1.0, 1.0]


def _turn(tokens, ttft, peak, seconds=1.0, steps=None):
    steps = max(len(tokens) - 1, 0) if steps is None else steps
    return bench.Turn(list(tokens), seconds, steps, ttft, peak, seconds, steps)


def test_method_totals_report_the_highest_peak_and_the_mean_ttft():
    """peak_mem_mb is the highest of the method's turns (not its last turn's); ttft_s the mean over turns."""
    totals = bench.MethodTotals()
    for tokens, ttft, peak in (([1, 2, 3], 0.1, 500.0), ([4, 5], 0.2, 300.0), ([6, 7, 8, 9], 0.6, 400.0)):
        totals.add(_turn(tokens, ttft, peak))
    row = totals.summary(None)
    assert row["peak_mem_mb"] == 500.0
    assert row["ttft_s"] == pytest.approx(0.3)
    assert row["turns"] == 3 and row["tokens"] == 9 and row["tau"] == 1.0


def _bench_serving_script():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving", path)
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # (its dataclasses look their module up)
    spec.loader.exec_module(script)
    return script


def test_bench_serving_compares_greedy_requests_only_and_refuses_temperatures_out_of_range(capsys):
    """--temperatures gives request i the i-th temperature, round robin; the text check counts only the greedy
    requests (sampled ones draw apart whatever the method), and a temperature outside 0..2 (or NaN) is refused."""
    script = _bench_serving_script()
    args = script.parse_args(["--temperatures", "0", "0.7", "1"])
    assert [script.request_temperature(args, i) for i in range(5)] == [0, 0.7, 1, 0, 0.7]

    def level(texts, temperatures):
        return script.LevelResult("m", 1, len(texts), len(texts), 1.0, 1, 1.0, 1.0, 1.0, 1.0, 0.0, *[0.0] * 6,
                                  texts=texts, temperatures=temperatures)

    ours = level(["a", "b", "c", None], [0, 0.7, 0, 0])
    assert script.same_text(ours, level(["a", "x", "y", None], [0, 0.7, 0, 0])) == (1, 3)
    assert script.same_text(level(["b"], [1.0]), level(["b"], [1.0])) == (0, 0)
    for bad in ("-0.1", "2.5", "nan"):
        with pytest.raises(SystemExit):
            script.parse_args(["--temperatures", "0", bad])
        assert f"--temperatures {float(bad)} is outside" in capsys.readouterr().err


def test_bench_serving_gives_the_baseline_its_own_arguments_and_checks_every_servers_first(capsys):
    """--server-arg went to the plain-decoding server too, which refuses a method's flags: its own help's
    --server-arg=--draft-tokens=4, and --draft-model (--method draft had no other way in), stopped the baseline
    after the speculative runs had taken their time, and no table came out."""
    from medusa_infer.serving.cli import parse_args as serve_args

    script = _bench_serving_script()
    args = script.parse_args(["--method", "draft", "--server-arg=--draft-model=smollm2-135m-instruct",
                              "--server-arg=--draft-tokens=4", "--baseline-arg=--max-prefill-tokens=512"])
    assert script.runs(args) == [("draft", "measured"), ("draft", "off"), ("autoregressive", "off")]
    for method, gate in script.runs(args):
        command = script.server_command(args, method, gate, port=8000)
        served = serve_args(command[3:])
        assert served.method == method
        assert (served.draft_model, served.draft_tokens) == (("smollm2-135m-instruct", 4) if method == "draft"
                                                             else (None, None))
        assert served.max_prefill_tokens == (512 if method == "autoregressive" else serve_args([]).max_prefill_tokens)
    with pytest.raises(SystemExit):  # refused before any server starts
        script.parse_args(["--method", "lookup", "--baseline-arg=--draft-tokens=4"])
    assert "the autoregressive server's medusa-serve refuses its arguments (above): mend its --baseline-arg" \
        in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.parse_args(["--method", "lookup", "--server-arg=--layerskip-layers=2"])
    assert "mend its --server-arg" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # bench_serving's own setting, passed on: not blamed on --server-arg
        script.parse_args(["--method", "lookup", "--threads", "100000"])
    err = capsys.readouterr().err
    assert "--threads must be at most" in err and err.splitlines()[-1].endswith("mend the setting named there")
    with pytest.raises(SystemExit):  # nor on a good --server-arg beside it
        script.parse_args(["--method", "lookup", "--threads", "100000", "--server-arg=--max-prefill-tokens=64"])
    assert capsys.readouterr().err.splitlines()[-1].endswith("mend the setting named there")
    with pytest.raises(SystemExit):  # plain decoding alone: its server takes --baseline-arg (--server-arg dropped)
        script.parse_args(["--method", "autoregressive", "--server-arg=--max-prefill-tokens=7"])
    assert "give its arguments with --baseline-arg, not --server-arg" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_serving_runs_mixed_temperatures_end_to_end(tmp_path):
    """scripts/bench_serving.py on the default model, a greedy and a sampled request at once: both methods'
    servers answer both, the greedy texts agree, and the report counts rows per step."""
    script = _bench_serving_script()
    output = tmp_path / "bench.json"
    assert script.main(["--method", "lookup", "--requests", "2", "--concurrency", "2", "--max-tokens", "6",
                        "--temperatures", "0", "1", "--ignore-eos", "--gate", "off", "--threads", "1",
                        "--output", str(output)]) == 0
    record = json.loads(output.read_text())
    assert [(r["method"], r["ok"], r["output_tokens"]) for r in record["results"]] == [
        ("lookup (gate off)", 2, 12), ("autoregressive", 2, 12)]
    assert record["same_greedy_text_as_autoregressive"] == {"lookup (gate off)@2": {"same": 1, "greedy": 1},
                                                             "autoregressive@2": {"same": 1, "greedy": 1}}
    assert all(1 <= r["rows_per_step"] <= 2 for r in record["results"])
    assert record["settings"]["temperatures"] == [0.0, 1.0]


def test_a_method_failing_on_a_batch_names_every_question_of_it(model, monkeypatch):
    """At batch size 2 the failing group holds two questions: stopped_by names both, not the first alone (M28)."""
    import re

    real = bench.Runner.run_batch
    failing = QUESTIONS[2]["turns"][0]

    def run_batch(self, method, conversations, **kwargs):
        if method == "ar" and any(c[0]["content"] == failing for c in conversations):
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(self, method, conversations, **kwargs)

    monkeypatch.setattr(bench.Runner, "run_batch", run_batch)
    report = benchmark(model, QUESTIONS, args(methods=["hf", "ar"], batch_size=2))
    said = re.fullmatch(r"method ar on question\(s\) (.+): RuntimeError: CUDA out of memory \(simulated\)",
                        report["settings"]["stopped_by"])
    assert said, report["settings"]["stopped_by"]
    ids = said.group(1).split(", ")
    assert len(ids) == 2 and str(QUESTIONS[2]["id"]) in ids


def test_the_report_names_the_excluded_ids_left_out():
    """--exclude-ids is said in the report's sentence, beside the calibration's questions or alone (M46)."""
    from medusa_train.benchmark import _left_out_note

    assert _left_out_note({"exclude_ids": ["7", "q3"], "calibration": [], "calibrated_here": False}) == \
        " Drawn from the file's questions but --exclude-ids 7,q3."
    assert _left_out_note({"exclude_ids": ["7"], "calibration": [1, 2], "calibrated_here": True}) == \
        " Drawn from the file's questions but the 2 the heads were calibrated on in this run (1, 2) and " \
        "--exclude-ids 7."
    assert _left_out_note({"exclude_ids": [], "calibration": [], "calibrated_here": False}) == ""
