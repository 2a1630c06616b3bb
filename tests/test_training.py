"""Training Medusa heads on tiny models: losses, targets, the feature cache, frozen weights,
exact resume after kill -9, Medusa-2 at step 0, and multi-process launches."""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from medusa_infer.datastore import SEPARATOR
from medusa_infer.model import MedusaModel
from medusa_train import trainer as tr
from medusa_train.features import (
    FeatureCache,
    MANIFEST,
    FeatureDataset,
    block_from_hidden,
    build_feature_cache,
    choose_token_map,
    head_targets,
    model_fingerprint,
    pad_batch,
    token_counts,
)
from medusa_infer.models import weights_identity
from medusa_train.losses import (
    IGNORE,
    OUT_OF_VOCAB,
    head_ce_loss,
    head_kl_loss,
    head_weights,
    logits_kl,
    to_head_vocab,
    topk_correct,
)
from medusa_train.train_config import config_from_dict, run_paths
from tiny import VOCAB, tiny_model

REPO = Path(__file__).resolve().parents[1]
TOKENS = 24  # the counting task uses ids 3..26


def counting_examples(n: int, seed: int = 0) -> list[dict]:
    """Sequences that count upward modulo 24 from a random start; the first few are the prompt."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        start, length, prompt = rng.randrange(TOKENS), rng.randrange(20, 40), rng.randrange(3, 8)
        ids = [3 + (start + j) % TOKENS for j in range(length)]
        examples.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})
    return examples


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny llama saved as a model folder, and counting examples as a tokenised JSONL."""
    folder = tmp_path_factory.mktemp("tiny")
    tiny_model("llama").save_pretrained(folder / "model")
    with (folder / "examples.jsonl").open("w") as handle:
        for example in counting_examples(64):
            handle.write(json.dumps(example) + "\n")
    return folder


def recipe(tiny_dir: Path, out: Path, **sections) -> dict:
    values = {
        "output_dir": str(out),
        "model": {"name": str(tiny_dir / "model")},
        "data": {"tokenized": str(tiny_dir / "examples.jsonl"), "heldout_fraction": 0.2},
        "heads": {"num_heads": 3, "num_layers": 1, "projection": "own"},
        "features": {"topk": 5, "batch_size": 8},
        "training": {"lr": 0.01, "epochs": 2, "batch_tokens": 128, "warmup_ratio": 0.0},
        "log": {"every": 1, "progress": False},
        "eval": {"tree_size": 8},
    }
    for name, updates in sections.items():
        values[name] = {**values.get(name, {}), **updates} if isinstance(updates, dict) else updates
    return values


def write_recipe(path: Path, values: dict) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


def quiet_env(tmp_path: Path) -> dict[str, str]:
    """Keep wandb, torchrun, DeepSpeed and caches out of $HOME and the shared /tmp."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ)
    cache = env.get("MEDUSA_FORGE_CACHE", str(Path("~/.cache/medusa-forge").expanduser()))
    env.update(HOME=str(home), TMPDIR=str(home), WANDB_MODE="offline", WANDB_DIR=str(home),
               # DeepSpeed's CPU ops (its shared-memory collectives) are compiled once, not in every test
               TORCH_EXTENSIONS_DIR=str(Path(cache) / "torch_extensions"), TRITON_CACHE_DIR=str(home / "triton"),
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), TOKENIZERS_PARALLELISM="false",
               MEDUSA_FORGE_CACHE=cache)
    return env


def run_script(args: list[str], env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def free_port() -> int:
    """A TCP port nothing listens on now, picked by the OS: a fixed port collides with another job's launch on a
    shared CI machine (torch.distributed's store then fails with EADDRINUSE)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def train_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "logs" / "train.jsonl").read_text().splitlines()]


def final_heads(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "checkpoints" / "final" / "model.safetensors"))


# ---------------------------------------------------------------------------------------------
# Losses and targets, by hand


def test_head_targets_are_labels_k_plus_2_ahead():
    labels = torch.tensor([IGNORE, IGNORE, 10, 11, 12, 13])
    targets = head_targets(labels, 3)
    assert targets.shape == (6, 3)
    assert targets[0].tolist() == [10, 11, 12]  # head k at t=0 predicts position k + 2
    assert targets[2].tolist() == [12, 13, IGNORE]
    assert targets[4].tolist() == [IGNORE, IGNORE, IGNORE]


def test_head_weights_decay_and_normalise():
    weights = head_weights(3, 0.5)
    assert torch.allclose(weights, torch.tensor([1.0, 0.5, 0.25]) / 1.75)


def test_ce_loss_matches_hand_computation():
    logits = torch.zeros(2, 3, 4)  # K=2 heads, N=3 positions, V=4
    logits[0, 0] = torch.tensor([2.0, 0.0, 0.0, 0.0])
    logits[1, 1] = torch.tensor([0.0, 1.0, 0.0, 0.0])
    targets = torch.tensor([[0, IGNORE], [1, 1], [IGNORE, OUT_OF_VOCAB]])
    out = head_ce_loss(logits, targets, decay=0.5)
    ce_head0 = (-math.log(math.e**2 / (math.e**2 + 3)) + math.log(4)) / 2  # positions 0 and 1
    ce_head1 = -math.log(math.e / (math.e + 3))  # position 1 only
    assert out.counts.tolist() == [2, 1]
    assert torch.allclose(out.per_head, torch.tensor([ce_head0, ce_head1]), atol=1e-6)
    assert math.isclose(float(out.loss), (ce_head0 + 0.5 * ce_head1) / 1.5, rel_tol=1e-6)
    halved = head_ce_loss(logits, targets, decay=0.5, denominators=torch.tensor([4.0, 2.0]))
    assert torch.allclose(halved.per_head, out.per_head / 2, atol=1e-6)


def test_kl_loss_matches_hand_computation_and_drops_missing_candidates():
    q = torch.tensor([0.5, 0.25, 0.125, 0.125])
    logits = q.log().view(1, 1, 4)  # one head, one position
    soft_ids = torch.tensor([[[0, 1, -1]]])  # the third candidate is outside the head vocabulary
    soft_probs = torch.tensor([[[0.3, 0.3, 0.4]]])
    out = head_kl_loss(logits, soft_ids, soft_probs)
    p = torch.tensor([0.5, 0.5])  # renormalised over the candidates the head can score
    expected = float((p * (p.log() - q[:2].log())).sum())
    assert math.isclose(float(out.loss), expected, rel_tol=1e-5)
    exact = head_kl_loss(logits, torch.tensor([[[0, 1, 2, 3]]]), q.view(1, 1, 4))
    assert abs(float(exact.loss)) < 1e-6
    empty = head_kl_loss(logits, soft_ids, torch.zeros(1, 1, 3))
    assert out.counts.tolist() == [1] and empty.counts.tolist() == [0] and float(empty.loss) == 0.0
    # the candidates the head can score hold a tiny mass (the top one outside its vocabulary): renormalised all the
    # same (a floor of 1e-12 left 2e-13 unnormalised: a KL of -0.32, its gradient shrunk by that mass)
    tiny = head_kl_loss(logits, soft_ids, torch.tensor([[[1e-13, 1e-13, 1.0]]]))
    assert math.isclose(float(tiny.loss), expected, rel_tol=1e-5)


def test_logits_kl_and_topk_accuracy():
    a = torch.randn(5, 7)
    assert float(logits_kl(a, a)) == pytest.approx(0.0, abs=1e-6)
    assert float(logits_kl(a, a + torch.randn(5, 7))) > 0
    logits = torch.tensor([[[0.1, 0.9, 0.0], [0.8, 0.1, 0.1]]])  # K=1, N=2, V=3
    hits, totals = topk_correct(logits, torch.tensor([[1], [2]]), max_k=3)
    assert hits.tolist() == [[1, 1, 2]] and totals.tolist() == [2]
    hits, totals = topk_correct(logits, torch.tensor([[OUT_OF_VOCAB], [IGNORE]]), max_k=2)
    assert hits.tolist() == [[0, 0]] and totals.tolist() == [1]


def test_a_loss_term_with_fewer_positions_than_micro_batches_keeps_its_gradient():
    """A head (or the base KL) with fewer positions in a step than processes x micro-batches: its
    step denominator is below 1, and must not be raised to 1 (its gradient was halved on 2 processes
    or with 2 accumulated micro-batches, against one process with the whole batch)."""

    class Accelerator:  # `world` processes, each holding its share; reduce adds every process's counts
        device = "cpu"

        def __init__(self, world, everyone):
            self.num_processes, self.everyone = world, everyone

        def reduce(self, tensor, reduction):
            return sum(self.everyone)

    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5, requires_grad=True)
    targets = torch.tensor([[1, 3], [2, IGNORE], [0, IGNORE], [4, IGNORE]])  # head 2: one target in the step
    teacher = torch.randn(4, 7)
    student = torch.randn(4, 7, requires_grad=True)
    base_mask = torch.tensor([True, False, False, False])  # the base KL: one position in the step

    def gradients(parts):  # parts[process][micro-batch]: positions; accelerate / DDP average the rest
        world, accum = len(parts), len(parts[0])
        counts = [[{"heads": (targets[p] >= 0).sum(0), "base": base_mask[p].sum().reshape(1)} for p in proc]
                  for proc in parts]
        everyone = [torch.cat([sum(c[n].float() for c in proc) for n in ("heads", "base")]) for proc in counts]
        heads, base = torch.zeros_like(logits), torch.zeros_like(student)
        for proc, cnt in zip(parts, counts):
            denominators = tr.step_denominators(Accelerator(world, everyone), cnt)
            for p in proc:
                logits.grad = student.grad = None
                loss = head_ce_loss(logits[:, p], targets[p], 0.8, denominators["heads"]).loss
                loss = loss + logits_kl(student[p], teacher[p], base_mask[p], denominators["base"][0])
                loss.div(accum).backward()
                heads += logits.grad / world
                base += student.grad / world
        return heads, base

    one = gradients([[torch.arange(4)]])
    for parts in ([[torch.tensor([0, 1])], [torch.tensor([2, 3])]], [[torch.tensor([0, 1]), torch.tensor([2, 3])]]):
        for got, want in zip(gradients(parts), one):
            torch.testing.assert_close(got, want)


def test_a_log_window_across_the_heads_only_stage_averages_base_kl_over_joint_steps():
    """Medusa-2's base KL exists only on joint micro-steps: a log window holding heads-only steps too
    averages it over the steps that measured it (it was divided by all of them)."""
    from types import SimpleNamespace

    window, measured = {}, {}
    for step in range(4):  # stage1_steps=2, log.every=4
        metrics = {"loss": torch.tensor(1.0 + step), "top1_hits": torch.tensor([1.0]), "top1_total": torch.tensor([2.0])}
        if step >= 2:
            metrics["base_kl"] = torch.tensor(0.5)
        tr.add_to_window(window, measured, metrics, "cpu")
    record = tr._summarise(SimpleNamespace(num_processes=1), window, measured, 4, 0.0)
    assert record["base_kl"] == 0.5 and record["loss"] == 2.5 and record["head_top1"] == [0.5]
    # to the digits a float32 holds (the log and the card's training record showed 3.893430471420288)
    window, measured = {}, {}
    for step in range(3):
        tr.add_to_window(window, measured, {"loss": torch.tensor(1.0 + (step == 0)), "top1_hits": torch.tensor([1.0]),
                                            "top1_total": torch.tensor([3.0])}, "cpu")
    record = tr._summarise(SimpleNamespace(num_processes=1), window, measured, 3, time.perf_counter() - 0.7)
    assert record["loss"] == 1.333333 and record["head_top1"] == [0.3333]
    assert 0 < record["units_per_s"] <= 3 / 0.7 and record["units_per_s"] == float(f"{record['units_per_s']:.7g}")


def test_a_log_windows_head_loss_is_pooled_over_its_positions():
    """A step without positions for head 2 adds none to its loss (its mean of 0 halved the window's mean),
    and a head the window gave no positions is logged as None, not 0 (its loss, and its top-1 accuracy)."""
    from types import SimpleNamespace

    window, measured = {}, {}
    steps = [([6.0, 3.0, 0.0], [3, 1, 0]), ([2.0, 0.0, 0.0], [1, 0, 0])]
    for sums, counts in steps:
        metrics = {"loss": torch.tensor(1.0), "top1_hits": torch.tensor([1.0, 0.0, 0.0]),
                   "top1_total": torch.tensor([2.0, 1.0, 0.0]), "head_loss_sum": torch.tensor(sums),
                   "head_loss_count": torch.tensor(counts, dtype=torch.float32)}
        tr.add_to_window(window, measured, metrics, "cpu")
    record = tr._summarise(SimpleNamespace(num_processes=1), window, measured, 4, 0.0)
    assert record["head_loss"] == [2.0, 3.0, None]
    assert record["head_top1"] == [0.5, 0.0, None]


def test_heldout_accuracy_counts_only_positions_where_decoding_runs_the_heads():
    from medusa_train.evaluate import head_accuracy

    # K=2 heads, 3 positions. Position 0 sits in the chat template just before the answer: head 1
    # has a target there (an answer token two ahead) but head 0 does not, and decoding never runs
    # heads there. Head 1 is right only at that position.
    targets = torch.tensor([[IGNORE, 1], [2, 0], [1, IGNORE]])
    logits = torch.zeros(2, 3, 3)
    logits[0, torch.arange(3), torch.tensor([0, 2, 1])] = 1.0  # head 0: wrong, right, right
    logits[1, torch.arange(3), torch.tensor([1, 2, 0])] = 1.0  # head 1: right, wrong, -
    batch = {"hidden": torch.zeros(3, 4), "targets": targets, "next_tokens": torch.zeros(3, dtype=torch.long)}
    accuracy = head_accuracy(lambda hidden, next_tokens: logits, [batch], top_k=1)
    assert accuracy.totals.tolist() == [2, 1]
    assert accuracy.topk() == [[1.0], [0.0]]
    assert accuracy.ranks.tolist() == [[0, -1], [0, -1]]  # the same positions as the ranks
    assert accuracy.starts is None  # the batches said nothing of where answers begin
    batch["run_start"] = torch.tensor([False, True, False])
    assert head_accuracy(lambda hidden, next_tokens: logits, [batch], top_k=1).starts.tolist() == [True, False]
    # held-out answers too short for the heads to run anywhere (live examples come as batches, empty ones too):
    # finalize failed after training ("ranks must be a non-empty ..."), the cache's path blamed the fraction alone
    empty = {"hidden": torch.zeros(0, 4), "targets": torch.zeros(0, 2, dtype=torch.long),
             "next_tokens": torch.zeros(0, dtype=torch.long)}
    for batches in ([empty, empty], []):
        with pytest.raises(ValueError, match=r"no held-out positions where the heads run .* or give longer answers"):
            head_accuracy(lambda hidden, next_tokens: torch.zeros(2, len(hidden), 3), batches, top_k=1)


def test_tokens_per_step_walk_the_answers_as_greedy_decoding_does():
    """Decoding runs the heads where the last step ended: an easy stretch is crossed in one step, so
    hard positions weigh more than in the average over every position."""
    from medusa_train.evaluate import HeadAccuracy, expected_tokens_per_step, stored_paths, walked_tokens_per_step

    tree = [(0,), (0, 0)]
    easy, hard = [0, 0], [-1, -1]
    # one answer: three easy positions then three hard ones (7 tokens); another: two easy (3 tokens)
    ranks = torch.tensor([easy] * 3 + [hard] * 3 + [easy] * 2)
    starts = torch.tensor([True] + [False] * 5 + [True, False])
    accuracy = HeadAccuracy(torch.zeros(2, 1), torch.tensor([8, 8]), ranks, starts)
    # by hand, the first token of each the prefill's: 3 + 1 + 1 + 1 tokens in 4 steps, then 2 tokens in 1 step
    # (the first token was counted as a step's: 10 tokens in 6 steps, above and below decoding's tau at once)
    assert walked_tokens_per_step(tree, accuracy) == pytest.approx(8 / 5)
    assert expected_tokens_per_step(tree, stored_paths(accuracy, 2)) == pytest.approx((5 * 3 + 3 * 1) / 8)
    assert walked_tokens_per_step([], accuracy) == 1.0
    assert walked_tokens_per_step(tree, HeadAccuracy(torch.zeros(2, 1), torch.tensor([8, 8]), ranks)) is None


RECIPE_HEADS = {"projection": "own", "next_token_input": True, "path_input": True}  # + a reduced vocabulary


@pytest.mark.parametrize("arch, heads", [("llama", {"next_token_input": False}), ("llama", {"next_token_input": True}),
                                         ("llama", RECIPE_HEADS), ("gemma3_text", RECIPE_HEADS)],
                         ids=["plain", "next-token", "recipe", "recipe-gemma3"])
def test_walked_tokens_per_step_is_the_tau_greedy_decoding_measures(arch, heads, tmp_path):
    """Held-out answers that are the model's own greedy answers: the walk over them gives exactly the tau
    that decoding them with the same tree measures (it counted each answer's first token, the prefill's,
    as a step's: about (tau - 1) / length off, either way). Also for the recipes' heads (their own
    projections over a reduced vocabulary, next-token and path inputs; on Gemma-3 too), saved and loaded as
    decoding loads them: what training measures is what decoding does."""
    import copy

    from medusa_infer.decoding import generate
    from medusa_train.evaluate import head_accuracy, walked_tokens_per_step
    from medusa_train.features import batch_hidden
    from medusa_train.trainer import HeadsModule

    base = tiny_model(arch, seed=1)
    token_map = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:80] if "path_input" in heads else None
    trained = MedusaModel.from_base(base, num_heads=3, token_map=token_map, **heads)
    torch.manual_seed(2)
    for parameter in trained.heads.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    trained.save_pretrained(tmp_path / "heads", base_model_id="tiny")
    model = MedusaModel.from_pretrained(tmp_path / "heads", base_model=base)
    tree = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    examples, step_tokens, steps = [], 0, 0
    for prompt in ([1, 5, 9, 14, 22, 7, 30], [1, 7, 30, 5, 9, 3], [1, 44, 12, 3, 8]):
        out = generate(model, torch.tensor([prompt]), max_new_tokens=40, tree=tree, adaptive=False, eos_token_id=[])
        examples.append({"input_ids": out.sequences[0].tolist(),
                         "labels": [IGNORE] * len(prompt) + out.sequences[0].tolist()[len(prompt):]})
        step_tokens, steps = step_tokens + out.metrics.step_tokens, steps + out.metrics.steps
    batch = pad_batch(examples)
    with torch.no_grad():
        block = block_from_hidden(batch_hidden(model, batch), batch["input_ids"], batch["labels"], batch["lengths"])
    rows = FeatureDataset(block, 3, trained.heads.token_map, trained.config.vocab_size)
    module = HeadsModule(copy.deepcopy(trained.heads), trained.lm_head.weight, None, trained.logit_softcap,
                         trained.base_model.get_input_embeddings().weight).eval()
    walked = walked_tokens_per_step(tree, head_accuracy(module, rows.sequential(1000), top_k=10))
    assert steps < step_tokens and walked == pytest.approx(step_tokens / steps, abs=1e-12)


def test_rows_are_the_positions_where_decoding_runs_the_heads_in_every_turn():
    """From each turn's last prompt position (the base model predicts the answer's first token
    there) to two before its last answer token; not at the assistant header before it, where head 0
    has a target but decoding never runs the heads."""
    from medusa_train.evaluate import head_accuracy

    # two assistant turns: [10, 11, 12] after prompt positions 0..3, [20, 21, 22, 23] after 6..8
    labels = [IGNORE] * 4 + [10, 11, 12] + [IGNORE] * 3 + [20, 21, 22, 23] + [IGNORE]
    example = {"input_ids": [5 if x == IGNORE else x for x in labels], "labels": labels}
    batch = pad_batch([example])
    block = block_from_hidden(torch.randn(1, len(labels), 4), batch["input_ids"], batch["labels"], batch["lengths"])
    assert block["row_position"].tolist() == [3, 4, 9, 10, 11]
    assert block["soft_position"].tolist() == [3, 4, 5, 9, 10, 11, 12]  # the base model's predictions
    data = FeatureDataset(block, 2, None, 30)
    accuracy = head_accuracy(lambda hidden, next_tokens, **_: torch.randn(2, len(hidden), 30),
                             data.sequential(100), top_k=5)
    assert accuracy.totals.tolist() == [5, 3]  # labelled tokens less one per turn, then less one more


def test_end_of_turn_ids_from_examples_and_from_a_cache_agree(tmp_path):
    from medusa_train.features import end_of_turn_ids

    labels = [[IGNORE, 5, 6, IGNORE, 7], [8, 9], [IGNORE, 4, IGNORE]]
    flat = torch.tensor([x for row in labels for x in row])
    # 6 and 4 end turns inside their examples; 7 and 9 run to their examples' ends (maybe a cut answer)
    assert end_of_turn_ids(flat, torch.tensor([5, 2, 3]), [2]) == [2, 4, 6]
    examples = [{"input_ids": [3 + abs(x) % 20 for x in row], "labels": row} for row in labels]
    model = MedusaModel.from_base(tiny_model("llama"), num_heads=1)
    cache = FeatureCache.load(build_feature_cache(model, examples, tmp_path, {"name": "t"}, topk=0, progress=False))
    assert cache.end_of_turn_ids() == end_of_turn_ids(flat, torch.tensor([5, 2, 3]), cache.manifest["eos_token_ids"])


def test_reduced_vocabulary_keeps_end_of_turn_and_most_frequent():
    labels = torch.tensor([5, 5, 5, 7, 7, 9, IGNORE, 2])
    token_map = choose_token_map(token_counts(labels, 12), 3, always=[11])
    assert token_map.tolist() == [11, 5, 7]
    columns = to_head_vocab(torch.tensor([7, 9, IGNORE, 11]), token_map, 12)
    assert columns.tolist() == [2, OUT_OF_VOCAB, IGNORE, 0]


# ---------------------------------------------------------------------------------------------
# Feature cache


