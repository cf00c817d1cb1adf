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
``GET|POST /ping``              ``/health`` by vLLM's (SageMaker's) other name
``GET /version``, ``/load``     sart's version; requests in flight (``server_load``)
``POST /tokenize``              a prompt or chat messages -> token ids, as vLLM's
``POST /detokenize``            token ids -> text (``sart.serve.tokenize``)
==============================  =========================================================

The shapes are ``vllm serve``'s (0.32) field for field (``sart.serve.responses``);
what differs by design is in docs/reference/api.md ("sart serve against vllm
serve") and tested against ``vllm serve`` in tests/test_serve_vllm_parity.py.

Each request is checked in this order, and refused at the first fault with
OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``):
the API key (401), the body size (413), JSON and field types (400), the
model (404), the policy and sampling fields against the server's limits
(400), the queue (429). Nothing a request holds can load a model, import a
module or render a template of its own: names resolve against what was
fixed at start.

``--api-key`` works as vLLM's: every ``/v1`` route needs ``Authorization:
Bearer KEY`` (401 otherwise); the others (``/health``, ``/metrics``,
``/tokenize``...) stay open, as vLLM leaves them, for load balancers and
Prometheus (bind to a private address, the default ``127.0.0.1``, if their
numbers are private).

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

**Streaming** (``stream=true``): the answer as server-sent events, once it is
known, or as it is made where a request's one branch is its answer
(``sart.serve.events``, whose docstring says why and in what order).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HTTPRequest

import sart
from sart.engines.base import BranchDelta
from sart.errors import ConfigError, EngineError
from sart.request import Request
from sart.serve import events, protocol, responses, tokenize
from sart.serve.config import Backend, ServeConfig
from sart.serve.methods import get_method, method_names
from sart.serve.protocol import Refused
from sart.serve.service import Outcome, QueueFull, Service, ServiceStopped
from sart.types import Prompt

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
        length = await _service(http).max_model_len()
        return JSONResponse(
            responses.models_body(config, app.state.created, method_names(), length)
        )

    @app.get("/health")
    async def health(http: HTTPRequest) -> Response:
        problem = await _service(http).health()
        if problem is None:
            return Response(status_code=200)
        return JSONResponse(responses.error_body(problem, 503), 503)

    # vLLM's SageMaker ping: /health by another name, GET or POST.
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": sart.__version__})

    @app.get("/load")
    async def load(http: HTTPRequest) -> JSONResponse:
        return JSONResponse({"server_load": _service(http).in_flight})

    @app.post("/tokenize")
    async def tokenize_route(http: HTTPRequest) -> JSONResponse:
        body = await _read_body(http, config.max_body_bytes)
        request = protocol.parse_model(tokenize.TokenizeRequest, body)
        _check_model(config, request.model)
        service = _service(http)
        length = await service.max_model_len()
        return JSONResponse(tokenize.tokenize(service.engine.tokenizer, request, length))

    @app.post("/detokenize")
    async def detokenize_route(http: HTTPRequest) -> JSONResponse:
        body = await _read_body(http, config.max_body_bytes)
        request = protocol.parse_model(tokenize.DetokenizeRequest, body)
        _check_model(config, request.model)
        return JSONResponse(tokenize.detokenize(_service(http).engine.tokenizer, request))

    @app.get("/metrics")
    async def metrics(http: HTTPRequest) -> Response:
        registry = _service(http).metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


# ------------------------------------------------------------------- a request


def _service(http: HTTPRequest) -> Service:
    return http.app.state.service


