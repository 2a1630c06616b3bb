"""The HTTP side: OpenAI-compatible routes over the engine.

    GET  /v1/models             the one served model
    GET  /v1/models/{id}        that model, by its id
    POST /v1/completions        text completion, streamed (SSE) or not
    POST /v1/chat/completions   chat, rendered with the tokenizer's chat template
    GET  /health                200 while the engine runs (HEAD too, for load balancers' probes)
    GET  /metrics               Prometheus text format

Requests are validated by ``protocol`` before anything is queued; every failure is answered with
an OpenAI-style error body. ``--api-key`` guards the ``/v1`` routes (``/health`` and ``/metrics``
stay open, as in vLLM). A client that goes away, streaming or not, has its row cancelled.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from medusa_infer.decoding import (
    ByteRun,
    SamplingConfig,
    StopConfig,
    cleans_spaces,
    cleanup_settled,
    context_start,
    ends_in_byte_token,
    special_stop_ids,
    text_start,
    whole_text,
)
from medusa_infer.serving import protocol
from medusa_infer.serving.protocol import APIError, GenerationParams, ModelInfo, Speculation
from medusa_infer.serving.scheduler import ABORT_REASONS, Engine, EngineStopped, QueueFull, Update
from medusa_infer.serving.scheduler import Request as EngineRequest

log = logging.getLogger(__name__)

TIMEOUT_GRACE_S = 10.0
"""Past its timeout plus this, a request whose engine has not answered is failed by the HTTP side."""

ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")


@dataclass(frozen=True)
class ServerSettings:
    """How the routes behave.

    Attributes:
        method: the proposer method, reported in each response's ``usage.speculative``.
        eos_token_ids: ids that end a request (unless it asks for ``ignore_eos``).
        api_key: required as ``Authorization: Bearer KEY`` on ``/v1`` routes when set.
        request_timeout: seconds a request may take in all (queued and decoding); None: no limit.
        acceptance: acceptance rule of sampled requests that do not choose one (greedy requests
            always use ``greedy``).
    """

    method: str
    eos_token_ids: tuple[int, ...]
    api_key: str | None = None
    request_timeout: float | None = 120.0
    acceptance: str = "lossless"


ANSWER_S = 5.0
"""Seconds uvicorn_server's shutdown leaves connections to send their answers once the engine stopped."""

STOP_WAIT_S = ANSWER_S / 2
"""Of those, the seconds it waits for the engine's thread to end its turn; past them the requests it still
holds are answered from here (a turn can take longer on a CPU: a long prefill)."""

FORCED_ANSWER_S = 1.0
"""After a second Ctrl-C, how long the requests still open get to send their shutdown error before the process
ends."""


def uvicorn_server(app: FastAPI, drain_s: float = 5.0, **config: Any):
    """A ``uvicorn.Server`` for ``app`` (of ``create_app``) whose shutdown (SIGTERM, Ctrl-C) stops
    listening, lets the engine finish what it holds for up to ``drain_s`` seconds, then stops it:
    requests still unanswered get the 503 ``shutdown`` error (a stream: an error event and
    ``[DONE]``), and their connections close once it is sent (within ``ANSWER_S`` more seconds): from
    the engine, or where its turn outlasts ``STOP_WAIT_S`` of those (a long prefill), from here.

    uvicorn alone stops the engine only in the lifespan's shutdown, after its graceful timeout and
    after cancelling the requests still open: their clients got a plain-text 500 or a stream cut
    off mid-way, never the shutdown error. ``config``: ``uvicorn.Config``'s other settings.
    """
    import uvicorn

    engine: Engine = app.state.engine

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            # requests still open: their bodies read, tokenised, queued, decoding (the engine's counts miss
            # the first ones, which were refused as the engine stopped at once)
            drained = asyncio.create_task(_drain(engine, drain_s, lambda: bool(self.server_state.tasks),
                                                 app.state.answers))
            try:
                await super().shutdown(sockets)
            finally:
                if self.force_exit:  # a second Ctrl-C: no more waiting for the engine, and the requests still open
                    drained.cancel()  # answered "shutdown" at once (their streams were cut off mid-chunk, without
                    engine.stop(timeout=0)  # the error event or [DONE]), with a moment to send it
                    for answer in list(app.state.answers):
                        answer.shut_down()
                    deadline = time.monotonic() + FORCED_ANSWER_S
                    while self.server_state.tasks and time.monotonic() < deadline:
                        await asyncio.sleep(0.02)
                await asyncio.gather(drained, return_exceptions=True)

    return DrainingServer(uvicorn.Config(app, timeout_graceful_shutdown=drain_s + ANSWER_S, **config))