def test_feature_cache_round_trip_equals_live_forward(tiny_dir, tmp_path):
    model = MedusaModel.from_base(tiny_model("llama"), num_heads=1)
    examples = counting_examples(11, seed=3)
    info = model_fingerprint(str(tiny_dir / "model"), "float32")
    folder = build_feature_cache(model, examples, tmp_path, info, topk=4, batch_size=4, shard_examples=5,
                                 progress=False)
    assert len(list(folder.glob("shard-*.safetensors"))) == 3
    cache = FeatureCache.load(folder)
    data = FeatureDataset(cache.block, 3, None, model.config.vocab_size, soft=True)
    block = cache.block
    assert torch.equal(cache.lm_head["weight"], model.lm_head.weight)
    for e in range(len(block["example_index"])):
        example = examples[int(block["example_index"][e])]
        ids = torch.tensor([example["input_ids"]])
        with torch.no_grad():
            out = model(ids)
            logits = model.project(out.hidden_states[0])
        rows = (block["row_example"] == e).nonzero().squeeze(1)
        positions = block["row_position"][rows]
        labels = torch.tensor(example["labels"])
        # where decoding runs the heads (an answer token at t + 1) and head 0 has a target (t + 2)
        decoded = [t for t in range(len(labels) - 2) if labels[t + 1] != IGNORE and labels[t + 2] != IGNORE]
        assert positions.tolist() == decoded
        torch.testing.assert_close(data.hidden[rows], out.hidden_states[0, positions], atol=1e-5, rtol=1e-5)
        assert torch.equal(data.targets[rows], head_targets(labels, 3)[positions])
        batch = data.batch(rows)
        for k in range(3):  # head k's soft target is the base distribution at t + k + 1
            for r, t in enumerate(positions.tolist()):
                if t + k + 2 < len(labels) and labels[t + k + 2] != IGNORE:
                    probs = torch.softmax(logits[t + k + 1], -1).topk(4)
                    assert batch["soft_ids"][r, k].tolist() == probs.indices.tolist()
                    torch.testing.assert_close(batch["soft_probs"][r, k], probs.values, atol=1e-5, rtol=1e-4)
                else:
                    assert float(batch["soft_probs"][r, k].sum()) == 0.0
    # The same model and data find the same cache again without running the model.
    again = build_feature_cache(None, examples, tmp_path, info, topk=4, shard_examples=5, progress=False)
    assert again == folder
    # more soft-label candidates than the vocabulary: a RuntimeError after the first forward, naming neither
    with pytest.raises(ValueError, match=f"features.topk={VOCAB + 1} soft-label candidates exceed the model's "
                                         f"vocabulary of {VOCAB} tokens; set features.topk to at most {VOCAB}"):
        build_feature_cache(model, examples, tmp_path, info, topk=VOCAB + 1, progress=False)
    # a build cut off before its manifest, with a shard left damaged (a power loss between its write and
    # its rename): the damaged shard is built again, the others kept (it stopped every later build)
    from safetensors.torch import load_file

    def shards():
        found = {}  # copies: the files are rewritten below, under any view of them
        for path in sorted(folder.glob("shard-*.safetensors")):
            found[path.name] = {k: v.clone() for k, v in load_file(str(path)).items()}
        return found

    whole, damaged = shards(), (folder / "shard-00001.safetensors").read_bytes()
    (folder / "manifest.json").unlink()
    # empty, header cut, data cut, a header length past the file (an OverflowError or MemoryError stopped every build)
    for damage in (b"", damaged[:200], damaged[:-16], b"\xff" * 8 + damaged[8:], (10**12).to_bytes(8, "little")):
        (folder / "shard-00001.safetensors").write_bytes(damage)
        assert build_feature_cache(model, examples, tmp_path, info, topk=4, batch_size=4, shard_examples=5,
                                   progress=False) == folder
        found = shards()
        assert found.keys() == whole.keys()
        assert all(torch.equal(found[n][k], whole[n][k]) for n in whole for k in whole[n])
        (folder / "manifest.json").unlink()
    # damaged after its manifest was written: loading named no file (a bare SafetensorError) and building
    # again kept the finished cache as it was, so every later run stopped alike
    build_feature_cache(model, examples, tmp_path, info, topk=4, batch_size=4, shard_examples=5, progress=False)
    (folder / "shard-00001.safetensors").write_bytes(damaged[:-16])
    with pytest.raises(ValueError, match=r"shard-00001.safetensors cannot be read .* the feature cache .* is damaged"):
        FeatureCache.load(folder)
    assert build_feature_cache(model, examples, tmp_path, info, topk=4, batch_size=4, shard_examples=5,
                               progress=False) == folder
    found = shards()
    assert all(torch.equal(found[n][k], whole[n][k]) for n in whole for k in whole[n])
    FeatureCache.load(folder)
    head = (folder / "lm_head.safetensors").read_bytes()  # its lm_head file too (was never built again)
    (folder / "lm_head.safetensors").write_bytes(head[:-16])
    with pytest.raises(ValueError, match=r"lm_head.safetensors cannot be read"):
        FeatureCache.load(folder)
    build_feature_cache(model, examples, tmp_path, info, topk=4, batch_size=4, shard_examples=5, progress=False)
    assert (folder / "lm_head.safetensors").read_bytes() == head
    # a killed build's temporary files (as large as a shard) are removed by the next build, a live process's kept
    import socket
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    host = socket.gethostname()
    dead, alive, recent = (folder / f"shard-0000{i}.safetensors.{host}-{pid}.tmp"
                           for i, pid in ((1, gone.pid), (2, os.getpid()), (0, gone.pid)))
    # another machine's (whose name ends as this one's: "gpu" and "gpu-12"), and an earlier release's names
    other, earlier = folder / f"shard-00001.safetensors.{host}-12-{gone.pid}.tmp", folder / "shard-00002.tmp"
    huge = folder / f"shard-00003.safetensors.{host}-{2**70}.tmp"  # no pid is that large: kept for good
    for file in (dead, alive, recent, other, earlier, huge, folder / "manifest.json.tmp"):
        file.write_bytes(b"x")
        if file is not recent:  # untouched for an hour (a file being written is touched as it grows)
            os.utime(file, (time.time() - 3600, time.time() - 3600))
    (folder / "manifest.json").unlink()
    build_feature_cache(model, examples, tmp_path, info, topk=4, batch_size=4, shard_examples=5, progress=False)
    assert sorted(p.name for p in folder.glob("*.tmp")) == sorted(p.name for p in (alive, recent, other))
    # ... and by a build that finds the cache complete (a run restarted within the 10 minutes finished it)
    os.utime(recent, (time.time() - 3600, time.time() - 3600))
    build_feature_cache(model, examples, tmp_path, info, topk=4, batch_size=4, shard_examples=5, progress=False)
    assert sorted(p.name for p in folder.glob("*.tmp")) == sorted(p.name for p in (alive, other))


def test_a_cache_folder_whose_dead_temporaries_cannot_be_removed_is_still_read(tmp_path, monkeypatch, caplog):
    """A shared cache this user only reads: removing another user's killed build's file fails, and is said."""
    import socket
    from pathlib import Path as PathType

    from medusa_train import features

    stale = tmp_path / f"shard-00000.safetensors.{socket.gethostname()}-999999999.tmp"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))

    def refuse(self, missing_ok=False):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(PathType, "unlink", refuse)
    with caplog.at_level("WARNING", logger="medusa_train.features"):
        features.remove_dead_temporaries(tmp_path)
    assert stale.exists() and "could not be removed" in caplog.text


def test_what_a_killed_run_leaves_half_written_is_cleared_by_the_next(tiny_dir, tmp_path):
    """A half-written features/index.json (killed, or a full disk) stopped every later run and --plan with a bare
    JSON error; a killed extraction's shard-sized temporary stayed for good once a later run finished the cache
    (reuse never cleaned); a checkpoint side folder of a step not saved again (save_every changed) was never
    removed."""
    import socket

    import train_heads

    out = tmp_path / "run"
    config_file = str(write_recipe(tmp_path / "r.yaml", recipe(tiny_dir, out, training={
        "max_steps": 6, "save_every": 2, "seed": 3, "keep_checkpoints": 2})))
    assert train_heads.main(["--config", config_file]) == 0
    index = out / "features" / "index.json"
    cache = out / "features" / json.loads(index.read_text())["train"]
    index.write_text(index.read_text()[:20])
    (cache / "manifest.json").write_text("")
    dead = cache / f"shard-00000.safetensors.{socket.gethostname()}-999999999.tmp"
    dead.write_bytes(b"x" * 64)
    os.utime(dead, (time.time() - 3600, time.time() - 3600))
    stale = out / "checkpoints" / "step-00000003.partial"
    stale.mkdir()
    for done in (out / "heads", out / "checkpoints" / "final", out / "checkpoints" / "step-00000004"):
        shutil.rmtree(done)  # (resumed from step 2: step 4 saved again)
    assert train_heads.main(["--config", config_file, "--plan"]) == 0
    assert train_heads.main(["--config", config_file]) == 0
    assert json.loads(index.read_text())["train"] == cache.name and json.loads((cache / "manifest.json").read_text())
    assert not stale.exists() and (out / "checkpoints" / "step-00000004").is_dir()
    dead.write_bytes(b"x" * 64)  # left by a killed extraction that a later run finished: gone at the next reuse
    os.utime(dead, (time.time() - 3600, time.time() - 3600))
    shutil.rmtree(out / "heads")
    shutil.rmtree(out / "checkpoints" / "final")  # (resumed from step 4: the features are read)
    assert train_heads.main(["--config", config_file]) == 0
    assert not dead.exists()


def test_a_run_sharing_features_dir_is_planned_with_the_caches_another_run_built(tiny_dir, tmp_path, capsys):
    """--plan read only the run folder's feature index: a run sharing features.dir with one that had built its
    caches was planned to extract them again, its steps given as a bound, while the run reused them."""
    import train_heads
    from medusa_train.train_config import plan

    shared = {"topk": 5, "batch_size": 8, "dir": str(tmp_path / "features")}
    first = recipe(tiny_dir, tmp_path / "a", features=shared)
    assert train_heads.main(["--config", str(write_recipe(tmp_path / "a.yaml", first))]) == 0
    second = recipe(tiny_dir, tmp_path / "b", features=shared)
    planned = plan(config_from_dict(second))
    assert [s.done for s in planned.stages if s.name == "features"] == [True] and planned.exact
    assert planned.train_units == plan(config_from_dict(first)).train_units
    # the run did reuse them, as planned
    capsys.readouterr()
    assert train_heads.main(["--config", str(write_recipe(tmp_path / "b.yaml", second))]) == 0
    assert "features: reusing" in capsys.readouterr().out
    # another run's settings (another split) are not this one's
    other = plan(config_from_dict(second, ["training.seed=9"]))
    assert [s.done for s in other.stages if s.name == "features"] == [False]
    assert not list((tmp_path / "features").rglob("*.partial"))
    # a shared folder this user only reads: the run ended in a traceback writing the index it holds as is
    from pathlib import Path as PathType

    write = PathType.write_text

    def read_only(self, *args, **kwargs):
        if str(self).startswith(str(tmp_path / "features")):
            raise PermissionError(13, "Permission denied", str(self))
        return write(self, *args, **kwargs)

    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PathType, "write_text", read_only)
        third = recipe(tiny_dir, tmp_path / "c", features=shared)
        assert train_heads.main(["--config", str(write_recipe(tmp_path / "c.yaml", third))]) == 0
        assert "could not be written" not in capsys.readouterr().out  # (the same index: not written again)
        (tmp_path / "features" / "indexes").rename(tmp_path / "features" / "indexes-aside")
        fourth = recipe(tiny_dir, tmp_path / "d", features=shared)
        assert train_heads.main(["--config", str(write_recipe(tmp_path / "d.yaml", fourth))]) == 0
        out = capsys.readouterr().out
    assert "features: reusing" in out and "could not be written (" in out and "Permission denied" in out


def test_two_runs_building_one_shared_feature_cache_at_once_both_finish(tmp_path):
    """Runs sharing features.dir (a sweep started together) wrote one temporary file per shard and moved each
    other's away: the later run failed (FileNotFoundError)."""
    import subprocess
    import sys
    import textwrap
    import time

    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        torch.set_num_threads(1)
        import medusa_train.features as features
        from medusa_infer.model import MedusaModel
        from test_training import counting_examples
        from tiny import tiny_model
        model = MedusaModel.from_base(tiny_model("llama"), num_heads=1)
        write = features.save_file
        def slow(*args, **kwargs):  # a large shard on a slow disk: the other run writes meanwhile
            write(*args, **kwargs)
            time.sleep(0.4)
        features.save_file = slow
        start = float(sys.argv[1])
        while time.time() < start:
            time.sleep(0.005)
        folder = features.build_feature_cache(model, counting_examples(8, seed=1), {str(tmp_path)!r}, {{"name": "t"}},
                                              topk=0, batch_size=4, shard_examples=4, progress=False)
        print(len(features.FeatureCache.load(folder).block["example_index"]))
    """)
    start = str(time.time() + 6)
    runs = [subprocess.Popen([sys.executable, "-c", script, start], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    results = [run.communicate(timeout=120) for run in runs]
    assert [(run.returncode, out.strip()) for run, (out, _) in zip(runs, results)] == [(0, "8"), (0, "8")], results
    assert not list(tmp_path.rglob("*.tmp"))


def test_feature_cache_key_covers_shards_and_how_the_backbone_runs(tmp_path):
    rng = random.Random(0)
    examples = []
    for length in range(20, 15, -1):
        ids = [rng.randrange(3, 96) for _ in range(length)]
        examples.append({"input_ids": ids, "labels": [IGNORE] * (length - 8) + ids[length - 8 :]})
    model = MedusaModel.from_base(tiny_model("llama"), num_heads=1)

    def build(root, shard_examples, backbone=model, info=None):
        folder = build_feature_cache(backbone, examples, root, info or {"name": "tiny"}, topk=0,
                                     shard_examples=shard_examples, progress=False)
        return folder, FeatureCache.load(folder)

    def held(cache):
        return sorted(cache.block["example_index"].tolist())

    # killed before its last shard and the manifest, then resumed with another shard size: no
    # example of the first run's shards is lost or counted twice
    folder, _ = build(tmp_path / "a", 2)
    (folder / MANIFEST).unlink()
    (folder / "shard-00002.safetensors").unlink()
    resumed, cache = build(tmp_path / "a", 4)
    assert resumed != folder and held(cache) == list(range(5)) == list(range(cache.manifest["num_examples"]))
    # a shard file that holds other examples than its plan's is made again
    folder, _ = build(tmp_path / "b", 2)
    (folder / MANIFEST).unlink()
    shutil.copyfile(folder / "shard-00000.safetensors", folder / "shard-00001.safetensors")
    again, cache = build(tmp_path / "b", 2)
    assert again == folder and held(cache) == list(range(5))
    # a bfloat16 backbone, or another attention implementation, has a cache of its own
    half = MedusaModel.from_base(tiny_model("llama").to(torch.bfloat16), num_heads=1)
    sdpa = MedusaModel.from_base(tiny_model("llama", attn_implementation="sdpa"), num_heads=1)
    folders = {build(tmp_path / "c", 2, backbone)[0] for backbone in (model, half, sdpa)}
    assert len(folders) == 3
    assert {json.loads((f / MANIFEST).read_text())["model"]["dtype"] for f in folders} == {"float32", "bfloat16"}
    # a fingerprint naming other settings than the model's is refused
    with pytest.raises(ValueError, match="runs in bfloat16 with 'eager' attention, but its fingerprint says float32"):
        build(tmp_path / "d", 2, half, {"name": "tiny", "dtype": "float32", "attn_implementation": None})
    with pytest.raises(ValueError, match="'sdpa' attention, but its fingerprint says float32 with 'eager'"):
        build(tmp_path / "d", 2, sdpa, {"name": "tiny", "dtype": "float32", "attn_implementation": "eager"})


def test_model_fingerprint_changes_with_weights_saved_again_over_the_same_folder(tmp_path):
    """Weights saved again in place, changed only in the middle (a partial fine-tune written over its
    folder), name another model: the fingerprint reads a weight file's first and last MiB only."""
    from safetensors.torch import save_file

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    weights = {"a": torch.zeros(1 << 19), "b": torch.zeros(1 << 20), "c": torch.zeros(1 << 19)}  # 8 MiB
    save_file(weights, folder / "model.safetensors")
    before = model_fingerprint(str(folder))
    assert model_fingerprint(str(folder)) == before  # stable while the folder is untouched
    # ... and however the path is spelt (another spelling threw away kept states and feature caches)
    for spelling in (f"{folder}/", f"{tmp_path}/./model", f"{tmp_path}//model"):
        assert model_fingerprint(spelling) == before, spelling
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    weights["b"][1 << 19] = 1.0  # 4 MiB into the file: outside the first and last MiB
    save_file(weights, folder / "model.safetensors")
    # saved later: a file system of coarse times (or a fast machine) may give it the same time, which this sets
    os.utime(folder / "model.safetensors", ns=(stamp + 10**9, stamp + 10**9))
    assert model_fingerprint(str(folder)) != before
    # a trust_remote_code model's modeling code edited: other hidden states (its old cache was reused)
    before = model_fingerprint(str(folder))
    (folder / "modeling_mine.py").write_text("SCALE = 1.0\n")
    edited = model_fingerprint(str(folder))
    (folder / "modeling_mine.py").write_text("SCALE = 2.0\n")
    assert len({before["content"], edited["content"], model_fingerprint(str(folder))["content"]}) == 3
    # a file from_pretrained does not load (a Trainer's training_args.bin, an adapter's weights) is no other model:
    # it changed the key (extracted again, a killed run's resume refused as "the model's weights" differing)
    before = model_fingerprint(str(folder))
    torch.save({"lr": 1e-3}, folder / "training_args.bin")
    save_file({"lora_A": torch.zeros(4)}, folder / "adapter_model.safetensors")
    assert model_fingerprint(str(folder)) == before


def test_a_hub_models_fingerprint_is_the_revision_its_main_points_to(tmp_path, monkeypatch):
    """Weights pushed again under the same Hub id (a fine-tune's new revision) name another model: the
    fingerprint was the id alone, so the feature cache of the old weights was reused. The revision is the
    Hub's online and the local cache's offline, the same before and after the download (hashing the
    downloaded files instead changed the key once the model was there: kept states and caches refused)."""
    from types import SimpleNamespace

    from huggingface_hub import HfApi, constants

    hub = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    repo = hub / "models--me--tiny-sft"
    assert model_fingerprint("me/tiny-sft") == {"name": "me/tiny-sft"}  # offline, never downloaded
    prints = []
    for seed, commit in ((0, "a" * 40), (1, "b" * 40)):
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # online: the Hub says, before any download
        monkeypatch.setattr(HfApi, "model_info", lambda self, repo_id, **kw: SimpleNamespace(sha=commit))
        before = model_fingerprint("me/tiny-sft", "float32")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # offline, downloaded: the cache says
        tiny_model("llama", seed=seed).save_pretrained(repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
        prints.append(model_fingerprint("me/tiny-sft", "float32"))
        assert prints[-1] == before and prints[-1]["revision"] == commit
    assert prints[0] != prints[1]


def test_weights_identity_names_the_weights_loaded_not_the_commit_or_other_files(tmp_path, monkeypatch):
    """Records that travel with a run (rows, heads, checkpoints) name the weights: a Hub commit that changed only
    the model card refused them as "other weights", and so did a copy without an unused pytorch_model.bin."""
    from huggingface_hub import constants

    folder = tmp_path / "model"
    tiny_model("llama", seed=0).save_pretrained(folder)
    first = weights_identity(str(folder))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "transformers_version": "9.9.9"}))
    torch.save({"unused": torch.zeros(3)}, folder / "pytorch_model.bin")
    torch.save({"args": 1}, folder / "training_args.bin")
    assert weights_identity(str(folder)) == first
    tiny_model("llama", seed=1).save_pretrained(folder)
    assert weights_identity(str(folder)) != first
    # from_pretrained's order: model.safetensors before a (stale) index, which hid every later save's weights
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002"}}))
    second = weights_identity(str(folder))
    tiny_model("llama", seed=2).save_pretrained(folder)
    assert weights_identity(str(folder)) not in (second, None)
    (folder / "model.safetensors").unlink()  # an index naming a file not there: unknown, not compared
    assert weights_identity(str(folder)) is None
    assert weights_identity("smollm2-135m-instruct").startswith("gguf-sha256:")  # nothing fetched
    hub = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    repo = hub / "models--me--tiny-sft"
    assert weights_identity("me/tiny-sft") is None  # never downloaded: not compared
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)  # a download cut short: its config, no weights yet
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text("{}")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    assert weights_identity("me/tiny-sft") is None
    found = []
    for commit, seed, card in (("a" * 40, 0, None), ("b" * 40, 0, "# a card"), ("c" * 40, 1, None)):
        tiny_model("llama", seed=seed).save_pretrained(repo / "snapshots" / commit)
        if card:
            (repo / "snapshots" / commit / "README.md").write_text(card)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
        found.append(weights_identity("me/tiny-sft"))
    assert found[0] == found[1] != found[2]  # a model card's commit keeps it, new weights do not


# ---------------------------------------------------------------------------------------------
# Medusa-1: what trains and what must not


def _accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)  # grad_accum 1, as in the recipes below


def test_medusa1_keeps_backbone_and_lm_head_bitwise_and_trains_every_block(tiny_dir, tmp_path):
    config = config_from_dict(recipe(tiny_dir, tmp_path / "run", heads={"num_layers": 2, "projection": "shared"},
                                     features={"enabled": False}, training={"batch_size": 4, "max_steps": 6}))
    base = tiny_model("llama")
    base.requires_grad_(False)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    medusa = MedusaModel.from_base(base, num_heads=1)
    module = tr.new_heads_module(config, medusa.lm_head.weight, None, None, "llama", None)
    task = tr.Medusa1Task(config, module, tr.LiveFeatures(medusa, counting_examples(32), 3, None, 0))
    optimized = {id(p) for group in task.param_groups() for p in group["params"]}
    assert id(base.lm_head.weight) not in optimized
    assert not any(id(p) in optimized for p in base.parameters())
    # only the heads train: the projection they train through is the lm_head's frozen copy (a trained copy
    # drifted from the lm_head decoding projects through, which the checks on the base model did not see)
    assert optimized == {id(p) for p in module.heads.parameters() if p.requires_grad}
    assert not any(id(p) in optimized for p in module.lm_head.parameters())
    result = tr.train(config, task, _accelerator(), run_paths(config))
    for name, tensor in base.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} changed"
    assert torch.equal(module.lm_head.weight, before["lm_head.weight"])
    blocks = [b.linear.weight for head in module.heads.heads for b in head.blocks]
    assert len(blocks) == 6 and len({w.data_ptr() for w in blocks}) == 6, "blocks share parameters"
    assert all(float(w.detach().abs().sum()) > 0 for w in blocks), "a block did not move from its zero init"
    assert set(result.heads_state) == set(module.heads.state_dict())


