"""``medusa-generate`` / ``python -m medusa_infer``: argument errors (no model load) and one real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from medusa_infer.cli import parse_args
from medusa_infer.proposers import build_proposer
from medusa_infer.proposers.lookup import LOOKUP_MAX_TOKENS


def parse_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "draft", "hi"], "--method draft needs --draft-model"),
        (["--method", "lookup", "--draft-model", "x", "hi"], "--draft-model is used by --method draft only"),
        (["--method", "beam", "hi"], "invalid choice: 'beam'"),
        (["--method", "lookup", "--draft-tokens", "0", "hi"], "--draft-tokens must be at least 1, got 0"),
        (["--method", "lookup", "--lookup-max-ngram", "0", "hi"], "--lookup-max-ngram must be at least 1"),
        (["--method", "layerskip", "--layerskip-layers", "-2", "hi"], "--layerskip-layers must be at least 1"),
        (["--method", "lookup", "--lookup-min-ngram", "4", "hi"], "--lookup-min-ngram must lie in [1, --lookup-max"),
        (["--method", "draft", "--draft-model", "x", "--draft-schedule", "fast", "hi"], "invalid choice: 'fast'"),
        (["--method", "medusa", "hi"], "--method medusa needs --heads"),
        (["--method", "lookup", "--lookup-tokens", "3", "hi"], "--lookup-tokens grafts lookup onto the Medusa "
                                                                "tree (--method medusa); with --method lookup use "
                                                                "--draft-tokens"),
        # autoregressive reads no --draft-tokens either: the advice led to a second refusal
        (["--method", "autoregressive", "--lookup-tokens", "3", "hi"], "autoregressive drop --lookup-tokens, or use "
                                                                        "--method lookup"),
        (["--heads", "h", "--lookup-tokens", "-1", "hi"], "--lookup-tokens must be >= 0"),
        (["--method", "lookup"], "give a prompt"),
        (["--temperature", "1.9", "--seed", "3", "hi"], "--temperature, --seed set the sampling, but without "
                                                        "--do-sample decoding is greedy: add --do-sample"),
        (["--top-p", "0.9", "hi"], "--top-p set the sampling"),
        (["--do-sample", "--temperature", "0", "--seed", "3", "hi"], "--seed shape sampling, and --temperature 0 "
                                                                      "decodes greedily"),
        (["--chat", "hi"], "--chat reads its prompts interactively; drop the prompt 'hi' or drop --chat"),
        # an unset shell variable: an empty user turn was answered
        ([""], "the prompt is empty (''): give the text to answer, or --chat"),
        (["  \n"], "the prompt is empty ('  \\n')"),
        (["--method", "lookup", "--tree", "chain-2", "hi"], "--tree shapes the Medusa heads' candidates"),
        (["--heads", "h", "--acceptance", "typical", "hi"], "--acceptance typical samples: add --do-sample"),
        (["--do-sample", "--temperature", "-1", "hi"], "temperature must be a finite number >= 0, got -1.0"),
        (["--do-sample", "--temperature", "nan", "hi"], "temperature must be a finite number >= 0, got nan"),
        (["--do-sample", "--top-p", "2", "hi"], "top_p must be in (0, 1], got 2.0"),
        (["--do-sample", "--top-p", "0", "hi"], "top_p must be in (0, 1], got 0.0"),
        (["--do-sample", "--top-k", "-3", "hi"], "top_k must be an integer >= 0 (0 disables it), got -3"),
        (["--heads", "h", "--do-sample", "--acceptance", "typical", "--top-p", "0.9", "hi"],
         "acceptance='typical' samples at the temperature only"),
        (["--acceptance", "greedy", "--do-sample", "--temperature", "0.5", "hi"],
         "--acceptance greedy takes the model's top token, so --do-sample --temperature would change nothing"),
        (["--raw", "--system", "be brief", "hi"], "--system goes into the chat template, which --raw leaves out"),
        # proposer flags the method would not read
        (["--draft-tokens", "7", "hi"], "--draft-tokens is read by --method draft / layerskip / lookup, not "
                                        "--method autoregressive; drop --draft-tokens"),
        (["--heads", "h", "--draft-tokens", "7", "hi"], "not --method medusa; drop --draft-tokens"),
        (["--method", "lookup", "--layerskip-layers", "3", "hi"], "--layerskip-layers is read by --method layerskip"),
        (["--method", "lookup", "--draft-schedule", "constant", "hi"], "--draft-schedule is read by --method draft / "
                                                                         "layerskip, not --method lookup"),
        (["--method", "layerskip", "--lookup-max-ngram", "2", "hi"], "--lookup-max-ngram is read by --method lookup"),
        (["--heads", "h", "--lookup-min-ngram", "2", "hi"], "--lookup-min-ngram shapes the lookup chain that "
                                                            "--lookup-tokens grafts onto the Medusa tree"),
        (["--no-datastore", "hi"], "--method autoregressive drafts none: drop --no-datastore"),
        (["--heads", "h", "--no-datastore", "hi"], "--method medusa drafts none: drop --no-datastore"),
        # (taken: the datastore comes only with heads)
        (["--method", "lookup", "--no-datastore", "hi"], "--no-datastore leaves out the datastore of a heads folder "
                                                         "(its datastore.safetensors), and no --heads is given"),
    ],
)
def test_bad_arguments_are_refused_before_loading_anything(capsys, argv, message):
    assert message in parse_error(capsys, argv)


def test_methods_and_options_are_parsed():
    args = parse_args(["--method", "lookup", "--draft-tokens", "6", "--lookup-max-ngram", "4",
                       "--lookup-min-ngram", "2", "hi"])
    assert (args.method, args.draft_tokens, args.lookup_max_ngram, args.lookup_min_ngram) == ("lookup", 6, 4, 2)
    args = parse_args(["--method", "layerskip", "--layerskip-layers", "8", "--draft-schedule", "constant",
                       "--do-sample", "--temperature", "0.7", "--top-p", "0.9", "hi"])
    assert (args.layerskip_layers, args.draft_schedule, args.do_sample, args.top_p) == (8, "constant", True, 0.9)
    assert parse_args(["hi"]).method == "autoregressive"
    assert parse_args(["--method", "draft", "--draft-model", "small", "hi"]).draft_model == "small"
    plain = parse_args(["hi"])  # the sampling flags, not given, take their defaults
    assert (plain.temperature, plain.top_p, plain.top_k, plain.seed) == (1.0, 1.0, 0, None)
    sampled = parse_args(["--method", "lookup", "--do-sample", "--temperature", "0.7", "--seed", "3", "--acceptance",
                          "typical", "hi"])
    assert (sampled.temperature, sampled.seed, sampled.acceptance) == (0.7, 3, "typical")


def test_a_medusa_turn_decodes_with_the_tree_given(monkeypatch, capsys):
    """--tree reaches the Medusa proposer run_turn builds (stream() refuses tree= beside a proposer)."""
    import medusa_infer.decoding as decoding
    from medusa_infer.cli import run_turn
    from tiny import word_medusa

    stream, trees = decoding.stream, []

    def spy(*a, proposer=None, **kw):
        trees.append(proposer.trees[-1].paths)  # the largest tree of its ladder
        return stream(*a, proposer=proposer, **kw)

    monkeypatch.setattr(decoding, "stream", spy)
    args = parse_args(["--heads", "h", "--tree", "chain-2", "--max-new-tokens", "3", "--raw", "hi"])
    result = run_turn(word_medusa(), args, None, "the cat sat on the mat")
    assert trees == [[(0,), (0, 0)]] and 1 <= len(result.new_tokens[0]) <= 3
    assert "[medusa]" in capsys.readouterr().err


def test_no_fallback_keeps_the_tree_given_on_calibrated_heads(capsys):
    import itertools

    from medusa_infer.proposers import build_proposer
    from medusa_infer.tree_fit import CostProfile
    from medusa_infer.trees import REFERENCE_HEAD_ACCURACY
    from tiny import word_medusa

    model = word_medusa()  # calibrated: the fallback would shrink the tree given
    model.config.head_accuracies = [list(itertools.accumulate(row)) for row in REFERENCE_HEAD_ACCURACY[:3]]
    model.config.cost_profile = CostProfile([1, 2, 4, 8, 16], [1.0, 1.12, 1.36, 1.6, 2.2], "2-core cpu").to_dict()
    adaptive = build_proposer("medusa", model, parse_args(["--heads", "h", "--tree", "tree-8", "hi"]))
    fixed = build_proposer("medusa", model, parse_args(["--heads", "h", "--tree", "tree-8", "--no-fallback", "hi"]))
    assert len(adaptive.trees) > 1 and adaptive.controller is not None
    assert len(fixed.trees) == 1 and fixed.controller is None and len(fixed.trees[0].paths) == 8
    with pytest.raises(SystemExit):
        parse_args(["--no-fallback", "hi"])
    assert "--no-fallback keeps the Medusa tree" in capsys.readouterr().err
    # --draft-tokens given to lookup on such heads caps the drafts its gate chooses (it went up to 16)
    lookup = build_proposer("lookup", model, parse_args(["--method", "lookup", "--draft-tokens", "1", "hi"]))
    assert lookup.gate is not None and lookup.max_tokens == 1
    assert build_proposer("lookup", model, parse_args(["--method", "lookup", "hi"])).max_tokens == 16


def test_errors_after_loading_are_reported_without_a_traceback(monkeypatch, capsys, tmp_path):
    """Heads that do not fit the model, and options the model refuses, end in ``error: ...`` and status 2."""
    import medusa_infer.cli as cli
    from medusa_infer.model import MedusaModel
    from medusa_infer.serving.testing import word_tokenizer
    from tiny import tiny_model, word_medusa

    tokenizer = word_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    MedusaModel.from_base(tiny_model("gpt2", vocab_size=len(tokenizer))).save_pretrained(tmp_path / "heads")
    assert cli.main(["--heads", str(tmp_path / "heads"), "--model", str(tmp_path / "base"), "--raw", "hi"]) == 2
    assert "medusa-generate: error: heads were trained for model type 'gpt2'" in capsys.readouterr().err
    # --no-datastore leaves a store that does not load unread (it stopped every method of the folder)
    MedusaModel.from_base(tiny_model("llama", vocab_size=len(tokenizer))).save_pretrained(tmp_path / "fitting")
    (tmp_path / "fitting" / "datastore.safetensors").write_bytes(b"cut short")
    given = ["--heads", str(tmp_path / "fitting"), "--model", str(tmp_path / "base"), "--method", "lookup",
             "--max-new-tokens", "3", "--raw", "hi"]
    assert cli.main(given) == 2 and "is not a readable datastore" in capsys.readouterr().err
    assert cli.main([*given, "--no-datastore"]) == 0
    # a method that drafts none leaves it unread too (it stopped them, and --no-datastore was refused for them)
    for method in (["--method", "medusa"], ["--method", "autoregressive"]):
        assert cli.main([*given[:4], *method, "--max-new-tokens", "3", "--raw", "hi"]) == 0, method
    assert cli.main([*given[:4], "--lookup-tokens", "2", "--max-new-tokens", "3", "--raw", "hi"]) == 2
    assert "is not a readable datastore" in capsys.readouterr().err
    # a default model that cannot be fetched (or whose cached copy is damaged) raises RuntimeError: a traceback
    from medusa_infer import models

    def unfetchable(name, **options):
        raise RuntimeError(f"could not fetch {name}: no index reachable")

    monkeypatch.setattr(models, "load_base_model", unfetchable)
    assert cli.main(["--max-new-tokens", "2", "hi"]) == 2
    assert "medusa-generate: error: could not fetch smollm2-135m-instruct" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setattr(cli, "load", lambda args: word_medusa())
    assert cli.main(["--heads", "h", "--tree", "[[0], [0, 0]", "--raw", "the cat"]) == 2  # a tree it cannot read
    assert "medusa-generate: error:" in capsys.readouterr().err
    tokenizer.chat_template = None
    monkeypatch.setattr(cli, "load", lambda args: MedusaModel.without_heads(word_medusa().base_model, tokenizer))
    assert cli.main(["--system", "be brief", "hi"]) == 2  # a tokenizer without a chat template
    assert "--system goes into the chat template, and this model's tokenizer has none" in capsys.readouterr().err
    from transformers import BloomConfig, BloomForCausalLM  # ALiBi, which tree attention cannot take: a traceback

    BloomForCausalLM(BloomConfig(vocab_size=len(tokenizer), hidden_size=32, n_layer=2, n_head=4)).save_pretrained(
        tmp_path / "bloom")
    word_tokenizer().save_pretrained(tmp_path / "bloom")
    monkeypatch.undo()
    assert cli.main(["--model", str(tmp_path / "bloom"), "--max-new-tokens", "2", "--raw", "the cat"]) == 2
    assert "medusa-generate: error: BloomForCausalLM (bloom) adds ALiBi" in capsys.readouterr().err


def test_what_a_model_folder_or_template_refuses_is_said_not_a_traceback(tmp_path, monkeypatch, capsys):
    """From a review of medusa-generate: a chat template that refuses a system message (Gemma 2's), weights cut
    short in the user's model folder, and heads in the FasterDecoding layout whose named base model moved away
    each ended in a traceback or an error that named neither the model nor the fix."""
    import json

    import medusa_infer.cli as cli
    from medusa_infer.model import MedusaModel
    from medusa_infer.serving.testing import word_tokenizer
    from tiny import tiny_model, word_medusa

    model = word_medusa()
    model.tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception("
                                     "'System role not supported') }}{% endif %}{{ m['content'] }} {% endfor %}")
    monkeypatch.setattr(cli, "load", lambda args: model)
    for chat in ([], ["--chat"]):
        assert cli.main(["--system", "be brief", "--max-new-tokens", "2", *(chat or ["the cat"])]) == 2
        assert ("medusa-generate: error: --system: the chat template refuses a system message (System role "
                "not supported): leave --system out") in capsys.readouterr().err
    # one that wants a system message first: jinja2's TemplateError was a traceback, at the first answer
    model.tokenizer.chat_template = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message "
                                     "must come first') }}{% endif %}{% for m in messages %}{{ m['content'] }} "
                                     "{% endfor %}")
    for chat in ([], ["--chat"]):
        assert cli.main(["--max-new-tokens", "2", *(chat or ["the cat"])]) == 2
        assert ("medusa-generate: error: the chat template wants a system message first (a system message must come "
                "first): give --system") in capsys.readouterr().err
    assert cli.main(["--system", "be brief", "--max-new-tokens", "2", "the cat"]) == 0
    capsys.readouterr()
    monkeypatch.undo()
    tokenizer = word_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    MedusaModel.from_base(str(tmp_path / "base")).export_medusa_layout(tmp_path / "fd")
    config = json.loads((tmp_path / "fd" / "config.json").read_text())
    config = {key: value for key, value in config.items() if not key.startswith("medusa_forge")}
    (tmp_path / "fd" / "config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(tmp_path / "x")}))
    assert cli.main(["--heads", str(tmp_path / "fd"), "--max-new-tokens", "2", "the cat"]) == 2
    assert (f"the base model '{tmp_path / 'x'}' that {tmp_path / 'fd'}/config.json names could not be loaded" in
            capsys.readouterr().err)
    weights = tmp_path / "base" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:3000])
    assert cli.main(["--model", str(tmp_path / "base"), "--max-new-tokens", "2", "the cat"]) == 2
    assert (f"medusa-generate: error: the weights in {tmp_path / 'base'} could not be read (" in
            capsys.readouterr().err)


def test_an_answer_a_terminals_encoding_cannot_show_is_written_escaped(tmp_path):
    """Under a cp1252 output (a Windows console, a file written there), an emoji ended the answer with exit 2 and
    "'charmap' codec can't encode character"."""
    from medusa_infer.serving.testing import WORDS, word_tokenizer
    from tiny import scripted_model

    tokenizer = word_tokenizer(WORDS + ("\U0001f389",))
    script = [tokenizer.convert_tokens_to_ids(token) for token in ("the", "\U0001f389", "cat")]
    model = scripted_model(tokenizer, script)
    model.base_model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    done = subprocess.run([sys.executable, "-m", "medusa_infer", "--model", str(tmp_path / "base"), "--raw",
                           "--max-new-tokens", "2", "the"], capture_output=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "cp1252"})
    assert done.returncode == 0, done.stderr.decode()[-1500:]
    assert done.stdout.decode("cp1252") == "\\U0001f389 cat\n"


def test_a_reader_that_goes_away_ends_medusa_generate_quietly(tmp_path):
    """`medusa-generate ... | head -c 1` printed "error: [Errno 32] Broken pipe" and exited 2."""
    from medusa_infer.serving.testing import word_tokenizer
    from tiny import tiny_model

    tokenizer = word_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    command = (f"{sys.executable} -m medusa_infer --model {tmp_path / 'base'} --max-new-tokens 400 --raw "
               "'the cat' | head -c 1")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert "error" not in done.stderr.lower() and "Traceback" not in done.stderr, done.stderr[-1500:]


def test_a_chat_line_that_is_not_utf8_is_left_out_under_a_strict_locale(tmp_path):
    """Under a UTF-8 locale stdin decodes strictly: a line that is not UTF-8 raised UnicodeDecodeError, ending the
    whole chat (a pipe is decoded in one chunk: the valid lines before it went unanswered too)."""
    from medusa_infer.serving.testing import word_tokenizer
    from tiny import tiny_model

    tokenizer = word_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    done = subprocess.run([sys.executable, "-m", "medusa_infer", "--model", str(tmp_path / "base"), "--chat", "--raw",
                           "--max-new-tokens", "2"], input=b"the cat\nthe \xff dog\nthe sun\n", capture_output=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "utf-8:strict"})
    err = done.stderr.decode()
    assert done.returncode == 0, err[-1500:]
    assert err.count("that line is not UTF-8 text") == 1 and err.count("[autoregressive]") == 2, err[-1500:]
    assert b"> " not in done.stdout  # no prompt written into the answers where the lines come from a pipe
    # a second chat in one process, stdin read from already (its errors could no longer be set: exit 2)
    twice = ("import sys; from medusa_infer.cli import main; "
             f"args = ['--model', {str(tmp_path / 'base')!r}, '--chat', '--raw', '--max-new-tokens', '2']; "
             "sys.exit(main(args) + main(args))")
    done = subprocess.run([sys.executable, "-c", twice], input=b"the cat\n\nthe sun\n", capture_output=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0 and done.stderr.decode().count("[autoregressive]") == 2, done.stderr[-1500:]


@pytest.mark.parametrize("tokenizer", ["words", "metaspace"])
def test_raw_chat_sends_the_whole_conversation(monkeypatch, capsys, tokenizer):
    """The next turn's text holds the answer as the model wrote it after the prompt: with a
    SentencePiece-style tokenizer an answer decoded alone loses its first word's space (it was
    glued to the prompt: 'the catwoman ...')."""
    import medusa_infer.cli as cli
    import medusa_infer.decoding as decoding
    from medusa_infer.model import MedusaModel
    from tiny import metaspace_tokenizer, tiny_model, word_medusa

    if tokenizer == "words":
        model = word_medusa()
    else:
        spaced = metaspace_tokenizer()
        model = MedusaModel.from_base(tiny_model("llama", seed=1, vocab_size=len(spaced)), num_heads=3,
                                      tokenizer=spaced)
    stream, prompts, streams = decoding.stream, [], []

    def spy(*a, prompt=None, **kw):
        prompts.append(prompt)
        streams.append(stream(*a, prompt=prompt, **kw))
        return streams[-1]

    lines = iter(["the cat", "the dog", ""])
    monkeypatch.setattr(decoding, "stream", spy)
    monkeypatch.setattr(cli, "load", lambda args: model)
    monkeypatch.setattr("builtins.input", lambda _: next(lines))
    assert cli.main(["--chat", "--raw", "--max-new-tokens", "3"]) == 0
    answer = capsys.readouterr().out.splitlines()[0]
    assert prompts[0] == "the cat" and prompts[1].startswith("the cat") and prompts[1].endswith("\nthe dog")
    assert prompts[1] == cli.raw_text([{"role": "user", "content": "the cat"},
                                       {"role": "assistant", "content": prompts[1][len("the cat"):-len("\nthe dog")]},
                                       {"role": "user", "content": "the dog"}])
    assert answer.strip() and len(prompts) == 2
    encode = lambda text: model.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    written = list(streams[0].result().new_tokens[0])
    assert encode(prompts[1][: -len("\nthe dog")]) == encode("the cat") + written


def test_a_chat_that_outgrows_the_context_goes_on_and_says_so(monkeypatch, capsys):
    """A turn whose prompt no longer fit ended medusa-generate with "does not fit the model's context", the
    conversation lost: the oldest exchanges are left out (the system message kept) with a note, leaving room
    for an answer; a line too long for the context alone is refused and the conversation kept as it was; an
    answer cut at the context's end says so (it did only by a smaller count)."""
    import medusa_infer.cli as cli
    import medusa_infer.decoding as decoding
    from medusa_infer.decoding import context_length
    from tiny import word_medusa

    model = word_medusa()
    stream, chats = decoding.stream, []

    def spy(*a, messages=None, **kw):
        chats.append([dict(m) for m in messages])
        return stream(*a, messages=messages, **kw)

    limit, answer = context_length(model), 60
    long_line = " ".join(["dog"] * (limit + 10))
    lines = iter(["hello world", "the cat sat", long_line, "good day", "more words", "and more", ""])
    monkeypatch.setattr(decoding, "stream", spy)
    monkeypatch.setattr(cli, "load", lambda args: model)
    monkeypatch.setattr("builtins.input", lambda _: next(lines))
    assert cli.main(["--chat", "--system", "be brief", "--max-new-tokens", str(answer)]) == 0
    err = capsys.readouterr().err
    assert "that line was left out, the conversation kept" in err and "does not fit the model's context" in err
    assert "oldest exchange" in err and "left out" in err
    asked = [c for c in chats if c[-1]["content"] != long_line]
    assert [c[-1]["content"] for c in asked] == ["hello world", "the cat sat", "good day", "more words", "and more"]
    # the line refused took nothing with it (every earlier exchange was dropped to make room for it, then lost)
    assert [m["content"] for m in asked[2] if m["role"] == "user"] == ["hello world", "the cat sat", "good day"]
    assert all(c[0] == {"role": "system", "content": "be brief"} for c in chats)  # kept while exchanges go
    assert all(m["content"] != "hello world" for m in asked[-1])
    assert all(cli.prompt_tokens(model.tokenizer, c, None) + answer <= limit for c in asked)  # room for an answer
    assert "the answer stopped at the end of the model's context" not in err
    assert cli.main(["--max-new-tokens", str(limit * 2), "the cat sat"]) == 0
    assert "[note] the answer stopped at the end of the model's context" in capsys.readouterr().err


