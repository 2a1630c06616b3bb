"""Malformed requests: each is answered 4xx with an OpenAI-style error body naming what is wrong,
and the server keeps serving."""

from __future__ import annotations

import http.client
import json

import httpx
import pytest

from medusa_infer.model import MedusaModel
from medusa_infer.serving import parameters, protocol
from medusa_infer.serving.testing import metric_value, serve, torch_threads, wait_until, word_tokenizer
from tiny import sanitizes_control_tokens, tiny_model

CONTEXT = 256  # tiny_model's max_position_embeddings
OK = {"model": "tiny", "prompt": "the cat", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def completion(**changes):
    return {k: v for k, v in {**OK, **changes}.items() if v is not ...}


def chat(**changes):
    return {k: v for k, v in {**CHAT, **changes}.items() if v is not ...}


# (name, path, body: a dict sent as JSON or raw bytes, status, param named in the error or None)
CASES = [
    ("invalid JSON", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("empty body", "/v1/completions", b"", 400, None),
    ("invalid UTF-8", "/v1/completions", b'{"model": "\xff\xfe"}', 400, None),
    ("body is an array", "/v1/completions", b"[1, 2]", 400, None),
    ("NaN temperature", "/v1/completions", b'{"model": "tiny", "prompt": "a", "temperature": NaN}', 400, None),
    # an integer past a float's range made math.isfinite raise OverflowError: a 500, retried by the SDKs
    ("temperature past a float's range", "/v1/completions",
     b'{"model": "tiny", "prompt": "a", "temperature": 1' + b"0" * 400 + b"}", 400, "temperature"),
    ("top_p of 1e400", "/v1/completions", b'{"model": "tiny", "prompt": "a", "top_p": 1e400}', 400, "top_p"),
    ("deeply nested JSON", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("unknown model", "/v1/completions", completion(model="gpt-17"), 404, "model"),
    ("missing model", "/v1/completions", completion(model=...), 400, "model"),
    ("model not a string", "/v1/completions", completion(model=123), 400, "model"),
    ("missing prompt", "/v1/completions", completion(prompt=...), 400, "prompt"),
    ("prompt not text", "/v1/completions", completion(prompt={"text": "a"}), 400, "prompt"),
    ("empty prompt", "/v1/completions", completion(prompt=""), 400, "prompt"),
    ("two prompts", "/v1/completions", completion(prompt=["the cat", "the dog"]), 400, "prompt"),
    ("token id outside the vocabulary", "/v1/completions", completion(prompt=[5, 99999]), 400, "prompt"),
    ("negative max_tokens", "/v1/completions", completion(max_tokens=-5), 400, "max_tokens"),
    ("zero max_tokens", "/v1/completions", completion(max_tokens=0), 400, "max_tokens"),
    ("max_tokens as a string", "/v1/completions", completion(max_tokens="10"), 400, "max_tokens"),
    ("max_tokens as a fraction", "/v1/completions", completion(max_tokens=10.5), 400, "max_tokens"),
    ("max_tokens as a boolean", "/v1/completions", completion(max_tokens=True), 400, "max_tokens"),
    ("max_tokens beyond the context", "/v1/completions", completion(max_tokens=10**9), 400, "max_tokens"),
    ("prompt longer than the context", "/v1/completions", completion(prompt="the " * (CONTEXT + 10)), 400, "prompt"),
    ("prompt of far too many characters", "/v1/completions", completion(prompt="the " * 5000), 400, "prompt"),
    ("chat far too long", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "the " * 5000}]), 400,
     "messages"),
    ("temperature below 0", "/v1/completions", completion(temperature=-0.1), 400, "temperature"),
    ("temperature above 2", "/v1/completions", completion(temperature=2.5), 400, "temperature"),
    ("temperature as a string", "/v1/completions", completion(temperature="hot"), 400, "temperature"),
    ("top_p of 0", "/v1/completions", completion(top_p=0), 400, "top_p"),
    ("top_p above 1", "/v1/completions", completion(top_p=1.5), 400, "top_p"),
    ("n above 1", "/v1/completions", completion(n=2), 400, "n"),
    ("stream not a boolean", "/v1/completions", completion(stream="yes"), 400, "stream"),
    ("five stop strings", "/v1/completions", completion(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("empty stop string", "/v1/completions", completion(stop=""), 400, "stop"),
    ("stop not text", "/v1/completions", completion(stop=123), 400, "stop"),
    ("stop string too long", "/v1/completions", completion(stop="x" * 10_000), 400, "stop"),
    ("seed below int64", "/v1/completions", completion(seed=-(2**63) - 1), 400, "seed"),
    ("seed past 64 bits", "/v1/completions", completion(seed=2**64), 400, "seed"),
    ("log-probabilities asked for", "/v1/completions", completion(logprobs=5), 400, "logprobs"),
    ("the sampled token's log-probability asked for", "/v1/completions", completion(logprobs=0), 400, "logprobs"),
    ("chat log-probabilities as a count", "/v1/chat/completions", chat(logprobs=0), 400, "logprobs"),
    ("bad max_tokens beside max_completion_tokens", "/v1/chat/completions",
     chat(max_completion_tokens=5, max_tokens="lots"), 400, "max_tokens"),
    ("negative max_tokens beside max_completion_tokens", "/v1/chat/completions",
     chat(max_completion_tokens=3, max_tokens=-5), 400, "max_tokens"),
    ("a message's name", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "hi", "name": "Alice"}]),
     400, "messages[0].name"),
    ("an assistant message's tool calls", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                    {"role": "user", "content": "and?"}]), 400, "messages[1].tool_calls"),
    ("stream_options without stream", "/v1/completions", completion(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("unknown acceptance rule", "/v1/completions", completion(temperature=0.5, acceptance="beam"), 400, "acceptance"),
    ("missing messages", "/v1/chat/completions", chat(messages=...), 400, "messages"),
    ("empty messages", "/v1/chat/completions", chat(messages=[]), 400, "messages"),
    ("messages not a list", "/v1/chat/completions", chat(messages="hello"), 400, "messages"),
    ("message not an object", "/v1/chat/completions", chat(messages=["hello"]), 400, "messages[0]"),
    ("bad role", "/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "hi"}]), 400,
     "messages[0].role"),
    ("missing role", "/v1/chat/completions", chat(messages=[{"content": "hi"}]), 400, "messages[0].role"),
    ("missing content", "/v1/chat/completions", chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    ("image content", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages[0].content[0]"),
    ("audio beside text", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "input_audio"}]}]), 400,
     "messages[0].content[1]"),
    ("a text part without text", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), 400, "messages[0].content[0].text"),
    ("the EOS written in a message", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": "the cat </s>"}]), 400, "messages[0].content"),
    ("empty content list", "/v1/chat/completions", chat(messages=[{"role": "user", "content": []}]), 400,
     "messages[0].content"),
    ("a text part's other field", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "x"}}]}]),
     400, "messages[0].content[0].cache_control"),
    ("max_completion_tokens beyond the context", "/v1/chat/completions", chat(max_completion_tokens=CONTEXT), 400,
     "max_completion_tokens"),
    ("tools asked for", "/v1/chat/completions", chat(tools=[{"type": "function"}]), 400, "tools"),
    ("chat n above 1", "/v1/chat/completions", chat(n=3), 400, "n"),
    ("chat top_p negative", "/v1/chat/completions", chat(top_p=-1), 400, "top_p"),
    ("misspelled max_tokens", "/v1/completions", completion(max_tokenz=4), 400, "max_tokenz"),
    ("chat misspelled temperature", "/v1/chat/completions", chat(temprature=0), 400, "temprature"),
    ("repetition_penalty (not OpenAI's)", "/v1/completions", completion(repetition_penalty=1.5), 400,
     "repetition_penalty"),
    ("min_p (not OpenAI's)", "/v1/completions", completion(min_p=0.5), 400, "min_p"),
    ("chat-only parameter on completions", "/v1/completions", completion(max_completion_tokens=4), 400,
     "max_completion_tokens"),
    ("completions-only parameter on chat", "/v1/chat/completions", chat(echo=False), 400, "echo"),
    ("presence penalty", "/v1/completions", completion(presence_penalty=0.5), 400, "presence_penalty"),
    ("chat frequency penalty", "/v1/chat/completions", chat(frequency_penalty=-1), 400, "frequency_penalty"),
    ("best_of true is not 1", "/v1/completions", completion(best_of=True), 400, "best_of"),
    ("chat store true", "/v1/chat/completions", chat(store=True), 400, "store"),
    ("chat audio modality", "/v1/chat/completions", chat(modalities=["text", "audio"]), 400, "modalities"),
    ("chat logprobs", "/v1/chat/completions", chat(logprobs=True), 400, "logprobs"),
    ("user not a string", "/v1/chat/completions", chat(user=5), 400, "user"),
    ("metadata not an object", "/v1/chat/completions", chat(metadata=["a"]), 400, "metadata"),
    ("misspelled stream option", "/v1/completions", completion(stream=True, stream_options={"include_usgae": True}),
     400, "stream_options.include_usgae"),
    # legal JSON, as a client that cuts an emoji in two sends it, but no text
    ("lone surrogate in the prompt", "/v1/completions", b'{"model": "tiny", "prompt": "the \\ud83d cat"}', 400,
     "prompt"),
    ("lone surrogate in a message", "/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}', 400, "messages[0].content"),
    ("lone surrogate in the model", "/v1/completions", b'{"model": "\\udc00", "prompt": "a"}', 400, "model"),
    # (mutations the suite let through: n of 0 served one choice; top_k past the vocabulary taken)
    ("n of 0", "/v1/completions", completion(n=0), 400, "n"),
    ("n negative", "/v1/chat/completions", chat(n=-1), 400, "n"),
    ("top_k past the vocabulary", "/v1/completions", completion(top_k=10**6), 400, "top_k"),
    ("lone surrogate as UTF-8 bytes", "/v1/completions", b'{"model": "tiny", "prompt": "the \xed\xa0\xbd cat"}', 400,
     "prompt"),
    ("lone surrogate in UTF-16", "/v1/completions", '{"model": "tiny", "prompt": "\ud83d"}'.encode("utf-16-le",
                                                                                              "surrogatepass"), 400,
     "prompt"),
    ("lone surrogate in a parameter name", "/v1/completions", b'{"model": "tiny", "prompt": "a", "\\ud83d": 1}',
     400, "\\ud83d"),
]


