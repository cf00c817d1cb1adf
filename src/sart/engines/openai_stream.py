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
  prompt ids, finish reason, cumulative usage), ``Usage`` (the final chunk
  without choices), ``Done`` (``[DONE]``) or ``StreamError`` (an error object,
  or data that is not a JSON object). ``StreamParser`` drops what follows
  ``[DONE]``.
- ``Tally``: token accounting. A delta's tokens are its ``token_ids`` if the
  server sends them (vLLM's ``return_token_ids``), else the growth of the
  cumulative ``completion_tokens`` (``continuous_usage_stats``), else one per
  chunk with text; the final usage chunk tops up the last chunk's count.

What a failed stream means for the request (retry, downgrade, fail) is the
engine's decision, not this module's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import attrs

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
    completion_tokens: int | None = None
    """The cumulative ``usage.completion_tokens`` (``continuous_usage_stats``), if sent."""


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
        return StreamError(f"reported an error: {data[:500]}")
    usage = event.get("usage") or {}
    total = usage.get("completion_tokens") if isinstance(usage, dict) else None
    total = total if isinstance(total, int) else None
    choices = event.get("choices") or []
    if not choices:
        return Usage(total)
    choice: dict[str, Any] = choices[0]
    ids = choice.get("token_ids")
    prompt_ids = choice.get("prompt_token_ids")
    return Delta(
        text=choice.get("text") or "",
        token_ids=None if ids is None else tuple(ids),
        prompt_token_ids=tuple(prompt_ids) if prompt_ids else None,
        finish_reason=choice.get("finish_reason"),
        completion_tokens=total,
    )


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

    def chunk(self, delta: Delta) -> Chunk:
        """The delta as a ``Chunk`` (its finish reason left to the caller), counted."""
        if delta.token_ids is not None:
            self.counted += len(delta.token_ids)
            return Chunk(token_ids=delta.token_ids, text=delta.text)
        if delta.completion_tokens is not None:
            n = max(0, delta.completion_tokens - self.counted)
        else:
            n = 1 if delta.text else 0
        self.counted += n
        return Chunk(text=delta.text, count=n)

    def top_up(self, last: Chunk, usage: Usage) -> Chunk:
        """``last`` with the tokens the final usage reports beyond those counted (they
        had no text, e.g. EOS); its ids are then dropped, as the count no longer matches."""
        total = usage.completion_tokens
        if total is None or total <= self.counted:
            return last
        last = attrs.evolve(last, count=last.tokens + total - self.counted, token_ids=())
        self.counted = total
        return last
