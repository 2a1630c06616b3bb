"""The OpenAI-compatible server, driven by the official ``openai`` client against a live uvicorn
server on loopback: a tiny random llama with a word-level tokenizer (no downloads), Medusa heads."""

from __future__ import annotations

import itertools
import json
import threading

import httpx
import openai
import pytest

from medusa_infer.decoding import SamplingConfig, StopConfig, generate
from medusa_infer.model import MedusaModel
from medusa_infer.proposers import build_proposer
from medusa_infer.serving import cli
from medusa_infer.serving.app import TextAssembler
from medusa_infer.serving.scheduler import Request
from medusa_infer.serving.testing import WORDS, ServerThread, metric_value, serve, torch_threads, word_tokenizer
from medusa_infer.tree_fit import CostProfile
from medusa_infer.trees import REFERENCE_HEAD_ACCURACY
from tiny import word_medusa

PROMPT = "the cat sat on the mat and the dog ran to the house"
MESSAGES = [{"role": "system", "content": "you are a good dog"}, {"role": "user", "content": "hello world"}]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model():
    with torch_threads(1):
        yield word_medusa()


@pytest.fixture(scope="module")
def server(model):
    # these tests count speculative steps: every step speculates (the gate that would make that
    # depend on timings is tested in test_speculation_gate.py)
    with serve(model, "medusa", speculation_gate=False) as (server, engine):
        yield server, engine


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server[0].base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def metrics_text(server) -> str:
    return httpx.get(server[0].base_url + "/metrics", timeout=10).text


def test_models_list(client, model):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].model_extra["max_model_len"] == model.base_model.config.max_position_embeddings
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="`gpt-17` does not exist"):
        client.models.retrieve("gpt-17")


def read_on(tokenizer, sequence, prompt_length: int) -> str:
    """The text a completion of ``sequence[:prompt_length]`` should carry: what the prompt's text needs
    to become the whole sequence's text (a leading space included where the tokenizer has one)."""
    prompt = tokenizer.decode(sequence[:prompt_length], skip_special_tokens=True)
    whole = tokenizer.decode(sequence, skip_special_tokens=True)
    assert whole.startswith(prompt)
    return whole[len(prompt):]


def test_greedy_completion_equals_library_generate(client, model):
    tokenizer = model.tokenizer
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body=NO_EOS)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    expected = generate(model, ids, max_new_tokens=12, eos_token_id=[])
    assert answer.choices[0].text == read_on(tokenizer, expected.sequences[0], ids.shape[1])
    assert answer.choices[0].finish_reason == "length"
    assert answer.object == "text_completion" and answer.id.startswith("cmpl-")


def test_requests_decoded_alone_share_the_engines_learned_step_costs():
    """With the adaptive fallback, every request's controller learns batch-1 step costs into the
    engine's one ``StepCosts`` (as medusa-bench shares one across questions); output stays exact."""
    with torch_threads(1):
        calibrated = word_medusa()
    calibrated.config.head_accuracies = [list(itertools.accumulate(row)) for row in REFERENCE_HEAD_ACCURACY[:3]]
    calibrated.config.cost_profile = CostProfile([1, 2, 4, 8, 16], [1.0, 1.12, 1.36, 1.6, 2.2], "2-core cpu").to_dict()
    tokenizer = calibrated.tokenizer
    with serve(calibrated, "medusa", speculation_gate=False) as (server, engine), \
            openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        assert engine.step_costs is not None
        for prompt in (PROMPT, "hello world", "the dog ran to the cat"):
            answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                               extra_body=NO_EOS)
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            expected = generate(calibrated, ids, max_new_tokens=40, eos_token_id=[])
            assert answer.choices[0].text == read_on(tokenizer, expected.sequences[0], ids.shape[1])
    summary = engine.step_costs.summary()
    assert sum(pair["samples"] for pair in summary.values()) >= 3  # a neighbouring tree every 8 steps
    # a seeded sampled request's trees must not depend on the clock: its batch learns nothing
    seeded = Request([1, 2], SamplingConfig(acceptance="lossless", temperature=0.8), StopConfig(max_new_tokens=4),
                     lambda update: None, seed=7)
    assert engine.options_for(seeded.batch_key).step_costs is None
    assert engine.options_for(Request([1, 2], SamplingConfig(), StopConfig(max_new_tokens=4),
                                      lambda update: None).batch_key).step_costs is engine.step_costs


def test_chat_streamed_equals_whole(client):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                                           extra_body=NO_EOS)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, extra_body=NO_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert whole.choices[0].message.role == "assistant"
    assert streamed == whole.choices[0].message.content and len(streamed.split()) == 10
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    # without stream_options.include_usage no chunk carries usage, not even the last one (OpenAI's spec)
    assert all(c.usage is None and "usage" not in c.model_fields_set for c in chunks)


def test_streamed_completion_with_include_usage(client, model):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_EOS))
    prompt_tokens = len(model.tokenizer(PROMPT)["input_ids"])
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (prompt_tokens, 6, prompt_tokens + 6)
    assert chunks[-2].choices[0].finish_reason == "length"
    # every other chunk has "usage": null, so a client summing usage over the chunks counts it once
    assert all(c.usage is None and "usage" in c.model_fields_set for c in chunks[:-1])
    speculative = usage.model_extra["speculative"]
    assert speculative["method"] == "medusa" and speculative["tau"] >= 1.0


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
], ids=["completions", "chat"])
@pytest.mark.parametrize("include_usage", [None, False, True])
def test_stream_usage_follows_openai(server, model, path, body, include_usage):
    """On the wire: usage comes once, in one extra chunk with no choices, and only when asked for."""
    request = {"model": "tiny", "max_tokens": 7, "temperature": 0, "stream": True, "ignore_eos": True, **body}
    if include_usage is not None:
        request["stream_options"] = {"include_usage": include_usage}
    with httpx.stream("POST", server[0].base_url + path, json=request, timeout=60) as answer:
        assert answer.status_code == 200
        lines = [line[len("data: "):] for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    finish = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"] is not None]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
    if not include_usage:
        assert all("usage" not in e for e in events)
        return
    assert all(e["usage"] is None for e in events[:-1])
    last = events[-1]
    assert last["choices"] == [] and last["id"] == events[0]["id"]
    whole = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
    prompt_tokens = httpx.post(server[0].base_url + path, json=whole, timeout=60).json()["usage"]["prompt_tokens"]
    if path == "/v1/completions":
        assert prompt_tokens == len(model.tokenizer(PROMPT)["input_ids"])
    assert last["usage"]["completion_tokens"] == 7 and last["usage"]["prompt_tokens"] == prompt_tokens
    assert last["usage"]["total_tokens"] == prompt_tokens + 7
    assert last["usage"]["speculative"]["method"] == "medusa"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text(client, stream):
    free = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body=NO_EOS)
    words = free.choices[0].text.split()
    stop = words[3]
    expected = free.choices[0].text[: free.choices[0].text.index(stop)]
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "no such words"])
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        answer = client.completions.create(**kwargs)
        text, finish = answer.choices[0].text, answer.choices[0].finish_reason
    assert text == expected and stop not in text
    assert finish == "stop"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("engine_window", [None, 1])
