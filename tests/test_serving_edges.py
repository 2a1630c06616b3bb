"""The server's limits and defaults at their edges (a body of exactly the size limit, the longest stop string, a
max_tokens that fills the context, top_k -1, port bounds), batching keys, metrics and messages: each pinned where a
mutation of the serving code went unnoticed."""
from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest

from medusa_infer.decoding import SamplingConfig, StopConfig
from medusa_infer.serving import protocol
from medusa_infer.serving.metrics import ServingMetrics
from medusa_infer.serving.scheduler import Engine, Request
from medusa_infer.serving.testing import serve, torch_threads, wait_until
from tiny import word_medusa

GREEDY = SamplingConfig("greedy", 0.0, 0, 1.0)
OK = {"model": "tiny", "prompt": "the cat", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def model():
    with torch_threads(1):
        yield word_medusa()


@pytest.fixture(scope="module")
def client(model):
    with serve(model, "autoregressive") as (server, engine):
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            yield client


@contextlib.contextmanager
def running_engine(model, method: str = "autoregressive"):
    """An engine (no HTTP) decoding on its own thread while the block runs."""
    engine = Engine(model, model.tokenizer, method, metrics=ServingMetrics("t"))
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def test_an_engines_misspelled_proposer_setting_is_refused(model):
    """Settings given as a mapping (build_app's and serve()'s options=) that no method reads were dropped without
    a word: {"draft_token": 2} drafted 4 tokens a step."""
    with pytest.raises(ValueError, match=r"unknown proposer settings \['draft_token'\]"):
        Engine(model, model.tokenizer, "lookup", {"draft_token": 2})
    assert Engine(model, model.tokenizer, "lookup", {"draft_tokens": 2}).options.draft_tokens == 2


def test_a_body_of_exactly_the_size_limit_is_read(client):
    body = json.dumps(OK).encode()
    padded = body[:-1] + b" " * (protocol.MAX_BODY_BYTES - len(body)) + b"}"
    assert len(padded) == protocol.MAX_BODY_BYTES
    answer = client.post("/v1/completions", content=padded, headers={"Content-Type": "application/json"})
    assert answer.status_code == 200, answer.text


def test_a_stop_string_of_the_longest_length_allowed_is_taken(client):
    answer = client.post("/v1/completions", json={**OK, "stop": ["x" * protocol.MAX_STOP_LENGTH]})
    assert answer.status_code == 200, answer.text
    answer = client.post("/v1/completions", json={**OK, "stop": ["x" * (protocol.MAX_STOP_LENGTH + 1)]})
    assert answer.status_code == 400


def test_text_parts_of_a_message_are_joined_by_newlines(client):
    def prompt_tokens(content):
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 1}
        answer = client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens"]

    parts = [{"type": "text", "text": "the cat"}, {"type": "text", "text": "sat"}]
    assert prompt_tokens(parts) == prompt_tokens("the cat\nsat") != prompt_tokens("the catsat")


def test_a_row_ended_by_the_context_counts_as_a_length_finish_in_the_metrics(model):
    finished = threading.Event()
    updates = []
    with running_engine(model) as engine:
        prompt = [5] * (engine.context_length - 3)
        request = Request(prompt, GREEDY, StopConfig(100, (), ()),
                          lambda u: (updates.append(u), finished.set()) if u.finish else None)
        engine.submit(request)
        assert finished.wait(30)
        assert updates[-1].finish == "context"
        assert engine.metrics.request_success.value(finished_reason="length") == 1
        assert engine.metrics.request_success.value(finished_reason="stop") == 0


def test_a_timeout_error_names_the_timeout_set(model):
    finished = threading.Event()
    updates = []
    with running_engine(model) as engine:
        request = Request([5, 6], GREEDY, StopConfig(100, (), ()),
                          lambda u: (updates.append(u), finished.set()) if u.finish else None, timeout=0.05)
        with engine.hold():
            engine.submit(request)
            time.sleep(0.3)
        assert finished.wait(10)
        assert updates[-1].finish == "timeout"
        assert updates[-1].error == "the request did not finish within its 0.05 s timeout"


