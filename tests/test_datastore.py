"""The datastore of the model's own answers: n-gram search, continuation drafts, files, and its use
by the lookup proposers (greedy output unchanged, drafts taken from the store)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from medusa_infer.config import MedusaConfig
from medusa_infer.datastore import DATASTORE_NAME, SEPARATOR, Datastore, DatastoreMatch
from medusa_infer.decoding import generate
from medusa_infer.model import MedusaModel
from medusa_infer.models import load_tokenizer
from medusa_infer.proposers import LookupProposer, MedusaProposer, build_proposer
from medusa_infer.proposers.base import StepContext
from medusa_infer.proposers.lookup import LookupGate, gated_matches
from medusa_infer.interop import BASE_MODEL_KEY
from medusa_train.datastore import build_datastore, check_rows, main
from medusa_train.distill import template_digest
from test_decoding import NO_EOS, reference
from test_proposers import CPU_COST, GPU_COST, GRAFT_TREE, random_heads, target_model


def brute_match(sequences, history, limit, min_ngram=2, max_ngram=6, max_occurrences=256, min_share=0.3):
    """The specification, written the slow way: the longest suffix of ``history`` that occurs in a
    sequence with a token after it; then, token by token, the most frequent next token among the
    latest ``max_occurrences`` occurrences still agreeing (ties: the latest occurrence's); with the
    number of occurrences that voted on the first token and the first token's share of them."""
    for n in range(min(max_ngram, len(history)), min_ngram - 1, -1):
        suffix = list(history[len(history) - n:])
        found = [(s, e) for s, seq in enumerate(sequences) for e in range(n, len(seq)) if seq[e - n:e] == suffix]
        if not found:
            continue
        live, draft = found[-max_occurrences:], []
        voters, share = len(live), 0.0
        for step in range(limit):
            nexts = [(sequences[s][e + step], i) for i, (s, e) in enumerate(live) if e + step < len(sequences[s])]
            if not nexts:
                break
            counts = {}
            for token, _ in nexts:
                counts[token] = counts.get(token, 0) + 1
            top = max(counts.values())
            best = max((i, t) for t, i in nexts if counts[t] == top)[1]
            if step and top < min_share * len(live):
                break
            if not step:
                share = top / len(live)
            draft.append(best)
            live = [(s, e) for s, e in live if e + step < len(sequences[s]) and sequences[s][e + step] == best]
        return (n, draft, voters, share) if draft else (0, [], 0, 0.0)
    return 0, [], 0, 0.0


@pytest.mark.parametrize("modulus", [2_147_483_647, 7])  # 7: nearly every n-gram collides
def test_match_equals_the_brute_force_search(modulus):
    rng = random.Random(0)
    for trial in range(30):
        vocab = rng.choice([3, 5, 12])
        sequences = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 40))] for _ in range(rng.randrange(1, 6))]
        store = Datastore.from_sequences(sequences, max_occurrences=rng.choice([1, 3, 256]), modulus=modulus)
        for _ in range(20):
            history = [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))]
            limit = rng.randrange(0, 10)
            expected = brute_match(sequences, history, limit, max_occurrences=store.max_occurrences)
            if limit == 0:
                expected = (0, [], 0, 0.0)
            assert store.match(history, limit) == expected, (trial, sequences, history, limit)


def test_drafts_follow_the_majority_and_stop_at_sequence_ends():
    store = Datastore.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 9], [7, 1, 2]])
    # 4 follows "1 2 3" in two of three; then 5 and 6 tie and the latest occurrence's wins
    assert store.match([8, 1, 2], 10)[:2] == (2, [3, 4, 6])
    assert store.match([8, 2, 3, 9], 10)[:2] == (0, [])  # "2 3 9" and "3 9" end their sequence
    assert store.occurrences([1, 2]) == [2, 8, 14]  # [7, 1, 2] ends there: no continuation
    assert store.match([5, 6], 4)[:2] == (0, [])  # never seen
    assert len(store) == 17 and store.tokens[-1] == SEPARATOR
    three_ways = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 4, 7]]
    assert Datastore.from_sequences(three_ways).match([1, 2, 3], 5)[:2] == (3, [4, 7])  # 1 of 3 >= 0.3
    assert Datastore.from_sequences(three_ways, min_share=0.5).match([1, 2, 3], 5)[:2] == (3, [4])


def test_confidence_classes_follow_the_vote_on_the_first_token():
    store = Datastore.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 9], [7, 1, 2]])
    assert store.match([8, 1, 2], 10) == (2, [3, 4, 6], 3, 1.0)  # three occurrences, all say 3

    def vote(*nexts):
        match = Datastore.from_sequences([[1, 2, t] for t in nexts]).match([1, 2], 4)
        return match.draft[0], match.occurrences, match.confidence()
    assert vote(3) == (3, 1, "single")
    assert vote(3, 4, 5) == (5, 3, "low")  # a three-way tie: the latest occurrence's token
    assert vote(3, 4, 3, 5) == (3, 4, "mid")  # one half
    assert vote(3, 3, 3, 3, 4) == (3, 5, "high")  # four fifths
    assert DatastoreMatch(2, [3], 7, 0.79).confidence() == "mid"


