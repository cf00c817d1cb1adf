"""A streamed answer (``stream=true``) as server-sent events, in OpenAI's chunks.

Which branch answers a request of several branches is known only when the
request finishes: the selector picks among the completed branches by PRM
reward or vote, and any running branch may still be pruned or stopped.
Streaming a branch's tokens as they come would show text that is then
withdrawn, which OpenAI's protocol cannot express. So such a stream carries
the answer in one chunk, once it is chosen. A request whose one branch is its
answer (one branch that never forks: ``vanilla``, ``streams_live``) is
streamed as it is made instead, as ``vllm serve`` streams it:

1. The stream opens once the engine has taken the prompt (or at the first
   keep-alive tick, if that comes first; ``app``'s handler waits for it): a
   prompt the engine refuses is answered with its HTTP status, as ``vllm
   serve`` answers it, and the ``openai`` client raises from ``create()``.
2. For chat, a first chunk carrying the assistant role.
3. A one-branch request: a chunk with each piece of its text as the engine
   reports it (the first token at once, then every ``--stream-interval``
   tokens, as vLLM's: a streaming engine's step returns early for it, a step
   engine with ``watchers`` hands over each decode step's tokens; on a step
   engine without, every decode chunk: ``app`` shortens such a request's
   chunks to the interval), with those tokens' ``logprobs`` if asked.
4. While the request is undecided, an SSE comment (``: keep-alive``) every
   ``keepalive`` seconds without an event, if set: proxies and load balancers
   then see a live connection. The default is none, as vLLM's server sends
   none: the ``openai`` client ignores comments, but vLLM's ``vllm bench
   serve`` client (0.32) strips each read it gets, so a comment that arrives
   alone loses its terminator and swallows the events after it.
5. The chosen answer in one chunk (a one-branch request: what it had not sent
   yet, if anything), a last chunk with ``finish_reason``, ``stop_reason`` and
   the ``sart`` field, the usage chunk if ``stream_options.include_usage``
   (with ``continuous_usage_stats``, every chunk carries ``usage``), and
   ``[DONE]``.

An error after the stream opened is sent as an ``{"error": ...}`` event, which
the ``openai`` client raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import attrs
from fastapi.responses import StreamingResponse

from sart.engines.base import BranchDelta, TokenLogprobs
from sart.errors import EngineError
from sart.policies.base import Policy
from sart.serve import responses
from sart.serve.logprobs import TokenNames, chat_logprobs, completion_logprobs, has_ids
from sart.serve.service import Outcome, Service
from sart.types import RequestStatus

_log = logging.getLogger("sart.serve")


def failure(outcome: Outcome) -> tuple[str, int, str | None]:
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
class Reply:
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
    echo: str = ""
    """What ``echo`` puts before the answer (``""``: nothing)."""
    logprobs: int | None = None
    """The most likely tokens to name with each token of the answer (``None``: no
    ``logprobs``)."""
    names: TokenNames | None = None
    """The engine's tokens' texts (with ``logprobs``)."""
    as_ids: bool = False
    """``logprobs`` name tokens ``token_id:N`` (``return_tokens_as_token_ids``)."""

    def body(self, outcome: Outcome) -> dict[str, Any]:
        return responses.completion_body(
            self.id,
            self.created,
            self.model,
            self.method,
            outcome,
            chat=self.chat,
            echo=self.echo,
            logprobs=self.choice_logprobs(outcome),
        )

    def choice_logprobs(self, outcome: Outcome, sent: Sent | None = None) -> dict[str, Any] | None:
        """The answer's ``logprobs`` object (``None`` where the request asked none);
        ``sent``: what a live stream sent already, whose tokens are then left out."""
        tokens = outcome.result.logprobs
        if self.logprobs is None or tokens is None:
            return None
        result = outcome.result
        made = result.branches[result.chosen].num_tokens if result.chosen is not None else 0
        if len(tokens) != made:  # an engine that ignores SamplingSettings.logprobs
            raise EngineError(
                f"the engine returned log-probabilities for {len(tokens)} of the answer's "
                f"{made} tokens"
            )
        sent = sent or Sent()
        return self.piece_logprobs(tokens[sent.tokens :], sent)

    def piece_logprobs(self, tokens: Sequence[TokenLogprobs], sent: Sent) -> dict[str, Any]:
        """The ``logprobs`` of ``tokens``, the answer's after what ``sent`` has sent."""
        if not has_ids(tokens):
            raise EngineError("the engine returned log-probabilities without token ids")
        if self.chat:
            assert self.names is not None  # a chat server has a tokenizer
            return chat_logprobs(self.names, tokens, self.logprobs or 0, self.as_ids, sent.ids)
        return completion_logprobs(
            self.names, tokens, self.logprobs or 0, sent.offset, self.as_ids, sent.ids
        )

    def chunk(self, **fields: Any) -> bytes:
        return sse(responses.chunk(self.id, self.created, self.model, chat=self.chat, **fields))