def test_requests_share_a_batch_whatever_their_rule_and_temperature_and_seeded_sampled_ones_decode_alone():
    stop = StopConfig(3, (), ())

    def key(sampling, seed=None):
        return Request([5], sampling, stop, lambda u: None, seed=seed).batch_key

    greedy = {key(sampling, seed) for seed in (None, 1, 2)
              for sampling in (GREEDY, SamplingConfig("lossless", 0.0), SamplingConfig("typical", 0.0))}
    lossless = {key(SamplingConfig("lossless", t, k, p)) for t, k, p in ((1.0, 0, 1.0), (0.7, 40, 0.9), (1.3, 5, 1.0))}
    typical = {key(SamplingConfig("typical", t)) for t in (0.7, 1.0)}
    assert len(greedy | lossless | typical) == 1
    sampled = SamplingConfig("lossless", 1.0, 0, 1.0)
    assert key(sampled, seed=1) != key(sampled, seed=1) and key(sampled, seed=1) not in lossless


def test_max_tokens_filling_the_context_exactly_is_taken(client, model):
    context = model.base_model.config.max_position_embeddings
    body = {"model": "tiny", "prompt": [5] * 10, "max_tokens": context - 10, "temperature": 0, "ignore_eos": True}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["total_tokens"] <= context
    answer = client.post("/v1/completions", json={**body, "max_tokens": context - 9})
    assert answer.status_code == 400 and f"at most {context - 10}" in answer.json()["error"]["message"]


def test_the_port_range_is_checked_at_both_ends(capsys):
    from medusa_infer.serving import cli

    assert cli.parse_args(["--method", "lookup", "--port", "65535"]).port == 65535
    for port in ("0", "65536"):
        with pytest.raises(SystemExit):
            cli.parse_args(["--method", "lookup", "--port", port])
        assert "--port must be in 1..65535" in capsys.readouterr().err


def test_a_two_character_stop_string_is_held_back_until_it_cannot_be_one(model):
    from medusa_infer.serving.app import TextAssembler

    tokenizer = model.tokenizer
    assembler = TextAssembler(tokenizer, ("t ",), tokenizer("the")["input_ids"])
    ids = [tokenizer.convert_tokens_to_ids(word) for word in ("cat", "sat", "dog")]
    deltas = [assembler.add([i]) for i in ids[:-1]] + [assembler.add(ids[-1:], final=True)]
    assert deltas[0] == " ca"  # the "t" may begin "t ": held back
    assert "".join(deltas) == " ca"