def test_settings_are_checked_and_files_round_trip(tmp_path):
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        Datastore(torch.tensor([1, 2]), min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="min_share"):
        Datastore(torch.tensor([1, 2]), min_share=0)
    with pytest.raises(ValueError, match="ids >= 0"):
        Datastore(torch.tensor([1, -5]))
    with pytest.raises(ValueError, match="indexes n-grams of 2..4"):
        Datastore(torch.tensor([1, 2, 3]), max_ngram=4).occurrences([1])
    with pytest.raises(ValueError, match="modulus"):
        Datastore(torch.tensor([1, 2]), modulus=2**44)
    store = Datastore.from_sequences([[5, 6, 7, 8], [5, 6, 9]], min_ngram=1, max_ngram=3, min_share=0.6)
    loaded = Datastore.load(store.save(tmp_path / DATASTORE_NAME))
    assert torch.equal(loaded.tokens, store.tokens)
    assert (loaded.min_ngram, loaded.max_ngram, loaded.min_share) == (1, 3, 0.6)
    assert loaded.match([5, 6], 3) == store.match([5, 6], 3) == (2, [9], 2, 0.5)
    assert store.occurrences([5, 6]) == [2, 7] and store.occurrences([5, 6], last=1) == [7]
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="python -m medusa_train.datastore"):
        Datastore.load(tmp_path / "bad.safetensors")
    # the same store, the same bytes (safetensors writes its metadata map in random order: each save of unchanged
    # heads was a new file to upload); the tokenizer digest comes back, also from a store of the earlier layout
    store = Datastore(store.tokens, tokenizer="abc123")
    assert len({store.save(tmp_path / f"{run}.safetensors").read_bytes() for run in range(8)}) == 1
    assert Datastore.load(tmp_path / "0.safetensors").tokenizer == "abc123"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "0.safetensors"), framework="pt") as f:  # what the earlier loader reads:
        settings = json.loads(f.metadata()["settings"])  # settings alone (a tokenizer among them failed it)
    assert set(settings) == {"min_ngram", "max_ngram", "max_occurrences", "min_share"}
    from safetensors.torch import save_file

    save_file({"tokens": store.tokens.to(torch.int32)}, str(tmp_path / "old.safetensors"),
              metadata={"format": "pt", "settings": '{"min_ngram": 1}', "tokenizer": "abc123"})
    old = Datastore.load(tmp_path / "old.safetensors")
    assert (old.tokenizer, old.min_ngram) == ("abc123", 1)
    # read as they were: float ids cut to integers, a 2-d tensor flattened, a float setting failing the first lookup
    # mid-decoding, a digest of bad bytes a bare UnicodeDecodeError
    for name, tensors, settings in (
            ("float", {"tokens": torch.tensor([1.7, 2.0])}, "{}"),
            ("2d", {"tokens": torch.tensor([[3, 4], [5, 6]], dtype=torch.int32)}, "{}"),
            ("setting", {"tokens": torch.tensor([3, 4], dtype=torch.int32)}, '{"min_ngram": 2.5}'),
            ("digest", {"tokens": torch.tensor([3, 4], dtype=torch.int32),
                        "tokenizer": torch.tensor([255, 254], dtype=torch.uint8)}, "{}"),
            # settings or tokens the store refuses were a bare ValueError naming neither the file nor the remedy;
            # a hash modulus is no saved setting; a huge n-gram length built an index per length (21 s)
            ("negative", {"tokens": torch.tensor([3, -2], dtype=torch.int32)}, "{}"),
            ("share", {"tokens": torch.tensor([3, 4], dtype=torch.int32)}, '{"min_share": NaN}'),
            ("order", {"tokens": torch.tensor([3, 4], dtype=torch.int32)}, '{"min_ngram": 4, "max_ngram": 2}'),
            ("modulus", {"tokens": torch.tensor([3, 4], dtype=torch.int32)}, '{"modulus": 1}'),
            ("long", {"tokens": torch.tensor([3, 4], dtype=torch.int32)}, '{"max_ngram": 300}')):
        save_file(tensors, str(tmp_path / f"{name}.safetensors"), metadata={"settings": settings})
        with pytest.raises(ValueError, match=f"{name}.safetensors is not a readable datastore"):
            Datastore.load(tmp_path / f"{name}.safetensors")


def test_every_lengths_index_holds_each_ngrams_own_hash_and_nothing_across_a_separator():
    """The rolled index (each length's hashes from the shorter one's) against each n-gram hashed alone."""
    from medusa_infer.datastore import ngram_hash

    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 6, (240,), generator=generator)
    tokens[torch.rand(240, generator=generator) < 0.08] = SEPARATOR
    store = Datastore(tokens, min_ngram=2, max_ngram=12)
    index = store._build()
    assert sorted(index) == list(range(2, 13))
    listed = tokens.tolist()
    for n, (keys, ends) in index.items():
        wanted = sorted((ngram_hash(listed[e - n : e], store.modulus), e) for e in range(n, len(listed))
                        if SEPARATOR not in listed[e - n : e + 1])
        assert sorted(zip(keys.tolist(), ends.tolist())) == wanted, n
        assert keys.tolist() == sorted(keys.tolist())


def test_build_datastore_keeps_whole_conversations():
    store = build_datastore([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5]}])
    assert store.tokens.tolist() == [1, 2, 3, SEPARATOR, 4, 5, SEPARATOR]
    with pytest.raises(ValueError, match="no tokens"):
        build_datastore([])


def test_rows_distilled_with_another_template_or_system_prompt_are_refused():
    plain = [{"id": 1, "prompt": "a", "response": "b", "generation": {"chat_template": None, "system_prompt": None}}]
    check_rows(plain, None, None)  # built as distilled
    check_rows([{"prompt": "a", "response": "b"}], "{{ x }}", "Be brief.")  # no record: taken as they are
    with pytest.raises(ValueError, match="--chat-template ''"):  # distilled with the tokenizer's own
        check_rows(plain, "{{ messages }}", None)
    vicuna = [{"id": 2, "prompt": "a", "response": "b",
               "generation": {"chat_template": template_digest("T"), "system_prompt": "Be brief."}}]
    check_rows(vicuna, "T", "Be brief.")
    with pytest.raises(ValueError, match="--system-prompt"):
        check_rows(vicuna, "T", None)
    with pytest.raises(ValueError, match="--chat-template FILE"):
        check_rows(vicuna, None, "Be brief.")


