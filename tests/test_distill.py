"""Tests for medusa_train.distill: sampling, batched greedy rows, resume, sharding, HTTP backend."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk

from medusa_infer.models import load_base_model, load_tokenizer
from medusa_train import distill as distill_module
from medusa_train.dataset import check_rows, encode_rendered, render_prompt
from medusa_train.distill import (
    DistillConfig,
    RejectedError,
    RetryableError,
    answer_text,
    arrow_path,
    build_parser,
    check_prompt_texts,
    config_from_args,
    distill,
    distill_shard,
    merge_shards,
    pending_prompts,
    post_json,
    prepare_prompt,
    read_jsonl_tolerant,
    read_ids,
    read_prompts,
    request_completion,
    sample_prompts,
    save_arrow,
    shard_path,
)
from tiny import tiny_model

ROW_KEYS = {
    "id", "source", "prompt", "prompt_cut", "response", "model", "generation", "finish_reason", "response_tokens",
}
SOURCES = {"big": 20, "mid": 6, "small": 4}
WORDS = "cat dog bird fish tree rock cloud river stone lamp book door".split()
EOS_SCALE = 2.8
"""Scales the tiny model's EOS row of lm_head so that some answers stop early and some do not."""


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread avoids OpenMP spin-waits when other work shares the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny random Llama with the SmolLM2 tokenizer (EOS id 2 in both), saved as a folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_model("llama", vocab_size=len(tokenizer))
    with torch.no_grad():
        model.lm_head.weight[2] *= EOS_SCALE
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    """30 prompts of varied lengths from three unbalanced sources."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    with path.open("w") as handle:
        k = 0
        for source, count in SOURCES.items():
            for i in range(count):
                words = " ".join(WORDS[(k + j) % len(WORDS)] for j in range(1 + (k * 7) % 13))
                row = {"id": f"{source}:{i}", "source": source, "prompt": f"Tell me about {words}."}
                handle.write(json.dumps(row) + "\n")
                k += 1
    return path


def make_config(model_dir: Path, prompts_file: Path, output: Path, **overrides) -> DistillConfig:
    settings = dict(
        model=str(model_dir), prompts=str(prompts_file), output=str(output), n=12,
        max_new_tokens=16, batch_size=4, progress=False,
    )
    return DistillConfig(**{**settings, **overrides})


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference_rows(tmp_path_factory, model_dir, prompts_file) -> list[dict]:
    """An uninterrupted single-process run over 12 prompts, batches of 4."""
    output = tmp_path_factory.mktemp("reference") / "rows.jsonl"
    distill(make_config(model_dir, prompts_file, output))
    return read_rows(output)


def test_a_second_distillation_into_the_same_output_is_refused_while_the_first_runs(tmp_path, model_dir,
                                                                                    prompts_file, reference_rows):
    """Two runs into one output wrote every answer twice into the same shard, or (of other settings) a merged file
    of both runs' rows, both ending with status 0. The lock goes with the run: a finished or failed one lets go."""
    output = tmp_path / "rows.jsonl"
    refused = []

    def second_run(batch_index, rows):  # (a lock is the open file's: a second one in this process is refused too)
        with pytest.raises(distill_module.DistillError) as raised:
            distill(make_config(model_dir, prompts_file, output, max_new_tokens=15))
        refused.append(str(raised.value))

    distill(make_config(model_dir, prompts_file, output), on_batch=second_run)
    assert refused and refused[0].startswith(f"{output} is being written by another distillation (process "
                                             f"{os.getpid()}): wait for it to end")
    assert read_rows(output) == reference_rows
    assert not distill_module.shard_files(output)
    distill(make_config(model_dir, prompts_file, output, n=14))  # let go: a later run goes on


def test_a_filesystem_without_locks_is_no_run_in_progress(tmp_path, monkeypatch, caplog):
    """flock failing for want of locks (NFS without its lock daemon: ENOLCK) was taken for another run holding the
    file: every run refused, naming the pid a finished run left there."""
    import errno
    import fcntl

    from medusa_train.locks import try_lock

    path = tmp_path / ".lock"
    path.write_text("6781\n")

    def no_locks(handle, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="medusa_train.locks"):
        assert try_lock(path) == (None, None)
    assert "cannot be locked (No locks available): this filesystem takes no locks" in caplog.text


def test_sample_prompts_balanced_and_deterministic(prompts_file):
    sample = sample_prompts(prompts_file, 9)
    counts = {s: sum(r["source"] == s for r in sample) for s in SOURCES}
    assert counts == {"big": 3, "mid": 3, "small": 3}
    assert sample == sample_prompts(prompts_file, 9)
    assert sample_prompts(prompts_file, 15)[:9] == sample  # a larger n extends a smaller one
    assert sample != sample_prompts(prompts_file, 9, seed=1)
    # "small" runs out after 4: the rest is shared by the others.
    counts = {s: sum(r["source"] == s for r in sample_prompts(prompts_file, 20)) for s in SOURCES}
    assert counts == {"big": 10, "mid": 6, "small": 4}
    assert len(sample_prompts(prompts_file, None)) == 30
    excluded = sample_prompts(prompts_file, 9, exclude_ids=[sample[0]["id"]])
    assert sample[0]["id"] not in {r["id"] for r in excluded} and len(excluded) == 9
    # leaving out a prompt the sample did not hold changes nothing (its source was shuffled anew: 7 of 9 kept)
    outside = next(r["id"] for r in sample_prompts(prompts_file, None) if r["id"] not in {s["id"] for s in sample}
                   and r["source"] == "big")
    assert sample_prompts(prompts_file, 9, exclude_ids=[outside]) == sample
    quotas = sample_prompts(prompts_file, None, per_source={"big": 5, "small": 2})
    assert sorted(r["source"] for r in quotas) == ["big"] * 5 + ["small"] * 2
    with pytest.raises(ValueError, match="not in"):
        sample_prompts(prompts_file, 4, per_source={"nope": 1})


def test_a_quota_whose_source_is_all_excluded_says_so(prompts_file, caplog):
    """Every prompt of a quota's source in exclude_ids (a held-out set): the error said the source was not
    in the file, though it is."""
    small = [r["id"] for r in sample_prompts(prompts_file, None) if r["source"] == "small"]
    with caplog.at_level(logging.WARNING, logger="medusa_train.distill"):
        quotas = sample_prompts(prompts_file, None, per_source={"big": 2, "small": 2}, exclude_ids=small)
    assert sorted(r["source"] for r in quotas) == ["big", "big"]
    assert "source small has 0 prompts once 4 excluded ones are left out, fewer than its quota 2" in caplog.text


@pytest.mark.parametrize("line, says", [
    ('{"id": "a", "prompt": "again"}', "id 'a' is already at "),
    ('{"id": "b", "prompt": ["hi"]}', "'prompt' must be a string"),
    ('{"id": "b", "prompt": "hi", "source": 3}', "'source' must be a string or null"),
    ('{"id": 1.5, "prompt": "hi"}', "'id' must be a string or an integer, got 1.5"),
    ('["b", "hi"]', "needs an object with 'id' and 'prompt'"),
    ('{"id": "b", "prompt": "half an emoji \\ud83d"}', "'prompt' holds a lone surrogate"),
    ('[{"id": "b", "prompt": "hi"},', "a prompts file holds one JSON object per line (JSONL), or one JSON array"),
    ('{"id": "b", "conversations": [{"from": "system", "value": "hello"}]}', "has no user turn to ask"),
    ('{"id": "b", "conversations": [{"from": "gpt", "value": "hello"}]}', "an assistant turn with no user turn"),
    ('{"id": "b", "conversations": [{"from": "tool", "value": "{}"}]}', "is from 'tool', which is no ShareGPT author"),
])
def test_prompts_file_rows_are_checked_by_line(tmp_path, line, says):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "prompt": "first"}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"{path}:2") as err:
        read_prompts(path)
    assert says in str(err.value)
    path.write_text('{"id": 7, "prompt": "first", "source": null}\n')
    assert read_prompts(path) == [{"id": "7", "source": "", "prompt": "first"}]


