"""The server under load: concurrent streams batched together and still exact, a full queue,
timeouts, and clients that go away. The engine is paused (``Engine.hold``, or inside the step after
a request's first token) where a test needs requests to sit still, so nothing here depends on how
fast the machine is."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time

import httpx
import openai
import pytest
import torch

from medusa_infer.serving.testing import metric_value, serve, torch_threads, wait_until, word_tokenizer
from tiny import word_medusa

WORDS = word_tokenizer().get_vocab()


@pytest.fixture(scope="module")
def model():
    with torch_threads(1):
        yield word_medusa()


def prompts(n: int) -> list[str]:
    words = sorted(w for w in WORDS if not w.startswith("<"))
    return [" ".join(words[(7 * i + j * 3) % len(words)] for j in range(2 + i % 9)) for i in range(n)]


def test_32_concurrent_streams_are_batched_and_match_single_requests(model):
    texts = prompts(32)
    with serve(model, "medusa", max_batch=16) as (server, engine):
        base = server.base_url + "/v1"

        def request(i: int) -> dict:
            # greedy, but every eighth sampled with a seed and every eighth without: three kinds of batch
            sampling = {0: dict(temperature=0.8, seed=i), 4: dict(temperature=0.8)}.get(i % 8, dict(temperature=0))
            kwargs = dict(model="tiny", max_tokens=6 + i % 11, **sampling)
            if i % 2:
                return dict(prompt=texts[i], **kwargs)
            return dict(messages=[{"role": "user", "content": texts[i]}], **kwargs)

        with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60) as client:
            alone = []
            for i in range(32):
                kwargs = request(i)
                if "prompt" in kwargs:
                    answer = client.completions.create(**kwargs)
                    alone.append((answer.choices[0].text, answer.choices[0].finish_reason))
                else:
                    answer = client.chat.completions.create(**kwargs)
                    alone.append((answer.choices[0].message.content, answer.choices[0].finish_reason))
        steps_before = metric_value(_metrics(server), "medusa:batch_steps_total")
        rows_before = metric_value(_metrics(server), "medusa:batch_row_steps_total")

        async def stream_one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
            kwargs = request(i)
            text, finish = "", None
            if "prompt" in kwargs:
                async for chunk in await client.completions.create(stream=True, **kwargs):
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
            else:
                async for chunk in await client.chat.completions.create(stream=True, **kwargs):
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
            return text, finish

        async def all_at_once() -> list[tuple[str, str]]:
            async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120) as client:
                return await asyncio.gather(*(stream_one(client, i) for i in range(32)))

        together = asyncio.run(asyncio.wait_for(all_at_once(), timeout=120))
        metrics = _metrics(server)
        assert engine.snapshot()["running"] == 0
    unseeded = [i for i in range(32) if i % 8 == 4]  # sampled without a seed: no single-request twin
    assert [t for i, t in enumerate(together) if i not in unseeded] == [
        a for i, a in enumerate(alone) if i not in unseeded]
    assert all(together[i][1] in ("stop", "length") for i in unseeded)
    assert metric_value(metrics, "medusa:batch_joins_total") > 0, "requests should have joined running batches"
    assert metric_value(metrics, "vllm:request_success_total") == 64
    steps = metric_value(metrics, "medusa:batch_steps_total") - steps_before
    rows = metric_value(metrics, "medusa:batch_row_steps_total") - rows_before
    assert rows / steps > 2, "concurrent requests should have been decoded in shared batches"


def test_full_queue_answers_503_and_the_queued_requests_still_finish(model):
    """--max-queue places beyond the rows free: on an idle engine with one row, three requests are taken (the
    row's and two waiting places), the fourth refused."""
    with serve(model, "medusa", max_batch=1, max_queue=2) as (server, engine):
        url = server.base_url + "/v1/completions"
        body = {"model": "tiny", "prompt": "the cat", "max_tokens": 4, "temperature": 0}
        answers: list[httpx.Response] = []
        with engine.hold():
            threads = [threading.Thread(target=lambda: answers.append(httpx.post(url, json=body, timeout=60)))
                       for _ in range(3)]
            for thread in threads:
                thread.start()
            wait_until(lambda: engine.snapshot()["waiting"] == 3, message="three requests should be queued")
            full = httpx.post(url, json=body, timeout=10)
            assert full.status_code == 503
            assert full.json()["error"]["code"] == "queue_full" and full.json()["error"]["type"] == "server_error"
            with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
                with pytest.raises(openai.InternalServerError, match="overloaded"):
                    client.completions.create(**body)
        for thread in threads:
            thread.join(60)
        assert [a.status_code for a in answers] == [200, 200, 200]
        assert metric_value(_metrics(server), "medusa:http_requests_total", status="503") == 2


def test_a_burst_the_free_rows_take_is_not_refused_as_a_full_queue(model):
    """Requests arriving within one turn all counted against --max-queue: on an idle engine with 8 free rows and
    one waiting place, the second was refused."""
    from medusa_infer.decoding import SamplingConfig, StopConfig
    from medusa_infer.serving.scheduler import Engine, QueueFull, Request

    engine = Engine(model, model.tokenizer, "medusa", max_batch=8, max_queue=1)
    ids = model.tokenizer("the cat")["input_ids"]
    finished: list[str] = []

    def make() -> Request:
        return Request(ids, SamplingConfig("greedy"), StopConfig(max_new_tokens=3),
                       lambda update: finished.append(update.finish) if update.finish else None)

    engine.start()
    try:
        with engine.hold():  # the burst arrives within one turn
            for _ in range(9):  # 8 free rows and 1 waiting place
                engine.submit(make())
            with pytest.raises(QueueFull, match=r"9 requests are already queued for 8 free rows \(--max-batch 8\)"):
                engine.submit(make())
        wait_until(lambda: len(finished) == 9, message="the burst should finish")
    finally:
        engine.stop()


def test_the_engine_never_decodes_more_rows_than_max_batch(model):
    """Rows past max_batch were admitted (a memory cap exceeded) with every answer still right."""
    from medusa_infer.decoding import SamplingConfig, StopConfig
    from medusa_infer.serving.scheduler import Engine, Request

    engine = Engine(model, model.tokenizer, "medusa", max_batch=2)
    rows, step = [], engine._step

    def counting(running):
        rows.append(sum(len(r.batch.rows) for r in engine._batches))
        return step(running)

    engine._step = counting
    done: dict[int, bool] = {}
    engine.start()
    try:
        with engine.hold():
            for i in range(3):
                engine.submit(Request([5 + i, 6, 7], SamplingConfig("greedy"), StopConfig(12, eos_token_ids=()),
                                      lambda u, i=i: done.__setitem__(i, bool(u.finish))))
        wait_until(lambda: len(done) == 3 and all(done.values()), timeout=60)
    finally:
        engine.stop()
    assert rows and max(rows) == 2


def test_queued_requests_whose_clients_left_free_their_queue_places_at_once(model):
    """A cancelled request still waiting leaves the queue when cancelled, not at the engine's next
    turn (after a long prefill or step new clients got 503 queue_full from requests nobody waited for)."""
    from medusa_infer.decoding import SamplingConfig, StopConfig
    from medusa_infer.serving.scheduler import Engine, Request

    engine = Engine(model, model.tokenizer, "medusa", max_batch=1, max_queue=2)
    ids = model.tokenizer("the cat")["input_ids"]
    updates: dict[int, list] = {}

    def request(i: int) -> Request:
        return Request(ids, SamplingConfig("greedy"), StopConfig(max_new_tokens=3),
                       lambda u: updates.setdefault(i, []).append(u))

    engine.start()
    try:
        with engine.hold():  # a turn that does not end while the clients come and go
            left = [request(0), request(1)]
            for r in left:
                engine.submit(r)
            for r in left:
                engine.cancel(r)
            assert engine.snapshot()["waiting"] == 0
            engine.submit(request(2))  # raised QueueFull
        wait_until(lambda: all(i in updates and updates[i][-1].finish for i in range(3)), timeout=60)
    finally:
        engine.stop()
    assert [updates[i][-1].finish for i in range(3)] == ["disconnect", "disconnect", "length"]

    # cancelled while queued, then the engine stops before its next turn: the request is still told
    engine = Engine(model, model.tokenizer, "medusa", max_batch=1, max_queue=2)
    updates.clear()
    engine.start()
    with engine.hold():
        left, waiting = request(0), request(1)
        engine.submit(left)
        engine.submit(waiting)
        engine.cancel(left)
        engine.stop(timeout=10)  # stop() waits out no turn: the loop ends without one
    assert [updates[i][-1].finish for i in range(2)] == ["disconnect", "shutdown"] and left.done


def test_the_engine_refuses_a_prompt_the_model_cannot_take(model):
    """An id outside the vocabulary, prefilled with a good request, failed both ("prefill failed: index out of
    range in self"); a prompt filling the context was decoded past it (a model of learned positions failed)."""
    from medusa_infer.decoding import SamplingConfig, StopConfig
    from medusa_infer.serving.scheduler import Engine, Request

    engine = Engine(model, model.tokenizer, "medusa", max_batch=4)
    ids = model.tokenizer("the cat")["input_ids"]
    updates: dict[int, list] = {}

    def request(i: int, prompt: list[int]) -> Request:
        return Request(prompt, SamplingConfig("greedy"), StopConfig(max_new_tokens=3),
                       lambda u: updates.setdefault(i, []).append(u))

    vocab = model.base_model.get_output_embeddings().weight.shape[0]
    engine.start()
    try:
        with engine.hold():  # one turn would prefill them together
            engine.submit(request(0, ids))
            with pytest.raises(ValueError, match=rf"the prompt's token id {vocab} is outside the vocabulary "
                                                 rf"\[0, {vocab}\): encode prompts with the model's tokenizer"):
                engine.submit(request(1, ids + [vocab]))
            with pytest.raises(ValueError, match=rf"a prompt of {engine.context_length} tokens leaves no room in the "
                                                 rf"model's context of {engine.context_length} tokens"):
                engine.submit(request(2, ids[:1] * engine.context_length))
        wait_until(lambda: 0 in updates and updates[0][-1].finish, timeout=60)
    finally:
        engine.stop()
    assert updates[0][-1].finish == "length" and set(updates) == {0}


def test_a_pad_token_the_model_has_no_embedding_for_pads_nothing(model, monkeypatch):
    """A pad token added to a tokenizer whose model was not resized: every prompt prefilled beside a longer one
    failed ("prefill failed: index out of range in self"); padding is masked, any id of the model serves."""
    import copy

    from medusa_infer.decoding import SamplingConfig, StopConfig, generate
    from medusa_infer.serving.scheduler import Engine, Request

    tokenizer = copy.deepcopy(model.tokenizer)
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    assert tokenizer.pad_token_id == model.base_model.get_input_embeddings().weight.shape[0]
    for config in (model.base_model.generation_config, model.base_model.config):  # (theirs come first)
        monkeypatch.setattr(config, "pad_token_id", None)
    texts = ["the cat", "the cat sat on the mat"]
    alone = [generate(model, prompt=text, tokenizer=tokenizer, max_new_tokens=3).sequences[0, -3:].tolist()
             for text in texts]
    assert generate(model, prompt=texts, tokenizer=tokenizer, max_new_tokens=3).sequences[:, -3:].tolist() == alone
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    engine = Engine(model, tokenizer, "medusa", max_batch=4)
    updates: dict[int, list] = {}
    engine.start()
    try:
        with engine.hold():  # one turn prefills them together
            for i, ids in enumerate(prompts):
                engine.submit(Request(ids, SamplingConfig("greedy"), StopConfig(max_new_tokens=3),
                                      lambda u, i=i: updates.setdefault(i, []).append(u)))
        wait_until(lambda: len(updates) == 2 and all(u[-1].finish for u in updates.values()), timeout=60)
    finally:
        engine.stop()
    assert [updates[i][-1].finish for i in range(2)] == ["length", "length"], updates


def test_timeouts_abort_queued_and_running_requests(model):
    with serve(model, "medusa", request_timeout=1.0) as (server, engine):
        url = server.base_url + "/v1/completions"
        body = {"model": "tiny", "prompt": "the cat", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        # queued past its deadline
        answers: list[httpx.Response] = []
        with engine.hold():
            thread = threading.Thread(target=lambda: answers.append(httpx.post(url, json=body, timeout=60)))
            thread.start()
            wait_until(lambda: engine.snapshot()["waiting"] == 1)
            start = time.monotonic()  # queued: it arrived before this, so its deadline passes before the hold ends
            wait_until(lambda: time.monotonic() - start > 1.05, timeout=5)
        thread.join(30)
        assert answers[0].status_code == 504
        assert answers[0].json()["error"]["type"] == "timeout_error"
        # OpenAI's SDKs retry a 5xx twice unless told not to: three times the engine time for the same 504
        assert answers[0].headers["x-should-retry"] == "false"
        # decoding past its deadline, streamed: the stream ends with an error event
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
            with _stopped_after_first_token(model, engine):
                stream = client.completions.create(stream=True, **{k: v for k, v in body.items() if k != "ignore_eos"},
                                                   extra_body={"ignore_eos": True})
                first = next(iter(stream))
                assert first.choices[0].text
                start = time.monotonic()  # it arrived before its first token: its deadline passes before the release
                wait_until(lambda: time.monotonic() - start > 1.05, timeout=5)
            with pytest.raises(openai.APIError, match="timed out"):
                for _ in stream:
                    pass
        wait_until(lambda: engine.snapshot()["running"] == 0)
        assert metric_value(_metrics(server), "medusa:requests_aborted_total", reason="timeout") == 2


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_frees_its_row(model, stream):
    with serve(model, "medusa") as (server, engine):
        body = {"model": "tiny", "prompt": "the cat sat", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        url = server.base_url + "/v1/completions"
        with contextlib.ExitStack() as paused:
            if stream:
                paused.enter_context(_stopped_after_first_token(model, engine))
                with httpx.Client(timeout=30) as client, client.stream("POST", url, json=body) as response:
                    assert response.status_code == 200
                    next(response.iter_lines())  # the first event: the request is decoding
            else:  # the client goes once its request is queued (a client timeout raced the server reading it)
                import json
                import socket

                paused.enter_context(engine.hold())
                data = json.dumps(body).encode()
                with socket.create_connection(("127.0.0.1", server.port), timeout=30) as connection:
                    connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                       + f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
                    wait_until(lambda: engine.snapshot()["waiting"] == 1, message="the request was never queued")
            wait_until(lambda: engine.snapshot()["pending_cancels"] == 1, message="the server missed the disconnect")
        wait_until(lambda: engine.snapshot()["running"] == 0 and engine.snapshot()["waiting"] == 0)
        metrics = _metrics(server)
        assert metric_value(metrics, "medusa:requests_aborted_total", reason="disconnect") == 1
        assert metric_value(metrics, "vllm:request_success_total") == 0
        assert metric_value(metrics, "vllm:generation_tokens_total") < 200


def test_a_client_that_goes_away_while_uploading_is_a_499_not_a_server_error(model, caplog):
    """A body cut short by the client (a timeout, a cancelled large prompt): nothing failed on the server,
    so no 500 is counted and no error logged."""
    import socket

    with serve(model, "medusa") as (server, engine):
        with socket.create_connection(("127.0.0.1", server.port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 1000\r\n\r\n{\"model\": \"tiny\"")
        counted = lambda status: metric_value(_metrics(server), "medusa:http_requests_total",  # noqa: E731
                                              method="POST", path="/v1/completions", status=status)
        wait_until(lambda: counted("499") == 1, message="the aborted upload was not counted as 499")
        assert counted("500") == 0
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
        assert engine.snapshot()["running"] == 0 and engine.snapshot()["waiting"] == 0


@contextlib.contextmanager
def _stopped_after_first_token(model, engine):
    """Blocks the engine thread in the model's first forward pass after a token was delivered,
    until the block ends (``Engine.hold`` after the first event would race the engine, which may
    have finished the request by then)."""
    release, before = threading.Event(), engine.metrics.generation_tokens.value()

    def wait(module, args, kwargs):
        if engine.metrics.generation_tokens.value() > before:
            assert release.wait(60), "the test never released the engine"

    handle = model.register_forward_pre_hook(wait, with_kwargs=True)
    try:
        yield
    finally:
        release.set()
        handle.remove()


def _metrics(server) -> str:
    return httpx.get(server.base_url + "/metrics", timeout=10).text


@pytest.mark.parametrize("budget, groups", [(2048, [3]), (20, [2, 1]), (5, [1, 1, 1])])
def test_a_burst_of_prompts_is_prefilled_within_the_token_budget_a_turn(model, monkeypatch, budget, groups):
    from medusa_infer.decoding import SamplingConfig, StopConfig
    from medusa_infer.serving.scheduler import Engine, Request

    tokenizer = model.tokenizer
    engine = Engine(model, tokenizer, "medusa", max_prefill_tokens=budget)
    prefills: list[int] = []
    start_batch = engine._start_batch
    monkeypatch.setattr(engine, "_start_batch", lambda key, requests: (prefills.append(len(requests)),
                                                                      start_batch(key, requests)))
    texts, finished = {}, []

    def on_update(i):
        def update(u):
            texts.setdefault(i, []).extend(u.token_ids)
            if u.finish is not None:
                finished.append(i)
        return update

    engine.start()
    try:
        with engine.hold():  # all three wait together, 9 prompt tokens each
            for i, text in enumerate(prompts(3)):
                ids = tokenizer(" ".join((text + " the the the the the the the the the").split()[:9]))["input_ids"]
                assert len(ids) == 9
                engine.submit(Request(ids, SamplingConfig("greedy"), StopConfig(max_new_tokens=5), on_update(i)))
        wait_until(lambda: len(finished) == 3, timeout=60)
    finally:
        engine.stop()
    assert prefills == groups  # a prompt longer than the budget still goes, alone
    assert all(len(tokens) == 5 for tokens in texts.values())


def test_a_batch_requests_keep_joining_holds_only_the_rows_still_decoding(model):
    """A server batch that never empties (a request joins whenever one ends) keeps no entry of a
    served request: it held each one's stop strings, finish and counts, growing with every request.

    Deterministic on any machine: a long request keeps the batch running, and each request that ends
    submits the next from its callback (on the engine thread), so it joins at the engine's next turn
    (the test thread used to submit it, and on a slow machine the batch had sometimes emptied first)."""
    from medusa_infer.decoding import SamplingConfig, StopConfig
    from medusa_infer.serving.scheduler import Engine, Request

    tokenizer = model.tokenizer
    engine = Engine(model, tokenizer, "medusa", max_batch=8)
    finished: list[int] = []
    batches, sizes = set(), []
    ids = tokenizer("the cat sat")["input_ids"]
    total, lanes = 40, 3

    def submit(i: int) -> None:
        def update(u) -> None:  # called between two steps: the engine's batches are not changing
            for running in engine._batches:
                batches.add(id(running.batch))
                sizes.append(len(running.batch.stops))
            if u.finish:
                finished.append(i)
                if i + lanes < total:
                    submit(i + lanes)

        stop = StopConfig(3 + i % 5, (), (f"zz{i}" + "x" * 200,))
        engine.submit(Request(ids, SamplingConfig("greedy"), stop, update))

    # 200 tokens: well past the 60 or so it reaches while the 40 go through, within the model's 256 positions
    anchor = Request(ids, SamplingConfig("greedy"), StopConfig(200), lambda u: None)
    engine.start()
    try:
        with engine.hold():
            engine.submit(anchor)
            for i in range(lanes):
                submit(i)
        wait_until(lambda: len(finished) == total, timeout=120)
        assert not anchor.done  # the batch never emptied (else this checks nothing)
        engine.cancel(anchor, "stop")
        wait_until(lambda: anchor.done, timeout=60)
    finally:
        engine.stop()
    assert len(batches) == 1  # every request joined the anchor's batch
    assert max(sizes) <= 1 + lanes, sizes  # the rows in flight; was up to 41 (every request served)


def test_a_request_s_client_hears_its_end_after_the_counts_stop_holding_it(model):
    """The engine's counts (``snapshot``, ``/metrics``' running rows) are published before a request's
    last update: a client that read them as soon as its answer came saw its own request still running
    until the engine's turn ended (1 read in 200 on a 2-core machine)."""
    from medusa_infer.decoding import SamplingConfig, StopConfig
    from medusa_infer.serving.scheduler import Engine, Request

    engine = Engine(model, model.tokenizer, "medusa", max_batch=4)
    seen: dict[int, dict] = {}

    def request(i: int, n: int, sampling: SamplingConfig = SamplingConfig("greedy"),
                seed: int | None = None) -> Request:
        def update(u) -> None:  # on the engine thread, as the server's handler is woken
            if u.finish:
                seen[i] = engine.snapshot()
        return Request([5, 6, 7], sampling, StopConfig(n), update, seed=seed)

    def counts(running: int, batches: int) -> dict:
        return {"running": running, "waiting": 0, "pending_cancels": 0, "batches": batches}

    locked = []  # each gauge is set under the engine's lock, with the queue it counts: /health never saw a
    for gauge in (engine.metrics.running, engine.metrics.waiting):  # request just taken in neither count
        gauge.set = functools.partial(lambda set_, value, **labels: (locked.append(engine._lock.locked()),
                                                                     set_(value, **labels)), gauge.set)
    engine.start()
    try:
        with engine.hold():
            engine.submit(request(0, 3))
            engine.submit(request(1, 40))
            engine.submit(request(2, 1))  # ends at its prefill, before its batch joins the engine's
            engine.submit(request(4, 40, SamplingConfig("lossless", temperature=0.7), seed=5))  # seeded: a batch of its
            # own, after
        wait_until(lambda: len(seen) == 4, timeout=60)
        engine.submit(request(3, 200))
        wait_until(lambda: engine.snapshot()["running"] == 1)
    finally:
        engine.stop()  # request 3 hears the shutdown
    # request 2: its batch's other rows and the seeded request admitted with them (it counted none of them)
    assert seen[2] == counts(3, 1)
    assert seen[0] == counts(2, 2)  # the other rows decode on
    first, last = sorted((1, 4), key=list(seen).index)
    assert (seen[first], seen[last], seen[3]) == (counts(1, 1), counts(0, 0), counts(0, 0))
    assert locked and all(locked)


def test_metrics_are_read_under_the_engine_lock(model):
    """``/metrics`` reads its gauges under the engine's lock, as ``snapshot`` does: read without it, a
    scrape could take the running gauge before a request left the queue and the waiting one after."""
    with serve(model, "medusa") as (server, engine):
        render, locked = engine.metrics.render, []
        engine.metrics.render = lambda: (locked.append(engine._lock.locked()), render())[1]
        assert "vllm:num_requests_running" in _metrics(server)
    assert locked == [True]


def test_a_draft_model_given_by_name_serves_requests_that_join_a_running_batch(model, tmp_path):
    """``Engine(..., "draft", options.draft_model=NAME)``: the draft is loaded once, so a request
    arriving while another decodes joins its batch (each batch loaded its own copy, the merge refused
    two copies as different drafts, and both requests failed)."""
    from types import SimpleNamespace

    from medusa_infer.decoding import SamplingConfig, StopConfig, generate
    from medusa_infer.serving.scheduler import Engine, Request

    model.base_model.save_pretrained(tmp_path / "draft")
    model.tokenizer.save_pretrained(tmp_path / "draft")
    engine = Engine(model, model.tokenizer, "draft", SimpleNamespace(draft_model=str(tmp_path / "draft")), gate=False)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    tokens, finish = {0: [], 1: []}, {}
    second = Request(prompts[1], SamplingConfig("greedy"), StopConfig(max_new_tokens=30), lambda u: update(1, u))

    def update(i, u):
        if i == 0 and not tokens[0]:  # the first request decodes: the second joins at the engine's next turn
            engine.submit(second)  # (from the engine thread: a test thread might submit after the first ended)
        tokens[i].extend(u.token_ids)
        if u.finish is not None:
            finish[i] = (u.finish, u.error)

    engine.start()
    try:
        engine.submit(Request(prompts[0], SamplingConfig("greedy"), StopConfig(max_new_tokens=40), lambda u: update(0, u)))
        wait_until(lambda: len(finish) == 2, timeout=120)
    finally:
        engine.stop()
    assert finish == {0: ("length", None), 1: ("length", None)}
    assert engine.metrics.batch_joins.value() == 1  # it joined the running batch (else this checks nothing)
    for i, n in ((0, 40), (1, 30)):
        plain = generate(model.__class__(model.base_model, None, model.tokenizer), torch.tensor([prompts[i]]),
                         max_new_tokens=n, eos_token_id=[])
        assert tokens[i] == plain.new_tokens[0]


def run_with_a_late_join(engine, prompts: dict[str, list[int]], limits: dict[str, int], first: list[str]):
    """Start ``engine``, submit the ``first`` requests in one turn and, once request A has 3 tokens, request C from
    A's update (from the engine thread: it joins A's batch at the engine's next turn); ``(tokens, finish)`` by name
    once all are finished."""
    from medusa_infer.decoding import SamplingConfig, StopConfig
    from medusa_infer.serving.scheduler import Request

    tokens, finish = {name: [] for name in prompts}, {}

    def request(name):
        return Request(prompts[name], SamplingConfig("greedy"), StopConfig(max_new_tokens=limits[name]),
                       lambda u: update(name, u))

    def update(name, u):
        tokens[name].extend(u.token_ids)
        if name == "A" and len(tokens["A"]) >= 3 and "C" not in finish:
            finish["C"] = None  # submitted once
            engine.submit(request("C"))
        if u.finish is not None:
            finish[name] = (u.finish, u.error)

    engine.start()
    try:
        with engine.hold():
            for name in first:
                engine.submit(request(name))
        wait_until(lambda: len(finish) == len(prompts) and None not in finish.values(), timeout=120)
    finally:
        engine.stop()
    return tokens, finish


def assert_plain_greedy(model, prompts: dict[str, list[int]], limits: dict[str, int], tokens: dict[str, list[int]]):
    from medusa_infer.decoding import generate

    plain = model.__class__(model.base_model, None, model.tokenizer)
    for name, ids in prompts.items():
        assert tokens[name] == generate(plain, torch.tensor([ids]), max_new_tokens=limits[name],
                                        eos_token_id=[]).new_tokens[0], name


@pytest.mark.parametrize("method", ["medusa", "draft"])
def test_a_batch_that_fails_to_join_a_running_one_decodes_alone_and_the_running_one_goes_on(model, monkeypatch,
                                                                                             method):
    """Out of memory midway through the caches' merge (each layer is held twice a moment on a loaded GPU) left the
    running batch half merged: its next step failed every request in it ("Sizes of tensors must match"), and the
    joining request failed though its prefill had worked."""
    from types import SimpleNamespace

    from medusa_infer import kv_cache
    from medusa_infer.serving.scheduler import Engine

    options = SimpleNamespace(draft_model=model.base_model, draft_tokens=3) if method == "draft" else None
    engine = Engine(model, model.tokenizer, method, options, max_batch=8, gate=False)
    merge, pad, failed = kv_cache.KVState.merge, kv_cache._pad_slots, []

    def flaky_merge(self, other):  # the running batch's own cache (after a draft's, which merges first)
        running = engine._batches and self is engine._batches[0].batch.kv
        calls = []

        def flaky_pad(tensor, width):
            calls.append(1)
            if running and not failed and len(calls) == 3:  # the second layer's keys
                failed.append(1)
                raise torch.OutOfMemoryError("out of memory (injected)")
            return pad(tensor, width)

        monkeypatch.setattr(kv_cache, "_pad_slots", flaky_pad)
        try:
            return merge(self, other)
        finally:
            monkeypatch.setattr(kv_cache, "_pad_slots", pad)

    monkeypatch.setattr(kv_cache.KVState, "merge", flaky_merge)
    prompts, limits = {"A": [10, 11, 12], "B": [13, 14, 15, 16], "C": [20, 21]}, {"A": 30, "B": 30, "C": 5}
    tokens, finish = run_with_a_late_join(engine, prompts, limits, ["A", "B"])
    assert failed and finish == {name: ("length", None) for name in prompts}
    assert engine.metrics.batch_joins.value() == 0  # C decoded alone
    assert_plain_greedy(model, prompts, limits, tokens)


def test_a_failed_join_leaves_the_joining_batchs_draft_cache_whole(model, monkeypatch):
    """A running batch whose draft cached nothing (its prompt is past the draft's context) took the joining batch's
    draft cache layers as its own in the merge: undone after the target cache's merge failed, the joining batch's
    draft cache was emptied and its first step alone failed ("index out of range in self")."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from medusa_infer import kv_cache
    from medusa_infer.serving.scheduler import Engine
    from tiny import tiny_config

    config = tiny_config("llama", vocab_size=model.base_model.get_output_embeddings().weight.shape[0])
    config.max_position_embeddings = 16
    torch.manual_seed(0)
    draft = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    engine = Engine(model, model.tokenizer, "draft", SimpleNamespace(draft_model=draft, draft_tokens=3), max_batch=8,
                    gate=False)
    merge, failed = kv_cache.KVState.merge, []

    def flaky(self, other):  # the target cache's merge, after the draft caches merged
        if engine._batches and self is engine._batches[0].batch.kv and not failed:
            failed.append(1)
            raise torch.OutOfMemoryError("out of memory (injected)")
        return merge(self, other)

    monkeypatch.setattr(kv_cache.KVState, "merge", flaky)
    prompts, limits = {"A": list(range(10, 30)), "C": [20, 21, 22]}, {"A": 30, "C": 5}  # A: past the draft's 16
    tokens, finish = run_with_a_late_join(engine, prompts, limits, ["A"])
    assert failed and finish == {"A": ("length", None), "C": ("length", None)}
    assert_plain_greedy(model, prompts, limits, tokens)


def test_shutdown_answers_the_requests_still_open_with_the_shutdown_error(model):
    """At shutdown the engine gets its drain time (2 s in tests) and is then stopped, and what it still
    holds is answered: a 503 ``shutdown`` error, or a stream's error event. uvicorn alone cancelled
    them after its graceful timeout (a plain-text 500, a stream cut off) and stopped the engine after."""
    body = {"model": "tiny", "prompt": "the cat", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    served = serve(model, "medusa", max_batch=1)
    server, engine = served.__enter__()
    url = server.base_url + "/v1/completions"
    answers: dict[str, object] = {}

    def whole() -> None:
        answers["whole"] = httpx.post(url, json=body, timeout=60)

    def streamed() -> None:
        with httpx.Client(timeout=60) as client, client.stream("POST", url, json={**body, "stream": True}) as reply:
            answers["stream"] = (reply.status_code, [line for line in reply.iter_lines() if line])

    with engine.hold():  # both sit in the queue past the drain time
        clients = [threading.Thread(target=whole), threading.Thread(target=streamed)]
        for client in clients:
            client.start()
        wait_until(lambda: engine.snapshot()["waiting"] == 2, message="two requests should be queued")
        start = time.monotonic()
        served.__exit__(None, None, None)
        for client in clients:
            client.join(30)
    assert not engine.alive and time.monotonic() - start < 10
    assert answers["whole"].status_code == 503
    assert answers["whole"].json()["error"]["code"] == "shutdown"
    status, lines = answers["stream"]
    assert '"code":"shutdown"' in lines[-2].replace(" ", "") and lines[-1] == "data: [DONE]", lines


def test_a_second_ctrl_c_still_ends_open_streams_with_the_shutdown_error(model):
    """A second Ctrl-C (uvicorn's force_exit) stopped waiting and ended the process: the streams still open were cut
    off mid-chunk, without the shutdown error event or [DONE]; they get them, within a second."""
    body = {"model": "tiny", "prompt": "the cat", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    served = serve(model, "medusa", max_batch=1)
    server, engine = served.__enter__()
    url = server.base_url + "/v1/completions"
    answers: dict[str, list[str]] = {}

    def streamed() -> None:
        with httpx.Client(timeout=60) as client, client.stream("POST", url, json=body) as reply:
            answers["stream"] = [line for line in reply.iter_lines() if line]

    with engine.hold():  # queued past the drain time
        client = threading.Thread(target=streamed)
        client.start()
        wait_until(lambda: engine.snapshot()["waiting"] == 1, message="the request should be queued")
        start = time.monotonic()
        server.server.should_exit = True  # the first Ctrl-C, then the second
        time.sleep(0.3)
        server.server.force_exit = True
        client.join(30)
        server.thread.join(15)
        server.socket.close()
    assert time.monotonic() - start < 2.0 + 1.0  # (not the drain's 2 s and the answering time's 5)
    lines = answers["stream"]
    assert '"code":"shutdown"' in lines[-2].replace(" ", "") and lines[-1] == "data: [DONE]", lines


def test_shutdown_answers_the_requests_of_an_engine_turn_that_outlasts_it(model):
    """An engine turn longer than the shutdown's grace (a long prefill on a CPU): the engine could not answer
    the requests it held, and uvicorn cancelled them at its graceful timeout: a stream cut off without its
    shutdown error event or [DONE]. They are answered from the HTTP side once the engine's wait ends."""
    body = {"model": "tiny", "prompt": "the cat", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    served = serve(model, "medusa", max_batch=1)
    server, engine = served.__enter__()
    url = server.base_url + "/v1/completions"
    turn, stuck, release = engine._turn, threading.Event(), threading.Event()

    def long_turn() -> None:  # once the stream has its first token: a turn that lasts until released
        if stuck.is_set():
            release.wait(60)
        turn()

    engine._turn = long_turn
    answers: dict[str, object] = {}

    def streamed() -> None:
        with httpx.Client(timeout=60) as client, client.stream("POST", url, json={**body, "stream": True}) as reply:
            lines = []
            for line in reply.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 1:
                    stuck.set()
            answers["stream"] = lines

    def whole() -> None:
        answers["whole"] = httpx.post(url, json=body, timeout=60)

    clients = [threading.Thread(target=streamed)]
    clients[0].start()
    wait_until(stuck.is_set, timeout=60, message="the stream never began")
    clients.append(threading.Thread(target=whole))  # queued behind the stream (one row a batch)
    clients[1].start()
    wait_until(lambda: engine.snapshot()["waiting"] == 1, timeout=30, message="the second request never queued")
    stopping = threading.Thread(target=served.__exit__, args=(None, None, None))
    start = time.monotonic()
    stopping.start()
    try:
        for client in clients:
            client.join(30)
        answered = time.monotonic() - start
    finally:
        release.set()  # the turn ends: the engine thread too
        stopping.join(30)
    lines = answers["stream"]
    assert '"code":"shutdown"' in lines[-2].replace(" ", "") and lines[-1] == "data: [DONE]", lines
    assert answers["whole"].status_code == 503 and answers["whole"].json()["error"]["code"] == "shutdown"
    assert answered < 2.0 + 5.0, answered  # within the drain and the answering time, before uvicorn's cut


def test_shutdown_serves_a_request_whose_body_was_still_arriving(model):
    """Its headers in before the shutdown, its body after: the drain waited on the engine's counts alone,
    stopped the engine at once, and the request was refused (503 engine_unavailable)."""
    import json
    import socket

    served = serve(model, "medusa", max_batch=1)
    server, _ = served.__enter__()
    body = json.dumps({"model": "tiny", "prompt": "the cat", "max_tokens": 5, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:10])
        # its headers read (uvicorn made the request's task), then the shutdown under way (it stopped
        # listening) before the rest comes: sleeps let a slow machine shut down before the headers were
        # read, or a fast one read the body before shutting down
        wait_until(lambda: served.server.server.server_state.tasks, message="the headers were never read")
        stopping = threading.Thread(target=served.__exit__, args=(None, None, None))
        stopping.start()
        wait_until(lambda: served.server.socket.fileno() == -1, message="the server never stopped listening")
        connection.sendall(body[10:])
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    stopping.join(30)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["usage"]["completion_tokens"] == 5


def test_the_engine_takes_its_methods_settings_as_a_mapping_as_build_proposer_does(model):
    """``Engine``'s options are ``build_proposer``'s, which takes a mapping: the engine set an attribute on it
    (AttributeError for "medusa") and read a draft model from it as an attribute (never loaded up front)."""
    from medusa_infer.decoding import SamplingConfig, StopConfig
    from medusa_infer.serving.scheduler import Engine, Request

    engine = Engine(model, model.tokenizer, "medusa", {"tree": "chain-1", "lookup_tokens": 2})
    assert (engine.options.tree, engine.options.lookup_tokens) == ("chain-1", 2)
    draft = Engine(model, model.tokenizer, "draft", {"draft_model": model.base_model, "draft_tokens": 2})
    assert draft.options.draft_model is not model.base_model  # made a draft model once, up front
    finished = []
    engine.start()
    try:
        engine.submit(Request(model.tokenizer("the cat")["input_ids"], SamplingConfig("greedy"),
                              StopConfig(max_new_tokens=3), lambda u: u.finish and finished.append(u.finish)))
        wait_until(lambda: finished, timeout=60)
    finally:
        engine.stop()
    assert finished == ["length"]