def test_ctrl_c_ends_the_builder_with_a_line(tmp_path, capsys, monkeypatch):
    """Ctrl-C ended python -m medusa_train.datastore with a traceback."""
    import medusa_train.datastore as builder

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(builder, "build_datastore", interrupted)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": 1, "input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8]}) + "\n")
    MedusaConfig(num_heads=1, hidden_size=576, vocab_size=49152,
                 base_model_name_or_path="smollm2-135m-instruct").save(tmp_path / "config.json")
    try:
        assert main(["--heads", str(tmp_path), "--rows", str(rows)]) == 130
    except KeyboardInterrupt:  # (escaping, it would stop the whole test session)
        pytest.fail("Ctrl-C escaped main() as a traceback")
    assert "medusa_train.datastore: interrupted" in capsys.readouterr().err
    assert not (tmp_path / DATASTORE_NAME).exists()


def test_the_builder_renders_rows_as_the_heads_recipe_did(tmp_path, capsys):
    recipe = {"model": {"chat_template": None}, "data": {"system_prompt": "Be brief.", "max_length": 64}}
    MedusaConfig(num_heads=1, hidden_size=576, vocab_size=49152, base_model_name_or_path="smollm2-135m-instruct",
                 training={"recipe": recipe}).save(tmp_path / "config.json")
    rows = tmp_path / "rows.jsonl"
    generation = {"chat_template": None, "system_prompt": "Be brief."}
    rows.write_text(json.dumps({"id": 1, "prompt": "Name a colour.", "response": "Blue " * 100,
                                "generation": generation}) + "\n")
    assert main(["--heads", str(tmp_path), "--rows", str(rows)]) == 0
    store = Datastore.load(tmp_path / DATASTORE_NAME)
    tokens = store.tokens[:-1].tolist()
    assert len(tokens) == 64  # the recipe's max_length
    system = load_tokenizer("smollm2-135m-instruct")("Be brief.", add_special_tokens=False)["input_ids"]
    assert store.occurrences(system[:2])  # the recipe's system prompt was rendered
    rows.write_text(json.dumps({"id": 1, "prompt": "Name a colour.", "response": "Blue.",
                                "generation": {**generation, "system_prompt": None}}) + "\n")
    with pytest.raises(SystemExit):  # distilled without it: refused, naming the way out
        main(["--heads", str(tmp_path), "--rows", str(rows)])
    assert "pass --system-prompt ''" in capsys.readouterr().err
    assert main(["--heads", str(tmp_path), "--rows", str(rows), "--system-prompt", ""]) == 0
    assert not Datastore.load(tmp_path / DATASTORE_NAME).occurrences(system[:2])
    # the card says what the store now holds, and where it came from (it said nothing, or an earlier store's)
    card = (tmp_path / "README.md").read_text()
    stored = Datastore.load(tmp_path / DATASTORE_NAME)
    assert card.count("## Datastore") == 1 and f"holds {len(stored)} tokens" in card
    assert stored.origin == "written by `python -m medusa_train.datastore` from the conversations in rows.jsonl"
    assert stored.origin in card
    # FasterDecoding-layout heads: no recipe, the defaults (the rows carry no record either)
    layout = tmp_path / "layout"
    layout.mkdir()
    # an export of the default model names its Hub id, and medusa-forge's own name beside it, which
    # the builder reads as from_pretrained does (offline, the Hub id could not be loaded)
    (layout / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                    "base_model_name_or_path": "HuggingFaceTB/No-Such-Model",
                                                    BASE_MODEL_KEY: "smollm2-135m-instruct"}))
    rows.write_text(json.dumps({"prompt": "Name a colour.", "response": "Blue."}) + "\n")
    assert main(["--heads", str(layout), "--rows", str(rows)]) == 0
    assert (layout / DATASTORE_NAME).is_file()
    # heads that carry the template they were trained on (a recipe's): built with it, no flag needed
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    own = tmp_path / "own"
    own.mkdir()
    MedusaConfig(num_heads=1, hidden_size=576, vocab_size=49152, base_model_name_or_path="smollm2-135m-instruct",
                 chat_template=template).save(own / "config.json")
    rows.write_text(json.dumps({"prompt": "Name a colour.", "response": "Blue.", "generation": {
        "chat_template": template_digest(template), "system_prompt": None}}) + "\n")
    assert main(["--heads", str(own), "--rows", str(rows)]) == 0
    expected = load_tokenizer("smollm2-135m-instruct")("user: Name a colour.\nassistant: Blue.\n",
                                                       add_special_tokens=False)["input_ids"]
    assert Datastore.load(own / DATASTORE_NAME).tokens[:-1].tolist() == expected
    # no conversation left (every prompt past --max-length, or no rows): said as a usage error, with the
    # counts (a traceback said "the examples are empty")
    for text, says in ((rows.read_text(), "1 rows in .*: 1 dropped with a prompt that fills --max-length=4$"),
                       ("", "0 rows in .*: none given$")):
        rows.write_text(text)
        capsys.readouterr()
        with pytest.raises(SystemExit):
            main(["--heads", str(own), "--rows", str(rows), "--max-length", "4"])
        assert re.search("no conversation to build a datastore from: " + says, capsys.readouterr().err.strip())