def test_sharegpt_conversations_are_read_as_prompts_and_as_training_rows(tmp_path, caplog):
    """The layout FasterDecoding/Medusa and Vicuna trained on (ShareGPT's .json: one array of
    {"id", "conversations": [{"from": "human" | "gpt" | "system", "value"}]}) was refused by both readers."""
    from medusa_train.dataset import read_rows, row_messages

    rows = [{"id": "s1", "conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"},
                                           {"from": "human", "value": "And?"}, {"from": "gpt", "value": "Bye."}]},
            {"id": 2, "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Why?"}]},
            {"id": "m", "messages": [{"role": "user", "content": "Say yes"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text("\ufeff" + json.dumps(rows, indent=1), encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="medusa_train.distill"):
        prompts = read_prompts(path)
    assert prompts == [{"id": "s1", "source": "", "prompt": "Hi there"}, {"id": "2", "source": "", "prompt": "Why?"},
                       {"id": "m", "source": "", "prompt": "Say yes"}]
    assert "2 of the conversations in" in caplog.text and "the model is asked that first turn alone" in caplog.text
    assert read_rows(path) == rows
    assert row_messages(rows[0]) == [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                                     {"role": "user", "content": "And?"}, {"role": "assistant", "content": "Bye."}]
    assert row_messages(rows[1])[0] == {"role": "system", "content": "Be brief."}
    lines = tmp_path / "sharegpt.jsonl"  # as JSON lines too
    lines.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert read_rows(lines) == rows and read_prompts(lines) == prompts
    assert read_ids(path) == ["s1", "2", "m"]  # exclude_ids from such a file (its first line was taken for one id)
    ids = tmp_path / "ids.txt"
    for text, expected in (('["p0", 7]', ["p0", "7"]), ("[draft]-1\nq2\n", ["[draft]-1", "q2"])):
        ids.write_text(text)
        assert read_ids(ids) == expected
    path.write_text(json.dumps([rows[0], ["not", "a", "row"]]))
    with pytest.raises(ValueError, match=r"sharegpt.json\[1\] needs an object with 'id' and 'prompt'"):
        read_prompts(path)
    with pytest.raises(ValueError, match="element 1 of its array is a JSON list, not an object"):
        read_rows(path)


def test_a_prompts_file_that_is_not_utf8_is_named_by_line(tmp_path):
    """The codec's own message named neither the file nor the line, and its position counted from the block read
    (a line past the first 8 KiB here)."""
    path = tmp_path / "prompts.jsonl"
    good = b"".join(b'{"id": "a%d", "prompt": "first"}\n' % n for n in range(400))
    path.write_bytes(good + b'{"id": "b", "prompt": "caf\xe9 au lait"}\n')
    with pytest.raises(ValueError) as err:
        read_prompts(path)
    at = len(good) + len(b'{"id": "b", "prompt": "caf')
    assert str(err.value) == f"{path}:401 is not UTF-8 text (invalid continuation byte at byte {at}): save it as UTF-8"


def test_a_run_an_earlier_release_sampled_with_exclusions_is_not_answered_again(tmp_path, model_dir, prompts_file,
                                                                                  monkeypatch):
    """Excluded prompts are left out after the shuffle since commit 0c5145d: a run an earlier release drew with
    exclude_ids (excluded ones left out before it) sampled other prompts, answered part of its sample again and
    trained on both."""
    import functools

    output = tmp_path / "rows.jsonl"
    excluded = [sample_prompts(prompts_file, None)[0]["id"], sample_prompts(prompts_file, None)[5]["id"]]
    config = make_config(model_dir, prompts_file, output, n=8, exclude_ids=excluded)
    real = distill_module.sample_prompts
    legacy = real(prompts_file, 8, exclude_ids=excluded, shuffle_first=False)
    assert legacy != real(prompts_file, 8, exclude_ids=excluded)  # (the two samples differ)
    monkeypatch.setattr(distill_module, "sample_prompts", functools.partial(real, shuffle_first=False))
    distill(config)  # as an earlier release drew it
    monkeypatch.setattr(distill_module, "sample_prompts", real)
    assert [row["id"] for row in read_rows(output)] == [p["id"] for p in legacy]
    assert pending_prompts(config) == (8, 0)
    distill(config)
    assert [row["id"] for row in read_rows(output)] == [p["id"] for p in legacy]  # nothing answered again
    # every prompt sampled, in another order (n=None): the same prompts, kept in the order written (a rerun merged
    # them anew in the new order, and the held-out split, drawn by position, changed)
    whole = tmp_path / "whole.jsonl"
    monkeypatch.setattr(distill_module, "sample_prompts", functools.partial(real, shuffle_first=False))
    distill(make_config(model_dir, prompts_file, whole, n=None, exclude_ids=excluded, format="arrow"))
    monkeypatch.setattr(distill_module, "sample_prompts", real)
    written = [row["id"] for row in read_rows(whole)]
    assert written != [p["id"] for p in real(prompts_file, None, exclude_ids=excluded)]  # (the orders differ)
    shutil.rmtree(arrow_path(whole))  # (a copy to make again: the merge runs)
    distill(make_config(model_dir, prompts_file, whole, n=None, exclude_ids=excluded, format="arrow"))
    assert [row["id"] for row in read_rows(whole)] == written
    # a run of this release cut short: its shards' rows (longest prompts first, not the sample's order) may match
    # the earlier release's order by chance; only a merged file's order tells (it took the earlier sample)
    cut = tmp_path / "cut.jsonl"
    current = real(prompts_file, 8, exclude_ids=excluded)
    where = {p["id"]: i for i, p in enumerate(legacy)}
    shared = [p["id"] for p in current if p["id"] in where]
    a, b = next((a, b) for a, b in itertools.combinations(shared, 2) if where[a] > where[b])  # (orders that differ)
    shard_path(cut, 0).write_text("".join(json.dumps({"id": i}) + "\n" for i in (b, a)))  # the earlier's order
    assert distill_module.run_prompts(make_config(model_dir, prompts_file, cut, n=8, exclude_ids=excluded)) == current
    fresh = tmp_path / "fresh.jsonl"  # a new run: the new sample
    distill(make_config(model_dir, prompts_file, fresh, n=8, exclude_ids=excluded))
    assert [row["id"] for row in read_rows(fresh)] == [p["id"] for p in real(prompts_file, 8, exclude_ids=excluded)]


def test_a_cut_line_is_not_taken_for_a_json_list(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "prompt": "first"}\n{"id": "b", "prom')  # a writer killed mid-line
    with pytest.raises(ValueError, match=r"prompts.jsonl:2 is not valid JSON \(") as err:
        read_prompts(path)
    assert "JSON list" not in str(err.value)


def test_empty_prompts_still_to_answer_are_refused_and_answered_ones_resume(tmp_path, model_dir, prompts_file):
    """An empty prompt was distilled as an empty user turn and trained on, without a word. Refused where it is
    still to answer; a file holding one was refused as a whole at first, which stopped runs that had answered it
    (by an earlier release) or never sampled it from resuming."""
    rows = [json.loads(line) for line in prompts_file.read_text().splitlines()]
    rows[0]["prompt"] = " \n"
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "rows.jsonl"
    with pytest.raises(ValueError, match=rf"the prompts '{rows[0]['id']}' are empty: there is nothing to answer; "
                                         r"leave them out \(exclude_ids, a recipe's data.distill_options.exclude_ids"):
        distill(make_config(model_dir, path, output, n=None))
    with pytest.raises(ValueError, match="are empty"):
        pending_prompts(make_config(model_dir, path, output, n=None))
    assert not output.exists()
    distill(make_config(model_dir, path, output, n=None, exclude_ids=[rows[0]["id"]]))  # left out: answered
    assert rows[0]["id"] not in {row["id"] for row in read_rows(output)} and len(read_rows(output)) == len(rows) - 1
    # answered by an earlier release: the run resumes (and plans) as it was
    answered = read_rows(output)[0]
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({**answered, "id": rows[0]["id"], "source": rows[0]["source"],
                               "prompt": rows[0]["prompt"]}) + "\n")
    assert pending_prompts(make_config(model_dir, path, old, n=None))[1] == len(rows) - 1


def test_batched_rows_equal_unbatched_greedy(reference_rows, model_dir, prompts_file, tokenizer):
    expected_ids = [p["id"] for p in sample_prompts(prompts_file, 12)]
    assert [r["id"] for r in reference_rows] == expected_ids
    model = load_base_model(str(model_dir))
    for row in reference_rows:
        # the local model's, which an endpoint does not tell
        assert set(row) == ROW_KEYS | {"model_weights", "response_ids", "prompt_template"}
        assert row["model"] == str(model_dir)
        assert row["generation"] == {
            "max_new_tokens": 16, "do_sample": False, "temperature": 0.0, "top_p": 1.0, "seed": 0,
            "chat_template": None, "system_prompt": None,
        }
        ids = encode_rendered(tokenizer, render_prompt(tokenizer, row["prompt"]))
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0,
            )[0, len(ids):].tolist()
        stop = out.index(2) if 2 in out else len(out)
        assert row["response"] == tokenizer.decode(out[:stop])
        assert row["response_tokens"] == stop
        assert row["response_ids"] == out[:stop + 1]  # the tokens as written, the end token included
        assert row["finish_reason"] == ("eos" if stop < len(out) else "length")
    reasons = {r["finish_reason"] for r in reference_rows}
    assert reasons == {"eos", "length"}, "the tiny model should give both kinds of ending"


def test_resume_after_exception(tmp_path, model_dir, prompts_file, reference_rows):
    output = tmp_path / "rows.jsonl"
    config = make_config(model_dir, prompts_file, output)

    def crash(batch_index, rows):
        if batch_index == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill(config, on_batch=crash)
    assert len(read_rows(shard_path(output, 0))) == 8 and not output.exists()
    distill(config)
    assert read_rows(output) == reference_rows
    assert not shard_path(output, 0).exists()


def test_resume_after_sigkill_with_half_written_line(tmp_path, model_dir, prompts_file, reference_rows):
    output = tmp_path / "rows.jsonl"
    config = make_config(model_dir, prompts_file, output)
    script = textwrap.dedent(
        """
        import json, os, signal, sys
        from medusa_train.distill import DistillConfig, distill, shard_path
        config = DistillConfig(**json.loads(sys.argv[1]))
        def die(batch_index, rows):
            if batch_index == 1:
                with open(shard_path(config.output, 0), "a") as handle:
                    handle.write('{"id": "big:3", "response": "half wr')
                os.kill(os.getpid(), signal.SIGKILL)
        distill(config, on_batch=die)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(dataclasses.asdict(config))],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    shard = shard_path(output, 0)
    assert shard.read_text().count("\n") == 8 and not shard.read_text().endswith("\n")
    distill(config)
    rows = read_rows(output)
    assert [r["id"] for r in rows] == [r["id"] for r in reference_rows]
    assert rows == reference_rows


def test_read_jsonl_tolerant(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": 1}\n{"id": 2}\n{"id": 3, "resp')
    assert read_jsonl_tolerant(path) == [{"id": 1}, {"id": 2}]
    assert path.read_text().endswith("resp")  # reading alone leaves the file untouched
    assert read_jsonl_tolerant(path, repair=True) == [{"id": 1}, {"id": 2}]
    assert path.read_text() == '{"id": 1}\n{"id": 2}\n'
    path.write_text('{"id": 1}\n{"id": 2}')  # complete JSON but no newline: not trusted
    assert read_jsonl_tolerant(path, repair=True) == [{"id": 1}]
    path.write_text('{"id": 1}\n{"id": \n{"id": 3}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_jsonl_tolerant(path)


def test_a_merge_keeps_the_first_row_of_an_id_written_twice(tmp_path):
    """Duplicated ids keep their first row (the merged output's), not a stale shard's (a later row replaced it)."""
    output = tmp_path / "rows.jsonl"
    output.write_text(json.dumps({"id": "a", "response": "first"}) + "\n")
    shard_path(output, 0).write_text("".join(json.dumps(row) + "\n" for row in (
        {"id": "a", "response": "second"}, {"id": "b", "response": "b's"})))
    merge_shards(output, [{"id": "b"}, {"id": "a"}])
    assert read_rows(output) == [{"id": "b", "response": "b's"}, {"id": "a", "response": "first"}]


def test_two_rank_shards_merge_in_prompt_order(tmp_path, model_dir, prompts_file, reference_rows):
    output = tmp_path / "rows.jsonl"
    config = make_config(model_dir, prompts_file, output, format="arrow")
    prompts = sample_prompts(prompts_file, 12)
    stats = [distill_shard(config, prompts, rank, 2) for rank in (1, 0)]
    assert [s.rows for s in stats] == [6, 6]
    assert {r["id"] for r in read_rows(shard_path(output, 1))} == {p["id"] for p in prompts[1::2]}
    merge_shards(output, prompts, config.format)
    assert read_rows(output) == reference_rows
    dataset = load_from_disk(str(output.with_name(output.name + ".arrow")))
    assert dataset["id"] == [r["id"] for r in reference_rows]
    assert dataset[0]["generation"] == reference_rows[0]["generation"]
    # A rerun finds everything done and changes nothing.
    assert distill_shard(config, prompts, 0, 2).rows == 0


def test_a_kill_while_saving_arrow_leaves_no_short_arrow_copy(tmp_path, model_dir, prompts_file, monkeypatch):
    """The JSONL is merged before the Arrow copy is saved: a run killed in between must not leave the
    earlier, shorter Arrow folder, which the next run would take as up to date."""
    output = tmp_path / "rows.jsonl"
    distill(make_config(model_dir, prompts_file, output, n=4, format="arrow"))
    assert len(load_from_disk(str(output.with_name(output.name + ".arrow")))) == 4
    real_save = distill_module.save_arrow

    def killed(rows, folder):
        raise KeyboardInterrupt

    monkeypatch.setattr(distill_module, "save_arrow", killed)
    with pytest.raises(KeyboardInterrupt):
        distill(make_config(model_dir, prompts_file, output, n=8, format="arrow"))
    assert len(read_rows(output)) == 8 and not output.with_name(output.name + ".arrow").exists()
    monkeypatch.setattr(distill_module, "save_arrow", real_save)
    distill(make_config(model_dir, prompts_file, output, n=8, format="arrow"))
    assert load_from_disk(str(output.with_name(output.name + ".arrow")))["id"] == [r["id"] for r in read_rows(output)]


def test_an_output_name_with_glob_characters_merges_its_shards(tmp_path, model_dir, prompts_file, reference_rows):
    output = tmp_path / "rows[v2].jsonl"
    distill(make_config(model_dir, prompts_file, output))
    assert read_rows(output) == reference_rows and not shard_path(output, 0).exists()


def test_the_arrow_copy_keeps_a_key_the_first_row_lacks(tmp_path):
    """An endpoint's served_model is kept on the rows whose reply named another model only: the datasets
    folder took its columns from the first row and dropped it from every row."""
    from datasets import load_from_disk

    from medusa_train.distill import save_arrow

    rows = [{"id": "0", "response": "a"}, {"id": "1", "response": "b", "served_model": "other"}]
    saved = load_from_disk(str(save_arrow(rows, tmp_path / "rows.arrow")))
    assert saved.to_list() == [{"id": "0", "response": "a", "served_model": None},
                               {"id": "1", "response": "b", "served_model": "other"}]


def test_a_jsonl_merge_leaves_no_stale_arrow_copy(tmp_path, model_dir, prompts_file, caplog):
    output = tmp_path / "rows.jsonl"
    distill(make_config(model_dir, prompts_file, output, n=4, format="arrow"))
    distill(make_config(model_dir, prompts_file, output, n=8))  # JSONL only: the Arrow copy would hold 4
    distill(make_config(model_dir, prompts_file, output, n=8, format="arrow"))  # all answered: merges again
    assert load_from_disk(str(output.with_name(output.name + ".arrow")))["id"] == [r["id"] for r in read_rows(output)]
    assert len(read_rows(output)) == 8
    # outputs whose names differ in their suffix only: they shared one folder (rows.arrow), each run's copy
    # replacing the other's, and a rerun took the other's rows for its own
    # the copy where earlier releases saved it (rows.arrow) holds the rows of then: named, not deleted (it may be
    # another output's own copy), as a data.rows pointing at it trained on the short copy without a word
    save_arrow(read_rows(output)[:4], tmp_path / "rows.arrow")
    with caplog.at_level(logging.WARNING, logger="medusa_train.distill"):
        distill(make_config(model_dir, prompts_file, output, n=9))
    assert f"{tmp_path / 'rows.arrow'} is where earlier releases saved the Arrow copy of {output}" in caplog.text
    assert (tmp_path / "rows.arrow").is_dir()
    caplog.clear()
    (tmp_path / "rows").write_text("")  # an output named rows: rows.arrow is its own copy, not to be deleted
    with caplog.at_level(logging.WARNING, logger="medusa_train.distill"):
        distill(make_config(model_dir, prompts_file, output, n=10))
    assert "earlier releases saved" not in caplog.text
    first, second = tmp_path / "rows.v1", tmp_path / "rows.v2"
    distill(make_config(model_dir, prompts_file, first, n=2, format="arrow"))
    distill(make_config(model_dir, prompts_file, second, n=5, seed=3, format="arrow"))
    distill(make_config(model_dir, prompts_file, first, n=2, format="arrow"))
    for path in (first, second):
        assert load_from_disk(str(arrow_path(path)))["id"] == [r["id"] for r in read_rows(path)]
    assert arrow_path(first) == tmp_path / "rows.v1.arrow"


def small_recipe(tmp_path: Path, model_dir: Path, prompts_file: Path, n: int):
    """A recipe distilling ``n`` of ``prompts_file``'s prompts, 4 tokens each, into ``tmp_path / "run"``."""
    from medusa_train.train_config import config_from_dict

    return config_from_dict({"output_dir": str(tmp_path / "run"), "model": {"name": str(model_dir)},
                             "data": {"prompts": str(prompts_file), "n": n, "max_new_tokens": 4,
                                      "distill_batch_size": 4},
                             "features": {"from_distillation": False}, "log": {"progress": False}})


def test_train_heads_merges_the_answers_a_killed_run_left_in_shards(tmp_path, model_dir, prompts_file):
    """Killed after its last answer, before the merge: the shard holds every missing answer, and
    train_heads must merge it rather than train on the shorter rows file."""
    import train_heads
    from accelerate import PartialState

    from medusa_train.train_config import rows_path

    def recipe(n):
        return small_recipe(tmp_path, model_dir, prompts_file, n)

    distill(distill_module.recipe_config(recipe(4)))

    def killed(batch_index, rows):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill(distill_module.recipe_config(recipe(8)), on_batch=killed)
    rows = rows_path(recipe(8))
    assert len(read_rows(rows)) == 4 and len(read_rows(shard_path(rows, 0))) == 4
    pending = train_heads.distill_pending(recipe(8))
    assert pending == 4
    train, heldout = train_heads.stage_data(recipe(8), PartialState(cpu=True), pending)
    assert len(train) + len(heldout) == 8 and len(read_rows(rows)) == 8 and not shard_path(rows, 0).exists()


def test_the_training_record_and_card_count_the_rows_of_each_prompt_source(tmp_path, model_dir, prompts_file):
    import train_heads
    from medusa_infer.checkpoint import model_card
    from medusa_infer.config import MedusaConfig
    from medusa_train.dataset import to_dataset
    from medusa_train.train_config import config_from_dict, rows_path

    config = small_recipe(tmp_path, model_dir, prompts_file, 12)
    distill(distill_module.recipe_config(config))
    rows = read_rows(rows_path(config))
    counted = {source: sum(row["source"] == source for row in rows) for source in SOURCES}
    sources = train_heads.data_sources(config)
    assert sources == {s: n for s, n in sorted(counted.items(), key=lambda i: (-i[1], i[0])) if n}
    assert list(sources.values()) == sorted(sources.values(), reverse=True) and sum(sources.values()) == 12
    # rows made elsewhere: those without a source counted apart; none naming one, or ready examples: no record
    given = tmp_path / "given.jsonl"
    given.write_text("".join(json.dumps({"prompt": "a", "response": "b", **extra}) + "\n"
                             for extra in ({"source": "x"}, {}, {"source": ""}, {"source": "x"}, {"source": "y"})))
    other = config_from_dict({"model": {"name": str(model_dir)}, "data": {"rows": str(given)}})
    assert train_heads.data_sources(other) == {"x": 2, "(no source)": 2, "y": 1}
    given.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    assert train_heads.data_sources(other) is None
    ready = config_from_dict({"model": {"name": str(model_dir)}, "data": {"tokenized": str(given)}})
    assert train_heads.data_sources(ready) is None
    card = model_card(MedusaConfig(hidden_size=8, vocab_size=16, num_heads=1, training={"data_sources": sources}))
    table = card.split("## Training data\n", 1)[1].split("\n## ", 1)[0]
    assert "on 12 rows of conversations" in table
    assert [line for line in table.splitlines() if line.startswith("| ") and "source" not in line] == [
        f"| {name} | {count} |" for name, count in sources.items()]
    for odd in ({}, {"a": "3"}, {"a": True}, ["a"]):  # a hand-edited record: no section (the card is still written)
        assert "## Training data" not in model_card(MedusaConfig(hidden_size=8, vocab_size=16, num_heads=1,
                                                                 training={"data_sources": odd}))
    # names as published: one cell each (a "|" added a column, a newline ended the table), a path by its last part
    # in the table and in the training record the card shows and the upload keeps
    odd = {"a|b": 3, "x\ny": 2, "/home/alice/private/prompts.jsonl": 1}
    card = model_card(MedusaConfig(hidden_size=8, vocab_size=16, num_heads=1, training={"data_sources": odd}))
    table = card.split("## Training data\n", 1)[1].split("\n## ", 1)[0]
    assert [line for line in table.splitlines() if line.startswith("| ") and "source" not in line] == [
        "| a\\|b | 3 |", "| x y | 2 |", "| <local>/prompts.jsonl | 1 |"]
    assert "alice" not in card
    # a datasets folder of rows: its source column (or each row's)
    to_dataset([{"source": "x"}, {"source": "y"}, {"source": "x"}]).save_to_disk(str(tmp_path / "folder"))
    assert train_heads.data_sources(config_from_dict({"model": {"name": str(model_dir)},
                                                      "data": {"rows": str(tmp_path / "folder")}})) == {"x": 2, "y": 1}


def test_train_heads_says_it_trains_on_rows_outside_a_smaller_sample(tmp_path, model_dir, prompts_file, caplog):
    """data.n lowered after a run: nothing is left to answer, so no distill() ran to warn that the rows
    file keeps the larger sample's rows, which are trained on (silently, as the README's 3229 rows were)."""
    import train_heads
    from accelerate import PartialState

    def recipe(n):
        return small_recipe(tmp_path, model_dir, prompts_file, n)

    distill(distill_module.recipe_config(recipe(6)))
    assert train_heads.distill_pending(recipe(4)) == 0
    with caplog.at_level("WARNING", logger="medusa_train.distill"):
        train, heldout = train_heads.stage_data(recipe(4), PartialState(cpu=True), 0)
    assert len(train) + len(heldout) == 6
    assert "keeps 2 rows whose prompts are not in this run's sample" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="medusa_train.distill"):
        train_heads.stage_data(recipe(6), PartialState(cpu=True), 0)
    assert "not in this run's sample" not in caplog.text


def test_train_heads_distils_on_its_accelerators_device(tmp_path, model_dir, prompts_file, monkeypatch):
    """One process too: distill() took no accelerator then, and ran the model on the CPU on a GPU machine."""
    import types

    import train_heads
    from medusa_train.train_config import config_from_dict

    recipe = config_from_dict({"output_dir": str(tmp_path / "run"), "model": {"name": str(model_dir)},
                               "data": {"prompts": str(prompts_file), "n": 2, "max_new_tokens": 2},
                               "features": {"from_distillation": False}, "log": {"progress": False}})
    seen = {}

    def spy(config, pending, writer, stats, device, on_batch=None, fingerprint=None, done=()):
        seen["device"] = device
        raise KeyboardInterrupt

    monkeypatch.setattr(distill_module, "run_local", spy)
    accelerator = types.SimpleNamespace(is_main_process=True, process_index=0, num_processes=1,
                                        device=torch.device("meta"), wait_for_everyone=lambda: None)
    with pytest.raises(KeyboardInterrupt):
        train_heads.stage_data(recipe, accelerator, None)
    assert seen["device"] == torch.device("meta")


def test_the_commands_paths_take_a_leading_tilde_as_the_home_folder(tmp_path, prompts_file, monkeypatch):
    """--output=~/rows.jsonl (no shell expands ~ after "=") wrote into a folder named ~ in the working folder."""
    from medusa_train.distill import build_parser, config_from_args

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copy(prompts_file, tmp_path / "p.jsonl")
    (tmp_path / "ids.txt").write_text("a\nb\n")
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    args = build_parser().parse_args(["--model", "m", "--prompts=~/p.jsonl", "--output=~/rows.jsonl",
                                      "--exclude-ids=~/ids.txt", "--chat-template=~/t.jinja"])
    config = config_from_args(args)
    assert (config.prompts, config.output) == (str(tmp_path / "p.jsonl"), str(tmp_path / "rows.jsonl"))
    assert config.exclude_ids == ["a", "b"] and config.chat_template == "{{ messages[0]['content'] }}"


def test_exclude_ids_given_as_a_file_in_a_recipe(tmp_path, prompts_file):
    (tmp_path / "held.txt").write_text("big:0\nbig:1\nmid:0\n")
    parser = build_parser()
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"prompts: {prompts_file}\nexclude_ids: {tmp_path / 'held.txt'}\n")
    by_recipe = config_from_args(parser.parse_args(["--recipe", str(recipe)]))
    by_flag = config_from_args(parser.parse_args(["--prompts", str(prompts_file),
                                                  "--exclude-ids", str(tmp_path / "held.txt")]))
    assert by_recipe.exclude_ids == by_flag.exclude_ids == ["big:0", "big:1", "mid:0"]
    sampled = {p["id"] for p in sample_prompts(prompts_file, None, exclude_ids=by_recipe.exclude_ids)}
    assert not sampled & {"big:0", "big:1", "mid:0"} and len(sampled) == 27
    # a recipe that is no YAML mapping, or gives a key twice (the last silently won), is named (a traceback)
    for text, message in ((f"prompts: {prompts_file}\nn: 2\nn: 3\n", "'n' appears twice in one mapping"),
                          ("- a\n", "holds a list, not a mapping"), ("n: [1\n", "is not valid YAML")):
        recipe.write_text(text)
        with pytest.raises(ValueError, match=message):
            config_from_args(parser.parse_args(["--recipe", str(recipe)]))
    from medusa_train.train_config import config_from_dict

    train = config_from_dict({"output_dir": "out", "data": {"prompts": str(prompts_file), "distill_options": {
        "exclude_ids": str(tmp_path / "held.txt")}}})
    assert distill_module.recipe_config(train).exclude_ids == ["big:0", "big:1", "mid:0"]
    assert DistillConfig(prompts="p.jsonl", exclude_ids=["a", "b"]).exclude_ids == ["a", "b"]
    with pytest.raises(ValueError, match="exclude_ids='no-such-file' is not a file"):
        DistillConfig(prompts="p.jsonl", exclude_ids="no-such-file")


def test_ids_to_exclude_are_read_from_rows_whose_text_holds_line_separators(tmp_path):
    """JSON strings may hold U+2028, U+2029 and U+0085 unescaped (rows are written with ensure_ascii=False);
    they end no line of a JSONL file."""
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": f"a\u2028b\u2029c\x85d {i}"}, ensure_ascii=False) + "\n"
                            for i in range(3)), encoding="utf-8")
    assert read_ids(path) == ["0", "1", "2"]
    (tmp_path / "ids.txt").write_text("x\ny\n\n")
    assert read_ids(tmp_path / "ids.txt") == ["x", "y"]