def _check_model(config: ServeConfig, model: str | None) -> None:
    if model is not None and model not in config.models:
        raise Refused(
            f"model={model!r} is not served here (served: {list(config.models)})", "model", 404
        )


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
    names = service.engine.token_names
    as_ids = bool(request.return_tokens_as_token_ids)
    if plan.request_kwargs["keep_logprobs"] and names is None and (chat or not as_ids):
        raise Refused(
            "logprobs need a tokenizer to name the tokens, and this server has none (a "
            "gateway needs --tokenizer DIR; or ask return_tokens_as_token_ids=true)",
            "top_logprobs" if chat else "logprobs",
        )
    prompt = _chat_prompt(service, request) if chat else protocol.completion_prompt(request)
    given = http.headers.get("x-request-id") or request.request_id or uuid.uuid4().hex
    answer_id = f"{'chatcmpl' if chat else 'cmpl'}-{given}"
    # A client that retries under its id while the first try still runs gets a
    # server-side id of its own for the second; both answers carry the client's.
    rid = answer_id if not service.is_open(answer_id) else f"{answer_id}-{uuid.uuid4().hex[:8]}"
    kwargs = plan.request_kwargs
    live = plan.stream and events.streams_live(kwargs["policy"])
    if live and not service.engine.streams_tokens and not kwargs["policy"].scores_running:
        # A step engine without watchers reports tokens at the end of each decode chunk,
        # which the request's interval bounds; its checks read no rewards: they cost nothing.
        interval = min(kwargs["policy"].interval, config.stream_interval)
        kwargs = {**kwargs, "policy": attrs.evolve(kwargs["policy"], interval=interval)}
    try:
        job = Request(rid, prompt, **kwargs)
        service.submit(job, protocol.question(request) if chat else _prompt_text(service, prompt))
    except ConfigError as exc:
        raise Refused(str(exc), protocol.field_of(str(exc))) from None
    except QueueFull as exc:
        raise Refused(str(exc), None, 429) from None
    except ServiceStopped as exc:
        raise Refused(str(exc), None, 503) from None
    echo = protocol.chat_echo(request) if chat else _completion_echo(service, request)
    k = plan.request_kwargs["sampling"].logprobs
    reply = events.Reply(
        answer_id, rid, int(time.time()), request.model, plan.method, chat, echo, k, names, as_ids
    )
    headers = {"X-Request-Id": given}
    news: asyncio.Queue[BranchDelta] | None = None
    if live:  # before any await: the driver reports nothing before this handler yields
        news = asyncio.Queue()
        service.engine.listen(rid, news.put_nowait, config.stream_interval)
    if plan.stream:
        # The stream opens once the engine has taken the prompt (or at the first
        # keep-alive tick): a prompt it refuses gets vLLM's HTTP 400, which the
        # openai client raises as BadRequestError from create(), not an error event.
        opened = await _unless_disconnected(http, _opened(service, rid, config.keepalive))
        if opened is None:  # the client left while the request waited for its prefill
            service.cancel(rid)
            return Response(status_code=499)
        ended = service.ended(rid)
        if ended is not None and not ended.result.ok:
            await service.result(rid)  # taken here: no stream will wait for it
            return _failed(ended, headers)
        return events.EventStream(
            events.events(
                service, reply, config.keepalive, plan.include_usage, plan.continuous_usage, news
            ),
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
    try:
        if reply.logprobs is None:
            answer = reply.body(outcome)
        else:  # naming 16k tokens' logprobs takes a second: not on the event loop
            answer = await asyncio.to_thread(reply.body, outcome)
    except EngineError as exc:  # logprobs the engine could not name
        return JSONResponse(responses.error_body(str(exc), 500), 500, headers=headers)
    return JSONResponse(answer, headers=headers)


async def _opened(service: Service, rid: str, keepalive: float | None) -> bool:
    """Wait until a streamed request may open its stream (``Service.started``)."""
    await service.started(rid, keepalive)
    return True


def _completion_echo(service: Service, request: protocol.CompletionRequest) -> str:
    """What ``echo`` puts before a completion's text, as vLLM: the prompt (token ids
    decoded by the engine's tokenizer)."""
    if not request.echo:
        return ""
    prompt = request.prompt
    if isinstance(prompt, str):
        return prompt
    tokenizer = service.engine.tokenizer
    if tokenizer is None:  # a gateway without --tokenizer
        raise Refused(
            "echo=true of a prompt of token ids needs a tokenizer to decode it (a gateway "
            "needs --tokenizer DIR)",
            "echo",
        )
    try:
        return str(tokenizer.decode(list(prompt), skip_special_tokens=False))
    except Exception:  # ids outside the vocabulary: the engine refuses them at prefill
        return ""


def _chat_prompt(service: Service, request: protocol.ChatCompletionRequest) -> tuple[int, ...]:
    tokenizer = service.engine.tokenizer
    if tokenizer is None:  # a gateway started without --tokenizer (nor a local --model)
        raise Refused(
            "this server has no tokenizer to render chat with (a gateway needs --tokenizer "
            "DIR or a local --model): use /v1/completions",
            "messages",
        )
    ids = tokenize.render_chat(
        tokenizer,
        request.messages,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        chat_template_kwargs=request.chat_template_kwargs,
        add_special_tokens=request.add_special_tokens,
    )
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
    message, status, param = events.failure(outcome)
    body = responses.error_body(message, status, param)
    return JSONResponse(body, status_code=status, headers=headers)
