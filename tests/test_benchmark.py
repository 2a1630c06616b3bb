"""medusa-bench on a tiny model: the protocol, the report's fields, calibration and the CLI."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from medusa_infer.model import MedusaModel
from medusa_infer.serving.testing import word_tokenizer
from medusa_train.benchmark import (
    benchmark,
    calibrate,
    head_topk_accuracy,
    load_questions,
    main,
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
    values = dict(methods=["hf", "hf-lookup", "ar", "medusa", "medusa-lossless", "lookup"], max_new_tokens=8,
                  tree="tree-8", lookup_tokens=4, temperature=0.7, seed=0, draft_model=None, model="tiny",
                  heads="tiny-heads", questions="q.jsonl", limit=None, calibrate_context=16)
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


def test_calibration_measures_accuracy_and_cost_and_fits_a_tree(model):
    result = calibrate(model, QUESTIONS[:2], args())
    config = model.config
    assert len(config.head_accuracies) == 4 and len(config.head_accuracies[0]) == config.top_k
    assert all(0 <= a <= 1 for row in config.head_accuracies for a in row)
    assert config.cost_profile["sizes"][0] == 1 and "head_overhead" in config.cost_profile
    assert result["table"][0]["nodes"] == 0
    assert (config.tree is None) == (result["tree_nodes"] == 0)


def test_head_accuracy_counts_the_token_d_plus_2_ahead(model):
    """A head that copies its input hidden state is the base head: rank it against the sequence
    the base model generates itself, where head 0's top-1 is right exactly when the token after
    next equals the next token's argmax one position later."""
    seq = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    acc = head_topk_accuracy(model, [(seq, 2)], top_k=10)
    assert len(acc) == 4 and all(len(row) == 10 for row in acc)
    assert all(0.0 <= sum(row) <= 1.0 + 1e-9 for row in acc)
    identity = MedusaModel.from_base(model.base_model, num_heads=1, tokenizer=model.tokenizer)
    with torch.no_grad():
        greedy = model.base_model.generate(seq[None], max_new_tokens=12, do_sample=False, eos_token_id=None,
                                           pad_token_id=0)[0]
    acc = head_topk_accuracy(identity, [(greedy, len(seq))], top_k=1)
    logits = model.base_model(greedy[None]).logits[0].argmax(-1)
    positions = range(len(seq) - 1, len(greedy) - 2)
    expected = sum(int(logits[t] == greedy[t + 2]) for t in positions) / len(positions)
    assert acc[0][0] == pytest.approx(expected)


def test_cli_writes_the_report_files(model, tmp_path, monkeypatch):
    heads = tmp_path / "heads"
    model.save_pretrained(heads)
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    import medusa_infer.models as models

    monkeypatch.setattr(models, "load_base_model", lambda name, **kw: model.base_model)
    monkeypatch.setattr(models, "load_tokenizer", lambda name, **kw: model.tokenizer)
    out = tmp_path / "bench"
    assert main(["--heads", str(heads), "--questions", str(questions), "--limit", "3", "--max-new-tokens", "6",
                 "--methods", "hf,ar,medusa", "--tree", "tree-8", "--output", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report["methods"]) == {"hf", "ar", "medusa"}
    assert (out / "report.md").read_text().startswith("# medusa-bench")
    assert (out / "report.png").stat().st_size > 1000
