"""Tests for medusa_train.dataset: assistant-only labels on any template, truncation, caching and
held-out splits. Uses the real SmolLM2 tokenizer (no model weights)."""

from __future__ import annotations

import contextlib
import copy
import json
import logging

import pytest

from medusa_infer.models import load_tokenizer
from medusa_train import dataset as dataset_module
from medusa_train.dataset import (
    IGNORE_INDEX,
    BuildStats,
    TemplateError,
    _tokenize_chat_by_prefix,
    build_examples,
    check_template,
    encode_rendered,
    load_or_build_dataset,
    read_rows,
    render_chat,
    render_prompt,
    row_messages,
    split_heldout,
    to_dataset,
    truncate_examples,
    tokenize_chat,
)

CONVERSATION = [
    {"role": "system", "content": "You are a terse pirate."},
    {"role": "user", "content": "Where is the treasure?"},
    {"role": "assistant", "content": "Under the old oak, matey."},
    {"role": "user", "content": "How deep?\nBe precise."},
    {"role": "assistant", "content": "Six feet.\n\nDig at dawn."},
]
ASSISTANT = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
ZEPHYR_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PHI3_TEMPLATE = (  # Phi-3's and Phi-4-mini's: the EOS token ends a conversation, after its last turn's <|end|>
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
NOT_PREFIX_STABLE = (
    "Conversation of {{ messages | length }} messages\n"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


class OneProcess:
    """The accelerator of a one-process run, as train_heads' data stage uses it."""

    is_main_process = True

    def main_process_first(self):
        return contextlib.nullcontext()


@pytest.fixture(scope="module")
def smol():
    return load_tokenizer("smollm2-135m-instruct")


def with_template(tokenizer, template, special_tokens=()):
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    if special_tokens:
        other.add_tokens(list(special_tokens), special_tokens=True)
    return other


def labelled_runs(tokenizer, input_ids, labels) -> list[str]:
    """Decoded text of each contiguous run of unmasked labels."""
    runs, current = [], []
    for token, label in zip(input_ids, labels):
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token
            current.append(label)
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def test_multi_turn_labels_are_exactly_the_assistant_turns(smol):
    input_ids, labels = tokenize_chat(smol, CONVERSATION)
    assert smol.decode(input_ids) == render_chat(smol, CONVERSATION)
    runs = labelled_runs(smol, input_ids, labels)
    assert runs == [f"{text}<|im_end|>" for text in ASSISTANT]
    unmasked = "".join(runs)
    for message in CONVERSATION:
        if message["role"] != "assistant":
            assert message["content"] not in unmasked
    assert "<|im_start|>" not in unmasked and "assistant\n" not in unmasked
    # The tokens before the first label are exactly the generation prompt.
    first = labels.index(next(label for label in labels if label != IGNORE_INDEX))
    assert smol.decode(input_ids[:first]) == render_chat(smol, CONVERSATION[:2], add_generation_prompt=True)


def test_prompt_response_row_with_default_system_prompt(smol):
    [example] = build_examples([{"id": "x", "prompt": "Hi?", "response": "Hello."}], smol, 256)
    assert example["id"] == "x"
    assert "SmolLM" in smol.decode(example["input_ids"])  # the template's own system prompt
    assert labelled_runs(smol, example["input_ids"], example["labels"]) == ["Hello.<|im_end|>"]
    [example] = build_examples(
        [{"prompt": "Hi?", "response": "Hello."}], smol, 256, system_prompt="Be kind."
    )
    assert "Be kind." in smol.decode(example["input_ids"])
    assert "SmolLM" not in smol.decode(example["input_ids"])


def test_a_distilled_answer_is_trained_on_the_tokens_the_model_wrote(smol, caplog):
    """Its text tokenised again parts otherwise in some answers: the model wrote "\n\n" as one
    token that the text reads as two newlines, and an answer starting with a newline merged with the assistant
    header's; the heads learnt from sequences decoding never produces (and a kept hidden state never matched)."""
    newline, pair, end = (smol.convert_tokens_to_ids(t) for t in ("Ċ", "ĊĊ", "<|im_end|>"))
    written = smol("A", add_special_tokens=False)["input_ids"] + [pair] + smol("B", add_special_tokens=False)["input_ids"]
    assert smol("A\n\nB", add_special_tokens=False)["input_ids"] != written  # the case itself
    prompt = encode_rendered(smol, render_prompt(smol, "Hi?"))
    rows = [{"id": "eos", "prompt": "Hi?", "response": "A\n\nB", "finish_reason": "eos", "response_ids": written + [end]},
            {"id": "cut", "prompt": "Hi?", "response": "A\n\nB", "finish_reason": "length", "response_ids": written},
            {"id": "lead", "prompt": "Hi?", "response": "\nA", "finish_reason": "eos",
             "response_ids": [newline] + written[:1] + [end]}]
    stats = BuildStats()
    eos, cut, lead = build_examples(rows, smol, 256, stats=stats)
    assert eos["input_ids"] == prompt + written + [end] and eos["labels"] == [-100] * len(prompt) + written + [end]
    assert cut["input_ids"] == prompt + written and cut["labels"][len(prompt):] == written
    assert lead["input_ids"][:len(prompt)] == prompt and lead["labels"][len(prompt)] == newline
    assert (stats.from_ids, stats.ids_unused, stats.cut_off) == (3, 0, 1)
    # ids that are not the response's (edited, another tokenizer's): its text, tokenised, as for an endpoint's row
    edited = dict(rows[0], response="A\n\nC")
    with caplog.at_level(logging.WARNING, logger="medusa_train.dataset"):
        [again] = build_examples([edited], smol, 256, stats=(stats := BuildStats()))
    assert stats.ids_unused == 1 and "1 rows' response_ids do not decode to their response" in caplog.text
    assert labelled_runs(smol, again["input_ids"], again["labels"]) == ["A\n\nC<|im_end|>"]
    with pytest.raises(ValueError, match=r"row 'eos': 'response_ids' must be a list of token ids \(integers >= 0\)"):
        build_examples([dict(rows[0], response_ids=[-1])], smol, 256)
    # an id past the tokenizer's (a padded embedding row the model sampled: no text) stopped the whole build;
    # a row of "messages": null (a datasets folder mixing conversations with distilled rows) lost its ids; a row
    # dropped for its length was counted as built from its ids
    padded = dict(rows[0], response_ids=written + [len(smol) + 3])
    mixed = dict(rows[0], messages=None)
    stats = BuildStats()
    from_text, from_ids = build_examples([padded, mixed], smol, 256, stats=stats)
    assert from_ids["input_ids"] == prompt + written + [end]
    assert from_text["input_ids"][len(prompt):] != written + [end]  # the text's tokens, "\n\n" read as two
    assert (stats.ids_unused, stats.from_ids, stats.examples) == (1, 1, 2)
    assert build_examples([rows[0]], smol, len(prompt), stats=(stats := BuildStats())) == []
    assert (stats.dropped_too_long, stats.from_ids) == (1, 0)


@pytest.mark.parametrize(
    "template, special_tokens, end_of_turn",
    [
        (LLAMA3_TEMPLATE, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|eot_id|>"),
        (ZEPHYR_TEMPLATE, (), "<|im_end|>"),  # role tags are plain text, as in Zephyr
        # the EOS the template writes after the last turn is no turn's: it was labelled as the last answer's
        # (with the newline before it), and multi-turn rows failed as not prefix-stable
        (PHI3_TEMPLATE, ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), "<|end|>"),
    ],
    ids=["llama3-like", "zephyr-like", "phi3-like"],
)
def test_other_templates(smol, template, special_tokens, end_of_turn):
    tokenizer = with_template(smol, template, special_tokens)
    [example] = build_examples([{"id": "c", "messages": CONVERSATION}], tokenizer, 512)
    runs = labelled_runs(tokenizer, example["input_ids"], example["labels"])
    assert [run.strip() for run in runs] == [f"{text}{end_of_turn}" for text in ASSISTANT]
    assert "<|assistant|>" not in "".join(runs) and "end_header_id" not in "".join(runs)
    [example] = build_examples([{"id": "r", "prompt": "Hi?", "response": "Hello."}], tokenizer, 256)
    assert labelled_runs(tokenizer, example["input_ids"], example["labels"]) == [f"Hello.{end_of_turn}"]


def test_a_template_writing_the_last_turn_otherwise_keeps_its_labels(smol):
    """Qwen3's template writes a thinking block only in an assistant turn that ends the conversation: a
    rendering with a user turn after it parts before the answer, which must not cut the answer away (the
    row was dropped as having no assistant answer)."""
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and loop.last %}"
                "<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokenizer = with_template(smol, template)
    [example] = build_examples([{"id": "r", "prompt": "Hi?", "response": "Hello."}], tokenizer, 256)
    assert labelled_runs(tokenizer, example["input_ids"], example["labels"]) == [
        "<think>\n\n</think>\n\nHello.<|im_end|>"]


END_ONLY_BEFORE_A_TURN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                          "{% if not (loop.last and m['role'] == 'assistant') %}<|im_end|>\n{% endif %}{% endfor %}"
                          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPT_AFTER_EVERY_TURN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                           "{% endfor %}<|im_start|>assistant\n")