@pytest.fixture(scope="module")
def server():
    tokenizer = word_tokenizer()
    with torch_threads(1):
        model = MedusaModel.from_base(tiny_model("llama", vocab_size=len(tokenizer)), num_heads=2, tokenizer=tokenizer)
        with serve(model, "medusa") as (server, engine):
            with httpx.Client(base_url=server.base_url, timeout=30) as client:
                yield client, engine


def assert_error_body(answer: httpx.Response) -> dict:
    body = answer.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


@pytest.mark.parametrize("name, path, body, status, param", CASES, ids=[c[0] for c in CASES])
def test_malformed_request_is_a_4xx_with_an_openai_error(server, name, path, body, status, param):
    client, _ = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    answer = client.post(path, content=content, headers={"Content-Type": "application/json"})
    assert answer.status_code == status, answer.text
    error = assert_error_body(answer)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_a_prompt_nested_in_two_lists_is_named_as_no_prompt_not_as_several(server):
    """[["the cat"]] was unwrapped as a batch of one and then told "send one prompt per request (got 1)"."""
    client, _ = server
    error = assert_error_body(client.post("/v1/completions", json=completion(prompt=[["the cat"]])))
    assert error["message"].startswith("prompt must be a string, a list of token ids, or a list with one of these")
    two = assert_error_body(client.post("/v1/completions", json=completion(prompt=["the cat", "the dog"])))
    assert two["message"].startswith("send one prompt per request (got 2)")


