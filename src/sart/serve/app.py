"""The HTTP layer: a FastAPI app with OpenAI's endpoints over a ``Service``.

==============================  =========================================================
``POST /v1/completions``        one prompt (text or token ids) -> the chosen branch
``POST /v1/chat/completions``   messages, rendered with the policy tokenizer's chat
                                template -> the chosen branch as the assistant's message
``GET /v1/models``              the served names, with sart's defaults and limits
``GET /health``                 200 while it can serve; 503 once the driver has failed,
                                while it shuts down, once vLLM's engine core died, or
                                when no upstream of a gateway can serve (``Service.health``)
``GET /metrics``                Prometheus text (``sart:`` metrics, ``sart.serve.metrics``)
==============================  =========================================================

Each request is checked in this order, and refused at the first fault with
OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``):
the API key (401), the body size (413), JSON and field types (400), the
model (404), the policy and sampling fields against the server's limits
(400), the queue (429). Nothing a request holds can load a model, import a
module or render a template of its own: names resolve against what was
fixed at start.

``--api-key`` works as vLLM's: every ``/v1`` route needs ``Authorization:
Bearer KEY`` (401 otherwise); ``/health`` and ``/metrics`` stay open, as
vLLM leaves them, for load balancers and Prometheus (bind to a private
address, the default ``127.0.0.1``, if their numbers are private).

**Request ids.** As vLLM's server: the client's ``X-Request-Id`` header, else the
body's ``request_id``, else a random hex, names the answer (``cmpl-ID``,
``chatcmpl-ID``) and comes back in the ``X-Request-Id`` response header; a
second request under an id still running gets a server-side id with a suffix.

**Disconnects.** While a request runs, its handler also watches the
connection (as vLLM's ``with_cancellation``): when the client goes away the
request is cancelled and every branch of it aborted in the engine.

**Timeouts.** A request's ``timeout`` (seconds, sart's extension field) is its
deadline from arrival: past it, waiting or running, it is cancelled, its
branches aborted, and it is answered 504 (an error event when streaming).
A failure of the engine or the PRM is answered 500.

**Shutdown.** Told to stop (SIGTERM, Ctrl-C), the server takes no new requests
(503) and gives those in flight ``shutdown_grace`` seconds; the ones still
running then are cancelled, their branches aborted, and answered 503 (an error
event when streaming) before the connections close (``Service.drain``, called
by ``sart serve``'s uvicorn server).

**Streaming** (``stream=true``). Which branch answers is known only when the
request finishes: the selector picks among the completed branches by PRM
reward or vote, and any running branch may still be pruned or stopped.
Streaming a branch's tokens as they come would show text that is then
withdrawn, which OpenAI's protocol cannot express. So the stream opens at
once (a first chunk carrying the assistant role, for chat), sends an SSE
comment (``: keep-alive``) every ``keepalive`` seconds, if set, while the
request is undecided — proxies and load balancers then see a live
connection; the ``openai`` client ignores comments, but vLLM's ``vllm bench
serve`` client (0.32) strips each read it gets, so a comment that arrives
alone loses its terminator and swallows the events after it: the default is
none, as vLLM's server sends none — then the chosen answer in one
chunk, a last chunk with ``finish_reason`` and the ``sart`` field, the
usage chunk if ``stream_options.include_usage``, and ``[DONE]``. An error
after the stream opened is sent as an ``{"error": ...}`` event, which the
``openai`` client raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HTTPRequest

from sart.errors import ConfigError
from sart.request import Request
from sart.serve import protocol, responses
from sart.serve.config import Backend, ServeConfig
from sart.serve.methods import get_method, method_names
from sart.serve.protocol import Refused
from sart.serve.service import Outcome, QueueFull, Service, ServiceStopped
from sart.types import Prompt, RequestStatus

_log = logging.getLogger("sart.serve")


def create_app(config: ServeConfig, backend: Backend | Callable[[], Backend]) -> FastAPI:
    """The server's ASGI app. ``backend`` may be a function that builds it: it is then
    called when the app starts, on its event loop (engines such as vLLM's
    ``AsyncLLM`` bind to the loop that builds them)."""
    get_method(config.method)  # an unknown default is refused now, not per request

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served = backend() if callable(backend) else backend
        service = Service(served.engine, served.prm, config)
        service.start()
        app.state.service = service
        try:
            yield
        finally:
            await service.stop()
            if served.close is not None:
                closing = served.close()
                if inspect.isawaitable(closing):  # e.g. the gateway's HTTP client
                    await closing

    app = FastAPI(title="sart serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.config = config
    app.state.created = int(time.time())

    @app.exception_handler(Refused)
    async def _refused(http: HTTPRequest, exc: Refused) -> JSONResponse:
        _service(http).metrics.reject(exc.status)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        body = responses.error_body(str(exc), exc.status, exc.param)
        return JSONResponse(body, status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(http: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            responses.error_body(str(exc.detail), exc.status_code), status_code=exc.status_code
        )

    @app.exception_handler(Exception)
    async def _crashed(http: HTTPRequest, exc: Exception) -> JSONResponse:
        message = f"internal error: {type(exc).__name__}: {exc}"
        return JSONResponse(responses.error_body(message, 500), status_code=500)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest) -> Response:
        return await _complete(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest) -> Response:
        return await _complete(http, chat=True)

    @app.get("/v1/models")
    async def models(http: HTTPRequest) -> JSONResponse:
        _authorize(http)
        return JSONResponse(responses.models_body(config, app.state.created, method_names()))

    @app.get("/health")
    async def health(http: HTTPRequest) -> Response:
        problem = await _service(http).health()
        if problem is None:
            return Response(status_code=200)
        return JSONResponse(responses.error_body(problem, 503), 503)

    @app.get("/metrics")
    async def metrics(http: HTTPRequest) -> Response:
        registry = _service(http).metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


# ------------------------------------------------------------------- a request


def _service(http: HTTPRequest) -> Service:
    return http.app.state.service


def _authorize(http: HTTPRequest) -> None:
    key = http.app.state.config.api_key
    if key is None:
        return
    scheme, _, given = http.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(
        given.strip().encode(), key.encode()
    ):
        raise Refused("a valid API key is required: Authorization: Bearer KEY", None, 401)


async def _read_body(http: HTTPRequest, limit: int) -> bytes:
    declared = http.headers.get("content-length", "")
    too_large = f"the request body is larger than {limit} bytes (the server's --max-body-bytes)"
    if declared.isdigit() and int(declared) > limit:
        raise Refused(too_large, None, 413)
    chunks, size = [], 0
    async for piece in http.stream():
        size += len(piece)
        if size > limit:
            raise Refused(too_large, None, 413)
        chunks.append(piece)
    return b"".join(chunks)


async def _complete(http: HTTPRequest, *, chat: bool) -> Response:
    service = _service(http)
    config: ServeConfig = http.app.state.config
    _authorize(http)
    body = await _read_body(http, config.max_body_bytes)
    shape = protocol.ChatCompletionRequest if chat else protocol.CompletionRequest
    request = protocol.parse(shape, body)
    plan = protocol.plan(request, config)
    prompt = _chat_prompt(service, request) if chat else protocol.completion_prompt(request)
    given = http.headers.get("x-request-id") or request.request_id or uuid.uuid4().hex
    answer_id = f"{'chatcmpl' if chat else 'cmpl'}-{given}"
    # A client that retries under its id while the first try still runs gets a
    # server-side id of its own for the second; both answers carry the client's.
    rid = answer_id if not service.is_open(answer_id) else f"{answer_id}-{uuid.uuid4().hex[:8]}"
    try:
        job = Request(rid, prompt, **plan.request_kwargs)
        service.submit(job, protocol.question(request) if chat else _prompt_text(service, prompt))
    except ConfigError as exc:
        raise Refused(str(exc), protocol.field_of(str(exc))) from None
    except QueueFull as exc:
        raise Refused(str(exc), None, 429) from None
    except ServiceStopped as exc:
        raise Refused(str(exc), None, 503) from None
    reply = _Reply(answer_id, rid, int(time.time()), request.model, plan.method, chat)
    headers = {"X-Request-Id": given}
    if plan.stream:
        return _EventStream(
            _events(service, reply, config.keepalive, plan.include_usage),
            on_close=lambda: service.cancel(rid),
            headers=headers,
        )
    try:
        outcome = await _unless_disconnected(http, service.result(rid))
    finally:
        service.cancel(rid)  # a no-op once the result was taken
    if outcome is None:  # the client left; nobody reads this
        return Response(status_code=499)
    if not outcome.result.ok:
        return _failed(outcome, headers)
    return JSONResponse(reply.body(outcome), headers=headers)


def _chat_prompt(service: Service, request: protocol.ChatCompletionRequest) -> tuple[int, ...]:
    tokenizer = service.engine.tokenizer
    if tokenizer is None:  # a gateway started without --tokenizer (nor a local --model)
        raise Refused(
            "this server has no tokenizer to render chat with (a gateway needs --tokenizer "
            "DIR or a local --model): use /v1/completions",
            "messages",
        )
    if getattr(tokenizer, "chat_template", None) is None:
        raise Refused("this server's model has no chat template: use /v1/completions", "messages")
    # vLLM's way: the template renders text, which is then tokenized (special tokens
    # only where the request asks: the template already holds them).
    text = tokenizer.apply_chat_template(
        protocol.chat_messages(request),
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        tokenize=False,
        **(request.chat_template_kwargs or {}),
    )
    ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    # transformers 5 may return a BatchEncoding (a mapping), 4.x a list.
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    if not ids:
        raise Refused("the chat template rendered no tokens", "messages")
    return tuple(ids)


def _prompt_text(service: Service, prompt: Prompt) -> str | None:
    """What the PRM reads as the question of a completion whose prompt is token ids:
    the ids decoded by the policy's tokenizer (``None``: a text prompt, read as it is,
    or nothing to decode with). A PRM formats its own input around the question as
    text; given ids, it failed the request after it ran, with a 500 that the
    ``openai`` client sends twice more."""
    tokenizer = service.engine.tokenizer
    if isinstance(prompt, str) or service.prm is None or tokenizer is None:
        return None
    try:
        return str(tokenizer.decode(list(prompt), skip_special_tokens=True))
    except Exception:  # ids outside the vocabulary: the engine refuses them at prefill
        return None


async def _unless_disconnected(http: HTTPRequest, waiting: Any) -> Outcome | None:
    """Await ``waiting``, or cancel it if the client disconnects first (``None`` then)."""
    job = asyncio.ensure_future(waiting)
    watch = asyncio.ensure_future(_disconnect(http))
    try:
        await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not job.done():
            job.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await job
    return None if job.cancelled() else job.result()


async def _disconnect(http: HTTPRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _failed(outcome: Outcome, headers: dict[str, str] | None = None) -> JSONResponse:
    message, status, param = _failure(outcome)
    body = responses.error_body(message, status, param)
    return JSONResponse(body, status_code=status, headers=headers)


def _failure(outcome: Outcome) -> tuple[str, int, str | None]:
    """The error message and HTTP status of a request that did not complete: 503 for one
    cancelled because the server is shutting down (as vLLM's server answers once its
    engine stops; clients and balancers retry it elsewhere), 504 for one that ran past
    its ``timeout`` (a cancelled request whose client is still there), 400 for one the
    engine refused for what it asks (a prompt over the context), 500 for a failure; and
    the field at fault, if any."""
    result = outcome.result
    if outcome.shutdown:
        message, status, param = f"the request was cancelled: {result.reason}", 503, None
    elif result.status is RequestStatus.CANCELLED:
        message, status, param = f"the request {result.reason}", 504, None
    elif result.refused:
        message, status = f"the request was refused: {result.reason}", 400
        param = result.refused_field
    else:
        message, status, param = f"the request failed: {result.reason}", 500, None
    # A streamed client may read no error event (vllm bench serve does not): the log
    # keeps the reason, as vLLM's server logs a failed request.
    _log.warning("%s: %s (HTTP %d)", result.request_id, message, status)
    return message, status, param


@attrs.frozen
class _Reply:
    """What every answer to one request shares."""

    id: str
    """The answer's id: ``cmpl-`` (``chatcmpl-``) and the client's id, as vLLM's."""
    key: str
    """The request's id in the server (``id``, or ``id`` and a suffix while another
    request of that id runs)."""
    created: int
    model: str
    method: str
    chat: bool

    def body(self, outcome: Outcome) -> dict[str, Any]:
        return responses.completion_body(
            self.id, self.created, self.model, self.method, outcome, chat=self.chat
        )

    def chunk(self, **fields: Any) -> bytes:
        return _sse(responses.chunk(self.id, self.created, self.model, chat=self.chat, **fields))


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