@pytest.mark.parametrize("template, first", [(END_ONLY_BEFORE_A_TURN, ""), (PROMPT_AFTER_EVERY_TURN, "\n")],
                         ids=["end-only-before-a-turn", "prompt-after-every-turn"])
def test_an_answers_end_of_turn_is_labelled_and_nothing_of_the_next_turn(smol, template, first):
    """A template writing <|im_end|> only where another turn follows: no answer's end was labelled (the last
    one's was not even in the example), so the heads never learnt where answers end. One writing the
    generation prompt after every conversation: each answer's labels ran on into the next turn's
    <|im_start|>, taken then as the end-of-turn token."""
    tokenizer = with_template(smol, template)
    check_template(tokenizer)
    chat = [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "One."},
            {"role": "user", "content": "B?"}, {"role": "assistant", "content": "Two."}]
    rows = [{"id": "m", "messages": chat}, {"id": "r", "prompt": "A?", "response": "One."}]
    multi, single = build_examples(rows, tokenizer, 512)
    assert labelled_runs(tokenizer, multi["input_ids"], multi["labels"]) == [f"{first}One.<|im_end|>",
                                                                             f"{first}Two.<|im_end|>"]
    assert labelled_runs(tokenizer, single["input_ids"], single["labels"]) == [f"{first}One.<|im_end|>"]
    assert build_examples(rows, NoOffsets(tokenizer), 512) == [multi, single]
    cut = build_examples([{**rows[1], "finish_reason": "length"}], tokenizer, 512)[0]  # no end where none was written
    assert labelled_runs(tokenizer, cut["input_ids"], cut["labels"]) == [f"{first}One."]


def test_a_next_turns_bos_that_is_the_eos_token_is_not_labelled(smol):
    """Where BOS and EOS are one token (GPT-2's <|endoftext|>) under a template opening each user turn with BOS
    (Llama 2's), the next turn's BOS was taken for an end of turn written only before another turn: each answer
    was labelled to end with EOS twice, and the last example had one appended."""
    template = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] {{ m['content'] }} [/INST]"
                "{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}")
    tokenizer = with_template(smol, template)
    tokenizer.bos_token = tokenizer.eos_token
    chat = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "More?"}, {"role": "assistant", "content": "Sure."}]
    input_ids, labels = tokenize_chat(tokenizer, chat)
    assert tokenizer.decode(input_ids) == render_chat(tokenizer, chat)
    assert labelled_runs(tokenizer, input_ids, labels) == [" Hello. <|im_end|>", " Sure. <|im_end|>"]


def test_short_and_empty_answers_under_a_template_ending_conversations_with_eos(smol):
    """An answer found inside the template's own closing text ("end" in <|im_end|>) or an empty one was not
    cut from the EOS after it: labelled again, or, in an earlier turn, the whole build failed as not
    prefix-stable."""
    tokenizer = with_template(smol, PHI3_TEMPLATE, ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"))
    for answer in ("end", "im", ""):
        [example] = build_examples([{"id": "r", "prompt": "Hi?", "response": answer}], tokenizer, 256)
        assert labelled_runs(tokenizer, example["input_ids"], example["labels"]) == [f"{answer}<|end|>"]
        chat = [{"role": "user", "content": "One?"}, {"role": "assistant", "content": answer},
                {"role": "user", "content": "Two?"}, {"role": "assistant", "content": "A two."}]
        [example] = build_examples([{"id": "m", "messages": chat}], tokenizer, 256)
        assert labelled_runs(tokenizer, example["input_ids"], example["labels"]) == [f"{answer}<|end|>",
                                                                                      "A two.<|end|>"]


def test_prefix_fallback_matches_offsets(smol):
    full = render_chat(smol, CONVERSATION)
    assert _tokenize_chat_by_prefix(smol, CONVERSATION, full) == tokenize_chat(smol, CONVERSATION)


def test_template_errors(smol):
    with pytest.raises(TemplateError, match="not prefix-stable"):
        build_examples([{"messages": CONVERSATION}], with_template(smol, NOT_PREFIX_STABLE), 512)
    with pytest.raises(TemplateError, match="no chat template"):
        build_examples([{"messages": CONVERSATION}], with_template(smol, None), 512)
    with pytest.raises(ValueError, match="unknown role"):
        build_examples([{"messages": [{"role": "tool", "content": "x"}]}], smol, 512)
    # rows that would fail inside the template, or with a KeyError, are named with what is wrong
    for messages, says in (([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}],
                            r"row 'r7': messages\[0\] is an assistant turn with no user turn before it"),
                           ([], "row 'r7': 'messages' must be a non-empty list"),
                           ([{"role": "user", "content": ["x"]}], r"row 'r7': messages\[0\] must have a string")):
        with pytest.raises(ValueError, match=says):
            build_examples([{"id": "r7", "messages": messages}], smol, 512)