def test_a_stop_string_the_engine_misses_still_stops(client, monkeypatch, engine_window, stream):
    """The engine looks for stop strings in a row's last ``StopConfig.window`` tokens only (enough
    unless more than 8 tokens inside a stop string decode to nothing); the server reads the whole
    text and ends the request where the engine missed one (``engine_window=1``: it sees no
    multi-token stop string), with the same text, finish reason and a cut short decode."""
    if engine_window is not None:
        monkeypatch.setattr(StopConfig, "window", property(lambda self: engine_window))
    free = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=60, temperature=0, extra_body=NO_EOS)
    words = free.choices[0].text.split(" ")
    stop = " ".join(words[5:45])
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=60, temperature=0, stop=stop, extra_body=NO_EOS)
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish, usage = [c.choices[0].finish_reason for c in chunks if c.choices][-1], chunks[-1].usage
    else:
        answer = client.completions.create(**kwargs)
        text, finish, usage = answer.choices[0].text, answer.choices[0].finish_reason, answer.usage
    assert text == free.choices[0].text[: free.choices[0].text.index(stop)]
    assert finish == "stop"
    assert usage.completion_tokens < 60  # ended at the stop string, not decoded to the limit


@pytest.mark.parametrize("stream", [False, True])
def test_usage_of_a_stop_the_engine_missed_leaves_out_steps_taken_before_the_cancel_took_effect(
        server, client, monkeypatch, stream):
    """The server's cancel of a stop string the engine missed takes effect at the engine's next turn;
    the steps it took meanwhile (as many as the load made) are not the answer's and not counted."""
    monkeypatch.setattr(StopConfig, "window", property(lambda self: 1))  # the engine misses the stop
    free = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=60, temperature=0, extra_body=NO_EOS)
    stop = " ".join(free.choices[0].text.split(" ")[5:8])
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=60, temperature=0, stop=stop, extra_body=NO_EOS)

    def usage():
        if stream:
            return list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                                  **kwargs))[-1].usage
        return client.completions.create(**kwargs).usage

    timely = usage()
    engine, cancel = server[1], server[1].cancel

    def late_cancel(request, reason="disconnect"):  # as under load: the engine steps on a while
        if reason != "stop":
            return cancel(request, reason)
        threading.Timer(0.5, cancel, (request, reason)).start()

    monkeypatch.setattr(engine, "cancel", late_cancel)
    late = usage()
    assert late.completion_tokens == timely.completion_tokens < 20
    assert late.speculative == timely.speculative


def test_text_assembler_holds_back_what_may_become_a_stop_string(model):
    ids = model.tokenizer.convert_tokens_to_ids
    text = TextAssembler(model.tokenizer, ("cat sat", "dog"))
    assert text.add([ids("the")]) == "the"
    assert text.add([ids("cat")]) == " "  # "cat" may begin "cat sat": held back
    assert text.add([ids("ran")]) == "cat ran"
    assert text.add([ids("cat"), ids("sat"), ids("on")]) == " "
    assert text.stopped and text.add([ids("mat")], final=True) == ""
    flushed = TextAssembler(model.tokenizer, ("cat sat",))
    assert flushed.add([ids("the"), ids("cat")]) == "the " and flushed.add([], final=True) == "cat"


def test_text_assembler_joins_to_the_decoded_answer_with_a_tokenizer_that_cleans_up_spaces():
    """decode's clean_up_tokenization_spaces (WordPiece, Unigram, WordLevel tokenizers) rewrites a text's end once
    later tokens show; decoded a window at a time, the server's text was cleaned within windows and not across
    them ("hello it ' s fine don't.")."""
    from medusa_infer.serving.testing import word_tokenizer

    tokenizer = word_tokenizer(("hello", "it", "'", "s", "fine", "do", "n't", "."))
    tokenizer.clean_up_tokenization_spaces = True
    ids = tokenizer("hello it ' s fine do n't .", add_special_tokens=False)["input_ids"]
    for context in (0, 1):  # after a prompt, the text reads as it does there: with the space before "it"
        text = TextAssembler(tokenizer, (), ids[:context])
        chunks = [text.add([token], final=n == len(ids) - context - 1) for n, token in enumerate(ids[context:])]
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(chunks) == whole[len(tokenizer.decode(ids[:context])):], chunks
        assert len([chunk for chunk in chunks if chunk]) > 3  # (streamed, not all at the end)
    stopped = TextAssembler(tokenizer, ("'s",), ids[:1])
    assert "".join(stopped.add([token]) for token in ids[1:]) == " it" and stopped.stopped
    # a stop string only in text the cleanup then rewrites ("don '" of "don ' t", "don't") does not stop it
    tokenizer = word_tokenizer(("don", "'", "t", "go"))
    tokenizer.clean_up_tokenization_spaces = True
    ids = tokenizer("don ' t go", add_special_tokens=False)["input_ids"]
    rewritten = TextAssembler(tokenizer, ("don '",))
    chunks = [rewritten.add([token], final=n == len(ids) - 1) for n, token in enumerate(ids)]
    assert "".join(chunks) == "don't go" and not rewritten.stopped
    # a stop string the cleanup makes ("it '" and "s" read "it's"): "it" was sent before it showed, as the end that
    # may begin a stop was looked for in text the cleanup then rewrote
    tokenizer = word_tokenizer(("do", "it", "'", "s", "x"))
    tokenizer.clean_up_tokenization_spaces = True
    ids = tokenizer("do it ' s x", add_special_tokens=False)["input_ids"]
    made = TextAssembler(tokenizer, ("it's",), ids[:1])
    assert "".join(made.add([token]) for token in ids[1:]) == " " and made.stopped