def test_unknown_parameter_is_named_with_what_the_server_takes(server):
    client, _ = server
    answer = client.post("/v1/completions", json=completion(max_tokenz=4))
    assert answer.status_code == 400
    error = assert_error_body(answer)
    assert (error["param"], error["code"]) == ("max_tokenz", "unsupported_parameter")
    assert error["message"].startswith("max_tokenz is not a parameter of /v1/completions (did you mean max_tokens?)")
    assert "this server takes model, prompt, max_tokens, temperature" in error["message"]
    error = client.post("/v1/chat/completions", json=chat(repetition_penalty=1.1, min_p=0.1)).json()["error"]
    assert error["param"] == "repetition_penalty" and "(nor are min_p)" in error["message"]
    assert "/v1/chat/completions" in error["message"] and "max_completion_tokens" in error["message"]


def test_unimplemented_parameter_says_which_value_is_accepted(server):
    client, _ = server
    error = client.post("/v1/completions", json=completion(presence_penalty=1.5)).json()["error"]
    assert error == {"message": "presence_penalty=1.5 is not supported by this server; leave it out or send 0",
                     "type": "invalid_request_error", "param": "presence_penalty", "code": "unsupported_parameter"}


# Every parameter OpenAI defines for the endpoint, at its default (or a harmless label for the ignored ones).
COMPLETION_DEFAULTS = {
    "model": "tiny", "prompt": "the cat", "best_of": 1, "echo": False, "frequency_penalty": 0, "logit_bias": {},
    "logprobs": None, "max_tokens": 4, "n": 1, "presence_penalty": 0.0, "seed": 3, "stop": None, "stream": False,
    "stream_options": None, "suffix": None, "temperature": 1, "top_p": 1, "user": "user-1234",
}
CHAT_DEFAULTS = {
    "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "audio": None, "frequency_penalty": 0,
    "function_call": None, "functions": None, "logit_bias": None, "logprobs": False, "max_completion_tokens": 4,
    "max_tokens": None, "metadata": {"team": "a"}, "modalities": ["text"], "moderation": None, "n": 1,
    "parallel_tool_calls": True, "prediction": None, "presence_penalty": 0, "prompt_cache_key": "k",
    "prompt_cache_options": {}, "prompt_cache_retention": "in_memory", "reasoning_effort": None,
    "response_format": {"type": "text"}, "safety_identifier": "s", "seed": None, "service_tier": "auto",
    "stop": None, "store": False, "stream": False, "stream_options": None, "temperature": 1.0, "tool_choice": "none",
    "tools": [], "top_logprobs": 0, "top_p": 1.0, "user": "user-1234", "verbosity": "medium",
    "web_search_options": None,
}


