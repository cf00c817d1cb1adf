"""The ``/v1/completions`` stream of an OpenAI-compatible server, parsed without I/O.

``OpenAIEngine`` feeds the bytes it receives to a ``StreamParser`` and gets
events back; ``parse_stream`` does the same for a whole stream at once (for
tests). Three layers, each a small pure piece:

- ``SSEDecoder``: bytes -> the ``data`` of each server-sent event. Lines end
  at CR, LF or CRLF only; an event's ``data:`` lines are joined with LF and
  it ends at a blank line; comments (``: keep-alive``) and other fields are
  skipped. An event left unterminated when the stream ends is still given
  (servers may close right after ``data: [DONE]``).
- ``parse_event``: one event's data -> ``Delta`` (a choice: text, token ids,
  prompt ids, finish reason, cumulative usage, log-probabilities), ``Usage``
  (the final chunk without choices), ``Done`` (``[DONE]``) or ``StreamError``
  (an error object, data that is not a JSON object, or malformed
  log-probabilities). ``StreamParser`` drops what follows ``[DONE]``.
- ``Tally``: token accounting. A delta's tokens are its ``token_ids`` if the
  server sends them (vLLM's ``return_token_ids``), else its log-probabilities
  when asked for (one per token), else the growth of the cumulative
  ``completion_tokens`` (``continuous_usage_stats``), else one per chunk with
  text; the final usage chunk tops up the last chunk's count.

Log-probabilities (the request's ``logprobs: k``). A chunk's choice carries
``logprobs`` in the completions API's legacy shape: ``token_logprobs`` (the
sampled token's, one per new token) and ``top_logprobs`` (per token an object
mapping a token to its log-probability). vLLM 0.32's object holds the sampled
token's entry first, then the ``k`` most likely (``k + 1`` entries, or ``k``
when the sampled token is among them; only the sampled one's for ``k = 0``);
SGLang 0.5.23's holds the ``k`` most likely only. ``parse_event`` keeps each
token's sampled value and, highest first, the object's values with the
sampled one among them (added if its entry is missing); ``Tally`` cuts them
to the ``k`` highest (``TokenLogprobs``), so the sampled token's entry drops
out unless it is among the ``k`` most likely. The object's keys are token
*texts* unless the server renders tokens as ids (vLLM's
``return_tokens_as_token_ids``: ``"token_id:42"``, which ``OpenAIEngine``
asks for): exact then. With texts, two tokens of one position that decode to
the same text (common for byte and special tokens) share a key and the
server keeps one value. The sampled token's is never lost (it comes in
``token_logprobs`` too, so ``top[0] >= logprob`` holds), but another token's
can be: ``top`` then holds fewer than ``k`` values (SGLang), or a lower-ranked
token's value in the lost one's place (vLLM, whose object has one entry
more). A chunk whose
log-probabilities do not match its tokens (one each) is an error
(``LogprobsError``): a branch's logprobs are one per token or none.

What a failed stream means for the request (retry, downgrade, fail) is the
engine's decision, not this module's.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable
from typing import Any

import attrs

from sart.engines.base import TokenLogprobs
from sart.engines.streaming import Chunk

_LINE_END = re.compile(rb"\r\n|\r|\n")


@attrs.frozen
class Delta:
    """A chunk with a choice (the first; sart asks for ``n: 1``)."""

    text: str = ""
    token_ids: tuple[int, ...] | None = None
    """The chunk's new token ids (vLLM's ``return_token_ids``), if sent."""
    prompt_token_ids: tuple[int, ...] | None = None
    """The prompt's ids as the server tokenized them (vLLM sends them in the first chunk)."""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    """vLLM's ``stop_reason`` on the last chunk: the stop string or token id that ended
    it (``None``: EOS, or a server that does not send one)."""
    completion_tokens: int | None = None
    """The cumulative ``usage.completion_tokens`` (``continuous_usage_stats``), if sent."""
    logprobs: tuple[TokenLogprobs, ...] | None = None
    """Per new token: the sampled token's log-probability and every value of its
    ``top_logprobs`` object, highest first (``Tally`` keeps the ``k`` highest); ``None``
    if the chunk has no ``logprobs``."""


class LogprobsError(ValueError):
    """A chunk's log-probabilities do not match its tokens (see the module docstring)."""


@attrs.frozen
class Usage:
    """A chunk without choices: the final usage chunk (``include_usage``)."""

    completion_tokens: int | None = None


@attrs.frozen
class Done:
    """``data: [DONE]``: the stream's end."""