def test_a_bpe_tokenizer_asking_for_space_cleanup_is_not_taken_for_one_that_cleans():
    """transformers skips clean_up_tokenization_spaces for BPE tokenizers (Llama 3's config asks for it): such a
    tokenizer was taken through the cleaning tokenizers' whole-text path, which lost a character a prompt ended
    inside of and the answer completed."""
    import copy

    from medusa_infer.decoding import cleans_spaces
    from medusa_infer.models import load_tokenizer
    from medusa_infer.serving.testing import word_tokenizer

    tokenizer = copy.deepcopy(load_tokenizer("smollm2-135m-instruct"))
    tokenizer.clean_up_tokenization_spaces = True
    ids = tokenizer(" it 's", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == " it 's" and not cleans_spaces(tokenizer)  # (transformers' decode: no cleanup)
    cat = tokenizer(" \u732b", add_special_tokens=False)["input_ids"]  # a space and a CJK character, bytes apart
    assert len(cat) > 1
    text = TextAssembler(tokenizer, (), cat[:-1])  # the prompt ends inside the character, the answer completes it
    assert text.add(cat[-1:], final=True) == "\u732b"
    words = word_tokenizer(("it", "'", "s"))
    words.clean_up_tokenization_spaces = True
    assert cleans_spaces(words)


def test_text_after_a_prompt_ending_inside_byte_tokens_is_whole_and_its_stop_strings_found():
    """A byte-fallback tokenizer (Llama-2, Mistral) with a prompt ending in emoji: the last prompt tokens
    decoded as context started inside a character, so the generated emoji continuing their run of byte
    tokens came out as four U+FFFD, and a stop string in it was never found (the server's text and the
    engine's stop-string window both)."""
    from medusa_infer.decoding import generated_text_tail
    from tiny import byte_fallback_tokenizer

    tokenizer = byte_fallback_tokenizer()
    prompt = tokenizer("party time \U0001F389\U0001F389")["input_ids"]
    new = tokenizer("\U0001F389 the party", add_special_tokens=False)["input_ids"][1:]  # the emoji's bytes first
    assert tokenizer.convert_ids_to_tokens(new[:4]) == ["<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"]
    whole = tokenizer.decode(prompt + new, skip_special_tokens=True)
    expected = whole[len(tokenizer.decode(prompt, skip_special_tokens=True)):]
    assert expected == "\U0001F389 the party"
    for chunks in ([[token] for token in new], [new]):
        text = TextAssembler(tokenizer, (), prompt)
        assert "".join(text.add(chunk, final=i == len(chunks) - 1) for i, chunk in enumerate(chunks)) == expected
    stopped = TextAssembler(tokenizer, ("\U0001F389",), prompt)
    assert stopped.add(new) == "" and stopped.stopped
    assert generated_text_tail(tokenizer, prompt + new, len(prompt), window=12) == expected


def test_an_answer_after_a_prompt_ending_in_special_tokens_keeps_its_leading_space():
    """The prompt's last 6 tokens, decoded as context, were all special (no text): a SentencePiece answer
    lost the space before its first word ('out' for ' out'), and a stop string starting with it was missed
    (in the server's text and the engine's stop-string window both)."""
    from medusa_infer.decoding import generated_text_tail
    from tiny import metaspace_tokenizer

    tokenizer = metaspace_tokenizer()
    word, out = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("the", "out"))
    for specials in (5, 6, 12):
        prompt = word + [tokenizer.unk_token_id] * specials
        before = tokenizer.decode(prompt, skip_special_tokens=True)
        expected = tokenizer.decode(prompt + out, skip_special_tokens=True)[len(before):]
        assert expected == " out"
        assert TextAssembler(tokenizer, (), prompt).add(out, final=True) == expected
        stopped = TextAssembler(tokenizer, (" out",), prompt)
        assert stopped.add(out) == "" and stopped.stopped
        assert generated_text_tail(tokenizer, prompt + out, len(prompt), window=4) == expected