def test_check_template_refuses_a_template_that_labels_no_answer(smol):
    """A template that writes no assistant turn (or a file's name given as the template's text) gave no
    example, which build_examples counts and drops: the check before distilling passed, and every prompt
    was answered before the dataset found nothing to train on."""
    check_template(smol)
    check_template(with_template(smol, LLAMA3_TEMPLATE, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]))
    user_only = "{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\n{% endif %}{% endfor %}"
    with pytest.raises(TemplateError, match="does not write an assistant's answer.*labelled as nothing"):
        check_template(with_template(smol, user_only))
    with pytest.raises(TemplateError, match=r"'recipes/vicuna.jinja' has no \{\{ or \{% in it: give the template itself"):
        check_template(with_template(smol, "recipes/vicuna.jinja"))
    # one that wants a system message first: the fix is a system prompt, not another template
    wants_system = with_template(smol, "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message "
                                       "must come first') }}{% endif %}" + smol.chat_template)
    with pytest.raises(TemplateError, match=r"a system message must come first.*renders them with a system message "
                                            r"first: set data.system_prompt\)$"):
        check_template(wants_system)
    check_template(wants_system, "Be brief.")


def test_truncation_and_dropping(smol, caplog):
    full_ids, full_labels = tokenize_chat(smol, CONVERSATION)
    last_label = max(i for i, label in enumerate(full_labels) if label != IGNORE_INDEX)
    cut = last_label - 2  # inside the second assistant turn
    rows = [
        {"id": "long", "messages": CONVERSATION},
        {"id": "no-room", "prompt": "Q " * 200, "response": "A."},
        {"id": "unanswered", "prompt": "Q?"},
    ]
    stats = BuildStats()
    with caplog.at_level(logging.INFO, logger="medusa_train.dataset"):
        examples = build_examples(rows, smol, cut, stats=stats)
    assert [e["id"] for e in examples] == ["long"]
    assert examples[0]["input_ids"] == full_ids[:cut] and examples[0]["labels"] == full_labels[:cut]
    runs = labelled_runs(smol, examples[0]["input_ids"], examples[0]["labels"])
    assert runs[0] == f"{ASSISTANT[0]}<|im_end|>" and ASSISTANT[1].startswith(runs[1]) and runs[1]
    # the long conversation is cut and kept; the long prompt leaves no answer; one row has none
    counts = (stats.rows, stats.examples, stats.truncated, stats.dropped_too_long, stats.dropped_no_assistant)
    assert counts == (3, 1, 1, 1, 1)
    assert "1 truncated" in caplog.text and "1 dropped with no assistant turn, 1 with a prompt" in caplog.text


def test_an_answer_cut_by_the_token_limit_has_no_end_of_turn_label(smol, caplog):
    cut_answer = "Six feet down, under the roots, where the "
    rows = [
        {"id": "cut", "prompt": "How deep?", "response": cut_answer, "finish_reason": "length"},
        {"id": "ended", "prompt": "How deep?", "response": "Six feet.", "finish_reason": "eos"},
        {"id": "cut-turn", "messages": CONVERSATION, "finish_reason": "length"},
    ]
    stats = BuildStats()
    with caplog.at_level(logging.INFO, logger="medusa_train.dataset"):
        cut, ended, cut_turn = build_examples(rows, smol, 512, stats=stats)
    generation_prompt = render_chat(smol, [{"role": "user", "content": "How deep?"}], add_generation_prompt=True)
    # The example is the prompt and the answer as far as the model wrote it: the trailing space the template
    # keeps is the answer's own, and nothing of the turn's end follows.
    assert smol.decode(cut["input_ids"]) == generation_prompt + cut_answer
    assert labelled_runs(smol, cut["input_ids"], cut["labels"]) == [cut_answer]
    assert labelled_runs(smol, ended["input_ids"], ended["labels"]) == ["Six feet.<|im_end|>"]
    # In a conversation only the last answer is cut; earlier ones ended their turns.
    runs = labelled_runs(smol, cut_turn["input_ids"], cut_turn["labels"])
    assert runs == [f"{ASSISTANT[0]}<|im_end|>", ASSISTANT[1]]
    full_ids, _ = tokenize_chat(smol, CONVERSATION)
    assert full_ids[: len(cut_turn["input_ids"])] == cut_turn["input_ids"]
    assert stats.cut_off == 2 and "2 answers cut by the token limit" in caplog.text
    # Rows whose last turn is not an answer are not cut, whatever their finish_reason says.
    asked = [*CONVERSATION, {"role": "user", "content": "And then?"}]
    [example] = build_examples([{"messages": asked, "finish_reason": "length"}], smol, 512)
    assert example["input_ids"] == tokenize_chat(smol, asked)[0]


class NoOffsets:
    """A tokenizer that gives no character offsets, as pure-Python and SentencePiece ones: transformers 5 leaves
    them out of the encoding (``raises``: earlier releases raised)."""

    def __init__(self, tokenizer, raises=False):
        self.tokenizer, self.raises = tokenizer, raises

    def __call__(self, text, **kwargs):
        if kwargs.pop("return_offsets_mapping", False) and self.raises:
            raise NotImplementedError("no offsets")
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize("answer", ["Six feet.\n\nDig at", "Six feet.\n\nDig at "])
def test_tokenizers_without_offsets_cut_answers_at_the_same_token(smol, answer):
    messages = [*CONVERSATION[:-1], {"role": "assistant", "content": answer}]
    row = {"messages": messages, "finish_reason": "length"}
    [example] = build_examples([row], NoOffsets(smol), 512)
    assert example == build_examples([row], smol, 512)[0]
    assert labelled_runs(smol, example["input_ids"], example["labels"])[-1] == answer