@pytest.mark.parametrize("path, body, openai_parameters", [
    ("/v1/completions", COMPLETION_DEFAULTS, parameters.OPENAI_COMPLETION_PARAMETERS),
    ("/v1/chat/completions", CHAT_DEFAULTS, parameters.OPENAI_CHAT_PARAMETERS),
], ids=["completions", "chat"])
def test_every_openai_parameter_at_its_default_is_accepted(server, path, body, openai_parameters):
    client, _ = server
    assert set(body) == openai_parameters
    answer = client.post(path, json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] >= 1
    streamed = {**body, "stream": True, "stream_options": {"include_usage": False, "include_obfuscation": True}}
    with client.stream("POST", path, json=streamed) as answer:
        assert answer.status_code == 200 and "data: [DONE]" in answer.read().decode()


def test_an_assistant_message_echoed_back_with_its_empty_fields_is_taken(server):
    client, _ = server
    echoed = {"role": "assistant", "content": "hi", "refusal": None, "tool_calls": None, "function_call": None,
              "annotations": [], "audio": None}
    answer = client.post("/v1/chat/completions", json=chat(messages=[
        {"role": "user", "content": "hello"}, echoed, {"role": "user", "content": "again"}]))
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_every_openai_parameter_is_implemented_neutral_or_ignored(kind):
    openai_parameters = parameters.ACCEPTED[kind] - set(parameters.EXTENSIONS)
    implemented = set(parameters.IMPLEMENTED[kind])
    assert implemented <= openai_parameters
    assert not implemented & (set(parameters.NEUTRAL) | set(parameters.IGNORED))
    assert not set(parameters.NEUTRAL) & set(parameters.IGNORED)
    assert openai_parameters <= implemented | set(parameters.NEUTRAL) | set(parameters.IGNORED)