def test_merge_keeps_an_earlier_runs_rows_and_says_so(tmp_path, model_dir, prompts_file, caplog):
    output = tmp_path / "rows.jsonl"
    distill(make_config(model_dir, prompts_file, output, n=4))
    first = read_rows(output)
    with caplog.at_level("WARNING", logger="medusa_train.distill"):
        distill(make_config(model_dir, prompts_file, output, n=2))  # a smaller sample: a prefix of the first
    assert read_rows(output) == first  # nothing answered again, nothing dropped
    assert "keeps 2 rows whose prompts are not in this run's sample" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="medusa_train.distill"):
        distill(make_config(model_dir, prompts_file, output, n=4))
    assert "not in this run's sample" not in caplog.text


def test_resume_refuses_other_generation_settings(tmp_path, model_dir, prompts_file):
    output = tmp_path / "rows.jsonl"
    distill(make_config(model_dir, prompts_file, output, n=2))
    with pytest.raises(ValueError, match="Use another output path"):
        distill(make_config(model_dir, prompts_file, output, n=4, max_new_tokens=8))
    with pytest.raises(ValueError, match="Use another output path"):
        distill(make_config(model_dir, prompts_file, output, n=4, system_prompt="Be brief."))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    with pytest.raises(ValueError, match=r"made with chat_template None \(now 'sha256:[0-9a-f]+'; model.chat_template in a "
                                         r"recipe\)"):
        distill(make_config(model_dir, prompts_file, output, n=4, chat_template=template))
    # the prompts file rewritten under the same ids: the old answers were kept as the new prompts' answers
    rows = read_rows(output)
    changed = tmp_path / "prompts.jsonl"
    changed.write_text("".join(json.dumps({**json.loads(line), "prompt": json.loads(line)["prompt"] + " Why?"})
                               + "\n" for line in Path(prompts_file).read_text().splitlines()))
    with pytest.raises(ValueError, match=rf"holds row '{rows[0]['id']}' answering another prompt than .*prompts.jsonl"):
        distill(make_config(model_dir, changed, output, n=4))
    # exclude_ids added after its prompt was answered: the row stayed, trained on (a held-out set's prompt)
    answered = read_rows(output)[0]["id"]
    with pytest.raises(ValueError, match=rf"holds row '{answered}', a prompt exclude_ids excludes"):
        distill(make_config(model_dir, prompts_file, output, n=4, exclude_ids=[answered]))


def test_rows_of_other_weights_under_the_same_name_are_refused(tmp_path, model_dir, prompts_file, tokenizer):
    """A model folder trained or converted again between two runs into one rows file: the second run's answers
    (another model's) were mixed with the first's without a word (only the name was compared)."""
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    output = tmp_path / "rows.jsonl"
    distill(make_config(folder, prompts_file, output, n=2))
    recorded = {row["model_weights"] for row in read_rows(output)}
    assert len(recorded) == 1 and recorded.pop().startswith("sha256:")
    shutil.copytree(folder, tmp_path / "copy")  # a copy elsewhere (other file times) is the same weights
    distill(make_config(tmp_path / "copy", prompts_file, tmp_path / "copy.jsonl", n=2))
    assert read_rows(tmp_path / "copy.jsonl")[0]["model_weights"] == read_rows(output)[0]["model_weights"]
    # resumed from the copy, or by another spelling of the same folder: the same weights (refused by name before)
    distill(make_config(folder, prompts_file, tmp_path / "copy.jsonl", n=3))
    distill(make_config(f"{tmp_path}/./copy/", prompts_file, tmp_path / "copy.jsonl", n=4))
    assert len(read_rows(tmp_path / "copy.jsonl")) == 4
    other = tiny_model("llama", seed=7, vocab_size=len(tokenizer))
    other.save_pretrained(folder)
    with pytest.raises(ValueError, match=r"already holds row .* answered by other weights under the name"):
        distill(make_config(folder, prompts_file, output, n=4))
    rows = read_rows(output)  # rows from before weights were recorded resume as they are
    for row in rows:
        del row["model_weights"]
    output.write_text("".join(json.dumps(row) + "\n" for row in rows))
    distill(make_config(folder, prompts_file, output, n=3))


def test_rows_of_another_endpoint_model_name_the_setting_that_picks_it():
    from medusa_train.distill import check_resumable

    for name in ("served-b", "smollm2-135m-instruct"):  # (the latter: the model.name it equals)
        config = DistillConfig(prompts="p.jsonl", output="rows.jsonl", backend="openai", endpoint="http://x/v1",
                               endpoint_model=name)
        rows = [{"id": "a", "model": "served-a", "generation": config.generation_record()}]
        with pytest.raises(ValueError, match=rf"made with model 'served-a' \(now '{name}'; "
                                             r"data.distill_options.endpoint_model in a recipe\)"):  # said model.name
            check_resumable(rows, config)


def test_rows_are_compared_with_their_prompts_text_and_a_cut_prompt_is_kept(model_dir, tokenizer, tmp_path):
    """A prompt cut under prompt_overflow=truncate (a resume under the default "skip", or at another limit, was
    refused as a rewritten prompts file); under truncate a rewritten file went unchecked; the message showed the
    first 60 characters, the same on both sides when the change came later."""
    prompt = "Please write a detailed summary of the history of the Roman Empire, from its founding to its fall."
    prompts = [{"id": "a", "prompt": prompt}]
    changed = prompt.replace(" fall.", " fall, said the scribe.")
    cut = prepare_prompt(tokenizer, prompt, DistillConfig(model=str(model_dir), prompts="p.jsonl",
                                                          prompt_overflow="truncate", max_prompt_tokens=40))[0]
    assert prompt.startswith(cut.rstrip()) and cut != prompt
    for overflow, limit in (("skip", 40), ("truncate", 40), ("truncate", 60), ("skip", None)):
        config = DistillConfig(model=str(model_dir), prompts="p.jsonl", output="rows.jsonl", prompt_overflow=overflow,
                               max_prompt_tokens=limit)
        older = [{"id": "a", "prompt": cut}] if limit == 40 else []  # no prompt_cut: today's limit decides
        check_prompt_texts([{"id": "a", "prompt": prompt, "prompt_cut": False}, {"id": "b", "prompt": "x"},
                            {"id": "a", "prompt": cut, "prompt_cut": True}, *older], prompts, config)
        with pytest.raises(ValueError, match=r"holds row 'a' answering another prompt than p.jsonl now gives that id "
                                             r"\(from character 97: 'founding to its fall, said the scribe.' there"):
            check_prompt_texts([{"id": "a", "prompt": changed}], prompts, config)
        with pytest.raises(ValueError, match="answering another prompt"):  # a prompt lengthened since: no cut
            check_prompt_texts([{"id": "a", "prompt": prompt, "prompt_cut": False}],
                               [{"id": "a", "prompt": prompt + " Why?"}], config)
    # an older row (no prompt_cut) is a cut only where today's limit cuts the prompt so: a prompt lengthened since
    # kept its old answer
    with pytest.raises(ValueError, match="answering another prompt"):
        check_prompt_texts([{"id": "a", "prompt": prompt}], [{"id": "a", "prompt": prompt + " Why?"}],
                           DistillConfig(model=str(model_dir), prompts="p.jsonl", output="rows.jsonl"))
    # a cut decoded without a special token's text is no prefix of its prompt: kept at another limit too
    special = "What does <|im_end|> mean in a ChatML template? Rate it: x\U0002000b\U0002000b\U0001f600. " * 8
    config = DistillConfig(model=str(model_dir), prompts="p.jsonl", prompt_overflow="truncate", max_prompt_tokens=40)
    cut = prepare_prompt(tokenizer, special, config)[0]
    assert not special.startswith(cut.rstrip())
    for limit in (40, 60, None):
        check_prompt_texts([{"id": "a", "prompt": cut, "prompt_cut": True}], [{"id": "a", "prompt": special}],
                           dataclasses.replace(config, max_prompt_tokens=limit))
    for limit in range(30, 70):  # cuts ending among a character's bytes (decoded lengths do not grow there)
        found = prepare_prompt(tokenizer, special, dataclasses.replace(config, max_prompt_tokens=limit))
        if found is not None and found[0] != special:
            check_prompt_texts([{"id": "a", "prompt": found[0], "prompt_cut": True}], [{"id": "a", "prompt": special}],
                               dataclasses.replace(config, max_prompt_tokens=None))
    # a row that cannot be a cut is refused without loading the model; one that might be, with the load error
    gone = DistillConfig(model=str(tmp_path / "no-model"), prompts="p.jsonl", output="rows.jsonl")
    with pytest.raises(ValueError, match="answering another prompt"):
        check_prompt_texts([{"id": "a", "prompt": changed}], prompts, gone)
    with pytest.raises(ValueError, match=r"answering another prompt .* could not be checked"):
        check_prompt_texts([{"id": "a", "prompt": prompt[:30] + "!", "prompt_cut": True}], prompts, gone)


def test_rows_of_a_template_changed_since_are_refused_on_resume_and_in_training(tmp_path, model_dir, prompts_file,
                                                                               tokenizer):
    """The tokenizer's own template edited (or updated on the Hub) leaves the weights' identity as it was: a resumed
    run mixed answers to two renderings, and training put the new rendering before the old answers' ids."""
    from medusa_train.dataset import build_examples

    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    output = tmp_path / "rows.jsonl"
    distill(make_config(folder, prompts_file, output, n=2))
    rows = read_rows(output)
    assert all(row["prompt_template"] == distill_module.rendering_digest(tokenizer) is not None for row in rows)
    edited = load_tokenizer(str(folder))
    edited.chat_template = edited.chat_template.replace("You are a helpful AI assistant", "You are a pirate")
    assert edited.chat_template != tokenizer.chat_template
    edited.save_pretrained(folder)
    with pytest.raises(ValueError, match=r"row '[^']+' was distilled with its prompt rendered by chat template sha256:"
                                         r"\w+, and .* renders with sha256:\w+ now .* use another output path"):
        distill(make_config(folder, prompts_file, output, n=4))
    assert read_rows(output) == rows  # nothing answered to the new rendering
    assert len(build_examples(rows, tokenizer, 512)) == 2
    with pytest.raises(ValueError, match=r"distil the rows again with the template as it is now"):
        build_examples(rows, load_tokenizer(str(folder)), 512)
    # endpoint rows and an earlier release's record none: taken as they are
    assert len(build_examples([{k: v for k, v in row.items() if k != "prompt_template"} for row in rows],
                              load_tokenizer(str(folder)), 512)) == 2