def test_a_pure_python_tokenizer_gives_no_offsets_and_is_labelled_from_token_prefixes():
    """transformers 5's pure-Python tokenizers (ByT5's here; SentencePiece's are built on them) give no offsets
    without raising: every row failed with KeyError 'offset_mapping'."""
    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer()
    for template in (ZEPHYR_TEMPLATE, PHI3_TEMPLATE):
        tokenizer.chat_template = template
        [one, two] = build_examples([{"id": "r", "prompt": "Hi?", "response": "Hello."},
                                     {"id": "m", "messages": CONVERSATION[1:]}], tokenizer, 512)
        end = "<|end|>" if template == PHI3_TEMPLATE else "</s>"
        assert labelled_runs(tokenizer, one["input_ids"], one["labels"]) == ["Hello." + end]
        assert labelled_runs(tokenizer, two["input_ids"], two["labels"]) == [answer + end for answer in ASSISTANT]


@pytest.mark.parametrize("raises", [False, True])
@pytest.mark.parametrize("answer", ["\n\nHello", "  lead", "\t tab", "Hello"])
def test_tokenizers_without_offsets_label_an_answer_merged_with_its_header_as_those_with(smol, answer, raises):
    """An answer starting with whitespace merges with its header's newline into one token: labelled with offsets
    (it straddles the boundary), it stopped the whole build without them."""
    rows = [{"id": "r", "prompt": "Hi?", "response": answer},
            {"id": "m", "messages": [*CONVERSATION[:2], {"role": "assistant", "content": answer}, *CONVERSATION[3:]]}]
    assert build_examples(rows, NoOffsets(smol, raises), 512) == build_examples(rows, smol, 512)


def test_tokenizers_without_offsets_label_phi3_style_templates_as_those_with(smol):
    """A template writing an EOS after a conversation's last turn (Phi-3's): without offsets that EOS was
    labelled as the answer's, and multi-turn rows failed as not prefix-stable."""
    tokenizer = with_template(smol, PHI3_TEMPLATE, ["<|user|>", "<|assistant|>", "<|end|>", "<|system|>"])
    for row in ({"id": "r", "prompt": "Hi?", "response": "Hello."}, {"id": "m", "messages": CONVERSATION}):
        [example] = build_examples([row], NoOffsets(tokenizer), 512)
        assert example == build_examples([row], tokenizer, 512)[0]
        assert all(run.endswith("<|end|>") for run in labelled_runs(tokenizer, example["input_ids"], example["labels"]))


def test_a_cut_answer_is_found_after_its_own_header_not_where_its_text_came_earlier(smol):
    tokenizer = with_template(smol, LLAMA3_TEMPLATE, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"))
    # The user wrote the answer's text first, and the answer "assistant" is the header's own word.
    for answer in ("Dig at dawn ", "assistant"):
        row = {"messages": [{"role": "user", "content": f"Say {answer}"}, {"role": "assistant", "content": answer}],
               "finish_reason": "length"}
        [example] = build_examples([row], tokenizer, 512)
        assert labelled_runs(tokenizer, example["input_ids"], example["labels"]) == [answer.strip()]


def test_cut_off_answers_under_a_trimming_template_and_one_that_rewrites_them(smol, caplog):
    tokenizer = with_template(smol, LLAMA3_TEMPLATE, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"))
    row = {"prompt": "Q?", "response": "Dig at dawn.\n", "finish_reason": "length"}
    [example] = build_examples([row], tokenizer, 512)
    assert labelled_runs(tokenizer, example["input_ids"], example["labels"]) == ["Dig at dawn."]
    assert tokenizer.decode(example["input_ids"]).endswith("<|end_header_id|>\n\nDig at dawn.")
    shouting = with_template(smol, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
                                    "{% if add_generation_prompt %}assistant: {% endif %}")
    # An answer the template rewrites cannot be cut: it is kept whole, counted and reported.
    stats = BuildStats()
    with caplog.at_level(logging.WARNING, logger="medusa_train.dataset"):
        [example] = build_examples([row], shouting, 512, stats=stats)
    whole = tokenize_chat(shouting, [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "Dig at dawn.\n"}])
    assert (example["input_ids"], example["labels"]) == whole
    assert (stats.cut_off, stats.cut_off_unfound) == (0, 1)
    assert "1 answers cut by the token limit keep an end-of-turn label" in caplog.text


def test_no_example_left_names_why_and_the_fix(tmp_path, smol):
    rows_path = tmp_path / "rows.jsonl"
    rows = [{"prompt": "Tell me about the sea " * 3, "response": "It is big."}] * 3 + [{"prompt": "Q?"}]
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"\(4 rows\): 1 dropped with no assistant turn, 3 dropped with a prompt "
                                         r"that fills data.max_length=40; raise data.max_length"):
        load_or_build_dataset(rows_path, smol, 40, tmp_path / "cache")
    rows_path.write_text(json.dumps({"prompt": "Q?"}) + "\n")  # a prompts file given as data.rows: no length helps
    with pytest.raises(ValueError, match=r"\(1 rows\): 1 dropped with no assistant turn; give rows with answers "
                                         r"\(prompts to distil go in data.prompts, not data.rows\)$"):
        load_or_build_dataset(rows_path, smol, 40, tmp_path / "cache")


def test_a_killed_builds_work_folder_is_removed_by_the_next_build(tmp_path, smol):
    """SIGTERM or SIGKILL during a build left its hidden work folder (a whole copy of the dataset), which no run
    read or removed; one touched in the last minute (a build under way) is left."""
    import os
    import shutil
    import time

    rows_path = tmp_path / "rows.jsonl"
    rows_path.write_text("".join(json.dumps({"id": str(i), "prompt": f"Q{i}?", "response": f"A{i}."}) + "\n"
                                 for i in range(4)))
    cache = tmp_path / "cache"
    load_or_build_dataset(rows_path, smol, 128, cache)
    [target] = cache.glob("tokenized-*")
    shutil.rmtree(target)
    killed, live = cache / f".{target.name}.partial-killed", cache / f".{target.name}.partial-live"
    for folder in (killed, live):
        (folder / "data").mkdir(parents=True)
        (folder / "data" / "data-00000-of-00001.arrow").write_bytes(b"x" * 100)
    old = time.time() - 3600
    os.utime(killed, (old, old))
    load_or_build_dataset(rows_path, smol, 128, cache)
    assert not killed.exists() and live.exists() and target.is_dir()