def test_the_builder_stores_ready_examples_as_they_are(tmp_path, capsys):
    """Heads trained on a recipe's data.tokenized got their store from those examples, and the builder refused
    them ("row '?' has neither 'messages' nor 'prompt'"), naming no way to rebuild it."""
    MedusaConfig(num_heads=1, hidden_size=576, vocab_size=49152, base_model_name_or_path="smollm2-135m-instruct",
                 training={"recipe": {"data": {"max_length": 4}}}).save(tmp_path / "config.json")
    ready = tmp_path / "examples.jsonl"
    ready.write_text(json.dumps({"input_ids": [1, 2, 3, 4, 5], "labels": [-100, -100, 3, 4, 5]}) + "\n"
                     + json.dumps({"input_ids": [7, 8, 9], "labels": [-100, 8, 9]}) + "\n")
    assert main(["--heads", str(tmp_path), "--rows", str(ready)]) == 0
    store = Datastore.load(tmp_path / DATASTORE_NAME)
    assert store.tokens.tolist() == [1, 2, 3, 4, SEPARATOR, 7, 8, 9, SEPARATOR]  # cut to the recipe's max_length
    assert store.origin.startswith("written by `python -m medusa_train.datastore` from the ready examples in")
    assert "2 conversations of 2 rows (1 cut to --max-length=4 tokens)" in capsys.readouterr().out
    conversation = tmp_path / "mixed.jsonl"
    conversation.write_text(ready.read_text() + json.dumps({"prompt": "Name a colour.", "response": "Blue."}) + "\n")
    for arguments, says in (([str(conversation)], "mix ready examples (input_ids; row 1) with conversations (row 3)"),
                            ([str(ready), "--system-prompt", "Be brief."], "drop --system-prompt")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--heads", str(tmp_path), "--rows", *arguments])
        assert exit_info.value.code == 2 and says in capsys.readouterr().err


def test_the_builders_bad_inputs_are_usage_errors_and_it_loads_the_recipes_remote_code(tmp_path, capsys,
                                                                                        monkeypatch):
    """A missing or bad rows file and a bad --max-length were tracebacks; a tokenizer needing its repository's
    code could not be loaded (the recipe's model.trust_remote_code was not read, and no flag set it)."""
    import medusa_infer.models

    recipe = {"model": {"trust_remote_code": True}, "data": {"max_length": 64}}
    MedusaConfig(num_heads=1, hidden_size=576, vocab_size=49152, base_model_name_or_path="smollm2-135m-instruct",
                 training={"recipe": recipe}).save(tmp_path / "config.json")
    rows = tmp_path / "rows.jsonl"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    rows.write_text(json.dumps({"prompt": "Name a colour.", "response": "Blue."}) + "\n")
    for arguments, says in (([str(tmp_path / "missing.jsonl")], "No such file"), ([str(bad)], "bad.jsonl:1"),
                            ([str(rows), "--max-length", "0"], "--max-length must be at least 2 tokens, got 0"),
                            ([str(rows), "--chat-template", str(tmp_path / "missing.jinja")], "missing.jinja")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--heads", str(tmp_path), "--rows", *arguments])
        assert exit_info.value.code == 2 and says in capsys.readouterr().err
    asked = []
    real = medusa_infer.models.load_tokenizer
    monkeypatch.setattr(medusa_infer.models, "load_tokenizer",
                        lambda name, trust_remote_code=False: asked.append(trust_remote_code) or real(name))
    assert main(["--heads", str(tmp_path), "--rows", str(rows)]) == 0
    assert main(["--heads", str(tmp_path), "--rows", str(rows), "--no-trust-remote-code"]) == 0
    assert asked == [True, False]
    # rows cut to --max-length are said (only a build left with none was)
    rows.write_text(json.dumps({"prompt": "Name a colour.", "response": "Blue " * 100}) + "\n")
    capsys.readouterr()
    assert main(["--heads", str(tmp_path), "--rows", str(rows)]) == 0
    assert "conversations of 1 rows (1 cut to --max-length=64 tokens)" in capsys.readouterr().out
    # built with another model's tokenizer (--model), the store was written over a working one, and the heads' folder
    # then no longer loaded
    from tiny import metaspace_tokenizer

    metaspace_tokenizer().save_pretrained(tmp_path / "other")
    before = (tmp_path / "datastore.safetensors").read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        main(["--heads", str(tmp_path), "--rows", str(rows), "--model", str(tmp_path / "other")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "built with --model" in err and "nothing was written" in err, err
    assert (tmp_path / "datastore.safetensors").read_bytes() == before


def test_gated_matches_choose_between_prompt_and_datastore():
    store = Datastore.from_sequences([[1, 2, 3, 4, 5, 6, 7]])
    history = [9, 2, 3, 8, 1, 2, 3]  # the prompt has "2 3" -> 8; the store "1 2 3" -> 4 5 6 7
    assert gated_matches([history], 3, 1, 4, None) == [(("prompt", 2), [8, 1, 2, 3])]
    assert gated_matches([history], 3, 1, 4, None, datastore=store) == [(("datastore", 3, "single"), [4, 5, 6, 7])]
    tie = [9, 2, 3, 8, 5, 2, 3]  # "2 3" in both: the prompt's match
    assert gated_matches([tie], 3, 1, 4, None, datastore=store) == [(("prompt", 2), [8, 5, 2, 3])]
    assert gated_matches([[9, 9, 1, 2]], 3, 2, 4, None, datastore=store) == [(("datastore", 2, "single"), [3, 4, 5, 6])]
    gate = LookupGate(GPU_COST)
    for _ in range(10):
        gate.record(("prompt", 2), 0, 4)  # the prompt's 2-gram matches fail
        gate.record(("datastore", 3, "single"), 4, 4)  # the store's 3-gram matches hold
    assert gated_matches([history], 3, 1, 4, gate, datastore=store) == [(("datastore", 3, "single"), [4, 5, 6, 7])]
    assert gated_matches([[5, 9]], 3, 2, 4, gate, datastore=store) == [(("prompt", 0), [])]
    longer = [9, 5, 6, 1, 2, 3, 4, 5, 6]  # the prompt's "5 6" against the store's "1 2 3 4 5 6": the longer wins
    assert gated_matches([longer], 3, 1, 4, None, datastore=store) == [(("datastore", 6, "single"), [7])]


def test_the_gate_measures_each_confidence_class_apart():
    # "1 2" is followed by 3 four times out of five; "5 6" by three different tokens
    store = Datastore.from_sequences([[1, 2, 3, 4]] * 4 + [[1, 2, 9, 9], [5, 6, 7], [5, 6, 8], [5, 6, 4]])
    gate = LookupGate(CPU_COST, probe_every=100)
    for _ in range(20):
        gate.record(("datastore", 2, "high"), 2, 2)  # confident drafts hold
        gate.record(("datastore", 2, "low"), 0, 2)  # split votes fail
    assert gated_matches([[0, 1, 2]], 2, 2, 2, gate, datastore=store) == [(("datastore", 2, "high"), [3, 4])]
    assert gated_matches([[0, 5, 6]], 2, 2, 2, gate, datastore=store) == [(("datastore", 2, "low"), [])]  # refused


def test_a_refused_source_is_still_probed_beside_another():
    store = Datastore.from_sequences([[1, 2, 3, 4, 5, 6, 7]])
    gate = LookupGate(CPU_COST, probe_every=4)
    for _ in range(10):
        gate.record(("prompt", 2), 0, 4)  # never right
        gate.record(("datastore", 3, "single"), 0, 4)  # never right either
    history = [9, 2, 3, 8, 1, 2, 3]  # a prompt match and a store match every step
    chosen = [gated_matches([history], 3, 1, 4, gate, datastore=store)[0] for _ in range(8)]
    verified = [key for key, draft in chosen if draft]
    assert len(verified) == 2 and len(set(verified)) == 1  # one source, probed every 4th refusal
    assert sum(gate.refused.values()) == 8


def test_gates_merge_their_counts():
    a, b = LookupGate(CPU_COST), LookupGate(CPU_COST)
    a.record(("prompt", 1), 2, 4)
    b.record(("prompt", 1), 4, 4)
    b.record(("datastore", 3, "single"), 1, 2)
    a.merge(b)
    assert a.drafts == {("prompt", 1): 2, ("datastore", 3, "single"): 1}
    assert a.accepted == {("prompt", 1): 6, ("datastore", 3, "single"): 1}
    assert a.stops == {("prompt", 1): 1, ("datastore", 3, "single"): 1}


def test_lookup_from_the_models_own_answer_is_exact_and_accepted():
    target = target_model("llama")
    prompt = torch.arange(3, 13)  # nothing repeats: prompt lookup alone finds little
    answer = reference(target, prompt, 40)
    plain = generate(target, prompt[None], max_new_tokens=40, eos_token_id=NO_EOS,
                     proposer=LookupProposer(target, num_tokens=6))
    store = Datastore.from_sequences([prompt.tolist() + answer])  # the model answered this before
    proposer = LookupProposer(target, num_tokens=6, datastore=store)
    out = generate(target, prompt[None], max_new_tokens=40, eos_token_id=NO_EOS, proposer=proposer)
    assert out.new_tokens[0] == plain.new_tokens[0] == answer
    assert out.metrics.tau > plain.metrics.tau + 1.0
    wrong = [t + 1 if i % 3 == 2 else t for i, t in enumerate(prompt.tolist() + answer)]  # drafts that fail
    gated = LookupProposer(target, num_tokens=6, datastore=Datastore.from_sequences([wrong]), cost=GPU_COST)
    again = generate(target, prompt[None], max_new_tokens=40, eos_token_id=NO_EOS, proposer=gated)
    assert again.new_tokens[0] == answer
    assert any(key[0] == "datastore" for key in gated.gate.drafts)


def test_medusa_lookup_uses_the_models_datastore_and_it_is_saved_with_the_heads(tmp_path):
    target = target_model("llama")
    model = random_heads(target)
    prompt = torch.arange(3, 13)
    answer = reference(target, prompt, 40)
    model.datastore = Datastore.from_sequences([prompt.tolist() + answer])
    runs = {}
    for use in (False, True):
        proposer = build_proposer("medusa", model, SimpleNamespace(tree=GRAFT_TREE, adaptive=False, lookup_tokens=4,
                                                                   datastore=use))
        assert isinstance(proposer, MedusaProposer) and (proposer.datastore is model.datastore) == use
        runs[use] = generate(model, prompt[None], max_new_tokens=40, eos_token_id=NO_EOS, proposer=proposer)
        assert runs[use].new_tokens[0] == answer
    assert runs[True].metrics.tau > runs[False].metrics.tau + 1.0
    assert build_proposer("lookup", model).datastore is model.datastore
    model.save_pretrained(tmp_path / "heads")
    loaded = MedusaModel.from_pretrained(tmp_path / "heads", base_model=target.base_model)
    assert torch.equal(loaded.datastore.tokens, model.datastore.tokens)
    model.datastore = Datastore.from_sequences([[1, 2, 3, 10_000]])  # another tokenizer's ids
    model.save_pretrained(tmp_path / "heads")
    with pytest.raises(ValueError, match="token id 10000, outside this model's vocabulary"):
        MedusaModel.from_pretrained(tmp_path / "heads", base_model=target.base_model)
    # unread (--no-datastore): a store that does not load stops nothing; one cut short either (a killed build left
    # one, written in place: it is written beside and moved in now)
    unread = MedusaModel.from_pretrained(tmp_path / "heads", base_model=target.base_model, datastore=False)
    assert unread.datastore is None and unread.heads is not None
    store = tmp_path / "heads" / DATASTORE_NAME
    store.write_bytes(store.read_bytes()[: store.stat().st_size // 2])
    unreadable = r"is not a readable datastore .* or delete it \(--no-datastore, or from_pretrained's datastore=False"
    with pytest.raises(ValueError, match=unreadable):
        MedusaModel.from_pretrained(tmp_path / "heads", base_model=target.base_model)
    assert MedusaModel.from_pretrained(tmp_path / "heads", base_model=target.base_model, datastore=False).heads
    # loaded without reading the store and saved back where they came from: the store stays (it was deleted)
    model.datastore = Datastore.from_sequences([prompt.tolist() + answer])
    model.save_pretrained(tmp_path / "heads")
    unread = MedusaModel.from_pretrained(tmp_path / "heads", base_model=target.base_model, datastore=False)
    unread.save_pretrained(tmp_path / "heads")
    unread.save_pretrained(tmp_path / "elsewhere")
    assert torch.equal(Datastore.load(store).tokens, model.datastore.tokens)
    assert not (tmp_path / "elsewhere" / DATASTORE_NAME).exists()
    card = (tmp_path / "heads" / "README.md").read_text()  # and the card still says what it holds (it lost that)
    assert card.count("## Datastore") == 1 and f"holds {len(model.datastore)} tokens" in card
    (tmp_path / "heads" / "README.md").write_bytes(card.encode() + b"\xff edited in Latin-1\n")  # (read to keep the
    unread.save_pretrained(tmp_path / "heads")  # section: a UnicodeDecodeError, nothing saved)
    assert "## Datastore" in (tmp_path / "heads" / "README.md").read_text()
    # the store it left unread deleted since: a store where it saves is another's (a FileNotFoundError, after
    # the heads were written)
    model.save_pretrained(tmp_path / "other")
    store.unlink()
    unread.save_pretrained(tmp_path / "other")
    assert not (tmp_path / "other" / DATASTORE_NAME).exists()
    (tmp_path / "alone").mkdir()
    saved = Datastore.from_sequences([[1, 2, 3]]).save(tmp_path / "alone" / DATASTORE_NAME)
    assert [p.name for p in saved.parent.iterdir()] == [DATASTORE_NAME]  # no partial file left beside it
    model.datastore = None
    model.save_pretrained(tmp_path / "heads")  # the folder's old store goes with it
    assert not (tmp_path / "heads" / DATASTORE_NAME).exists()
    assert MedusaModel.from_pretrained(tmp_path / "heads", base_model=target.base_model).datastore is None


def test_the_card_says_where_a_datastore_set_in_code_comes_from(tmp_path):
    """A store set in code was described as the training split's conversations written by train_heads.py,
    on heads the same card called never trained; a second save with another store kept the first's count."""
    model = MedusaModel.from_base(target_model("llama").base_model, num_heads=2, base_model_name_or_path="org/x")
    model.datastore = Datastore.from_sequences([[3, 4, 5, 6]])
    model.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "text whose origin was not recorded" in card and "train_heads.py" not in card.split("## Datastore")[1]
    model.datastore = Datastore.from_sequences([[3, 4, 5, 6, 7, 8]], origin="my notes, CC-BY")
    model.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert card.count("## Datastore") == 1 and f"holds {len(model.datastore)} tokens of text" in card
    assert "my notes, CC-BY" in card
    assert MedusaModel.from_pretrained(tmp_path, base_model=model.base_model).datastore.origin == "my notes, CC-BY"


def test_exporting_the_faster_decoding_layout_says_it_leaves_the_datastore_out(tmp_path, caplog):
    model = MedusaModel.from_base(target_model("llama").base_model, num_heads=2, base_model_name_or_path="org/x")
    model.datastore = Datastore.from_sequences([[3, 4, 5, 6]])
    model.export_medusa_layout(tmp_path / "fd")
    assert "lookup datastore (4 entries) is not part of the layout" in caplog.text
    assert not (tmp_path / "fd" / DATASTORE_NAME).exists()


def test_merged_medusa_proposers_keep_both_gates_counts():
    model = random_heads(target_model("llama"))
    model.config.cost_profile = CPU_COST.to_dict()
    a, b = (MedusaProposer(model, GRAFT_TREE, lookup_tokens=4) for _ in range(2))
    for p in (a, b):
        p.start(None, torch.randn(1, model.config.hidden_size))
    b.gate.record(("prompt", 2), 3, 4)
    a.merge(b)
    assert a.gate.drafts == {("prompt", 2): 1} and a.hidden.shape[0] == 2
    context = StepContext([[1, 2, 3, 1, 2], [4, 5, 4]], 8)
    assert a.propose(torch.tensor([3, 5]), context).tree.num_nodes > 1 + len(GRAFT_TREE)


def test_proposers_refuse_a_store_of_another_vocabulary_and_merges_of_other_settings():
    """A store set directly (``model.datastore = ...``, ``datastore=``), not loaded with the heads, is checked
    too: its out-of-vocabulary ids failed in the embedding, an IndexError naming no store. Batches of
    proposers with other lookup settings are not joined (the joined rows drafted with the first's)."""
    model = random_heads(target_model("llama"))
    outside = Datastore.from_sequences([[1, 2, 3, 10_000]])
    with pytest.raises(ValueError, match="the datastore holds token id 10000, outside this model's vocabulary"):
        LookupProposer(model, datastore=outside)
    model.datastore = outside
    with pytest.raises(ValueError, match="token id 10000, outside this model's vocabulary"):
        build_proposer("medusa", model, SimpleNamespace(tree=GRAFT_TREE, adaptive=False, lookup_tokens=4))
    store = Datastore.from_sequences([[1, 2, 3, 4]])
    for a, b in ((LookupProposer(model, num_tokens=4), LookupProposer(model, num_tokens=2)),
                 (LookupProposer(model, min_ngram=1), LookupProposer(model, min_ngram=2)),
                 (LookupProposer(model), LookupProposer(model, datastore=store))):
        with pytest.raises(ValueError, match="cannot merge lookup proposers with different settings"):
            a.merge(b)
    LookupProposer(model, datastore=store).merge(LookupProposer(model, datastore=store))
    a, b = MedusaProposer(model, GRAFT_TREE, lookup_tokens=4), MedusaProposer(model, GRAFT_TREE, lookup_tokens=4,
                                                                              datastore=store)
    with pytest.raises(ValueError, match="different lookup settings"):
        a.merge(b)


def test_a_store_built_with_another_tokenizer_is_refused_at_load(tmp_path, caplog):
    """The store records its tokenizer's fingerprint: with heads on a model whose tokenizer differs (ids
    standing for other text, all within the vocabulary), loading is refused; with the same one it loads."""
    from tiny import metaspace_tokenizer, word_medusa

    from medusa_infer.datastore import tokenizer_digest
    from medusa_train.datastore import build_datastore

    model = word_medusa()
    other = metaspace_tokenizer()
    assert tokenizer_digest(other) != tokenizer_digest(model.tokenizer)
    assert tokenizer_digest(model.tokenizer) == tokenizer_digest(word_medusa().tokenizer)
    examples = [{"input_ids": other("the cat sat on the mat")["input_ids"]}]
    model.datastore = build_datastore(examples, other)
    model.save_pretrained(tmp_path / "heads")
    assert Datastore.load(tmp_path / "heads" / DATASTORE_NAME).tokenizer == tokenizer_digest(other)
    with pytest.raises(ValueError, match="was built with another tokenizer than this model's"):
        MedusaModel.from_pretrained(tmp_path / "heads", base_model=model.base_model, tokenizer=model.tokenizer)
    model.datastore = build_datastore([{"input_ids": model.tokenizer("the cat sat")["input_ids"]}], model.tokenizer)
    model.save_pretrained(tmp_path / "heads")
    loaded = MedusaModel.from_pretrained(tmp_path / "heads", base_model=model.base_model, tokenizer=model.tokenizer)
    assert loaded.datastore.tokenizer == tokenizer_digest(model.tokenizer)
    # a base model object and no tokenizer: nothing to check the store against, which is said (it loaded silently)
    with caplog.at_level("WARNING"):
        MedusaModel.from_pretrained(tmp_path / "heads", base_model=model.base_model)
    assert "datastore.safetensors was not checked against the model's tokenizer" in caplog.text
    # a tokenizer that only added tokens since (a pad token for batches): its ids stand for the same text; the
    # whole heads folder was refused, and the fix given (a rebuild with the stock tokenizer) was refused again
    extended = word_medusa().tokenizer
    extended.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    assert tokenizer_digest(extended) != tokenizer_digest(model.tokenizer)
    loaded = MedusaModel.from_pretrained(tmp_path / "heads", base_model=model.base_model, tokenizer=extended)
    assert loaded.datastore.tokenizer_size == len(model.tokenizer.get_vocab())
    renamed = word_medusa().tokenizer  # the same ids, one standing for other text: still refused
    vocab = renamed.get_vocab()
    assert "five" in vocab
    backend = json.loads(renamed.backend_tokenizer.to_str())
    backend["model"]["vocab"] = {("fivex" if word == "five" else word): i
                                 for word, i in backend["model"]["vocab"].items()}
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    renamed = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(backend)))
    with pytest.raises(ValueError, match="was built with another tokenizer than this model's"):
        MedusaModel.from_pretrained(tmp_path / "heads", base_model=model.base_model, tokenizer=renamed)
    # a store of an earlier release, which recorded no size: every id compared (and the message says so)
    store = Datastore.load(tmp_path / "heads" / DATASTORE_NAME)
    store.tokenizer_size = None
    store.save(tmp_path / "heads" / DATASTORE_NAME)
    with pytest.raises(ValueError, match=r"or, for a store that records no tokenizer size, tokens were added since"):
        MedusaModel.from_pretrained(tmp_path / "heads", base_model=model.base_model, tokenizer=extended)
    # a store of commit a28f3b2, whose settings held the digest: refused as "not whole numbers"
    from safetensors.torch import save_file

    settings = {"min_ngram": 2, "max_ngram": 6, "max_occurrences": 256, "min_share": 0.3,
                "tokenizer": tokenizer_digest(model.tokenizer)}
    save_file({"tokens": torch.tensor([5, 6, 7, -1], dtype=torch.int32)}, str(tmp_path / "old.safetensors"),
              metadata={"settings": json.dumps(settings)})
    assert Datastore.load(tmp_path / "old.safetensors").tokenizer == tokenizer_digest(model.tokenizer)

    class BytesVocab:  # tiktoken-based remote-code tokenizers (Qwen v1's): get_vocab() keys are bytes
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    one, two = BytesVocab({b"a": 0, b"\xe4\xbd": 1}), BytesVocab({b"a": 0, b"\xe4\xbe": 1})
    assert build_datastore([{"input_ids": [0, 1, 0]}], one).tokenizer == tokenizer_digest(one) != tokenizer_digest(two)


def test_a_draft_goes_on_at_exactly_min_share_and_an_id_at_the_vocabulary_size_is_refused():
    """The draft continues at a share of at least min_share (it stopped at exactly it); an id equal to the
    vocabulary's size is past it (it was taken, and would fail in the embedding)."""
    store = Datastore.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7]], min_ngram=2, max_ngram=2, min_share=0.5)
    assert store.match([1, 2], 5).draft == [3, 6, 7]  # 6 and 4 each half of the occurrences: the latest wins
    with pytest.raises(ValueError, match="token id 8, outside"):
        Datastore.from_sequences([[1, 2, 8]]).check_vocabulary(8, "store")
    Datastore.from_sequences([[1, 2, 7]]).check_vocabulary(8, "store")


def test_a_store_of_tokens_without_a_final_separator_drafts_to_their_end():
    """Tokens given directly (not from_sequences) may not end with the separator: drafts stop at the end."""
    store = Datastore(torch.tensor([1, 2, 3, 1, 2]), min_ngram=1, max_ngram=2)
    match = store.match([1, 2], limit=10)
    assert (match.n, match.draft) == (2, [3, 1, 2])
    assert len(store) == 5
    assert store.match([2], limit=10).draft == [3, 1, 2]



def heads_folder(path, **config):
    path.mkdir(exist_ok=True)
    MedusaConfig(num_heads=1, hidden_size=576, **{"vocab_size": 49152, **config},
                 base_model_name_or_path="smollm2-135m-instruct").save(path / "config.json")
    return path


def test_every_rows_file_given_is_built_and_the_counts_are_said(tmp_path, capsys):
    """--rows takes several files: each one's conversations go into the store (none silently left out), and the
    last line counts conversations and rows apart (a row dropped is one row, no conversation)."""
    heads = heads_folder(tmp_path / "heads")
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    one.write_text(json.dumps({"prompt": "Name a colour.", "response": "Blue."}) + "\n")
    two.write_text(json.dumps({"prompt": "Name a fruit.", "response": "Apple."}) + "\n"
                   + json.dumps({"prompt": "word " * 100, "response": "Pear."}) + "\n")
    assert main(["--heads", str(heads), "--rows", str(one), str(two), "--max-length", "64"]) == 0
    out = capsys.readouterr().out
    assert "from 2 conversations of 3 rows (1 dropped with a prompt that fills --max-length=64)" in out, out
    tokens = Datastore.load(heads / DATASTORE_NAME).tokens.tolist()
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    for prompt in ("Name a colour.", "Name a fruit."):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert any(tokens[i:i + len(ids)] == ids for i in range(len(tokens))), prompt
    store = Datastore.load(heads / DATASTORE_NAME)
    assert store.origin.endswith("one.jsonl, two.jsonl")


def test_a_store_outside_the_heads_vocabulary_is_refused_and_nothing_is_written(tmp_path, capsys):
    heads = heads_folder(tmp_path / "heads", vocab_size=100)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "Name a colour.", "response": "Blue."}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--heads", str(heads), "--rows", str(rows)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "outside this model's vocabulary of 100" in err and "nothing was written" in err
    assert not (heads / DATASTORE_NAME).exists()
    # from a review: the load's advice (--no-datastore, which this command lacks, and a rebuild with this very
    # command) and "drop --model" where none was given
    assert "--no-datastore" not in err and "rebuild it with" not in err and "drop --model" not in err
    assert "correct base_model_name_or_path there, or give --model, the model the heads were trained on" in err