def test_rows_written_before_templates_were_recorded_still_resume(tmp_path, model_dir, prompts_file):
    output = tmp_path / "rows.jsonl"
    distill(make_config(model_dir, prompts_file, output, n=2))
    rows = read_rows(output)
    for row in rows:
        del row["generation"]["chat_template"], row["generation"]["system_prompt"]
    output.write_text("".join(json.dumps(row) + "\n" for row in rows))
    distill(make_config(model_dir, prompts_file, output, n=3))
    assert [r["id"] for r in read_rows(output)][:2] == [r["id"] for r in rows]
    assert len(read_rows(output)) == 3


def test_sampling_option_is_reproducible(tmp_path, model_dir, prompts_file, reference_rows):
    rows = []
    for name in ("a", "b"):
        output = tmp_path / f"{name}.jsonl"
        distill(make_config(model_dir, prompts_file, output, n=4, do_sample=True, temperature=0.9, top_p=0.9))
        rows.append(read_rows(output))
    assert rows[0] == rows[1]
    assert [r["response"] for r in rows[0]] != [r["response"] for r in reference_rows[:4]]
    assert rows[0][0]["generation"]["do_sample"] is True and rows[0][0]["generation"]["top_p"] == 0.9


def test_sampling_settings_without_do_sample_are_refused(tmp_path, model_dir, prompts_file):
    """temperature and top_p without do_sample distilled greedily, the rows saying temperature 0 and the
    setting dropped without a word."""
    for given, says in (({"temperature": 1.3}, "temperature set"), ({"temperature": 1.3, "top_p": 0.8},
                                                                     "temperature and top_p set")):
        with pytest.raises(ValueError, match=f"{says} the sampling, but do_sample is off.*add do_sample"):
            make_config(model_dir, prompts_file, tmp_path / "x.jsonl", **given)
    sampled = make_config(model_dir, prompts_file, tmp_path / "x.jsonl", do_sample=True)
    assert (sampled.temperature, sampled.top_p) == (0.7, 1.0)  # sampling's defaults
    greedy = make_config(model_dir, prompts_file, tmp_path / "x.jsonl")
    assert greedy.generation_record()["temperature"] == 0.0 and greedy.generation_record()["top_p"] == 1.0


def test_long_prompts_skipped_or_truncated(tmp_path, model_dir, prompts_file, tokenizer, caplog):
    config = make_config(model_dir, prompts_file, tmp_path / "x.jsonl", max_prompt_tokens=40)
    long_prompt = "Tell me about " + " ".join(WORDS * 3)
    assert prepare_prompt(tokenizer, long_prompt, config) is None
    truncate = dataclasses.replace(config, prompt_overflow="truncate")
    text, ids = prepare_prompt(tokenizer, long_prompt, truncate)
    assert len(ids) <= 40 and long_prompt.startswith(text) and len(text) < len(long_prompt)
    # a cut inside a character's bytes keeps whole characters (the model would read a U+FFFD)
    japanese = "日本語のテキストを要約してください。" * 6
    for limit in range(30, 70):
        cut = prepare_prompt(tokenizer, japanese, dataclasses.replace(truncate, max_prompt_tokens=limit))
        assert cut is None or (japanese.startswith(cut[0]) and "\ufffd" not in cut[0]), (limit, cut and cut[0])
    # Through a whole run: the rendered prompts are 34 to 46 tokens long.
    prompts = sample_prompts(prompts_file, 12)
    lengths = [len(encode_rendered(tokenizer, render_prompt(tokenizer, p["prompt"]))) for p in prompts]
    too_long = sum(n > 40 for n in lengths)
    assert 0 < too_long < 12
    with caplog.at_level(logging.INFO, logger="medusa_train.distill"):
        distill(dataclasses.replace(config, n=12))
    assert len(read_rows(tmp_path / "x.jsonl")) == 12 - too_long
    assert f"{too_long} prompts over max_prompt_tokens=40 skipped" in caplog.text
    assert "rows written" in caplog.text and "tokens/s" in caplog.text


def test_plain_prompt_without_chat_template(tmp_path, model_dir, prompts_file, tokenizer, caplog):
    folder = tmp_path / "no-template"
    folder.mkdir()
    for file in model_dir.iterdir():
        if file.name != "chat_template.jinja":
            (folder / file.name).symlink_to(file)
    plain = load_tokenizer(str(folder))
    assert not plain.chat_template
    assert render_prompt(plain, "Hello there") == "Hello there"
    with pytest.raises(ValueError, match="system_prompt is set, but the tokenizer of .* has no chat template"):
        distill(make_config(folder, prompts_file, tmp_path / "rows.jsonl", n=2, system_prompt="Be brief."))
    # a template that wants a system message first, or takes none: said before the model loads, with the option
    # (jinja2's TemplateError was a traceback at the first batch)
    wants = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}"
             "{% endif %}{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    with pytest.raises(ValueError, match=r"wants a system message first \(a system message must come first\): give "
                                         r"system_prompt \(--system-prompt\)"):
        distill(make_config(folder, prompts_file, tmp_path / "rows.jsonl", n=2, chat_template=wants))
    refuses = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    with pytest.raises(ValueError, match=r"refuses a system message \(no system role\): leave system_prompt"):
        distill(make_config(folder, prompts_file, tmp_path / "rows.jsonl", n=2, chat_template=refuses + "{% endfor %}",
                            system_prompt="Be brief."))
    assert not (tmp_path / "rows.jsonl").exists()
    with caplog.at_level(logging.WARNING, logger="medusa_train.distill"):
        distill(make_config(folder, prompts_file, tmp_path / "rows.jsonl", n=2))
    # said as a warning, with what training makes of such rows (an info line; training then refused them with
    # advice to set the template, and under one, advice to set none: each message pointed at the other)
    assert "no chat template: prompts are given as plain text, and train_heads.py cannot train on such rows" \
        in caplog.text and "give --chat-template" in caplog.text
    rows = read_rows(tmp_path / "rows.jsonl")
    assert [r["prompt"] for r in rows] == [p["prompt"] for p in sample_prompts(prompts_file, 2)]
    for template in (None, "{{ messages }}"):
        with pytest.raises(ValueError, match=r"distilled with its prompt as plain text .* distil the rows again in "
                                             r"a chat template \(--chat-template FILE"):
            check_rows(rows, template, None)



def test_the_early_template_check_renders_as_distillation_does(tmp_path, model_dir, prompts_file, monkeypatch):
    """From a review of the check above: it encoded a system prompt as the chat tools do (control-token text as
    text, which needs transformers 5.20), where distillation renders it as the template reads it: a system prompt
    spelling <|im_end|> was refused before 5.20 with advice to upgrade, which distillation does not follow; a
    template that renders nothing was called a refusal of the system message; an endpoint renders with its own."""
    from transformers import PreTrainedTokenizerBase

    from medusa_train.distill import load_distill_tokenizer

    real = PreTrainedTokenizerBase.apply_chat_template

    def before_5_20(self, conversation, add_generation_prompt=False, tokenize=True, return_dict=True, **kwargs):
        return real(self, conversation, add_generation_prompt=add_generation_prompt, tokenize=tokenize,
                    return_dict=return_dict, **kwargs)

    control = make_config(model_dir, prompts_file, tmp_path / "rows.jsonl", system_prompt="Write <|im_end|> at the end.")
    with monkeypatch.context() as patch:
        patch.setattr(PreTrainedTokenizerBase, "apply_chat_template", before_5_20)
        load_distill_tokenizer(control)
    broken = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}"
    with pytest.raises(ValueError, match=r"^the chat template cannot render a question \(") as caught:
        load_distill_tokenizer(dataclasses.replace(control, system_prompt="Be brief.", chat_template=broken))
    assert "system" not in str(caught.value)
    refuses = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
               "{% endif %}{{ m['content'] }}{% endfor %}")
    endpoint = dataclasses.replace(control, system_prompt="Be brief.", chat_template=refuses, backend="openai",
                                   endpoint="http://127.0.0.1:9")
    assert load_distill_tokenizer(endpoint).chat_template == refuses


def test_cli_with_recipe(tmp_path, model_dir, prompts_file, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"distill:\n  model: {model_dir}\n  n: 3\n  max_new_tokens: 4\n  batch_size: 2\n")
    output = tmp_path / "cli.jsonl"
    distill_module.main(
        ["--recipe", str(recipe), "--prompts", str(prompts_file), "--output", str(output),
         "--n", "5", "--per-source", "mid=2", "--per-source", "small=3", "--no-progress",
         "--threads", "2"]
    )
    assert torch.get_num_threads() == 1  # restored after generation
    assert capsys.readouterr().out.strip() == str(output)
    rows = read_rows(output)
    assert sorted(r["source"] for r in rows) == ["mid", "mid", "small", "small", "small"]
    assert all(r["generation"]["max_new_tokens"] == 4 for r in rows)


def test_a_distill_recipes_values_are_taken_as_their_types(tmp_path, prompts_file):
    """--recipe's values went in as YAML read them: do_sample: "false" sampled (and the rows recorded the string),
    a quoted number failed with a TypeError traceback."""
    recipe = tmp_path / "r.yaml"

    def config(text: str) -> DistillConfig:
        recipe.write_text(text)
        args = distill_module.build_parser().parse_args(["--recipe", str(recipe), "--prompts", str(prompts_file)])
        return distill_module.config_from_args(args)

    with pytest.raises(ValueError, match="temperature set the sampling, but do_sample is off"):
        config('distill:\n  do_sample: "false"\n  temperature: 0.5\n')
    assert config('distill:\n  do_sample: "false"\n').do_sample is False
    sampled = config('distill:\n  do_sample: "true"\n  temperature: "0.5"\n  n: "4"\n')
    assert (sampled.do_sample, sampled.temperature, sampled.n) == (True, 0.5, 4)
    with pytest.raises(ValueError, match="r.yaml: n"):
        config("distill:\n  n: many\n")
    with pytest.raises(ValueError, match="unknown distill settings"):
        config("distill:\n  temprature: 0.5\n")
    assert config('distill:\n  chat_template: ""\n').chat_template is None  # the tokenizer's own, as on the command line


def test_a_setting_only_the_other_backend_reads_is_refused(tmp_path):
    """The local backend took concurrency, max_retries, request_timeout_s, retry_backoff_s and api_key_env, the
    openai one threads and device, and read none of them."""
    with pytest.raises(ValueError, match=r"concurrency=64, max_retries=9: read by backend 'openai' only, and the "
                                         r"backend is 'local': add --backend openai"):
        DistillConfig(prompts="p.jsonl", concurrency=64, max_retries=9)
    with pytest.raises(ValueError, match=r"api_key_env='NOPE': read by backend 'openai'"):
        DistillConfig(prompts="p.jsonl", api_key_env="NOPE")
    with pytest.raises(ValueError, match=r"device='cuda:3', threads=4: read by backend 'local' only, and the backend "
                                         r"is 'openai': drop them"):
        DistillConfig(prompts="p.jsonl", backend="openai", endpoint="http://127.0.0.1:9", threads=4, device="cuda:3")
    DistillConfig(prompts="p.jsonl", threads=2, device="cpu")  # each backend's own
    DistillConfig(prompts="p.jsonl", backend="openai", endpoint="http://127.0.0.1:9", concurrency=2, max_retries=0)


# ---------------------------------------------------------------------------------------------
# OpenAI-compatible backend against a loopback server