def test_medusa1_from_cache_learns_head_k_predicts_t_plus_k_plus_2(tiny_dir, tmp_path, capsys):
    import train_heads

    out = tmp_path / "run"
    values = recipe(tiny_dir, out, training={"epochs": 8, "lr": 0.03}, log={"every": 20})
    config_file = str(write_recipe(tmp_path / "r.yaml", values))
    train_heads.main(["--config", config_file])
    saved = (out / "heads" / "config.json").read_text()
    accuracies = json.loads(saved)["head_accuracies"]
    assert [row[0] for row in accuracies] == pytest.approx([1.0, 1.0, 1.0], abs=0.05)
    # --heldout-only reprints the held-out table from the run's data and features, writing nothing
    capsys.readouterr()
    assert train_heads.main(["--config", config_file, "--heldout-only"]) == 0
    table = capsys.readouterr().out.splitlines()
    first = next(line for line in table if line.strip().startswith("1 "))
    assert float(first.split()[2]) == pytest.approx(accuracies[0][0], abs=1e-3)
    assert (out / "heads" / "config.json").read_text() == saved
    # another split would score the heads on examples they were trained on (it printed the table without a word)
    for other in ("training.seed=7", "data.heldout_fraction=0.5"):
        with pytest.raises(SystemExit, match="the held-out split drawn now is not the one the heads"):
            train_heads.main(["--config", config_file, "--heldout-only", other])
    # Medusa-1 heads scored as Medusa-2 ones: an adapter the run never made was looked for (peft's traceback)
    with pytest.raises(SystemExit, match=r"were trained with training.mode=medusa1, and the settings now say medusa2"):
        train_heads.main(["--config", config_file, "--heldout-only", "training.mode=medusa2",
                          "lora.target_modules=[q_proj,v_proj]"])
    # a cache damaged since it was finished is built again by the features stage (it was reused, and failed)
    heldout_cache = out / "features" / json.loads((out / "features" / "index.json").read_text())["heldout"]
    from safetensors.torch import load_file

    shard = next(heldout_cache.glob("shard-*.safetensors"))
    whole = {k: v.clone() for k, v in load_file(str(shard)).items()}
    shard.write_bytes(shard.read_bytes()[:-8])
    assert train_heads.main(["--config", config_file, "--heldout-only"]) == 0
    rebuilt = load_file(str(shard))
    assert rebuilt.keys() == whole.keys() and all(torch.allclose(rebuilt[k].float(), whole[k].float()) for k in whole)
    # Check the alignment against the sequence itself, not against our own targets: on a fresh
    # counting sequence head k's top token at position t >= 3 (the shortest prompt the heads
    # trained after) must be token t + k + 2.
    model = MedusaModel.from_pretrained(out / "heads", base_model=tiny_model("llama"))
    # the datastore holds the training split's conversations, for lookup drafts
    train_key = json.loads((out / "features" / "index.json").read_text())["train"]
    train_examples = json.loads((out / "features" / train_key / "manifest.json").read_text())["num_examples"]
    assert int((model.datastore.tokens == SEPARATOR).sum()) == train_examples > 0
    assert len(model.datastore) > 10 * train_examples
    ids = torch.tensor([[3 + (5 + j) % TOKENS for j in range(30)]])
    with torch.no_grad():
        heads = model(ids, head_positions=None).head_logits[:, 0].argmax(-1)  # [K, seq]
    for k in range(3):
        expected = ids[0, 3 + k + 2 :]
        agree = (heads[k, 3 : 3 + len(expected)] == expected).float().mean()
        assert agree > 0.9, f"head {k} agrees with t + {k + 2} only {agree:.2f} of the time"
    cache = FeatureCache.load(next(p for p in (out / "features").iterdir() if p.is_dir()))
    assert torch.equal(cache.lm_head["weight"], tiny_model("llama").lm_head.weight), "the cached lm_head changed"
    # loss ce never reads soft labels, so the recipe's features.topk=5 computed none
    assert cache.manifest["topk"] == 0 and "soft_ids" not in cache.block
    # a second run of a finished recipe neither extracts features nor touches the heads or the
    # first run's stage timings
    stages = (out / "logs" / "stages.json").read_text()
    assert "features" in json.loads(stages)
    shutil.rmtree(out / "features")
    assert train_heads.main(["--config", config_file]) == 0
    assert not (out / "features").exists() and (out / "heads" / "config.json").read_text() == saved
    assert (out / "logs" / "stages.json").read_text() == stages
    # other settings on a finished run would keep the old heads: refused by name, nothing written
    recorded_config = (out / "config.yaml").read_text()
    for overrides, says in ((["training.epochs=2", "heads.num_heads=2"], ["training.epochs was 8.0, now 2.0",
                                                                          "heads.num_heads was 3, now 2",
                                                                          "checkpoints and"]),
                            (["eval.tree_size=5"], ["eval.tree_size was 8, now 5", "to evaluate again"])):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            train_heads.main(["--config", config_file, *overrides])
        err = capsys.readouterr().err
        assert all(s in err for s in says), err
    assert (out / "config.yaml").read_text() == recorded_config
    # a second stage pointed at the first's own folder: told to remove the heads it starts from, its mode hidden
    # among "(and 3 more)" of keys sorted by name
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train_heads.main(["--config", config_file, "training.mode=medusa2", "lora.target_modules=[q_proj,v_proj]",
                          f"heads.init_from={out / 'heads'}", "heads.num_layers=1", "training.lr=0.02"])
    err = capsys.readouterr().err
    assert "other settings: training.mode was 'medusa1', now 'medusa2'" in err and "lies in this run's folders" in err
    assert "to train again" not in err and (out / "heads" / "config.json").is_file()
    # settings that do not decide the heads pass: logging, the Hub id, and on tokenized data, distilling's
    capsys.readouterr()
    assert train_heads.main(["--config", config_file, "log.every=5", "model.hub_id=me/tiny", "data.n=7",
                             "data.distill_batch_size=3", "data.distill_options.threads=1"]) == 0
    # ... though the heads name their base model otherwise: said (config.yaml claimed me/tiny silently)
    assert "names its base model" in (said := capsys.readouterr().out) and "not 'me/tiny' (model.hub_id)" in said
    # evaluated again with other eval settings, the heads record them: a re-run with those passes
    recorded_seconds = json.loads((out / "heads" / "config.json").read_text())["training"]["stage_seconds"]
    shutil.rmtree(out / "heads")
    assert train_heads.main(["--config", config_file, "eval.tree_size=5", "model.hub_id=me/tiny"]) == 0
    # ... and the seconds the first run recorded for the stages this one found done (it recorded the
    # near-zero seconds it took to find them: the card said distilling took a second); the features, removed
    # above, were extracted again: this run's seconds, as stages.json has them
    again = json.loads((out / "heads" / "config.json").read_text())["training"]["stage_seconds"]
    assert {k: again[k] for k in ("data", "train")} == {k: recorded_seconds[k] for k in ("data", "train")}, (
        again, recorded_seconds)
    assert again["features"] == json.loads((out / "logs" / "stages.json").read_text())["features"]
    assert "evaluate" not in again  # this evaluation's own, being timed (a previous one's was recorded)
    assert len(json.loads((out / "heads" / "config.json").read_text())["tree"]) == 5
    assert json.loads((out / "heads" / "config.json").read_text())["training"]["recipe"]["eval"]["tree_size"] == 5
    assert json.loads((out / "heads" / "config.json").read_text())["base_model_name_or_path"] == "me/tiny"
    assert train_heads.main(["--config", config_file, "eval.tree_size=5"]) == 0
    with pytest.raises(SystemExit):
        train_heads.main(["--config", config_file])  # the recipe's 8 nodes are not what heads/ holds
    assert "eval.tree_size was 5, now 8" in capsys.readouterr().err
    shutil.rmtree(out / "features")  # extracted again for that evaluation; the partial re-run below makes them
    # the examples the heads trained on are recorded: other rows under the same settings are refused
    final = json.loads((out / "checkpoints" / "final" / "config.json").read_text())
    with pytest.raises(ValueError, match="trained on other examples"):
        tr.check_finished_examples(run_paths(config_from_dict(values)), "0" * 64)
    tr.check_finished_examples(run_paths(config_from_dict(values)), final["training"]["train_examples_sha256"])
    # heads trained before the settings were recorded: compared through the recipe they recorded
    del final["training"]["settings"]
    (out / "checkpoints" / "final" / "config.json").write_text(json.dumps(final))
    changed = config_from_dict(values, ["training.lr=0.01"])
    with pytest.raises(ValueError, match="training.lr was 0.03, now 0.01"):
        tr.check_finished_run(changed, run_paths(changed))
    # the base model trained again into its folder: other heads would be needed (they were reused silently)
    current = config_from_dict(values, ["eval.tree_size=5"])  # as heads/ was evaluated above
    recorded = tr.finished_settings(current)
    assert recorded["model_weights"].startswith("sha256:")
    final["training"]["settings"] = {**recorded, "model_weights": "sha256:" + "0" * 32}
    (out / "checkpoints" / "final" / "config.json").write_text(json.dumps(final))
    with pytest.raises(ValueError, match="model_weights was 'sha256:0+', now 'sha256:"):
        tr.check_finished_run(current, run_paths(current))
    del final["training"]["settings"]["model_weights"]  # recorded before weights were: not compared
    (out / "checkpoints" / "final" / "config.json").write_text(json.dumps(final))
    tr.check_finished_run(current, run_paths(current))
    # a partial re-run (rows there, features, heads and final checkpoint gone) records the seconds
    # of the stages it ran, and keeps the recorded distillation seconds rather than its own
    recorded = {"data": 1234.5, "features": 2345.6, "train": 3456.7, "evaluate": 4567.8}
    (out / "logs" / "stages.json").write_text(json.dumps(recorded))
    shutil.rmtree(out / "heads")
    shutil.rmtree(out / "checkpoints")
    assert train_heads.main(["--config", config_file]) == 0
    rerun = json.loads((out / "logs" / "stages.json").read_text())
    assert rerun["data"] == recorded["data"]
    assert all(rerun[stage] != recorded[stage] for stage in ("features", "train", "evaluate")), rerun


def test_loss_ce_reuses_features_extracted_with_soft_labels(tiny_dir, tmp_path):
    import train_heads

    out = tmp_path / "run"
    kl = recipe(tiny_dir, out, training={"max_steps": 2, "loss": "kl"})
    train_heads.main(["--config", str(write_recipe(tmp_path / "kl.yaml", kl))])
    extracted = sorted(p.name for p in (out / "features").iterdir() if p.is_dir())
    assert len(extracted) == 2  # train and held-out, with top-5 soft labels
    ce = recipe(tiny_dir, out, training={"max_steps": 2, "loss": "ce"})
    assert train_heads.main(["--config", str(write_recipe(tmp_path / "ce.yaml", ce)), "--heldout-only"]) == 0
    assert sorted(p.name for p in (out / "features").iterdir() if p.is_dir()) == extracted
    index = json.loads((out / "features" / "index.json").read_text())
    assert sorted([index["train"], index["heldout"]]) == extracted
    # with its caches gone, --heldout-only extracts the held-out split's alone (it extracted the training
    # split's too: most of the work, for nothing it reports)
    for folder in extracted:
        shutil.rmtree(out / "features" / folder)
    assert train_heads.main(["--config", str(write_recipe(tmp_path / "kl.yaml", kl)), "--heldout-only"]) == 0
    assert [p.name for p in (out / "features").iterdir() if p.is_dir()] == [index["heldout"]]
    assert json.loads((out / "features" / "index.json").read_text()) == index


# ---------------------------------------------------------------------------------------------
# Exact resume after kill -9

KILL_SCRIPT = """
import os, signal, sys
from medusa_train import trainer
kill_at = int(sys.argv[1])
log = trainer.MetricLogger.log
def log_then_die(self, record, bar):
    log(self, record, bar)
    if record["step"] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
trainer.MetricLogger.log = log_then_die
import train_heads
sys.exit(train_heads.main(sys.argv[2:]))
"""


def killed_at_step(step: int, config_file: str, tmp_path: Path) -> None:
    """Run ``train_heads.py --config config_file`` in a process killed with SIGKILL after logging ``step``."""
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(step), "--config", config_file], cwd=REPO,
                            env=quiet_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]


def test_kill_9_then_resume_equals_uninterrupted_run(tiny_dir, tmp_path):
    import train_heads

    env = quiet_env(tmp_path)
    # Soft labels, a reduced vocabulary and two checkpoints: everything a resume must restore.
    values = {"training": {"max_steps": 12, "save_every": 4, "seed": 3, "loss": "kl"},
              "heads": {"reduced_vocab_size": 30}}
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    train_heads.main(["--config", str(write_recipe(tmp_path / "a.yaml", recipe(tiny_dir, whole, **values)))])
    killed_recipe = str(write_recipe(tmp_path / "b.yaml", recipe(tiny_dir, killed, **values)))
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    result = subprocess.run([sys.executable, str(script), "6", "--config", killed_recipe], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert tr.latest_checkpoint(killed / "checkpoints").name == "step-00000004"
    assert not (killed / "checkpoints" / "final").exists()
    before = json.loads((killed / "checkpoints" / "step-00000004" / tr.STATE_NAME).read_text())["train_seconds"]
    train_heads.main(["--config", killed_recipe])
    final = json.loads((killed / "checkpoints" / "final" / "config.json").read_text())
    assert final["training"]["resumed_from_step"] == 4
    # the training seconds before the kill count too (the card's time was the resumed run's alone)
    assert before > 0 and final["training"]["train_seconds"] >= round(before, 1)
    a, b = final_heads(whole), final_heads(killed)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=1e-6)
    assert [r["step"] for r in train_log(killed)] == list(range(1, 13))
    train_key = json.loads((killed / "features" / "index.json").read_text())["train"]
    assert json.loads((killed / "features" / train_key / "manifest.json").read_text())["topk"] == 5  # loss kl
    for x, y in zip(train_log(whole), train_log(killed)):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)


def test_a_resumed_run_logs_the_same_windows_as_an_uninterrupted_run(tiny_dir, tmp_path):
    """A checkpoint between two log lines (``save_every`` 4, ``log.every`` 3, as the 8B recipes' 50 and 20):
    the resumed run's first line averages the steps since the last line, those before the kill included
    (it averaged only those after the checkpoint: step 6's line held steps 5-6, not 4-6)."""
    import train_heads

    values = {"training": {"max_steps": 12, "save_every": 4, "seed": 3, "loss": "ce"}, "log": {"every": 3}}
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    train_heads.main(["--config", str(write_recipe(tmp_path / "a.yaml", recipe(tiny_dir, whole, **values)))])
    killed_recipe = str(write_recipe(tmp_path / "b.yaml", recipe(tiny_dir, killed, **values)))
    killed_at_step(6, killed_recipe, tmp_path)
    train_heads.main(["--config", killed_recipe])
    a, b = train_log(whole), train_log(killed)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [3, 6, 9, 12]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (x["step"], x["loss"], y["loss"])
        assert y["head_top1"] == pytest.approx(x["head_top1"], abs=1e-4)
        assert y["head_loss"] == pytest.approx(x["head_loss"], rel=1e-5)


def test_a_log_window_an_earlier_release_checkpointed_is_resumed_without_its_head_loss_means(tiny_dir, tmp_path):
    """Earlier releases kept per-step head_loss means in the checkpointed log window: resumed, they overwrote
    the pooled head_loss of the window's line (divided by the steps before the checkpoint alone)."""
    import train_heads

    values = {"training": {"max_steps": 8, "save_every": 4, "seed": 3, "loss": "ce"}, "log": {"every": 3}}
    killed = tmp_path / "killed"
    killed_recipe = str(write_recipe(tmp_path / "b.yaml", recipe(tiny_dir, killed, **values)))
    killed_at_step(6, killed_recipe, tmp_path)
    window_file = tr.latest_checkpoint(killed / "checkpoints") / tr._window_file(0)
    kept = torch.load(window_file, weights_only=True)
    kept["sums"]["head_loss"] = torch.full_like(kept["sums"].pop("head_loss_sum"), 1e6)  # as they were kept
    del kept["sums"]["head_loss_count"]
    kept["measured"]["head_loss"] = kept["measured"].pop("head_loss_sum")
    del kept["measured"]["head_loss_count"]
    torch.save(kept, window_file)
    train_heads.main(["--config", killed_recipe])
    lines = train_log(killed)
    assert [r["step"] for r in lines] == [3, 6, 8]
    assert all(0 < loss < 100 for r in lines for loss in r["head_loss"])


def test_kill_9_then_resume_a_medusa2_run_equals_uninterrupted_run(tiny_dir, tmp_path):
    """Medusa-2's steps draw random numbers (LoRA dropout), so its resume must restore the RNG states too:
    killed after the heads-only stage, the resumed run's heads, adapter and losses are the uninterrupted
    run's (the Medusa-1 test above would pass without the RNG states)."""
    import train_heads
    from safetensors.torch import load_file

    values = {"training": {"mode": "medusa2", "batch_size": 4, "max_steps": 8, "stage1_steps": 2,
                           "heads_warmup_steps": 2, "save_every": 4, "seed": 3, "loss": "ce"},
              "lora": {"r": 4, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}}
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    train_heads.main(["--config", str(write_recipe(tmp_path / "a.yaml", recipe(tiny_dir, whole, **values)))])
    killed_recipe = str(write_recipe(tmp_path / "b.yaml", recipe(tiny_dir, killed, **values)))
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    result = subprocess.run([sys.executable, str(script), "6", "--config", killed_recipe], cwd=REPO,
                            env=quiet_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    train_heads.main(["--config", killed_recipe])
    assert json.loads((killed / "checkpoints" / "final" / "config.json").read_text())["training"][
        "resumed_from_step"] == 4
    adapter = Path("checkpoints") / "final" / "adapter" / "adapter_model.safetensors"
    for a, b in ((final_heads(whole), final_heads(killed)), (load_file(whole / adapter), load_file(killed / adapter))):
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=1e-6)
    assert [x["loss"] for x in train_log(whole)] == pytest.approx([y["loss"] for y in train_log(killed)], rel=1e-5)


def test_a_medusa2_run_resumes_and_reruns_with_gradient_checkpointing_switched(tiny_dir, tmp_path):
    """Gradient checkpointing trades memory for time and trains the same weights: a run out of memory at its first
    joint step resumes its last heads-only checkpoint with it turned on (refused: "was written by a different
    run"), and a finished run re-run with it turned off keeps its heads (refused: "made with other settings")."""
    import train_heads
    from safetensors.torch import load_file

    values = {"training": {"mode": "medusa2", "batch_size": 4, "max_steps": 6, "stage1_steps": 2,
                           "save_every": 2, "keep_checkpoints": 5, "seed": 3, "loss": "ce"},
              "lora": {"r": 4, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}}
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train_heads.main(["--config", str(write_recipe(tmp_path / "a.yaml", recipe(tiny_dir, whole, **values)))])
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / "step-00000002", resumed / "checkpoints" / "step-00000002")
    second = str(write_recipe(tmp_path / "b.yaml", recipe(tiny_dir, resumed, **values)))
    train_heads.main(["--config", second, "training.gradient_checkpointing=true"])
    final = json.loads((resumed / "checkpoints" / "final" / "config.json").read_text())["training"]
    assert final["resumed_from_step"] == 2
    adapter = Path("checkpoints") / "final" / "adapter" / "adapter_model.safetensors"
    for a, b in ((final_heads(whole), final_heads(resumed)), (load_file(whole / adapter), load_file(resumed / adapter))):
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=1e-6)
    kept = (resumed / "heads" / "model.safetensors").stat().st_mtime_ns
    train_heads.main(["--config", second, "training.gradient_checkpointing=false"])
    assert (resumed / "heads" / "model.safetensors").stat().st_mtime_ns == kept


def test_a_checkpoint_is_not_resumed_on_other_examples(tiny_dir, tmp_path, capsys):
    """Killed, then the training examples rewritten under the same recipe: the steps before the kill
    trained on the old ones, so the checkpoint is refused rather than continued on the new ones."""
    import train_heads

    examples = tmp_path / "examples.jsonl"
    shutil.copy(tiny_dir / "examples.jsonl", examples)
    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 6, "save_every": 2, "seed": 3})
    values["data"]["tokenized"] = str(examples)
    config_file = str(write_recipe(tmp_path / "r.yaml", values))
    killed_at_step(3, config_file, tmp_path)
    with examples.open("w") as handle:
        for example in counting_examples(64, seed=9):
            handle.write(json.dumps(example) + "\n")
    capsys.readouterr()
    features = sorted(p.name for p in (tmp_path / "run" / "features").iterdir())
    for plan_only in (["--plan"], []):  # refused by the plan, before the features stage (it was refused after it)
        with pytest.raises(SystemExit) as exit_info:
            train_heads.main(["--config", config_file, *plan_only])
        captured = capsys.readouterr()
        assert "was written by a different run: train_examples_sha256 was" in captured.err + str(exit_info.value), (
            str(exit_info.value), captured.out[-2000:], captured.err[-2000:])
        assert sorted(p.name for p in (tmp_path / "run" / "features").iterdir()) == features


def test_a_split_with_no_position_for_the_heads_is_refused_before_training(tiny_dir, tmp_path, capsys):
    """Held-out answers of one token each hold no position the heads are scored at (two answer tokens in
    a row): refused with the fix named before anything trains. Training ran to its end and the
    evaluation then died with a traceback, leaving no heads (and a rerun skipped to the same crash)."""
    import numpy as np

    import train_heads

    examples = counting_examples(20, seed=1)
    for i in np.random.default_rng(0).permutation(20)[:4].tolist():  # split_heldout's 4 of 20 (seed 0, 0.2)
        ids = examples[i]["input_ids"]
        examples[i]["labels"] = [IGNORE] * (len(ids) - 1) + ids[-1:]
    data = tmp_path / "examples.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in examples))
    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 2, "seed": 0})
    values["data"].update(tokenized=str(data), heldout_fraction=0.2)
    config_file = str(write_recipe(tmp_path / "r.yaml", values))
    for plan_only in ([], ["--plan"]):  # refused by the plan now, which counts data.tokenized's split
        with pytest.raises(SystemExit):
            train_heads.main(["--config", config_file, *plan_only])
        assert re.search(r"none of the 4 held-out examples has two answer tokens in a row.*data.heldout_fraction",
                         capsys.readouterr().err)
    assert not (tmp_path / "run" / "checkpoints" / "final").exists() and not (tmp_path / "run" / "features").exists()


@pytest.mark.parametrize("log_every, stopped_at", [(1, 1), (5, 2)])  # at a log line, or at a checkpoint before one
def test_a_loss_that_overflows_stops_the_run_before_any_heads_are_saved(tmp_path, log_every, stopped_at):
    """From a review: a backbone whose numbers overflow in float16 (Gemma 3's do) trained NaN heads at a loss of
    nan, exited 0, fitted a tree to them and reported their accuracy."""
    import train_heads

    base = tiny_model("llama")
    with torch.no_grad():
        base.get_input_embeddings().weight.mul_(1e6)  # past float16's 65504
    base.save_pretrained(tmp_path / "tiny" / "model")
    with (tmp_path / "tiny" / "examples.jsonl").open("w") as handle:
        handle.writelines(json.dumps(example) + "\n" for example in counting_examples(32))
    values = recipe(tmp_path / "tiny", tmp_path / "run", model={"dtype": "float16"},
                    training={"max_steps": 3, "save_every": 2}, log={"every": log_every, "progress": False})
    config_file = str(write_recipe(tmp_path / "r.yaml", values))
    with pytest.raises(SystemExit) as err:
        train_heads.main(["--config", config_file])
    assert re.search(rf"the training loss is nan at step {stopped_at}: the numbers overflowed.*model.dtype=float16.*train in "
                     r"bfloat16 or float32", str(err.value))
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
    assert not (tmp_path / "run" / "heads").exists()


def test_heads_of_a_run_whose_final_heads_are_gone_are_evaluated_again(tiny_dir, tmp_path, capsys):
    """checkpoints/ removed (heads/ kept), the examples changed: the rerun trains on the new examples, and
    heads/ was kept as the old training's ("evaluate: heads exists, skipping"), the plan saying done."""
    import train_heads

    examples = tmp_path / "examples.jsonl"
    shutil.copy(tiny_dir / "examples.jsonl", examples)
    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 3, "seed": 1})
    values["data"]["tokenized"] = str(examples)
    config_file = str(write_recipe(tmp_path / "r.yaml", values))
    assert train_heads.main(["--config", config_file]) == 0
    with examples.open("w") as handle:
        for example in counting_examples(64, seed=9):
            handle.write(json.dumps(example) + "\n")
    shutil.rmtree(tmp_path / "run" / "checkpoints")
    capsys.readouterr()
    assert train_heads.main(["--config", config_file, "--plan"]) == 0
    assert "[todo] evaluate" in capsys.readouterr().out
    assert train_heads.main(["--config", config_file]) == 0
    out = capsys.readouterr().out
    assert "heads exists, skipping" not in out

    def trained_on(folder):
        return json.loads((tmp_path / "run" / folder / "config.json").read_text())["training"]["train_examples_sha256"]

    assert trained_on("heads") == trained_on("checkpoints/final")
    # the same, stopped in its evaluation: the next run found heads/ and final/ both there, and kept heads/
    # of the earlier training beside the newer final
    with examples.open("w") as handle:
        for example in counting_examples(64, seed=11):
            handle.write(json.dumps(example) + "\n")
    shutil.rmtree(tmp_path / "run" / "checkpoints")

    def stop(*args, **kwargs):
        raise RuntimeError("stopped")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_heads, "stage_evaluate", stop)
        with pytest.raises(RuntimeError, match="stopped"):
            train_heads.main(["--config", config_file])
    assert trained_on("heads") != trained_on("checkpoints/final")
    capsys.readouterr()
    assert train_heads.main(["--config", config_file, "--plan"]) == 0
    assert "[todo] evaluate" in capsys.readouterr().out
    assert train_heads.main(["--config", config_file]) == 0
    assert trained_on("heads") == trained_on("checkpoints/final")
    # trained heads whose evaluation is missing are evaluated on the held-out split's features alone
    shutil.rmtree(tmp_path / "run" / "heads")
    shutil.rmtree(tmp_path / "run" / "features")
    capsys.readouterr()
    assert train_heads.main(["--config", config_file]) == 0
    out = capsys.readouterr().out
    assert "features: heldout split" in out and "features: train split" not in out