async def _drain(engine: Engine, seconds: float, open_requests: Callable[[], bool],
                 answers: set[_Answer]) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and open_requests():
        await asyncio.sleep(0.05)
    await asyncio.to_thread(engine.stop, STOP_WAIT_S)  # what is left is answered "shutdown"
    for answer in list(answers):  # the engine still in its turn, past the wait: uvicorn would cut these off
        answer.shut_down()  # (a stream without its error event or [DONE]) once its graceful timeout ends


def create_app(engine: Engine, model: ModelInfo, settings: ServerSettings) -> FastAPI:
    """The FastAPI application; it starts the engine with the server and stops it at shutdown."""

    model.tokenizer("warm-up")  # a tokenizer may reset its settings on first use: not concurrently, later

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine.alive:
            engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="medusa-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine  # for uvicorn_server's shutdown
    answers: set[_Answer] = set()  # the requests being answered: uvicorn_server's shutdown answers them
    app.state.answers = answers
    _add_error_handlers(app)
    app.add_middleware(_CountRequests, count=lambda method, path, status: engine.metrics.http_requests.inc(
        method=method, path=path, status=status))

    async def check_api_key(request: Request) -> None:
        if settings.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key; send the header 'Authorization: Bearer <key>'.",
                           "invalid_request_error", None, "invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    def model_card() -> dict[str, Any]:
        return {"id": model.name, "object": "model", "created": 0, "owned_by": "medusa-forge",
                "max_model_len": model.context_length}

    @v1.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{name:path}")
    async def retrieve_model(name: str) -> dict[str, Any]:
        if name != model.name:
            raise protocol.unknown_model(name, model)
        return model_card()

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        # tokenising off the event loop (the tokenizer releases the GIL) keeps other streams flowing
        params = await asyncio.to_thread(protocol.parse_completion, await _read_json(request), model)
        return await _generate(request, params)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        params = await asyncio.to_thread(protocol.parse_chat, await _read_json(request), model)
        return await _generate(request, params)

    app.include_router(v1)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not engine.alive:
            raise APIError(503, "the engine is not running", "server_error", None, "engine_unavailable")
        return JSONResponse({"status": "ok", **engine.snapshot()})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(engine.render_metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _generate(request: Request, params: GenerationParams) -> Response:
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[Update] = asyncio.Queue()

        def on_update(update: Update) -> None:  # called on the engine thread
            loop.call_soon_threadsafe(updates.put_nowait, update)

        stop = StopConfig(params.max_tokens, () if params.ignore_eos else settings.eos_token_ids, params.stop,
                          special_stop_ids(model.tokenizer, params.stop))
        job = EngineRequest(params.prompt_ids, _sampling(params, settings.acceptance), stop, on_update,
                            seed=params.seed, timeout=settings.request_timeout)
        try:
            engine.submit(job)
        except QueueFull as error:
            raise APIError(503, f"The server is overloaded: {error}. Retry later.", "server_error", None,
                           "queue_full") from None
        except EngineStopped as error:
            raise APIError(503, f"The server cannot take requests: {error}.", "server_error", None,
                           "engine_unavailable") from None
        except ValueError as error:  # a prompt the engine refuses (the request's checks take these first)
            raise protocol.invalid(str(error), "messages" if params.kind == "chat" else "prompt") from None
        answer = _Answer(engine, job, params, model, settings.method, updates, settings.request_timeout, answers)
        if params.stream:
            return _EventStream(answer.events(), on_close=answer.close,
                                media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await answer.whole(request)

    return app


def _sampling(params: GenerationParams, default_acceptance: str) -> SamplingConfig:
    """Greedy for temperature 0 (top-p/top-k do not matter then, so all greedy requests batch together).
    Raises a 400 ``APIError`` for top_k or top_p with typical acceptance, which samples without them."""
    if params.temperature == 0:
        return SamplingConfig("greedy", 0.0, 0, 1.0)
    try:
        return SamplingConfig(params.acceptance or default_acceptance, params.temperature, params.top_k, params.top_p)
    except ValueError as error:  # protocol checked each value alone: only their combination can be refused here
        raise protocol.invalid(str(error), "top_k" if params.top_k else "top_p") from None


class _Answer:
    """Turns one request's engine updates into an OpenAI response, whole or as server-sent events."""

    def __init__(self, engine: Engine, job: EngineRequest, params: GenerationParams, model: ModelInfo,
                 method: str, updates: asyncio.Queue[Update], timeout: float | None, answers: set[_Answer]) -> None:
        self.engine, self.job, self.params, self.model = engine, job, params, model
        self.updates, self.answers = updates, answers
        answers.add(self)  # until it is answered (whole or events)
        self.deadline = job.arrival + timeout + TIMEOUT_GRACE_S if timeout else None
        self.text = TextAssembler(model.tokenizer, params.stop, params.prompt_ids)
        self.speculation = Speculation(method)
        self.id, self.created = protocol.new_id(params.kind), protocol.now()
        self.completion_tokens = 0

    async def _next(self, disconnected: asyncio.Future | None = None) -> Update:
        """The next update; raises ``APIError`` when the engine took far longer than allowed."""
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        waiters: set[asyncio.Future] = {asyncio.ensure_future(self.updates.get())}
        if disconnected is not None:
            waiters.add(disconnected)
        done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        getter = next(w for w in waiters if w is not disconnected)
        if getter in done:
            update = getter.result()
            if not self.text.stopped:  # steps the engine took before the cancel of a stop it missed took effect
                self.completion_tokens += len(update.token_ids)  # count for nothing, as many as the load made
                self.speculation.draft_steps, self.speculation.accepted_tokens = (update.draft_steps,
                                                                                  update.accepted_tokens)
                self.speculation.step_tokens = max(self.completion_tokens - 1, 0)  # all but the prefill's
            return update
        getter.cancel()
        if disconnected is not None and disconnected in done:
            raise _ClientGone
        self.engine.cancel(self.job, "timeout")
        raise _timeout_error("the engine did not answer in time")

    def close(self) -> None:
        """The response is over (answered, or its client gone): the request ends (a no-op once finished)."""
        self.engine.cancel(self.job, "disconnect")
        self.answers.discard(self)

    def shut_down(self) -> None:
        """At shutdown, the engine stopped while still in a turn that holds this request: answer it the
        shutdown error now (an update after the engine's own, if any, is never read)."""
        if not self.job.done:
            self.updates.put_nowait(Update([], "shutdown", "the server is shutting down"))

    def _stop_early(self) -> None:
        """The text holds a stop string the engine has not seen yet (it only looks at the last
        tokens): end the request there, as a normal stop."""
        if self.text.stopped and not self.job.done:
            self.engine.cancel(self.job, "stop")

    def _finish_reason(self, update: Update) -> str:
        """OpenAI's finish reason: "stop" whenever the text was cut at a stop string, even where the
        engine ended the row for another reason at the same step (the limit, an end-of-text token)."""
        return "stop" if self.text.stopped else protocol.FINISH_REASONS[update.finish]

    def _usage(self) -> dict[str, Any]:
        return protocol.usage(len(self.params.prompt_ids), self.completion_tokens, self.speculation)

    async def whole(self, request: Request) -> Response:
        disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            text = ""
            while True:
                update = await self._next(disconnected)
                text += self.text.add(update.token_ids, final=update.finish is not None)
                if update.finish is not None:
                    break
                self._stop_early()
        except Exception as error:  # unexpected: counted as an error, as a stream's is (close() said disconnect)
            if not isinstance(error, (_ClientGone, protocol.APIError)):
                self.engine.cancel(self.job, "error")
            raise
        finally:  # a _ClientGone goes on to the app's handler: a 499 nobody reads
            disconnected.cancel()
            self.close()
        if update.finish in ABORT_REASONS:
            raise _abort_error(update)
        body = protocol.response_body(self.params.kind, self.id, self.model.name, self.created, text,
                                      self._finish_reason(update), self._usage())
        return JSONResponse(body)

    async def events(self) -> AsyncIterator[str]:
        """The answer as server-sent events. As in OpenAI's API, no chunk carries usage unless the request
        set ``stream_options.include_usage``; then every chunk has ``"usage": null`` and one extra chunk
        with no choices, before ``[DONE]``, has the usage (and ``usage.speculative``). An unexpected
        error once the stream has begun (its 200 sent) is logged and ends it with a ``server_error``
        event and ``[DONE]``: it was cut off mid-way."""
        try:
            async for event in self._events():
                yield event
        except Exception:
            log.exception("unhandled error in a stream (request %s)", self.id)
            self.engine.cancel(self.job, "error")  # its row freed now, and counted as an error, not a disconnect
            yield _sse(protocol.error_body("internal server error", "server_error"))
            yield "data: [DONE]\n\n"

    async def _events(self) -> AsyncIterator[str]:
        kind, name, with_usage = self.params.kind, self.model.name, self.params.include_usage

        def chunk(text: str | None, finish: str | None = None, first: bool = False) -> str:
            return _sse(protocol.chunk_body(kind, self.id, name, self.created, text, finish, first, with_usage))

        if kind == "chat":
            yield chunk("", first=True)
        while True:
            try:
                update = await self._next()
            except APIError as error:
                yield _sse(error.body())
                break
            delta = self.text.add(update.token_ids, final=update.finish is not None)
            if delta:
                yield chunk(delta)
            self._stop_early()
            if update.finish in ABORT_REASONS:
                yield _sse(_abort_error(update).body())
                break
            if update.finish is not None:
                yield chunk(None, self._finish_reason(update))
                if with_usage:
                    yield _sse(protocol.usage_chunk(kind, self.id, name, self.created, self._usage()))
                break
        yield "data: [DONE]\n\n"


class TextAssembler:
    """A request's text as its tokens arrive, decoded incrementally (a window of recent tokens,
    not the whole output each time, bar a tokenizer whose decode cleans up spaces). The text is cut before the first stop string; until the
    request ends, text that may be the start of a stop string or of a multi-byte character (or a
    run of byte tokens: ``ByteRun``) is held back, so a stream never shows what the final
    text will not contain."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...] = (), context: Sequence[int] = ()) -> None:
        """``context``: the prompt's token ids; its last few are decoded before the first new token, so
        the text starts as it reads after the prompt (with the leading space a SentencePiece
        tokenizer drops from a text's first word), and are never part of the text, bar a character
        they end inside of (prompt ids cut mid-character), which the text begins with once complete."""
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = list(context[context_start(tokenizer, context, len(context)):]) if context else []
        self.prefix_offset, self.read_offset = 0, len(self.tokens)
        before = tokenizer.decode(self.tokens, skip_special_tokens=True)
        self.whole: str | None = whole_text(tokenizer, self.tokens, before)  # until the first text: text_start
        self.byte_run = ByteRun(tokenizer, len(self.tokens) if self.whole == before else 0)
        self.text = ""  # decoded so far
        self.sent = 0  # characters of ``text`` handed out
        self.stopped = False
        # decode cleans spaces up: across windows it did not ("it ' s"), so the text is decoded whole, from the
        # context on, and its end held back while a cleanup pattern may still change it
        self.cleans = cleans_spaces(tokenizer)
        self.context, self.context_text = len(self.tokens), before

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """The new text these tokens complete; ``final`` flushes everything held back."""
        if self.stopped:
            return ""
        self.tokens.extend(token_ids)
        self._decode(final)
        end = len(self.text)
        longest = max((len(s) for s in self.stops), default=0)
        settled = len(self.text) if final or not self.cleans else cleanup_settled(self.text)
        for stop in self.stops:
            found = self.text.find(stop, max(0, self.sent - longest))
            if found >= 0 and found + len(stop) <= settled:  # (not in text a cleanup may yet rewrite)
                end = min(end, found)
                self.stopped = True
        if not self.stopped and not final:  # held back: text a cleanup may yet rewrite, then the end of what is
            # settled that may begin a stop string ("it" of "it '", which the next token read "it's", a stop, was
            # sent: the partial stop was looked for in text the cleanup then rewrote)
            end = min(end, settled)
            end -= _partial_stop(self.text[:end], self.stops)
        delta = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def _decode(self, final: bool) -> None:
        decode = self.tokenizer.decode
        if self.cleans:  # whole (quadratic in the answer's length, for these tokenizers alone)
            whole = decode(self.tokens, skip_special_tokens=True)
            text = whole[len(self.context_text):] if whole.startswith(self.context_text) else \
                decode(self.tokens[self.context:], skip_special_tokens=True)  # (cleaned at the seam)
            self.text = text if final or not text.endswith("\ufffd") else self.text
            return
        end = len(self.tokens) if final else self.byte_run(self.tokens)
        before = decode(self.tokens[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        after = decode(self.tokens[self.prefix_offset : end], skip_special_tokens=True)
        if final and after.endswith("\ufffd") and ends_in_byte_token(self.tokenizer, self.tokens[:end]):
            # the answer ends inside a character: the characters before it whole (a byte-fallback tokenizer read
            # all its run of byte tokens as U+FFFD: an answer cut inside a run of 20 CJK characters lost them
            # all), then one U+FFFD, as a byte-level tokenizer reads it (whose own text is kept: one U+FFFD for
            # each stray byte, as its decode gives)
            whole = whole_text(self.tokenizer, self.tokens[self.prefix_offset : end], after)
            after = max(after.rstrip("\ufffd"), whole, key=len) + "\ufffd"
        at = text_start(before, before if self.whole is None else self.whole, after)
        added = after[len(before) if at is None else at:]  # (None: a tokenizer that cleaned up spaces at the seam)
        if added and (final or not after.endswith("\ufffd")):
            first, self.whole = self.whole is not None, None
            self.text += added
            # the next window begins where a character does: after prompt ids cut inside one, the first text's
            # tokens begin with its last bytes, and a window from them read otherwise as the tokens came in one
            # step or in several (the first text only: a model's stray byte at every step kept it there for good)
            if not (first and decode(self.tokens[self.read_offset : end],
                                     skip_special_tokens=True).startswith("\ufffd")):
                self.prefix_offset = self.read_offset
            self.read_offset = end


def _partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that begins some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class _ClientGone(Exception):
    pass


def _abort_error(update: Update) -> APIError:
    if update.finish == "timeout":
        return _timeout_error(update.error or "timed out")
    if update.finish == "shutdown":
        return APIError(503, update.error or "the server is shutting down", "server_error", None, "shutdown")
    return APIError(500, update.error or "generation failed", "server_error", None, update.finish,
                    protocol.NO_RETRY)


def _timeout_error(message: str) -> APIError:
    # not retried by OpenAI's SDKs (their default: twice, so three times the request's engine time)
    return APIError(504, f"The request timed out: {message}.", "timeout_error", None, "request_timeout",
                    protocol.NO_RETRY)


_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
"""Characters JSON leaves as they are that line readers split at (Python's ``str.splitlines``, httpx's and requests'
``iter_lines``): escaped, an event's line was cut in two there, and its JSON failed to parse."""


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':')).translate(_LINE_BREAKS)}\n\n"


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _read_json(request: Request) -> dict[str, Any]:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > protocol.MAX_BODY_BYTES:
        raise _too_large()
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > protocol.MAX_BODY_BYTES:
                raise _too_large()
            chunks.append(chunk)
    except ClientDisconnect:  # gone while uploading: nothing failed here
        raise _ClientGone from None
    # (off the event loop: a body of megabytes stalled every stream and /health while it was parsed)
    return await asyncio.to_thread(protocol.parse_json, b"".join(chunks))