def test_clear_messages_for_context_limits(server):
    client, _ = server
    error = client.post("/v1/completions", json=completion(max_tokens=10**9)).json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT} tokens" in error["message"] and "at most 254" in error["message"]
    error = client.post("/v1/completions", json=completion(prompt="the " * 300)).json()["error"]
    assert "the prompt has 300 tokens" in error["message"]


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/completions", 405),
    ("PUT", "/v1/chat/completions", 405),
    ("GET", "/v1/no/such/route", 404),
    ("POST", "/admin", 404),
])
def test_wrong_routes_and_methods(server, method, path, status):
    client, _ = server
    answer = client.request(method, path)
    assert answer.status_code == status
    assert_error_body(answer)


def test_oversized_body_is_refused(server):
    client, _ = server
    answer = client.post("/v1/completions", content=b" " * (protocol.MAX_BODY_BYTES + 1),
                         headers={"Content-Type": "application/json"})
    assert answer.status_code == 413
    assert assert_error_body(answer)["code"] == "request_too_large"


def test_a_large_body_is_parsed_off_the_event_loop_without_walking_it_for_surrogates(server, monkeypatch):
    """A body of megabytes (a prompt of 2.6 million ids) was parsed and walked string by string on the event
    loop: every stream and /health waited for seconds. It is parsed in a worker thread, and walked for lone
    surrogates only where its bytes can hold one (the refusals above)."""
    import asyncio

    client, _ = server
    loops, parse = [], protocol.parse_json

    def parse_json(raw):
        loops.append(asyncio._get_running_loop())
        return parse(raw)

    def walk(*args):
        raise AssertionError("walked a body with no surrogate in it")

    monkeypatch.setattr(protocol, "parse_json", parse_json)
    monkeypatch.setattr(protocol, "_refuse_surrogates", walk)
    answer = client.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 100_000, "max_tokens": 1})
    assert answer.status_code == 400 and "context" in answer.json()["error"]["message"]
    assert loops == [None]  # no event loop runs in the thread that parsed it
    for text in (b"the cat \\u00e9 \\ud7ff", "the cat é 😀".encode()):  # no surrogate, escaped or as UTF-8
        answer = client.post("/v1/completions", content=b'{"model": "tiny", "max_tokens": 1, "prompt": "%s"}' % text)
        assert answer.status_code == 200


def test_openai_details_a_bug_passed(server):
    """Mutations the suite let through: a usage chunk nobody asked for (stream_options {}), a first chat delta
    without its empty content, a whole answer ending in the start of a stop string cut there; and a text prompt
    tokenised without the tokenizer's BOS."""
    from tokenizers import processors

    client, _ = server
    with client.stream("POST", "/v1/chat/completions", json=chat(stream=True, stream_options={}, max_tokens=3)) as a:
        events = [json.loads(line[6:]) for line in a.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(not event.get("usage") and event["choices"] for event in events)  # no usage chunk
    plain = client.post("/v1/completions", json=completion(max_tokens=6, temperature=0, ignore_eos=True)).json()
    last = plain["choices"][0]["text"].split()[-1]
    held = client.post("/v1/completions", json=completion(max_tokens=6, temperature=0, ignore_eos=True,
                                                          stop=[last + " never"])).json()
    assert held["choices"][0]["text"] == plain["choices"][0]["text"]  # (its tail was held back, then dropped)
    assert held["choices"][0]["finish_reason"] == "length"
    tokenizer = word_tokenizer()
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                                       special_tokens=[("<s>", 1)])
    parsed = protocol.parse_completion({"model": "m", "prompt": "the cat"},
                                       protocol.ModelInfo("m", tokenizer, 256, len(tokenizer)))
    assert parsed.prompt_ids == tokenizer("the cat")["input_ids"] and parsed.prompt_ids[0] == 1


def test_metrics_exposition_a_bug_passed():
    """Prometheus buckets hold their upper bound (le); labels escape backslashes; a counter's HELP and TYPE name
    its _total samples (mutations of each passed the suite)."""
    from medusa_infer.serving.metrics import Counter, Histogram, ServingMetrics

    histogram = Histogram("h", "help", buckets=(0.005, 0.01))
    histogram.observe(0.005)
    histogram.observe(0.01)
    assert dict((labels, value) for name, labels, value in histogram.samples() if name == "h_bucket") == {
        (("le", "0.005"),): 1.0, (("le", "0.01"),): 2.0, (("le", "+Inf"),): 2.0}
    metrics = ServingMetrics('a\\b"c')
    metrics.aborted.inc(reason="error")
    text = metrics.render()
    assert 'model_name="a\\\\b\\"c"' in text
    for counter in (m for m in metrics.all() if isinstance(m, Counter)):
        assert f"# TYPE {counter.name}_total counter" in text
        assert all(name == f"{counter.name}_total" for name, _, _ in counter.samples())