def test_a_checkpoint_of_other_settings_is_refused_before_any_stage_runs(tiny_dir, tmp_path, capsys):
    """features.dtype changed on a killed run: refused only in the training stage, after the features were
    extracted again and config.yaml rewritten (--plan said nothing); the distilling settings, which change
    no training step, refused the resume."""
    import train_heads

    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 6, "save_every": 2, "seed": 3})
    config_file = str(write_recipe(tmp_path / "r.yaml", values))
    killed_at_step(3, config_file, tmp_path)
    saved = (tmp_path / "run" / "config.yaml").read_text()
    caches = sorted((tmp_path / "run" / "features").iterdir())
    for flags in ([], ["--plan"]):
        with pytest.raises(SystemExit):
            train_heads.main(["--config", config_file, "features.dtype=bfloat16", *flags])
        assert "step-00000002 was written by a different run: features.dtype was 'float32', now 'bfloat16'" \
            in capsys.readouterr().err
    # the cache's shards too (refused after extracting features again, naming only the caches' hashes)
    with pytest.raises(SystemExit):
        train_heads.main(["--config", config_file, "features.shard_examples=7", "--plan"])
    assert "features.shard_examples was 256, now 7" in capsys.readouterr().err
    # the cache turned off: said so, not as the cache's own settings (features.dtype was 'float32', now None)
    with pytest.raises(SystemExit):
        train_heads.main(["--config", config_file, "features.enabled=false", "--plan"])
    said = capsys.readouterr().err
    assert "was written by a different run: the feature cache (features.enabled, Medusa-1) was used, now not" in said
    assert "features.dtype" not in said and "features_cache" not in said
    assert (tmp_path / "run" / "config.yaml").read_text() == saved
    assert sorted((tmp_path / "run" / "features").iterdir()) == caches
    # a launch's checkpoint: a plain --plan knows no number of processes (it printed no plan), a run does
    state_file = tmp_path / "run" / "checkpoints" / "step-00000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "world_size": 2}))
    capsys.readouterr()
    assert train_heads.main(["--config", config_file, "--plan"]) == 0
    # the plan says which checkpoint the training resumes (it said nothing of it)
    assert re.search(r"\[todo\] train .*, resuming step-00000002\)", capsys.readouterr().out)
    with pytest.raises(SystemExit):
        train_heads.main(["--config", config_file])
    assert "world_size was 2, now 1" in capsys.readouterr().err
    # the base model trained again into its folder: the steps ran on another backbone (resumed silently without
    # the feature cache)
    assert state["fingerprint"]["model_weights"].startswith("sha256:")
    state_file.write_text(json.dumps({**state, "fingerprint": {**state["fingerprint"], "model_weights": "sha256:0"}}))
    with pytest.raises(SystemExit):
        train_heads.main(["--config", config_file, "--plan"])
    assert "model_weights was 'sha256:0', now 'sha256:" in capsys.readouterr().err
    older = {k: v for k, v in state["fingerprint"].items() if k != "model_weights"}  # before weights were recorded
    state_file.write_text(json.dumps({**state, "fingerprint": older}))
    assert train_heads.main(["--config", config_file, "--plan"]) == 0
    state_file.write_text(json.dumps(state))
    assert train_heads.main(["--config", config_file, "data.distill_batch_size=3"]) == 0
    assert "resuming from" in capsys.readouterr().out


def test_the_weights_a_training_records_are_the_ones_it_began_on(tiny_dir, tmp_path, monkeypatch):
    """model_weights was read again at every checkpoint save and for the final heads: a folder trained again
    during the run had the old backbone's heads record the new weights (and each save read 3 MiB of every weight
    file, or asked the Hub)."""
    import train_heads
    from medusa_train import trainer as tr

    calls = []

    def identity(name: str) -> str:
        calls.append(name)
        return f"sha256:{len(calls)}"

    monkeypatch.setattr(tr, "weights_identity", identity)
    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 4, "save_every": 1, "keep_checkpoints": 4},
                    features={"enabled": False})
    assert train_heads.main(["--config", str(write_recipe(tmp_path / "r.yaml", values))]) == 0
    checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    recorded = {json.loads((c / "trainer_state.json").read_text())["fingerprint"]["model_weights"] for c in checkpoints}
    final = json.loads((tmp_path / "run" / "checkpoints" / "final" / "config.json").read_text())
    assert len(checkpoints) == 3 and recorded == {final["training"]["settings"]["model_weights"]}


def test_a_damaged_checkpoint_is_named_with_the_one_to_resume_from(tiny_dir, tmp_path, capsys):
    """A newest checkpoint damaged after it was written (cut by a full disk, a copy): a bare SafetensorError
    traceback, naming neither the folder nor the older checkpoint kept beside it."""
    import train_heads

    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 8, "save_every": 2, "seed": 1})
    config_file = str(write_recipe(tmp_path / "r.yaml", values))
    killed_at_step(5, config_file, tmp_path)
    newest = tmp_path / "run" / "checkpoints" / "step-00000004"
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train_heads.main(["--config", config_file])
    said = str(exit_info.value) + capsys.readouterr().err
    assert f"{newest} could not be loaded (SafetensorError" in said
    assert "remove that folder to resume from step-00000002, the one before it" in said
    window = newest / "log_window_0.pt"  # the log's window, read after the weights: an EOFError traceback
    weights.unlink()
    shutil.copy(newest.parent / "step-00000002" / "model.safetensors", weights)
    window.write_bytes(b"")
    with pytest.raises(SystemExit) as exit_info:
        train_heads.main(["--config", config_file])
    assert f"{newest} could not be loaded (EOFError" in str(exit_info.value) + capsys.readouterr().err
    window.write_bytes((newest.parent / "step-00000002" / window.name).read_bytes())
    # the random states: accelerate's loader left out a cut or missing file with an INFO line, and the run
    # resumed with its RNG where it stood (LoRA dropout then drew otherwise than an uninterrupted run)
    rng = newest / "random_states_0.pkl"
    kept = rng.read_bytes()
    for damage in ("cut", "missing"):
        rng.write_bytes(kept[:len(kept) // 2]) if damage == "cut" else rng.unlink()
        with pytest.raises(SystemExit) as exit_info:
            train_heads.main(["--config", config_file])
        said = str(exit_info.value) + capsys.readouterr().err
        assert f"{newest} could not be loaded (" in said and "resume from step-00000002" in said, damage
    rng.write_bytes(kept)
    state = newest / "trainer_state.json"  # read before any stage: a bare JSON error naming no checkpoint
    state.write_text(state.read_text()[:20])
    with pytest.raises(SystemExit) as exit_info:
        train_heads.main(["--config", config_file])
    said = str(exit_info.value) + capsys.readouterr().err
    assert f"{newest} could not be loaded (JSONDecodeError" in said and "resume from step-00000002" in said
    shutil.rmtree(newest)
    assert train_heads.main(["--config", config_file]) == 0
    assert "resuming from" in capsys.readouterr().out and (tmp_path / "run" / "heads" / "config.json").is_file()


def test_a_half_written_log_line_does_not_stop_the_resume(tiny_dir, tmp_path):
    """A run killed while writing ``logs/train.jsonl`` (or on a full disk) leaves half a line: the resume
    drops it with the lines past its checkpoint and goes on, instead of failing on it every time."""
    import train_heads

    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 6, "save_every": 2, "seed": 3})
    config_file = str(write_recipe(tmp_path / "r.yaml", values))
    killed_at_step(3, config_file, tmp_path)
    log = tmp_path / "run" / "logs" / "train.jsonl"
    with log.open("a") as handle:
        handle.write('{"step": 4, "loss": 1.2')
    train_heads.main(["--config", config_file])
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == list(range(1, 7)), steps


def test_a_checkpoint_is_not_resumed_on_another_feature_cache(tiny_dir, tmp_path, capsys):
    """Killed, then resumed with the features sharded otherwise: the new cache holds the same examples in
    another row order (rows follow the shards) and a resumed step reads rows by position, so the
    checkpoint, which names the cache it trained on, is refused: by the setting, before any stage runs, and
    where the checkpoint does not record it (written before it was), by the cache it names."""
    import train_heads

    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 6, "save_every": 2, "seed": 3},
                    features={"shard_examples": 5})
    config_file = str(write_recipe(tmp_path / "r.yaml", values))
    killed_at_step(3, config_file, tmp_path)
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("step-*/trainer_state.json")).read_text())
    train_key = json.loads((tmp_path / "run" / "features" / "index.json").read_text())["train"]
    assert state["features_cache"] == train_key
    values["features"]["shard_examples"] = 7
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train_heads.main(["--config", str(write_recipe(tmp_path / "r.yaml", values))])
    said = capsys.readouterr().err + str(exit_info.value)
    assert "features.shard_examples was 5, now 7" in said, said
    for state_file in (tmp_path / "run" / "checkpoints").glob("step-*/trainer_state.json"):
        written = json.loads(state_file.read_text())
        del written["fingerprint"]["features"]["shard_examples"]  # as a checkpoint from before the key
        state_file.write_text(json.dumps(written))
    with pytest.raises(SystemExit) as exit_info:
        train_heads.main(["--config", str(write_recipe(tmp_path / "r.yaml", values))])
    said = capsys.readouterr().err + str(exit_info.value)
    assert f"features_cache was {train_key!r}, now " in said and "a resumed step would read other rows" in said, said


# ---------------------------------------------------------------------------------------------
# Medusa-2


def test_medusa2_teacher_is_the_original_model_without_dropout(tiny_dir, tmp_path):
    """A base model with dropout (GPT-2's 0.1) in training mode: the teacher (the original model) and the
    heads-only stage's features are computed without it, so they are the model's own outputs; training
    mode is back after each pass."""
    from medusa_infer.heads import MedusaHeads
    from medusa_train.lora import add_lora

    config = config_from_dict(recipe(tiny_dir, tmp_path / "run", training={"mode": "medusa2", "loss": "kl"},
                                     lora={"target_modules": ["c_attn"]}))
    base = tiny_model("gpt2")
    assert base.config.resid_pdrop > 0
    batch = pad_batch(counting_examples(3, seed=5))
    base.requires_grad_(False)
    peft_model = add_lora(base, 8, 16, 0.0, config.lora.target_modules)
    heads = MedusaHeads(tr.heads_config(config, 32, 96, "gpt2", None), lm_head_weight=base.lm_head.weight)
    module = tr.JointModule(MedusaModel(peft_model.get_base_model(), heads), peft_model, 5).train()
    torch.manual_seed(7)
    with torch.no_grad():  # an adapter that has trained a while (LoRA starts as the identity)
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    outputs = []
    for seed, joint in ((0, True), (1, True), (0, False), (1, False)):
        torch.manual_seed(seed)
        outputs.append(module(batch, joint=joint, num_heads=3))
        assert all(m.training for m in module.modules())
    torch.testing.assert_close(outputs[0]["teacher_logits"], outputs[1]["teacher_logits"], atol=0, rtol=0)
    assert not torch.equal(outputs[0]["student_logits"], outputs[1]["student_logits"])  # the student keeps dropout
    torch.testing.assert_close(outputs[2]["soft_probs"], outputs[3]["soft_probs"], atol=0, rtol=0)
    # the teacher is the original model: its soft labels are not those of the adapted model (the heads-only
    # stage's, without dropout either); a teacher keeping the adapter passed every check above
    assert not torch.allclose(outputs[0]["soft_probs"], outputs[2]["soft_probs"])


def test_medusa2_step0_kl_is_zero_and_base_logits_unchanged(tiny_dir, tmp_path):
    from medusa_infer.heads import MedusaHeads
    from medusa_train.lora import add_lora

    config = config_from_dict(recipe(tiny_dir, tmp_path / "run", training={"mode": "medusa2", "loss": "kl"},
                                     lora={"target_modules": ["q_proj", "v_proj", "up_proj"]}))
    base = tiny_model("llama")
    batch = pad_batch(counting_examples(3, seed=5))
    with torch.no_grad():
        original = base(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    base.requires_grad_(False)
    peft_model = add_lora(base, 8, 16, 0.0, config.lora.target_modules)
    heads = MedusaHeads(tr.heads_config(config, 32, 96, "llama", None), lm_head_weight=base.lm_head.weight)
    medusa = MedusaModel(peft_model.get_base_model(), heads)
    task = tr.Medusa2Task(config, tr.JointModule(medusa, peft_model, 5), [], None)
    trainable = {n for n, p in task.module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("medusa.heads.") for n in trainable)
    out = task.module(batch, joint=True, num_heads=3)
    assert float(logits_kl(out["student_logits"], out["teacher_logits"]).detach()) == pytest.approx(0.0, abs=1e-7)
    torch.testing.assert_close(out["student_logits"], out["teacher_logits"], atol=0, rtol=0)
    with torch.no_grad():
        adapted = medusa.base_model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(adapted[mask], original[mask], atol=0, rtol=0)
    assert tr.heads_loss_weight(config, 0) == config.training.heads_loss_weight


def test_joint_module_names_the_layers_fsdp_shards_one_by_one():
    # accelerate's FSDP (TRANSFORMER_BASED_WRAP) reads _no_split_modules; without it nothing is wrapped
    module = tr.JointModule(MedusaModel.from_base(tiny_model("llama"), num_heads=1), None, 0)
    assert module._no_split_modules == ["LlamaDecoderLayer"]


def test_medusa2_trains_adapter_and_heads_then_evaluates(tiny_dir, tmp_path):
    import train_heads

    out = tmp_path / "run"
    values = recipe(tiny_dir, out, training={"mode": "medusa2", "batch_size": 4, "max_steps": 6, "stage1_steps": 2,
                                             "heads_warmup_steps": 2, "loss": "ce"},
                    lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}, heads={"reduced_vocab_size": 30})
    train_heads.main(["--config", str(write_recipe(tmp_path / "r.yaml", values))])
    log = train_log(out)
    assert "base_kl" not in log[0] and log[-1]["base_kl"] > 0  # heads alone first, then joint
    assert [r["heads_weight"] for r in log] == pytest.approx([1, 1, 0.1, 0.2, 0.2, 0.2])
    # a log window across the heads-only stage: its base KL is the mean of its joint steps' (it was divided by
    # every step of the window); the run is the same, logged every 3 steps
    windowed = {**values, "output_dir": str(tmp_path / "windowed"), "log": {**values["log"], "every": 3}}
    train_heads.main(["--config", str(write_recipe(tmp_path / "w.yaml", windowed))])
    coarse = train_log(tmp_path / "windowed")
    assert [r["step"] for r in coarse] == [3, 6]
    assert coarse[0]["base_kl"] == pytest.approx(log[2]["base_kl"], rel=1e-5)
    assert coarse[1]["base_kl"] == pytest.approx(sum(r["base_kl"] for r in log[3:]) / 3, rel=1e-5)
    assert (out / "heads" / "adapter" / "adapter_config.json").is_file()
    config = json.loads((out / "heads" / "config.json").read_text())
    assert config["reduced_vocab_size"] == 30 and len(config["head_accuracies"]) == 3 and config["tree"]
    # the adapter names the base model as the heads do, and has no peft card (both named the folder it was loaded
    # from, published with the adapter)
    adapter = json.loads((out / "heads" / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == config["base_model_name_or_path"]
    assert not (out / "heads" / "adapter" / "README.md").exists()
    # evaluated again with model.hub_id set after training: the adapter named the local folder still
    shutil.rmtree(out / "heads")
    train_heads.main(["--config", str(write_recipe(tmp_path / "r.yaml", values)), "model.hub_id=me/tiny"])
    assert json.loads((out / "heads" / "config.json").read_text())["base_model_name_or_path"] == "me/tiny"
    adapter_now = json.loads((out / "heads" / "adapter" / "adapter_config.json").read_text())
    assert adapter_now == {**adapter, "base_model_name_or_path": "me/tiny"}
    # --heldout-only without the mode the run was trained in (an override of the README's two-stage flow): the heads
    # were scored on the backbone without their adapter, lower figures printed with exit 0
    plain = {**values, "training": {k: v for k, v in values["training"].items()
                                    if k not in ("mode", "stage1_steps", "heads_warmup_steps")}}
    plain.pop("lora")
    with pytest.raises(SystemExit, match=r"were trained with training.mode=medusa2, and the settings now say medusa1"):
        train_heads.main(["--config", str(write_recipe(tmp_path / "plain.yaml", plain)), "--heldout-only"])


def test_medusa2_run_starts_at_a_base_kl_of_zero_on_cpu_kernels(tiny_dir, tmp_path, monkeypatch):
    """train_heads loads the base on this CPU's tuned linear kernels, which take passes without grad only:
    the teacher ran on them (oneDNN here), the student on PyTorch's, and the step-0 KL was not 0."""
    import medusa_infer.cpu_kernels as kernels
    import medusa_infer.models as models
    import train_heads

    load, run = models.load_base_model, kernels._run
    monkeypatch.setattr(models, "load_base_model", lambda *a, cpu_kernels="tuned", **kw: load(
        *a, cpu_kernels="onednn" if cpu_kernels == "tuned" else cpu_kernels, **kw))  # a plan taking oneDNN
    # whose rounding differs from PyTorch's (at the tiny model's widths the two sum alike; at SmolLM2's they
    # part by ~1e-4 in the logits)
    monkeypatch.setattr(kernels, "_run", lambda *a: run(*a) * (1 + 1e-6))
    out = tmp_path / "run"
    values = recipe(tiny_dir, out, training={"mode": "medusa2", "batch_size": 4, "max_steps": 2, "loss": "kl"},
                    lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}, log={"every": 1})
    assert train_heads.main(["--config", str(write_recipe(tmp_path / "r.yaml", values))]) == 0
    assert train_log(out)[0]["base_kl"] == 0.0


def test_the_log_gives_the_learning_rates_each_step_ran_with(tiny_dir, tmp_path, capsys):
    """The log's lr was the next step's (read after the scheduler's step), and in Medusa-2 the adapter's
    alone: the heads-only stage logged 0 while the heads trained at training.heads_lr."""
    import train_heads

    out = tmp_path / "run"
    values = recipe(tiny_dir, out, training={"mode": "medusa2", "batch_size": 4, "max_steps": 3, "stage1_steps": 1,
                                             "lr": 0.01, "heads_lr": 0.02, "warmup_ratio": 0.0, "loss": "ce"},
                    lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}, log={"every": 1})
    assert train_heads.main(["--config", str(write_recipe(tmp_path / "r.yaml", values))]) == 0
    log = train_log(out)
    assert [r["lr"] for r in log] == pytest.approx([0.0, 0.01, 0.005])  # cosine over the 2 joint steps
    assert [r["heads_lr"] for r in log] == pytest.approx([0.02, 0.02 * 0.75, 0.02 * 0.25])  # cosine over all 3
    printed = capsys.readouterr()
    assert "lr 0.00e+00 heads_lr 2.00e-02 top1" in printed.out + printed.err  # the console line too


def test_fp16_on_the_cpu_is_refused_by_name(tiny_dir, tmp_path, capsys):
    """accelerate takes fp16 on the CPU without autocast: the run trained in float32 and said fp16."""
    import train_heads

    values = recipe(tiny_dir, tmp_path / "run", training={"mixed_precision": "fp16", "max_steps": 1})
    for flags in (["--plan"], []):  # --plan said nothing of it, and the run stopped at once
        with pytest.raises(SystemExit, match="training.mixed_precision=fp16 has no autocast on the CPU .* set "
                                             "training.mixed_precision=bf16 or no"):
            train_heads.main(["--config", str(write_recipe(tmp_path / "r.yaml", values)), *flags])


def test_examples_past_the_models_context_are_refused_before_features_are_extracted(tmp_path):
    """`data.tokenized` examples longer than the model's context under the default data.max_length=1024: the
    run failed in the feature extraction with an IndexError traceback (GPT-2's learned positions)."""
    import train_heads

    (tmp_path / "tiny").mkdir()
    tiny_model("gpt2").save_pretrained(tmp_path / "tiny" / "model")  # 256 positions
    examples = tmp_path / "tiny" / "examples.jsonl"
    examples.write_text("".join(json.dumps({"input_ids": ids, "labels": [-100] * 10 + ids[10:]}) + "\n"
                                for ids in ([3 + (i + j) % 24 for j in range(300)] for i in range(16))))
    values = recipe(tmp_path / "tiny", tmp_path / "run", training={"max_steps": 2},
                    heads={"num_heads": 2, "projection": "own"}, features={"topk": 0, "batch_size": 4})
    config_file = str(write_recipe(tmp_path / "r.yaml", values))
    with pytest.raises(SystemExit, match=re.escape("examples of up to 300 tokens are past the model's context of 256 "
                                                   "positions (data.max_length=1024 cuts them at that length); set "
                                                   "data.max_length=256 or lower")):
        train_heads.main(["--config", config_file])
    assert not (tmp_path / "run" / "features").exists() or not any((tmp_path / "run" / "features").iterdir())
    assert train_heads.main(["--config", config_file, "data.max_length=256"]) == 0
    # made with another tokenizer: an id past the embedding failed the same way, in the feature extraction
    vocab = tiny_model("gpt2").config.vocab_size
    examples.write_text(examples.read_text() + json.dumps({"id": "other", "input_ids": [3, vocab, 4],
                                                           "labels": [-100, vocab, 4]}) + "\n")
    with pytest.raises(SystemExit, match=re.escape(f"an example holds the token id {vocab}, past the model's "
                                                   f"vocabulary of {vocab} tokens (input_ids [3, {vocab}, 4]): the "
                                                   "examples were made with another tokenizer")):
        train_heads.main(["--config", config_file, "data.max_length=256", "output_dir=" + str(tmp_path / "run2")])
    # rows the run tokenises itself, with a token the tokenizer added past the embedding: not another tokenizer's
    from medusa_infer.serving.testing import word_tokenizer

    words = word_tokenizer()
    tiny_model("llama", vocab_size=len(words)).save_pretrained(tmp_path / "grown")
    words.add_tokens(["zzz"])  # (the embedding not resized)
    words.save_pretrained(tmp_path / "grown")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": str(i), "prompt": "the cat sat", "response": "the dog zzz ran"}) + "\n"
                            for i in range(6)))
    grown = {"output_dir": str(tmp_path / "run3"), "model": {"name": str(tmp_path / "grown")},
             "data": {"rows": str(rows), "heldout_fraction": 0.34}, "heads": {"num_heads": 2, "num_layers": 1},
             "training": {"max_steps": 1}}
    with pytest.raises(SystemExit, match=r"the tokenizer in .*grown holds more tokens than the model's embedding "
                                         r"\(added without resizing it\)"):
        train_heads.main(["--config", str(write_recipe(tmp_path / "grown.yaml", grown))])


def test_a_model_that_cannot_decode_here_is_refused_before_anything_runs(tiny_dir, tmp_path, capsys):
    """Granite-3's logits_scaling (logits scaled after the lm_head) passed --plan and every check, and was refused
    with a NotImplementedError traceback at the features stage, after every prompt was distilled (through a paid
    endpoint too); refused up front, for --plan and a run, in one line. Soft-capped attention (Gemma 2, which the
    load gives eager attention) is not refused."""
    import train_heads
    from test_architectures import CONFIGS, tiny

    tiny("granite", {**CONFIGS["granite"], "logits_scaling": 8.0}).save_pretrained(tmp_path / "granite")
    tiny("gemma2", CONFIGS["gemma2"]).save_pretrained(tmp_path / "gemma2")
    for mode in ("medusa1", "medusa2"):
        values = recipe(tiny_dir, tmp_path / f"run-{mode}", model={"name": str(tmp_path / "granite")},
                        training={"mode": mode, "max_steps": 2, **({"stage1_steps": 1} if mode == "medusa2" else {})})
        config_file = str(write_recipe(tmp_path / f"{mode}.yaml", values))
        for plan_only in (["--plan"], []):
            capsys.readouterr()
            with pytest.raises(SystemExit) as exit_info:
                train_heads.main(["--config", config_file, *plan_only])
            said = capsys.readouterr().err + str(exit_info.value)
            assert re.search(r"error: model.name=.*granite'?: GraniteForCausalLM scales its logits "
                             r"\(logits_scaling=8.0\)", said), said[-2000:]
            assert "Traceback" not in said
        assert not (tmp_path / f"run-{mode}" / "features").exists()
    values = recipe(tiny_dir, tmp_path / "run-gemma2", model={"name": str(tmp_path / "gemma2")})
    assert train_heads.main(["--config", str(write_recipe(tmp_path / "gemma2.yaml", values)), "--plan"]) == 0