def test_an_answer_completing_a_character_its_prompt_ids_end_inside_of_begins_with_it():
    """A prompt given as token ids may end inside a character (its first bytes): the answer's text began
    as many characters late as the prompt's text ended in U+FFFD (an emoji and the next word were lost),
    and the engine's stop-string window missed that character. The text begins with the character the
    answer completes, and with none of the prompt's whole characters (a byte-fallback tokenizer reads all
    the run of byte tokens a cut ends, characters complete before it included, as U+FFFD): in the server's
    text (streamed token by token or at once) and in that window, for a byte-fallback tokenizer (Llama-2,
    Gemma) and the default model's byte-level one."""
    from medusa_infer.decoding import generated_text_tail
    from medusa_infer.models import load_tokenizer
    from tiny import byte_fallback_tokenizer

    long_run = "the party \u1000\u2c0e\u307c\u40ba\u50f8\u6136\u7174 is now"  # 7 characters of 3 bytes each
    tokenizer = byte_fallback_tokenizer()
    ids = tokenizer(long_run, add_special_tokens=False)["input_ids"]
    first = tokenizer.convert_ids_to_tokens(ids).index("<0xE1>")  # the run's 21 byte tokens begin here
    for cut in range(first + 1, first + 21):  # a cut deep in the run: the context began inside a character
        whole = tokenizer.decode(ids[:cut - (cut - first) % 3])
        expected = long_run[len(whole):]
        assembler = TextAssembler(tokenizer, (), ids[:cut])
        assert assembler.add(ids[cut:], final=True) == expected, cut
        assert generated_text_tail(tokenizer, ids, cut, window=40) == expected, cut
        stop = expected[1]  # a character of the answer's text only
        stopped = TextAssembler(tokenizer, (stop,), ids[:cut])
        assert stopped.add(ids[cut:]) == expected[:1] and stopped.stopped, cut

    text = "party time \U0001F389\u65e5 the party"
    # prompt cuts (tokens kept) and the answer's text: the tokens are listed in the comments
    cases = {
        # '▁party' '▁time' '▁' <F0> <9F> <8E> <89> <E6> <97> <A5> '▁the' '▁party'
        "byte-fallback": (byte_fallback_tokenizer(), {3: "\U0001F389\u65e5 the party", 4: "\U0001F389\u65e5 the party",
                                                      6: "\U0001F389\u65e5 the party", 7: "\u65e5 the party",
                                                      8: "\u65e5 the party", 9: "\u65e5 the party", 10: " the party"}),
        # 'party' 'Ġtime' 'ĠðŁ' 'İ' 'ī' 'æĹ' '¥' 'Ġthe' 'Ġparty'
        "byte-level": (load_tokenizer("smollm2-135m-instruct"), {2: " \U0001F389\u65e5 the party",
                                                                   3: "\U0001F389\u65e5 the party",
                                                                   4: "\U0001F389\u65e5 the party",
                                                                   5: "\u65e5 the party", 6: "\u65e5 the party",
                                                                   7: " the party"}),
    }
    for name, (tokenizer, answers) in cases.items():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text, name
        for cut, expected in answers.items():
            prompt, new = ids[:cut], ids[cut:]
            for chunks in ([[token] for token in new], [new]):
                assembler = TextAssembler(tokenizer, (), prompt)
                joined = "".join(assembler.add(chunk) for chunk in chunks) + assembler.add([], final=True)
                assert joined == expected, (name, cut, joined)
            assert generated_text_tail(tokenizer, ids, cut, window=20) == expected, (name, cut)
            for stop in ("\U0001F389", "\u65e5"):  # a stop string in the answer's text only stops it
                stopped = TextAssembler(tokenizer, (stop,), prompt)
                assert stopped.add(new) == expected.split(stop)[0] and stopped.stopped == (stop in expected)


def test_a_stop_string_ending_a_run_of_byte_tokens_longer_than_the_window_is_found():
    """The engine looks for stop strings in the text of a row's last tokens; within a run of byte tokens
    longer than that window the window began inside a character, and a byte-fallback tokenizer read all
    the run as U+FFFD: the row ran past its stop string (or to its token limit)."""
    from medusa_infer.decoding import StopConfig, generated_text_tail
    from tiny import byte_fallback_tokenizer

    tokenizer = byte_fallback_tokenizer()
    answer = "\u1000\u2c0e\u307c\u40ba\u50f8\u6136\u7174"  # 7 characters of 3 bytes: 21 byte tokens
    tokens = tokenizer(answer, add_special_tokens=False)["input_ids"]
    tokens = tokens[tokens.index(tokenizer.convert_tokens_to_ids("<0xE1>")):]
    assert len(tokens) == 21 and tokenizer.decode(tokens) == answer
    prompt = tokenizer("the party", add_special_tokens=False)["input_ids"]
    window = StopConfig(64, (), ("\u7174",)).window
    assert window < len(tokens)
    for end in range(window + 1, len(tokens) + 1, 3):  # each time the run ends on a whole character
        tail = generated_text_tail(tokenizer, prompt + tokens[:end], len(prompt), window)
        assert tail and answer[:end // 3].endswith(tail), (end, tail)
    assert generated_text_tail(tokenizer, prompt + tokens, len(prompt), window).endswith("\u7174")


def test_a_byte_level_answer_ending_in_stray_bytes_keeps_each_replacement_character():
    """A byte-level tokenizer (SmolLM2) decodes each stray byte to a U+FFFD of its own: the server's final text
    squashed them into one (the byte-fallback tokenizers' case below), unlike the tokens' decode, generate()'s
    text and the text the engine matched stop strings in."""
    from medusa_infer.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    lead, tail = tokenizer.convert_tokens_to_ids("\u00f0"), tokenizer.convert_tokens_to_ids("\u0142")  # F0, A0
    the = tokenizer("The", add_special_tokens=False)["input_ids"]
    for answer in (the + [lead, lead], the + [tail, tail, lead], the + [lead]):
        served = TextAssembler(tokenizer, (), tokenizer("Hello")["input_ids"]).add(answer, final=True)
        assert served == tokenizer.decode(answer, skip_special_tokens=True), answer


def test_streamed_text_of_a_run_of_byte_tokens_joins_to_the_decoded_answer():
    """A byte-fallback tokenizer (Gemma, Llama-2) decodes a run of byte tokens as one, every byte U+FFFD
    while it ends inside a character, characters it completed before included: a character sent as
    soon as its bytes were in read otherwise in the answer once an incomplete one (a stray byte, or the
    answer cut mid-character) joined the run. Both the server's text and ``stream()``'s are checked."""
    from medusa_infer.decoding import _TextTracker
    from tiny import byte_fallback_tokenizer

    tokenizer = byte_fallback_tokenizer()
    byte = lambda b: tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>")  # noqa: E731
    sun = [byte(b) for b in "\u65e5".encode()]  # a whole character, then the first byte of another
    word = tokenizer("the", add_special_tokens=False)["input_ids"]
    end_id = tokenizer.eos_token_id  # skipped in decoding: the bytes either side of it decode as one run
    def as_bytes(tokens: list[int]) -> str:  # the text of their bytes, a character cut short one U+FFFD
        pieces = [tokenizer.convert_ids_to_tokens(t) for t in tokens if t not in tokenizer.all_special_ids]
        data = b"".join(bytes([int(p[3:5], 16)]) if p.startswith("<0x") else p.replace("\u2581", " ").encode()
                        for p in pieces)
        return data.decode("utf-8", errors="replace").removeprefix(" ")

    for answer in (sun + [byte(0xE6)] + word, sun + [byte(0xE6)], word + sun + word, sun + [end_id, byte(0xE6)] + word):
        expected = tokenizer.decode(answer, skip_special_tokens=True)
        for end in range(1, len(answer) + 1):  # each token as it comes, the last one final
            tracker, assembler = _TextTracker(tokenizer, 1), TextAssembler(tokenizer)
            streamed = "".join(tracker.update(0, answer[:i], final=i == end) for i in range(1, end + 1))
            served = "".join(assembler.add(answer[i - 1:i], final=i == end) for i in range(1, end + 1))
            cut = tokenizer.decode(answer[:end], skip_special_tokens=True)
            assert streamed == cut, (answer[:end], streamed, cut)
            # the server's text of an answer that ends inside a character: the characters of its run of byte
            # tokens complete before that one (the decoder reads them all as U+FFFD), then one U+FFFD
            assert served == (as_bytes(answer[:end]) if cut.endswith("\ufffd") else cut), (answer[:end], served)
        assert cut == expected


def test_a_run_of_byte_tokens_is_followed_in_time_linear_in_its_length():
    """Each update looks at the tokens it adds only (a run held back was scanned whole at every token:
    4000 byte tokens took 10 s of the server's event loop), and a tokenizer whose ``convert_ids_to_tokens``
    gives bytes or refuses an id (remote-code tiktoken ones) has no byte tokens (it raised)."""
    from medusa_infer.decoding import ByteRun
    from tiny import byte_fallback_tokenizer

    tokenizer = byte_fallback_tokenizer()
    emoji = tokenizer("\U0001F389", add_special_tokens=False)["input_ids"][1:]
    assert tokenizer.convert_ids_to_tokens(emoji[0]) == "<0xF0>"
    looked = []

    class Counting:
        all_special_ids = tokenizer.all_special_ids

        def convert_ids_to_tokens(self, token_id):
            looked.append(token_id)
            return tokenizer.convert_ids_to_tokens(token_id)

    ids, run = [], ByteRun(Counting())
    for token in emoji * 250:
        ids.append(token)
        assert run(ids) == 0
    ids += tokenizer("the", add_special_tokens=False)["input_ids"]
    assert run(ids) == len(ids) and len(looked) == len(ids)

    class Tiktoken:
        all_special_ids = [0]

        def convert_ids_to_tokens(self, token_id):
            if token_id > 9:
                raise ValueError("unknown ids")
            return b"<0xF0>"

    assert ByteRun(Tiktoken())([5, 11]) == 2


def test_usage_carries_speculative_statistics(client, model):
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, extra_body=NO_EOS)
    usage = answer.usage
    prompt_tokens = len(model.tokenizer(PROMPT)["input_ids"])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (prompt_tokens, 16, prompt_tokens + 16)
    spec = usage.model_extra["speculative"]
    assert set(spec) == {"method", "tau", "accepted_tokens", "draft_steps"}
    # the first token comes from the prefill; each step adds its accepted drafts plus one token
    assert 1 <= spec["draft_steps"] <= 15 and spec["accepted_tokens"] >= 0
    assert spec["draft_steps"] + spec["accepted_tokens"] >= 15
    # tokens per step, the prefill's token not a step's; stopped by the length on a step's own token here, so
    # each step emitted its accepted drafts and one token more
    assert spec["tau"] == pytest.approx(15 / spec["draft_steps"], abs=1e-3)
    assert spec["tau"] == pytest.approx((spec["accepted_tokens"] + spec["draft_steps"]) / spec["draft_steps"], abs=1e-3)
    assert usage.completion_tokens_details.accepted_prediction_tokens == spec["accepted_tokens"]


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.9,
                                                top_p=0.95, seed=seed, extra_body=NO_EOS)
        return answer.choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in range(5)}) > 1  # it samples (a server decoding greedily passed)
    # OpenAI's seeds are int64, negative ones too (they were refused); past 2**63 a seed is not drawn as
    # seed - 2**63 (torch's CPU generator keeps 63 bits)
    assert sample(-1) == sample(-1) and sample(2**63 + 5) != sample(5)