class FakeServer:
    """A chat-completions server on 127.0.0.1 answering canned completions.

    The first request for each prompt in ``flaky`` gets a 503; prompts containing "forbidden" get
    a 400 (not retried). It records every request body, headers and the peak concurrency.
    """

    def __init__(self, flaky: set[str] = frozenset()):
        self.flaky = set(flaky)
        self.down: tuple[int, dict] | None = None  # a status and body every request gets, once set
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.times: list[float] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                with server.lock:
                    server.in_flight += 1
                    server.peak = max(server.peak, server.in_flight)
                self.counted = True
                try:
                    self.answer()
                finally:
                    self.uncount()

            def uncount(self):  # before the reply is written: the client's next request may come as it is read
                if self.counted:
                    self.counted = False
                    with server.lock:
                        server.in_flight -= 1

            def answer(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][-1]["content"]
                with server.lock:
                    server.requests.append(body)
                    server.headers.append(dict(self.headers))
                    server.times.append(time.monotonic())
                    fail = prompt in server.flaky
                    server.flaky.discard(prompt)
                if self.path == "/old/v1/chat/completions":  # moved: urllib follows no redirect of a POST
                    return self.reply(308, {}, headers={"Location": "/v1/chat/completions"})
                if self.path == "/older/v1/chat/completions":  # a 301: urllib re-sent the POST as a GET, bodiless
                    return self.reply(301, {}, headers={"Location": "/v1/chat/completions"})
                if self.path != "/v1/chat/completions":
                    return self.reply(404, {"error": "not found"})
                if server.down is not None:
                    return self.reply(*server.down)
                if fail:
                    return self.reply(503, {"error": "overloaded"})
                if "forbidden" in prompt:
                    return self.reply(400, {"error": "bad prompt"})
                if "garbled" in prompt and server.requests.count(body) == 1:  # bytes that are no text, once
                    return self.reply(200, None, b"\xff\xfe\x00\xd8garbage")
                first = server.requests.count(body) == 1
                if "throttled" in prompt and first:  # asks for 1 s, far more than the test's backoff
                    return self.reply(429, {"error": "slow down"}, headers={"Retry-After": "1"})
                if "stalled" in prompt:  # busy for good, asking for a minute each time
                    return self.reply(429, {"error": "busy"}, headers={"Retry-After": "60"})
                if "late" in prompt and first:  # the server timed the request out
                    return self.reply(408, {"error": "request timeout"})
                if "dropped" in prompt and first:  # a 503 whose body never arrives whole
                    return self.reply(503, None, b"{}", length=1000)
                if "surrogate" in prompt:  # JSON's escape of a lone surrogate: valid JSON, no text
                    return self.reply(200, None, json.dumps({"choices": [{"finish_reason": "stop", "message": {
                        "role": "assistant", "content": "bad \udc80"}}]}).encode())
                if "moderated" in prompt:  # a provider's moderation: a 403 for this prompt alone
                    return self.reply(403, {"error": "your input was flagged"})
                if "twice" in prompt:  # two choices, the second first (the row took its text)
                    return self.reply(200, {"choices": [
                        {"index": 1, "finish_reason": "stop", "message": {"role": "assistant", "content": "second"}},
                        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "first"}}]})
                if "odd finish" in prompt:  # (a TypeError ended the whole run)
                    return self.reply(200, {"choices": [{"index": 0, "finish_reason": {"type": "stop"},
                                                         "message": {"role": "assistant", "content": "x"}}]})
                if "parts" in prompt:  # content as a list of parts (was called a lone surrogate)
                    return self.reply(200, {"choices": [{"index": 0, "finish_reason": "stop", "message": {
                        "role": "assistant", "content": [{"type": "text", "text": "x"}]}}]})
                if "reasoning" in prompt:  # vLLM's reasoning parser, cut while the model still reasoned
                    return self.reply(200, {"choices": [{"index": 0, "finish_reason": "length",
                                                         "message": {"role": "assistant", "content": None}}]})
                words = prompt.split()
                finish = "content_filter" if "filtered" in prompt else "length" if len(words) > 8 else "stop"
                usage = {} if "uncounted" in prompt else {"usage": "n/a"} if "garbled usage" in prompt else {
                    "usage": {"prompt_tokens": len(words), "completion_tokens": len(words)}}
                self.reply(200, {
                    "id": "cmpl-1", "object": "chat.completion",
                    "model": "some-other-model" if "elsewhere" in prompt else body["model"],  # TGI's way
                    "choices": [{"index": 0, "finish_reason": finish,
                                 "message": {"role": "assistant", "content": f"Answer: {words[-1]}"}}],
                    **usage,
                })

            def reply(self, status, payload, raw=None, headers=None, length=None):
                self.uncount()
                data = raw if raw is not None else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(length or len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def openai_config(prompts_file: Path, output: Path, url: str, **overrides) -> DistillConfig:
    settings = dict(
        backend="openai", endpoint=url, endpoint_model="served-model", prompts=str(prompts_file),
        output=str(output), n=12, batch_size=4, concurrency=3, max_prompt_tokens=None,
        retry_backoff_s=0.001, progress=False, api_key_env="MEDUSA_TEST_KEY",
    )
    return DistillConfig(**{**settings, **overrides})


def test_openai_backend_rows_retries_and_resume(tmp_path, prompts_file, monkeypatch):
    monkeypatch.setenv("MEDUSA_TEST_KEY", "secret")
    prompts = sample_prompts(prompts_file, 12)
    output = tmp_path / "rows.jsonl"
    with FakeServer(flaky={p["prompt"] for p in prompts[:5]}) as server:
        config = openai_config(prompts_file, output, server.url + "/v1")

        def stop(batch_index, rows):
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            distill(config, on_batch=stop)
        written = {r["prompt"] for r in read_rows(shard_path(output, 0))}
        assert len(written) >= 4
        asked_before = len(server.requests)
        distill(config)
        asked_after = [b["messages"][-1]["content"] for b in server.requests[asked_before:]]
        asked = [b["messages"][-1]["content"] for b in server.requests]
    rows = read_rows(output)
    assert [r["id"] for r in rows] == [p["id"] for p in prompts]
    for row, prompt in zip(rows, prompts):
        words = prompt["prompt"].split()
        assert set(row) == ROW_KEYS and row["model"] == "served-model"
        assert row["response"] == f"Answer: {words[-1]}"
        assert row["finish_reason"] == ("length" if len(words) > 8 else "eos")
        # the server's count (the fake's: a word a token), whose end token the rows do not count
        assert row["response_tokens"] == (len(words) if len(words) > 8 else len(words) - 1)
    body = server.requests[0]
    assert body["model"] == "served-model" and body["max_tokens"] == 256
    assert body["temperature"] == 0.0 and body["messages"] == [{"role": "user", "content": body["messages"][0]["content"]}]
    assert all(h["Authorization"] == "Bearer secret" for h in server.headers)
    assert 1 <= server.peak <= 3
    # each prompt its own seed (one for all: sampled answers drawn from the same random stream),
    # the same one when it is asked again
    seeds: dict[str, set] = {}
    for request in server.requests:
        seeds.setdefault(request["messages"][-1]["content"], set()).add(request["seed"])
    assert all(len(s) == 1 for s in seeds.values()) and len(set.union(*seeds.values())) == len(seeds)
    # Flaky prompts were retried after their 503; rows written before the stop were not asked
    # for again (requests in flight at the stop are, as their answers were never written).
    assert all(asked.count(p["prompt"]) >= 2 for p in prompts[:5])
    assert not written & set(asked_after)
    assert set(asked_after) | written == {p["prompt"] for p in prompts}


def test_a_stopped_openai_run_leaves_no_request_waiting_to_retry(tmp_path):
    """Stopped (Ctrl-C, a failed batch), the run's requests waiting out a Retry-After give up at once: their
    threads would otherwise keep the process alive at exit for up to their whole retry budget."""
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": str(i), "source": "s", "prompt": p}) + "\n"
                                    for i, p in enumerate(["stalled reply", "hello there", "good day"])))
    before = set(threading.enumerate())
    workers: list[threading.Thread] = []

    def stop(batch_index, rows):  # the request threads the run started, then the stop
        workers.extend(t for t in threading.enumerate() if t not in before and t.name == "distill-request")
        raise KeyboardInterrupt

    with FakeServer() as server:
        config = openai_config(prompts_file, tmp_path / "rows.jsonl", server.url, n=None, batch_size=1,
                               concurrency=2, max_retries=5)
        with pytest.raises(KeyboardInterrupt):
            distill(config, on_batch=stop)
        assert workers and all(worker.daemon for worker in workers)  # (an executor's were joined at exit: Ctrl-C
        for worker in workers:  # left the process waiting on the requests in flight)
            worker.join(timeout=10)
        assert not [t.name for t in workers if t.is_alive()]
        assert [b["messages"][-1]["content"] for b in server.requests].count("stalled reply") >= 1


def test_openai_backend_prompts_the_endpoint_refuses_are_left_out_and_counted(tmp_path, caplog, model_dir):
    """A 400 for one prompt (say, over the server's context), a content filter's finish or an answer that
    is no UTF-8 text (a lone surrogate) is that prompt's answer for good: not retried, logged and counted,
    and the other rows are merged, so that a training run gets past its data. A reply that is no text is
    retried, as are a 408, a 503 whose body breaks off, and a 429 after the wait its Retry-After asks for; one
    without usage is counted by the tokenizer."""
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(
        "".join(json.dumps({"id": str(i), "source": "s", "prompt": p}) + "\n"
                for i, p in enumerate(["hello there", "forbidden words", "good day", "filtered words",
                                       "garbled reply", "uncounted reply", "throttled reply", "dropped reply",
                                       "surrogate reply", "late reply", "elsewhere reply"]))
    )
    output = tmp_path / "rows.jsonl"
    with FakeServer() as server, caplog.at_level(logging.INFO, logger="medusa_train.distill"):
        config = openai_config(prompts_file, output, server.url, n=None, max_retries=3, model=str(model_dir))
        distill(config)
        asked = [b["messages"][-1]["content"] for b in server.requests]
        throttled = [t for b, t in zip(server.requests, server.times) if b["messages"][-1]["content"] == "throttled reply"]
    assert asked.count("forbidden words") == asked.count("filtered words") == asked.count("surrogate reply") == 1
    assert asked.count("garbled reply") == asked.count("dropped reply") == asked.count("throttled reply") == 2
    assert asked.count("late reply") == 2
    assert throttled[1] - throttled[0] >= 0.9  # Retry-After: 1, where the backoff alone is 1 ms
    rows = {r["id"]: r for r in read_rows(output)}
    assert sorted(rows) == ["0", "10", "2", "4", "5", "6", "7", "9"]
    # an endpoint answering as another model (TGI, llama.cpp serve whatever they hold): kept and said
    assert rows["10"]["served_model"] == "some-other-model" and "served_model" not in rows["0"]
    assert "the endpoint answers as 'some-other-model'" in caplog.text
    assert rows["5"]["response_tokens"] == len(load_tokenizer(str(model_dir))("Answer: reply",
                                                                           add_special_tokens=False)["input_ids"])
    assert "refused by the endpoint 3" in caplog.text and "finish_reason 'content_filter'" in caplog.text
    assert "the answer is not UTF-8 text (a lone surrogate)" in caplog.text


def test_a_refusal_written_after_a_half_written_one_is_kept_and_the_file_stays_readable(tmp_path, prompts_file):
    """A refusal cut short (a full disk, a kill) left half a line: the next refusal was glued onto it (lost without
    a word), and once one more followed, every run stopped on the file ("damaged beyond a killed write")."""
    config = openai_config(prompts_file, tmp_path / "rows.jsonl", "http://127.0.0.1:9")
    prompts = sample_prompts(prompts_file, 4)
    distill_module.record_refusal(config, 0, prompts[0], "HTTP 400")
    path = distill_module.refusals_path(config.output, 0)
    with path.open("a", encoding="utf-8") as handle:
        handle.write('{"id": "' + prompts[1]["id"] + '", "rea')
    for prompt in prompts[2:]:
        distill_module.record_refusal(config, 0, prompt, "HTTP 400")
    assert distill_module.refused_ids(config, prompts) == {prompts[0]["id"], prompts[2]["id"], prompts[3]["id"]}
    assert len(path.read_text().splitlines()) == 3


def test_openai_backend_stops_on_a_wrong_endpoint(tmp_path, prompts_file):
    with FakeServer() as server:
        config = openai_config(prompts_file, tmp_path / "rows.jsonl", server.url + "/v2/chat/completions", n=2)
        # the endpoint's fault, not a prompt's: said at once with what to check (it advised exclude_ids)
        with pytest.raises(RuntimeError, match=r"HTTP 404 .*check endpoint \(the server's root or its /v1 base"):
            distill(config)


@pytest.mark.parametrize("path, code", [("/old", 308), ("/older", 301)])
def test_openai_backend_stops_on_a_moved_endpoint(tmp_path, prompts_file, path, code):
    """A redirect is about the endpoint, not the prompt: every prompt was left out as refused and
    the run ended with an empty file. urllib followed a 301 with a bodiless GET, and the run reported the new
    address's 405."""
    with FakeServer() as server:
        config = openai_config(prompts_file, tmp_path / "rows.jsonl", server.url + path, n=2)
        with pytest.raises(RuntimeError, match=f"HTTP {code}.*moved to '/v1/chat/completions'"):
            distill(config)


class _Reply:
    """A response whose body read fails as a TLS connection cut mid-reply fails."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read(self):
        raise ssl.SSLError("EOF occurred in violation of protocol")


@pytest.mark.parametrize("failure, expected", [
    (lambda: _Reply(), distill_module.RetryableError),  # it stopped the run, not retried like a reset
    (lambda: (_ for _ in ()).throw(urllib.error.URLError(ssl.SSLCertVerificationError("self-signed"))),
     RuntimeError),  # was retried: the same refusal each time, backing off for minutes
], ids=["body-cut", "certificate-refused"])
def test_tls_failures_are_retried_only_when_asking_again_can_help(monkeypatch, failure, expected):
    monkeypatch.setattr(distill_module._NO_REDIRECTS, "open", lambda request, timeout: failure())
    with pytest.raises(expected) as raised:
        distill_module.post_json("https://example.invalid/v1/chat/completions", {}, {}, timeout=1.0)
    assert (type(raised.value) is RuntimeError) == (expected is RuntimeError)
    if expected is RuntimeError:
        assert "certificate was refused" in str(raised.value) and "SSL_CERT_FILE" in str(raised.value)


def test_openai_backend_sends_top_p_only_below_one_and_takes_no_reply_without_an_answer(tmp_path, caplog):
    """TGI refuses top_p=1.0 (it must lie in (0, 1)), which every request carried, greedy ones included: every
    prompt was refused. A reply of no content (vLLM's reasoning parser cut short) was written as an empty answer,
    and a malformed usage stopped the run with an AttributeError."""
    prompts_file = tmp_path / "prompts.jsonl"
    texts = ["hello there", "some reasoning here", "garbled usage words"]
    prompts_file.write_text("".join(json.dumps({"id": str(i), "source": "s", "prompt": text}) + "\n"
                                    for i, text in enumerate(texts)))
    with FakeServer() as server:
        distill(openai_config(prompts_file, tmp_path / "greedy.jsonl", server.url, n=None))
        assert all("top_p" not in body for body in server.requests)
        sampled = openai_config(prompts_file, tmp_path / "sampled.jsonl", server.url, n=None, do_sample=True,
                                temperature=0.7, top_p=0.9)
        asked = len(server.requests)
        distill(sampled)
        assert {body["top_p"] for body in server.requests[asked:]} == {0.9}
    rows = read_rows(tmp_path / "greedy.jsonl")
    assert [row["id"] for row in rows] == ["0", "2"]  # no row for the reply without an answer
    assert rows[1]["response"] == "Answer: words" and rows[1]["response_tokens"] > 0  # counted by the tokenizer


def test_openai_backend_gives_up_on_dead_server(tmp_path, prompts_file):
    with FakeServer() as server:
        url = server.url
    config = openai_config(prompts_file, tmp_path / "rows.jsonl", url, n=2, max_retries=2)
    with pytest.raises(RuntimeError, match="giving up after 3 attempts"):
        distill(config)
    # with more prompts than requests in flight, the run stops once that many failed in a row: every prompt
    # waited out its own retries first (a dead server took hours to report on a large sample)
    config = openai_config(prompts_file, tmp_path / "rows.jsonl", url, n=12, max_retries=1, concurrency=3)
    with pytest.raises(RuntimeError, match=r"failed; after 3 failures in a row the other [1-9]\d* were not asked "
                                           r"\(the endpoint looks down\).*giving up after 2 attempts"):
        distill(config)


def test_openai_backend_fails_when_the_endpoint_refuses_every_prompt(tmp_path, caplog):
    """Every prompt refused (a 400 for each: say max_new_tokens past the served model's context) is a
    setting's fault, not the prompts': the run fails saying so (it ended with an empty rows file, and
    training then blamed data.max_length)."""
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": str(i), "source": "s", "prompt": f"forbidden words {i}"}) + "\n"
                                    for i in range(3)))
    with FakeServer() as server:
        config = openai_config(prompts_file, tmp_path / "rows.jsonl", server.url, n=None)
        with pytest.raises(RuntimeError, match=r"the endpoint refused all 3 prompts and no row was written before; "
                                               r"first: \d: HTTP 400.*max_new_tokens past the served model's context"):
            distill(config)
        assert not list(tmp_path.glob("rows.jsonl.refused.*"))  # (all refused: asked again once fixed)
        # beside rows an earlier run wrote, the prompts it had refused are asked again, refused again, and
        # the run goes on (it failed: a recipe with one refused prompt could never be run a second time)
        with prompts_file.open("a") as handle:
            handle.write(json.dumps({"id": "ok", "source": "s", "prompt": "hello there"}) + "\n")
        distill(config)  # one answered, three refused: recorded
        asked = len(server.requests)
        with caplog.at_level(logging.WARNING, logger="medusa_train.distill"):
            distill(config)  # not asked again: a finished run's rerun failed on them with its endpoint stopped
        assert len(server.requests) == asked
        assert "3 prompts the endpoint refused before are not asked again" in caplog.text
        from medusa_train.distill import pending_prompts

        assert pending_prompts(config) == (4, 0)  # (train_heads.py's plan: nothing to distil)
        for path in tmp_path.glob("rows.jsonl.refused.*"):  # deleted: asked again, refused again, said
            path.unlink()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="medusa_train.distill"):
            distill(config)
    assert [row["id"] for row in read_rows(tmp_path / "rows.jsonl")] == ["ok"]
    assert "the endpoint refused all 3 prompts asked" in caplog.text and "the 1 rows already there are kept" in caplog.text
    # all of them refused beside earlier rows (a parameter every request carries): not recorded, so that a rerun
    # once it is fixed asks them (they were recorded, and the rerun asked nothing)
    assert "fix that and run again: they are asked again" in caplog.text
    assert not list(tmp_path.glob("rows.jsonl.refused.*"))


def test_openai_backend_stops_on_a_key_or_model_name_gone_wrong_after_answers(tmp_path, caplog):
    """A 401 (a key revoked) or a 404 (a server restarted under another model name) after an answer was taken for
    that prompt's refusal, as a moderation's 403 is: every later prompt was recorded refused, the run passed, and a
    rerun once fixed asked nothing. So were 403s to every later prompt (a key expired): past 5 in a row they stop the
    run, unrecorded."""
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": str(i), "source": "s", "prompt": f"hello {i}"}) + "\n"
                                    for i in range(8)))
    for status, body in ((401, {"error": {"message": "Incorrect API key provided"}}),
                         (404, {"error": {"message": "The model does not exist"}}),
                         (403, {"error": {"message": "key expired"}})):
        rows = tmp_path / f"rows-{status}.jsonl"
        with FakeServer() as server:
            config = openai_config(prompts_file, rows, server.url, n=None, concurrency=1)
            original, armed = distill_module.request_completion, [True]

            def then_down(*args, **kwargs):
                reply = original(*args, **kwargs)
                if armed:  # after the first answer: the key or the model name gone (once: a request the failed run
                    armed.clear()  # abandoned in flight may be answered after the fix below)
                    server.down = (status, body)
                return reply

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(distill_module, "request_completion", then_down)
                with pytest.raises(distill_module.DistillError, match=f"HTTP {status} from .*rows written so far are "
                                                                      "kept" if status != 403 else
                                   "the endpoint answered HTTP 403 to 5 prompts in a row after answering others: a "
                                   "key that expired .* not recorded as refused"):
                    distill(config)
            assert not list(tmp_path.glob(f"rows-{status}.jsonl.refused.*"))
            assert [len(read_rows(kept)) for kept in tmp_path.glob(f"rows-{status}.jsonl.rank*")] == [1]
            server.down = None
            distill(config)  # fixed: every prompt asked
            assert sorted(row["id"] for row in read_rows(rows)) == [str(i) for i in range(8)]


def test_a_403_streak_reached_among_replies_of_one_wake_up_records_none_of_them(tmp_path, monkeypatch):
    """With requests in flight together, the 403s that came in the same wake-up after the streak reached its limit
    were recorded as those prompts' refusals (the run had stopped for the key): a rerun once fixed skipped them."""
    import concurrent.futures

    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": str(i), "source": "s", "prompt": f"hello {i}"}) + "\n"
                                    for i in range(10)))
    # the replies of both requests in flight come in one wake-up (a main thread slower than the endpoint)
    monkeypatch.setattr(distill_module, "wait", lambda futures, return_when=None: concurrent.futures.wait(
        futures, return_when=concurrent.futures.ALL_COMPLETED))
    rows = tmp_path / "rows.jsonl"
    with FakeServer() as server:
        config = openai_config(prompts_file, rows, server.url, n=None, concurrency=2)
        original, answered = distill_module.request_completion, []

        def then_expired(*args, **kwargs):
            reply = original(*args, **kwargs)
            answered.append(reply)
            if len(answered) == 2:  # the first wake-up's two answers, then the key expires
                server.down = (403, {"error": {"message": "key expired"}})
            return reply

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(distill_module, "request_completion", then_expired)
            with pytest.raises(distill_module.DistillError, match="403 to 5 prompts in a row"):
                distill(config)
        assert not list(tmp_path.glob("rows.jsonl.refused.*"))  # (the sixth 403, of the fifth's wake-up, was)
        server.down = None
        distill(config)
    assert sorted(row["id"] for row in read_rows(rows)) == [str(i) for i in range(10)]