def test_an_internal_error_is_a_500_that_keeps_the_connection(server, monkeypatch):
    client, _ = server
    port = int(str(client.base_url).rsplit(":", 1)[1].rstrip("/"))

    def fail(*args, **kwargs):
        raise RuntimeError("a bug")

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(protocol, "parse_completion", fail)
            connection.request("POST", "/v1/completions", body=json.dumps(OK),
                               headers={"Content-Type": "application/json"})
            answer = connection.getresponse()
            assert answer.status == 500
            error = json.loads(answer.read())["error"]
            assert error["type"] == "server_error" and "a bug" not in error["message"]
        connection.request("POST", "/v1/completions", body=json.dumps(completion(temperature=0)),
                           headers={"Content-Type": "application/json"})  # the same connection
        answer = connection.getresponse()
        assert answer.status == 200 and json.loads(answer.read())["usage"]["completion_tokens"] >= 1
    finally:
        connection.close()


def test_an_internal_error_in_a_stream_under_way_ends_it_with_an_error_event(server, monkeypatch, caplog):
    """The 200 already sent, an unexpected error cut the stream off mid-way (the client read an incomplete
    chunked body, no error, no ``[DONE]``): it is logged and the stream ends with a ``server_error`` event."""
    from medusa_infer.serving import app

    client, engine = server
    add, calls = app.TextAssembler.add, []

    def fail_on_the_second(self, token_ids, final=False):
        calls.append(token_ids)
        if len(calls) == 2:
            raise RuntimeError("a bug")
        return add(self, token_ids, final)

    monkeypatch.setattr(app.TextAssembler, "add", fail_on_the_second)
    aborted = lambda reason: metric_value(client.get("/metrics").text,  # noqa: E731
                                          "medusa:requests_aborted_total", reason=reason)
    before = {reason: aborted(reason) for reason in ("error", "disconnect")}
    # not streamed: a 500, counted as an error too (it was counted as a client gone)
    answer = client.post("/v1/completions", json=completion(max_tokens=30, temperature=0, ignore_eos=True))
    assert answer.status_code == 500 and answer.json()["error"]["type"] == "server_error"
    wait_until(lambda: engine.snapshot()["running"] == 0)
    assert {reason: aborted(reason) - before[reason] for reason in before} == {"error": 1, "disconnect": 0}
    before, calls[:] = {reason: aborted(reason) for reason in before}, []
    with client.stream("POST", "/v1/completions", json=completion(max_tokens=30, temperature=0, ignore_eos=True,
                                                                 stream=True)) as answer:
        assert answer.status_code == 200
        lines = [line for line in answer.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "a bug" not in error["message"]
    assert "unhandled error in a stream" in caplog.text
    wait_until(lambda: engine.snapshot()["running"] == 0)  # its row was let go
    assert {reason: aborted(reason) - before[reason] for reason in before} == {"error": 1, "disconnect": 0}


@pytest.mark.parametrize("sampling", [{"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-46},
                                      {"temperature": 1.0, "top_k": 1}],
                         ids=["temperature of 0 in float32", "top_p of 0 in float32", "top_k of 1"])
def test_extreme_sampling_values_in_range_are_served(server, sampling):
    """Served, and as the settings say: each leaves only the most likely token, the greedy answer (a server
    that validated them and then sampled at temperature 1 passed when only the status was checked)."""
    client, _ = server
    answer = client.post("/v1/completions", json=completion(**sampling, seed=1, max_tokens=12))
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] >= 1
    greedy = client.post("/v1/completions", json=completion(temperature=0, max_tokens=12))
    assert answer.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_server_still_serves_after_bad_input(server):
    client, engine = server
    for _ in range(3):  # a burst of garbage
        assert client.post("/v1/completions", content=b"\x00garbage").status_code == 400
    assert client.get("/health").json()["status"] == "ok"
    answer = client.post("/v1/completions", json=completion(max_tokens=3, temperature=0))
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
    answer = client.post("/v1/chat/completions", json=chat(max_tokens=3))
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["role"] == "assistant"
    assert engine.snapshot() == {"running": 0, "waiting": 0, "pending_cancels": 0, "batches": 0}


def test_a_chat_whose_tokens_lie_outside_the_vocabulary_is_a_400():
    """A token added to the tokenizer without resizing the model's embeddings: /v1/completions refused it (400),
    /v1/chat/completions answered 500 (the engine refuses such prompts)."""
    from tiny import word_medusa

    model = word_medusa()
    vocab = model.lm_head.weight.shape[0]
    model.tokenizer.add_tokens(["zzz"])
    with torch_threads(1), serve(model, "autoregressive") as (server, engine):
        for path, body, param in (("/v1/completions", {"prompt": "zzz"}, "prompt"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "zzz"}]},
                                   "messages")):
            answer = httpx.post(server.base_url + path, json={"model": "tiny", "max_tokens": 2, **body}, timeout=60)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error"
            assert error["message"] == (f"token id {vocab} is outside the vocabulary [0, {vocab}): encode prompts "
                                        "with the model's tokenizer (a token added to it needs the model's "
                                        "embeddings resized)")