def test_health_and_metrics_counters_increase(server, client):
    health = httpx.get(server[0].base_url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert httpx.head(server[0].base_url + "/health", timeout=10).status_code == 200  # a load balancer's probe
    before = metrics_text(server)
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body=NO_EOS)
    after = metrics_text(server)

    def grew(name, **labels):
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert grew("vllm:request_success_total", finished_reason="length") == 1
    assert grew("vllm:generation_tokens_total") == 8
    assert grew("vllm:prompt_tokens_total") == answer.usage.prompt_tokens
    assert grew("medusa:http_requests_total", path="/v1/completions", status="200") == 1
    httpx.get(server[0].base_url + "/v1/models/tiny", timeout=10)  # counted under its route, not as "other"
    assert metric_value(metrics_text(server), "medusa:http_requests_total", path="/v1/models/:id") - \
        metric_value(after, "medusa:http_requests_total", path="/v1/models/:id") == 1
    spec = answer.usage.model_extra["speculative"]
    assert 1 <= grew("vllm:spec_decode_num_drafts_total") <= spec["draft_steps"]
    assert grew("vllm:spec_decode_num_draft_tokens_total") >= grew("vllm:spec_decode_num_drafts_total")
    assert grew("vllm:spec_decode_num_accepted_tokens_total") == spec["accepted_tokens"]
    per_position = sum(grew("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=p) for p in range(3))
    assert per_position == spec["accepted_tokens"]
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in after
    assert grew("vllm:e2e_request_latency_seconds_count") == 1
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in after
    # vLLM's meanings: one inter-token sample per decoding step after the first token (the old name, vLLM's
    # alias of it, got one per request: its mean), and the per-request mean under its own name
    assert grew("vllm:request_time_per_output_token_seconds_count") == 1
    for name in ("vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count"):
        assert grew(name) == spec["draft_steps"] > 1, name


@pytest.mark.parametrize("sampling, param", [(dict(top_k=5), "top_k"), (dict(top_p=0.9), "top_p")])
def test_typical_acceptance_refuses_top_k_and_top_p_with_a_400(model, sampling, param):
    """Typical acceptance samples at the temperature only: a request that sets top_k or top_p
    would silently get another distribution; it is a 400 naming the parameter, whether typical is
    the server's default (--acceptance typical) or the request's own choice."""
    with serve(model, "medusa", acceptance="typical", speculation_gate=False) as (server, _), \
            openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        for extra in ({}, {"acceptance": "typical"}):
            top_p = sampling.get("top_p", openai.NOT_GIVEN)
            extra_body = {**extra, **({"top_k": sampling["top_k"]} if "top_k" in sampling else {})}
            with pytest.raises(openai.BadRequestError) as refused:
                client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0.8, top_p=top_p,
                                          extra_body=extra_body)
            error = refused.value.body
            assert error["param"] == param and "acceptance='typical'" in error["message"]
            assert error["type"] == "invalid_request_error"
        # without them typical acceptance samples; temperature 0 is greedy, where top-k and top-p do not matter
        assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0.8).choices
        assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, top_p=0.5,
                                         extra_body={"top_k": 3}).choices


