"""Which upstream server a gateway's request and each of its branches stream from.

``OpenAIEngine`` keeps one ``Server`` per upstream (``sart.engines.openai_wire``:
its open requests and live branches). ``Upstreams`` chooses among them: a new
request's home (the fewest open requests, then the fewest live branches), a
branch's next attempt (its request's home with affinity, else the least-loaded
server not yet tried), ties in round-robin order; a request whose home failed
moves, with its count, to the server picked instead, so that its later branches
follow the prompt that server now caches. Pure bookkeeping: no I/O.

With several servers (``OpenAIEngine``'s ``base_urls``, one model) and ``affinity``
(the default) every branch of a request, and its forks, stream from one
server: the one with the fewest open requests of this engine when the request
is prefilled (then the fewest live branches, ties in round-robin order), so
the prompt is prefilled once and its KV shared by the branches through that
server's prefix cache. With ``affinity=False`` each branch goes to the server
with the fewest live branches (the prompt is then prefilled on every server
that gets a branch of it). A transport error (connection refused or reset,
timeout) or an answer that says this server cannot take it now (502, 503, 504:
down or busy; 408, 429: timed out or rate-limited; 401, 403, 404: it refuses
the gateway's key or no longer serves the model, as the others were checked to
at start) before the branch streamed any token is retried on another server
(``max_retries`` times in all); the request's later branches then follow it
there. A branch that has already streamed tokens is
never retried: its request fails (``EngineError``), the other requests go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from sart.engines.openai_wire import Server


class Homed(Protocol):
    """A request as ``Upstreams`` sees it: the server it calls home (``None``: none)."""

    home: int | None


@attrs.define
class UpstreamRequest:
    """A request as ``OpenAIEngine`` keeps it: its prompt's ids, its ``max_tokens``, and
    the server it calls home."""

    ids: list[int] | None
    """The prompt's token ids, if known (the server's own, once a stream reports them)."""
    max_tokens: int
    home: int | None = None
    """The server every branch of the request streams from (with affinity)."""


class Upstreams:
    """The servers, and the choice of one for a request or a branch (module docstring)."""

    def __init__(
        self,
        servers: Sequence[Server],
        *,
        cooldown: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.servers = list(servers)
        self.cooldown = cooldown
        """Seconds a server that failed an attempt is passed over (``failed``)."""
        self.clock = clock
        self._next = 0  # round-robin start among equally loaded servers

    def failed(self, index: int) -> None:
        """Server ``index`` failed an attempt (or a health probe): pass it over for
        ``cooldown`` seconds while another is left."""
        self.servers[index].down_until = self.clock() + self.cooldown

    def answered(self, index: int) -> None:
        """Server ``index`` answered: it is chosen again as any other."""
        self.servers[index].down_until = 0.0

    def down(self, index: int) -> bool:
        """Whether server ``index`` is passed over now (it failed within ``cooldown``)."""
        return self.servers[index].down_until > self.clock()

    def home(self) -> int:
        """A new request's server, counted as one more open request there. (Its
        branches start only after the prefill, so live branches alone would send
        every request prefilled in one scheduler step to the same server.)"""
        home = self._least(set(), lambda s: (s.requests, s.live))
        self.servers[home].requests += 1
        return home

    def leave(self, request: Homed) -> None:
        """The request ended: its home has one open request fewer."""
        if request.home is not None:
            self.servers[request.home].requests -= 1

    def pick(self, exclude: set[int], request: Homed | None = None) -> int:
        """The server for a branch's next attempt: its request's home (with affinity),
        else the least-loaded server not in ``exclude`` (all of them if none is left)."""
        if request is not None and request.home is not None:
            if request.home not in exclude:
                return request.home
            moved = self._least(exclude, lambda s: (s.live,))
            self.servers[request.home].requests -= 1
            self.servers[moved].requests += 1
            request.home = moved
            return moved
        return self._least(exclude, lambda s: (s.live,))

    def _least(self, exclude: set[int], load: Callable[[Server], Any]) -> int:
        n = len(self.servers)
        order = [(self._next + i) % n for i in range(n)]
        untried = [i for i in order if i not in exclude] or order
        # A server that failed lately only if every other did too: it may be back.
        candidates = [i for i in untried if not self.down(i)] or untried
        best = min(candidates, key=lambda i: load(self.servers[i]))  # first minimum wins
        self._next = (best + 1) % n
        return best


__all__ = ["Homed", "Upstreams"]