def test_a_request_s_acceptance_overrides_the_server_default(client):
    # typical acceptance samples without top_k: refused when the request asks for it
    answer = client.post("/v1/completions", json={**OK, "temperature": 1.0, "top_k": 5, "acceptance": "typical"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "top_k"


def test_top_k_minus_one_means_no_top_k(client):
    answer = client.post("/v1/completions", json={**OK, "temperature": 1.0, "top_k": -1, "seed": 1})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == client.post(
        "/v1/completions", json={**OK, "temperature": 1.0, "seed": 1}).json()["choices"][0]["text"]


def test_a_bearer_token_is_read_with_its_surrounding_spaces_dropped(model):
    with serve(model, "autoregressive", api_key="key") as (server, engine):
        for header in ("Bearer key", "bearer key", "Bearer  key"):
            answer = httpx.post(server.base_url + "/v1/completions", json=OK, headers={"Authorization": header},
                                timeout=60)
            assert answer.status_code == 200, (header, answer.text)


def test_tau_of_a_request_with_no_decoding_step_is_one(model):
    with serve(model, "medusa", speculation_gate=False) as (server, engine):
        answer = httpx.post(server.base_url + "/v1/completions", json={**OK, "max_tokens": 1}, timeout=60).json()
    assert answer["usage"]["speculative"]["draft_steps"] == 0
    assert answer["usage"]["speculative"]["tau"] == 1.0


def test_a_seeded_sampled_batch_is_built_without_the_learned_step_costs(model, monkeypatch):
    """options_for(key) is what a batch's proposer is built with: a seeded sampled request's leaves out the
    engine's step_costs (its trees must not depend on the clock), a greedy one's keeps them."""
    from medusa_infer.serving import scheduler

    built = []
    real = scheduler.build_proposer
    with running_engine(model, "medusa") as engine:  # (the proposers its set-up builds not counted)
        monkeypatch.setattr(scheduler, "build_proposer",
                            lambda method, m, options: (built.append(options), real(method, m, options))[1])
        for sampling, seed in ((SamplingConfig("lossless", 0.8, 0, 1.0), 7), (GREEDY, None)):
            finished = threading.Event()
            request = Request([5, 6], sampling, StopConfig(3, (), ()),
                              lambda u, f=finished: f.set() if u.finish else None, seed=seed)
            engine.submit(request)
            assert finished.wait(30)
            assert built[-1] is engine.options_for(request.batch_key)
        assert built[0] is not built[1]
        assert built[0].step_costs is None and built[1].step_costs is engine.step_costs


def test_a_request_being_prefilled_counts_as_running(model, monkeypatch):
    """Between leaving the queue and its batch's first tokens (a prefill may take seconds) a request is in
    the running count, not in neither count."""
    from medusa_infer import decoding

    entered, release = threading.Event(), threading.Event()
    prefill = decoding.DecodeBatch.prefill

    def slow_prefill(self, *args, **kwargs):
        entered.set()
        release.wait(30)
        return prefill(self, *args, **kwargs)

    monkeypatch.setattr(decoding.DecodeBatch, "prefill", slow_prefill)
    finished = threading.Event()
    with running_engine(model) as engine:
        try:
            engine.submit(Request([5, 6], GREEDY, StopConfig(2, (), ()),
                                  lambda u: finished.set() if u.finish else None))
            assert entered.wait(30)
            counts = engine.snapshot()
            assert counts["running"] == 1 and counts["waiting"] == 0
            assert engine.metrics.running.value() == 1
        finally:
            release.set()
            assert finished.wait(30)


def test_a_whole_answer_ends_the_engines_row_at_a_stop_string_it_missed(model, monkeypatch):
    """A non-streamed answer cancels the engine's row as soon as its text holds a stop string the engine
    missed (it looks at its last token only here): the engine does not decode on to max_tokens."""
    from medusa_infer import decoding

    monkeypatch.setattr(StopConfig, "window", property(lambda self: 1))
    step = decoding.DecodeBatch.step
    monkeypatch.setattr(decoding.DecodeBatch, "step", lambda self, *a, **k: (time.sleep(0.02), step(self, *a, **k))[1])
    body = {"model": "tiny", "prompt": "the cat sat on the mat", "max_tokens": 60, "temperature": 0,
            "ignore_eos": True}
    with serve(model, "autoregressive") as (server, engine):
        url = server.base_url + "/v1/completions"
        free = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
        stop = " ".join(free.split(" ")[3:6])
        assert len(stop.split(" ")) == 3
        before = engine.metrics.generation_tokens.value()
        answer = httpx.post(url, json={**body, "stop": [stop]}, timeout=60).json()
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert answer["choices"][0]["text"] == free[: free.index(stop)]
        time.sleep(1.5)  # were the row left running, it would reach its 60 tokens by now
        assert engine.metrics.generation_tokens.value() - before < 40


def test_a_request_timeout_is_answered_with_the_engines_own_timeout_error(model):
    """The HTTP side waits TIMEOUT_GRACE_S past a request's timeout for the engine's answer: a request held in
    the queue past its timeout gets the engine's error naming its timeout, not 'did not answer in time'."""
    with serve(model, "autoregressive", request_timeout=0.2) as (server, engine):
        answers = []
        with engine.hold():
            thread = threading.Thread(target=lambda: answers.append(
                httpx.post(server.base_url + "/v1/completions", json=OK, timeout=60)))
            thread.start()
            # queued before its timeout's clock is read (a busy machine may take seconds to get it there: it
            # arrived after the hold and was answered 200)
            wait_until(lambda: engine.snapshot()["waiting"] == 1, message="the request was never queued")
            time.sleep(1.0)
        thread.join(30)
    assert answers[0].status_code == 504
    message = answers[0].json()["error"]["message"]
    assert "within its 0.2 s timeout" in message and "did not answer in time" not in message


def test_the_most_stop_strings_allowed_are_taken(client):
    answer = client.post("/v1/completions", json={**OK, "stop": ["xa", "xb", "xc", "xd"][:protocol.MAX_STOP_STRINGS]})
    assert answer.status_code == 200, answer.text
    too_many = [f"x{i}" for i in range(protocol.MAX_STOP_STRINGS + 1)]
    answer = client.post("/v1/completions", json={**OK, "stop": too_many})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "stop"


def test_a_prompt_filling_the_whole_context_is_refused_with_a_400(client, model):
    context = model.base_model.config.max_position_embeddings
    for body in ({"model": "tiny", "prompt": [5] * context},
                 {"model": "tiny", "prompt": [5] * context, "max_tokens": 1}):
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 400, answer.text
        assert f"shorten the prompt to at most {context - 1} tokens" in answer.json()["error"]["message"]


def test_a_histogram_ignores_values_that_are_not_finite():
    from medusa_infer.serving.metrics import Histogram

    histogram = Histogram("h", "help", buckets=(1.0,))
    for value in (float("nan"), float("inf"), 0.5):
        histogram.observe(value)
    samples = {(name, labels): value for name, labels, value in histogram.samples()}
    assert histogram.count == 1 and samples[("h_sum", ())] == 0.5
    assert samples[("h_bucket", (("le", "+Inf"),))] == 1.0


@pytest.mark.parametrize("argv, message", [
    (["--max-queue", "0"], "--max-batch and --max-queue must be >= 1"),
    (["--max-batch", "0"], "--max-batch and --max-queue must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
])
def test_serving_counts_below_one_are_refused(argv, message, capsys):
    from medusa_infer.serving import cli

    with pytest.raises(SystemExit):
        cli.parse_args(["--method", "lookup", *argv])
    assert message in capsys.readouterr().err


def test_sampled_requests_of_other_temperatures_share_one_batch_with_a_greedy_one_that_stays_greedy(model,
                                                                                                      monkeypatch):
    """Three requests admitted together: the two sampled ones (other temperature, top_k and top_p) and the greedy
    one are prefilled as one batch, each row with its own setting; the greedy one answers as it does alone."""
    from medusa_infer.serving import scheduler

    built = []

    class Spy(scheduler.DecodeBatch):
        def __init__(self, model, ids, mask, proposer, sampling, *args):
            built.append(list(sampling) if isinstance(sampling, list) else [sampling] * len(ids))
            super().__init__(model, ids, mask, proposer, sampling, *args)

    monkeypatch.setattr(scheduler, "DecodeBatch", Spy)
    warm, cool = SamplingConfig("lossless", 1.2, 0, 1.0), SamplingConfig("lossless", 0.7, 3, 0.9)
    prompt = model.tokenizer("the cat sat on")["input_ids"]

    def run(engine, samplings):
        done = {i: threading.Event() for i in range(len(samplings))}
        tokens: dict[int, list[int]] = {i: [] for i in done}

        def collect(i):
            return lambda u: (tokens[i].extend(u.token_ids), u.finish and done[i].set())

        with engine.hold():
            for i, sampling in enumerate(samplings):
                engine.submit(Request(prompt, sampling, StopConfig(6, (), ()), collect(i)))
        assert all(event.wait(30) for event in done.values())
        return tokens

    with running_engine(model, "medusa") as engine:
        alone = run(engine, [GREEDY])[0]
        built.clear()
        tokens = run(engine, [warm, GREEDY, cool])
    assert built == [[warm, GREEDY, cool]]
    assert tokens[1] == alone and len(alone) == 6
    assert len(tokens[0]) == len(tokens[2]) == 6


@pytest.mark.parametrize("method", ["autoregressive", "lookup"])
def test_greedy_and_sampled_requests_decode_in_one_batch(model, method, monkeypatch):
    """A greedy, a lossless and a typical request share one batch, one forward a step for the three (they took
    one batch per acceptance rule, three forwards a step), and the greedy one reads as it does alone; a seeded
    sampled request still decodes alone."""
    from medusa_infer.serving import scheduler

    settings = [(GREEDY, None), (SamplingConfig("lossless", 0.8, 0, 1.0), None), (SamplingConfig("typical", 0.7), None),
                (SamplingConfig("lossless", 0.9, 0, 1.0), 3)]

    def run(engine, chosen):
        updates = {i: [] for i in range(len(chosen))}
        done = [threading.Event() for _ in chosen]
        with engine.hold():
            for i, (sampling, seed) in enumerate(chosen):
                engine.submit(Request([5, 6, 7], sampling, StopConfig(6, (), ()),
                                      lambda u, i=i: (updates[i].append(u), u.finish and done[i].set()), seed=seed))
        assert all(event.wait(60) for event in done)
        return [[t for u in updates[i] for t in u.token_ids] for i in range(len(chosen))]

    with running_engine(model, method) as engine:
        alone = run(engine, settings[:1])[0]
        steps, rows = engine.metrics.batch_steps.value(), engine.metrics.batch_row_steps.value()
        real, sizes = scheduler.gated_step, []
        monkeypatch.setattr(scheduler, "gated_step", lambda batch, gate: (sizes.append(len(batch.rows)),
                                                                           real(batch, gate))[1])
        tokens = run(engine, settings)
        steps, rows = engine.metrics.batch_steps.value() - steps, engine.metrics.batch_row_steps.value() - rows
    assert tokens[0] == alone and all(len(t) == 6 for t in tokens)
    assert sizes.count(3) >= 1 and max(sizes) == 3  # the three unseeded rows in one forward, the seeded one alone
    if method == "autoregressive":  # 5 steps after the prefill each: the three together, the seeded one alone
        assert steps == 2 * 5 and rows == 4 * 5