def _too_large() -> APIError:
    return APIError(413, f"the request body is larger than {protocol.MAX_BODY_BYTES} bytes",
                    "invalid_request_error", None, "request_too_large")


class _EventStream(StreamingResponse):
    """A streaming response that calls ``on_close`` however it ends (done, client gone, error),
    even when the client leaves before the first event."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class _CountRequests:
    """ASGI middleware: counts HTTP requests by method, route and status (streams included)."""

    def __init__(self, app: Any, count: Callable[[str, str, str], None]) -> None:
        self.app, self.count = app, count

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_note(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            method = scope.get("method", "")
            self.count(method if method in ("GET", "POST") else "other", _route(scope["path"]), str(status))


def _route(path: str) -> str:
    """The metrics label of a request path: one of ``ROUTES``, ``/v1/models/:id``, or ``other`` (a label
    per unknown path would let clients grow the metrics without bound)."""
    if path in ROUTES:
        return path
    return "/v1/models/:id" if path.startswith("/v1/models/") else "other"


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers or None)

    @app.exception_handler(_ClientGone)
    async def client_gone(request: Request, error: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; counted as such, not as a server error

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            message = f"Unknown route {request.method} {request.url.path}; see /v1/models, /v1/completions, " \
                      "/v1/chat/completions, /health, /metrics"
        else:
            message = str(error.detail)
        return JSONResponse(protocol.error_body(message, "invalid_request_error"), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    app.add_middleware(_AnswerInternalErrors)


class _AnswerInternalErrors:
    """ASGI middleware: an unexpected exception is logged and answered as an OpenAI-style 500.

    Starlette's handler for ``Exception`` answers too, but then re-raises, and the server closes
    the client's keep-alive connection without saying so: its next request fails with a reset.
    Here the error ends with the answer. Once a response has started it cannot be answered again,
    so the exception goes on up (a stream ends itself with an error event: ``_Answer.events``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_and_note(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            response = JSONResponse(protocol.error_body("internal server error", "server_error"), status_code=500)
            await response(scope, receive, send)