def test_the_builders_advice_names_its_own_flags(tmp_path, capsys):
    """From a review: its usage named it datastore.py, and rows rendered by another template, or a tokenizer without
    one, were told of a recipe's model.chat_template and of tokenizer.chat_template, not of --chat-template."""
    from tiny import tiny_model

    from medusa_infer.serving.testing import word_tokenizer

    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m medusa_train.datastore")
    heads = heads_folder(tmp_path / "heads", vocab_size=100)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "Name a colour.", "response": "Blue.",
                                "prompt_template": "sha256:deadbeef"}) + "\n")
    with pytest.raises(SystemExit):
        main(["--heads", str(heads), "--rows", str(rows)])
    err = capsys.readouterr().err
    assert "--chat-template FILE" in err and "in a recipe" not in err, err
    tokenizer = word_tokenizer()
    tokenizer.chat_template = None
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "plain")
    tokenizer.save_pretrained(tmp_path / "plain")
    rows.write_text(json.dumps({"prompt": "the cat", "response": "sat"}) + "\n")
    with pytest.raises(SystemExit):
        main(["--heads", str(heads), "--rows", str(rows), "--model", str(tmp_path / "plain")])
    err = capsys.readouterr().err
    assert "has no chat template; give the template to render the conversations with: --chat-template FILE" in err


