"""Which upstream server a gateway's request and each of its branches stream from.

``OpenAIEngine`` keeps one ``Server`` per upstream (``sart.engines.openai_wire``:
its open requests and live branches). ``Upstreams`` chooses among them: a new
request's home (the fewest open requests, then the fewest live branches), a
branch's next attempt (its request's home with affinity, else the least-loaded
server not yet tried), ties in round-robin order; a request whose home failed
moves, with its count, to the server picked instead, so that its later branches
follow the prompt that server now caches. Pure bookkeeping: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from sart.engines.openai_wire import Server


class Homed(Protocol):
    """A request as ``Upstreams`` sees it: the server it calls home (``None``: none)."""

    home: int | None


class Upstreams:
    """The servers, and the choice of one for a request or a branch (module docstring)."""

    def __init__(self, servers: Sequence[Server]) -> None:
        self.servers = list(servers)
        self._next = 0  # round-robin start among equally loaded servers

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
        candidates = [i for i in order if i not in exclude] or order
        best = min(candidates, key=lambda i: load(self.servers[i]))  # first minimum wins
        self._next = (best + 1) % n
        return best


__all__ = ["Homed", "Upstreams"]