def test_api_key_is_required_when_set(model):
    with serve(model, "medusa", api_key="s3cret") as (server, _):
        base = server.base_url
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            answer = httpx.get(base + "/v1/models", headers=headers, timeout=10)
            assert answer.status_code == 401
            assert answer.json()["error"]["code"] == "invalid_api_key"
        with openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        with openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0) as good:
            assert good.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(base + "/health", timeout=10).status_code == 200  # open, as in vLLM


def test_cli_serves_heads_loaded_from_a_folder(model, tmp_path):
    model.base_model.save_pretrained(tmp_path / "base")
    model.tokenizer.save_pretrained(tmp_path / "base")
    model.save_pretrained(tmp_path / "heads")
    args = cli.parse_args(["--model", str(tmp_path / "base"), "--heads", str(tmp_path / "heads"), "--max-batch", "4",
                           "--lookup-tokens", "3"])
    assert args.method == "medusa" and args.host == "127.0.0.1" and not args.trust_remote_code
    loaded = cli.load_model(args)
    assert loaded.config.num_heads == 3 and loaded.tokenizer is not None
    assert build_proposer(args.method, loaded, args).lookup_tokens == 3  # the grafted lookup branch
    app, engine = cli.build_app(loaded, cli.served_name(args, loaded), args.method, options=args,
                                max_batch=args.max_batch)
    with ServerThread(app) as server:
        answer = httpx.post(server.base_url + "/v1/completions", timeout=30,
                            json={"model": str(tmp_path / "base"), "prompt": PROMPT, "max_tokens": 5, "temperature": 0})
    assert answer.status_code == 200 and answer.json()["usage"]["speculative"]["method"] == "medusa"
    assert not engine.alive  # stopped with the server


@pytest.mark.parametrize("argv, message", [
    (["--method", "lookup", "--lookup-tokens", "2"], "--lookup-tokens grafts lookup onto the Medusa tree"),
    (["--heads", "h", "--lookup-tokens", "-1"], "--lookup-tokens must be >= 0"),
    # (taken, and nothing read them)
    (["--method", "autoregressive", "--speculation-gate", "off"], "--method autoregressive never speculates: drop "
                                                                  "--speculation-gate"),
    (["--method", "lookup", "--no-datastore"], "and no --heads is given: drop --no-datastore"),
])
def test_cli_refuses_lookup_tokens_it_cannot_use(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--method", "lookup", "--draft-tokens", "0"], "--draft-tokens must be at least 1, got 0"),
    (["--method", "layerskip", "--layerskip-layers", "-2"], "--layerskip-layers must be at least 1, got -2"),
    (["--method", "lookup", "--draft-model", "small"], "--draft-model is used by --method draft only, not --method "
                                                       "lookup"),
    (["--draft-model", "small"], "--draft-model is used by --method draft only, not --method autoregressive"),
    (["--method", "lookup", "--tree", "chain"], "--tree shapes the Medusa heads' candidates (--method medusa), not "
                                                "--method lookup; drop --tree"),
    (["--draft-tokens", "9"], "--draft-tokens is read by --method draft / layerskip / lookup, not --method "
                              "autoregressive"),
    (["--method", "lookup", "--layerskip-layers", "3"], "--layerskip-layers is read by --method layerskip, not "
                                                        "--method lookup"),
    (["--method", "lookup", "--request-timeout", "nan"], "--request-timeout must be a number of seconds >= 0"),
])
def test_cli_refuses_flags_the_method_cannot_use_before_loading(argv, message, capsys, monkeypatch):
    def no_loading(args):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(cli, "load_model", no_loading)
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("missing", ["fastapi", "uvicorn"])
def test_cli_without_the_serve_extra_says_so_before_loading(missing, capsys, monkeypatch):
    """uvicorn without fastapi (or the reverse) loaded and warmed up the model, then failed in a traceback."""
    import sys

    def no_loading(args):
        raise AssertionError("a model was loaded before the serve extra was checked")

    monkeypatch.setattr(cli, "load_model", no_loading)
    monkeypatch.setitem(sys.modules, missing, None)  # an import of it raises ImportError
    assert cli.main([]) == 1
    assert "the server needs the serve extra: pip install 'medusa-forge[serve]'" in capsys.readouterr().err


def test_cli_ends_on_ctrl_c_without_a_traceback(monkeypatch):
    """uvicorn shuts down on Ctrl-C, then raises the KeyboardInterrupt again (uvicorn.run swallows it; the
    server object's run does not): every Ctrl-C printed two tracebacks."""
    import socket

    from medusa_infer.serving import app as app_module
    from tiny import tiny_model

    class Interrupted:
        def run(self, sockets):
            raise KeyboardInterrupt

    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    model = MedusaModel.without_heads(tiny_model("llama"), word_tokenizer())
    monkeypatch.setattr(cli, "load_model", lambda args: model)
    monkeypatch.setattr(cli, "warm_up", lambda *args: None)
    monkeypatch.setattr(app_module, "uvicorn_server", lambda *args, **kwargs: Interrupted())
    assert cli.main(["--method", "autoregressive", "--port", str(port)]) == 130