def test_a_write_the_machine_refuses_ends_the_run_with_what_to_do(tiny_dir, tmp_path, monkeypatch):
    """A full disk ended a run with a traceback from wherever it wrote (torch.save's "[enforce fail at
    inline_container.cc:672] . unexpected pos 92608 vs 92496", or "[Errno 27] File too large"), a read-only folder
    too; any other error keeps its traceback."""
    import errno

    import train_heads
    from medusa_infer.checkpoint import write_failure

    from safetensors import SafetensorError

    from medusa_infer.checkpoint import write_in_place

    full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert write_failure(OSError(errno.ENOSPC, "No space left on device")) and write_failure(
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 92608 vs 92496")) and \
        write_failure(full)
    with pytest.raises(OSError) as named:  # (write_in_place names the file, raising from safetensors' error)
        write_in_place(tmp_path, [("model.safetensors", lambda path: (_ for _ in ()).throw(full))])
    assert "model.safetensors.partial could not be written" in str(named.value) and write_failure(named.value)
    assert "/ro/x is on a read-only disk" in write_failure(OSError(errno.EROFS, "Read-only", "/ro/x"))
    # (a file that cannot be read is not called unwritable)
    assert "this user may not open /x: change its permissions" in write_failure(PermissionError(
        errno.EACCES, "Permission denied", "/x"))
    assert write_failure(FileNotFoundError(errno.ENOENT, "No such file", "/x")) is None
    assert write_failure(RuntimeError("shape mismatch")) is None
    assert write_failure(SafetensorError("Error while deserializing header: HeaderTooLarge")) is None
    config_file = str(write_recipe(tmp_path / "r.yaml", recipe(tiny_dir, tmp_path / "run", training={"max_steps": 2})))
    failures = [OSError(errno.EFBIG, "File too large", str(tmp_path / "run" / "x")),
                RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 92608 vs 92496\nframe #0"),
                full]  # (the features' shards, saved by safetensors)
    for failure in failures:
        def refused(*args, **kwargs):
            raise failure

        monkeypatch.setattr(train_heads, "stage_train", refused)
        with pytest.raises(SystemExit) as exit_info:
            train_heads.main(["--config", config_file])
        said = str(exit_info.value)
        assert said.startswith("train_heads.py: error: ") and "free space, then run the same command again" in said
        assert "frame #0" not in said
    monkeypatch.setattr(train_heads, "stage_train", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        train_heads.main(["--config", config_file])


def test_heads_and_final_folders_linked_elsewhere_are_written_there(tiny_dir, tmp_path):
    """output_dir/heads as a symbolic link (to another disk): removing the link failed without a word, and
    renaming the new heads onto it failed every evaluation (NotADirectoryError)."""
    import train_heads
    from medusa_infer.checkpoint import load_heads_state

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    links = {"heads": run / "heads", "final": run / "checkpoints" / "final"}
    for name, link in links.items():
        (elsewhere / name).mkdir(parents=True)
        (elsewhere / name / "stale.txt").write_text("an earlier run's")
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(elsewhere / name)
    config_file = str(write_recipe(tmp_path / "r.yaml", recipe(tiny_dir, run, training={"max_steps": 2})))
    assert train_heads.main(["--config", config_file]) == 0
    for name, link in links.items():
        assert link.is_symlink() and not (elsewhere / name / "stale.txt").exists()
        assert (elsewhere / name / "config.json").is_file()
    assert load_heads_state(run / "heads")[1]  # (through the link)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["final", "heads"]  # (no side folder left)


def test_ctrl_c_ends_a_run_with_a_line_saying_how_to_go_on(tiny_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C ended train_heads.py with a 28-line traceback from wherever it was (accelerate's save_state)."""
    import train_heads

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_heads, "stage_features", interrupted)
    config_file = str(write_recipe(tmp_path / "r.yaml", recipe(tiny_dir, tmp_path / "run", training={"max_steps": 2})))
    try:
        assert train_heads.main(["--config", config_file]) == 130
    except KeyboardInterrupt:  # (escaping, it would stop the whole test session)
        pytest.fail("Ctrl-C escaped main() as a traceback")
    err = capsys.readouterr().err
    assert "train_heads.py: interrupted; run the same command again to go on" in err and "Traceback" not in err
    # the other processes of a launch say nothing (Ctrl-C reaches each of them: the line came once per process)
    for name in ("RANK", "OMPI_COMM_WORLD_RANK"):  # (mpirun's: accelerate sets RANK only once its state forms)
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.setenv(name, "1")
        try:
            assert train_heads.main(["--config", config_file]) == 130
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C escaped main() as a traceback")
        assert capsys.readouterr().err == "", name
    monkeypatch.undo()
    assert train_heads.main(["--config", config_file]) == 0


def test_the_plan_splits_rows_that_share_a_prompt_id_as_the_run_does(tmp_path):
    """Several answers to one prompt stay on one side of the split, so fewer rows can be held out: the plan counted
    the split by rows alone (22 trained, 6 held out) and promised <= 11 steps to a run that took 12 (24 and 4)."""
    import train_heads
    from medusa_infer.serving.testing import word_tokenizer
    from medusa_train.train_config import load_config, plan

    words = word_tokenizer()
    tiny_model("llama", vocab_size=len(words)).save_pretrained(tmp_path / "model")
    words.save_pretrained(tmp_path / "model")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": f"q{i // 4}", "prompt": "the cat sat", "response": "the dog ran on the mat"})
                            + "\n" for i in range(28)))
    values = {"output_dir": str(tmp_path / "run"), "model": {"name": str(tmp_path / "model")},
              "data": {"rows": str(rows), "heldout_fraction": 0.2}, "heads": {"num_heads": 2, "num_layers": 1},
              "training": {"mode": "medusa2", "batch_size": 2, "epochs": 1, "stage1_steps": 1},
              "lora": {"r": 2, "target_modules": ["q_proj", "v_proj"]}, "log": {"every": 1, "progress": False}}
    config_file = write_recipe(tmp_path / "r.yaml", values)
    planned = plan(load_config(config_file))
    assert (planned.train_examples, planned.heldout_examples) == (24, 4)
    assert train_heads.main(["--config", str(config_file)]) == 0
    assert len(train_log(tmp_path / "run")) <= planned.total_steps


def test_rows_too_few_for_one_batch_are_refused_before_the_features(tmp_path, capsys):
    """data.rows are counted by the plan as estimates (max_length tokens a row: it promised 18 steps for rows that
    fill no micro-batch), so the refusal of batches the data cannot fill came only after the backbone had run over
    every example for the feature cache; it comes once the rows are tokenised, and --plan still plans."""
    import train_heads
    from medusa_infer.serving.testing import word_tokenizer

    words = word_tokenizer()
    tiny_model("llama", vocab_size=len(words)).save_pretrained(tmp_path / "model")
    words.save_pretrained(tmp_path / "model")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": str(i), "prompt": "the cat sat", "response": "the dog ran on the mat"})
                            + "\n" for i in range(6)))
    values = {"output_dir": str(tmp_path / "run"), "model": {"name": str(tmp_path / "model")},
              "data": {"rows": str(rows), "heldout_fraction": 0.34}, "heads": {"num_heads": 2, "num_layers": 1},
              "training": {"epochs": 1, "batch_tokens": 1024}}
    config_file = str(write_recipe(tmp_path / "r.yaml", values))
    assert train_heads.main(["--config", config_file, "--plan"]) == 0
    assert "steps" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"training positions do not fill one micro-batch of 1024 x 1 process"):
        train_heads.main(["--config", config_file])
    assert not (tmp_path / "run" / "features").exists() or not any((tmp_path / "run" / "features").iterdir())
    assert train_heads.main(["--config", config_file, "training.batch_tokens=8"]) == 0


def test_training_pieces_a_bug_passed_are_pinned_by_hand(tiny_dir, tmp_path):
    """Mutations the suite let through, each changing what a run trains on or with: the base KL taken the other way
    (KL(student || teacher)); the adapter's scale without lora.alpha; path tokens one place on (a head reading its
    own target); Medusa-1's KL denominator counting positions with no candidate in the head vocabulary; the
    warm-up's first step at learning rate 0; its step count rounded up."""
    from medusa_train.features import head_targets, path_tokens
    from medusa_train.lora import add_lora
    from medusa_train.train_config import step_counts

    student = torch.tensor([[2.0, 0.0, -1.0, 0.5]])
    teacher = torch.tensor([[0.0, 1.5, 0.3, -2.0]])
    p, q = torch.softmax(teacher, -1), torch.softmax(student, -1)
    assert float(logits_kl(student, teacher)) == pytest.approx(float((p * (p.log() - q.log())).sum()), rel=1e-6)
    assert float(logits_kl(student, teacher)) != pytest.approx(float((q * (q.log() - p.log())).sum()), rel=1e-3)

    adapted = add_lora(tiny_model("llama"), r=4, alpha=16, dropout=0.0, target_modules=["q_proj"])
    q_proj = next(m for name, m in adapted.named_modules() if name.endswith("q_proj") and hasattr(m, "scaling"))
    assert q_proj.scaling == {"default": 4.0}  # alpha / r

    seq = torch.arange(10, 16)
    targets = head_targets(seq, 3)
    assert targets[0].tolist() == [12, 13, 14]  # head k at t: the token at t + k + 2
    for t in range(len(seq) - 4):
        assert path_tokens(targets)[t].tolist() == seq[t + 2 : t + 4].tolist()  # head k reads t + 2 .. t + k + 1

    config = config_from_dict(recipe(tiny_dir, tmp_path / "run", training={"loss": "kl", "warmup_ratio": 0.05,
                                                                            "max_steps": 30}))
    soft_ids = torch.tensor([[[3, 4]], [[-1, -1]]])  # [positions, heads, candidates]: the second all outside
    soft_probs = torch.tensor([[[0.5, 0.2]], [[0.6, 0.3]]])
    assert tr._target_counts(config, torch.zeros(2, 1, dtype=torch.long), soft_ids, soft_probs).tolist() == [1]
    assert [tr._lr_factor(step, 0, 10, 4, "linear") for step in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    assert step_counts(config, 10_000, 1)[3] == 1  # floor(0.05 * 30)


def test_run_settings_a_bug_passed_are_pinned(tiny_dir, tmp_path):
    """Mutations the suite let through: every epoch read in one order; a Medusa-2 run with no joint stage planned
    (its adapter never trained); an override's 1 read as false, one whose value holds = refused, 1e3 refused for
    an integer."""
    from medusa_train.train_config import convert_value, parse_overrides, step_counts

    cache: dict[int, torch.Tensor] = {}
    first = [tr.micro_batch_index(g, 16, 2, 8, 0, 0, 1, cache)[1].tolist() for g in range(8)]
    second = [tr.micro_batch_index(g, 16, 2, 8, 0, 0, 1, cache)[1].tolist() for g in range(8, 16)]
    assert sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(16)) and first != second
    config = config_from_dict(recipe(tiny_dir, tmp_path / "run", training={
        "mode": "medusa2", "max_steps": 40, "stage1_steps": 40}, lora={"r": 4, "target_modules": ["q_proj"]}))
    with pytest.raises(ValueError, match="training.stage1_steps=40 leaves no joint stage in 40 steps"):
        step_counts(config, 10_000, 1)
    assert all(convert_value(word, bool, "k") is True for word in ("1", "true", "yes", "on"))
    assert all(convert_value(word, bool, "k") is False for word in ("0", "false", "no", "off"))
    assert parse_overrides(["data.system_prompt=Answer as key=value pairs"]) == [
        ("data.system_prompt", "Answer as key=value pairs")]
    assert convert_value("1e3", int, "training.seed") == 1000
    with pytest.raises(ValueError, match="expected an integer"):
        convert_value("1.5", int, "training.seed")


def test_checkpoints_kept_and_time_trained_carry_across_a_resume(tiny_dir, tmp_path):
    """keep_checkpoints newest step folders stay (one more was kept, unnoticed); the seconds trained before a
    resume are added to the record's train_seconds (dropped, unnoticed where the resumed run took longer)."""
    import train_heads

    out = tmp_path / "run"
    values = recipe(tiny_dir, out, training={"max_steps": 8, "save_every": 1, "keep_checkpoints": 2, "seed": 3,
                                             "loss": "ce"})
    config_file = str(write_recipe(tmp_path / "r.yaml", values))
    assert train_heads.main(["--config", config_file]) == 0
    steps = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert steps == ["step-00000006", "step-00000007"]
    shutil.rmtree(out / "checkpoints" / "final")
    shutil.rmtree(out / "heads")
    last = tr.latest_checkpoint(out / "checkpoints")
    state = json.loads((last / tr.STATE_NAME).read_text())
    (last / tr.STATE_NAME).write_text(json.dumps({**state, "train_seconds": 1000.0}))
    assert train_heads.main(["--config", config_file]) == 0
    record = json.loads((out / "checkpoints" / "final" / "config.json").read_text())["training"]
    assert record["resumed_from_step"] == 7 and record["train_seconds"] >= 1000.0


def test_the_cards_example_sends_text_where_the_tokenizer_renders_no_chats(tiny_dir, tmp_path, capsys):
    """The heads' card (the one uploaded) sent a chat where the model's tokenizer has no template: its example
    failed ("this tokenizer has no chat template")."""
    import train_heads
    from medusa_infer.serving.testing import word_tokenizer

    shutil.copytree(tiny_dir / "model", tmp_path / "model")
    plain = word_tokenizer()
    plain.chat_template = None
    plain.save_pretrained(tmp_path / "model")
    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 2})
    values["model"]["name"] = str(tmp_path / "model")
    assert train_heads.main(["--config", str(write_recipe(tmp_path / "r.yaml", values))]) == 0
    card = (tmp_path / "run" / "heads" / "README.md").read_text()
    assert 'model.generate(prompt="The capital of France is"' in card and "messages=" not in card
    # a tokenizer whose remote code this machine cannot run: the heads are written all the same (the run failed
    # at evaluation, and every rerun after it)
    import medusa_infer.models as models

    def no_tokenizer(name, trust_remote_code=False):
        raise ImportError("This modeling file requires the following packages: tiktoken")

    values["output_dir"] = str(tmp_path / "remote")
    values["eval"] = {**values["eval"], "datastore": False}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "load_tokenizer", no_tokenizer)
        assert train_heads.main(["--config", str(write_recipe(tmp_path / "remote.yaml", values))]) == 0
    assert (tmp_path / "remote" / "heads" / "config.json").is_file()
    assert "did not load (ImportError: This modeling file requires" in capsys.readouterr().err


def test_a_finished_fp16_run_is_evaluated_on_the_cpu(tiny_dir, tmp_path):
    """The fp16 refusal is for training: a run a GPU trained in fp16 (its settings say so, and a rerun must
    keep them) is evaluated on a CPU (it was refused, and with the precision changed refused as another run)."""
    import shutil

    import train_heads

    out = tmp_path / "run"
    config_file = str(write_recipe(tmp_path / "r.yaml", recipe(tiny_dir, out, training={"max_steps": 2})))
    assert train_heads.main(["--config", config_file]) == 0
    final = out / "checkpoints" / "final" / "config.json"  # as a GPU's fp16 run writes it
    stored = json.loads(final.read_text())
    assert stored["training"]["settings"]["training.mixed_precision"] == "no"
    stored["training"]["settings"]["training.mixed_precision"] = "fp16"
    final.write_text(json.dumps(stored))
    shutil.rmtree(out / "heads")
    # a process of its own: accelerate keeps one precision a process
    done = subprocess.run([sys.executable, "train_heads.py", "--config", config_file, "training.mixed_precision=fp16"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "heads" / "config.json").is_file()


@pytest.fixture(scope="module")
def counting_heads(tiny_dir, tmp_path_factory) -> Path:
    """A Medusa-1 run's heads (feature cache, a 30-token head vocabulary) that learnt to count."""
    import train_heads

    root = tmp_path_factory.mktemp("counting")
    values = recipe(tiny_dir, root / "run", training={"epochs": 8, "lr": 0.03}, heads={"reduced_vocab_size": 30},
                    log={"every": 50})
    train_heads.main(["--config", str(write_recipe(root / "r.yaml", values))])
    accuracies = json.loads((root / "run" / "heads" / "config.json").read_text())["head_accuracies"]
    assert accuracies[0][0] > 0.9
    return root / "run" / "heads"


@pytest.mark.parametrize("mode", ["medusa1", "medusa2"])
def test_training_starts_from_an_earlier_runs_heads(tiny_dir, tmp_path, counting_heads, mode, capsys):
    """Medusa's two stages on a CPU: Medusa-1 on the feature cache, then (here) one more step of
    Medusa-1 or a Medusa-2 step from those heads, with their head vocabulary."""
    import train_heads
    from safetensors.torch import load_file, save_file

    # The starting heads with their vocabulary permuted (rows moved alike, so they still count): a
    # run that chose its own vocabulary from the same data would not end with this order.
    start = tmp_path / "start"
    shutil.copytree(counting_heads, start)
    state = load_file(str(start / "model.safetensors"))
    order = torch.randperm(30, generator=torch.Generator().manual_seed(0))
    state = {k: (v[order] if k == "token_map" or k.endswith(".proj.weight") else v) for k, v in state.items()}
    save_file(state, str(start / "model.safetensors"), metadata={"format": "pt"})

    def first_step(out: Path, **heads) -> dict:
        training = {"max_steps": 1, "lr": 1e-4}
        extra = {}
        if mode == "medusa2":
            training |= {"mode": "medusa2", "batch_size": 8, "loss": "ce"}
            extra = {"lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}}
        values = recipe(tiny_dir, out, training=training, heads={"reduced_vocab_size": 30, **heads}, **extra)
        train_heads.main(["--config", str(write_recipe(out.with_suffix(".yaml"), values))])
        return train_log(out)[0]

    capsys.readouterr()
    started = first_step(tmp_path / "from", init_from=str(start))
    assert "beside another held-out split" not in capsys.readouterr().out  # the starting heads' split
    fresh = first_step(tmp_path / "fresh")
    # the first step's accuracy is measured before its update: the starting heads' own
    assert min(started["head_top1"]) > 0.9 and max(fresh["head_top1"]) < 0.5, (started, fresh)
    after = load_file(str(tmp_path / "from" / "heads" / "model.safetensors"))
    assert torch.equal(after["token_map"], state["token_map"])  # the starting heads' vocabulary, not a new one
    own = load_file(str(tmp_path / "fresh" / "heads" / "model.safetensors"))["token_map"]
    assert not torch.equal(own, state["token_map"])
    assert (tmp_path / "from" / "heads" / "adapter").is_dir() == (mode == "medusa2")
    # a finished run re-run: passes while the starting heads are unchanged or gone, refused once they changed
    config_file = str((tmp_path / "from").with_suffix(".yaml"))
    assert train_heads.main(["--config", config_file]) == 0
    save_file({**state, "token_map": state["token_map"].flip(0)}, str(start / "model.safetensors"))
    with pytest.raises(SystemExit):
        train_heads.main(["--config", config_file])
    shutil.move(start, tmp_path / "moved")
    assert train_heads.main(["--config", config_file]) == 0
    if mode == "medusa1":  # another seed draws another split: the starting heads' training examples may be held out,
        capsys.readouterr()  # their figures read high (nothing said)
        values = recipe(tiny_dir, tmp_path / "seed", training={"max_steps": 1, "seed": 5},
                        heads={"reduced_vocab_size": 30, "init_from": str(tmp_path / "moved")})
        train_heads.main(["--config", str(write_recipe(tmp_path / "seed.yaml", values))])
        assert "were trained beside another held-out split" in capsys.readouterr().out


def test_init_from_refuses_heads_this_run_would_not_build(tiny_dir, tmp_path, counting_heads):
    import train_heads

    def values(folder: Path = counting_heads, **heads) -> dict:
        return recipe(tiny_dir, tmp_path / "run", heads={"reduced_vocab_size": 30, "init_from": str(folder), **heads})

    def check(match: str, folder: Path = counting_heads, **heads) -> None:
        with pytest.raises(ValueError, match=match):
            tr.check_init_from(config_from_dict(values(folder, **heads)))

    check("num_heads=3 where this run builds 2", num_heads=2)
    check("next_token_input=False where this run builds True", next_token_input=True, path_input=True)
    check("scores 30 tokens where heads.reduced_vocab_size=None; set it to 30", reduced_vocab_size=None)
    check("has no config.json", tmp_path)
    templated = values()
    templated["model"]["chat_template"] = "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="chat_template=None where this run builds"):
        tr.check_init_from(config_from_dict(templated))
    adapted = tmp_path / "adapted"
    shutil.copytree(counting_heads, adapted)
    (adapted / "adapter").mkdir()
    check("holds a Medusa-2 adapter", adapted)
    shutil.rmtree(adapted / "adapter")  # copied without it: still heads of the adapted backbone
    saved = json.loads((adapted / "config.json").read_text())
    saved["training"] = {"recipe": {"training": {"mode": "medusa2"}}}
    (adapted / "config.json").write_text(json.dumps(saved))
    check("holds heads a Medusa-2 run trained with a LoRA adapter", adapted)
    faster = tmp_path / "fd"
    faster.mkdir()
    (faster / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    check(r"holds heads in the FasterDecoding/Medusa layout; save them in medusa-forge's first", faster)
    # heads of an earlier release, which named the model folder as the recipe wrote it (relative, through a link):
    # the same folder (they were refused as another base model)
    relative = tmp_path / "relative"
    shutil.copytree(counting_heads, relative)
    saved = json.loads((relative / "config.json").read_text())
    (tmp_path / "link").symlink_to(Path(saved["base_model_name_or_path"]).parent)
    linked = str(tmp_path / "link" / Path(saved["base_model_name_or_path"]).name)
    (relative / "config.json").write_text(json.dumps({**saved, "base_model_name_or_path": linked}))
    tr.check_init_from(config_from_dict(values(relative)))
    assert tr.same_folder(linked, saved["base_model_name_or_path"]) and not tr.same_folder("org/a", "org/b")
    with pytest.raises(ValueError, match="hidden_size=32 where the model has 64"):
        tr.initial_heads(config_from_dict(values()), 64, 96)
    state, token_map = tr.initial_heads(config_from_dict(values()), 32, 96)
    assert token_map is state["token_map"] and len(token_map) == 30
    # a resumed run checks the starting heads by content, not only by path
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "copy"
    shutil.copytree(counting_heads, copy)
    before = tr.resume_fingerprint(config_from_dict(values(copy)))
    weights = load_file(str(copy / "model.safetensors"))
    weights["heads.0.blocks.0.linear.bias"] += 1
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert tr.resume_fingerprint(config_from_dict(values(copy))) != before
    # train_heads.py refuses such a folder before any stage runs
    with pytest.raises(SystemExit):
        train_heads.main(["--config", str(write_recipe(tmp_path / "r.yaml", values(num_heads=2)))])
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# Several processes


@pytest.mark.slow
def test_push_to_hub_after_training_takes_private(tiny_dir, tmp_path, monkeypatch, capsys):
    """``--private`` creates the repo private: the upload holds the datastore, the training conversations
    (there was no way to ask for it)."""
    import huggingface_hub

    import train_heads
    from medusa_train import evaluate

    from medusa_infer import checkpoint

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "token")
    pushed = []
    monkeypatch.setattr(evaluate, "push_to_hub", lambda folder, repo, private=None: pushed.append(
        (Path(folder).name, repo, private)) or "https://hub/commit")
    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 2})
    config = str(write_recipe(tmp_path / "r.yaml", values))

    def public(repo_id, token=None):
        raise ValueError(f"{repo_id} exists and is public")

    # an empty --push-to-hub read as not given: a recipe's eval.push_to_hub uploaded all the same
    with pytest.raises(SystemExit):
        train_heads.main(["--config", config, "--push-to-hub", ""])
    assert "--push-to-hub is empty (''): give the Hub repo" in capsys.readouterr().err
    # a private upload into a public repo is refused before any work (it failed after training)
    monkeypatch.setattr(checkpoint, "check_private_upload", public)
    with pytest.raises(SystemExit):
        train_heads.main(["--config", config, "--push-to-hub", "me/heads", "--private"])
    assert "me/heads exists and is public" in capsys.readouterr().err and not (tmp_path / "run" / "heads").exists()
    monkeypatch.setattr(checkpoint, "check_private_upload", lambda repo_id, token=None: None)
    assert train_heads.main(["--config", config, "--push-to-hub", "me/heads", "--private"]) == 0
    assert train_heads.main(["--config", config, "--push-to-hub", "me/heads"]) == 0  # finished: uploaded again
    assert pushed == [("heads", "me/heads", True), ("heads", "me/heads", None)]
    # heads naming a local folder as their base are uploaded, and said so
    assert "the uploaded heads name their base model" in capsys.readouterr().out
    # the card says what the datastore uploaded with them holds
    card = (tmp_path / "run" / "heads" / "README.md").read_text()
    assert (tmp_path / "run" / "heads" / "datastore.safetensors").is_file()
    assert "## Datastore" in card and "written by `train_heads.py`: the training split's ready examples " \
        "(examples.jsonl)" in card