@attrs.frozen
class StreamError:
    """The server reported an error in the stream, or sent data that is not a JSON object."""

    message: str
    code: int | None = None
    """The HTTP status the error event carries (vLLM's ``code``: 400 when it validates
    the request's sampling fields after its 200), if any."""


Event = Delta | Usage | Done | StreamError


@attrs.define
class SSEDecoder:
    """Server-sent events, incrementally: ``feed`` bytes as they arrive, ``end`` at EOF.

    Not ``httpx``'s ``aiter_lines``: like ``str.splitlines`` it also splits at
    U+2028, U+0085 and other Unicode line boundaries, which a model can
    generate and a server's JSON carries unescaped inside a string (seen with
    vLLM: the event was cut in two and failed to parse). JSON escapes CR and
    LF inside strings, so these three never split an event. Data that is
    not UTF-8 raises ``UnicodeDecodeError``.
    """

    _pending: bytes = b""
    _data: list[str] | None = None
    """The ``data`` lines of the event being read (``None``: none yet)."""

    def feed(self, chunk: bytes) -> list[str]:
        """The data of the events that ``chunk`` completes."""
        buffer = self._pending + chunk
        # A CR at the end may be the first half of a CRLF: wait for the next byte.
        cut = len(buffer) - 1 if buffer.endswith(b"\r") else len(buffer)
        *lines, rest = _LINE_END.split(buffer[:cut])
        self._pending = rest + buffer[cut:]
        return self._lines(lines)

    def end(self) -> list[str]:
        """The data of an event the stream left unterminated, if any."""
        *lines, rest = _LINE_END.split(self._pending)
        self._pending = b""
        return self._lines([*lines, rest, b""])

    def _lines(self, lines: list[bytes]) -> list[str]:
        return [data for line in lines if (data := self._line(line)) is not None]

    def _line(self, line: bytes) -> str | None:
        """Take one line; the event's data if the line ends one."""
        if not line:  # a blank line dispatches the event
            data, self._data = self._data, None
            return None if data is None else "\n".join(data).strip()
        if line == b"data" or line.startswith(b"data:"):
            value = line[5:].decode("utf-8")
            if self._data is None:
                self._data = []
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None  # a comment (":..."), another field, or more data


def parse_event(data: str) -> Event:
    """One event's data as an ``Event`` (see the module docstring)."""
    if data == "[DONE]":
        return Done()
    try:
        event = json.loads(data)
    except ValueError:
        return StreamError(f"sent invalid JSON: {data[:500]!r}")
    if not isinstance(event, dict):
        return StreamError(f"sent an event that is not a JSON object: {data[:500]!r}")
    if "error" in event or event.get("object") == "error":
        error = event.get("error")
        code = (error if isinstance(error, dict) else event).get("code")
        return StreamError(
            f"reported an error: {data[:500]}",
            code if isinstance(code, int) and not isinstance(code, bool) else None,
        )
    usage = event.get("usage") or {}
    total = usage.get("completion_tokens") if isinstance(usage, dict) else None
    total = total if isinstance(total, int) else None
    choices = event.get("choices") or []
    if not choices:
        return Usage(total)
    choice: dict[str, Any] = choices[0]
    ids = choice.get("token_ids")
    prompt_ids = choice.get("prompt_token_ids")
    try:
        logprobs = _choice_logprobs(choice.get("logprobs"))
    except (TypeError, ValueError, LookupError, AttributeError):
        return StreamError(f"sent malformed logprobs: {data[:500]!r}")
    return Delta(
        text=choice.get("text") or "",
        token_ids=None if ids is None else tuple(ids),
        prompt_token_ids=tuple(prompt_ids) if prompt_ids else None,
        finish_reason=choice.get("finish_reason"),
        stop_reason=_stop_reason(choice.get("stop_reason")),
        completion_tokens=total,
        logprobs=logprobs,
    )


def _stop_reason(raw: Any) -> str | int | None:
    """A choice's ``stop_reason`` if it is one vLLM sends (a string or a token id)."""
    if isinstance(raw, str) or (isinstance(raw, int) and not isinstance(raw, bool)):
        return raw
    return None