def test_cli_refuses_connections_until_the_model_is_loaded(capsys, monkeypatch):
    """The port is taken before the model loads but listened on only once it is ready: a TCP readiness
    probe passed (and requests waited) during the whole load."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    seen = {}

    def loading(args):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            seen["connected"] = True
        except ConnectionRefusedError:
            seen["connected"] = False
        raise ValueError("stopped while loading")

    monkeypatch.setattr(cli, "load_model", loading)
    assert cli.main(["--method", "lookup", "--port", str(port)]) == 1
    assert seen == {"connected": False}
    assert "stopped while loading" in capsys.readouterr().err


def test_cli_on_an_ipv6_address_serves_ipv6_alone(capsys, monkeypatch):
    """As socket.create_server: ``--host ::`` takes the IPv6 port alone (it took the IPv4 one too, exposing
    the server on addresses nobody named, and failing where IPv4 held the port)."""
    import socket

    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    seen = {}

    def loading(args):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as ipv4:
            ipv4.bind(("0.0.0.0", port))  # free: the server's socket holds the IPv6 port only
            seen["ipv4_free"] = True
        raise ValueError("stopped while loading")

    monkeypatch.setattr(cli, "load_model", loading)
    try:
        assert cli.main(["--method", "lookup", "--host", "::", "--port", str(port)]) == 1
    except OSError as error:  # no IPv6 stack
        pytest.skip(f"IPv6 unavailable: {error}")
    assert seen == {"ipv4_free": True}, capsys.readouterr().err


def test_cli_strips_the_api_key_and_says_where_an_empty_one_came_from(capsys, monkeypatch):
    """A key read from a file ends in a newline no client sends: it was kept, and every request refused."""
    monkeypatch.setenv(cli.API_KEY_ENV, "s3cret\n")
    assert cli.parse_args(["--method", "lookup"]).api_key == "s3cret"
    assert cli.parse_args(["--method", "lookup", "--api-key", " other "]).api_key == "other"
    monkeypatch.setenv(cli.API_KEY_ENV, " ")
    for argv, says in ((["--method", "lookup"], f"${cli.API_KEY_ENV} is empty"),
                       (["--method", "lookup", "--api-key", ""], "--api-key is empty")):
        with pytest.raises(SystemExit):
            cli.parse_args(argv)
        assert says in capsys.readouterr().err


def test_cli_says_options_the_loaded_model_refuses_without_a_traceback(capsys, monkeypatch):
    """A tree the heads cannot take (a fitted tree without measured accuracies, say), found by the warm-up
    after loading: medusa-serve: error, as medusa-generate says it (it was a traceback)."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    model = word_medusa()
    monkeypatch.setattr(cli, "load_model", lambda args: model)
    assert cli.main(["--heads", "h", "--tree", "fitted-4", "--port", str(port)]) == 1
    assert "medusa-serve: error:" in (err := capsys.readouterr().err) and "fitted" in err


def test_cli_says_a_busy_port_before_loading(capsys, monkeypatch):
    import socket

    def no_loading(args):
        raise AssertionError("a model was loaded for a port it cannot listen on")

    monkeypatch.setattr(cli, "load_model", no_loading)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert cli.main(["--method", "lookup", "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in (err := capsys.readouterr().err) and "pick another --port" in err
    # an address that is not this machine's: the port was blamed
    assert cli.main(["--method", "lookup", "--host", "192.0.2.1", "--port", str(port)]) == 1
    assert "check --host" in (err := capsys.readouterr().err) and "--port" not in err.split(";")[-1]


def test_cli_takes_the_flags_its_method_uses():
    args = cli.parse_args(["--method", "draft", "--draft-model", "small", "--draft-tokens", "3"])
    assert (args.method, args.draft_model, args.draft_tokens) == ("draft", "small", 3)
    assert cli.parse_args(["--heads", "h", "--tree", "chain"]).tree == "chain"


@pytest.mark.slow
def test_default_model_answers_a_chat_with_prompt_lookup():
    with torch_threads(2):
        model = MedusaModel.without_heads("smollm2-135m-instruct")
        with serve(model, "lookup", name="smollm2-135m-instruct") as (server, _):
            base_url = server.base_url + "/v1"
            with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as client:
                answer = client.chat.completions.create(
                    model="smollm2-135m-instruct", temperature=0, max_tokens=24,
                    messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.model_extra["speculative"]["method"] == "lookup"


def test_warm_up_packs_every_layer_before_the_first_request():
    """medusa-serve answers one short generation before it listens: the first forward through each
    switched layer packs its weight (and builds its kernels), a cost the first request would pay."""
    from medusa_infer.cpu_kernels import CPULinear, use_cpu_kernels

    model = word_medusa()
    assert use_cpu_kernels(model.base_model, "onednn") > 0
    layers = [m for m in model.base_model.modules() if isinstance(m, CPULinear)]
    assert not any(m.__dict__.get("_kernel_cache") for m in layers)
    cli.warm_up(model, "medusa")
    assert all(m.__dict__.get("_kernel_cache") for m in layers)
    # with --method draft, the draft model's layers too
    draft = word_medusa()
    use_cpu_kernels(draft.base_model, "onednn")
    args = cli.parse_args(["--method", "draft", "--draft-model", "small"])
    args.draft_model = draft  # as load_model leaves it
    cli.warm_up(model, "draft", args)
    assert all(m.__dict__.get("_kernel_cache") for m in draft.base_model.modules() if isinstance(m, CPULinear))


def test_completions_read_on_from_the_prompt_with_a_sentencepiece_style_tokenizer():
    from tiny import metaspace_tokenizer, tiny_model

    tokenizer = metaspace_tokenizer()
    with torch_threads(1):
        model = MedusaModel.from_base(tiny_model("llama", vocab_size=len(tokenizer)), num_heads=2, tokenizer=tokenizer)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    expected = generate(model, ids, max_new_tokens=5, eos_token_id=[])
    words = tokenizer.convert_ids_to_tokens(expected.new_tokens[0])
    with serve(model, "medusa") as (server, engine), \
            openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, extra_body=NO_EOS)
        text = answer.choices[0].text
        assert text == read_on(tokenizer, expected.sequences[0], ids.shape[1]) and text.startswith(" ")
        # a stop string as the text reads (its leading space included) is found, by the engine too
        stop = " " + words[1][1:]
        answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, stop=stop,
                                           extra_body=NO_EOS)
        assert answer.choices[0].text == " " + words[0][1:] and answer.choices[0].finish_reason == "stop"
        assert answer.usage.completion_tokens == 2  # the engine stopped at the stop string's token


def test_a_stop_string_that_is_a_special_tokens_text_stops_at_that_token():
    """Stop strings are matched in text with special tokens left out: "<s>" never appeared there, and the model's
    next turn ran on to the token limit (finish "length"), in generate() and the server alike."""
    import torch

    from tiny import scripted_model

    tokenizer = word_tokenizer()
    script = [tokenizer.convert_tokens_to_ids(token) for token in ("the", "cat", "<s>", "sat", "on", "mat")]
    model = scripted_model(tokenizer, script)
    prompt = torch.tensor([script[:1]])
    out = generate(model, prompt, max_new_tokens=5, stop_strings=["<s>"], eos_token_id=[])
    assert out.new_tokens == [script[1:3]] and out.finish_reasons == ["stop"]
    # only a special token of that very text: no lookup of other stop strings (an unknown text gave the unk id, or
    # None where there is none: every call failed), nor of what StopConfig refuses by name
    from medusa_infer.decoding import special_stop_ids

    assert special_stop_ids(tokenizer, ["<s>", "cat", "zzz", "<s>"]) == (1,) and special_stop_ids(tokenizer, ()) == ()
    assert special_stop_ids(tokenizer, [["<s>"]]) == special_stop_ids(tokenizer, b"<s>") == ()
    with pytest.raises(ValueError, match=r"stop_strings must be a string or a list of strings, got \[\['<s>'\]\]"):
        generate(model, prompt, max_new_tokens=2, stop_strings=[["<s>"]])
    with serve(model, "autoregressive") as (server, _):
        body = {"model": "tiny", "prompt": script[:1], "max_tokens": 5, "temperature": 0, "stop": ["<s>", "zzz"]}
        answer = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30).json()
    assert (answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]) == (" cat", "stop")
    assert answer["usage"]["completion_tokens"] == 2