def test_ddp_sends_no_buffers_before_each_forward():
    """Medusa-1 keeps the frozen lm_head and embeddings as buffers of the trained module: DDP's default
    sent them from the first process before every forward (509.8 ms against 4.6 a step at SmolLM2's
    size on two CPU processes)."""
    import train_heads

    for mode in ("medusa1", "medusa2"):
        config = config_from_dict({"data": {"prompts": "p.jsonl"}, "training": {"mode": mode}})
        handler = train_heads.make_accelerator(config).ddp_handler
        assert handler.broadcast_buffers is False and handler.find_unused_parameters == (mode == "medusa2")


def test_two_process_cpu_launch_matches_one_process(tiny_dir, tmp_path):
    """... and one killed, then resumed, ends as the uninterrupted launch (each process of a CPU launch
    runs on "cpu:0", onto which torch.load could not map the checkpoint's log window: every such resume
    failed)."""
    env = quiet_env(tmp_path)
    values = {"training": {"max_steps": 6, "batch_tokens": 64, "seed": 1, "save_every": 2},
              "heads": {"reduced_vocab_size": 40}}
    # (logging to TensorBoard: closing its logger ended the processes' group, and the launch failed at the next
    # barrier with no heads written)
    two = recipe(tiny_dir, tmp_path / "two", **values, log={"tensorboard": True, "progress": False})
    one = recipe(tiny_dir, tmp_path / "one", **values)
    one["training"]["batch_tokens"] = 128  # the same global batch on one process
    run_script([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                "recipes/accelerate/cpu-ddp-2proc.yaml", "train_heads.py", "--config",
                str(write_recipe(tmp_path / "two.yaml", two))], env)
    run_script([sys.executable, "train_heads.py", "--config", str(write_recipe(tmp_path / "one.yaml", one))], env)
    state = json.loads((tmp_path / "two" / "checkpoints" / "final" / "config.json").read_text())
    assert state["training"]["num_processes"] == 2, "the launch did not start two ranks"
    logs = train_log(tmp_path / "one"), train_log(tmp_path / "two")
    assert [r["step"] for r in logs[0]] == [r["step"] for r in logs[1]] == list(range(1, 7))  # whole curves
    for a, b in zip(*logs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5)
        assert a["head_top1"] == pytest.approx(b["head_top1"], abs=1e-6)
    a, b = final_heads(tmp_path / "one"), final_heads(tmp_path / "two")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/cpu-ddp-2proc.yaml"]
    # logged every 3 steps: the step-2 checkpoint holds a log window with sums in it
    killed = str(write_recipe(tmp_path / "killed.yaml", recipe(tiny_dir, tmp_path / "killed", **values,
                                                                log={"every": 3, "progress": False})))
    result = subprocess.run([*launch, "--main_process_port", "29573", str(script), "3", "--config", killed],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and (tmp_path / "killed" / "checkpoints" / "step-00000002").is_dir(), \
        result.stderr[-2000:]
    resumed = run_script([*launch, "--main_process_port", "29574", "train_heads.py", "--config", killed], env)
    assert "resuming from" in resumed.stdout
    c = final_heads(tmp_path / "killed")
    for name in b:
        assert torch.equal(b[name], c[name]), name
    lines = train_log(tmp_path / "killed")
    assert [r["step"] for r in lines] == [3, 6]
    assert lines[0]["loss"] == pytest.approx(sum(r["loss"] for r in logs[1][:3]) / 3, rel=1e-5)


LAGGING_RANK_SCRIPT = """
import sys, time
import train_heads
train = train_heads.stage_train
def train_then_lag(config, accelerator, *args):
    train(config, accelerator, *args)
    if accelerator.process_index == 1:  # held up (a loaded machine): the main process evaluates meanwhile
        time.sleep(8)
train_heads.stage_train = train_then_lag
sys.exit(train_heads.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_process_that_lags_after_training_still_joins_the_evaluation(tiny_dir, tmp_path):
    """Whether to train and to evaluate is decided once, by the main process: a process that looked at the
    heads folder after the main process had written it skipped evaluating and left the main process
    waiting at the evaluation's barrier until the launch failed."""
    script = tmp_path / "lagging.py"
    script.write_text(LAGGING_RANK_SCRIPT)
    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 2, "batch_tokens": 64, "seed": 1})
    result = run_script([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                         "recipes/accelerate/cpu-ddp-2proc.yaml", "--main_process_port", "29571", str(script),
                         "--config", str(write_recipe(tmp_path / "r.yaml", values))], quiet_env(tmp_path))
    assert (tmp_path / "run" / "heads" / "config.json").is_file(), result.stdout[-2000:]
    assert "stage seconds" in result.stdout


DEEPSPEED_SCRIPT = """
import json, sys, torch, deepspeed
from medusa_train import trainer as tr
from medusa_train.features import FeatureCache, FeatureDataset
from medusa_train.train_config import config_from_dict
from medusa_train.losses import head_ce_loss
values, cache_dir, ds_json, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
config = config_from_dict(values)
deepspeed.init_distributed(dist_backend="gloo")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
cache = FeatureCache.load(cache_dir)
module = tr.new_heads_module(config, cache.lm_head["weight"], None, None, "llama", None)
data = FeatureDataset(cache.block, config.heads.num_heads, None, cache.manifest["vocab_size"])
ds_config = json.loads(open(ds_json).read())
micro = config.training.batch_tokens
tr._fill_deepspeed_config(ds_config, micro, config.training.max_grad_norm)  # as train() does
ds_config.update(gradient_accumulation_steps=1, train_batch_size=micro * world)
ds_config.pop("bf16", None)
ds_config.update(zero_allow_untested_optimizer=True)  # torch's AdamW: DeepSpeed's own needs CUDA
optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=config.training.lr)
engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config)
cache_perm, losses = {}, []
for step in range(8):
    _, index = tr.micro_batch_index(step, len(data), micro, len(data) // (micro * world), 0, rank, world, cache_perm)
    batch = data.batch(index)
    loss = head_ce_loss(engine(batch["hidden"]), batch["targets"]).loss
    engine.backward(loss)
    engine.step()
    losses.append(float(loss))
if rank == 0:
    json.dump({"losses": losses, "zero_stage": engine.zero_optimization_stage()}, open(out, "w"))
# an interpreter exiting with the process group alive can abort in a communication thread's teardown
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_deepspeed_zero2_on_cpu_trains_heads(tiny_dir, tmp_path):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")
    env = quiet_env(tmp_path)
    env["DS_ACCELERATOR"] = "cpu"
    model = MedusaModel.from_base(tiny_model("llama"), num_heads=1)
    cache = build_feature_cache(model, counting_examples(32), tmp_path / "features",
                                model_fingerprint(str(tiny_dir / "model")), topk=0, progress=False)
    values = recipe(tiny_dir, tmp_path / "run", training={"batch_tokens": 64, "lr": 0.01})
    script = tmp_path / "ds.py"
    script.write_text(DEEPSPEED_SCRIPT)
    out = tmp_path / "losses.json"
    run_script([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                str(script), json.dumps(values), str(cache), str(REPO / "recipes/accelerate/deepspeed-zero2.json"),
                str(out)], env)
    result = json.loads(out.read_text())
    assert result["zero_stage"] == 2
    assert result["losses"][-1] < result["losses"][0]


def test_a_restarted_runs_event_file_sorts_after_the_killed_ones(tmp_path):
    """TensorBoard names event files by whole seconds: a run restarted within the second its killed run
    started in could sort first, and the killed run's steps, read last, purged its own (a TensorBoard of
    step 1; test_logs_to_jsonl_tensorboard_and_offline_wandb failed so under load)."""
    import medusa_train.trainer as tr

    now = int(time.time())
    (tmp_path / f"events.out.tfevents.{now}.host.123.0").write_bytes(b"")
    (tmp_path / "events.out.tfevents.garbled").write_bytes(b"")
    tr._after_earlier_event_files(tmp_path)
    assert time.time() >= now + 1
    started = time.time()
    tr._after_earlier_event_files(tmp_path / "none")  # no earlier file: no wait
    assert time.time() - started < 0.5


def test_logs_to_jsonl_tensorboard_and_offline_wandb(tiny_dir, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    import train_heads

    for name, value in quiet_env(tmp_path).items():
        if name in ("HOME", "TMPDIR", "WANDB_MODE", "WANDB_DIR"):
            monkeypatch.setenv(name, value)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    values = recipe(tiny_dir, out, training={"max_steps": 4, "save_every": 2},
                    log={"tensorboard": True, "wandb": True})
    config_file = str(write_recipe(tmp_path / "r.yaml", values))
    killed_at_step(3, config_file, tmp_path)  # logged step 3 after its checkpoint at step 2
    train_heads.main(["--config", config_file])
    assert [r["step"] for r in train_log(out)] == [1, 2, 3, 4]
    assert list((out / "logs" / "wandb").glob("offline-run-*"))
    events = EventAccumulator(str(out / "logs" / "medusa-forge"))
    events.Reload()
    # each step once (the killed run's step 3 was read beside the resumed one's), each head's loss too
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]
    for k, record in enumerate(train_log(out)):
        assert [e.value for e in events.Scalars("head2_loss")][k] == pytest.approx(record["head_loss"][1])
    # killed before its first checkpoint: the run starts again, and TensorBoard drops the killed one's steps
    out = tmp_path / "early"
    config_file = str(write_recipe(tmp_path / "early.yaml", {**values, "output_dir": str(out)}))
    killed_at_step(1, config_file, tmp_path)
    train_heads.main(["--config", config_file])
    events = EventAccumulator(str(out / "logs" / "medusa-forge"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [r["step"] for r in train_log(out)] == [1, 2, 3, 4]


@pytest.mark.parametrize("name, hub_id, recorded", [
    ("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct"),  # loads offline
    ("/models/llama-local", "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
    ("org/model", None, "org/model"),
])
def test_heads_config_names_the_base_model_the_way_it_loads_again(name, hub_id, recorded):
    config = config_from_dict({"model": {"name": name, "hub_id": hub_id}, "data": {"rows": "rows.jsonl"}})
    assert tr.heads_config(config, 8, 32, "llama", None).base_model_name_or_path == recorded


def test_heads_config_records_the_recipes_chat_template():
    """Heads trained on a recipe's template (Vicuna's) carry it; from_pretrained installs it (test_model)."""
    values = {"model": {"name": "org/model", "chat_template": "{{ messages }}"}, "data": {"rows": "rows.jsonl"}}
    assert tr.heads_config(config_from_dict(values), 8, 32, "llama", None).chat_template == "{{ messages }}"
    del values["model"]["chat_template"]
    assert tr.heads_config(config_from_dict(values), 8, 32, "llama", None).chat_template is None



def test_an_fsdp_launch_without_a_gpu_names_what_runs_instead(tiny_dir, tmp_path, monkeypatch, capsys):
    """accelerate runs FSDP on GPUs only: a launch with fsdp.yaml on a CPU trains as plain data parallel, which
    the run says (its note named training.cpu, which is not what decides it)."""
    import train_heads

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch --config_file fsdp.yaml` sets
    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 1})
    assert train_heads.main(["--config", str(write_recipe(tmp_path / "r.yaml", values))]) == 0
    assert ("note: the launch config asks for FSDP, which accelerate does not run here (it runs FSDP on GPUs only; "
            "CUDA available: False, training.cpu=False): training in one process, nothing sharded") \
        in capsys.readouterr().out


#: accelerate made FSDP on the CPU: it maps an FSDP launch config to FSDP on GPU-like devices only (MULTI_CPU, plain
#: data parallel, here), where torch's FSDP2 runs on the CPU over gloo; then KILL_SCRIPT
FSDP_ON_THE_CPU = """
from accelerate import state
from accelerate.utils import DistributedType

init = state.AcceleratorState.__init__

def fsdp_on_the_cpu(self, *args, fsdp_plugin=None, **kwargs):
    init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin

state.AcceleratorState.__init__ = fsdp_on_the_cpu
""" + KILL_SCRIPT


@pytest.mark.slow
def test_an_fsdp_medusa2_run_resumes_from_its_heads_only_stage_and_names_a_damaged_checkpoint(tiny_dir, tmp_path):
    """From a review of FSDP on the CPU (accelerate forced into it, two processes; tests/test_cuda.py runs
    fsdp.yaml on a GPU, one process, never resuming): a Medusa-2 checkpoint of the heads-only stage held no AdamW
    state for the adapter, which torch.distributed.checkpoint's loader asks for: resuming from it failed
    ("Missing key in checkpoint state_dict: optimizer.state....lora_A...step"); and a damaged shard raised
    CheckpointException, a BaseException, as a traceback on every rank (not the message naming the one before)."""
    from safetensors.torch import load_file

    env = quiet_env(tmp_path)
    config = tmp_path / "fsdp.yaml"  # the GPU launch config, for 2 processes
    config.write_text((REPO / "recipes/accelerate/fsdp.yaml").read_text().replace("num_processes: 8",
                                                                                   "num_processes: 2"))
    script = tmp_path / "fsdp_cpu.py"
    script.write_text(FSDP_ON_THE_CPU)

    def launch(kill_at: int, recipe_file: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                               "--main_process_port", str(free_port()), str(script), str(kill_at), "--config",
                               recipe_file], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)

    values = {"training": {"mode": "medusa2", "batch_size": 4, "max_steps": 4, "stage1_steps": 2,
                           "heads_warmup_steps": 2, "loss": "ce", "seed": 1, "save_every": 2},
              "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0},
              "heads": {"reduced_vocab_size": 30}}
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    whole_recipe = str(write_recipe(tmp_path / "whole.yaml", recipe(tiny_dir, whole, **values)))
    done = launch(0, whole_recipe)
    assert done.returncode == 0 and "accelerate: FSDP on cpu, 2 process(es)" in done.stdout, \
        (done.stdout + done.stderr)[-3000:]
    killed_recipe = str(write_recipe(tmp_path / "killed.yaml", recipe(tiny_dir, killed, **values)))
    died = launch(3, killed_recipe)  # after step 3: its last checkpoint is step 2's, of the heads-only stage
    assert died.returncode != 0 and (killed / "checkpoints" / "step-00000002").is_dir(), died.stderr[-3000:]
    assert not (killed / "checkpoints" / "step-00000004").exists()
    resumed = launch(0, killed_recipe)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, (resumed.stdout + resumed.stderr)[-3000:]
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = (load_file(run / "checkpoints" / "final" / name) for run in (whole, killed))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    # the step checkpoint holds what trains (heads, adapter) and its optimizer state, not the frozen backbone
    # (accelerate's save_state saved the FSDP module whole: ~16 GB a checkpoint for an 8B model)
    from torch.distributed.checkpoint import FileSystemReader

    step = whole / "checkpoints" / "step-00000002"
    saved = FileSystemReader(str(step / "trainable")).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("model.")]
    assert weights and all(".heads." in k or "lora_" in k for k in weights), sorted(saved)
    assert any("lora_" in k for k in saved if k.startswith("optimizer.state.")), sorted(saved)
    assert not (step / "pytorch_model_fsdp_0").exists() and not (step / "optimizer_0").exists()
    # a damaged shard of the step checkpoint left (the last step's is the final one): named, with what to do
    shutil.rmtree(whole / "checkpoints" / "final")
    shard = step / "trainable" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    broken = launch(0, whole_recipe)
    said = broken.stdout + broken.stderr
    assert broken.returncode != 0 and f"{shard.parents[1]} could not be loaded" in said, said[-3000:]
    # (torchrun's own traceback follows, as after any rank that failed; none of a rank's through the trainer)
    assert "to train from the start" in said and 'medusa_train/trainer.py", line' not in said, said[-3000:]
    # one line, with the first failing rank's own error (CheckpointException's text held every rank's traceback)
    assert "(RANK " not in said and "could not be loaded (RuntimeError: " in said, said[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("stage, mode", [(2, "medusa1"), (2, "medusa2"), (3, "medusa2")])
def test_deepspeed_launch_configs_train_heads_on_the_cpu(tiny_dir, tmp_path, stage, mode):
    """``accelerate launch --config_file recipes/accelerate/deepspeed-zeroN.yaml train_heads.py`` runs
    DeepSpeed itself, two processes, on a machine without a GPU (its CPU accelerator, gloo), in
    bfloat16 as the GPU recipes train: ZeRO-2 Medusa-1 on the feature cache, ZeRO-2 Medusa-2 (whose
    module DeepSpeed casts to bfloat16, adapter included), ZeRO-3 Medusa-2 with the base model
    partitioned as it loads, evaluated from a whole copy. tests/test_cuda.py runs
    each launch config on a GPU."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")
    env = quiet_env(tmp_path)
    env["DS_ACCELERATOR"] = "cpu"
    out = tmp_path / "run"
    training = {"mixed_precision": "bf16", "max_steps": 6, "seed": 1, "lr": 0.03}
    if mode == "medusa2":
        training |= {"mode": "medusa2", "batch_size": 4, "stage1_steps": 2, "heads_warmup_steps": 2, "loss": "ce",
                     "save_every": 3}
        values = recipe(tiny_dir, out, training=training, lora={"r": 4, "target_modules": ["q_proj", "v_proj"]},
                        model={"dtype": "bfloat16"}, heads={"projection": "shared", "next_token_input": True})
    else:
        values = recipe(tiny_dir, out, training=training)
    result = run_script([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                         f"recipes/accelerate/deepspeed-zero{stage}.yaml", "--num_processes", "2",
                         "--main_process_port", str(29560 + 2 * stage + (mode == "medusa2")), "train_heads.py",
                         "--config",
                         str(write_recipe(tmp_path / "r.yaml", values))], env)
    assert "accelerate: DEEPSPEED on cpu, 2 process(es), mixed precision bf16" in result.stdout, \
        result.stdout[-2000:]
    log = train_log(out)
    assert [r["step"] for r in log] == list(range(1, 7)) and log[-1]["loss"] < log[0]["loss"]
    config = json.loads((out / "heads" / "config.json").read_text())
    assert len(config["head_accuracies"]) == 3 and config["tree"]
    assert (out / "heads" / "adapter").is_dir() == (mode == "medusa2")
    # the optimizer's float32 master weights, not the bfloat16 copies DeepSpeed computed with
    assert {t.dtype for t in final_heads(out).values() if t.is_floating_point()} == {torch.float32}
    from safetensors.torch import load_file

    published = load_file(out / "heads" / "model.safetensors")  # after evaluating them on the bfloat16 base
    assert {k: v.dtype for k, v in published.items()} == {k: v.dtype for k, v in final_heads(out).items()}
    if mode == "medusa2":  # the adapter too, and only its LoRA weights (A and B for q_proj and v_proj per layer)
        adapter = load_file(out / "heads" / "adapter" / "adapter_model.safetensors")
        layers = json.loads((tiny_dir / "model" / "config.json").read_text())["num_hidden_layers"]
        assert len(adapter) == 4 * layers and all("lora_" in k for k in adapter), sorted(adapter)
        assert {t.dtype for t in adapter.values()} == {torch.float32}
        # a step checkpoint holds what trains, not the frozen backbone (it held all of it: ~16 GB for an 8B model)
        step = out / "checkpoints" / "step-00000003" / "pytorch_model"
        assert step.is_dir()
        if stage == 2:  # (ZeRO-3's files hold partitions)
            states = torch.load(step / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)["module"]
            frozen = [k for k in states if "lora_" not in k and ".heads." not in k and "rotary" not in k]
            assert states and not frozen, frozen[:5]
        # the adapter's Adam starts at its first joint step, as under DDP (DeepSpeed stepped it through the
        # heads-only stage with zero gradients: 3 steps of history, whose bias correction shrank nothing)
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        for rank in range(2):  # (DeepSpeed's own objects beside the tensors: those three read, nothing else)
            with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
                saved = torch.load(step / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", map_location="cpu",
                                   weights_only=True)["optimizer_state_dict"]
            state = saved.get("base_optimizer_state", saved.get("optimizer_state_dict"))["state"]
            assert {group: float(s["step"]) for group, s in state.items()} == {0: 3.0, 1: 1.0}


ZERO3_DISTILL = """
import sys
import torch
import train_heads
from medusa_train import distill as distill_module
from medusa_train.train_config import config_from_dict
from transformers.integrations import is_deepspeed_zero3_enabled

folder = sys.argv[1]
config = config_from_dict({"model": {"name": folder}, "data": {"prompts": "p.jsonl"}, "output_dir": sys.argv[2],
                           "training": {"mode": "medusa2", "mixed_precision": "bf16"}})
accelerator = train_heads.make_accelerator(config)
assert is_deepspeed_zero3_enabled()
seen = {}

def spy(config, accelerator=None, on_batch=None):  # what distill() meets: a model it loads must be whole
    from medusa_infer.models import load_base_model
    seen["zero3"] = is_deepspeed_zero3_enabled()
    seen["shape"] = tuple(load_base_model(folder).model.layers[0].self_attn.q_proj.weight.shape)
    raise KeyboardInterrupt

distill_module.distill = spy
import medusa_infer.models as models  # the tiny model's folder holds no tokenizer, which stage_data checks first
default_tokenizer = models.load_tokenizer("smollm2-135m-instruct")
models.load_tokenizer = lambda *args, **kwargs: default_tokenizer
try:
    train_heads.stage_data(config, accelerator, None)
except KeyboardInterrupt:
    pass
print("inside", seen, "after", is_deepspeed_zero3_enabled())
"""


@pytest.mark.slow
def test_distillation_under_zero3_loads_the_model_whole(tiny_dir, tmp_path):
    """Under the ZeRO-3 launch config transformers partitions every model it loads: the model that
    answers the prompts, in no DeepSpeed engine, had empty weights ('weight' must be 2-D), and every
    GPU recipe distils first."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")
    env = quiet_env(tmp_path) | {
        "DS_ACCELERATOR": "cpu", "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(REPO / "recipes" / "accelerate" / "deepspeed-zero3.json"),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1"}
    result = run_script([sys.executable, "-c", ZERO3_DISTILL, str(tiny_dir / "model"), str(tmp_path / "run")], env)
    assert "inside {'zero3': False, 'shape': (32, 32)} after True" in result.stdout, result.stdout[-2000:]


def test_deepspeed_clips_gradients_at_the_recipes_max_grad_norm():
    """DeepSpeed's engine clips gradients itself (accelerate's clip_grad_norm_ only reads the norm there):
    the shipped configs take ``training.max_grad_norm`` ("auto"), and a file that sets another value is
    refused rather than silently replacing the recipe's."""
    for name in ("deepspeed-zero2.json", "deepspeed-zero3.json"):
        shipped = json.loads((REPO / "recipes" / "accelerate" / name).read_text())
        tr._fill_deepspeed_config(shipped, 512, 0.5)
        assert shipped["gradient_clipping"] == 0.5 and shipped["train_micro_batch_size_per_gpu"] == 512
    no_clipping = {"gradient_clipping": "auto"}
    tr._fill_deepspeed_config(no_clipping, 8, 0.0)
    assert no_clipping["gradient_clipping"] == 0.0  # DeepSpeed's "no clipping"
    tr._fill_deepspeed_config({"gradient_clipping": 1}, 8, 1.0)
    with pytest.raises(ValueError, match=r"gradient_clipping=1.0, the recipe at training.max_grad_norm=0.5: set "
                                         r"\"gradient_clipping\": \"auto\""):
        tr._fill_deepspeed_config({"gradient_clipping": 1.0}, 8, 0.5)