def test_openai_backend_refusals_with_no_answer_are_not_recorded_and_a_first_403_names_exclude_ids(tmp_path):
    """Refusals in a run that answered nothing (the others failed: an endpoint refusing for a setting, then down)
    were recorded, and a rerun once fixed skipped them; a 403 before any answer (a moderated prompt left alone to a
    rerun) failed every rerun blaming the key, naming no way to leave the prompt out."""
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": p, "source": "s", "prompt": p}) + "\n"
                                    for p in ("refused", "failed")))
    config = openai_config(prompts_file, tmp_path / "rows.jsonl", "http://127.0.0.1:9/v1", n=None, concurrency=1)

    def reply(url, body, *args, **kwargs):
        if body["messages"][-1]["content"] == "refused":
            raise RejectedError("HTTP 400: max_tokens too large")
        raise RuntimeError("connection refused")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(distill_module, "request_completion", reply)
        with pytest.raises(distill_module.DistillError, match="1 of 2 requests failed"):
            distill(config)
    assert not list(tmp_path.glob("rows.jsonl.refused.*"))
    with FakeServer() as server:
        prompts_file.write_text(json.dumps({"id": "2", "source": "s", "prompt": "moderated words"}) + "\n")
        config = openai_config(prompts_file, tmp_path / "moderated.jsonl", server.url, n=None)
        with pytest.raises(distill_module.DistillError, match=r"HTTP 403 .*; where the endpoint answers other prompts, "
                                                              r"a 403 is this prompt's own refusal \(a provider's "
                                                              r"moderation\): leave it out with exclude_ids=\['2'\]"):
            distill(config)


# ---------------------------------------------------------------------------------------------
# Chat template override

VICUNA_LIKE = (
    "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def test_chat_template_option_renders_prompts(tmp_path, model_dir, prompts_file, tokenizer, monkeypatch):
    seen: list[list[int]] = []
    generate = distill_module.generate_batch

    def spy(model, tok, prompt_ids, config, eos_ids, *rest):
        seen.extend(list(ids) for ids in prompt_ids)
        return generate(model, tok, prompt_ids, config, eos_ids, *rest)

    monkeypatch.setattr(distill_module, "generate_batch", spy)
    config = make_config(model_dir, prompts_file, tmp_path / "rows.jsonl", n=2, max_new_tokens=2,
                         chat_template=VICUNA_LIKE)
    distill(config)
    expected = [
        tokenizer(f"USER: {p['prompt']}\nASSISTANT:", add_special_tokens=False)["input_ids"]
        for p in sample_prompts(prompts_file, 2)
    ]
    assert sorted(seen) == sorted(expected)
    own = encode_rendered(tokenizer, render_prompt(tokenizer, sample_prompts(prompts_file, 1)[0]["prompt"]))
    assert own not in seen, "without the option the tokenizer's own template renders the prompt"


def test_endpoint_rows_count_and_cut_answers_as_the_local_backend_does(tokenizer):
    """An endpoint's `completion_tokens` counts the end token (vLLM, OpenAI, medusa-serve), which the local
    backend's `response_tokens` leaves out: every row that ended at it counted one more. An answer cut at the
    token limit inside a character ended in U+FFFD, which the local backend drops (`answer_text`)."""
    config = DistillConfig(prompts="p.jsonl", backend="openai", endpoint="http://127.0.0.1:1", progress=False)
    prompt = {"id": "1", "source": "s", "prompt": "hi"}

    def reply(content, finish, usage):
        return {"choices": [{"finish_reason": finish, "message": {"role": "assistant", "content": content}}],
                **({"usage": {"completion_tokens": usage}} if usage is not None else {})}

    ended = distill_module.completion_row(prompt, "hi", reply("The sea.", "stop", 4), config, lambda: tokenizer)
    assert (ended["finish_reason"], ended["response_tokens"]) == ("eos", 3)
    cut = distill_module.completion_row(prompt, "hi", reply("The sea \ufffd", "length", 5), config, lambda: tokenizer)
    assert (cut["response"], cut["finish_reason"]) == ("The sea ", "length")
    assert cut["response_tokens"] == len(tokenizer("The sea ", add_special_tokens=False)["input_ids"])
    whole = distill_module.completion_row(prompt, "hi", reply("The sea", "length", 5), config, lambda: tokenizer)
    assert (whole["response"], whole["response_tokens"]) == ("The sea", 5)  # the limit: no end token to count
    uncounted = distill_module.completion_row(prompt, "hi", reply("The sea.", "stop", None), config, lambda: tokenizer)
    assert uncounted["response_tokens"] == len(tokenizer("The sea.", add_special_tokens=False)["input_ids"])
    # cut at the limit with every token stripped (special ones, reasoning_content's): an empty target that counted
    # 256 tokens; an empty answer that ended is one
    for blank in ("", "  "):
        with pytest.raises(distill_module.RejectedError, match=r"holds no answer \(content '\s*', finish_reason "
                                                               r"'length'\)"):
            distill_module.completion_row(prompt, "hi", reply(blank, "length", 256), config, lambda: tokenizer)
    ended_empty = distill_module.completion_row(prompt, "hi", reply("", "stop", 1), config, lambda: tokenizer)
    assert ended_empty["response"] == ""


@pytest.mark.parametrize("setting, message", [
    (dict(max_retries=-1), "max_retries must be >= 0 (0: ask once), got -1"),
    (dict(request_timeout_s=0), "request_timeout_s must be > 0 seconds, got 0"),
    (dict(retry_backoff_s=-1.0), "retry_backoff_s must be >= 0 seconds, got -1.0"),
    (dict(chat_template="templates/vicuna_v1.1.jinja"), "has no {{ or {%, so it is no template"),
    # an empty system message: rows no recipe could train on (data.system_prompt takes none), nor a datastore use
    (dict(system_prompt=""), "system_prompt is empty: give text, or leave it out"),
])
def test_settings_that_would_fail_every_request_or_render_every_prompt_alike_are_refused(setting, message):
    """max_retries=-1 ended in AssertionError("unreachable"), a timeout of 0 failed every request after 31 s
    of retries with a "connection in progress" error, and a mistyped --chat-template path became the
    template itself: every prompt rendered as that path's text, without a word."""
    with pytest.raises(ValueError, match=re.escape(message)):
        DistillConfig(prompts="p.jsonl", backend="openai", endpoint="http://127.0.0.1:1", **setting)
    flags = {"max_retries": "--max-retries", "chat_template": "--chat-template",
             "system_prompt": "--system-prompt"}  # the command line's
    for name, value in setting.items():
        if name in flags:
            with pytest.raises(ValueError, match=re.escape(message)):
                config_from_args(build_parser().parse_args(["--prompts", "p.jsonl", flags[name], str(value)]))


def test_endpoint_settings_without_the_endpoint_backend_are_refused(capsys):
    """`--endpoint URL` without `--backend openai`: the local model answered, exit 0, the rows labelled with it
    (a 7B model loaded for a server's work); a bad --log-level ended in a traceback."""
    for given in ({"endpoint": "http://127.0.0.1:8000"}, {"endpoint_model": "served"}):
        with pytest.raises(ValueError, match=r"endpoint and endpoint_model are read by backend 'openai', and the "
                                             r"backend is 'local': add --backend openai"):
            DistillConfig(prompts="p.jsonl", **given)
    with pytest.raises(ValueError, match="are read by backend 'openai'"):
        config_from_args(build_parser().parse_args(["--prompts", "p.jsonl", "--endpoint", "http://127.0.0.1:9"]))
    assert DistillConfig(prompts="p.jsonl", backend="openai", endpoint="http://127.0.0.1:9").endpoint
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--prompts", "p.jsonl", "--log-level", "verbose"])
    assert exit_info.value.code == 2 and "--log-level: invalid choice: 'VERBOSE'" in capsys.readouterr().err
    assert build_parser().parse_args(["--prompts", "p.jsonl", "--log-level", "debug"]).log_level == "DEBUG"


def test_chat_template_flag_takes_a_file_or_the_template(tmp_path, prompts_file):
    template_file = tmp_path / "vicuna.jinja"
    template_file.write_text(VICUNA_LIKE)
    parser = build_parser()
    for given in (str(template_file), VICUNA_LIKE):
        args = parser.parse_args(["--prompts", str(prompts_file), "--chat-template", given])
        assert config_from_args(args).chat_template == VICUNA_LIKE
    long = VICUNA_LIKE.replace("{% for", "{# " + "x" * 300 + " #}{% for", 1)  # no path is that long
    args = parser.parse_args(["--prompts", str(prompts_file), "--chat-template", long])
    assert config_from_args(args).chat_template == long
    assert config_from_args(parser.parse_args(["--prompts", str(prompts_file)])).chat_template is None
    # '' is the tokenizer's own, as the datastore builder takes it: rows recorded a digest of '' and training refused
    args = parser.parse_args(["--prompts", str(prompts_file), "--chat-template", ""])
    config = config_from_args(args)
    assert config.chat_template is None and config.generation_record()["chat_template"] is None
    # rows an earlier release recorded so (the digest of '') resume, and train, as the tokenizer's own template's
    old = {"id": "x", "model": config.model_label, "generation": {**config.generation_record(),
                                                                  "chat_template": distill_module.template_digest("")}}
    distill_module.check_resumable([old], config)
    check_rows([old], None, None)
    # an empty distill section of a recipe, and ids rows without an id, were tracebacks
    (tmp_path / "r.yaml").write_text("distill:\n")
    with pytest.raises(ValueError, match=r"r.yaml: its distill section must be a mapping of settings, got None"):
        config_from_args(parser.parse_args(["--recipe", str(tmp_path / "r.yaml")]))
    (tmp_path / "ex.jsonl").write_text('{"id": "a"}\n{"prompt": "held out"}\n')
    with pytest.raises(ValueError, match=r"ex.jsonl:2 is a JSON row without an 'id' key"):
        config_from_args(parser.parse_args(["--prompts", str(prompts_file), "--exclude-ids",
                                            str(tmp_path / "ex.jsonl")]))


def test_answers_are_generated_on_decodings_attention_kernels(tmp_path, model_dir, prompts_file, monkeypatch):
    """Self-distillation is the largest decoding job: every attention call of its ``generate``
    runs inside ``attention_kernels.decoding_attention`` (no per-length cuDNN plans on a GPU)."""
    import contextlib

    state = {"inside": 0, "devices": [], "attention": 0, "outside": 0}

    @contextlib.contextmanager
    def spy(device):
        state["inside"] += 1
        state["devices"].append(torch.device(device).type)
        try:
            yield
        finally:
            state["inside"] -= 1

    import medusa_infer.models

    real_load = medusa_infer.models.load_base_model

    def load_and_watch(*args, **kwargs):
        model = real_load(*args, **kwargs)

        def hook(module, inputs):
            state["attention"] += 1
            state["outside"] += state["inside"] == 0

        for name, module in model.named_modules():
            if name.endswith("self_attn"):
                module.register_forward_pre_hook(hook)
        return model

    monkeypatch.setattr(distill_module, "decoding_attention", spy)
    monkeypatch.setattr(medusa_infer.models, "load_base_model", load_and_watch)
    distill(make_config(model_dir, prompts_file, tmp_path / "rows.jsonl", n=4))
    assert len(read_rows(tmp_path / "rows.jsonl")) == 4
    assert state["attention"] > 0 and state["outside"] == 0
    assert set(state["devices"]) == {"cpu"}


def test_pending_prompts_leaves_out_answered_and_too_long_prompts(tmp_path, model_dir, prompts_file, tokenizer):
    from medusa_train.distill import load_distill_tokenizer, pending_prompts, prepare_prompt

    sample = sample_prompts(prompts_file, 12)
    config = make_config(model_dir, prompts_file, tmp_path / "rows.jsonl")
    assert pending_prompts(config) == (12, 12)  # nothing written yet
    lengths = {p["id"]: len(prepare_prompt(load_distill_tokenizer(config), p["prompt"], config)[1]) for p in sample}
    limit = sorted(lengths.values())[-3]  # the two longest prompts go over it (ties aside)
    short = make_config(model_dir, prompts_file, tmp_path / "rows.jsonl", max_prompt_tokens=limit)
    too_long = {i for i, n in lengths.items() if n > limit}
    assert too_long
    record = short.generation_record()
    answered = [p for p in sample if p["id"] not in too_long][:-1]
    (tmp_path / "rows.jsonl").write_text("".join(
        json.dumps({"id": p["id"], "prompt": p["prompt"], "response": "r", "model": short.model_label,
                    "generation": record}) + "\n" for p in answered))
    assert pending_prompts(short) == (12, 1)  # only the short prompt without a row; the long ones are skipped
    with pytest.raises(ValueError, match="already holds row"):
        pending_prompts(make_config(model_dir, prompts_file, tmp_path / "rows.jsonl", max_new_tokens=99))


def test_prompts_the_models_context_cannot_hold_are_skipped_like_long_ones(tmp_path, model_dir, prompts_file,
                                                                          tokenizer, caplog):
    """A model whose context (40 tokens) is shorter than max_prompt_tokens: the prompts it cannot answer
    are skipped (prompt_overflow) and counted, and the others answered, instead of the run stopping
    when the first one reaches the model, on every rerun."""
    folder = tmp_path / "short-context"
    folder.mkdir()
    for file in model_dir.iterdir():
        if file.name != "config.json":
            (folder / file.name).symlink_to(file)
    config = json.loads((model_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40}))
    prompts = sample_prompts(prompts_file, 12)
    lengths = [len(encode_rendered(tokenizer, render_prompt(tokenizer, p["prompt"]))) for p in prompts]
    fit = sum(n <= 39 for n in lengths)
    assert 0 < fit < 12
    run = make_config(folder, prompts_file, tmp_path / "rows.jsonl", max_new_tokens=4)
    assert distill_module.pending_prompts(run) == (12, fit)
    with caplog.at_level(logging.INFO, logger="medusa_train.distill"):
        distill(run)
    assert len(read_rows(tmp_path / "rows.jsonl")) == fit
    assert f"{12 - fit} prompts over max_prompt_tokens=39 skipped" in caplog.text