async def _events(
    service: Service, reply: _Reply, keepalive: float | None, include_usage: bool
) -> AsyncIterator[bytes]:
    """The SSE events of a streamed request (see the module docstring)."""
    job = asyncio.ensure_future(service.result(reply.key))
    try:
        if reply.chat:
            yield reply.chunk(role=True, text="")
        while True:
            done, _ = await asyncio.wait({job}, timeout=keepalive)
            if done:
                break
            yield KEEPALIVE
        try:
            outcome = job.result()
        except Exception as exc:
            yield _sse(responses.error_body(f"internal error: {type(exc).__name__}: {exc}", 500))
            yield DONE
            return
        if not outcome.result.ok:
            yield _sse(responses.error_body(*_failure(outcome)))
            yield DONE
            return
        yield reply.chunk(text=outcome.result.text or "")
        sart_field = {"sart": responses.extension(reply.method, outcome)}
        yield reply.chunk(finish=responses.finish_reason(outcome), extra=sart_field)
        if include_usage:
            yield _sse(
                responses.usage_chunk(
                    reply.id, reply.created, reply.model, outcome, chat=reply.chat
                )
            )
        yield DONE
    finally:
        if not job.done():
            job.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await job


class _EventStream(StreamingResponse):
    """An SSE response that calls ``on_close`` however it ends: finished, failed, or
    torn down because the client left (even before its first event)."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        *,
        on_close: Callable[[], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