def test_heads_that_never_guess_right_get_the_empty_tree(tmp_path):
    """No held-out path accepted (untrained heads on hard data): the fitted tree is plain decoding,
    not an error after training (the final save raised)."""
    from medusa_infer.config import MedusaConfig
    from medusa_train.evaluate import HeadAccuracy, finalize, fit_tree, summary_table

    accuracy = HeadAccuracy(torch.zeros(3, 10, dtype=torch.long), torch.full((3,), 40), torch.full((40, 3), -1))
    assert fit_tree(accuracy, 16) == []
    assert "expected tokens per step 1.000" in summary_table(accuracy, [])
    folder = finalize(tmp_path / "heads", MedusaConfig(num_heads=3, hidden_size=8, vocab_size=16), {}, accuracy, 16)
    saved = MedusaConfig.load(folder / "config.json")  # the final save of training's evaluate stage
    assert saved.tree == [] and saved.acceptance["expected_tokens_per_step_fitted_tree"] == 1.0


def test_a_fitted_tree_larger_than_the_stored_paths_keeps_its_size(tmp_path):
    """eval.tree_size above the 128 paths usually kept: that many paths are kept, and the tree has
    that many nodes (it was cut to 128 silently)."""
    from medusa_infer.config import MedusaConfig
    from medusa_train.evaluate import MAX_STORED_PATHS, HeadAccuracy, finalize

    g = torch.Generator().manual_seed(0)
    ranks = torch.randint(0, 10, (6000, 3), generator=g)
    ranks[:3000, 0] = 0
    accuracy = HeadAccuracy(torch.zeros(3, 10, dtype=torch.long), torch.full((3,), 6000), ranks)
    assert len(accuracy.paths(None)) > 300
    for size in (64, MAX_STORED_PATHS, 200):
        folder = finalize(tmp_path / str(size), MedusaConfig(num_heads=3, hidden_size=8, vocab_size=16), {},
                          accuracy, size)
        saved = MedusaConfig.load(folder / "config.json")
        assert len(saved.tree) == size
        assert len(saved.path_accuracies) == max(size, MAX_STORED_PATHS)


@pytest.mark.parametrize("mode", ["medusa1", "medusa2"])
def test_gradient_accumulation_equals_the_larger_batch(tiny_dir, tmp_path, mode):
    """Two micro-batches accumulated train the heads as one batch of both: each micro-batch's loss is
    divided by the step's counts, not its own (a mean of means would weigh a micro-batch with fewer
    targets more). Medusa-1 from the feature cache (soft labels), Medusa-2 with LoRA (hard labels)."""
    import train_heads

    if mode == "medusa1":
        whole, halves = {"batch_tokens": 128}, {"batch_tokens": 64, "grad_accum": 2}
        extra = {"loss": "kl"}
    else:
        whole, halves = {"batch_size": 4}, {"batch_size": 2, "grad_accum": 2}
        extra = {"mode": "medusa2", "loss": "ce", "stage1_steps": 1, "heads_warmup_steps": 0}
    heads, losses = {}, {}
    for name, batch in (("whole", whole), ("halves", halves)):
        out = tmp_path / name
        lora = {"lora": {"r": 4, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}} if mode == "medusa2" else {}
        values = recipe(tiny_dir, out, training={"max_steps": 3, "seed": 2, "lr": 0.05, **extra, **batch}, **lora)
        assert train_heads.main(["--config", str(write_recipe(tmp_path / f"{name}.yaml", values))]) == 0
        heads[name] = final_heads(out)
        losses[name] = [(r["loss"], r.get("base_kl")) for r in train_log(out)]
    # every step's loss (and Medusa-2's base KL): the same batches, the same means
    assert len(losses["whole"]) == 3
    for (loss, kl), (half_loss, half_kl) in zip(losses["whole"], losses["halves"]):
        assert half_loss == pytest.approx(loss, rel=1e-5) and (kl is None or half_kl == pytest.approx(kl, rel=1e-5))
    # the weights too: Medusa-1's the same rows to the bit; Medusa-2's padding makes its forwards differ in the
    # last bits, which Adam's normalised steps magnify (its adapter's init differed by 0.3 when loading the
    # model measured the CPU kernels with the global generator, seeded before it)
    tolerance = dict(atol=2e-6, rtol=1e-5) if mode == "medusa1" else dict(atol=1e-4, rtol=1e-4)
    for key in heads["whole"]:
        torch.testing.assert_close(heads["halves"][key], heads["whole"][key], **tolerance)


def test_a_checkpoint_whose_state_file_was_cut_short_is_not_resumed(tmp_path, monkeypatch):
    """Killed or out of disk while writing trainer_state.json into step-N.partial: that folder was taken as
    the newest complete checkpoint, and every later run failed to read it ("Expecting value")."""
    import types

    def save_state(folder):
        (Path(folder) / "model.safetensors").write_bytes(b"x")

    accelerator = types.SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None, save_state=save_state)
    folder = tmp_path / "checkpoints"
    tr._save_checkpoint(accelerator, folder, {"step": 2, "note": "x" * 100}, keep=2)
    write_text = Path.write_text

    def disk_full(self, text, *args, **kwargs):
        write_text(self, text[:20], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError, match="No space left"):
        tr._save_checkpoint(accelerator, folder, {"step": 4, "note": "x" * 100}, keep=2)
    monkeypatch.undo()
    assert (folder / "step-00000004.partial").is_dir()
    assert tr.latest_checkpoint(folder).name == "step-00000002"
    assert json.loads((tr.latest_checkpoint(folder) / tr.STATE_NAME).read_text())["step"] == 2


def test_naming_the_models_hub_id_keeps_the_checkpoints(tiny_dir, tmp_path, capsys):
    """model.hub_id only names the base model in what is saved: setting it on a rerun refused to resume."""
    import train_heads

    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 6, "save_every": 2, "seed": 3})
    config_file = str(write_recipe(tmp_path / "r.yaml", values))
    killed_at_step(3, config_file, tmp_path)
    capsys.readouterr()
    assert train_heads.main(["--config", config_file, "model.hub_id=me/tiny"]) == 0
    assert "resuming from" in capsys.readouterr().out
    final = json.loads((tmp_path / "run" / "checkpoints" / "final" / "config.json").read_text())
    assert final["training"]["resumed_from_step"] == 2


def test_a_checkpoint_without_frozen_weights_loads_only_where_it_fits():
    """DeepSpeed step checkpoints leave the frozen weights out, so they cannot load strictly; a trainable
    weight missing or a tensor the module lacks still fails loudly."""
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    module[0].requires_grad_(False)
    saved = {k: torch.full_like(v, 7.0) for k, v in module.state_dict().items() if k.startswith("1.")}
    tr.load_trainable(saved, module)
    assert torch.equal(module[1].weight, torch.full((2, 3), 7.0)) and not torch.equal(module[0].weight,
                                                                                      torch.full((3, 3), 7.0))
    with pytest.raises(ValueError, match=r"trainable weights missing \['1.bias'\]"):
        tr.load_trainable({"1.weight": saved["1.weight"]}, module)
    with pytest.raises(ValueError, match=r"tensors it does not have \['2.weight'\]"):
        tr.load_trainable({**saved, "2.weight": torch.zeros(1)}, module)


@pytest.mark.parametrize("choice", [{"n": 8}, {"per_source": {"a": 3, "b": 5}}])
def test_a_finished_run_whose_own_rows_file_was_removed_is_not_refused_for_it(tmp_path, choice):
    """Rows distilled into a data.rows path record no distilling choice (a rows file there is read as
    given); with the file removed to save disk the rerun would distil, and was refused for the data.n,
    data.per_source and data.max_new_tokens nobody changed."""
    prompts, rows = tmp_path / "prompts.jsonl", tmp_path / "my_rows.jsonl"
    prompts.write_text(json.dumps({"id": "1", "prompt": "hi", "source": "a"}) + "\n")
    rows.write_text(json.dumps({"id": "1", "prompt": "hi", "response": "hello"}) + "\n")
    values = {"output_dir": str(tmp_path / "run"), "data": {"prompts": str(prompts), "rows": str(rows),
                                                             "max_new_tokens": 16, **choice}}
    config = config_from_dict(values)
    paths = run_paths(config)
    paths.final.mkdir(parents=True)
    (paths.final / "config.json").write_text(json.dumps({"training": {"settings": tr.finished_settings(config)}}))
    rows.unlink()
    tr.check_finished_run(config, paths)
    changed = config_from_dict(values, ["data.max_length=64"])
    with pytest.raises(ValueError, match="data.max_length was 1024, now 64"):
        tr.check_finished_run(changed, run_paths(changed))


def test_a_finished_run_refused_for_packing_or_the_feature_cache_says_what_was_set(tmp_path):
    """data.pack, recorded only when set, was said to have been None; the feature cache turned off was said as its
    own settings (features.dtype was 'float32', now None), which the user never set."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "1", "prompt": "hi", "response": "hello"}) + "\n")
    values = {"output_dir": str(tmp_path / "run"), "data": {"rows": str(rows)}, "features": {"enabled": True}}
    config = config_from_dict(values)
    paths = run_paths(config)
    paths.final.mkdir(parents=True)
    (paths.final / "config.json").write_text(json.dumps({"training": {"settings": tr.finished_settings(config)}}))
    tr.check_finished_run(config, paths)
    for override, said in (("data.pack=true", "data.pack was False, now True"),
                           ("features.enabled=false", "the feature cache (features.enabled, Medusa-1) was used, now "
                                                      "not; remove")):
        changed = config_from_dict(values, [override])
        with pytest.raises(ValueError, match=re.escape(said)):
            tr.check_finished_run(changed, run_paths(changed))


def test_a_killed_run_whose_starting_heads_are_gone_is_told_so(tiny_dir, tmp_path, counting_heads, capsys):
    """The early checkpoint check hashed heads.init_from's weights unchecked: FileNotFoundError traceback."""
    import train_heads

    start = tmp_path / "start"
    shutil.copytree(counting_heads, start)
    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 6, "save_every": 2, "seed": 3, "lr": 1e-4},
                    heads={"reduced_vocab_size": 30, "init_from": str(start)})
    config_file = str(write_recipe(tmp_path / "r.yaml", values))
    killed_at_step(3, config_file, tmp_path)
    shutil.rmtree(start)
    for flags in (["--plan"], []):
        with pytest.raises(SystemExit):
            train_heads.main(["--config", config_file, *flags])
        assert f"heads.init_from={start} has no config.json" in capsys.readouterr().err


def test_a_run_stopped_in_its_evaluation_keeps_the_seconds_of_the_stages_it_did(tiny_dir, tmp_path, monkeypatch):
    """stages.json was written at the very end: a run stopped in its evaluation left none, and the re-run
    recorded the seconds it took to find the trained heads as the training's (the card said 0.0 s)."""
    import train_heads

    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 2})
    config = str(write_recipe(tmp_path / "r.yaml", values))

    def stop(*args, **kwargs):
        raise RuntimeError("stopped")

    with monkeypatch.context() as patch:
        patch.setattr(train_heads, "stage_evaluate", stop)
        with pytest.raises(RuntimeError, match="stopped"):
            train_heads.main(["--config", config])
    stages = json.loads((tmp_path / "run" / "logs" / "stages.json").read_text())
    assert set(stages) == {"data", "features", "train"}
    (tmp_path / "run" / "logs" / "stages.json").write_text(json.dumps({**stages, "train": 123.4}))
    assert train_heads.main(["--config", config]) == 0
    recorded = json.loads((tmp_path / "run" / "heads" / "config.json").read_text())["training"]["stage_seconds"]
    assert recorded["train"] == 123.4 and recorded["features"] == stages["features"]
    # evaluated again without features: the held-out split's extraction is not the stage's seconds
    record = json.loads((tmp_path / "run" / "logs" / "stages.json").read_text())
    (tmp_path / "run" / "logs" / "stages.json").write_text(json.dumps({**record, "features": 222.0}))
    shutil.rmtree(tmp_path / "run" / "heads")
    shutil.rmtree(tmp_path / "run" / "features")
    assert train_heads.main(["--config", config]) == 0
    assert json.loads((tmp_path / "run" / "logs" / "stages.json").read_text())["features"] == 222.0
    # a stages.json emptied by a run killed while writing it is no record (the re-run failed on it)
    (tmp_path / "run" / "logs" / "stages.json").write_text("")
    shutil.rmtree(tmp_path / "run" / "heads")
    assert train_heads.main(["--config", config]) == 0


def test_heldout_only_ignores_a_recipes_upload_and_refuses_the_flags(tiny_dir, tmp_path, monkeypatch, capsys):
    """--heldout-only uploads nothing: a recipe's eval.push_to_hub was checked offline and refused it."""
    import huggingface_hub
    import train_heads

    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 2})
    config = str(write_recipe(tmp_path / "r.yaml", values))
    assert train_heads.main(["--config", config]) == 0
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert train_heads.main(["--config", config, "--heldout-only", "eval.push_to_hub=me/heads"]) == 0
    with pytest.raises(SystemExit):
        train_heads.main(["--config", config, "--heldout-only", "--push-to-hub", "me/heads"])
    assert "--heldout-only prints the held-out table and uploads nothing" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a run that would upload is still refused before any work
        train_heads.main(["--config", config, "--push-to-hub", "me/heads"])
    assert "push_folder_to_hub('" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the advised upload keeps it private (it left private=True out)
        train_heads.main(["--config", config, "--push-to-hub", "me/heads", "--private"])
    assert "'me/heads', private=True))" in capsys.readouterr().err


def test_features_a_run_reuses_keep_their_recorded_seconds_whatever_the_plan_said(tiny_dir, tmp_path):
    """An index an earlier release wrote (no settings record) made the plan say features to do; the run
    reused the caches in 0.0 s and recorded that as the stage's seconds, the card showing it."""
    import train_heads

    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 2})
    config = str(write_recipe(tmp_path / "r.yaml", values))
    assert train_heads.main(["--config", config]) == 0
    out = tmp_path / "run"
    index = json.loads((out / "features" / "index.json").read_text())
    (out / "features" / "index.json").write_text(json.dumps({k: v for k, v in index.items() if k != "settings"}))
    stages = json.loads((out / "logs" / "stages.json").read_text())
    (out / "logs" / "stages.json").write_text(json.dumps({**stages, "features": 120.0}))
    shutil.rmtree(out / "heads")
    assert train_heads.main(["--config", config]) == 0
    assert json.loads((out / "logs" / "stages.json").read_text())["features"] == 120.0
    assert json.loads((out / "heads" / "config.json").read_text())["training"]["stage_seconds"]["features"] == 120.0


def test_settings_a_run_does_not_read_neither_refuse_its_rerun_nor_its_resume(tmp_path):
    """A finished run re-run, or a step checkpoint resumed, with a changed setting that run never reads was
    refused and told to train again: `training.batch_size` under the feature cache, `training.batch_tokens`
    without it (Medusa-2), `training.epochs` beside `max_steps`, and on tokenized data the distilling settings
    (on a resume) and `features.from_distillation`. Settings it reads still are refused."""
    model = tmp_path / "model"
    model.mkdir()  # a folder name: no model is loaded to compare settings
    examples = tmp_path / "examples.jsonl"
    examples.write_text("")

    def config(mode: str, *overrides: str):
        sections = {"training": {"mode": mode, "max_steps": 5, **({"loss": "kl"} if mode == "medusa2" else {})}}
        if mode == "medusa2":
            sections["lora"] = {"target_modules": ["q_proj"]}
        values = recipe(tmp_path, tmp_path / "run", **sections)
        values["model"]["name"] = str(model)
        values["data"]["tokenized"] = str(examples)
        return config_from_dict(values, list(overrides))

    def refusals(mode: str, *overrides: str) -> tuple[str, str]:
        """What a re-run of a finished run, and a resume of a step checkpoint, with ``overrides`` say."""
        before, after = config(mode), config(mode, *overrides)
        paths = run_paths(after)
        final = paths.final / "config.json"
        final.parent.mkdir(parents=True, exist_ok=True)
        final.write_text(json.dumps({"training": {"settings": tr.finished_settings(before, "sha256:w")}}))
        said = []
        try:
            tr.check_finished_run(after, paths)
            said.append("")
        except ValueError as err:
            said.append(str(err))
        shutil.rmtree(paths.final)
        state = {"fingerprint": tr.resume_fingerprint(before, "sha256:w"), "world_size": 1,
                 "grad_accum": before.training.grad_accum}
        expected, found = tr._resume_settings(after, json.loads(json.dumps(state)), 1)
        try:
            tr._refuse_other_run(paths.checkpoints / "step-1", expected, found, paths)
            said.append("")
        except ValueError as err:
            said.append(str(err))
        return said[0], said[1]

    for mode, overrides in (
        ("medusa1", ["training.batch_size=8"]), ("medusa1", ["training.epochs=3"]),
        ("medusa1", ["features.from_distillation=false"]),
        ("medusa1", ["data.n=7", "data.max_new_tokens=5", "data.prompts=p.jsonl", "data.system_prompt=Be brief."]),
        ("medusa2", ["training.batch_tokens=64"]), ("medusa2", ["training.epochs=3"]),
    ):
        assert refusals(mode, *overrides) == ("", ""), (mode, overrides)
    rerun, resume = refusals("medusa1", "training.batch_tokens=64", "training.lr=0.5")
    assert "training.batch_tokens was 128, now 64" in rerun and "training.lr was 0.01, now 0.5" in rerun
    assert "training.batch_tokens was 128, now 64" in resume
    rerun, resume = refusals("medusa2", "training.batch_size=8")
    assert "training.batch_size was 4, now 8" in rerun and "training.batch_size was 4, now 8" in resume
    rerun, resume = refusals("medusa1", "training.max_steps=null", "training.epochs=3")
    assert "training.epochs was 2.0, now 3.0" in rerun and "training.max_steps was 5, now None" in resume
    # rows given (the run distils none) with the hidden states kept while distilling them: features come
    # from those states or the backbone as features.from_distillation says, so a change of it is refused
    from medusa_train.captured import hidden_dir

    rows = tmp_path / "rows.jsonl"
    rows.write_text("")
    before = config("medusa1", f"data.rows={rows}", "data.tokenized=null")
    after = config("medusa1", f"data.rows={rows}", "data.tokenized=null", "features.from_distillation=false")
    assert "features.from_distillation" in tr.unread_settings(after)  # no states kept: unread
    hidden_dir(rows).mkdir()
    (hidden_dir(rows) / "batch-00000.safetensors").write_bytes(b"")
    assert "features.from_distillation" not in tr.unread_settings(after)
    for other in ("model.dtype=bfloat16", "data.distill_options.backend=openai"):  # states the features never take
        assert "features.from_distillation" in tr.unread_settings(config(
            "medusa1", f"data.rows={rows}", "data.tokenized=null", "features.from_distillation=false", other)), other
    wanted = tr._without(tr.finished_settings(after, "w"), tr.unread_settings(after))
    found = tr._without(tr.finished_settings(before, "w"), tr.unread_settings(after))
    assert {k for k in wanted if wanted[k] != found.get(k)} == {"features.from_distillation"}


def test_a_checkpoint_side_folder_is_never_resumed_from(tmp_path):
    """A run killed between a checkpoint's state file and its folder's rename left `step-N.partial` holding
    everything: it sorted after `step-N` and was resumed from, then never renamed nor removed. The complete
    checkpoint before it is resumed, and the side folder is written over when that step is saved again."""
    folder = tmp_path / "checkpoints"
    for name in ("step-00000002", "step-00000004.partial"):
        (folder / name).mkdir(parents=True)
        (folder / name / tr.STATE_NAME).write_text("{}")
    assert tr.latest_checkpoint(folder) == folder / "step-00000002"
    assert tr._complete_checkpoints(folder) == [folder / "step-00000002"]


def test_the_plan_of_a_finished_run_resumes_no_checkpoint(tiny_dir, tmp_path):
    """A finished run keeps its step checkpoints: its plan said the done training stage was "resuming" one."""
    from medusa_train.train_config import plan

    config = config_from_dict(recipe(tiny_dir, tmp_path / "run", training={"max_steps": 2}))
    step = run_paths(config).checkpoints / "step-00000002"
    step.mkdir(parents=True)
    (step / tr.STATE_NAME).write_text("{}")
    train = next(s for s in plan(config).stages if s.name == "train")
    assert not train.done and "resuming step-00000002" in train.detail
    (run_paths(config).final).mkdir(parents=True)
    (run_paths(config).final / "config.json").write_text("{}")
    train = next(s for s in plan(config).stages if s.name == "train")
    assert train.done and "resuming" not in train.detail


def test_weights_identity_tells_weights_changed_past_the_first_mib_apart(tmp_path):
    """A weight file is sampled (first, middle and last MiB): new weights in its middle or at its end are new
    weights."""
    from safetensors.torch import save_file

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    weights = torch.zeros(1 << 20)  # 4 MiB of float32
    save_file({"w": weights}, str(folder / "model.safetensors"))
    first = weights_identity(str(folder))
    weights[-1] = 1.0  # the last MiB
    save_file({"w": weights}, str(folder / "model.safetensors"))
    second = weights_identity(str(folder))
    weights[len(weights) // 2] = 1.0  # the middle MiB
    save_file({"w": weights}, str(folder / "model.safetensors"))
    third = weights_identity(str(folder))
    assert None not in (first, second, third) and len({first, second, third}) == 3


def test_a_head_with_no_heldout_target_scores_zero_not_nan(tmp_path):
    """Held-out answers of two labelled tokens give head 0 targets and head 1 none: its accuracies are 0.0, not
    NaN (which json writes as NaN into the heads' config.json, which strict JSON readers refuse)."""
    from medusa_train.evaluate import HeadAccuracy

    accuracy = HeadAccuracy(torch.tensor([[3, 4], [0, 0]]), torch.tensor([4, 0]), torch.full((4, 2), -1))
    topk = accuracy.topk()
    assert topk == [[0.75, 1.0], [0.0, 0.0]]
    assert not any(math.isnan(x) for row in topk for x in row)
    json.loads(json.dumps(topk), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))


def _accuracy():
    from medusa_train.evaluate import HeadAccuracy

    # 2 heads, ranks over 0..2: up to 3 + 9 paths accepted somewhere
    g = torch.Generator().manual_seed(0)
    ranks = torch.randint(-1, 3, (200, 2), generator=g)
    ranks[:, 1] = torch.where(ranks[:, 0] < 0, -1, ranks[:, 1])
    return HeadAccuracy(torch.zeros(2, 3, dtype=torch.long), torch.tensor([200, 200]), ranks)


def test_finalize_keeps_more_paths_than_the_fitted_trees_nodes(tmp_path):
    """The heads' config keeps max(MAX_STORED_PATHS, tree_size) paths: a later fitted-N tree larger than
    training's (and calibration) reads them."""
    from medusa_infer.config import MedusaConfig
    from medusa_train.evaluate import finalize

    accuracy = _accuracy()
    folder = finalize(tmp_path / "heads", MedusaConfig(num_heads=2, hidden_size=8, vocab_size=16), {}, accuracy, 2)
    saved = MedusaConfig.load(folder / "config.json")
    assert len(saved.tree) == 2
    assert len(saved.path_accuracies) == len(accuracy.paths()) > 2


def test_a_tree_asked_larger_than_the_paths_ever_accepted_is_all_of_them():
    from medusa_train.evaluate import fit_tree, stored_paths

    accuracy = _accuracy()
    assert sorted(fit_tree(accuracy, 500)) == sorted(stored_paths(accuracy, 500))


def test_finalize_and_summary_report_the_walked_tokens_per_step(tmp_path):
    """What training stores (acceptance.expected_tokens_per_step_fitted_tree) and prints is greedy decoding
    walked over the held-out answers, not the average over every position (which runs high)."""
    from medusa_infer.config import MedusaConfig
    from medusa_train.evaluate import (HeadAccuracy, expected_tokens_per_step, finalize, fit_tree, stored_paths,
                                       summary_table, walked_tokens_per_step)

    easy, hard = [0, 0], [-1, -1]
    ranks = torch.tensor([easy] * 3 + [hard] * 3 + [easy] * 2)
    starts = torch.tensor([True] + [False] * 5 + [True, False])
    accuracy = HeadAccuracy(torch.tensor([[5], [5]]), torch.tensor([8, 8]), ranks, starts)
    tree = fit_tree(accuracy, 2)
    assert tree == [(0,), (0, 0)]
    walked = walked_tokens_per_step(tree, accuracy)
    assert walked == pytest.approx(8 / 5)
    assert expected_tokens_per_step(tree, stored_paths(accuracy, 2)) != pytest.approx(walked)  # 2.25: not it
    assert "expected tokens per step 1.600" in summary_table(accuracy, tree)
    folder = finalize(tmp_path / "heads", MedusaConfig(num_heads=2, hidden_size=8, vocab_size=16), {}, accuracy, 2)
    saved = MedusaConfig.load(folder / "config.json")
    assert saved.acceptance["expected_tokens_per_step_fitted_tree"] == 1.6
    # without starts (batches that did not say where answers begin): the average over positions
    plain = HeadAccuracy(accuracy.hits, accuracy.totals, ranks)
    assert "expected tokens per step 2.250" in summary_table(plain, tree)