def test_head_positions_count_where_the_next_token_and_head_1s_are_both_answer_tokens():
    """Counted one place early, a fully labelled 2-token example passed the check that refuses runs no head
    position trains (the evaluation failed after training)."""
    from medusa_train.dataset import check_head_positions, head_positions

    assert head_positions([5, 6]) == 0  # no t with labels t + 1 and t + 2
    assert head_positions([IGNORE_INDEX, 5, 6]) == 1 and head_positions([1, 5, 6, 7]) == 2
    assert head_positions([IGNORE_INDEX, 5, IGNORE_INDEX, 6, 7]) == 1
    with pytest.raises(ValueError, match="training examples"):
        check_head_positions([{"labels": [5, 6]}], [{"labels": [IGNORE_INDEX, 5, 6]}])
    check_head_positions([{"labels": [IGNORE_INDEX, 5, 6]}], [{"labels": [IGNORE_INDEX, 5, 6]}])


def test_heads_no_training_example_reaches_are_refused_before_training():
    """heads.num_heads 40 over examples of 12 tokens: 32 heads trained on no position, saved untrained, exit 0."""
    from medusa_train.dataset import check_head_positions, heads_with_targets

    four = {"labels": [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 5, 6, 7, 8]}  # at t = 2, heads 1..3 have targets
    assert heads_with_targets([four]) == 3
    assert heads_with_targets([{"labels": [IGNORE_INDEX, 5, IGNORE_INDEX, 6, 7, 8]}, four]) == 3
    assert heads_with_targets([{"labels": [1, 5, 6, 7, 8, 9]}]) == 4  # (t = 0 reaches the last, index 5)
    assert heads_with_targets([{"labels": [1, 5, 6, 7, 8, 9]}, "not read"], enough=4) == 4  # (25k examples: one)
    check_head_positions([four], [four], num_heads=3)
    with pytest.raises(ValueError, match=r"heads 4..5 would learn from no position: no training example's answer "
                                         r"reaches 5 tokens .* lower heads.num_heads to 3"):
        check_head_positions([four], [four], num_heads=5)
    long = {"labels": [IGNORE_INDEX] + list(range(5, 12))}
    with pytest.raises(ValueError, match=r"heads 4..5 would be scored at no position: no held-out example's answer"):
        check_head_positions([long], [four], num_heads=5)  # (a 0.000 in the card, as if measured)
    check_head_positions([long], [four, long], num_heads=5)


def test_load_or_build_dataset_caches(tmp_path, smol, monkeypatch):
    rows_path = tmp_path / "rows.jsonl"
    rows = [{"id": str(i), "prompt": f"Q{i}?", "response": f"A{i}."} for i in range(6)]
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = tmp_path / "cache"
    built = load_or_build_dataset(rows_path, smol, 128, cache)
    assert built["id"] == [str(i) for i in range(6)]
    assert len(list(cache.glob("tokenized-*"))) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("should have come from the cache")

    monkeypatch.setattr(dataset_module, "build_examples", refuse)
    cached = load_or_build_dataset(rows_path, smol, 128, cache)
    assert cached["input_ids"] == built["input_ids"] and cached["labels"] == built["labels"]
    monkeypatch.undo()
    # Any change of rows, length or template is a new entry.
    load_or_build_dataset(rows_path, smol, 64, cache)
    load_or_build_dataset(rows_path, with_template(smol, ZEPHYR_TEMPLATE), 128, cache)
    rows_path.write_text(rows_path.read_text() + json.dumps({"id": "6", "prompt": "Q", "response": "A"}) + "\n")
    assert len(load_or_build_dataset(rows_path, smol, 128, cache)) == 7
    assert len(list(cache.glob("tokenized-*"))) == 4
    assert not list(cache.glob(".tokenized-*"))  # no leftover partial folders


def test_split_heldout_deterministic():
    data = to_dataset([{"id": str(i), "input_ids": [i], "labels": [i]} for i in range(50)])
    train, heldout = split_heldout(data, 0.1, seed=3)
    assert len(heldout) == 5 and len(train) == 45
    assert set(train["id"]).isdisjoint(heldout["id"]) and set(train["id"]) | set(heldout["id"]) == set(data["id"])
    again = split_heldout(data, 0.1, seed=3)
    assert again[1]["id"] == heldout["id"] and again[0]["id"] == train["id"]
    assert split_heldout(data, 0.1, seed=4)[1]["id"] != heldout["id"]
    assert train["id"] == sorted(train["id"], key=int)  # file order kept
    assert len(split_heldout(data, 0.001)[1]) == 1
    assert len(split_heldout(data, 0.0)[1]) == 0
    # one example leaves the training or the held-out split empty: refused, not an empty evaluation
    with pytest.raises(ValueError, match="1 example.* cannot be split"):
        split_heldout(data.select([0]), 0.1)
    with pytest.raises(ValueError, match="fraction"):
        split_heldout(data, 1.0)


def test_the_answers_of_one_prompt_stay_on_one_side_of_the_heldout_split(smol):
    """Rows answering one prompt several times (data.rows read as they are) were split apart: every held-out
    prompt was trained on too, and the held-out accuracies and the tree fitted on them read high."""
    data = to_dataset([{"id": f"p{i % 10}", "input_ids": [i], "labels": [i]} for i in range(20)])
    for seed in range(5):
        train, heldout = split_heldout(data, 0.2, seed=seed)
        assert set(train["id"]).isdisjoint(heldout["id"]), seed
        assert len(set(heldout["id"])) == 2 and len(heldout) == 4  # 2 of the 10 prompts, both answers of each
        assert train["input_ids"] == sorted(train["input_ids"])  # file order kept
    # one prompt with most of the answers: drawn as a count of ids, half the seeds held out 33 of 40 at 0.3
    from medusa_train.train_config import split_indices

    ids = ["p0"] * 31 + [f"p{i}" for i in range(1, 10)]
    for seed in range(10):
        train, heldout = split_indices(40, 0.3, seed, ids)
        # the 9 other prompts fit the 12 held-out places, p0's 31 answers do not
        assert len(heldout) == 9 and "p0" not in {ids[i] for i in heldout}, seed
        assert not {ids[i] for i in train} & {ids[i] for i in heldout}, seed
    # 2 held-out places fit neither prompt's answers: one prompt's all the same, training keeps the other's
    assert {len(split_indices(7, 0.3, seed, ["a"] * 3 + ["b"] * 4)[1]) for seed in range(4)} == {3, 4}
    with pytest.raises(ValueError, match="the 4 examples all answer one prompt \\(id 'a'\\).*at least 2 prompts"):
        split_indices(4, 0.5, 0, ["a"] * 4)  # (it said "1 example(s) cannot be split")
    # rows without an id have none: their index as an id joined row 0 with the row whose id is "0"
    from medusa_train.dataset import build_examples

    rows = [{"prompt": f"Q{i}?", "response": f"A{i}."} for i in range(6)] + [{"id": "0", "prompt": "Z?",
                                                                              "response": "Z."}]
    assert [e["id"] for e in build_examples(rows, smol, 64)] == [None] * 6 + ["0"]