def test_ctrl_c_and_text_that_is_not_utf8_end_nothing_with_a_traceback(monkeypatch, capsys):
    """Ctrl-C ended medusa-generate with a KeyboardInterrupt traceback (in a chat, while it answered, the whole
    chat); bytes that are not UTF-8 (lone surrogates to Python) crashed the tokenizer with a TypeError, ending a
    chat too."""
    import medusa_infer.cli as cli
    import medusa_infer.decoding as decoding
    from tiny import word_medusa

    model = word_medusa()
    monkeypatch.setattr(cli, "load", lambda args: model)
    bad = "the \udcff party"  # b"the \xff party" as Python reads it from argv or a piped line
    assert "the prompt is not UTF-8 text" in parse_error(capsys, [bad])
    assert "--system is not UTF-8 text" in parse_error(capsys, ["--system", bad, "hi"])
    stream, asked = decoding.stream, []

    def interrupted(*a, messages=None, **kw):
        asked.append(messages[-1]["content"])
        if messages[-1]["content"] == "the cat sat":
            raise KeyboardInterrupt
        return stream(*a, messages=messages, **kw)

    monkeypatch.setattr(decoding, "stream", interrupted)
    lines = iter(["hello world", bad, "the cat sat", "good day", ""])
    monkeypatch.setattr("builtins.input", lambda _: next(lines))
    assert cli.main(["--chat", "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "that line is not UTF-8 text" in err and "[interrupted: that answer was left out" in err
    assert asked == ["hello world", "the cat sat", "good day"]

    def ctrl_c(_):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", ctrl_c)  # at the prompt: the chat ends, as a shell's does
    assert cli.main(["--chat"]) == 130
    monkeypatch.setattr(decoding, "stream", lambda *a, **kw: ctrl_c(None))
    assert cli.main(["hi"]) == 130


def test_an_empty_system_message_is_sent_not_dropped(monkeypatch, capsys):
    """``--system ""`` asks for a system turn with no text (a template may then leave out its default one)."""
    import medusa_infer.cli as cli
    import medusa_infer.decoding as decoding
    from tiny import word_medusa

    stream, chats = decoding.stream, []

    def spy(*a, messages=None, **kw):
        chats.append(messages)
        return stream(*a, messages=messages, **kw)

    model = word_medusa()
    model.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    monkeypatch.setattr(decoding, "stream", spy)
    monkeypatch.setattr(cli, "load", lambda args: model)
    assert cli.main(["--system", "", "--max-new-tokens", "2", "the cat"]) == 0
    assert chats[0][0] == {"role": "system", "content": ""}


def test_module_entry_point_reports_argument_errors():
    result = subprocess.run([sys.executable, "-m", "medusa_infer", "--method", "draft", "hi"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--method draft needs --draft-model" in result.stderr


@pytest.mark.slow
def test_lookup_run_streams_the_answer_and_prints_metrics():
    prompt = "Repeat this sentence: the quick brown fox jumps over the lazy dog."
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, "-m", "medusa_infer", "--method", "lookup", "--max-new-tokens", "24", prompt],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "quick brown fox" in result.stdout
    metrics = [line for line in result.stderr.splitlines() if line.startswith("[lookup]")]
    assert metrics, result.stderr
    assert "tau" in metrics[0] and "tok/s" in metrics[0]


def test_the_lookup_chain_grafted_onto_the_tree_takes_the_n_gram_flags():
    from medusa_infer.proposers import build_proposer
    from tiny import word_medusa

    model = word_medusa()
    given = build_proposer("medusa", model, parse_args(["--heads", "h", "--lookup-tokens", "4", "--lookup-max-ngram",
                                                        "2", "--lookup-min-ngram", "2", "hi"]))
    default = build_proposer("medusa", model, parse_args(["--heads", "h", "--lookup-tokens", "4", "hi"]))
    assert (given.lookup_ngram, default.lookup_ngram) == ((2, 2), (3, 1))


def test_sampling_flags_reach_the_decoder(monkeypatch):
    """--top-p, --top-k, --temperature and --seed were read and checked, and a run passing others (top_p 1.0, no
    seed) passed the suite: every sampling setting reaches stream as given."""
    import medusa_infer.cli as cli
    import medusa_infer.decoding as decoding
    from tiny import word_medusa

    stream, seen = decoding.stream, []

    def spy(*args, **kwargs):
        seen.append({k: kwargs[k] for k in ("do_sample", "temperature", "top_p", "top_k", "seed")})
        return stream(*args, **kwargs)

    monkeypatch.setattr(decoding, "stream", spy)
    monkeypatch.setattr(cli, "load", lambda args: word_medusa())
    assert cli.main(["--heads", "h", "--raw", "--max-new-tokens", "2", "--do-sample", "--temperature", "0.7",
                     "--top-p", "0.9", "--top-k", "5", "--seed", "3", "the cat"]) == 0
    assert seen == [{"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3}]


def test_a_huge_max_new_tokens_keeps_the_chat_history():
    """The answer's room is capped at half the context: with --max-new-tokens 10**6 every --chat turn forgot
    the earlier exchanges."""
    from medusa_infer.cli import fit_history
    from tiny import word_medusa

    history = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on"},
               {"role": "user", "content": "the mat"}]
    assert fit_history(word_medusa(), history, False, 10**6) == (history, 0)


@pytest.mark.parametrize("argv, message", [
    # lossless acceptance without --do-sample decoded greedily, the flag silently ignored
    (["--acceptance", "lossless", "hi"], "--acceptance lossless samples: add --do-sample"),
    # refused before the model loads (generation refused it only after minutes of loading)
    (["--max-new-tokens", "0", "hi"], "--max-new-tokens must be at least 1, got 0"),
    (["--method", "lookup", "--lookup-min-ngram", "0", "hi"],
     "--lookup-min-ngram must lie in [1, --lookup-max-ngram=3], got 0"),
    (["--do-sample", "--temperature", "0", "--top-p", "0.9", "hi"],
     "--top-p shape sampling, and --temperature 0 decodes greedily"),
    # from a review: typical acceptance at temperature 0 decodes greedily, as greedy acceptance with --do-sample
    (["--heads", "h", "--do-sample", "--temperature", "0", "--acceptance", "typical", "hi"],
     "--acceptance typical shape sampling, and --temperature 0 decodes greedily"),
    # the draft proposer reads no --layerskip-layers: it was taken and ignored
    (["--method", "draft", "--draft-model", "x", "--layerskip-layers", "3", "hi"],
     "--layerskip-layers is read by --method layerskip, not --method draft"),
    # nothing drafted, nothing accepted: the rule's top-p and top-k refusals turned away plain sampling's
    (["--do-sample", "--acceptance", "typical", "hi"], "--method autoregressive drafts none"),
    (["--do-sample", "--acceptance", "typical", "--top-p", "0.9", "hi"], "--method autoregressive drafts none"),
    # generation streamed a token, then failed naming no flag ("Overflow when unpacking long long")
    (["--max-new-tokens", "99999999999999999999", "hi"], "--max-new-tokens must be at most 2147483647, got 9999"),
    # empty names read as not given: plain decoding without heads, the default model loaded
    (["--heads", "", "hi"], "--heads is empty (''): name a heads folder or Hub repo, or leave --heads out"),
    (["--model", "", "hi"], "--model is empty (''): name the base model"),
    (["--method", "draft", "--draft-model", " ", "hi"], "--draft-model is empty (' ')"),
])
def test_more_bad_arguments_are_refused_before_loading_anything(capsys, argv, message):
    assert message in parse_error(capsys, argv)


def test_a_chat_line_too_long_for_the_context_says_no_exchange_was_left_out(monkeypatch, capsys):
    """A line refused as too long keeps the conversation as it was: no "[note] ... oldest exchange left
    out" may come before its refusal (the exchanges dropped to try it were not dropped)."""
    import medusa_infer.cli as cli
    from medusa_infer.decoding import context_length
    from tiny import word_medusa

    model = word_medusa()
    long_line = " ".join(["dog"] * (context_length(model) + 10))
    lines = iter(["hello world", long_line, ""])
    monkeypatch.setattr(cli, "load", lambda args: model)
    monkeypatch.setattr("builtins.input", lambda _: next(lines))
    assert cli.main(["--chat", "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "that line was left out, the conversation kept" in err
    assert "oldest exchange" not in err, err


def test_piped_chat_lines_a_bom_a_control_token_and_the_empty_line_that_ends_it(monkeypatch, capsys):
    """From a review: a byte order mark (a file saved by Notepad) reached the model as the first line's text; a
    line writing the tokenizer's EOS as text is its own error, the chat goes on; an empty line ended a piped chat
    without a word (a prompts file with blank lines between prompts: the rest went unread)."""
    import types

    import medusa_infer.cli as cli
    from tiny import word_medusa

    model = word_medusa()
    turns = []

    def fake_turn(model, args, messages, prompt):
        turns.append(messages[-1]["content"])
        return types.SimpleNamespace(new_tokens=[[model.tokenizer.eos_token_id]])

    lines = iter(["\ufeffthe cat", "the </s> sun", "the dog", "", "never read"])
    monkeypatch.setattr(cli, "load", lambda args: model)
    monkeypatch.setattr(cli, "run_turn", fake_turn)
    monkeypatch.setattr("builtins.input", lambda _: next(lines))
    assert cli.main(["--chat", "--heads", "h", "--max-new-tokens", "3"]) == 0
    assert turns == ["the cat", "the dog"]
    err = capsys.readouterr().err
    assert "message 2 holds '</s>'" in err and "that line was left out, the conversation kept" in err
    assert "[note] the chat ended at an empty line" in err
    assert next(lines) == "never read"


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_a_chat_in_a_terminal_reads_long_lines_whole_with_line_editing(tmp_path):
    """From a review: nothing imported readline, so the terminal read the lines itself: a pasted line was cut at
    4095 characters without a word, and the Up arrow reached the model as the text "\\x1b[A"."""
    import pty
    import select
    import time

    from medusa_infer.serving.testing import word_tokenizer
    from tiny import tiny_model

    tokenizer = word_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    spy = ("import json, sys, medusa_infer.cli as cli; run = cli.run_turn\n"
           "def spy(model, args, messages, prompt):\n"
           "    print('TURN' + json.dumps(messages[-1]['content']), file=sys.stderr, flush=True)\n"
           "    return run(model, args, messages, prompt)\n"
           "cli.run_turn = spy; sys.exit(cli.main(sys.argv[1:]))\n")
    pid, fd = pty.fork()
    if pid == 0:  # the child: stdin, stdout and stderr on the terminal
        os.execvpe(sys.executable, [sys.executable, "-c", spy, "--model", str(tmp_path / "base"), "--chat",
                                    "--max-new-tokens", "1"], {**os.environ, "HF_HUB_OFFLINE": "1"})
    seen = b""

    def read_until(wanted: bytes, count: int, seconds: float = 240) -> None:
        nonlocal seen
        end = time.monotonic() + seconds
        while seen.count(wanted) < count and time.monotonic() < end:
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    seen += os.read(fd, 65536)
                except OSError:  # the child has exited
                    return

    try:
        read_until(b"> ", 1)
        os.write(fd, b"the cat " * 700 + b"\r")  # 5600 characters, as a paste
        read_until(b"TURN", 1)
        read_until(b"> ", 2)
        os.write(fd, b"the sun\r")
        read_until(b"TURN", 2)
        read_until(b"> ", 3)
        os.write(fd, b"\x1b[A\r")  # Up: the last line again
        read_until(b"TURN", 3)
        read_until(b"> ", 4)
        os.write(fd, b"\x04")  # Ctrl-D
        read_until(b"\x00", 1, 30)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    text = seen.decode(errors="replace").replace("\r", "")
    turns = [json.loads(line[4:]) for line in text.splitlines() if line.startswith("TURN")]
    assert [len(turn) for turn in turns] == [len("the cat " * 700) - 1, 7, 7], text[-2000:]
    assert turns[1:] == ["the sun", "the sun"] and os.waitstatus_to_exitcode(status) == 0


def test_chat_history_holds_the_answer_without_special_tokens(monkeypatch, capsys):
    """The answer kept for the next turn is its text: an end-of-sequence token the model wrote (its text,
    '</s>', '<|im_end|>') is not sent back as part of the assistant's message."""
    import types

    import medusa_infer.cli as cli
    from tiny import word_medusa

    model = word_medusa()
    tokenizer = model.tokenizer
    answer_ids = tokenizer("the cat", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    turns = []

    def fake_turn(model, args, messages, prompt):
        turns.append([dict(m) for m in messages])
        return types.SimpleNamespace(new_tokens=[answer_ids])

    lines = iter(["hello world", "good day", ""])
    monkeypatch.setattr(cli, "load", lambda args: model)
    monkeypatch.setattr(cli, "run_turn", fake_turn)
    monkeypatch.setattr("builtins.input", lambda _: next(lines))
    assert cli.main(["--chat", "--max-new-tokens", "3"]) == 0
    assert turns[1][1] == {"role": "assistant", "content": "the cat"}, turns[1]


def test_lookup_max_tokens_bounds_the_grafted_chain_and_is_refused_where_nothing_reads_it(capsys):
    """medusa-generate's --lookup-max-tokens, as medusa-bench's: the longest chain a cost profile may choose (the
    chain ran up to 16 tokens whatever --lookup-tokens said, and no flag bounded it)."""
    from tiny import word_medusa

    args = parse_args(["--heads", "h", "--lookup-tokens", "2", "--lookup-max-tokens", "4", "hi"])
    assert build_proposer("medusa", word_medusa(), args).lookup_max_tokens == 4
    assert build_proposer("medusa", word_medusa(), parse_args(["--heads", "h", "--lookup-tokens", "2", "hi"])
                          ).lookup_max_tokens == LOOKUP_MAX_TOKENS
    for argv, message in ((["--heads", "h", "--lookup-max-tokens", "4", "hi"], "add --lookup-tokens N"),
                          (["--method", "lookup", "--lookup-max-tokens", "4", "hi"], "--draft-tokens bounds"),
                          (["--heads", "h", "--lookup-tokens", "2", "--lookup-max-tokens", "0", "hi"],
                           "--lookup-max-tokens must be at least 1, got 0")):
        assert message in parse_error(capsys, argv)


def test_lookup_max_tokens_on_heads_without_a_cost_profile_is_refused(monkeypatch, capsys):
    """From a review: heads with no cost profile graft chains of --lookup-tokens, and --lookup-max-tokens was taken
    and left unused (chains of 3 under a bound of 2), where medusa-bench refuses it."""
    import medusa_infer.cli as cli
    from medusa_infer.tree_fit import CostProfile
    from tiny import word_medusa

    model = word_medusa()
    monkeypatch.setattr(cli, "load", lambda args: model)
    argv = ["--heads", "h", "--lookup-tokens", "3", "--lookup-max-tokens", "2", "--max-new-tokens", "2", "--raw",
            "the cat"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--lookup-max-tokens bounds the lookup chain a cost profile chooses, and the heads in h carry" in err
    model.config.cost_profile = CostProfile([1, 2, 4, 8, 16], [1.0, 1.1, 1.3, 1.6, 2.2], "cpu").to_dict()
    assert cli.main(argv) == 0, capsys.readouterr().err


def test_a_chat_with_stdin_closed_is_said_not_a_traceback(tmp_path):
    """Started with stdin closed (or under pythonw), sys.stdin is None: an AttributeError traceback."""
    from medusa_infer.serving.testing import word_tokenizer
    from tiny import tiny_model

    tokenizer = word_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    done = subprocess.run(["bash", "-c", f"{sys.executable} -m medusa_infer --model {tmp_path / 'base'} --chat --raw "
                           "0<&-"], capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2, done.stderr[-1500:]
    assert "medusa-generate: error: --chat reads its prompts from stdin, which is closed" in done.stderr
