"""The OpenAI-compatible HTTP app (Starlette): routes, authentication, body limits, streaming.

    POST /v1/chat/completions   chat messages through the bundle's chat template
    POST /v1/completions        a plain-text prompt
    GET  /v1/models             the one model served
    GET  /health                liveness (never needs the API key)
    GET  /metrics               Prometheus text

A request is checked completely (key, body size, JSON, parameters; then admitted: its prompt tokenized
once and its length measured against the KV cache, ``Server.admit``) before it takes a queue slot, so
every refusal is a 4xx with an OpenAI-style error object. Admitted requests go to the one ``Worker`` thread,
which runs them as they are (no second tokenization, no second check); their events come back to the event loop
through ``call_soon_threadsafe``. A client that disconnects, or a request past its deadline,
cancels its generation, and the worker moves on to the next request; one that disconnects before its body
has arrived is answered (and counted in /metrics) as 499, without a log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specdec_edge.api.pipeline import Admitted, TooLong
from specdec_edge.errors import SpecdecError
from specdec_edge.serve.metrics import CONTENT_TYPE, Metrics
from specdec_edge.serve.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    STATS_FIELD,
    APIError,
    ChunkWriter,
    CompletionRequest,
    bad,
    completion_object,
    parse_request,
)
from specdec_edge.serve.worker import Job, QueueFull, Worker

log = logging.getLogger("specdec_edge.serve")
BODY_TIMEOUT_S = 60.0  # a request body's time from its headers (and within --timeout); then 408
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
NO_RETRY = {"x-should-retry": "false"}  # the official clients retry 5xx unless told not to


@dataclass(eq=False)
class Server:
    """What the handlers share: the pipeline, its worker and the server's settings."""

    pipe: object  # specdec_edge.Pipeline
    model: str
    api_keys: tuple[str, ...]  # empty: no key needed (then every request is one client)
    timeout_s: float
    max_body_bytes: int
    worker: Worker
    metrics: Metrics
    created: int = field(default_factory=lambda: int(time.time()))
    # One history store per client (API key), never shared: a shared one would let a client time whether
    # another sent a text (docs/SERVING.md). Made on a client's first request.
    histories: dict = field(default_factory=dict)

    def authorize(self, request: Request) -> int:
        """The client (the index of its API key; 0 when the server needs none), or a 401."""
        if not self.api_keys:
            return 0
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        # every key compared, so the time taken does not tell which one matched
        matches = [hmac.compare_digest(given, key.encode()) for key in self.api_keys]
        if scheme.lower() != "bearer" or not any(matches):
            raise APIError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer KEY' with a key the server "
                "was started with (--api-key).",
                code="invalid_api_key",
            )
        return matches.index(True)

    def history(self, client: int):
        """The client's own history store (False when the server keeps none: history off)."""
        if client not in self.histories:
            self.histories[client] = self.pipe.new_history()
        store = self.histories[client]
        return False if store is None else store

    def admit(self, request: CompletionRequest) -> Admitted:
        """The request admitted (``Pipeline.admit``): its prompt tokenized once, its stops and its length (the
        endpoint's default where it names none) measured against the KV cache; the job passes the ``Admitted`` on,
        and the pipeline runs it as it is. Tokenizes: call it in a thread."""
        if request.kind == "chat" and self.pipe.tokenizer.chat_template is None:
            raise bad(
                f"the model {self.model!r} has no chat template (a base model): send a plain prompt to "
                "/v1/completions instead.",
                "messages",
            )
        try:  # no max_tokens: chat's answer may fill the cache, a completion's as much of OpenAI's default as fits
            admitted = self.pipe.admit(request.prompt, request.max_tokens, list(request.stop))
        except TooLong as e:
            raise bad(too_long(request, e), request.prompt_param) from None
        except SpecdecError as e:
            raise bad(str(e), request.prompt_param) from None
        if request.max_tokens is None and request.kind != "chat":
            return admitted.at_most(COMPLETIONS_DEFAULT_MAX_TOKENS)
        return admitted


def too_long(request: CompletionRequest, e: TooLong) -> str:
    """The server's words for a request whose prompt and answer do not fit in the KV cache."""
    what = "the messages take" if request.kind == "chat" else "the prompt takes"
    asked = "" if request.max_tokens is None else f", plus max_tokens={request.max_tokens}"
    return (
        f"{what} {e.prompt_tokens} tokens{asked}: more than the {e.capacity} tokens this model holds in all "
        f"(its KV cache). Shorten the {request.prompt_param}" + (" or lower max_tokens." if asked else ".")
    )