def test_ready_examples_are_cut_to_max_length_like_built_ones(tmp_path, capsys):
    """``data.tokenized`` examples follow ``data.max_length`` as tokenised rows do: cut to their first
    max_length tokens, dropped (and counted) when no labelled token is left; train_heads.py says so."""
    ignore = IGNORE_INDEX
    examples = [
        {"input_ids": [1, 2, 3], "labels": [ignore, 2, 3]},                    # fits
        {"input_ids": [1, 2, 3, 4, 5, 6], "labels": [ignore, ignore, 3, 4, 5, 6]},  # cut, keeps label 3
        {"input_ids": [1, 2, 3, 4, 5], "labels": [ignore, ignore, ignore, 4, 5]},   # cut to prompt only
    ]
    kept, cut, dropped = truncate_examples(examples, 3)
    assert (cut, dropped) == (2, 1)
    assert kept == [examples[0], {"input_ids": [1, 2, 3], "labels": [ignore, ignore, 3]}]
    assert truncate_examples(examples, 6) == (examples, 0, 0)
    with pytest.raises(ValueError, match="max_length must be >= 2, got 1"):
        truncate_examples(examples, 1)
    unlabelled = {"id": "u", "input_ids": [1, 2], "labels": [ignore, ignore]}  # uncut, nothing to learn: dropped
    assert truncate_examples([examples[0], unlabelled], 6) == ([examples[0]], 0, 1)
    with pytest.raises(ValueError, match=r"ready example 'short' has 2 labels for 3 input_ids"):  # a raw error later
        truncate_examples([{"id": "short", "input_ids": [1, 2, 3], "labels": [ignore, 2]}], 6)
    for bad, says in (({"id": "n", "input_ids": [1, 2, 3]}, r"ready example 'n' needs 'labels' as a list of token ids"),
                      ({"input_ids": [1, 2], "labels": None}, r"ready example 0 needs 'labels' as a list.*got None"),
                      ({"input_ids": "1 2", "labels": [1, 2]}, r"ready example 0 needs 'input_ids' as a list")):
        with pytest.raises(ValueError, match=says):  # KeyError and TypeError tracebacks
            truncate_examples([bad], 6)
    # labels shifted by one, or -1 for "ignore": trained on other targets (the prompt's soft labels too) silently
    with pytest.raises(ValueError, match=r"ready example 'p' holds the token id -1 in its input_ids: ids are >= 0"):
        truncate_examples([{"id": "p", "input_ids": [1, 2, -1], "labels": [ignore, 2, ignore]}], 6)  # (padding)
    for labels, says in (([ignore, 3, 4, ignore], r"ready example 's' has label 3 at position 1, where input_ids "
                                                  r"holds 2: labels are the tokens themselves, not shifted"),
                         ([-1, 2, 3, 4], r"ready example 's' has label -1 at position 0")):
        with pytest.raises(ValueError, match=says):
            truncate_examples([{"id": "s", "input_ids": [1, 2, 3, 4], "labels": labels}], 6)
    not_objects = tmp_path / "lists.jsonl"
    not_objects.write_text('{"input_ids": [1], "labels": [1]}\n[1, 2, 3]\n')
    with pytest.raises(ValueError, match=r"lists.jsonl:2 is a JSON list, not an object"):
        read_rows(not_objects)
    # a DatasetDict's folder (load_dataset(...).save_to_disk): its rows were its split names, failing later
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list([{"prompt": "Hi", "response": "Hello."}])}).save_to_disk(tmp_path / "dd")
    with pytest.raises(ValueError, match=r"dd holds the splits \['train'\], not one set of rows: give one split's"):
        read_rows(tmp_path / "dd")
    assert read_rows(tmp_path / "dd" / "train") == [{"prompt": "Hi", "response": "Hello."}]

    import train_heads
    from medusa_train.train_config import config_from_dict

    ready = tmp_path / "examples.jsonl"
    ready.write_text("".join(json.dumps(e) + "\n" for e in examples * 4))

    config = config_from_dict({"output_dir": str(tmp_path / "run"), "model": {"name": "smollm2-135m-instruct"},
                               "data": {"tokenized": str(ready), "max_length": 3, "heldout_fraction": 0.25}})
    train, heldout = train_heads.stage_data(config, OneProcess(), 0)
    assert len(train) + len(heldout) == 8 and all(len(e["input_ids"]) <= 3 for e in train + heldout)
    assert f"8 of 12 examples in {ready} cut to data.max_length=3 tokens; 4 dropped with no labelled token" \
        in capsys.readouterr().out
    ready.write_text("".join(json.dumps(e) + "\n" for e in [examples[0]] * 2 + [{"input_ids": [1, 2], "labels": [ignore] * 2}]))
    config = config_from_dict({"output_dir": str(tmp_path / "run2"), "model": {"name": "smollm2-135m-instruct"},
                               "data": {"tokenized": str(ready), "max_length": 3, "heldout_fraction": 0.5}})
    train_heads.stage_data(config, OneProcess(), 0)  # none cut, one dropped: said too
    assert "0 of 3 examples" in capsys.readouterr().out