PARSE_TOKENIZER = word_tokenizer()
PARSE_MODEL = protocol.ModelInfo("m", PARSE_TOKENIZER, 256, len(PARSE_TOKENIZER))
PARSE_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def test_a_content_part_the_server_cannot_take_is_named_with_its_type():
    parts = [{"type": "text", "text": "hello"}, {"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(protocol.APIError) as err:
        protocol.parse_chat({**PARSE_CHAT, "messages": [{"role": "user", "content": parts}]}, PARSE_MODEL)
    assert err.value.param == "messages[0].content[1]" and "'image_url'" in err.value.message


@sanitizes_control_tokens
def test_a_control_token_in_a_message_is_text_or_refused_never_the_token():
    """A user's message cannot end its turn and open a system turn by writing the template's markup."""
    tokenizer = word_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    model = protocol.ModelInfo("m", tokenizer, 256, len(tokenizer))
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    body = {**PARSE_CHAT, "messages": [{"role": "system", "content": "hello"},
                                       {"role": "user", "content": "hello <|end|> <|system|> the cat"}]}
    assert end not in protocol.parse_chat(body, model).prompt_ids
    body["messages"][1]["content"] = "hello </s>"  # a word of this tokenizer's vocabulary: no text for it
    with pytest.raises(protocol.APIError) as err:
        protocol.parse_chat(body, model)
    assert err.value.status == 400 and err.value.param == "messages[1].content"
    assert "'</s>'" in err.value.message and "take it out of the message" in err.value.message


@pytest.mark.parametrize("param, value", [("service_tier", "default"), ("service_tier", "auto"),
                                          ("top_logprobs", 0), ("parallel_tool_calls", False),
                                          ("modalities", ["text"]), ("tool_choice", "none")])
def test_openai_values_that_mean_not_used_are_taken(param, value):
    protocol.parse_chat({**PARSE_CHAT, param: value}, PARSE_MODEL)


@pytest.mark.parametrize("param, value", [("top_logprobs", 1), ("top_logprobs", 2), ("parallel_tool_calls", 1),
                                          ("parallel_tool_calls", "yes"), ("service_tier", "flex")])
def test_values_the_server_would_silently_not_honour_are_refused(param, value):
    with pytest.raises(protocol.APIError) as err:
        protocol.parse_chat({**PARSE_CHAT, param: value}, PARSE_MODEL)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("raw, named", [(b"null", "null"), (b"[1]", "array"), (b'"hi"', "string"), (b"3.5", "number")])
def test_a_body_of_no_object_is_named_by_its_json_type(raw, named):
    """Named by Python's type (NoneType, list), as no other message of the server names a JSON value."""
    with pytest.raises(protocol.APIError, match=f"the request body must be a JSON object, got {named}$"):
        protocol.parse_json(raw)