def _server(request: Request) -> Server:
    return request.app.state.server


def data(obj) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def read_json(request: Request, limit: int, deadline: float):
    """The request's JSON body, read until ``deadline`` (monotonic seconds): a 408 past it, a 413 past ``limit``
    bytes."""
    try:
        body = await asyncio.wait_for(_read_body(request, limit), max(deadline - time.monotonic(), 0))
    except asyncio.TimeoutError:
        raise APIError(
            408,
            "the request body did not arrive in time (this server waits at most "
            f"{BODY_TIMEOUT_S:g} s after the headers, within --timeout): send the whole body at once.",
            code="request_timeout",
            headers={"connection": "close"},  # the rest of the body is not read: this connection is done
        ) from None
    if not body:
        raise bad("the request body is empty: send a JSON object.")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise bad(f"the request body is not valid JSON ({e}).") from None


async def _read_body(request: Request, limit: int) -> bytearray:
    too_large = APIError(
        413,
        f"the request body is larger than {limit} bytes, this server's limit (--max-body-bytes).",
        code="request_too_large",
    )
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:  # gone in the middle of its body: nobody to answer, nothing to log
        raise APIError(
            499, "the client disconnected before it sent the whole request body.", code="client_gone"
        ) from None
    return body


class Events:
    """The worker's notifications for one job, delivered on the event loop, read until a deadline."""

    def __init__(self, deadline: float, timeout_s: float):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.deadline = deadline
        self.timeout_s = timeout_s

    def notify(self, kind: str, value) -> None:  # called from the worker thread
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is going down
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))

    async def next(self) -> tuple[str, object]:
        try:
            return await asyncio.wait_for(self.queue.get(), max(self.deadline - time.monotonic(), 0))
        except asyncio.TimeoutError:
            raise APIError(
                504,
                f"the request did not finish within {self.timeout_s:g} s (the server's --timeout, time in the queue "
                "included): ask for fewer tokens (max_tokens), or start the server with a longer --timeout.",
                kind="timeout_error",
                code="timeout",
                headers=NO_RETRY,
            ) from None


def worker_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, SpecdecError):
        return bad(str(e))
    return APIError(500, "the generation failed (a server bug; see the server log).", kind="server_error")