def test_rows_the_build_cuts_or_drops_are_reported_by_the_run(tmp_path, capsys):
    """build_examples' counts went to a logger train_heads never shows: rows dropped or cut in silence."""
    import train_heads
    from medusa_train.train_config import config_from_dict

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "prompt": "Hi?", "response": "Hello there."},
        {"id": "b", "prompt": "Tell me a long story.", "response": " ".join(["word"] * 80)},  # cut
        {"id": "c", "messages": [{"role": "user", "content": "No answer here."}]},          # dropped
        {"id": "d", "prompt": " ".join(["question"] * 80), "response": "Fine."},             # prompt fills it
    ]))

    config = config_from_dict({"output_dir": str(tmp_path / "run"), "model": {"name": "smollm2-135m-instruct"},
                               "data": {"rows": str(rows), "max_length": 40, "heldout_fraction": 0.5}})
    for _ in range(2):  # built, then from the cache: said both times
        train, heldout = train_heads.stage_data(config, OneProcess(), 0)
        assert len(train) + len(heldout) == 2
        assert (f"data: 2 examples from 4 rows of {rows}; 1 cut to data.max_length=40 tokens, 1 dropped with no "
                "assistant turn, 1 dropped with a prompt that fills data.max_length=40, 2 of 2 examples tokenised "
                "from the answers' text") in capsys.readouterr().out
    # how many examples come from the tokens the model wrote went to the logger alone, too
    smol = load_tokenizer("smollm2-135m-instruct")
    written = smol("Hello there.", add_special_tokens=False)["input_ids"] + [smol.convert_tokens_to_ids("<|im_end|>")]
    rows.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "prompt": "Hi?", "response": "Hello there.", "finish_reason": "eos", "response_ids": written},
        {"id": "e", "prompt": "Hey?", "response": "Hi."}]))
    train_heads.stage_data(config, OneProcess(), 0)
    assert (f"data: 2 examples from 2 rows of {rows}; 1 of 2 examples tokenised from the answers' text (rows "
            "without the token ids the model wrote") in capsys.readouterr().out
    rows.write_text("".join(json.dumps({"id": name, "prompt": "Hi?", "response": "Hello there.",
                                        "finish_reason": "eos", "response_ids": written}) + "\n" for name in "ab"))
    train_heads.stage_data(config, OneProcess(), 0)
    assert "data:" not in capsys.readouterr().out  # every example from the ids, nothing left out: nothing to say


def test_rows_that_are_not_chats_and_template_errors_are_named_by_row(smol):
    """prompt/response rows of the wrong types are refused by row as messages rows are (a list response was
    trained on as its repr, a null prompt as an empty turn); a template failing on one row names it."""
    from medusa_train.dataset import row_messages

    for row, says in (({"id": "p", "prompt": None, "response": "Paris."}, "'prompt' must be a string, got None"),
                      ({"id": "r", "prompt": "Capital?", "response": ["Paris."]},
                       r"'response' must be a string or null, got \['Paris.'\]")):
        with pytest.raises(ValueError, match=f"row {row['id']!r}: {says}"):
            row_messages(row)
    assert row_messages({"prompt": "Capital?", "response": None}) == [{"role": "user", "content": "Capital?"}]
    rows = [{"id": "no-answer", "messages": CONVERSATION[1:2]}, {"id": "bad-2", "messages": CONVERSATION}]
    with pytest.raises(TemplateError, match="row 'bad-2': the chat template is not prefix-stable"):
        build_examples(rows, with_template(smol, NOT_PREFIX_STABLE), max_length=512)


def test_the_cache_key_follows_the_tokenizers_pipeline_not_only_its_vocabulary(smol):
    """A tokenizer fixed in place (another pre-tokenizer, same vocabulary) tokenises otherwise: a new key
    (the cached examples, tokenised the old way, were served)."""
    from tokenizers import pre_tokenizers

    from medusa_train.dataset import tokenizer_fingerprint

    other = copy.deepcopy(smol)
    other.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    assert other.get_vocab() == smol.get_vocab() and other("a b")["input_ids"] != smol("a b")["input_ids"]
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(smol)
    assert tokenizer_fingerprint(copy.deepcopy(smol)) == tokenizer_fingerprint(smol)
    padded = copy.deepcopy(smol)
    padded(["a", "a b c"], padding=True, truncation=True, max_length=2)  # leaves padding and truncation set
    assert tokenizer_fingerprint(padded) == tokenizer_fingerprint(smol)


def test_a_row_the_template_itself_refuses_is_named(smol):
    """Gemma's and Mistral's templates raise (jinja2's TemplateError) on roles that do not alternate: the
    error passed through with no row id, in a file of thousands."""
    strict = with_template(smol, "{% for m in messages %}{% if loop.index0 % 2 == 0 and m['role'] != 'user' %}"
                                 "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
                                 "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                 "{% if add_generation_prompt %}assistant: {% endif %}")
    rows = [{"id": "fine", "prompt": "Hi", "response": "Hello."},
            {"id": "two-users", "messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hey"},
                                             {"role": "assistant", "content": "Hello."}]}]
    with pytest.raises(TemplateError, match=r"^row 'two-users': the chat template refuses a conversation of user, "
                                            r"user, assistant \(roles must alternate user/assistant\)"):
        build_examples(rows, strict, 64)
    # a distilled row's prompt is rendered for its response_ids: that refusal escaped with no row named
    distilled = {"id": "ids", "messages": None, "prompt": "Hi", "response": "Hello.", "finish_reason": "length",
                 "response_ids": strict("Hello.", add_special_tokens=False)["input_ids"]}
    with pytest.raises(TemplateError, match=r"^row 'ids': the chat template refuses .*roles must alternate"):
        build_examples([distilled], strict, 64, system_prompt="Be brief.")


def test_system_prompt_is_not_added_before_a_conversations_own_system_message(smol):  # D1
    own = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Hello."}]
    assert row_messages({"messages": own}, "You are a pirate.") == own
    assert row_messages({"prompt": "Hi", "response": "Hello."}, "You are a pirate.")[0] == \
        {"role": "system", "content": "You are a pirate."}
    [example] = build_examples([{"id": "c", "messages": own}], smol, 512, "You are a pirate.")
    text = smol.decode(example["input_ids"])
    assert "Be brief." in text and "pirate" not in text


def test_an_id_just_past_the_tokenizer_is_not_taken_as_written(smol):  # D7: the boundary t == len(tokenizer)
    written = smol("Hello there", add_special_tokens=False)["input_ids"]
    row = {"id": "r", "prompt": "Hi?", "response": "Hello there", "finish_reason": "length",
           "response_ids": written + [len(smol)]}
    stats = BuildStats()
    [example] = build_examples([row], smol, 256, stats=stats)
    assert (stats.ids_unused, stats.from_ids) == (1, 0)
    assert len(smol) not in example["input_ids"]