def _choice_logprobs(raw: Any) -> tuple[TokenLogprobs, ...] | None:
    """A choice's ``logprobs`` object as ``TokenLogprobs`` (every top value, highest
    first), ``None`` without one; raises ``TypeError``/``ValueError`` if it is not the
    completions shape (a null ``token_logprobs`` entry, a prompt token's, included);
    ``parse_event`` turns those into a ``StreamError``."""
    if raw is None:
        return None
    sampled = raw["token_logprobs"] or []
    tops = raw.get("top_logprobs") or []
    tokens = raw.get("tokens") or []
    out = []
    for i, value in enumerate(sampled):
        top = tops[i] if i < len(tops) else None
        own = float(value)
        own_id = _token_id(tokens[i]) if i < len(tokens) else None
        ranked = [(float(v), _token_id(key)) for key, v in (top or {}).items()]
        if own not in (v for v, _ in ranked):  # lost to a token of the same text, or not sent
            ranked.append((own, own_id))
        ranked.sort(key=lambda item: -item[0])
        ids = tuple(t for _, t in ranked if t is not None)
        out.append(
            TokenLogprobs(
                own,
                tuple(v for v, _ in ranked),
                own_id,
                ids if len(ids) == len(ranked) else (),  # ids of all, or of none
            )
        )
    return tuple(out)


def _token_id(token: Any) -> int | None:
    """The id in a token vLLM writes as ``token_id:N`` (``return_tokens_as_token_ids``);
    ``None`` for a token's text."""
    if isinstance(token, str) and token.startswith("token_id:"):
        with contextlib.suppress(ValueError):
            return int(token.removeprefix("token_id:"))
    return None


@attrs.define
class StreamParser:
    """A completions stream, incrementally: ``feed`` bytes, get ``Event``s; nothing
    after ``Done`` (the rest of the body is still read, and ignored)."""

    _sse: SSEDecoder = attrs.Factory(SSEDecoder)
    done: bool = False
    """``[DONE]`` was seen."""

    def feed(self, chunk: bytes) -> list[Event]:
        return self._parse(self._sse.feed(chunk))

    def end(self) -> list[Event]:
        return self._parse(self._sse.end())

    def _parse(self, payloads: list[str]) -> list[Event]:
        events = []
        for data in payloads:
            if self.done:
                break
            event = parse_event(data)
            self.done = isinstance(event, Done)
            events.append(event)
        return events


def parse_stream(chunks: Iterable[bytes]) -> list[Event]:
    """The events of a whole stream, however its bytes are cut into ``chunks``."""
    parser = StreamParser()
    events = [event for chunk in chunks for event in parser.feed(chunk)]
    return events + parser.end()


@attrs.define
class Tally:
    """Counts one stream's tokens (see the module docstring)."""

    counted: int = 0
    """Tokens counted so far."""
    top_k: int | None = None
    """The request's ``logprobs`` (``None``: it asked for none, and any the server
    sends are ignored)."""

    def chunk(self, delta: Delta) -> Chunk:
        """The delta as a ``Chunk`` (its finish reason left to the caller), counted.
        Raises ``LogprobsError`` if the request asked for log-probabilities and the
        delta's do not come one per token."""
        logprobs = self._logprobs(delta)
        if delta.token_ids is not None:
            self._check(len(delta.token_ids), logprobs)
            self.counted += len(delta.token_ids)
            return Chunk(token_ids=delta.token_ids, text=delta.text, logprobs=logprobs)
        if self.top_k is not None:
            n = len(logprobs)  # one per token: exact, where text and usage may lag
        elif delta.completion_tokens is not None:
            n = max(0, delta.completion_tokens - self.counted)
        else:
            n = 1 if delta.text else 0
        self.counted += n
        return Chunk(text=delta.text, count=n, logprobs=logprobs)

    def top_up(self, last: Chunk, usage: Usage) -> Chunk:
        """``last`` with the tokens the final usage reports beyond those counted (they
        had no text, e.g. EOS); its ids are then dropped, as the count no longer matches.
        With log-probabilities every token came with its own, so the usage may not
        report more (``LogprobsError``)."""
        total = usage.completion_tokens
        if total is None or total <= self.counted:
            return last
        if self.top_k is not None:
            raise LogprobsError(
                f"the final usage reports {total} tokens, but {self.counted} came with "
                "log-probabilities"
            )
        last = attrs.evolve(last, count=last.tokens + total - self.counted, token_ids=())
        self.counted = total
        return last

    def _logprobs(self, delta: Delta) -> tuple[TokenLogprobs, ...]:
        """The delta's log-probabilities cut to the ``top_k`` highest (none if not asked)."""
        if self.top_k is None:
            return ()
        k = self.top_k
        return tuple(lp.cut(k) for lp in delta.logprobs or ())

    def _check(self, tokens: int, logprobs: tuple[TokenLogprobs, ...]) -> None:
        if self.top_k is not None and len(logprobs) != tokens:
            raise LogprobsError(f"a chunk of {tokens} tokens came with {len(logprobs)} logprobs")