async def watch_disconnect(request: Request, job: Job, events: Events) -> None:
    """Cancel ``job`` as soon as the client goes away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()
    events.notify("gone", None)


async def complete(request: Request, kind: str) -> Response:
    srv = _server(request)
    # --timeout counts from the request's first byte (the connection guard notes it), slow headers included
    deadline = getattr(request.state, "first_byte", None) or time.monotonic()
    deadline += srv.timeout_s
    client = srv.authorize(request)
    body = await read_json(request, srv.max_body_bytes, min(deadline, time.monotonic() + BODY_TIMEOUT_S))
    req = parse_request(body, kind, srv.model, srv.pipe.engines.capacity)
    admitted = await run_in_threadpool(srv.admit, req)
    prompt_tokens = len(admitted.ids)
    events = Events(deadline, srv.timeout_s)
    # owner: the request reuses, restores and is timed against only its own key's earlier contexts
    options = {**req.sampling(), "history": srv.history(client), "owner": client}
    job = Job(admitted, options, events.notify, client=client)
    try:
        srv.worker.submit(job)
    except QueueFull as full:
        raise APIError(
            429,
            f"the server is busy ({srv.worker.depth} requests queued or running, the most --max-queue allows): "
            f"retry after {full.retry_after} s.",
            kind="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(full.retry_after)},
        ) from None
    watcher = asyncio.create_task(watch_disconnect(request, job, events))
    if req.stream:
        stream = sse(req, srv, job, events, watcher, prompt_tokens)
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        while True:
            what, value = await events.next()
            if what == "done":
                return JSONResponse(completion_object(req, srv.model, value, prompt_tokens, srv.pipe.method))
            if what == "error":
                raise worker_error(value)
            if what == "gone":  # nobody to answer
                return Response(status_code=499)
    finally:
        job.cancel()  # after a timeout or a disconnect; no effect on a finished job
        watcher.cancel()


async def sse(req: CompletionRequest, srv: Server, job: Job, events: Events, watcher, prompt_tokens: int):
    """The server-sent events of a streaming request, ending with ``data: [DONE]``. Errors after the
    stream has begun come as an event carrying an OpenAI error object (the clients raise it)."""
    chunks = ChunkWriter(req, srv.model)
    try:
        if (first := chunks.first()) is not None:
            yield data(first)
        while True:
            try:
                what, value = await events.next()
            except APIError as e:
                yield data(e.body())
                break
            if what == "piece":
                yield data(chunks.piece(value))
            elif what == "done":
                yield data(chunks.last(value, srv.pipe.method))
                if req.include_usage:
                    yield data(chunks.usage(value, prompt_tokens))
                break
            elif what == "error":
                yield data(worker_error(value).body())
                break
            else:  # "gone": the client disconnected
                return
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()
        watcher.cancel()


async def chat_completions(request: Request) -> Response:
    return await complete(request, "chat")


async def completions(request: Request) -> Response:
    return await complete(request, "completion")


def model_object(srv: Server) -> dict:
    return {
        "id": srv.model,
        "object": "model",
        "created": srv.created,
        "owned_by": "specdec-edge",
        STATS_FIELD: {"method": srv.pipe.method, "capacity": srv.pipe.engines.capacity},
    }


async def list_models(request: Request) -> Response:
    srv = _server(request)
    srv.authorize(request)
    return JSONResponse({"object": "list", "data": [model_object(srv)]})


async def get_model(request: Request) -> Response:
    srv = _server(request)
    srv.authorize(request)
    if request.path_params["model"] != srv.model:
        raise APIError(404, f"no model {request.path_params['model']!r} here: this server serves {srv.model!r}.")
    return JSONResponse(model_object(srv))


async def health(request: Request) -> Response:
    srv = _server(request)
    return JSONResponse({"status": "ok", "model": srv.model, "method": srv.pipe.method, "queue": srv.worker.depth})


async def metrics(request: Request) -> Response:
    srv = _server(request)
    client = srv.authorize(request)  # each key reads its own generations' metrics only
    return Response(srv.metrics.render(client), media_type=CONTENT_TYPE)


async def api_error(request: Request, e: APIError) -> Response:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def http_error(request: Request, e: HTTPException) -> Response:
    # Starlette's own refusals (unknown path, wrong method) in the same error format
    error = APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=str(e.status_code))
    return JSONResponse(error.body(), status_code=e.status_code, headers=e.headers)


async def internal_error(request: Request, e: Exception) -> Response:
    # a bug: the traceback goes to the server log, never to the client
    error = APIError(500, "internal server error (a bug; see the server log).", kind="server_error")
    return JSONResponse(error.body(), status_code=500, headers=NO_RETRY)


class CountRequests:
    """ASGI middleware: counts every HTTP response by path and status code."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # unless a response starts

        async def counting_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            path = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.requests.labels(path, str(status)).inc()


def create_app(
    pipe,
    *,
    model: str,
    api_key: str | Sequence[str] | None = None,
    max_queue: int = 16,
    timeout_s: float = 600.0,
    max_body_bytes: int = 1 << 20,
) -> Starlette:
    """An app serving ``pipe`` (a loaded ``Pipeline``) as ``model``.

    ``api_key``: required as a Bearer token on every route but /health; several keys are several clients,
    each with its own history store (``Pipeline.new_history``). ``max_queue``: requests that
    may wait while one runs (more get 429). ``timeout_s``: a request's whole time, queue included.
    ``max_body_bytes``: larger request bodies get 413. A request keeps the KV prefix it shares with the previous
    one (the same system prompt, the next turn of a conversation) where ``pipe`` reuses (``LoadSettings.reuse``).
    """
    metrics_ = Metrics()
    worker = Worker(pipe, max_queue, metrics_.observe)
    metrics_.watch_queue(lambda: worker.depth)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            await run_in_threadpool(worker.close)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    handlers = {APIError: api_error, HTTPException: http_error, Exception: internal_error}
    app = Starlette(
        routes=routes,
        exception_handlers=handlers,
        middleware=[Middleware(CountRequests, metrics=metrics_)],
        lifespan=lifespan,
    )
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    app.state.server = Server(pipe, model, keys, timeout_s, max_body_bytes, worker, metrics_)
    return app