def test_an_answer_cut_inside_a_character_keeps_its_whole_characters(tokenizer):
    ids = tokenizer("Sure 日本語 ok", add_special_tokens=False)["input_ids"]
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    tokens, text = answer_text(tokenizer, ids[:cut], "length")
    assert not text.endswith("\ufffd") and text == tokenizer.decode(tokens) and ids[:cut][:len(tokens)] == tokens
    assert answer_text(tokenizer, ids, "eos") == (ids, "Sure 日本語 ok")
    # U+FFFD characters the model wrote whole were cut off as if they were bytes cut short
    ids = tokenizer("Replacement char: \ufffd\ufffd", add_special_tokens=False)["input_ids"]
    assert answer_text(tokenizer, ids, "length") == (ids, "Replacement char: \ufffd\ufffd")
    written, character = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("Sure \ufffd", "語"))
    for k in range(1, len(character)):  # bytes cut short after one: cut off, the written one kept
        assert tokenizer.decode(written + character[:k]).endswith("\ufffd\ufffd")
        assert answer_text(tokenizer, written + character[:k], "length") == (written, "Sure \ufffd")


def test_recipe_settings_reach_distillation(tmp_path, monkeypatch):
    from medusa_train.train_config import config_from_dict

    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    recipe = config_from_dict({"model": {"name": "org/custom-model", "trust_remote_code": True},
                               "data": {"prompts": "p.jsonl"}, "output_dir": "out"})
    assert distill_module.recipe_config(recipe).trust_remote_code is True
    for quota in (-1, "3", 2.5, True):  # ("3" and 2.5 passed, then failed in a traceback)
        with pytest.raises(ValueError, match=r"per_source quotas must be whole numbers >= 1, got \{'a': "):
            DistillConfig(prompts="p.jsonl", per_source={"a": quota})
    parser = build_parser()
    assert config_from_args(parser.parse_args(["--prompts", "p.jsonl", "--trust-remote-code"])).trust_remote_code
    assert not config_from_args(parser.parse_args(["--prompts", "p.jsonl"])).trust_remote_code