def test_a_cache_of_other_soft_label_candidates_is_not_reused(tmp_path):
    """features.topk is part of the cache key: a run asking 3 candidates (or any, after a topk=0 cache) must not
    read the cache another topk built (it trained on 2 candidates, or failed for want of soft labels)."""
    model = MedusaModel.from_base(tiny_model("llama"), num_heads=1)
    examples = counting_examples(4, seed=1)
    folders = [build_feature_cache(model, examples, tmp_path, {"name": "t"}, topk=k, progress=False) for k in (0, 2, 3)]
    assert len(set(folders)) == 3
    for k, folder in zip((2, 3), folders[1:]):
        assert FeatureCache.load(folder).block["soft_ids"].shape[1] == k


def test_a_second_turn_starts_its_own_run_of_positions():
    """Decoding walks each assistant turn on its own: the second turn's first row starts a run (run_start), so
    the walked tokens per step never carry a step from one turn's end into the next turn."""
    from medusa_train.evaluate import head_accuracy, walked_tokens_per_step

    # two assistant turns: rows at 3, 4 (answer 10 11 12) and at 9, 10, 11 (answer 20 21 22 23)
    labels = [IGNORE] * 4 + [10, 11, 12] + [IGNORE] * 3 + [20, 21, 22, 23] + [IGNORE]
    example = {"input_ids": [5 if x == IGNORE else x for x in labels], "labels": labels}
    batch = pad_batch([example, example])
    block = block_from_hidden(torch.randn(2, len(labels), 4), batch["input_ids"], batch["labels"], batch["lengths"])
    data = FeatureDataset(block, 2, None, 30)
    assert data.run_start.tolist() == [True, False, True, False, False] * 2
    rows = data.batch(torch.arange(5))  # the first example
    right = torch.tensor([True, True, False, True, True])  # both heads wrong at the second turn's first row

    def heads(hidden, next_tokens, **_):
        guess = torch.where(right.unsqueeze(1), rows["targets"], torch.zeros_like(rows["targets"]))
        return torch.nn.functional.one_hot(guess.clamp(min=0).t(), 30).float()

    accuracy = head_accuracy(heads, [rows], top_k=1)
    # turn 1: one step (2 tokens: the step ends at the answer's end); turn 2: a step of 1, then one of 2
    assert walked_tokens_per_step([(0,), (0, 0)], accuracy) == pytest.approx(5 / 3)


def test_medusa2_heads_weight_rises_to_its_value_on_each_schedule(tiny_dir, tmp_path):
    """heads_loss_weight: 1 in the heads-only stage, then rising over heads_warmup_steps to
    training.heads_loss_weight, where it stays: linearly, or along a quarter sine (never back down)."""
    for schedule, rise in (("linear", lambda f: f), ("sine", lambda f: math.sin(0.5 * math.pi * f))):
        config = config_from_dict(recipe(tiny_dir, tmp_path / schedule, training={
            "mode": "medusa2", "max_steps": 20, "stage1_steps": 2, "heads_warmup_steps": 4, "heads_loss_weight": 0.5,
            "heads_weight_schedule": schedule, "loss": "ce"}, lora={"r": 4, "target_modules": ["q_proj"]}))
        weights = [tr.heads_loss_weight(config, step) for step in range(10)]
        expected = [1.0, 1.0] + [0.5 * rise(min(1.0, (j + 1) / 4)) for j in range(8)]
        assert weights == pytest.approx(expected), schedule
        assert weights[5:] == pytest.approx([0.5] * 5)


def _medusa2_config(tiny_dir, tmp_path, **training):
    return config_from_dict(recipe(tiny_dir, tmp_path / "run", training={
        "mode": "medusa2", "max_steps": 4, "loss": "ce", **training}, lora={"r": 4, "target_modules": ["q_proj"]}))


def test_medusa2_base_kl_averages_over_every_position_the_base_model_predicts(tiny_dir, tmp_path):
    """Medusa2Task.counts: the base KL's count is every position predicting an answer token (the soft-label
    positions: 7 here), not the heads' rows (5: two fewer per turn's end), which scaled the KL up."""
    from types import SimpleNamespace

    labels = [IGNORE] * 4 + [10, 11, 12] + [IGNORE] * 3 + [20, 21, 22, 23] + [IGNORE]
    example = {"input_ids": [5 if x == IGNORE else x for x in labels], "labels": labels}
    stub = SimpleNamespace(medusa=SimpleNamespace(config=SimpleNamespace(vocab_size=30)))
    task = tr.Medusa2Task(_medusa2_config(tiny_dir, tmp_path), stub, [example], None)
    counts = task.counts(task.prepare(torch.tensor([0]), torch.device("cpu")))
    assert counts["base"].tolist() == [7]
    assert counts["heads"].tolist() == [5, 3, 1]  # head k: the labelled tokens less k + 1 per turn


def test_medusa2_loss_weighs_the_base_kl_by_kl_weight(tiny_dir, tmp_path):
    """The joint loss is kl_weight * KL(original || adapted) + the heads' weight * the heads' loss."""
    from types import SimpleNamespace

    from medusa_train.losses import head_ce_loss, logits_kl

    config = _medusa2_config(tiny_dir, tmp_path, kl_weight=0.25, heads_loss_weight=0.5)
    g = torch.Generator().manual_seed(0)
    out = {"head_logits": torch.randn(3, 4, 30, generator=g), "targets": torch.randint(30, (4, 3), generator=g),
           "student_logits": torch.randn(5, 30, generator=g), "teacher_logits": torch.randn(5, 30, generator=g)}
    stub = SimpleNamespace(medusa=SimpleNamespace(config=SimpleNamespace(vocab_size=30)))
    task = tr.Medusa2Task(config, stub, [], None)
    denominators = {"heads": torch.full((3,), 4.0), "base": torch.tensor([5.0])}
    loss, metrics = task.loss(lambda batch, joint, num_heads: out, {}, 1, denominators)
    heads = head_ce_loss(out["head_logits"], out["targets"], config.training.head_decay, denominators["heads"]).loss
    kl = logits_kl(out["student_logits"], out["teacher_logits"], denominator=denominators["base"][0])
    assert float(kl) > 0 and float(metrics["heads_weight"]) == 0.5
    assert float(loss) == pytest.approx(float(0.25 * kl + 0.5 * heads), rel=1e-6)


def test_medusa2_soft_labels_are_the_original_models_in_the_joint_stage():
    """With loss: kl the heads learn the original model's distributions (the adapter disabled), not the adapted
    backbone's they are trained on: JointModule's soft labels come from the teacher's hidden states."""
    from medusa_train.features import rows_from_block, soft_labels
    from medusa_train.lora import add_lora

    torch.manual_seed(0)
    peft_model = add_lora(tiny_model("llama"), r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():  # an adapter that has trained: the adapted model differs from the original
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    medusa = MedusaModel.from_base(peft_model.get_base_model(), num_heads=2)
    joint = tr.JointModule(medusa, peft_model, topk=3)
    batch = pad_batch(counting_examples(2, seed=4))
    with torch.no_grad():
        out = joint(batch, True, 2)
        expected = {}
        for name, adapter in (("teacher", False), ("student", True)):
            with (peft_model.disable_adapter() if not adapter else torch.enable_grad()):
                hidden = tr.batch_hidden(medusa, batch)
            block = block_from_hidden(hidden, batch["input_ids"], batch["labels"], batch["lengths"], medusa.project, 3)
            expected[name] = soft_labels(block, rows_from_block(block, 2).soft_row, None, 0)
    assert not torch.allclose(expected["teacher"][1], expected["student"][1], atol=1e-3)
    assert torch.equal(out["soft_ids"], expected["teacher"][0])
    torch.testing.assert_close(out["soft_probs"], expected["teacher"][1], atol=1e-5, rtol=1e-5)



def test_medusa1_ce_denominator_counts_the_targets_the_loss_sums(tiny_dir, tmp_path):
    """With a reduced vocabulary a target outside it (OUT_OF_VOCAB, -1) adds no cross-entropy: the step's
    denominator must leave it out too (counting it shrank each head's loss by its share of such targets)."""
    from medusa_train.losses import OUT_OF_VOCAB, head_ce_loss

    config = config_from_dict(recipe(tiny_dir, tmp_path / "run", training={"loss": "ce"}))
    targets = torch.tensor([[3, OUT_OF_VOCAB, 5], [IGNORE, 4, OUT_OF_VOCAB], [OUT_OF_VOCAB, 2, IGNORE]])
    counts = tr._target_counts(config, targets, None, None)
    assert counts.tolist() == [1, 2, 1]
    assert counts.tolist() == head_ce_loss(torch.randn(3, 3, 8), targets).counts.tolist()


def test_a_resume_compares_the_soft_label_candidates_the_run_reads(tiny_dir, tmp_path):
    """features.topk is read with loss: kl only: a loss: ce run's checkpoint resumes under another features.topk
    (resume_fingerprint records soft_label_topk, as finished_settings does), a kl run's does not."""
    fingerprints = {}
    for loss in ("ce", "kl"):
        for topk in (5, 20):
            config = config_from_dict(recipe(tiny_dir, tmp_path / "run", training={"loss": loss},
                                             features={"topk": topk}))
            fingerprints[loss, topk] = tr.resume_fingerprint(config, None)
    assert fingerprints["ce", 5] == fingerprints["ce", 20]
    assert fingerprints["kl", 5] != fingerprints["kl", 20]


def test_heldout_only_leaves_the_runs_feature_index_as_the_run_wrote_it(tiny_dir, tmp_path, capsys):
    """--heldout-only reads a finished run and writes nothing: the feature index (which --plan reads for
    the training split's positions and the features stage's state) keeps its training split's entry."""
    import train_heads

    values = recipe(tiny_dir, tmp_path / "run", training={"max_steps": 2})
    config = str(write_recipe(tmp_path / "r.yaml", values))
    assert train_heads.main(["--config", config]) == 0
    index = tmp_path / "run" / "features" / "index.json"
    written = index.read_text()
    capsys.readouterr()
    assert train_heads.main(["--config", config, "--plan"]) == 0
    planned = capsys.readouterr().out
    assert train_heads.main(["--config", config, "--heldout-only"]) == 0
    assert index.read_text() == written
    assert "train" in json.loads(written)
    capsys.readouterr()
    assert train_heads.main(["--config", config, "--plan"]) == 0
    assert capsys.readouterr().out == planned


def test_ready_examples_record_no_sources_of_rows_the_run_did_not_read(tmp_path):
    """With data.tokenized the run trains on those examples alone: rows left in the output folder by an earlier
    run (or named in data.rows beside it) are not read, and their sources are not the training data's (the
    training record and the model card would list them)."""
    import train_heads
    from medusa_train.train_config import config_from_dict, rows_path

    ready = tmp_path / "ready.jsonl"
    ready.write_text(json.dumps({"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}) + "\n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "a", "response": "b", "source": s}) + "\n" for s in "xxy"))
    given = config_from_dict({"model": {"name": "m"}, "data": {"rows": str(rows)}})
    assert train_heads.data_sources(given) == {"x": 2, "y": 1}  # (rows the run reads are counted)
    both = config_from_dict({"model": {"name": "m"}, "data": {"rows": str(rows), "tokenized": str(ready)}})
    assert train_heads.data_sources(both) is None
    left = config_from_dict({"model": {"name": "m"}, "output_dir": str(tmp_path / "run"),
                             "data": {"tokenized": str(ready)}})
    rows_path(left).parent.mkdir(parents=True)
    rows_path(left).write_text(rows.read_text())  # an earlier run's distilled rows
    assert train_heads.data_sources(left) is None


def test_an_example_one_token_past_the_context_is_refused(tmp_path):
    """The context bound is exact: an example of context + 1 tokens (data.max_length one past it) has a position
    the model never learned (GPT-2's 256: an IndexError in the feature extraction), and is refused by name."""
    import pytest
    import train_heads
    from medusa_train.train_config import config_from_dict
    from tiny import tiny_model

    tiny_model("gpt2").save_pretrained(tmp_path / "model")  # 256 positions
    ready = tmp_path / "examples.jsonl"
    ready.write_text(json.dumps({"input_ids": [3] * 257, "labels": [-100] + [3] * 256}) + "\n")
    config = config_from_dict({"model": {"name": str(tmp_path / "model")},
                               "data": {"tokenized": str(ready), "max_length": 257}})

    def examples(length):
        return [{"input_ids": [3] * length, "labels": [-100] + [3] * (length - 1)}]

    train_heads.check_examples_fit(config, examples(256))  # as many tokens as positions: fits
    with pytest.raises(ValueError, match="examples of up to 257 tokens are past the model's context of 256"):
        train_heads.check_examples_fit(config, examples(257))


def test_an_mpi_launch_is_planned_for_its_processes_and_printed_once(tiny_dir, tmp_path, capsys, monkeypatch):
    """mpirun sets OMPI_COMM_WORLD_SIZE and _RANK, not WORLD_SIZE (accelerate's state sets that later, from them):
    the plan said 1 process for 2, its batch and steps per epoch a 1-process run's, and --plan printed it on every
    process."""
    import train_heads

    config_file = str(write_recipe(tmp_path / "r.yaml", recipe(tiny_dir, tmp_path / "run", training={"max_steps": 2})))
    for name in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "RANK", "PMI_RANK",
                 "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    assert train_heads.main(["--config", config_file, "--plan"]) == 0
    assert "on 2 process(es)" in capsys.readouterr().out
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    assert train_heads.main(["--config", config_file, "--plan"]) == 0
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("WORLD_SIZE", "3")  # torchrun's first, as accelerate reads them
    monkeypatch.setenv("RANK", "0")
    assert train_heads.main(["--config", config_file, "--plan"]) == 0
    assert "on 3 process(es)" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "-1")  # below 0: skipped, as accelerate skips it
    assert train_heads.main(["--config", config_file, "--plan"]) == 0
    assert "on 2 process(es)" in capsys.readouterr().out
    monkeypatch.setenv("PMI_SIZE", "two")
    with pytest.raises(SystemExit):
        train_heads.main(["--config", config_file, "--plan"])
    assert "PMI_SIZE='two' is not a whole number" in capsys.readouterr().err
    # with a GPU accelerate reads no MPI variable (one left by an outer job): a single run, not one of 2
    monkeypatch.delenv("PMI_SIZE")
    monkeypatch.setattr(train_heads.torch.cuda, "is_available", lambda: True)
    assert train_heads.main(["--config", config_file, "--plan"]) == 0
    said = capsys.readouterr()
    assert "on 1 process(es)" in said.out
    # ... and says that under mpirun each process would train alone (before, it trained 2 copies in silence)
    assert "warning: OMPI_COMM_WORLD_SIZE=2 says an MPI launch of 2 processes" in said.err
    assert "accelerate launch" in said.err
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's: counted, nothing to say
    assert train_heads.main(["--config", config_file, "--plan"]) == 0
    said = capsys.readouterr()
    assert "on 2 process(es)" in said.out and "warning" not in said.err
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setattr(train_heads.torch.cuda, "is_available", lambda: False)  # on the CPU: counted, no warning
    assert train_heads.main(["--config", config_file, "--plan"]) == 0
    said = capsys.readouterr()
    assert "on 2 process(es)" in said.out and "warning" not in said.err


def test_what_each_epoch_leaves_out_is_said(tiny_dir, tmp_path, capsys):
    """An epoch's incomplete last micro-batch, and the last epoch's micro-batches that fill no optimizer step,
    were left out of training with nothing said (0.4% of the default recipe's positions)."""
    import train_heads
    from medusa_train.train_config import left_out, step_counts

    config = config_from_dict(recipe(tiny_dir, tmp_path / "run", training={"batch_tokens": 100, "epochs": 3,
                                                                            "grad_accum": 2}))
    assert step_counts(config, 1050, 1)[:3] == (10, 5, 15)  # 30 micro-batches
    assert left_out(config, 1050, 1) == ("each epoch leaves out 50 of its 1050 positions (4.8%; they do not fill "
                                         "a micro-batch of 100 x 1 process(es)), a different random set each epoch")
    assert left_out(config, 1000, 1) is None
    assert left_out(config, 900, 2).startswith("each epoch leaves out 100 of its 900 positions")  # 4 x 200 read
    odd = config_from_dict(recipe(tiny_dir, tmp_path / "run", training={"batch_tokens": 100, "epochs": 3,
                                                                         "grad_accum": 4}))
    assert step_counts(odd, 1000, 1)[2] == 7  # 30 micro-batches, 28 of them in steps
    assert left_out(odd, 1000, 1) == ("the last epoch's last 2 micro-batch(es) fill no step of "
                                      "training.grad_accum=4 and are left out")
    assert left_out(config_from_dict(recipe(tiny_dir, tmp_path / "run", training={
        "batch_tokens": 100, "max_steps": 7, "grad_accum": 4})), 1000, 1) is None  # the steps asked for

    assert train_heads.main(["--config", str(write_recipe(tmp_path / "r.yaml", recipe(
        tiny_dir, tmp_path / "run", training={"batch_tokens": 128, "epochs": 1}, eval={"tree_size": 4})))]) == 0
    assert re.search(r"train: each epoch leaves out \d+ of its \d+ positions", capsys.readouterr().out)


def test_medusa2_base_kl_trains_the_adapter():
    """The KL term that keeps the adapted model near the original reaches the LoRA weights: its gradient alone is
    non-zero on them once the adapter differs from the original (a student detached before the projection kept
    the loss's value and trained nothing: no test saw it)."""
    from medusa_train.features import pad_batch
    from medusa_train.lora import add_lora

    torch.manual_seed(0)
    peft_model = add_lora(tiny_model("llama"), r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    medusa = MedusaModel.from_base(peft_model.get_base_model(), num_heads=2)
    out = tr.JointModule(medusa, peft_model, topk=0)(pad_batch(counting_examples(2, seed=4)), True, 2)
    kl = logits_kl(out["student_logits"], out["teacher_logits"])
    assert float(kl.detach()) > 0
    kl.backward()
    grads = [p.grad for name, p in peft_model.named_parameters() if "lora_" in name]
    assert grads and all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0


def test_the_feature_cache_key_follows_the_labels_not_only_the_tokens():
    """Examples that differ only in which tokens are labelled (ready examples relabelled) are other features: the
    cache keeps the labels the heads' targets and rows come from, and a checkpoint's resume is checked by it."""
    from medusa_train.features import cache_key, examples_hash

    ids = [1, 2, 3, 4, 5, 6]
    a = [{"input_ids": ids, "labels": [IGNORE, IGNORE, 3, 4, 5, 6]}]
    b = [{"input_ids": ids, "labels": [IGNORE, 2, 3, 4, 5, 6]}]
    assert examples_hash(a) != examples_hash(b)
    model = {"name": "m", "dtype": "float32", "attn_implementation": None}
    assert cache_key(model, examples_hash(a), 20, "float32") != cache_key(model, examples_hash(b), 20, "float32")


def test_base_id_0_is_mapped_to_its_head_column_like_any_other_id():
    """Token 0 is a real id (SmolLM2's <|endoftext|>, an end of sequence the reduced vocabulary keeps)."""
    columns = to_head_vocab(torch.tensor([0, 5, 3, 1, IGNORE]), torch.tensor([5, 0, 3]), 6)
    assert columns.tolist() == [1, 0, 2, OUT_OF_VOCAB, IGNORE]
    assert to_head_vocab(torch.tensor([0]), torch.tensor([4, 2]), 6).tolist() == [OUT_OF_VOCAB]


def test_closing_the_metric_logger_finishes_its_trackers_and_keeps_the_process_group(tmp_path):
    """accelerate's end_training destroys the processes' group too: a launch of several processes logging to
    TensorBoard failed at the barrier after its last step (test_two_process_cpu_launch_matches_one_process runs one)."""
    from types import SimpleNamespace

    config = config_from_dict({"output_dir": str(tmp_path), "data": {"prompts": "p.jsonl"},
                               "log": {"tensorboard": True}})
    calls = []
    accelerator = SimpleNamespace(log_with=["tensorboard"], is_main_process=False,
                                  trackers=[SimpleNamespace(finish=lambda: calls.append("finish"))],
                                  end_training=lambda: calls.append("end_training"))
    logger = tr.MetricLogger(config, run_paths(config), accelerator, 0)
    logger.close()
    assert calls == ["finish"] and accelerator.trackers == []


def test_a_second_run_in_an_output_dir_in_use_is_refused(tiny_dir, tmp_path, monkeypatch):
    """A launcher killed with SIGKILL leaves its workers training; a relaunch on the same output_dir joined them,
    two runs writing the same checkpoints, log and heads at once. The lock is let go at the run's end, and where
    the run fails (a caller keeping its traceback kept it held: a rerun in that process was refused)."""
    import fcntl

    import train_heads

    out = tmp_path / "run"
    path = write_recipe(tmp_path / "r.yaml", recipe(tiny_dir, out, training={"max_steps": 1, "batch_tokens": 64}))
    out.mkdir()
    with open(out / train_heads.LOCK_NAME, "w") as other:
        other.write("4242\n")
        other.flush()
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another run, holding it
        with pytest.raises(SystemExit, match=f"{out} is in use by another train_heads.py run \\(process 4242\\)"):
            train_heads.main(["--config", str(path)])
    assert not (out / "checkpoints").exists()  # refused before anything was written
    def fails(*args, **kwargs):
        raise ValueError("the data stage failed")

    monkeypatch.setattr(train_heads, "stage_data", fails)
    with pytest.raises(SystemExit, match="the data stage failed") as failed:  # a run that fails lets it go
        train_heads.main(["--config", str(path)])
    with open(out / train_heads.LOCK_NAME) as probe:  # (while its traceback is kept)
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    del failed
    monkeypatch.undo()
    assert train_heads.main(["--config", str(path)]) == 0 and (out / "heads" / "config.json").is_file()
    assert train_heads.main(["--config", str(path)]) == 0  # (finished: done again at once, the lock let go)
    # an output_dir that cannot be made: a FileNotFoundError traceback (a read-only disk's, another user's too)
    with pytest.raises(SystemExit, match=r"output_dir /proc/medusa-test/run cannot be made or written \(No such "
                                         r"file or directory: /proc/medusa-test\): give a folder this user can write"):
        train_heads.main(["--config", str(path), "output_dir=/proc/medusa-test/run"])


def test_features_planned_done_follow_weights_saved_again_over_the_model_folder(tiny_dir, tmp_path):
    """--plan matched the feature index on the model's name alone: weights saved again over its folder were planned
    as done (their steps as exact), and the run extracted again, its stage record keeping the earlier extraction's
    seconds as its own."""
    import train_heads
    from medusa_train.train_config import plan

    model_dir = tmp_path / "model"
    tiny_model("llama").save_pretrained(model_dir)
    values = recipe(tiny_dir, tmp_path / "run", model={"name": str(model_dir)})
    config_file = str(write_recipe(tmp_path / "r.yaml", values))
    assert train_heads.main(["--config", config_file]) == 0

    def features_done() -> list[bool]:
        return [stage.done for stage in plan(config_from_dict(values)).stages if stage.name == "features"]

    assert features_done() == [True]
    stages = tmp_path / "run" / "logs" / "stages.json"
    stages.write_text(json.dumps({**json.loads(stages.read_text()), "features": 999.0}))
    tiny_model("llama", seed=1).save_pretrained(model_dir)
    assert features_done() == [False]
    for done in ("heads", "checkpoints"):
        shutil.rmtree(tmp_path / "run" / done)
    assert train_heads.main(["--config", config_file]) == 0
    assert json.loads(stages.read_text())["features"] != 999.0
    assert features_done() == [True]