def test_the_cache_is_not_reused_under_another_system_prompt(tmp_path, smol):  # D12
    import json

    from medusa_train.dataset import load_or_build_dataset

    rows_path = tmp_path / "rows.jsonl"
    rows_path.write_text("".join(json.dumps({"id": str(i), "prompt": f"Q{i}?", "response": f"A{i}."}) + "\n"
                                 for i in range(3)))
    cache = tmp_path / "cache"
    plain = load_or_build_dataset(rows_path, smol, 256, cache, system_prompt="Be a pirate.")
    other = load_or_build_dataset(rows_path, smol, 256, cache, system_prompt="Be a poet.")
    assert len(list(cache.glob("tokenized-*"))) == 2
    assert "Be a poet." in smol.decode(other["input_ids"][0]) and plain["input_ids"][0] != other["input_ids"][0]


def test_split_heldout_keeps_file_order_in_the_heldout_split_too():  # D14
    from medusa_train.dataset import split_heldout, to_dataset

    data = to_dataset([{"id": str(i), "input_ids": [i], "labels": [i]} for i in range(50)])
    for seed in range(5):
        train, heldout = split_heldout(data, 0.2, seed=seed)
        assert heldout["id"] == sorted(heldout["id"], key=int)
        assert train["id"] == sorted(train["id"], key=int)


def test_check_rows_takes_rows_that_record_no_system_prompt_or_template():  # D15
    from medusa_train.dataset import check_rows

    old = [{"id": "a", "prompt": "Q", "response": "A", "generation": {"max_new_tokens": 8}}]
    check_rows(old, None, "Be brief.")  # recorded none: taken as it is, whatever the prompt now
    check_rows(old, "{{ messages }}", None)
    with pytest.raises(ValueError, match="system prompt 'Other'"):
        check_rows([{**old[0], "generation": {"system_prompt": "Other"}}], None, "Be brief.")


def test_rows_whose_prompt_was_rendered_without_a_template_are_refused_under_one(smol):  # D16
    """A row distilled when the tokenizer had no chat template records prompt_template null: its prompt went as
    plain text, so an example built with the template now is an answer to another prompt."""
    row = {"id": "plain", "prompt": "Hi?", "response": "Hello.", "prompt_template": None}
    with pytest.raises(ValueError, match=r"row 'plain' was distilled with its prompt rendered by chat template None"):
        build_examples([row], smol, 256)
    [example] = build_examples([{k: v for k, v in row.items() if k != "prompt_template"}], smol, 256)  # none recorded
    assert example["id"] == "plain"


def test_an_empty_heldout_split_needs_no_head_positions():  # D17 (data.heldout_fraction=0)
    from medusa_train.dataset import check_head_positions

    check_head_positions([{"labels": [IGNORE_INDEX, 5, 6]}], [])
    with pytest.raises(ValueError, match="none of the 1 training examples"):
        check_head_positions([{"labels": [IGNORE_INDEX, 5]}], [])


def test_a_template_that_shortens_earlier_answers_keeps_a_last_answers_labels_whole(smol):  # D18
    """_through_turn cuts only after the turn's content: a template writing an answer followed by another turn
    otherwise (here: only its text before '|', as reasoning-dropping templates do) parts inside the content."""
    import copy

    from medusa_train.dataset import tokenize_chat

    other = copy.deepcopy(smol)
    other.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                           "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('|')[0] }}"
                           "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello | there friend."}]
    _, labels = tokenize_chat(other, messages)
    assert other.decode([t for t in labels if t != IGNORE_INDEX]) == "Hello | there friend.<|im_end|>"


def test_without_offsets_a_token_merged_across_an_answers_end_is_labelled(smol):  # D21
    """Turns with no separator: an answer's last token merges with the next turn's first letters ("Hellouser"
    tokenises ' Hell', 'ous', 'er'); the prefix path labels the token straddling the answer's end, as the offsets
    path labels every token straddling it (without it the first answer had no label at all)."""
    import copy

    from medusa_train.dataset import _tokenize_chat_by_prefix, assistant_char_spans

    other = copy.deepcopy(smol)
    other.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}"
                           "{% if add_generation_prompt %}assistant: {% endif %}")
    messages = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "More."}, {"role": "assistant", "content": "Sure."}]
    full, _ = assistant_char_spans(other, messages)
    ids, labels = _tokenize_chat_by_prefix(other, messages, full)
    labelled = [other.decode([t]) for t in labels if t != IGNORE_INDEX]
    assert labelled[0] == " Hell" and labelled[-2:] == [" Sure", "."]


def test_blank_lines_in_a_rows_file_are_skipped(tmp_path):  # D23
    from medusa_train.dataset import read_rows

    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "Q1", "response": "A1"}\n\n   \n{"prompt": "Q2", "response": "A2"}\n\n')
    assert [row["prompt"] for row in read_rows(path)] == ["Q1", "Q2"]


def test_a_rows_file_that_is_not_utf8_is_named_by_line(tmp_path):
    """The codec's own message named neither the file nor the line, and its position counted from the block read
    (a line past the first 8 KiB here)."""
    from medusa_train.dataset import read_rows, row_sources

    path = tmp_path / "rows.jsonl"
    good = b'{"prompt": "Q1", "response": "A1"}\n' * 300
    path.write_bytes(good + b'{"prompt": "Q2", "response": "caf\xe9"}\n')
    at = len(good) + len(b'{"prompt": "Q2", "response": "caf')
    says = f"{path}:301 is not UTF-8 text (invalid continuation byte at byte {at}): save it as UTF-8"
    with pytest.raises(ValueError) as err:
        read_rows(path)
    assert str(err.value) == says
    with pytest.raises(ValueError) as err:
        list(row_sources(path))
    assert str(err.value) == says


def test_a_cut_answers_trailing_space_token_is_labelled_under_trimmed_offsets():
    """A byte-level tokenizer that trims offsets gives a cut answer's trailing space token the zero-width offsets
    (end, end): it is the answer's last token all the same, and labelled (no test saw it left out)."""
    import copy

    from tokenizers import processors

    from medusa_infer.models import load_tokenizer
    from medusa_train.dataset import IGNORE_INDEX, build_examples

    tokenizer = copy.deepcopy(load_tokenizer("smollm2-135m-instruct"))
    tokenizer.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    answer = "Six feet down, under the roots, where the "
    [example] = build_examples([{"id": "cut", "prompt": "How deep?", "response": answer, "finish_reason": "length"}],
                               tokenizer, 512)
    assert example["labels"][-1] == example["input_ids"][-1]
    assert tokenizer.decode([t for t in example["labels"] if t != IGNORE_INDEX]) == answer