# Mistral-7B-Instruct-v0.3's template (shortened): the system prompt goes into the last user turn only
MISTRAL_V03_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}{{- '[INST] ' + system_message + '\\n\\n' + message['content'] "
    "+ '[/INST]' }}{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}"
)


@pytest.mark.parametrize("template, system_prompt, error", [
    (MISTRAL_V03_TEMPLATE, "Be brief.", r"not prefix-stable.*set model.chat_template to one that can, or leave out "
                                        r"data.system_prompt"),
    (None, None, r"has no chat template.*set model.chat_template to one that can$"),
])
def test_train_heads_checks_the_chat_template_before_distilling(tmp_path, model_dir, prompts_file, monkeypatch,
                                                                 template, system_prompt, error):
    """A template that cannot label the answers (Mistral v0.3's with a system prompt, or none) failed
    only when the dataset was built, after every prompt was distilled."""
    import train_heads
    from accelerate import PartialState

    from medusa_train.train_config import config_from_dict

    def answered(*args, **kwargs):
        raise AssertionError("distilled before the template was checked")

    monkeypatch.setattr(distill_module, "distill", answered)
    data = {"prompts": str(prompts_file), "n": 2, "max_new_tokens": 2, "system_prompt": system_prompt}
    recipe = config_from_dict({"output_dir": str(tmp_path / "run"),
                               "model": {"name": str(model_dir), "chat_template": template},
                               "data": data, "features": {"from_distillation": False}, "log": {"progress": False}})
    if template is None:
        import medusa_infer.models as models

        plain = models.load_tokenizer(str(model_dir))
        plain.chat_template = None
        monkeypatch.setattr(models, "load_tokenizer", lambda *args, **kwargs: plain)
    with pytest.raises(ValueError, match=error):
        train_heads.stage_data(recipe, PartialState(cpu=True), None)
    if template is not None:  # without the system prompt it labels the answers
        recipe.data.system_prompt = None
        with pytest.raises(AssertionError, match="distilled before"):
            train_heads.stage_data(recipe, PartialState(cpu=True), None)


def test_a_pad_token_the_model_has_no_embedding_for_pads_nothing_in_distillation(tmp_path):
    """A pad token added to a tokenizer whose model was not resized: every batch of prompts of mixed lengths
    failed ("token id 86 is outside the vocabulary"); padding is masked, any id the model embeds serves."""
    import copy

    from medusa_infer.model import MedusaModel
    from medusa_infer.serving.testing import word_tokenizer

    tokenizer = copy.deepcopy(word_tokenizer())
    base = tiny_model("llama", vocab_size=len(tokenizer))
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    assert tokenizer.pad_token_id == len(tokenizer) - 1 == base.get_input_embeddings().weight.shape[0]
    model = MedusaModel(base, None, tokenizer)
    config = DistillConfig(model="tiny", prompts=str(tmp_path / "p.jsonl"), output=str(tmp_path / "o.jsonl"),
                           max_new_tokens=3)
    prompts = [tokenizer(text)["input_ids"] for text in ("the cat", "the cat sat on the mat")]
    together = distill_module.generate_batch(model, tokenizer, prompts, config, [2])
    assert together == [distill_module.generate_batch(model, tokenizer, [ids], config, [2])[0] for ids in prompts]


def test_distillation_stops_at_the_end_tokens_decoding_stops_at(model_dir, tokenizer):
    """A fine-tune naming its end-of-turn token in its model config alone: distillation left the config's
    ids out (decoding and medusa-bench stop there), so its answers ran on past it."""
    from transformers import AutoModelForCausalLM

    from medusa_infer.model import MedusaModel

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    base.config.eos_token_id = [2, 50]
    assert sorted(distill_module.eos_token_ids(MedusaModel.without_heads(base, tokenizer), tokenizer)) == [2, 50]
    # none named anywhere: refused with where to name one (it named no file, nor the fix)
    import copy

    plain = copy.deepcopy(tokenizer)
    plain.eos_token = None
    base.config.eos_token_id = base.generation_config.eos_token_id = None
    with pytest.raises(ValueError, match=r"eos_token_id in generation_config.json or config.json.*eos_token in "
                                         r"tokenizer_config.json.*set one of them to the token the model ends"):
        distill_module.eos_token_ids(MedusaModel.without_heads(base, plain), plain)


def write_prompts(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sources_take_turns_in_the_order_of_their_names(tmp_path):  # S1
    path = write_prompts(tmp_path / "p.jsonl", [
        *({"id": f"z{i}", "source": "zeta", "prompt": f"z {i}"} for i in range(3)),
        *({"id": f"a{i}", "source": "alpha", "prompt": f"a {i}"} for i in range(3)),
    ])
    sample = sample_prompts(path, None)
    assert [p["source"] for p in sample] == ["alpha", "zeta"] * 3
    assert [p["source"] for p in sample_prompts(path, 1)] == ["alpha"]


def test_an_endpoint_failing_now_and_then_is_asked_every_prompt(tmp_path):  # S7: failures counted in a row
    texts = [f"prompt number {i}" for i in range(8)]
    path = write_prompts(tmp_path / "p.jsonl",
                         [{"id": str(i), "source": "s", "prompt": t} for i, t in enumerate(texts)])
    order = [p["prompt"] for p in sample_prompts(path, None)]  # the order they are asked in (concurrency 1)
    with FakeServer(flaky=set(order[::2])) as server:  # every other prompt fails once, no retry: for good
        config = openai_config(path, tmp_path / "rows.jsonl", server.url, n=None, max_retries=0, concurrency=1)
        with pytest.raises(RuntimeError) as failed:
            distill(config)
        asked = [body["messages"][-1]["content"] for body in server.requests]
    assert "were not asked" not in str(failed.value) and "4 of 8 requests failed" in str(failed.value)
    assert sorted(asked) == sorted(texts)
    assert [row["prompt"] for row in read_rows(tmp_path / "rows.jsonl.rank0.jsonl")] == order[1::2]


def test_the_last_partial_batch_of_an_endpoint_run_is_reported(tmp_path):  # S8
    path = write_prompts(tmp_path / "p.jsonl",
                         [{"id": str(i), "source": "s", "prompt": f"hello {i}"} for i in range(5)])
    seen = []
    with FakeServer() as server:
        distill(openai_config(path, tmp_path / "rows.jsonl", server.url, n=None, batch_size=4),
                on_batch=lambda index, rows: seen.append((index, len(rows))))
    assert seen == [(0, 4), (1, 1)]


def test_an_answer_that_ended_keeps_the_bytes_it_wrote_last(tokenizer):  # S12
    from medusa_train.distill import answer_text

    ids = tokenizer("Sure 日本語 ok", add_special_tokens=False)["input_ids"]
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    assert answer_text(tokenizer, ids[:cut], "eos") == (ids[:cut], tokenizer.decode(ids[:cut]))


def test_a_truncated_prompt_fills_max_prompt_tokens(tokenizer):  # S10
    from medusa_train.distill import DistillConfig, prepare_prompt

    prompt = " ".join(f"word{i}" for i in range(60))
    overhead = len(prepare_prompt(tokenizer, "", DistillConfig(prompts="p", max_prompt_tokens=None))[1])
    for limit in range(overhead + 5, overhead + 15):
        config = DistillConfig(prompts="p", max_prompt_tokens=limit, prompt_overflow="truncate")
        text, ids = prepare_prompt(tokenizer, prompt, config)
        assert prompt.startswith(text) and len(ids) == limit, (limit, len(ids))


def test_max_prompt_tokens_0_on_the_command_line_means_no_limit(tmp_path):  # S20
    from medusa_train.distill import build_parser, config_from_args

    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    args = build_parser().parse_args(["--prompts", str(tmp_path / "p.jsonl"), "--max-prompt-tokens", "0"])
    assert config_from_args(args).max_prompt_tokens is None


def test_one_failed_request_alone_does_not_stop_a_one_at_a_time_run(tmp_path):  # S22: at least 2 in a row
    texts = [f"prompt number {i}" for i in range(4)]
    path = write_prompts(tmp_path / "p.jsonl",
                         [{"id": str(i), "source": "s", "prompt": t} for i, t in enumerate(texts)])
    order = [p["prompt"] for p in sample_prompts(path, None)]
    with FakeServer(flaky={order[0]}) as server:
        config = openai_config(path, tmp_path / "rows.jsonl", server.url, n=None, max_retries=0, concurrency=1)
        with pytest.raises(RuntimeError, match=r"^1 of 4 requests failed \(rows written"):
            distill(config)
        assert len(server.requests) == 4


@pytest.mark.parametrize("code", [408, 425, 429, 500, 503])
def test_transient_statuses_are_retried_and_a_400_is_not(tmp_path, code):
    calls = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            calls.append(self.path)
            status, body = ((code, b'{"error": "later"}') if len(calls) == 1 else
                            (200, json.dumps({"choices": [{"message": {"content": "ok"}}]}).encode()))
            if self.path == "/bad":
                status = 400
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(RetryableError):
            post_json(url + "/v1", {}, {}, 5.0)
        calls.clear()
        config = DistillConfig(prompts="p.jsonl", backend="openai", endpoint=url, retry_backoff_s=0.0)
        assert request_completion(url + "/v1", {}, {}, config)["choices"][0]["message"]["content"] == "ok"
        assert len(calls) == 2
        with pytest.raises(RejectedError):
            post_json(url + "/bad", {}, {}, 5.0)
    finally:
        server.shutdown()
        server.server_close()


def test_the_datastores_origin_says_whether_the_run_made_its_answers(model_dir, prompts_file, tmp_path):
    """The card's datastore section says what the store holds: the run's own distilled answers, or rows
    given as they are (data.rows, distilled elsewhere), named by their file."""
    import train_heads
    from test_training import write_recipe

    base = {"model": {"name": str(model_dir)},
            "heads": {"num_heads": 1, "num_layers": 1, "projection": "shared"},
            "features": {"from_distillation": False},
            "training": {"lr": 0.01, "max_steps": 1, "batch_tokens": 16, "warmup_ratio": 0.0},
            "log": {"every": 1, "progress": False}, "eval": {"tree_size": 2}}
    own = dict(base, output_dir=str(tmp_path / "own"),
               data={"prompts": str(prompts_file), "n": 8, "max_new_tokens": 6, "distill_batch_size": 8,
                     "heldout_fraction": 0.25})
    write_recipe(tmp_path / "own.yaml", own)
    assert train_heads.main(["--config", str(tmp_path / "own.yaml")]) == 0
    card = (tmp_path / "own" / "heads" / "README.md").read_text()
    assert "the training split's conversations, prompts and the model's own answers" in card
    given = dict(base, output_dir=str(tmp_path / "given"),
                 data={"rows": str(tmp_path / "own" / "data" / "distilled.jsonl"), "heldout_fraction": 0.25})
    write_recipe(tmp_path / "given.yaml", given)
    assert train_heads.main(["--config", str(tmp_path / "given.yaml")]) == 0
    card = (tmp_path / "given" / "heads" / "README.md").read_text()
    assert "the training split's conversations as given in distilled.jsonl" in card


def test_rows_already_complete_are_not_distilled_again(tmp_path, model_dir, prompts_file, monkeypatch, capsys):
    """Nothing pending (a rerun, or data.n lowered): no distillation runs, and the run does not say it distils."""
    import train_heads
    from accelerate import PartialState

    from medusa_train import distill as distill_module
    from medusa_train.distill import distill
    from test_distill import small_recipe

    config = small_recipe(tmp_path, model_dir, prompts_file, 6)
    distill(distill_module.recipe_config(config))
    assert train_heads.distill_pending(config) == 0
    capsys.readouterr()
    calls = []
    monkeypatch.setattr(distill_module, "distill", lambda *a, **k: calls.append(a))
    train, heldout = train_heads.stage_data(config, PartialState(cpu=True), 0)
    assert len(train) + len(heldout) == 6 and calls == []
    assert "distilling" not in capsys.readouterr().out


def test_openai_backend_reads_odd_replies_and_keys_as_said(tmp_path, caplog, monkeypatch, model_dir):
    """From a review against misbehaving servers: two choices out of order gave the second's text; a finish_reason
    that is no name ended the run with a TypeError; content as a list of parts was called a lone surrogate; a key
    read from a file saved with CRLF line endings ("key\\r") ended the run printing the whole key; an endpoint
    without its scheme was retried 4 times a prompt and exclude_ids advised; retries were logged at debug only."""
    prompts_file = tmp_path / "prompts.jsonl"
    texts = ["twice please", "odd finish here", "parts please", "throttled hello"]
    prompts_file.write_text("".join(json.dumps({"id": str(i), "source": "s", "prompt": p}) + "\n"
                                    for i, p in enumerate(texts)))
    monkeypatch.setenv("MEDUSA_TEST_KEY", "sk-secret-123\r")  # stripped
    with FakeServer() as server, caplog.at_level(logging.WARNING, logger="medusa_train.distill"):
        config = openai_config(prompts_file, tmp_path / "rows.jsonl", server.url, n=None, model=str(model_dir))
        distill(config)
        assert {h["Authorization"] for h in server.headers} == {"Bearer sk-secret-123"}
    rows = {row["id"]: row for row in read_rows(tmp_path / "rows.jsonl")}
    assert rows["0"]["response"] == "first" and set(rows) == {"0", "3"}
    assert "finish_reason {'type': 'stop'} is no reason's name" in caplog.text
    assert "the answer is a list, not text" in caplog.text
    assert re.search(r"prompt 3: retry 1 of \d+ in [\d.]+ s after: HTTP 429", caplog.text)
    monkeypatch.setenv("MEDUSA_TEST_KEY", "sk-secret\n-123")
    with pytest.raises(ValueError,
                       match=r"\$MEDUSA_TEST_KEY holds a line break .*: set it to the key alone") as refused:
        distill(openai_config(prompts_file, tmp_path / "rows2.jsonl", "http://127.0.0.1:9", n=None,
                              model=str(model_dir)))
    assert "secret" not in str(refused.value)
    for endpoint, said in (("127.0.0.1:8000", "has no http:// or https:// in front"),
                           ("http://127.0.0.1:80a", "has a port that is no number")):
        with pytest.raises(ValueError, match=re.escape(f"endpoint {endpoint!r} {said}")):
            openai_config(prompts_file, tmp_path / "rows3.jsonl", endpoint, n=None)


def test_refusals_recorded_count_for_their_prompt_and_settings_only(tmp_path, caplog, model_dir):
    """A recorded refusal held the prompt's id alone: a prompt rewritten since under that id, or asked with prompt
    limits set since, was not asked again. A 403 after answers is that prompt's (a provider's moderation), not a
    wrong key: it stopped the run, naming no prompt, for good. Prompts refused before counted as rows already
    there: a run whose every prompt was refused passed, and recorded them all."""
    from medusa_train.distill import _refusal_key, pending_prompts

    prompts_file = tmp_path / "prompts.jsonl"

    def write(texts):
        prompts_file.write_text("".join(json.dumps({"id": str(i), "source": "s", "prompt": t}) + "\n"
                                        for i, t in enumerate(texts)))

    write(["hello there", "forbidden words", "moderated words", "good day"])
    with FakeServer() as server, caplog.at_level(logging.WARNING, logger="medusa_train.distill"):
        config = openai_config(prompts_file, tmp_path / "rows.jsonl", server.url, n=None, concurrency=1)
        distill(config)  # (one at a time: the first answered before the 403)
        assert sorted(row["id"] for row in read_rows(tmp_path / "rows.jsonl")) == ["0", "3"]
        assert pending_prompts(config) == (4, 0)  # both refusals recorded
        write(["hello there", "fine words now", "moderated words", "good day"])  # prompt 1 rewritten
        assert pending_prompts(config) == (4, 1)
        distill(config)
        assert sorted(row["id"] for row in read_rows(tmp_path / "rows.jsonl")) == ["0", "1", "3"]
        limited = dataclasses.replace(config, max_prompt_tokens=64, model=str(model_dir))
        assert pending_prompts(limited) == (4, 1)  # other limits: prompt 2 is asked again
    # a run whose every prompt is refused fails, beside prompts refused before: they are no rows
    write(["forbidden a", "forbidden b", "forbidden c"])
    with FakeServer() as server:
        config = openai_config(prompts_file, tmp_path / "rows2.jsonl", server.url, n=None)
        (tmp_path / "rows2.jsonl.refused.rank0.jsonl").write_text("".join(
            json.dumps({"id": str(i), "reason": "r", **_refusal_key(config, {"prompt": f"forbidden {c}"})}) + "\n"
            for i, c in enumerate("ab")))
        with pytest.raises(RuntimeError, match="the endpoint refused all 1 prompts and no row was written before"):
            distill(config)
    # an address that holds a line break (urlsplit dropped it, and each prompt was retried)
    with pytest.raises(ValueError, match="holds a space, a line break or another character no URL holds"):
        openai_config(prompts_file, tmp_path / "rows3.jsonl", "http://127.0.0.1:8000/v1\n", n=None)


def test_an_endpoint_of_another_scheme_is_refused():
    """Only http and https are servers' addresses: ftp:// and a host:port without scheme are named as such (M29)."""
    from medusa_train.distill import endpoint_problem

    for endpoint in ("ftp://127.0.0.1:8000", "localhost:8000", "ws://host/v1"):
        assert endpoint_problem(endpoint) == "has no http:// or https:// in front", endpoint
    assert endpoint_problem("https://host/v1") is None and endpoint_problem("http://127.0.0.1:8000") is None


def test_an_address_no_request_can_go_to_is_the_endpoints_error_not_retried():
    """http.client's InvalidURL is the endpoint's fault, said at once, not retried as a transient one (M45)."""
    import pytest
    from medusa_train.distill import EndpointError, RetryableError, post_json

    for url in ("http://127.0.0.1:80a/v1/chat/completions", "http://127.0.0.1:8000/v1 x/chat/completions"):
        with pytest.raises(EndpointError, match="is no address a request can be sent to") as caught:
            post_json(url, {}, {}, 2)
        assert not isinstance(caught.value, RetryableError)


def test_files_saved_with_a_byte_order_mark_are_read_whole(tmp_path, model_dir, capsys):
    """From a review: an ids file saved with a byte order mark (Notepad, PowerShell) made its first id one no prompt
    has, and that held-out prompt was distilled and trained on; a prompts file, rows or questions with one were
    refused; a bad ids line named neither file nor line, and the command line's own errors were tracebacks."""
    from medusa_train.benchmark import read_questions
    from medusa_train.dataset import read_rows
    from medusa_train.distill import main, read_ids, read_prompts

    bom = b"\xef\xbb\xbf"
    (tmp_path / "ids.txt").write_bytes(bom + b"p0\np1\n")
    (tmp_path / "ids.jsonl").write_bytes(bom + b'{"id": "p0"}\n{"id": "p1"}\n')
    (tmp_path / "prompts.jsonl").write_bytes(bom + b'{"id": "p0", "prompt": "hi"}\n')
    (tmp_path / "rows.jsonl").write_bytes(bom + b'{"id": "p0", "prompt": "hi", "response": "hello"}\n')
    (tmp_path / "questions.jsonl").write_bytes(bom + b'{"id": 1, "category": "qa", "turns": ["hi"]}\n')
    assert read_ids(tmp_path / "ids.txt") == read_ids(tmp_path / "ids.jsonl") == ["p0", "p1"]
    assert [row["id"] for row in read_prompts(tmp_path / "prompts.jsonl")] == ["p0"]
    assert [row["id"] for row in read_rows(tmp_path / "rows.jsonl")] == ["p0"]
    assert [row["id"] for row in read_questions(tmp_path / "questions.jsonl")] == [1]
    from medusa_infer.cli import decode_utf8

    with pytest.raises(ValueError, match=r"^x:2 is not UTF-8 text \(invalid start byte at byte 6\)"):
        decode_utf8(bom + b"ab\n\xff", "x")  # (counted from after the mark: byte 3 of line 1)
    (tmp_path / "bad.jsonl").write_text('{"id": "p0"}\n{"id": "p1",}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not valid JSON"):
        read_ids(tmp_path / "bad.jsonl")
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "x"}\n{"id": "b", prompt: "y"}\n')
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(model_dir), "--prompts", str(tmp_path / "p.jsonl"), "--output", str(tmp_path / "o.jsonl"),
              "--no-progress"])
    assert str(exit_info.value.code).startswith("python -m medusa_train.distill: error: ")
    assert "p.jsonl:2 is not valid JSON" in str(exit_info.value.code)


def test_the_distill_command_names_a_full_disk_and_an_output_that_is_a_folder(tmp_path, model_dir, monkeypatch,
                                                                              capsys):
    """A full disk (or a read-only folder) was a traceback from the shard writer; a folder given as --output an
    IsADirectoryError traceback once the first answers were in."""
    import errno

    from medusa_train.distill import main

    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    command = ["--model", str(model_dir), "--prompts", str(tmp_path / "p.jsonl"), "--no-progress"]
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--output", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"output={str(tmp_path)!r} is a folder: give the path of the rows' file" in capsys.readouterr().err
    asked = []
    monkeypatch.setattr(distill_module, "distill", lambda *a, **k: asked.append(1))
    with pytest.raises(SystemExit):
        main([*command, "--output", ""])
    assert asked == [] and "output is empty: give the path of the rows' file" in capsys.readouterr().err

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "o.jsonl.rank0.jsonl"))

    monkeypatch.setattr(distill_module, "distill", full)
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--output", str(tmp_path / "o.jsonl")])
    assert str(exit_info.value.code).startswith("python -m medusa_train.distill: error: [Errno 28] No space left")
    assert "the disk is full (or the file too large for it): free space, then run the same command again" in \
        str(exit_info.value.code)


def test_the_distill_command_refuses_what_it_would_drop_or_fail_on_late(tmp_path, model_dir, monkeypatch, capsys):
    """A missing prompts file (or a folder) was a FileNotFoundError traceback; --n 0, an empty prompts file or every
    prompt excluded wrote an empty file with status 0; a source given two --per-source quotas kept the last; a
    --max-new-tokens or --threads past a C long failed after loading with "Overflow when unpacking long"."""
    from medusa_train.distill import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "source": "s", "prompt": "x"}\n')
    (tmp_path / "empty.jsonl").write_text("")
    asked = []
    monkeypatch.setattr(distill_module, "run_local", lambda *a, **k: asked.append(1))

    def refused(*flags: str) -> str:
        with pytest.raises(SystemExit) as exit_info:
            main(["--model", str(model_dir), "--output", str(tmp_path / "o.jsonl"), "--no-progress", *flags])
        return str(exit_info.value.code) + capsys.readouterr().err

    assert "--prompts " + str(tmp_path / "missing.jsonl") + ": no such file: give a JSONL file" in refused(
        "--prompts", str(tmp_path / "missing.jsonl"))
    assert f"--prompts {tmp_path}: is a folder" in refused("--prompts", str(tmp_path))
    os.mkfifo(tmp_path / "fifo")  # (read twice: it hung, waiting for a second writer; a shell's pipe gave no prompt)
    assert "is no regular file (a pipe or a device)" in refused("--prompts", str(tmp_path / "fifo"))
    assert "n must be >= 1 (or left out: every prompt), got 0" in refused("--prompts", str(prompts), "--n", "0")
    assert "gives no prompt to distil" in refused("--prompts", str(tmp_path / "empty.jsonl"))
    (tmp_path / "ids.txt").write_text("a\n")
    assert "gives no prompt to distil" in refused("--prompts", str(prompts), "--exclude-ids", str(tmp_path / "ids.txt"))
    assert "--per-source names 's' more than once" in refused("--prompts", str(prompts), "--per-source", "s=1",
                                                              "--per-source", "s=3")
    for flag in ("--max-new-tokens", "--threads"):
        assert f"{flag[2:].replace('-', '_')} must be in [1, " in refused("--prompts", str(prompts), flag, str(10**20))
    assert asked == [] and not (tmp_path / "o.jsonl").exists()


def test_ctrl_c_ends_the_distill_command_with_a_line(tmp_path, model_dir, capsys, monkeypatch):
    """Ctrl-C ended python -m medusa_train.distill with a traceback (after its in-flight requests' warning)."""
    from medusa_train.distill import main

    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "x"}\n')

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(distill_module, "distill", interrupted)

    def run() -> str:
        with pytest.raises(SystemExit) as exit_info:
            try:
                main(["--model", str(model_dir), "--prompts", str(tmp_path / "p.jsonl"), "--output",
                      str(tmp_path / "o.jsonl"), "--no-progress"])
            except KeyboardInterrupt:  # (escaping, it would stop the whole test session)
                pytest.fail("Ctrl-C escaped main() as a traceback")
        assert exit_info.value.code == 130
        return capsys.readouterr().err

    assert "medusa_train.distill: interrupted; the rows written are kept" in run()
    # the other processes of a launch say nothing (Ctrl-C reaches each of them), nor while the state forms (a
    # launch's rendezvous: it escaped as a traceback there)
    import types

    import accelerate

    monkeypatch.setattr(accelerate, "PartialState", lambda cpu: types.SimpleNamespace(is_main_process=False))
    assert run() == ""
    monkeypatch.setattr(accelerate, "PartialState", interrupted)
    assert "medusa_train.distill: interrupted" in run()
    for name in ("RANK", "PMI_RANK"):  # (mpirun's: accelerate sets RANK only once its state forms)
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.setenv(name, "1")
        assert run() == "", name