@attrs.define
class Sent:
    """What a live stream (``streams_live``) has sent of its answer so far."""

    pieces: list[str] = attrs.Factory(list)
    """The answer's text sent, piece by piece (not what ``echo`` put before it)."""
    chars: int = 0
    tokens: int = 0
    opened: bool = False
    """Whether a chunk of the answer went out (the first carries ``echo``)."""
    ids: list[int] = attrs.Factory(list)
    """The sent tokens' ids, where ``logprobs`` were asked (they name what follows)."""
    offset: int = 0
    """Where the next token's text starts (a completion's ``text_offset``)."""

    def add(
        self, text: str, count: int, tokens: Sequence[TokenLogprobs], named: dict[str, Any] | None
    ) -> None:
        """Count a piece sent: its text, its number of tokens, their log-probabilities
        and the ``logprobs`` object that named them (``None``: none asked)."""
        self.pieces.append(text)
        self.chars += len(text)
        self.tokens += count
        if named is None:
            return
        self.ids.extend(t.token_id for t in tokens if t.token_id is not None)
        offsets = named.get("text_offset")
        if offsets:
            self.offset = offsets[-1] + len(named["tokens"][-1])


def streams_live(policy: Policy) -> bool:
    """Whether a request's tokens can be streamed as they are made: its one branch is
    its answer (one branch, never forked; it cannot be pruned, as a request keeps one
    branch at least)."""
    return policy.n == 1 and not policy.forks


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


async def events(
    service: Service,
    reply: Reply,
    keepalive: float | None,
    include_usage: bool,
    continuous_usage: bool = False,
    live: asyncio.Queue[BranchDelta] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE events of a streamed request (see the module docstring); ``live``: the
    engine's news of a request whose one branch is its answer (``streams_live``), sent
    as it comes."""
    job = asyncio.ensure_future(service.result(reply.key))
    news: asyncio.Future[BranchDelta] | None = None
    sent = Sent()
    prompt = 0
    try:
        if reply.chat or continuous_usage:
            # Prefilled by now (or ended, its outcome says).
            ended = service.ended(reply.key)
            took = service.engine.prompt_tokens
            prompt = ended.prompt_tokens if ended else took.get(reply.key, 0)
        if reply.chat:
            running = responses.running_usage(prompt, 0) if continuous_usage else None
            yield reply.chunk(role=True, text="", extra=running)
        while True:
            if live is not None and news is None:
                news = asyncio.ensure_future(live.get())
            waits: set[asyncio.Future[Any]] = {job} if news is None else {job, news}
            done, _ = await asyncio.wait(
                waits, timeout=keepalive, return_when=asyncio.FIRST_COMPLETED
            )
            deltas = []
            if news is not None and news in done:
                deltas.append(news.result())
                news = None
            if live is not None and job in done:  # each piece reported, in a chunk of its own
                while not live.empty():
                    deltas.append(live.get_nowait())
            for delta in deltas:
                try:
                    piece = _piece(reply, delta, sent, prompt if continuous_usage else None)
                except EngineError as exc:  # logprobs the engine could not name
                    yield sse(responses.error_body(str(exc), 500))
                    yield DONE
                    return
                if piece is not None:
                    yield piece
            if job in done:
                break
            if not done:
                yield KEEPALIVE
        try:
            outcome = job.result()
        except Exception as exc:
            yield sse(responses.error_body(f"internal error: {type(exc).__name__}: {exc}", 500))
            yield DONE
            return
        if not outcome.result.ok:
            yield sse(responses.error_body(*failure(outcome)))
            yield DONE
            return
        usage = {"usage": responses.usage(outcome)} if continuous_usage else {}
        answer = outcome.result.text or ""
        if answer[: sent.chars] != "".join(sent.pieces):  # the engine's news is the answer
            _log.error("%s: the streamed text is not the answer's start", reply.key)
        rest = ("" if sent.opened else reply.echo) + answer[sent.chars :]
        try:
            logprobs = None
            if reply.logprobs is not None:  # a second for 16k tokens: not on the event loop
                logprobs = await asyncio.to_thread(reply.choice_logprobs, outcome, sent)
        except EngineError as exc:
            yield sse(responses.error_body(str(exc), 500))
            yield DONE
            return
        if rest or not sent.opened or (logprobs is not None and _named_any(logprobs)):
            yield reply.chunk(text=rest, extra=usage or None, logprobs=logprobs)
        sart_field = {"sart": responses.extension(reply.method, outcome), **usage}
        yield reply.chunk(
            finish=responses.finish_reason(outcome),
            stop=responses.stop_reason(outcome),
            extra=sart_field,
        )
        if include_usage:
            yield sse(
                responses.usage_chunk(
                    reply.id, reply.created, reply.model, outcome, chat=reply.chat
                )
            )
        yield DONE
    finally:
        for pending in (job, news):
            if pending is not None and not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending


def _piece(reply: Reply, delta: BranchDelta, sent: Sent, prompt: int | None) -> bytes | None:
    """The chunk of a live stream's news (``None``: nothing to send: no text, and no
    ``logprobs`` asked); counts it in ``sent``. ``prompt``: the prompt's tokens, where
    every chunk carries ``usage``."""
    named = None
    if reply.logprobs is not None and delta.logprobs:
        named = reply.piece_logprobs(delta.logprobs, sent)
    sent.add(delta.text, delta.new_tokens, delta.logprobs, named)
    text = ("" if sent.opened else reply.echo) + delta.text
    if not text and named is None:
        return None
    sent.opened = True
    usage = None if prompt is None else responses.running_usage(prompt, sent.tokens)
    return reply.chunk(text=text, extra=usage, logprobs=named)


def _named_any(logprobs: dict[str, Any]) -> bool:
    """Whether a ``logprobs`` object names any token."""
    return bool(logprobs.get("content") or logprobs.get("tokens"))


class EventStream(StreamingResponse):
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