def test_a_streamed_line_separator_is_escaped_so_line_readers_get_whole_events():
    """U+2028, U+2029 and U+0085 in an answer went raw into the stream's JSON: httpx's and requests' iter_lines
    (scripts/bench_serving.py reads so) split the event there, and json.loads failed on both halves."""
    from tiny import scripted_model

    words = ("line\u2028sep", "para\u2029sep", "next\x85line")
    tokenizer = word_tokenizer(WORDS + words)
    script = [tokenizer.convert_tokens_to_ids(token) for token in ("the", *words, "cat")]
    with serve(scripted_model(tokenizer, script), "autoregressive") as (server, _):
        body = {"model": "tiny", "prompt": script[:1], "max_tokens": 4, "temperature": 0}
        whole = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
        with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True},
                          timeout=30) as response:
            lines = [line for line in response.iter_lines() if line]
    assert whole == " " + " ".join(words) + " cat"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]  # (each parses: none was cut)
    assert lines[-1] == "data: [DONE]" and "".join(e["choices"][0]["text"] for e in events if e["choices"]) == whole


def test_text_cut_inside_a_character_reads_alike_after_special_tokens_and_in_any_steps():
    """From a fuzz of stop strings and streamed text (byte-level SmolLM2 tokenizer): an answer ending inside a
    character, then 3 or more special tokens (which decode to nothing), got two U+FFFD, and one that completed the
    character its prompt's ids were cut inside of got a U+FFFD added; after such a prompt the text's end depended on
    whether its tokens came in one step or in several; and a stop string holding U+FFFD was missed after many
    special tokens (the engine's window counted them as text)."""
    import torch

    from medusa_infer.decoding import generate
    from medusa_infer.models import load_tokenizer
    from tiny import scripted_model

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")

    def text(prompt, updates):
        assembler = TextAssembler(tokenizer, (), prompt)
        return "".join(assembler.add(u, final=i == len(updates) - 1) for i, u in enumerate(updates))

    for specials in range(5):  # ' ,' then 2 of an emoji's 4 bytes (cut by max_tokens), then special tokens
        assert text([1792], [[28], [10813]] + [[end]] * specials) == ",\ufffd"
        assert text([1792, 27709, 230], [[121]] + [[end]] * specials) == "\u732b"  # the prompt's cut ' 猫'
    cut = [216, 33085, 246, 181, 130]  # '...한' then the first byte of '국'
    assert text(cut, [[251], [183]]) == text(cut, [[251, 183]]) == text(cut, [[251], [183], [end]])
    model = scripted_model(tokenizer, [1792, 10813, end])  # ' x', half an emoji, then special tokens for good
    for steps in (5, 12, 20):
        out = generate(model, input_ids=torch.tensor([[1792]]), attention_mask=torch.ones(1, 1, dtype=torch.long),
                       max_new_tokens=steps, stop_strings=["\ufffd"], eos_token_id=[])
        assert out.finish_reasons == ["stop"], steps
    with pytest.raises(ValueError, match="stop_strings must be a string or a list of strings, got 5"):
        generate(model, input_ids=torch.tensor([[1792]]), max_new_tokens=2, stop_strings=5)
    # the window is kept where a character begins for the first text only: a model's stray byte at every step
    # kept it at the answer's start for good, each step decoding all of it again
    stray = TextAssembler(tokenizer, (), [1792])
    for _ in range(50):
        stray.add([119, 28])  # a lone continuation byte, then ','
    assert stray.read_offset - stray.prefix_offset <= 4
    # special tokens add no text: the stop strings are not looked for again at each (a walk back over the whole
    # run of them, and a decode of it, at every token)
    import medusa_infer.decoding as decoding

    calls = []
    real = decoding.generated_text_tail
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decoding, "generated_text_tail", lambda *a, **k: calls.append(1) or real(*a, **k))
        out = generate(model, input_ids=torch.tensor([[1792]]), max_new_tokens=60, stop_strings=["zzz"],
                       eos_token_id=[])
    assert out.finish_reasons == ["length"] and len(calls) <= 4