def test_an_empty_chat_template_selects_the_tokenizers_own(tmp_path):
    """--chat-template '' (documented): rows distilled with the tokenizer's own template are built with it even
    where the heads record another."""
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    heads = heads_folder(tmp_path / "heads", chat_template=template)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "Name a colour.", "response": "Blue.",
                                "generation": {"chat_template": None, "system_prompt": None}}) + "\n")
    assert main(["--heads", str(heads), "--rows", str(rows), "--chat-template", ""]) == 0
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    own = tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."},
                                         {"role": "assistant", "content": "Blue."}], tokenize=False)
    tokens = Datastore.load(heads / DATASTORE_NAME).tokens[:-1].tolist()
    assert tokenizer.decode(tokens) in own and "user: Name a colour." not in tokenizer.decode(tokens)


def test_a_folder_without_config_json_is_a_usage_error(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--heads", str(tmp_path / "nothing"), "--rows", str(rows)])
    assert exit_info.value.code == 2 and "has no config.json: not a heads folder" in capsys.readouterr().err


def test_a_model_folder_or_a_broken_config_is_a_usage_error_and_nothing_is_written(tmp_path, capsys):
    """Any folder with a config.json was taken for heads: a base model's folder got datastore.safetensors and a
    README section written into it; a config.json that is no JSON ended in a traceback."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    folder = tmp_path / "model"
    folder.mkdir()
    for text, said in ((json.dumps({"model_type": "llama", "hidden_size": 64}), "holds a model's config.json "
                                                                                  "(model_type 'llama'), not heads"),
                       # GPT-Neo's config holds num_heads too
                       (json.dumps({"model_type": "gpt_neo", "num_heads": 4}), "(model_type 'gpt_neo'), not heads"),
                       (json.dumps(["x"]), "holds a config.json that is not a JSON object, not heads"),
                       (json.dumps({"hidden_size": 8}), "holds a config.json of another kind"),
                       ("{\n  'num_heads': 2\n", "config.json cannot be read as JSON")):
        (folder / "config.json").write_text(text)
        with pytest.raises(SystemExit) as exit_info:
            main(["--heads", str(folder), "--rows", str(rows), "--model", "unused"])
        assert exit_info.value.code == 2 and said in capsys.readouterr().err
        assert sorted(p.name for p in folder.iterdir()) == ["config.json"]


def test_a_card_note_cut_short_leaves_the_card_as_it_was(tmp_path, monkeypatch):
    """The datastore's section was appended by rewriting the card in place, after the heads were saved: a full disk
    left the card cut mid-line."""
    import errno

    from medusa_infer.checkpoint import note_datastore

    card = tmp_path / "README.md"
    card.write_text("# Heads\n\nWhat they are, at length.\n" * 20, encoding="utf-8")
    before = card.read_bytes()
    write_text = Path.write_text

    def full_disk(self, data, *args, **kwargs):
        if self.name.startswith("README.md"):
            write_text(self, data[:len(data) // 2], *args, **kwargs)
            raise OSError(errno.EFBIG, "File too large")
        return write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="File too large"):
        note_datastore(tmp_path, 100, "some text")
    assert card.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]
    monkeypatch.undo()
    note_datastore(tmp_path, 100, "some text")
    assert card.read_text(encoding="utf-8").startswith(before.decode()) and "holds 100 tokens" in card.read_text()
